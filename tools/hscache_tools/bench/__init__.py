"""Side-by-side benchmark of vLLM's ``KVCacheManager`` and hscache's (``python -m hscache bench``).

Owns the benchmark package: :mod:`.scenarios` (seeded workloads), :mod:`.managers` (the two
managers and the requests they are fed), :mod:`.side` (one manager stepped through vLLM's
Scheduler loops of :mod:`hscache_tools.testing.scheduler_step`, its calls timed), :mod:`.driver`
(both sides in lock-step, the decision check), :mod:`.results` (what a run measured),
:mod:`.report` (medians, p90s, ratios, JSON, plot), :mod:`.runner` (the command-line front
end) and :mod:`.scheduler_level` (vLLM's real Scheduler, stock against hscache's).
"""

from hscache_tools.bench.driver import DivergenceError, StepDriver, run_scenario
from hscache_tools.bench.results import RunResult
from hscache_tools.bench.scenarios import (
    DEFAULT_SCENARIOS,
    QUICK_SCENARIOS,
    Scenario,
    find_scenario,
)

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
