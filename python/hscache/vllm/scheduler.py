"""vLLM ``Scheduler`` / ``AsyncScheduler`` subclasses that run on hscache's managers.

``vllm serve MODEL --scheduler-cls hscache.vllm.Scheduler`` (or ``AsyncScheduler``)
switches them on. The Scheduler builds its KV-cache and encoder-cache managers by the
names bound in its own module; the subclasses rebind those names to hscache's managers
(``plugin.scheduler_bindings``) for the duration of the parent constructor, and install
hscache's request block hasher, which ``EngineCore`` builds right after the scheduler.
Nothing else in vLLM changes; each supported vLLM (``hscache.vllm.version``) runs its own
scheduling code. With any other vLLM, importing this module raises
``UnsupportedVllmVersionError``, so ``--scheduler-cls hscache.vllm.Scheduler`` stops the
engine at start with a message naming the supported versions.

After construction the scheduler logs one line naming the KV-cache manager class it got
(``hscache.vllm.kv_cache_manager.KVCacheManager``, or vLLM's own after a fallback, whose
reason is logged just before): what ``scripts/e2e.sh`` reads to prove hscache served.

KV-event publishing never blocks the step: the same bindings make the Scheduler's
``ZmqEventPublisher`` a ``hscache.vllm.publisher.NonBlockingPublisher`` (batches its
full queue cannot take are held, merged, and handed over as soon as there is room).
Other publishers are left as they are.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import vllm.v1.core.sched.scheduler as _scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput

from hscache.vllm import mirror, step
from hscache.vllm.block_hasher import install_block_hasher
from hscache.vllm.plugin import scheduler_bindings, use_vllm_log_handler
from hscache.vllm.version import require

_PROFILE = require()
logger = logging.getLogger(__name__)
_PATCH_LOCK = threading.Lock()

FAST_PATH_COUNTS = ("schedule_steps", "schedule_served", "update_requests", "update_served")
"""The keys of every hscache scheduler's ``fast_path_counts`` (``_FastStepMixin``)."""


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


class HscacheSchedulerMixin:
    """Builds the scheduler inside hscache's bindings: put it first among the bases of
    any subclass of vLLM's ``Scheduler`` (``hscache.omni.scheduler`` does, for vllm-omni's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        use_vllm_log_handler()
        # EngineCore builds its request block hasher right after the scheduler: from
        # then on it is hscache's (same hashes as the configured vLLM algorithm).
        install_block_hasher()
        with _hscache_managers():
            super().__init__(*args, **kwargs)
        manager = type(self.kv_cache_manager)  # type: ignore[attr-defined]
        logger.info(
            "hscache: %s (vLLM %s) uses KV-cache manager %s.%s",
            type(self).__name__,
            _PROFILE.version,
            manager.__module__,
            manager.__qualname__,
        )


class _FastStepMixin:
    """The steady decode step's fast path (``hscache.vllm.step``) in front of vLLM's
    ``schedule()`` / ``update_from_output()``, where the vLLM version's profile enables it,
    ``HSCACHE_FAST_STEP`` is not ``0`` and the vLLM code it mirrors is the code tested, for
    this scheduler's class and every request's (``hscache.vllm.mirror``); ``_is_async``
    selects vLLM's async semantics.

    ``fast_path_counts`` counts, per phase, what the fast path served (a few integer adds
    per step; never reset by the scheduler, so a reader takes differences):

    - ``schedule_steps``: calls of ``schedule()``;
    - ``schedule_served``: those the fast path served, whole or in part;
    - ``update_requests``: requests in ``update_from_output()`` calls (the scheduled
      ones, ``len(scheduler_output.num_scheduled_tokens)``);
    - ``update_served``: those whose update the fast path served.
    """

    _is_async = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast_step = self._fast_step_allowed()
        self.fast_path_counts: dict[str, int] = dict.fromkeys(FAST_PATH_COUNTS, 0)

    def _fast_step_allowed(self) -> bool:
        """Whether the fast path may serve this scheduler's steps (decided at construction;
        ``hscache.omni.scheduler`` decides for vllm-omni's classes)."""
        return step.enabled() and mirror.scheduler_covered(type(self))

    def add_request(self, request: Any) -> None:
        # Requests are built by the engine (or a plugin's Request subclass): the first
        # request of a class whose mirrored methods are not vLLM's turns the path off.
        if self.fast_step and not mirror.request_covered(type(request)):
            self.fast_step = False
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        counts = self.fast_path_counts
        counts["schedule_steps"] += 1
        if self.fast_step:
            out = step.schedule(self, throttle_prefills, is_async=self._is_async)
            if out is not None:
                counts["schedule_served"] += 1
                return out
        return super().schedule(throttle_prefills)  # type: ignore[misc,no-any-return]

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        counts = self.fast_path_counts
        counts["update_requests"] += len(scheduler_output.num_scheduled_tokens)
        if self.fast_step:
            split = step.split_update(
                self, scheduler_output, model_runner_output, is_async=self._is_async
            )
            if split is not None:
                rest, built = split
                counts["update_served"] += len(built)
                outputs = super().update_from_output(rest, model_runner_output)  # type: ignore[misc]
                return step.merge_outputs(scheduler_output, outputs, built)
        return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc,no-any-return]


class Scheduler(HscacheSchedulerMixin, _FastStepMixin, _VllmScheduler):
    """vLLM's synchronous ``Scheduler`` with hscache's KV-cache and encoder-cache managers,
    and the steady decode step's fast path."""


class AsyncScheduler(HscacheSchedulerMixin, _FastStepMixin, _VllmAsyncScheduler):
    """vLLM's ``AsyncScheduler`` with hscache's KV-cache and encoder-cache managers, and
    the steady decode step's fast path with vLLM's async semantics (output placeholders)."""

    _is_async = True
