"""The steady decode step's fast path (``hscache.vllm.step``) against vLLM's schedulers.

Differential: vLLM's own ``Scheduler`` (over vLLM's manager) and ``hscache.vllm.Scheduler``
with the fast path on get the same seeded stream (bursts of arrivals between stretches of
pure decode, shared prefixes, a small pool that forces preemptions, aborts, finishes by
EOS, stop token ids, ``max_tokens`` and ``max_model_len``, ``min_tokens``, requests asking
for logprobs, repetition detection) and the same sampled tokens. After every step these
must be equal: the whole ``SchedulerOutput`` (every field), the ``EngineCoreOutputs``
(every field but timestamps), the scheduler's step counters and queues, every request's
state (tokens, block hashes, counters, status, events) and the published KV events. Full
attention and a sliding-window hybrid, KV events on and off, a budget that binds.

Async scheduling: vLLM's ``AsyncScheduler`` against ``hscache.vllm.AsyncScheduler``, driven
as vLLM's engine drives it with a batch queue of two (step N+1 is scheduled before step
N's ``update_from_output``; a step that schedules nothing drains the queue), with the same
comparisons after every call.

Mutants: each rule of the fast path (``step.RULES``) broken on its own
(``tests/scheduler/mutants.py``) must make the differential fail.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import zlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache.bench.layouts import layout_config
from hscache.testing.offline_scheduler import make_scheduler
from hscache.testing.requests import init_none_hash, make_request, request_block_hasher
from hscache.vllm import AsyncScheduler as HscacheAsyncScheduler
from hscache.vllm import Scheduler as HscacheScheduler
from hscache.vllm import step as fast_step
from hscache.vllm.block_hasher import get_request_block_hasher as hscache_request_block_hasher
from hscache.vllm.step import rules as step_rules
from hscache.vllm.version import require
from vllm.sampling_params import RepetitionDetectionParams
from vllm.utils.hashing import sha256
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from tests.scheduler import mutants

pytestmark = pytest.mark.vllm

PROFILE = require()

EOS = 3
STOP_ID = 5
VOCAB = 64


@dataclasses.dataclass(frozen=True)
class Scenario:
    layout: str = "full"
    num_blocks: int = 40
    max_num_seqs: int = 12
    max_num_batched_tokens: int = 256
    squeeze_budget: tuple[int, int, int] | None = None
    """(start, tokens, end): from step ``start`` to step ``end`` the token budget (the
    value the constructor reads from ``SchedulerConfig.max_num_scheduled_tokens``) is
    ``tokens``, which binds the running decodes; then it is restored."""
    max_model_len: int = 512
    kv_events: bool = False
    steps: int = 220
    seed: int = 0
    aborts: float = 0.05
    """Per step, the chance that a live request is aborted."""
    abort_waiting: bool = False
    """When admissions were capacity-bound, every waiting request is aborted (so that a
    steady step follows a capacity-bound one)."""
    expect: tuple[str, ...] = ()
    """Boundaries the fast path must have crossed (counters of ``run_differential``)."""
    async_scheduling: bool = False
    """``AsyncScheduler`` on both sides, driven with a batch queue of two."""
    parity: bool = False
    """hscache's Scheduler runs in parity mode (``HSCACHE_PARITY=1``): every manager call
    the fast path makes is also made on vLLM's manager, and answers compared."""
    hscache_hasher: bool = False
    """hscache's requests hash their blocks with hscache's block hasher (as under
    ``hscache.vllm.Scheduler`` in vLLM's engine), whose calls the fast path skips where
    no block completes; vLLM's keep vLLM's."""


SCENARIOS = [
    Scenario(expect=("update_mixed",)),
    Scenario(kv_events=True, seed=1),
    Scenario(seed=2, aborts=0.0, expect=("preempt",)),
    Scenario(seed=2, aborts=0.0, kv_events=True, parity=True, expect=("preempt",)),
    Scenario(
        seed=7, max_num_seqs=6, num_blocks=400, abort_waiting=True, expect=("capacity_reset",)
    ),
    Scenario(layout="full+swa", num_blocks=96, seed=2),
    Scenario(layout="full+swa", num_blocks=96, kv_events=True, seed=3),
    Scenario(num_blocks=400, max_model_len=160, seed=4),
    Scenario(
        max_num_seqs=16,
        num_blocks=200,
        squeeze_budget=(8, 4, 14),
        seed=5,
        expect=("all_token_ids",),
    ),
    Scenario(async_scheduling=True, expect=("update_mixed",)),
    Scenario(async_scheduling=True, kv_events=True, seed=1),
    Scenario(async_scheduling=True, seed=2, aborts=0.0, expect=("preempt",)),
    Scenario(async_scheduling=True, seed=2, aborts=0.0, kv_events=True, parity=True),
    Scenario(async_scheduling=True, layout="full+swa", num_blocks=96, kv_events=True, seed=3),
    Scenario(async_scheduling=True, num_blocks=400, max_model_len=160, seed=4),
    Scenario(kv_events=True, seed=1, hscache_hasher=True),
    Scenario(async_scheduling=True, kv_events=True, seed=1, hscache_hasher=True),
]


