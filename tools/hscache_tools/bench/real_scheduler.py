"""The hybrid scenarios of ``python -m hscache bench``: vLLM's real ``Scheduler`` makes the calls.

A scenario whose ``layout`` is not ``"full"`` (full attention with a sliding window, with
Mamba in ``align`` mode, with chunked local attention: :mod:`hscache_tools.bench.layouts`) runs
here instead of in the emulated step loop of :mod:`hscache_tools.bench.driver`: a hybrid
manager's calls depend on rules of the Scheduler itself (Mamba's block-aligned chunk
splits, copy-on-write hand-offs, skipped-block frees), and emulating them would be a second
copy of vLLM's Scheduler. So each side is vLLM 0.33's own ``Scheduler``, built offline
(:mod:`hscache_tools.testing.offline_scheduler`) over the scenario's layout with the side's manager
class, fed the same request stream (:class:`~hscache_tools.bench.scenarios.TraceGenerator`) and
stub model outputs (the trace's output tokens). Every manager method the Scheduler calls
is timed around the call (:class:`~hscache_tools.bench.scheduler_level.ManagerTimer`), so the
per-step totals, the per-operation table and the ratios mean what they mean for the
emulated scenarios: time in KV-cache bookkeeping. After every step both Schedulers'
decisions (:func:`~hscache_tools.testing.offline_scheduler.summarize_output`) are compared. Each
Scheduler publishes its KV events to a counting publisher (events per step).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

from hscache_tools.bench.layouts import layout_config
from hscache_tools.bench.managers import candidate_events, events_on
from hscache_tools.bench.results import (
    OP_ALLOC_ADMIT,
    OP_ALLOC_RUNNING,
    DivergenceError,
    RunResult,
    SideResult,
    WorkloadCounters,
)
from hscache_tools.bench.scenarios import Scenario, TraceGenerator
from hscache_tools.bench.scheduler_level import ManagerTimer

__all__ = ["RealSchedulerDriver", "run_real_scenario"]


class _CountingPublisher:
    """Where a side's Scheduler publishes its KV events: counts them, keeps nothing."""

    def __init__(self) -> None:
        self.events = 0

    def publish(self, batch: Any) -> None:
        self.events += len(batch.events)

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self) -> None:
        return None


class _RealSide:
    """One vLLM Scheduler over one manager class, with its timings and counters."""

    def __init__(
        self,
        label: str,
        manager_cls: type,
        scenario: Scenario,
        overhead: int,
        candidate: bool = False,
    ) -> None:
        from vllm.v1.core.sched import scheduler as scheduler_module
        from vllm.v1.request import RequestStatus

        from hscache_tools.testing.offline_scheduler import make_scheduler

        lc = layout_config(scenario.layout, scenario.num_blocks)
        # The name vLLM's Scheduler constructs its manager through (as the plugin rebinds it).
        module: Any = scheduler_module
        saved = module.KVCacheManager
        module.KVCacheManager = manager_cls
        try:
            with candidate_events(scenario) if candidate else contextlib.nullcontext():
                self.scheduler = make_scheduler(
                    scheduler_module.Scheduler,
                    lc.kv_cache_config,
                    block_size=lc.scheduler_block_size,
                    max_num_seqs=scenario.max_running,
                    max_num_batched_tokens=scenario.token_budget,
                    # The offline model's max_position_embeddings bound it; the trace's
                    # prompts and outputs stay far below.
                    max_model_len=min(scenario.max_model_len, 16_384),
                    cache=lc.cache,
                    kv_cache_events=events_on(scenario, candidate),
                )
        finally:
            module.KVCacheManager = saved
        self.publisher = _CountingPublisher()
        self.scheduler.kv_event_publisher = self.publisher
        manager = self.scheduler.kv_cache_manager
        self.result = SideResult(label, f"{type(manager).__module__}.{type(manager).__qualname__}")
        self.counters = WorkloadCounters()
        self.hash_block_size = lc.hash_block_size
        self.outputs: dict[str, list[int]] = {}
        self._running = RequestStatus.RUNNING
        self._measuring = False
        self._step_ns = 0
        self._timer = ManagerTimer(manager, self._record, overhead)

    def _record(self, name: str, args: tuple[Any, ...], ns: int) -> None:
        self._step_ns += ns
        if not self._measuring:
            return
        if name == "allocate_slots":
            running = bool(args) and getattr(args[0], "status", None) == self._running
            name = OP_ALLOC_RUNNING if running else OP_ALLOC_ADMIT
        self.result.op_ns.setdefault(name, []).append(ns)

    def add(self, request: Any, output: list[int]) -> None:
        self.outputs[request.request_id] = output
        self.scheduler.add_request(request)

    def step(self, measuring: bool) -> tuple[Any, ...]:
        from hscache_tools.testing.offline_scheduler import stub_runner_output, summarize_output

        sched = self.scheduler
        self._measuring = measuring
        self._step_ns = 0
        out = sched.schedule()
        req_ids = list(out.num_scheduled_tokens)
        requests = sched.requests

        def token_of(i: int) -> int:
            req = requests[req_ids[i]]
            output = self.outputs[req.request_id]
            return int(output[min(req.num_output_tokens, len(output) - 1)])

        c = self.counters
        for rid, n in out.num_scheduled_tokens.items():
            # schedule() advanced num_computed_tokens by the scheduled tokens already.
            if requests[rid].num_computed_tokens <= requests[rid].num_prompt_tokens:
                c.prefill_tokens += n
            else:
                c.decode_tokens += n
        runner_out = stub_runner_output(out, token_of, requests)
        sched.update_from_output(out, runner_out)
        if measuring:
            self.result.step_ns.append(self._step_ns)
        c.steps += 1
        c.admissions += len(out.scheduled_new_reqs)
        c.resumed += len(out.scheduled_cached_reqs.resumed_req_ids)
        c.preemptions += len(out.preempted_req_ids or ())
        c.finishes += len(out.finished_req_ids)
        c.running_sum += len(sched.running)
        c.events = self.publisher.events
        for new in out.scheduled_new_reqs:
            c.hit_tokens += new.num_computed_tokens
            c.query_tokens += len(new.prompt_token_ids or ())
        return summarize_output(out)


