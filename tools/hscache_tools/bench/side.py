"""One side of ``python -m hscache bench``: a manager, its scheduler state, its timed calls.

Owns :class:`Side`: one ``KVCacheManager`` with its private waiting / running queues and
``Request`` objects, stepped through one vLLM 0.33 Scheduler step at a time. The scheduling
loops are :mod:`hscache_tools.testing.scheduler_step`'s (the same emulation the differential tests
use); ``Side`` is their policy: it makes each manager call timed (``perf_counter_ns`` around
the call only, the timer's own cost subtracted, per operation), and records the step's
decisions for the lock-step comparison of :mod:`hscache_tools.bench.driver`.

The per-step call sequence: ``new_step_starts``; ``allocate_slots`` for running requests
with preemption from the tail on ``None`` (or, on the candidate's batched path, one
``allocate_slots_batch``); ``get_computed_blocks`` → ``allocate_slots`` (timed apart when it
refuses) → ``record_prefix_cache_stats`` → ``get_blocks`` for admissions; ``get_block_ids`` and
``take_new_block_ids`` while building the output; after the "model": token appends, ``free``
(or ``free_batch``) on finish, ``take_events``, ``make_prefix_cache_stats``, ``usage``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from hscache_tools.bench.results import (
    OP_ALLOC_ADMIT,
    OP_ALLOC_BATCH,
    OP_ALLOC_REFUSED,
    OP_ALLOC_RUNNING,
    OP_BLOCK_IDS,
    OP_FREE,
    OP_FREE_BATCH,
    OP_GET_BLOCKS,
    OP_HANDLE,
    OP_LOOKUP,
    OP_MAKE_STATS,
    OP_NEW_STEP,
    OP_RECORD_STATS,
    OP_TAKE_EVENTS,
    OP_TAKE_NEW_IDS,
    OP_USAGE,
    SideResult,
    WorkloadCounters,
)
from hscache_tools.bench.scenarios import Scenario
from hscache_tools.testing.scheduler_step import (
    NEW,
    RESUMED,
    Admit,
    Admitted,
    Scheduled,
    StepSchedule,
    running_num_new_tokens,
    schedule_running,
    schedule_waiting,
)

__all__ = ["BATCHED", "Decision", "Side"]

Decision = tuple[Any, ...]

# Scheduled.kind of the batched path's entries: their blocks are the new ids (an array).
BATCHED = 3


class Side:
    """One manager and its private copy of the scheduler state (waiting / running queues);
    the :class:`~hscache_tools.testing.scheduler_step.SchedulerPolicy` of its steps."""

    def __init__(
        self,
        label: str,
        manager: Any,
        scenario: Scenario,
        timer_overhead_ns: int,
        batched: bool = False,
        compare_events: Callable[[list[Any]], Any] | None = list,
    ) -> None:
        """``compare_events``: what of a step's events the decision check compares
        (``None``: nothing, for a side whose counterpart publishes no events)."""
        from vllm.v1.request import RequestStatus

        self.label = label
        self.batched = batched
        self.compare_events = compare_events
        # Batched path: request id -> handle, taken when a request is admitted.
        self.handles: dict[str, int] = {}
        self.manager = manager
        self.scenario = scenario
        self.max_running = scenario.max_running
        self.overhead = timer_overhead_ns
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self.outputs: dict[str, list[int]] = {}
        self.result = SideResult(label, f"{type(manager).__module__}.{type(manager).__qualname__}")
        self.counters = WorkloadCounters()
        self._measuring = False
        self._step_total = 0
        self._status = RequestStatus
        self._out: list[Decision] = []
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

    # ---- the scheduler_step policy: one timed manager call each ------------------------

    def num_new_tokens(self, request: Any, budget: int) -> int:
        return running_num_new_tokens(request, budget, self.scenario.max_model_len)

    def allocate_running(self, request: Any, num_new_tokens: int) -> Any:
        pc = time.perf_counter_ns
        t0 = pc()
        blocks = self.manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=0)
        t1 = pc()
        self._rec(OP_ALLOC_RUNNING, t1 - t0)
        return blocks

    def preempt(self, request: Any) -> None:
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
        self._out.append(("preempt", request.request_id))

    def admit(self, request: Any, budget: int) -> Admitted | Admit:
        """Admission of the head of the waiting queue: lookup, allocation, stats, blocks."""
        mgr = self.manager
        pc = time.perf_counter_ns
        rec = self._rec
        t0 = pc()
        computed, hit, boundary = mgr.get_computed_blocks(request, None)
        t1 = pc()
        rec(OP_LOOKUP, t1 - t0)
        request.shared_prefix_boundary = boundary
        n = min(request.num_tokens - hit, budget)
        t0 = pc()
        blocks = mgr.allocate_slots(
            request,
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
            has_scheduled_reqs=bool(self.running),
        )
        t1 = pc()
        rec(OP_ALLOC_ADMIT if blocks is not None else OP_ALLOC_REFUSED, t1 - t0)
        counters = self.counters
        if blocks is None:
            counters.admission_failures += 1
            self._out.append(("admit-fail", request.request_id, hit))
            return Admit.STOP
        if self.batched:
            t0 = pc()
            handle = mgr.request_handle(request.request_id)
            t1 = pc()
            rec(OP_HANDLE, t1 - t0)
            self.handles[request.request_id] = handle
        t0 = pc()
        mgr.record_prefix_cache_stats(request, hit)
        t1 = pc()
        rec(OP_RECORD_STATS, t1 - t0)
        t0 = pc()
        full = mgr.get_blocks(request.request_id)
        t1 = pc()
        rec(OP_GET_BLOCKS, t1 - t0)
        status = self._status
        kind = NEW if request.status == status.WAITING else RESUMED
        request.status = status.RUNNING
        request.num_computed_tokens = hit
        counters.admissions += 1
        counters.resumed += kind == RESUMED
        counters.hit_tokens += hit
        counters.query_tokens += request.num_tokens
        return Admitted(n, full, kind)

    # ---- the batched running loop (the candidate's own API; vLLM has no equivalent) ----

    def _schedule_running_batched(self, budget: int, step: StepSchedule[Any]) -> int:
        """The running loop with one ``allocate_slots_batch`` call (``--batched``).

        The per-request token counts are the per-call loop's (they depend only on the
        budget, and a preemption only removes requests from the tail, which have not
        been scheduled yet). The loop that computes them reads each request's
        ``num_computed_tokens`` anyway and also collects the handles (taken, timed,
        once per admission); it is untimed like the per-call loop's own argument
        computation, and only the batched call is timed.
        """
        max_model_len = self.scenario.max_model_len
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
            n = running_num_new_tokens(req, budget, max_model_len)
            if n <= 0:
                continue
            reqs.append(req)
            handles.append(handle_of[req.request_id])
            computed.append(req.num_computed_tokens)
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
                step.scheduled.append(
                    Scheduled(reqs[e], counts[e], ids[offsets[j] : offsets[j + 1]], BATCHED)
                )
            start += result.num_allocated
            if start == len(reqs):
                break
            # Entry `start` did not fit: preempt from the tail and retry it, as the
            # per-call loop does after a None.
            req = reqs[start]
            victim = running.pop()
            self.preempt(victim)
            step.preempted.append(victim)
            if victim is req:
                break
            # The victim came from the tail of the running queue, so it is the last
            # pending entry or was never gathered: drop it from the pending entries.
            if reqs[-1] is victim:
                del reqs[-1], handles[-1], computed[-1], counts[-1]
        # Budget left: only the scheduled entries consumed theirs.
        return initial_budget - sum(counts[:start])

    # ---- one step ----------------------------------------------------------------------

    def step(self, measuring: bool, check: bool) -> list[Decision]:
        """One scheduler step + model output; returns the decisions made (for comparison)."""
        # One piece: one emulated scheduler step in vLLM's order (schedule, block ids handed
        # over, model output, frees, events, stats, usage), each manager call timed where vLLM
        # makes it, with the timers bound to locals so that timing adds no calls.
        sc = self.scenario
        mgr = self.manager
        pc = time.perf_counter_ns
        rec = self._rec
        status = self._status
        counters = self.counters
        self._measuring = measuring
        self._step_total = 0
        out: list[Decision] = []
        self._out = out

        t0 = pc()
        mgr.new_step_starts()
        t1 = pc()
        rec(OP_NEW_STEP, t1 - t0)

        # --- schedule(): running requests (decode, prefill chunks), then admissions ---
        plan: StepSchedule[Any] = StepSchedule()
        budget = sc.token_budget
        if self.batched:
            budget = self._schedule_running_batched(budget, plan)
        else:
            budget = schedule_running(self.running, budget, self, plan)
        if not plan.preempted:
            schedule_waiting(self.waiting, self.running, budget, self, plan)
        scheduled = plan.scheduled

        # --- scheduler output: block ids handed to the workers ---
        for entry in scheduled:
            req, n, blocks, kind = entry.item, entry.num_new_tokens, entry.blocks, entry.kind
            if kind == BATCHED:
                # Batched: the new ids are already arrays; lists only for the check.
                ids = (blocks.tolist(),) if len(blocks) else None
                if check:
                    hashes = req.block_hashes
                    out.append(("sched", req.request_id, 0, n, ids, type(hashes), len(hashes)))
                continue
            if kind == NEW:
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
        for entry in scheduled:
            req, n = entry.item, entry.num_new_tokens
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
            self.running = [r for r in self.running if id(r) not in done]
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
            if self.compare_events is not None:
                out.append(("events", self.compare_events(events)))
            from hscache.vllm.parity import prefix_cache_stats_key

            out.append(("stats", prefix_cache_stats_key(stats)))
            out.append(("usage", usage))
            if self._num_free is not None:
                out.append(("free-blocks", self._num_free()))
            out.append(("running", len(self.running), len(self.waiting)))
        if measuring:
            self.result.step_ns.append(self._step_total)
        return out
