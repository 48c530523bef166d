"""Differential testing of a KVCacheManager replacement against vLLM's own.

`trace` holds the trace driver: a seeded, scheduler-like generator of manager calls that is
executed against a *pair* of managers (vLLM's reference and a candidate), comparing every
return value and the observable state after every call.  `python -m vllm_diff` (with
``tests/`` on ``sys.path``) runs seeds from the command line and shrinks failures.

Nothing here is collected by pytest (no ``test_*`` names); see
``tests/test_differential_vllm.py``.
"""

from .trace import (
    Divergence,
    HarnessError,
    TraceConfig,
    config_for_seed,
    dump_repro,
    format_actions,
    load_candidate,
    load_repro,
    minimize,
    replay,
    run_trace,
    shrink,
)

__all__ = [
    "Divergence",
    "HarnessError",
    "TraceConfig",
    "config_for_seed",
    "dump_repro",
    "format_actions",
    "load_candidate",
    "load_repro",
    "minimize",
    "replay",
    "run_trace",
    "shrink",
]
