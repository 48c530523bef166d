"""vLLM ``Scheduler`` / ``AsyncScheduler`` subclasses that run on hscache's managers.

``vllm serve MODEL --scheduler-cls hscache.vllm.Scheduler`` (or ``AsyncScheduler``)
switches them on. The Scheduler builds its KV-cache and encoder-cache managers by the
names bound in its own module; the subclasses rebind those names to hscache's managers
(``plugin.scheduler_bindings``) for the duration of the parent constructor, and install
hscache's request block hasher, which ``EngineCore`` builds right after the scheduler.
Nothing else in vLLM changes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import vllm.v1.core.sched.scheduler as _scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler

from hscache.vllm.block_hasher import install_block_hasher
from hscache.vllm.plugin import scheduler_bindings

_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _hscache_managers() -> Iterator[None]:
    bindings = scheduler_bindings()
    with _PATCH_LOCK:
        saved = {name: getattr(_scheduler_module, name) for name in bindings}
        for name, obj in bindings.items():
            setattr(_scheduler_module, name, obj)
        try:
            yield
        finally:
            for name, obj in saved.items():
                setattr(_scheduler_module, name, obj)


class _HscacheSchedulerMixin:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # EngineCore builds its request block hasher right after the scheduler: from
        # then on it is hscache's (same hashes as the configured vLLM algorithm).
        install_block_hasher()
        with _hscache_managers():
            super().__init__(*args, **kwargs)


class Scheduler(_HscacheSchedulerMixin, _VllmScheduler):
    """vLLM's synchronous ``Scheduler`` with hscache's KV-cache and encoder-cache managers."""


class AsyncScheduler(_HscacheSchedulerMixin, _VllmAsyncScheduler):
    """vLLM's ``AsyncScheduler`` with hscache's KV-cache and encoder-cache managers."""
