"""vLLM general plugin: ``HSCACHE=1 vllm serve ...`` switches vLLM to hscache.

Registered as the ``vllm.general_plugins`` entry point ``hscache`` (pyproject.toml).
vLLM calls :func:`register` in every engine process before it builds the scheduler.
With ``HSCACHE=1`` it rebinds, in vLLM's scheduler module, the names of the managers the
Scheduler builds and of its KV-event publisher factory (:func:`scheduler_bindings`), so
both the synchronous and the async scheduler use hscache's, and installs hscache's
request block hasher (which ``EngineCore`` builds after the scheduler); without it the
plugin does nothing.
``--scheduler-cls hscache.vllm.Scheduler`` uses the same bindings, for its constructor
only.

vLLM imports this module in every process of every vLLM installation hscache is
installed beside, so it imports nothing of hscache's vLLM glue until ``HSCACHE=1`` asks
for it. With a vLLM that hscache does not support (``hscache.vllm.version``) it logs one
line and does nothing: never a traceback.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)
_said_unsupported = False
_said_switched = False


def enabled() -> bool:
    """Whether ``HSCACHE`` asks for hscache (``1``, ``true``, ``yes``)."""
    return os.environ.get("HSCACHE", "0").lower() in ("1", "true", "yes", "on")


def use_vllm_log_handler() -> None:
    """Show hscache's log lines (fallback reasons, parity mode) in vLLM's log.

    vLLM configures only its own ``vllm`` logger (no propagation), so lines of the
    ``hscache`` logger would otherwise reach no handler in a vLLM process. Gives that
    logger vLLM's handlers and level, once (it still propagates, so a process that
    captures the root logger, as pytest does, sees its records); a process that gave
    the ``hscache`` logger handlers itself keeps them.
    """
    ours = logging.getLogger("hscache")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    if not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)


def scheduler_bindings() -> dict[str, Any]:
    """Names in ``vllm.v1.core.sched.scheduler`` that hscache replaces, and by what.

    ``EncoderCacheManager`` is the default multimodal encoder-cache manager (vLLM still
    picks its own ``EncoderDecoderCacheManager`` for encoder-decoder models, and an
    explicit ``--ec-manager-config`` wins). ``EventPublisherFactory`` hands out vLLM's
    publishers, its ZMQ one wrapped so that publishing never blocks the step
    (``hscache.vllm.publisher``).
    """
    from hscache.vllm.encoder_cache_manager import EncoderCacheManager
    from hscache.vllm.kv_cache_manager import KVCacheManager
    from hscache.vllm.publisher import NonBlockingEventPublisherFactory

    return {
        "KVCacheManager": KVCacheManager,
        "EncoderCacheManager": EncoderCacheManager,
        "EventPublisherFactory": NonBlockingEventPublisherFactory,
    }


def register() -> None:
    """The plugin entry point; idempotent (vLLM may load plugins several times)."""
    global _said_unsupported, _said_switched
    if not enabled():
        return
    from hscache.vllm import version

    use_vllm_log_handler()
    if version.profile() is None:
        if not _said_unsupported:
            _said_unsupported = True
            logger.warning(
                "hscache: HSCACHE=1 ignored, vLLM keeps its own managers: %s",
                version.unsupported_message(version.installed_version()),
            )
        return
    import vllm.v1.core.sched.scheduler as scheduler_module

    from hscache.vllm.block_hasher import install_block_hasher

    for name, obj in scheduler_bindings().items():
        setattr(scheduler_module, name, obj)
    install_block_hasher()
    if not _said_switched:
        _said_switched = True
        logger.info(
            "hscache: HSCACHE=1: vLLM %s's schedulers build hscache's KV-cache and "
            "encoder-cache managers, block hasher and non-blocking KV-event publisher",
            version.installed_version(),
        )
