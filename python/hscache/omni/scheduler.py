"""vllm-omni's autoregressive schedulers with hscache's KV-cache manager.

vllm-omni 0.30 runs each AR stage (a thinker, a talker) on its own ``OmniARScheduler`` or,
with async scheduling (its default), ``OmniARAsyncScheduler``: subclasses of vLLM's
``Scheduler`` / ``AsyncScheduler`` that inherit vLLM's constructor, so they build their
KV-cache manager by the name bound in vLLM's scheduler module. Two ways to run them on
hscache's manager, the same manager and decisions either way:

- ``HSCACHE=1`` in the stage's environment: hscache's vLLM plugin (loaded by vLLM's
  ``EngineCore`` in every engine process) rebinds that name, so whatever scheduler the
  stage runs, vllm-omni's included, builds hscache's manager.
- ``scheduler_cls: hscache.omni.OmniARScheduler`` (or ``hscache.omni.OmniARAsyncScheduler``)
  in a stage of the deploy YAML: the classes below, vllm-omni's schedulers unchanged but
  for their constructor, which runs inside hscache's bindings
  (``hscache.vllm.scheduler``). vllm-omni passes a stage's ``scheduler_cls`` through as it
  is, so the class must match the stage's ``async_scheduling`` (vllm-omni picks the async
  one when it chooses by itself). ``hscache.vllm.Scheduler`` there would drop vllm-omni's
  own scheduling (KV transfer to the next stage, chunk transport, streaming input).

Importing this module needs vLLM, vllm-omni and a vLLM version hscache supports
(``hscache.vllm.version``); ``hscache.omni`` imports it only when one of the two names
is asked for.
"""

from __future__ import annotations

from vllm_omni.core.sched.omni_ar_scheduler import (
    OmniARAsyncScheduler as _OmniARAsyncScheduler,
)
from vllm_omni.core.sched.omni_ar_scheduler import (
    OmniARScheduler as _OmniARScheduler,
)

from hscache.vllm.scheduler import HscacheSchedulerMixin

__all__ = ["OmniARAsyncScheduler", "OmniARScheduler"]


class OmniARScheduler(HscacheSchedulerMixin, _OmniARScheduler):  # type: ignore[misc,unused-ignore]
    """vllm-omni's synchronous ``OmniARScheduler`` with hscache's KV-cache and
    encoder-cache managers."""


class OmniARAsyncScheduler(HscacheSchedulerMixin, _OmniARAsyncScheduler):  # type: ignore[misc,unused-ignore]
    """vllm-omni's ``OmniARAsyncScheduler`` (its default for AR stages) with hscache's
    KV-cache and encoder-cache managers."""
