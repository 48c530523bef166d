"""Differential testing of a KVCacheManager replacement against vLLM's own.

A seeded, scheduler-like generator of manager calls is executed against a *pair* of managers
(vLLM's reference and a candidate), comparing every return value and the observable state
after every call; a divergence is shrunk into a short repro. Where each concept lives:

- :mod:`.config` — :class:`TraceConfig`, :func:`config_for_seed` (every layout family in
  turn), the managers' keywords (:mod:`hscache_tools.testing`), :func:`load_candidate`;
- :mod:`.layouts` — the KV-cache layouts: a short string per list of groups (full
  attention, sliding window, chunked local, Mamba, cross attention, EAGLE, ...);
- :mod:`.actions` — the action vocabulary of a trace, its rendering, counters, repro files;
- :mod:`.side` — one manager with its own ``Request`` objects: executes actions, normalises
  answers, observes state;
- :mod:`.pair` — both sides in lock-step, the comparison, :class:`Divergence` reports;
- :mod:`.generator` — the scheduler-like generator (the Scheduler's loops come from
  :mod:`hscache_tools.testing.scheduler_step`, shared with the benchmark);
- :mod:`.trace` — :func:`run_trace`, one seeded trace;
- :mod:`.shrinking` — :func:`replay`, :func:`shrink`, :func:`minimize`;
- :mod:`.exceptions` — where vLLM's own manager crashes: the documented cases, each with
  what hscache does instead;
- :mod:`.mutants` — deliberately wrong managers that prove the harness notices;
- ``__main__`` — ``cd tests && python -m vllm_diff`` (or ``python -m tests.vllm_diff``)
  runs seeds from the command line and shrinks failures.

Nothing here is collected by pytest (no ``test_*`` names); see
``tests/differential/test_differential_vllm.py``.
"""

from . import exceptions
from .actions import dump_repro, format_actions, load_repro, render_action, summarize
from .config import (
    ReferenceKVCacheManager,
    TraceConfig,
    config_for_seed,
    load_candidate,
    manager_kwargs,
)
from .errors import Divergence, HarnessError
from .exceptions import KnownVllmException
from .pair import Pair
from .shrinking import minimize, replay, shrink
from .trace import run_trace

__all__ = [
    "Divergence",
    "HarnessError",
    "KnownVllmException",
    "Pair",
    "ReferenceKVCacheManager",
    "TraceConfig",
    "config_for_seed",
    "dump_repro",
    "exceptions",
    "format_actions",
    "load_candidate",
    "load_repro",
    "manager_kwargs",
    "minimize",
    "render_action",
    "replay",
    "run_trace",
    "shrink",
    "summarize",
]