def _norm(x: Any) -> Any:
    """A comparable form of scheduler outputs: timestamps dropped, arrays as lists."""
    if isinstance(x, msgspec.Struct):
        return (
            type(x).__name__,
            {f: _norm(getattr(x, f)) for f in x.__struct_fields__ if f not in ("timestamp", "ts")},
        )
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            type(x).__name__,
            {f.name: _norm(getattr(x, f.name)) for f in dataclasses.fields(x) if f.name != "ts"},
        )
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted(repr(_norm(v)) for v in x)
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, Request):
        return ("Request", x.request_id)
    if x is None or isinstance(x, (int, float, str, bytes, bool)):
        return x
    return repr(x)


def _request_state(r: Request) -> tuple[Any, ...]:
    return (
        r.request_id,
        r.status.name,
        r.num_computed_tokens,
        r.num_in_flight_tokens,
        r.is_prefill_chunk,
        list(r._all_token_ids),
        list(r._output_token_ids),
        list(r.block_hashes),
        r.num_preemptions,
        r.stop_reason,
        list(r.spec_token_ids),
        r.num_output_placeholders,
        r.num_stale_output_tokens,
        [(e.type,) for e in r.events],
    )


def _scheduler_state(s: Any) -> tuple[Any, ...]:
    cadence = (s.num_executed_steps, s.last_prefill_step) if PROFILE.prefill_cadence else ()
    return (
        s.current_step,
        cadence,
        s.prefill_capacity_bound,
        sorted(s.prev_step_scheduled_req_ids),
        sorted(s.finished_req_ids),
        sorted(s.reset_preempted_req_ids),
        [r.request_id for r in s.running],
        [r.request_id for r in s.waiting],
        sorted(_request_state(r) for r in s.requests.values()),
        s.kv_cache_manager.block_pool.get_num_free_blocks(),
        list(getattr(s, "_spec_token_placeholders", ())),
    )


def _stream(sc: Scenario, hash_block_size: int, hscache: bool = False) -> Iterator[list[Request]]:
    """Per step, the new requests: bursts separated by stretches without arrivals.
    ``hscache``: they hash their blocks with hscache's hasher (same hashes)."""
    init_none_hash("sha256")
    hasher = (
        hscache_request_block_hasher(hash_block_size, sha256)
        if hscache
        else request_block_hasher(hash_block_size, "sha256")
    )
    rng = random.Random(sc.seed)
    prefixes = [[rng.randrange(VOCAB, 50000) for _ in range(32)] for _ in range(3)]
    n = 0
    for step in range(sc.steps):
        k = rng.choice([6, 8, 10]) if step % 40 == 0 else int(rng.random() < 0.02)
        batch = []
        for _ in range(k):
            prompt = rng.choice(prefixes) + [
                rng.randrange(VOCAB, 50000) for _ in range(rng.randrange(4, 40))
            ]
            kind = rng.randrange(6)
            extra: dict[str, Any] = {}
            if kind == 0:
                extra["ignore_eos"] = True
            elif kind == 1:
                extra["stop_token_ids"] = [STOP_ID]
            elif kind == 2:
                extra["min_tokens"] = rng.randrange(1, 8)
            elif kind == 3:
                extra["logprobs"] = 2
            elif kind == 4:
                extra["repetition_detection"] = RepetitionDetectionParams(
                    max_pattern_size=2, min_count=3
                )
            req = make_request(
                f"r{n}",
                prompt,
                max_tokens=rng.randrange(8, 100),
                block_hasher=hasher,
                **extra,
            )
            params = req.sampling_params
            assert params is not None
            params.update_from_generation_config({}, EOS)
            batch.append(req)
            n += 1
        yield batch


