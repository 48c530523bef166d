"""Step driver for ``python -m hscache bench``: emulates the vLLM Scheduler's KV bookkeeping.

Owns the per-step call sequence a vLLM 0.33 ``Scheduler`` makes on its ``KVCacheManager``
(``new_step_starts``; ``allocate_slots`` for running requests with preemption on ``None``;
``get_computed_blocks`` → ``allocate_slots`` → ``record_prefix_cache_stats`` → ``get_blocks``
for admissions; ``get_block_ids`` and ``take_new_block_ids`` while building the output; after
the "model": token appends, ``free`` on finish, ``take_events``, ``make_prefix_cache_stats``,
``usage``), run in lockstep on two managers (reference and candidate) that each own separate
but identical ``vllm.v1.request.Request`` objects. Only the manager calls are timed
(``perf_counter_ns`` around each call, per operation); every step's decisions of both sides
are compared and a divergence aborts the run with :class:`DivergenceError`.
"""

from __future__ import annotations

import gc
import importlib
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hscache.bench.scenarios import RequestSpec, Scenario, TraceGenerator

__all__ = [
    "CANDIDATE_SPEC",
    "REFERENCE_SPEC",
    "DivergenceError",
    "RunResult",
    "SideResult",
    "StepDriver",
    "build_manager",
    "calibrate_timer",
    "load_class",
    "merge_runs",
    "run_scenario",
]

REFERENCE_SPEC = "vllm.v1.core.kv_cache_manager:KVCacheManager"
CANDIDATE_SPEC = "hscache.vllm:KVCacheManager"

# Operation names used in the per-operation statistics.
OP_NEW_STEP = "new_step_starts"
OP_ALLOC_RUNNING = "allocate_slots(running)"
OP_ALLOC_ADMIT = "allocate_slots(admit)"
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

Decision = tuple[Any, ...]


class DivergenceError(RuntimeError):
    """The two managers made different decisions on the same trace."""


def _ensure_vllm_env() -> None:
    # The benchmark only needs vLLM's CPU-side scheduling code.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_class(spec: str) -> type:
    """Import ``module:Class`` (or ``module.Class``) and return the class."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:Class', got {spec!r}")
    _ensure_vllm_env()
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{spec} is not a class")
    return obj


def calibrate_timer(samples: int = 20_001) -> int:
    """Median cost in ns of an empty ``perf_counter_ns()`` pair (subtracted from each call)."""
    pc = time.perf_counter_ns
    diffs = []
    for _ in range(samples):
        t0 = pc()
        t1 = pc()
        diffs.append(t1 - t0)
    return int(statistics.median(diffs))


def build_kv_cache_config(scenario: Scenario) -> Any:
    """A one-group full-attention ``KVCacheConfig`` with the scenario's pool size."""
    _ensure_vllm_env()
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=scenario.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=scenario.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)],
    )


def manager_kwargs(scenario: Scenario) -> dict[str, Any]:
    """The keywords vLLM's Scheduler passes to ``KVCacheManager`` for this scenario."""
    return {
        "kv_cache_config": build_kv_cache_config(scenario),
        "max_model_len": scenario.max_model_len,
        "max_in_flight_tokens": scenario.token_budget,
        "enable_caching": True,
        "use_eagle": False,
        "num_hash_lookahead_tokens": 0,
        "num_prefill_lookahead": 0,
        "log_stats": True,
        "enable_kv_cache_events": scenario.kv_events,
        "dcp_world_size": 1,
        "pcp_world_size": 1,
        "scheduler_block_size": scenario.block_size,
        "hash_block_size": scenario.block_size,
        "metrics_collector": None,
        "watermark": 0.0,
        "enable_mamba_shared_prefix_checkpoint": False,
    }


def build_manager(cls: type, scenario: Scenario) -> Any:
    """Construct a manager of class ``cls`` exactly as the Scheduler would."""
    return cls(**manager_kwargs(scenario))