class RealSchedulerDriver:
    """Runs one hybrid scenario on two vLLM Schedulers (reference and candidate managers)."""

    def __init__(
        self,
        scenario: Scenario,
        reference_cls: type,
        candidate_cls: type,
        seed: int,
        check: bool,
        overhead: int,
    ) -> None:
        from hscache_tools.testing.requests import (
            init_none_hash,
            make_request,
            request_block_hasher,
        )

        self.scenario = scenario
        self.check = check
        self.reference = _RealSide("vllm", reference_cls, scenario, overhead)
        self.candidate = _RealSide("hscache", candidate_cls, scenario, overhead, candidate=True)
        init_none_hash("sha256")
        hasher = request_block_hasher(self.reference.hash_block_size, "sha256")

        def build(spec: Any) -> Any:
            return make_request(
                spec.request_id,
                spec.prompt,
                max_tokens=len(spec.output),
                block_hasher=hasher,
                arrival_time=0.0,
                ignore_eos=True,
            )

        self._build = build
        self._trace = TraceGenerator(scenario, seed)
        self.step_index = 0
        self._measured_start: WorkloadCounters | None = None
        self._candidate_events_start = 0

    def _top_up(self) -> None:
        sc = self.scenario
        if len(self.reference.scheduler.waiting) >= sc.max_running:
            return
        for spec in self._trace.take(sc.max_running):
            self.reference.add(self._build(spec), spec.output)
            self.candidate.add(self._build(spec), spec.output)

    def steps(self) -> Iterator[int]:

        sc = self.scenario
        gc.collect()
        gc.freeze()
        try:
            while self.step_index < sc.total_steps:
                self._top_up()
                measuring = self.step_index >= sc.warmup_steps
                if measuring and self._measured_start is None:
                    self._measured_start = WorkloadCounters(**vars(self.reference.counters))
                    self._candidate_events_start = self.candidate.counters.events
                # Alternate which side goes first so that cache warmth favours neither.
                sides = (self.reference, self.candidate)
                if self.step_index % 2:
                    sides = sides[::-1]
                decisions = {side.result.label: side.step(measuring) for side in sides}
                if self.check and decisions["vllm"] != decisions["hscache"]:
                    raise DivergenceError(
                        f"step {self.step_index}: the Schedulers decided differently\n"
                        f"  vLLM's manager:  {decisions['vllm']}"[:2000]
                        + f"\n  the candidate:   {decisions['hscache']}"[:2000]
                    )
                self.step_index += 1
                yield self.step_index
        finally:
            gc.unfreeze()

    def measured_counters(self) -> WorkloadCounters:
        start = self._measured_start or WorkloadCounters()
        end = self.reference.counters
        return WorkloadCounters(**{k: v - getattr(start, k) for k, v in vars(end).items()})

    def measured_candidate_events(self) -> int:
        return self.candidate.counters.events - self._candidate_events_start


def run_real_scenario(
    scenario: Scenario,
    reference_cls: type,
    candidate_cls: type,
    seed: int,
    check: bool,
    progress: Callable[[int, int], None] | None,
    timer_overhead_ns: int,
) -> RunResult:
    """:func:`hscache_tools.bench.driver.run_scenario` for a hybrid scenario."""
    t_start = time.perf_counter()
    driver = RealSchedulerDriver(
        scenario, reference_cls, candidate_cls, seed, check, timer_overhead_ns
    )
    for done in driver.steps():
        if progress is not None:
            progress(done, scenario.total_steps)
    return RunResult(
        scenario=scenario,
        seed=seed,
        reference=driver.reference.result,
        candidate=driver.candidate.result,
        counters=driver.reference.counters,
        measured_counters=driver.measured_counters(),
        candidate_events=driver.measured_candidate_events(),
        timer_overhead_ns=timer_overhead_ns,
        wall_s=time.perf_counter() - t_start,
        checked=check,
    )
