"""What one benchmark run measured: per-side timings, workload counters, the run's result.

Owns the operation names of the per-operation statistics, :class:`SideResult` (one
manager's per-step and per-call times), :class:`WorkloadCounters` (what the trace did,
identical on both sides when their decisions agree) and :class:`RunResult` (one scenario,
both sides), plus :func:`merge_runs` for ``--repeat`` and the two errors a run can end
with. No vLLM, no timing code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hscache_tools.bench.scenarios import Scenario

__all__ = [
    "OP_ALLOC_ADMIT",
    "OP_ALLOC_BATCH",
    "OP_ALLOC_REFUSED",
    "OP_ALLOC_RUNNING",
    "OP_BLOCK_IDS",
    "OP_FREE",
    "OP_FREE_BATCH",
    "OP_GET_BLOCKS",
    "OP_HANDLE",
    "OP_LOOKUP",
    "OP_MAKE_STATS",
    "OP_NEW_STEP",
    "OP_RECORD_STATS",
    "OP_TAKE_EVENTS",
    "OP_TAKE_NEW_IDS",
    "OP_USAGE",
    "DivergenceError",
    "RunResult",
    "SideResult",
    "UnsupportedScenarioError",
    "WorkloadCounters",
    "merge_runs",
]


class DivergenceError(RuntimeError):
    """The two managers made different decisions on the same trace."""


class UnsupportedScenarioError(ValueError):
    """The scenario cannot run on this path (a hybrid layout on the batched path)."""


# Operation names used in the per-operation statistics.
OP_NEW_STEP = "new_step_starts"
OP_ALLOC_RUNNING = "allocate_slots(running)"
OP_ALLOC_ADMIT = "allocate_slots(admit)"
# An admission's ``allocate_slots`` that returned None (not enough free blocks): timed
# apart, since under pool pressure most admissions are refused and retried every step.
OP_ALLOC_REFUSED = "allocate_slots(refused)"
OP_LOOKUP = "get_computed_blocks"
OP_RECORD_STATS = "record_prefix_cache_stats"
OP_GET_BLOCKS = "get_blocks"
OP_BLOCK_IDS = "KVCacheBlocks.get_block_ids"
OP_TAKE_NEW_IDS = "take_new_block_ids"
OP_FREE = "free"
OP_TAKE_EVENTS = "take_events"
OP_MAKE_STATS = "make_prefix_cache_stats"
OP_USAGE = "usage"
# Batched path (``--batched``): the candidate replaces the per-request calls of the
# running loop and of finishes by one call each per step.
OP_ALLOC_BATCH = "allocate_slots_batch(running)"
OP_HANDLE = "request_handle"
OP_FREE_BATCH = "free_batch"


@dataclass
class SideResult:
    """Everything one side measured in one scenario."""

    label: str
    class_name: str
    step_ns: list[int] = field(default_factory=list)
    """Per measured step: total ns spent in manager calls."""
    op_ns: dict[str, list[int]] = field(default_factory=dict)
    """Per operation: ns of every call made during measured steps."""


@dataclass
class WorkloadCounters:
    """What the trace did (identical on both sides when decisions agree)."""

    steps: int = 0
    admissions: int = 0
    admission_failures: int = 0
    resumed: int = 0
    preemptions: int = 0
    finishes: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    running_sum: int = 0
    events: int = 0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(vars(self))
        d["mean_running"] = self.running_sum / self.steps if self.steps else 0.0
        d["hit_rate"] = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return d


@dataclass
class RunResult:
    """One scenario's results: both sides' timings plus the workload it produced."""

    scenario: Scenario
    seed: int
    reference: SideResult
    candidate: SideResult
    counters: WorkloadCounters
    measured_counters: WorkloadCounters
    timer_overhead_ns: int
    wall_s: float
    checked: bool
    candidate_events: int = 0
    """KV events the candidate published over the measured steps (the reference's are
    ``measured_counters.events``)."""


def merge_runs(runs: list[RunResult]) -> RunResult:
    """Pool repeated runs of one scenario: step and per-call samples concatenated, workload
    and wall time summed (the repeats replay the same trace, so their decisions are equal)."""
    if not runs:
        raise ValueError("nothing to merge")
    first = runs[0]
    if len(runs) == 1:
        return first

    def pooled(side: str) -> SideResult:
        parts: list[SideResult] = [getattr(r, side) for r in runs]
        merged = SideResult(parts[0].label, parts[0].class_name)
        for part in parts:
            merged.step_ns.extend(part.step_ns)
            for op, calls in part.op_ns.items():
                merged.op_ns.setdefault(op, []).extend(calls)
        return merged

    def summed(name: str) -> WorkloadCounters:
        total = WorkloadCounters()
        for r in runs:
            for key, value in vars(getattr(r, name)).items():
                setattr(total, key, getattr(total, key) + value)
        return total

    return RunResult(
        scenario=first.scenario,
        seed=first.seed,
        reference=pooled("reference"),
        candidate=pooled("candidate"),
        counters=summed("counters"),
        measured_counters=summed("measured_counters"),
        timer_overhead_ns=first.timer_overhead_ns,
        wall_s=sum(r.wall_s for r in runs),
        checked=all(r.checked for r in runs),
        candidate_events=sum(r.candidate_events for r in runs),
    )