def _token(seed: int, step: int, req_id: str) -> int:
    """One token in five is 9, so that runs of it trigger repetition detection."""
    v = zlib.crc32(f"{seed}:{step}:{req_id}".encode())
    return 9 if v % 5 == 0 else (v // 5) % VOCAB


def _runner_output(sc: Scenario, step: int, out: Any, requests: dict[str, Any]) -> Any:
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = requests[rid]
        partial = req.num_computed_tokens < req.num_tokens
        sampled.append([] if partial else [_token(sc.seed, step, rid)])
    n = len(req_ids)
    logprobs = None
    if n and step % 2:
        ids = np.array([[t[0] if t else 0, 1, 2] for t in sampled], dtype=np.int64)
        logprobs = LogprobsLists(
            ids, np.full((n, 3), -0.5, dtype=np.float32), np.zeros(n, dtype=np.int64)
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=logprobs,
    )


def _build(cls: type, sc: Scenario) -> Any:
    lc = layout_config(sc.layout, sc.num_blocks)
    sched = make_scheduler(
        cls,
        lc.kv_cache_config,
        async_scheduling=sc.async_scheduling,
        block_size=lc.scheduler_block_size,
        cache=lc.cache,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_model_len=sc.max_model_len,
        kv_cache_events=sc.kv_events,
    )
    published: list[Any] = []
    sched.kv_event_publisher.publish = published.append
    return sched, published, lc.hash_block_size


def run_differential(sc: Scenario) -> dict[str, int]:
    """Steps both schedulers; raises AssertionError at the first difference. Returns
    how many steps each phase of the fast path served."""
    served = dict.fromkeys(
        (
            "schedule",
            "update",
            "steps",
            "preempt",
            "all_token_ids",
            "capacity_reset",
            "update_mixed",
        ),
        0,
    )
    ref_cls, cand_cls = (
        (VllmAsyncScheduler, HscacheAsyncScheduler)
        if sc.async_scheduling
        else (VllmScheduler, HscacheScheduler)
    )
    ref, ref_events, hbs = _build(ref_cls, sc)
    with pytest.MonkeyPatch.context() as env:
        if sc.parity:
            env.setenv("HSCACHE_PARITY", "1")
        # The differential proves the fast path on every version, also where the
        # profile has it off (what turning it on there rests on).
        env.setattr(step_rules, "_PROFILE", dataclasses.replace(PROFILE, fast_step=True))
        cand, cand_events, _ = _build(cand_cls, sc)
    assert cand.fast_step
    parity = type(cand.kv_cache_manager).__name__ == "ParityKVCacheManager"
    assert parity == sc.parity, type(cand.kv_cache_manager)
    orig_schedule, orig_split = fast_step.schedule, fast_step.split_update

    def counted_schedule(sched: Any, *a: Any, **kw: Any) -> Any:
        bound = sched.prefill_capacity_bound
        out = orig_schedule(sched, *a, **kw)
        if out is not None:
            served["schedule"] += 1
            served["preempt"] += bool(out.preempted_req_ids)
            served["all_token_ids"] += bool(out.scheduled_cached_reqs.all_token_ids)
            served["capacity_reset"] += bound and not sched.prefill_capacity_bound
        return out

    def counted_split(sched: Any, out: Any, *a: Any, **kw: Any) -> Any:
        split = orig_split(sched, out, *a, **kw)
        if split is not None:
            served["update"] += 1
            served["update_mixed"] += bool(split[0].num_scheduled_tokens)
        return split

    rng = random.Random(sc.seed + 1000)
    # Each scheduler gets its own Request objects (the same stream built twice).
    streams = (_stream(sc, hbs), _stream(sc, hbs, sc.hscache_hasher))
    # Scheduled steps whose update_from_output is still due (the engine's batch queue).
    pending: deque[tuple[int, Any, Any, Any, Any]] = deque()
    depth = 2 if sc.async_scheduling else 1

    def update_oldest() -> None:
        step, out_ref, out_cand, ro_ref, ro_cand = pending.popleft()
        eco_ref = ref.update_from_output(out_ref, ro_ref)
        eco_cand = cand.update_from_output(out_cand, ro_cand)
        assert _norm(eco_cand) == _norm(eco_ref), f"step {step}: EngineCoreOutputs"
        assert _scheduler_state(cand) == _scheduler_state(ref), f"step {step}: after update"
        assert _norm(cand_events) == _norm(ref_events), f"step {step}: KV events"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_step, "schedule", counted_schedule)
        mp.setattr(fast_step, "split_update", counted_split)
        for step, (new_ref, new_cand) in enumerate(zip(*streams, strict=True)):
            served["steps"] += 1
            for a, b in zip(new_ref, new_cand, strict=True):
                ref.add_request(a)
                cand.add_request(b)
            if sc.squeeze_budget is not None:
                start, tokens, end = sc.squeeze_budget
                if step in (start, end):
                    budget = tokens if step == start else ref.max_num_scheduled_tokens_saved
                    ref.max_num_scheduled_tokens_saved = ref.max_num_scheduled_tokens
                    ref.max_num_scheduled_tokens = budget
                    cand.max_num_scheduled_tokens = budget
            live = [*ref.running, *ref.waiting]
            if live and rng.random() < sc.aborts:
                victim = rng.choice(live).request_id
                ref.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
                cand.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            if sc.abort_waiting and ref.prefill_capacity_bound and ref.waiting:
                waiting = [r.request_id for r in ref.waiting]
                ref.finish_requests(waiting, RequestStatus.FINISHED_ABORTED)
                cand.finish_requests(waiting, RequestStatus.FINISHED_ABORTED)
            out_ref = ref.schedule()
            out_cand = cand.schedule()
            assert _norm(out_cand) == _norm(out_ref), f"step {step}: SchedulerOutput"
            assert _scheduler_state(cand) == _scheduler_state(ref), f"step {step}: after schedule"
            ro_ref = _runner_output(sc, step, out_ref, ref.requests)
            ro_cand = _runner_output(sc, step, out_cand, cand.requests)
            # vLLM's engine with async scheduling queues only steps that schedule
            # something, and updates the oldest once the queue is full or nothing new
            # was scheduled.
            if out_ref.total_num_scheduled_tokens or not sc.async_scheduling:
                pending.append((step, out_ref, out_cand, ro_ref, ro_cand))
                if len(pending) >= depth:
                    update_oldest()
            elif pending:
                update_oldest()
        while pending:
            update_oldest()
    return served