class RequestFactory:
    """Builds pairs of identical ``Request`` objects (one per side) from trace specs."""

    def __init__(self, scenario: Scenario) -> None:
        _ensure_vllm_env()
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(scenario.block_size, sha256)
        self._request_cls = Request
        self._params_cls = SamplingParams

    def build(self, spec: RequestSpec) -> Any:
        return self._request_cls(
            request_id=spec.request_id,
            prompt_token_ids=list(spec.prompt),
            sampling_params=self._params_cls(max_tokens=len(spec.output)),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=self._hasher,
        )


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


class Side:
    """One manager and its private copy of the scheduler state (waiting / running queues)."""

    def __init__(
        self,
        label: str,
        manager: Any,
        scenario: Scenario,
        timer_overhead_ns: int,
        batched: bool = False,
    ) -> None:
        from vllm.v1.request import RequestStatus

        self.label = label
        self.batched = batched
        # Batched path: request id -> handle, taken when a request is admitted.
        self.handles: dict[str, int] = {}
        self.manager = manager
        self.scenario = scenario
        self.overhead = timer_overhead_ns
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self.outputs: dict[str, list[int]] = {}
        self.result = SideResult(label, f"{type(manager).__module__}.{type(manager).__qualname__}")
        self.counters = WorkloadCounters()
        self._measuring = False
        self._step_total = 0
        self._status = RequestStatus
        pool = getattr(manager, "block_pool", None)
        self._num_free: Callable[[], int] | None = getattr(pool, "get_num_free_blocks", None)

    def add_waiting(self, request: Any, output: list[int]) -> None:
        self.waiting.append(request)
        self.outputs[request.request_id] = output

    def _rec(self, op: str, dt: int) -> None:
        dt -= self.overhead
        if dt < 0:
            dt = 0
        self._step_total += dt
        if self._measuring:
            calls = self.result.op_ns.get(op)
            if calls is None:
                calls = self.result.op_ns[op] = []
            calls.append(dt)

    def _preempt(self, request: Any, out: list[Decision]) -> None:
        pc = time.perf_counter_ns
        t0 = pc()
        self.manager.free(request)
        t1 = pc()
        self._rec(OP_FREE, t1 - t0)
        self.handles.pop(request.request_id, None)
        request.status = self._status.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.counters.preemptions += 1
        out.append(("preempt", request.request_id))

    def _schedule_running_batched(
        self,
        budget: int,
        scheduled: list[tuple[Any, int, Any, int]],
        preempted: list[Any],
        out: list[Decision],
    ) -> int:
        """The running loop with one ``allocate_slots_batch`` call (``--batched``).

        The per-request token counts are the per-call loop's (they depend only on the
        budget, and a preemption only removes requests from the tail, which have not
        been scheduled yet). The loop that computes them reads each request's
        ``num_computed_tokens`` anyway and also collects the handles (taken, timed,
        once per admission); it is untimed like the per-call loop's own argument
        computation, and only the batched call is timed.
        """
        sc = self.scenario
        running = self.running
        handle_of = self.handles
        initial_budget = budget
        reqs: list[Any] = []
        handles: list[int] = []
        computed: list[int] = []
        counts: list[int] = []
        for req in running:
            if budget <= 0:
                break
            c = req.num_computed_tokens
            n = min(req.num_tokens - c, budget, sc.max_model_len - 1 - c)
            if n <= 0:
                continue
            reqs.append(req)
            handles.append(handle_of[req.request_id])
            computed.append(c)
            counts.append(n)
            budget -= n
        pc = time.perf_counter_ns
        start = 0
        while start < len(reqs):
            t0 = pc()
            result = self.manager.allocate_slots_batch(
                reqs[start:] if start else reqs,
                handles[start:] if start else handles,
                computed[start:] if start else computed,
                counts[start:] if start else counts,
            )
            t1 = pc()
            self._rec(OP_ALLOC_BATCH, t1 - t0)
            ids, offsets = result.new_block_ids, result.offsets
            for j in range(result.num_allocated):
                e = start + j
                scheduled.append((reqs[e], counts[e], ids[offsets[j] : offsets[j + 1]], 3))
            start += result.num_allocated
            if start == len(reqs):
                break
            # Entry `start` did not fit: preempt from the tail and retry it, as the
            # per-call loop does after a None.
            req = reqs[start]
            victim = running.pop()
            self._preempt(victim, out)
            preempted.append(victim)
            if victim is req:
                break
            # The victim came from the tail of the running queue, so it is the last
            # pending entry or was never gathered: drop it from the pending entries.
            if reqs[-1] is victim:
                del reqs[-1], handles[-1], computed[-1], counts[-1]
        # Budget left: only the scheduled entries consumed theirs.
        return initial_budget - sum(counts[:start])

    def step(self, measuring: bool, check: bool) -> list[Decision]:
        """One scheduler step + model output; returns the decisions made (for comparison)."""
        sc = self.scenario
        mgr = self.manager
        pc = time.perf_counter_ns
        rec = self._rec
        status = self._status
        counters = self.counters
        self._measuring = measuring
        self._step_total = 0
        out: list[Decision] = []

        allocate_slots = mgr.allocate_slots
        get_computed_blocks = mgr.get_computed_blocks
        record_prefix_cache_stats = mgr.record_prefix_cache_stats
        get_blocks = mgr.get_blocks

        t0 = pc()
        mgr.new_step_starts()
        t1 = pc()
        rec(OP_NEW_STEP, t1 - t0)

        budget = sc.token_budget
        running = self.running
        # (request, num_new_tokens, blocks, kind) with kind 0 running, 1 new, 2 resumed
        scheduled: list[tuple[Any, int, Any, int]] = []
        preempted: list[Any] = []

        # --- running requests (decode and prefill-chunk continuations) ---
        if self.batched:
            budget = self._schedule_running_batched(budget, scheduled, preempted, out)
        else:
            i = 0
            while i < len(running) and budget > 0:
                req = running[i]
                n = req.num_tokens - req.num_computed_tokens
                n = min(n, budget, sc.max_model_len - 1 - req.num_computed_tokens)
                if n <= 0:
                    i += 1
                    continue
                while True:
                    t0 = pc()
                    blocks = allocate_slots(req, n, num_lookahead_tokens=0)
                    t1 = pc()
                    rec(OP_ALLOC_RUNNING, t1 - t0)
                    if blocks is not None:
                        break
                    victim = running.pop()
                    self._preempt(victim, out)
                    preempted.append(victim)
                    if victim is req:
                        break
                if blocks is None:
                    break
                scheduled.append((req, n, blocks, 0))
                budget -= n
                i += 1

        # --- waiting requests (admissions, including preempted ones) ---
        if not preempted:
            waiting = self.waiting
            while budget > 0 and waiting and len(running) < sc.max_running:
                req = waiting[0]
                t0 = pc()
                computed, hit, boundary = get_computed_blocks(req, None)
                t1 = pc()
                rec(OP_LOOKUP, t1 - t0)
                req.shared_prefix_boundary = boundary
                n = min(req.num_tokens - hit, budget)
                t0 = pc()
                blocks = allocate_slots(
                    req,
                    n,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=computed,
                    num_lookahead_tokens=0,
                    num_external_computed_tokens=0,
                    delay_cache_blocks=False,
                    skip_zeroing_group_ids=(),
                    num_encoder_tokens=0,
                    full_sequence_must_fit=False,
                    reserved_blocks=0,
                    has_scheduled_reqs=bool(running),
                )
                t1 = pc()
                rec(OP_ALLOC_ADMIT, t1 - t0)
                if blocks is None:
                    counters.admission_failures += 1
                    out.append(("admit-fail", req.request_id, hit))
                    break
                if self.batched:
                    t0 = pc()
                    handle = mgr.request_handle(req.request_id)
                    t1 = pc()
                    rec(OP_HANDLE, t1 - t0)
                    self.handles[req.request_id] = handle
                t0 = pc()
                record_prefix_cache_stats(req, hit)
                t1 = pc()
                rec(OP_RECORD_STATS, t1 - t0)
                waiting.popleft()
                running.append(req)
                t0 = pc()
                full = get_blocks(req.request_id)
                t1 = pc()
                rec(OP_GET_BLOCKS, t1 - t0)
                kind = 1 if req.status == status.WAITING else 2
                req.status = status.RUNNING
                req.num_computed_tokens = hit
                scheduled.append((req, n, full, kind))
                budget -= n
                counters.admissions += 1
                counters.resumed += kind == 2
                counters.hit_tokens += hit
                counters.query_tokens += req.num_tokens

        # --- scheduler output: block ids handed to the workers ---
        for req, n, blocks, kind in scheduled:
            if kind == 3:
                # Batched: the new ids are already arrays; lists only for the check.
                ids = (blocks.tolist(),) if len(blocks) else None
                if check:
                    hashes = req.block_hashes
                    out.append(("sched", req.request_id, 0, n, ids, type(hashes), len(hashes)))
                continue
            if kind == 1:
                t0 = pc()
                ids = blocks.get_block_ids()
                t1 = pc()
            else:
                t0 = pc()
                ids = blocks.get_block_ids(allow_none=True)
                t1 = pc()
            rec(OP_BLOCK_IDS, t1 - t0)
            if check:
                # The hashes must stay a plain list that only the hasher extends: a manager
                # that moved work into it would hide cost outside the timed calls.
                hashes = req.block_hashes
                out.append(("sched", req.request_id, kind, n, ids, type(hashes), len(hashes)))
        t0 = pc()
        zero_ids = mgr.take_new_block_ids()
        t1 = pc()
        rec(OP_TAKE_NEW_IDS, t1 - t0)
        if check:
            out.append(("zero", list(zero_ids)))

        # --- the "model" ran: advance, sample, finish ---
        finished: list[Any] = []
        for req, n, _, _ in scheduled:
            if n == 1 and req.num_output_tokens > 0:
                counters.decode_tokens += 1
            else:
                counters.prefill_tokens += n
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                output = self.outputs[req.request_id]
                if req.num_output_tokens < len(output):
                    req.append_output_token_ids(output[req.num_output_tokens])
                if req.num_output_tokens >= len(output) or req.num_tokens >= sc.max_model_len:
                    finished.append(req)
        if finished:
            done = {id(r) for r in finished}
            if self.batched:
                finished_handles = [self.handles.pop(r.request_id) for r in finished]
                t0 = pc()
                mgr.free_batch(finished_handles)
                t1 = pc()
                rec(OP_FREE_BATCH, t1 - t0)
            for req in finished:
                req.status = status.FINISHED_LENGTH_CAPPED
                if not self.batched:
                    t0 = pc()
                    mgr.free(req)
                    t1 = pc()
                    rec(OP_FREE, t1 - t0)
                del self.outputs[req.request_id]
                out.append(("finish", req.request_id))
            self.running = [r for r in running if id(r) not in done]
            counters.finishes += len(finished)

        t0 = pc()
        events = mgr.take_events()
        t1 = pc()
        rec(OP_TAKE_EVENTS, t1 - t0)
        t0 = pc()
        stats = mgr.make_prefix_cache_stats()
        t1 = pc()
        rec(OP_MAKE_STATS, t1 - t0)
        t0 = pc()
        usage = mgr.usage
        t1 = pc()
        rec(OP_USAGE, t1 - t0)

        counters.events += len(events)
        counters.steps += 1
        counters.running_sum += len(self.running)
        if check:
            out.append(("events", list(events)))
            from hscache.vllm.parity import prefix_cache_stats_key

            out.append(("stats", prefix_cache_stats_key(stats)))
            out.append(("usage", usage))
            if self._num_free is not None:
                out.append(("free-blocks", self._num_free()))
            out.append(("running", len(self.running), len(self.waiting)))
        if measuring:
            self.result.step_ns.append(self._step_total)
        return out


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
        self.reference = Side(
            "vllm", build_manager(reference_cls, scenario), scenario, self.overhead
        )
        self.candidate = Side(
            "hscache",
            build_manager(candidate_cls, scenario),
            scenario,
            self.overhead,
            batched=batched,
        )
        self.step_index = 0
        self._measured_start: WorkloadCounters | None = None
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
        timer_overhead_ns=driver.overhead,
        wall_s=wall,
        checked=check,
    )


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
    )
