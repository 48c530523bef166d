"""The steady decode step's fast path inside ``hscache.vllm.Scheduler`` (vLLM 0.33, 0.32,
0.30), mirroring the core's ``src/step/`` (``docs/fast_step.md``).

vLLM's ``Scheduler`` spends ~10 µs of Python per running request per step in the
``schedule()`` loop body, ``_make_cached_request_data``, ``_update_after_schedule`` and
``update_from_output``'s loop. In a steady decode step almost all of it decides nothing:
every running request schedules its one decode token. This package serves those steps
with one core call per phase, over vLLM's own ``Request`` objects (which stay
authoritative: every field ends as vLLM's code leaves it) and vLLM's own helpers for the
rare events (preemption, stats), and hands everything else to vLLM's code unchanged:

- :mod:`.schedule` (``schedule``): the ``schedule()`` phase, a whole step or nothing;
  core: ``src/step/schedule.rs`` through ``hscache._core.StepSchedule``.
- :mod:`.update` (``split_update``, ``merge_outputs``): the steady requests of
  ``update_from_output()``; core: ``src/step/update.rs`` through
  ``hscache._core.StepUpdate``.
- :mod:`.rules`: every rule's name (``RULES``; each has a mutant the differential
  catches) and ``enabled()``: on only for the vLLM versions whose profile says so
  (``VllmProfile.fast_step``), off with ``HSCACHE_FAST_STEP=0``.

The scheduler subclasses (``hscache.vllm.scheduler``) call the phases through this
package's attributes, so that a wrapper set here (the benches' counters) sees every call.
"""

from __future__ import annotations

from hscache.vllm.step.rules import RULES, enabled
from hscache.vllm.step.schedule import schedule
from hscache.vllm.step.update import merge_outputs, split_update

__all__ = ["RULES", "enabled", "merge_outputs", "schedule", "split_update"]