@pytest.mark.parametrize(
    "sc",
    SCENARIOS,
    ids=lambda s: (
        f"{s.layout}-seed{s.seed}{'-parity' if s.parity else ''}"
        f"{'-hscache-hasher' if s.hscache_hasher else ''}"
    ),
)
def test_fast_path_makes_vllms_decisions_and_outputs(sc: Scenario) -> None:
    served = run_differential(sc)
    # Both paths ran: the fast path served steady steps, vLLM's code the others.
    least = 1 if sc.squeeze_budget or sc.abort_waiting else served["steps"] // 4
    assert least <= served["schedule"] < served["steps"], served
    for boundary in sc.expect:
        assert served[boundary] > 0, (boundary, served)
    assert served["update"] > served["steps"] // 4, served


def test_stream_exercises_every_boundary() -> None:
    """The stream finishes requests every way and preempts (else the differential
    proves less than it says)."""
    sc = SCENARIOS[0]
    sched, _, hbs = _build(VllmScheduler, sc)
    reasons: set[str] = set()
    preemptions = 0
    for step, new in enumerate(_stream(sc, hbs)):
        for r in new:
            sched.add_request(r)
        out = sched.schedule()
        preemptions += len(out.preempted_req_ids or ())
        eco = sched.update_from_output(out, _runner_output(sc, step, out, sched.requests))
        for outs in eco.values():
            reasons.update(
                str(o.finish_reason) for o in outs.outputs if o.finish_reason is not None
            )
            reasons.update(str(o.stop_reason) for o in outs.outputs if o.stop_reason is not None)
    assert preemptions > 0
    assert {"stop", "length", str(STOP_ID)} <= {r.split(".")[-1].lower() for r in reasons}, reasons


def test_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_FAST_STEP", "0")
    assert not fast_step.enabled()
    sched, _, _ = _build(HscacheScheduler, SCENARIOS[0])
    assert not sched.fast_step
    monkeypatch.setenv("HSCACHE_FAST_STEP", "1")
    assert fast_step.enabled()


@pytest.mark.parametrize(
    "rule",
    [
        *step_rules.GLUE_RULES,
        # The core's mutants exist only in the test-hooks extension.
        *(pytest.param(r, marks=pytest.mark.hooks) for r in step_rules.CORE_RULES),
    ],
)
def test_each_broken_rule_is_caught(rule: str) -> None:
    with mutants.armed(rule):
        for sc in SCENARIOS:
            try:
                run_differential(sc)
            except AssertionError:
                return
    pytest.fail(f"breaking {rule!r} went unnoticed")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mixed", [False, True])
def test_decode_bench_sides_agree(mixed: bool, async_scheduling: bool) -> None:
    """``bench-scheduler --decode`` (``--async-scheduling``): the three sides make the same
    decisions and outputs (``bench_decode`` raises otherwise)."""
    from hscache.bench.decode_step import bench_decode

    r = bench_decode(
        running=8,
        steps=12,
        repeat=1,
        mixed=mixed,
        kv_events=mixed,
        async_scheduling=async_scheduling,
    )
    assert r["vllm_us"] > 0 and r["hscache+fast_us"] > 0
