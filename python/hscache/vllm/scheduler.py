"""vLLM ``Scheduler`` / ``AsyncScheduler`` subclasses that run on hscache's manager.

``vllm serve MODEL --scheduler-cls hscache.vllm.Scheduler`` (or ``AsyncScheduler``)
switches them on. The Scheduler builds its KV-cache manager by the name bound in its
own module; the subclasses rebind that name to hscache's manager for the duration of
the parent constructor, so nothing else in vLLM changes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import vllm.v1.core.sched.scheduler as _scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler

from hscache.vllm.kv_cache_manager import KVCacheManager

_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _hscache_kv_cache_manager() -> Iterator[None]:
    with _PATCH_LOCK:
        saved = getattr(_scheduler_module, "KVCacheManager")  # noqa: B009
        setattr(_scheduler_module, "KVCacheManager", KVCacheManager)  # noqa: B010
        try:
            yield
        finally:
            setattr(_scheduler_module, "KVCacheManager", saved)  # noqa: B010


class _HscacheSchedulerMixin:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _hscache_kv_cache_manager():
            super().__init__(*args, **kwargs)


class Scheduler(_HscacheSchedulerMixin, _VllmScheduler):
    """vLLM's synchronous ``Scheduler`` with hscache's ``KVCacheManager``."""


class AsyncScheduler(_HscacheSchedulerMixin, _VllmAsyncScheduler):
    """vLLM's ``AsyncScheduler`` with hscache's ``KVCacheManager``."""
