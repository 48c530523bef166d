"""Side-by-side benchmark of vLLM's ``KVCacheManager`` and hscache's (``python -m hscache bench``).

Owns the benchmark package: :mod:`.scenarios` (seeded workloads), :mod:`.driver` (the
Scheduler-emulating step driver, per-call timing and the decision check), :mod:`.report`
(medians, p90s, ratios, JSON, plot) and :mod:`.runner` (the command-line front end).
"""

from hscache.bench.driver import DivergenceError, RunResult, StepDriver, run_scenario
from hscache.bench.scenarios import DEFAULT_SCENARIOS, QUICK_SCENARIOS, Scenario, find_scenario

__all__ = [
    "DEFAULT_SCENARIOS",
    "QUICK_SCENARIOS",
    "DivergenceError",
    "RunResult",
    "Scenario",
    "StepDriver",
    "find_scenario",
    "run_scenario",
]
