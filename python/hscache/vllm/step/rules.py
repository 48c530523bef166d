"""The fast path's rules, by name: the ones the Python glue applies (this file) and the
core's (``src/step/schedule.rs``'s ``ScheduleRule``, ``src/step/update.rs``'s
``UpdateRule``, read from the bindings), and whether the fast path is on.

Each rule has a mutant, the rule broken alone, that the scheduler differential
(``tests/scheduler/test_scheduler_fast_path.py``) must catch. The core's mutants are armed
by the test-only hook ``tests/scheduler/mutants.py``; the glue's are the names in
:data:`BROKEN`, empty here and set only by that hook.
"""

from __future__ import annotations

import os

from hscache._core import StepSchedule, StepUpdate
from hscache.vllm import mirror
from hscache.vllm.version import require

__all__ = ["BROKEN", "CORE_RULES", "GLUE_RULES", "RULES", "enabled", "switched_on"]

_PROFILE = require()

GLUE_RULES = (
    "waiting",  # a step whose waiting loop could admit is not served
    "queue_seats",  # a queue behind full admission seats (max_num_seqs) is served
    "queue_budget",  # a queue behind a spent token / input budget is served
    "preempt",  # pool pressure preempts from the tail (vLLM's FCFS rule)
    "skip",  # a request vLLM's running loop skips (`continue`) is not in the step
    "all_token_ids",  # requests not scheduled last step carry their tokens (MRV1)
    "capacity_bound",  # the step records whether admissions were capacity-bound
    "in_flight",  # scheduling counts the tokens in flight
    "prefill_chunk",  # a request whose chunk ends mid-prompt stays a prefill chunk
    "last_prefill_step",  # a running prefill chunk restarts the prefill cadence (0.33)
    # AsyncScheduler only:
    "output_placeholders",  # scheduling adds the token's output placeholder
    "chunk_placeholders",  # a chunk that ends mid-prompt gets no placeholder
)
"""The rules :mod:`hscache.vllm.step.schedule` applies in Python."""

CORE_RULES: tuple[str, ...] = (*StepSchedule.RULES, *StepUpdate.RULES)
"""The rules the core applies (``chunk_tokens``, ``long_prefill``, ``token_budget``,
``stop_eos``, ...)."""

RULES: tuple[str, ...] = (*GLUE_RULES, *CORE_RULES)
"""Every rule of the fast path."""

BROKEN: frozenset[str] = frozenset()
"""The glue rules broken (test-only mutants): always empty outside the hook."""


def switched_on() -> bool:
    """The version's profile says the fast path was proven and ``HSCACHE_FAST_STEP`` is
    not ``0``."""
    flag = os.environ.get("HSCACHE_FAST_STEP", "1").lower()
    return _PROFILE.fast_step and flag not in ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether the fast path serves steps: :func:`switched_on`, and the installed vLLM's
    mirrored code is the code tested (``hscache.vllm.mirror.proven``: exact version,
    fingerprint) with its scheduler building the ``EngineCoreOutput`` the core builds
    (``update.OUTPUT_CLASS``: under vllm-omni's patch, vLLM's code builds
    ``OmniEngineCoreOutput``)."""
    from hscache.vllm.step.update import OUTPUT_CLASS

    return switched_on() and mirror.proven(OUTPUT_CLASS)
