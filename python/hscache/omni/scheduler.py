"""vllm-omni's autoregressive schedulers with hscache's KV-cache manager and the fast path.

vllm-omni 0.30 runs each AR stage (a thinker, a talker) on its own ``OmniARScheduler`` or,
with async scheduling (its default), ``OmniARAsyncScheduler``: subclasses of vLLM's
``Scheduler`` / ``AsyncScheduler`` that inherit vLLM's constructor, so they build their
KV-cache manager by the name bound in vLLM's scheduler module. Two ways to run them on
hscache's manager, the same manager and decisions either way:

- ``HSCACHE=1`` in the stage's environment: hscache's vLLM plugin (loaded by vLLM's
  ``EngineCore`` in every engine process) rebinds that name, so whatever scheduler the
  stage runs, vllm-omni's included, builds hscache's manager (no fast path: the class is
  vllm-omni's own).
- ``scheduler_cls: hscache.omni.OmniARScheduler`` (or
  ``hscache.omni.OmniARAsyncScheduler``) as a pipeline stage's ``scheduler_cls``
  (``StagePipelineConfig``, e.g. a pipeline registered with ``register_pipeline``;
  vllm-omni 0.30 overwrites a deploy YAML stage's ``scheduler_cls`` with the pipeline's,
  so a YAML key is ignored): the classes below, vllm-omni's schedulers built inside
  hscache's bindings (``hscache.vllm.scheduler``), with the whole-step fast path
  (``hscache.vllm.step``) where vllm-omni's code calls vLLM's: the fast ``schedule()``
  sits below vllm-omni's (its ``super().schedule()``), and the steady requests of
  ``update_from_output()`` are taken out of vllm-omni's loop (``hscache.omni.fast``). Both
  only where vLLM's and vllm-omni's code are the code tested (``hscache.omni.mirror``).
  vllm-omni passes a stage's ``scheduler_cls`` through as it is, so the class must match
  the stage's ``async_scheduling`` (vllm-omni picks the async one when it chooses by
  itself). ``hscache.vllm.Scheduler`` there would drop vllm-omni's own scheduling (KV
  transfer to the next stage, chunk transport, streaming input).

Importing this module needs vLLM, vllm-omni and a vLLM version hscache supports
(``hscache.vllm.version``); ``hscache.omni`` imports it only when one of the two names
is asked for.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm_omni.core.sched.omni_ar_scheduler import (
    OmniARAsyncScheduler as _OmniARAsyncScheduler,
)
from vllm_omni.core.sched.omni_ar_scheduler import (
    OmniARScheduler as _OmniARScheduler,
)

from hscache.omni import fast, mirror
from hscache.vllm.scheduler import HscacheSchedulerMixin, _FastStepMixin
from hscache.vllm.step import rules

__all__ = ["OmniARAsyncScheduler", "OmniARScheduler"]


class _FastVllmScheduler(_FastStepMixin, _VllmScheduler):
    """vLLM's ``Scheduler`` under vllm-omni's: its ``schedule()`` (what vllm-omni's calls
    as ``super().schedule()``) served by the fast path."""


class _FastVllmAsyncScheduler(_FastStepMixin, _VllmAsyncScheduler):
    """The same for vLLM's ``AsyncScheduler``."""

    _is_async = True


class _OmniFastUpdate:
    """In front of vllm-omni's ``update_from_output``: its steady requests served by the
    core (``hscache.omni.fast``), the others left to vllm-omni's loop."""

    fast_step: bool
    fast_path_counts: dict[str, int]
    _is_async: bool

    def _fast_step_allowed(self) -> bool:
        return rules.switched_on() and mirror.omni_covered(type(self))

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: Any
    ) -> Any:
        counts = self.fast_path_counts
        counts["update_requests"] += len(scheduler_output.num_scheduled_tokens)
        if self.fast_step:
            split = fast.split_update(
                self, scheduler_output, model_runner_output, is_async=self._is_async
            )
            if split is not None:
                rest, built = split
                counts["update_served"] += len(built)
                outputs = super().update_from_output(rest, model_runner_output)  # type: ignore[misc]
                return fast.merge_outputs(scheduler_output, outputs, built)
        return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]


class OmniARScheduler(
    HscacheSchedulerMixin,
    _OmniFastUpdate,
    _OmniARScheduler,  # type: ignore[misc,unused-ignore]
    _FastVllmScheduler,
):
    """vllm-omni's synchronous ``OmniARScheduler`` with hscache's KV-cache and
    encoder-cache managers, and the fast path under it."""


class OmniARAsyncScheduler(
    HscacheSchedulerMixin,
    _OmniFastUpdate,
    _OmniARAsyncScheduler,  # type: ignore[misc,unused-ignore]
    _FastVllmAsyncScheduler,
):
    """vllm-omni's ``OmniARAsyncScheduler`` (its default for AR stages) with hscache's
    KV-cache and encoder-cache managers, and the fast path under it."""
