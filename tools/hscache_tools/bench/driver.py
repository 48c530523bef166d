"""Lock-step driver of ``python -m hscache bench``: two managers, one trace, every decision
compared.

Owns :class:`StepDriver`, which feeds one scenario's seeded request stream to two
:class:`~hscache_tools.bench.side.Side` s (reference and candidate, each with its own but identical
``Request`` objects), steps them alternately first so that cache warmth favours neither,
compares every step's decisions and aborts with :class:`DivergenceError` on the first
difference; :func:`run_scenario` wraps one such run into a
:class:`~hscache_tools.bench.results.RunResult`, and :func:`calibrate_timer` measures the cost of
the timer itself (subtracted from every timed call).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from hscache_tools.bench.managers import RequestFactory, build_manager
from hscache_tools.bench.results import (
    DivergenceError,
    RunResult,
    UnsupportedScenarioError,
    WorkloadCounters,
)
from hscache_tools.bench.scenarios import Scenario, TraceGenerator
from hscache_tools.bench.side import Decision, Side

__all__ = [
    "DivergenceError",
    "StepDriver",
    "UnsupportedScenarioError",
    "calibrate_timer",
    "run_scenario",
]


def calibrate_timer(samples: int = 20_001) -> int:
    """Median cost in ns of an empty ``perf_counter_ns()`` pair (subtracted from each call)."""
    pc = time.perf_counter_ns
    diffs = []
    for _ in range(samples):
        t0 = pc()
        t1 = pc()
        diffs.append(t1 - t0)
    return int(statistics.median(diffs))


def _describe(d: Decision | None) -> str:
    text = repr(d)
    return text if len(text) <= 600 else text[:600] + "..."


def _compare(step: int, ref: list[Decision], cand: list[Decision]) -> None:
    if ref == cand:
        return
    for k, (a, b) in enumerate(zip(ref, cand, strict=False)):
        if a != b:
            raise DivergenceError(
                f"decision divergence at step {step}, item {k}:\n"
                f"  reference: {_describe(a)}\n  candidate: {_describe(b)}"
            )
    longer, name = (ref, "reference") if len(ref) > len(cand) else (cand, "candidate")
    extra = longer[min(len(ref), len(cand))]
    raise DivergenceError(
        f"decision divergence at step {step}: the {name} made an extra decision {_describe(extra)}"
    )


class StepDriver:
    """Runs one scenario on a reference and a candidate manager in lockstep.

    Requests are built (and hashed) before the timed loop; if the trace runs short the driver
    tops both sides up between steps, outside any timed region.
    """

    def __init__(
        self,
        scenario: Scenario,
        reference_cls: type,
        candidate_cls: type,
        seed: int = 0,
        check: bool = True,
        timer_overhead_ns: int | None = None,
        batched: bool = False,
    ) -> None:
        self.scenario = scenario
        self.seed = seed
        self.check = check
        self.overhead = calibrate_timer() if timer_overhead_ns is None else timer_overhead_ns
        self._trace = TraceGenerator(scenario, seed)
        self._factory = RequestFactory(scenario)
        ref_events, cand_events = compared_events(scenario)
        self.reference = Side(
            "vllm",
            build_manager(reference_cls, scenario),
            scenario,
            self.overhead,
            compare_events=ref_events,
        )
        self.candidate = Side(
            "hscache",
            build_manager(candidate_cls, scenario, candidate=True),
            scenario,
            self.overhead,
            batched=batched,
            compare_events=cand_events,
        )
        self.step_index = 0
        self._measured_start: WorkloadCounters | None = None
        self._candidate_events_start = 0
        self._add_requests(scenario.estimated_requests())

    def _add_requests(self, n: int) -> None:
        for spec in self._trace.take(n):
            self.reference.add_waiting(self._factory.build(spec), spec.output)
            self.candidate.add_waiting(self._factory.build(spec), spec.output)

    def step(self) -> None:
        sc = self.scenario
        if len(self.reference.waiting) < sc.max_running:
            self._add_requests(sc.max_running)
        measuring = self.step_index >= sc.warmup_steps
        if measuring and self._measured_start is None:
            self._measured_start = WorkloadCounters(**vars(self.reference.counters))
            self._candidate_events_start = self.candidate.counters.events
        # Alternate which side goes first so that cache warmth favours neither.
        if self.step_index % 2 == 0:
            ref = self.reference.step(measuring, self.check)
            cand = self.candidate.step(measuring, self.check)
        else:
            cand = self.candidate.step(measuring, self.check)
            ref = self.reference.step(measuring, self.check)
        if self.check:
            _compare(self.step_index, ref, cand)
        self.step_index += 1

    def steps(self) -> Iterator[int]:
        """Run every step of the scenario, yielding after each (for progress reporting)."""
        gc.collect()
        gc.freeze()
        try:
            while self.step_index < self.scenario.total_steps:
                self.step()
                yield self.step_index
        finally:
            gc.unfreeze()

    def measured_counters(self) -> WorkloadCounters:
        start = self._measured_start or WorkloadCounters()
        end = self.reference.counters
        return WorkloadCounters(**{k: v - getattr(start, k) for k, v in vars(end).items()})

    def measured_candidate_events(self) -> int:
        """KV events the candidate published over the measured steps."""
        return self.candidate.counters.events - self._candidate_events_start


def compared_events(
    scenario: Scenario,
) -> tuple[Callable[[list[Any]], Any] | None, Callable[[list[Any]], Any] | None]:
    """What the decision check compares of each side's events (reference, candidate): the
    events themselves; for a compact candidate, the reference's coalesced by the same rule
    (``hscache._core.coalesce_kv_events``); nothing when the candidate has none."""
    if scenario.candidate_events == "off":
        return None, None
    if scenario.candidate_events == "compact":
        from hscache._core import coalesce_kv_events

        return coalesce_kv_events, list
    return list, list


def run_scenario(
    scenario: Scenario,
    reference_cls: type,
    candidate_cls: type,
    seed: int = 0,
    check: bool = True,
    progress: Callable[[int, int], None] | None = None,
    timer_overhead_ns: int | None = None,
    batched: bool = False,
) -> RunResult:
    """Run ``scenario`` on both managers; ``progress(done, total)`` is called after each step.

    ``batched``: the candidate uses ``allocate_slots_batch`` / ``free_batch`` for the
    running set and finishes instead of one call per request."""
    if scenario.layout != "full":
        if batched:
            raise UnsupportedScenarioError(
                f"{scenario.name}: the batched API serves one full-attention group only"
            )
        from hscache_tools.bench.real_scheduler import run_real_scenario

        overhead = calibrate_timer() if timer_overhead_ns is None else timer_overhead_ns
        return run_real_scenario(
            scenario, reference_cls, candidate_cls, seed, check, progress, overhead
        )
    t_start = time.perf_counter()
    driver = StepDriver(
        scenario, reference_cls, candidate_cls, seed, check, timer_overhead_ns, batched
    )
    total = scenario.total_steps
    for done in driver.steps():
        if progress is not None:
            progress(done, total)
    wall = time.perf_counter() - t_start
    return RunResult(
        scenario=scenario,
        seed=seed,
        reference=driver.reference.result,
        candidate=driver.candidate.result,
        counters=driver.reference.counters,
        measured_counters=driver.measured_counters(),
        candidate_events=driver.measured_candidate_events(),
        timer_overhead_ns=driver.overhead,
        wall_s=wall,
        checked=check,
    )
