"""vLLM general plugin: ``HSCACHE=1 vllm serve ...`` switches vLLM to hscache.

Registered as the ``vllm.general_plugins`` entry point ``hscache`` (pyproject.toml).
vLLM calls :func:`register` in every engine process before it builds the scheduler.
With ``HSCACHE=1`` it rebinds, in vLLM's scheduler module, the names of the managers the
Scheduler builds (:func:`scheduler_bindings`), so both the synchronous and the async
scheduler use hscache's, and installs hscache's request block hasher (which ``EngineCore``
builds after the scheduler); without it the plugin does nothing.
``--scheduler-cls hscache.vllm.Scheduler`` uses the same bindings, for its constructor
only.
"""

from __future__ import annotations

import os
from typing import Any


def enabled() -> bool:
    """Whether ``HSCACHE`` asks for hscache (``1``, ``true``, ``yes``)."""
    return os.environ.get("HSCACHE", "0").lower() in ("1", "true", "yes", "on")


def scheduler_bindings() -> dict[str, Any]:
    """Names in ``vllm.v1.core.sched.scheduler`` that hscache replaces, and by what.

    ``EncoderCacheManager`` is the default multimodal encoder-cache manager (vLLM still
    picks its own ``EncoderDecoderCacheManager`` for encoder-decoder models, and an
    explicit ``--ec-manager-config`` wins).
    """
    from hscache.vllm.encoder_cache_manager import EncoderCacheManager
    from hscache.vllm.kv_cache_manager import KVCacheManager

    return {"KVCacheManager": KVCacheManager, "EncoderCacheManager": EncoderCacheManager}


def register() -> None:
    """The plugin entry point; idempotent (vLLM may load plugins several times)."""
    if not enabled():
        return
    import vllm.v1.core.sched.scheduler as scheduler_module

    from hscache.vllm.block_hasher import install_block_hasher

    for name, obj in scheduler_bindings().items():
        setattr(scheduler_module, name, obj)
    install_block_hasher()
