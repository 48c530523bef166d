"""vLLM general plugin: ``HSCACHE=1 vllm serve ...`` switches vLLM to hscache.

Registered as the ``vllm.general_plugins`` entry point ``hscache`` (pyproject.toml).
vLLM calls :func:`register` in every engine process before it builds the scheduler.
With ``HSCACHE=1`` it rebinds the ``KVCacheManager`` name in vLLM's scheduler module, so
both the synchronous and the async scheduler build hscache's manager; without it the
plugin does nothing. ``--scheduler-cls hscache.vllm.Scheduler`` keeps working either way.
"""

from __future__ import annotations

import os


def enabled() -> bool:
    """Whether ``HSCACHE`` asks for hscache (``1``, ``true``, ``yes``)."""
    return os.environ.get("HSCACHE", "0").lower() in ("1", "true", "yes", "on")


def register() -> None:
    """The plugin entry point; idempotent (vLLM may load plugins several times)."""
    if not enabled():
        return
    import vllm.v1.core.sched.scheduler as scheduler_module

    from hscache.vllm.kv_cache_manager import KVCacheManager

    setattr(scheduler_module, "KVCacheManager", KVCacheManager)  # noqa: B010
