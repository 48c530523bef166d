"""The scheduler differential of the fast path, shared by ``test_scheduler_fast_path.py``
and ``test_fast_path_boundaries.py``.

:func:`run_differential` steps vLLM's own ``Scheduler`` / ``AsyncScheduler`` (over vLLM's
manager) and hscache's (the fast path forced on) on the same seeded stream
(:func:`_stream`) and sampled tokens, and after every call compares the whole
``SchedulerOutput``, the ``EngineCoreOutputs`` (timestamps aside), the step counters and
queues, every request's state and the published KV events. It asserts that hscache's
core serves the candidate (``KVCacheCore``, or the parity manager over it), not vLLM's
manager after a fallback, and counts per phase what the fast path did;
:func:`check_floors` then holds each scenario to its floors (``Scenario.schedule_floor``,
``update_floor``), so that a fast path that silently declines fails. Where the scheduler
has ``fast_path_counts`` (the per-phase counters of ``hscache.vllm.Scheduler``), they
must agree with the harness's own counts.

A scenario file adapts the run through hooks: how the schedulers are built, the model's
outputs, what a new batch of requests carries, a check after each update, and counts of
its own taken from each split.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import vllm
from hscache._core import KVCacheCore
from hscache.vllm import AsyncScheduler as HscacheAsyncScheduler
from hscache.vllm import Scheduler as HscacheScheduler
from hscache.vllm import step as fast_step
from hscache.vllm.block_hasher import get_request_block_hasher as hscache_request_block_hasher
from hscache.vllm.step import rules as step_rules
from hscache.vllm.version import require
from hscache_tools.bench.layouts import layout_config
from hscache_tools.testing.offline_scheduler import make_scheduler
from hscache_tools.testing.requests import init_none_hash, make_request, request_block_hasher
from vllm.sampling_params import RepetitionDetectionParams
from vllm.utils.hashing import sha256
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

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
    long_prompts: float = 0.0
    """The share of new requests whose prompt is 100-400 tokens longer (chunked under a
    small budget: prefill chunks among decodes)."""
    long_prefill_token_threshold: int = 0
    """``SchedulerConfig.long_prefill_token_threshold`` (0: none)."""
    adaptive_threshold: bool = False
    """The threshold is floored at a fair share of the input budget
    (``adaptive_long_prefill_threshold``, 0.33 / 0.32)."""
    prefill_interval: int = 0
    """The local prefill cadence (``local_prefill_interval``, 0.33; 0: the default, none)."""
    throttle_every: int = 0
    """Every this many steps ``schedule(throttle_prefills=True)`` (vLLM's DP throttle;
    0: never)."""
    schedule_floor: int | None = None
    """The least number of ``schedule()`` steps the fast path must serve (None: a quarter
    of the steps; 0 with ``schedule_served=False``: it must serve none)."""
    update_floor: int | None = None
    """The least number of ``update_from_output()`` steps it must split (None: a quarter
    of the steps)."""
    schedule_served: bool = True
    """Whether the fast path must serve some ``schedule()`` calls (else: none)."""
    update_served: bool = True
    """Whether it must serve some requests' ``update_from_output()`` (else: none)."""


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
            if sc.long_prompts and rng.random() < sc.long_prompts:
                prompt += [rng.randrange(VOCAB, 50000) for _ in range(rng.randrange(100, 400))]
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
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
    )
    if sc.adaptive_threshold and PROFILE.long_prefill_eligibility:
        sched.adaptive_long_prefill_threshold = True
    if sc.prefill_interval and PROFILE.prefill_cadence:
        sched.local_prefill_interval = sc.prefill_interval
        sched.last_prefill_step = -sc.prefill_interval
    published: list[Any] = []
    sched.kv_event_publisher.publish = published.append
    return sched, published, lc.hash_block_size


COUNTS = (
    "steps",
    "schedule_tried",
    "schedule",
    "update_tried",
    "update",
    "update_requests",
    "update_mixed",
    "preempt",
    "all_token_ids",
    "capacity_reset",
    "queue_seats",
    "queue_budget",
    "chunk",
    "chunk_decode",
)
"""What :func:`run_differential` counts: steps; ``schedule()`` calls the fast path was
asked (``schedule_tried``) and served; ``update_from_output()`` calls asked and split,
the requests it served in them, splits that left requests to vLLM (``update_mixed``);
served steps that preempted, carried ``all_token_ids``, or reset a capacity bound; served
steps with a queue (not preempting) behind full seats (``queue_seats``: the running
requests at ``max_num_seqs``) or a spent token budget (``queue_budget``, seats free);
served steps that scheduled a prefill chunk of more than one token (``chunk``), and among
them steps that also scheduled a decode (``chunk_decode``)."""


def _queue_exit(sched: Any) -> str | None:
    """Which of vLLM's waiting-loop exits a step with a queue meets, before it is
    scheduled (every running request counted as one token): ``"queue_seats"``,
    ``"queue_budget"``, or None (no queue, or the loop could admit)."""
    if PROFILE.kv_holding_queues:
        queued = sched.waiting or sched.kv_holding_waiting
    else:
        queued = sched.waiting or sched.skipped_waiting
    n = len(sched.running)
    if not queued:
        return None
    if n >= getattr(sched, PROFILE.waiting_loop_seats):
        return "queue_seats"
    budget = min(sched.max_num_scheduled_tokens, sched.scheduler_config.max_num_batched_tokens)
    return "queue_budget" if n >= budget else None


@dataclasses.dataclass
class Hooks:
    """How a scenario file adapts :func:`run_differential` (defaults: the plain stream)."""

    build: Callable[[type, Any], tuple[Any, list[Any], int]] = lambda cls, sc: _build(cls, sc)
    """``(scheduler, published KV events, hash block size)`` of ``cls`` for the scenario."""
    runner_output: Callable[[Any, int, Any, dict[str, Any]], Any] = lambda sc, step, out, reqs: (
        _runner_output(sc, step, out, reqs)
    )
    """The model's output for a scheduled step."""
    batch: Callable[[list[Request]], list[Request]] = lambda batch: batch
    """What a new batch of requests carries (applied to each side's)."""
    after_update: Callable[[Any, Any, int, Any, Any], None] = lambda ref, cand, s, a, b: None
    """Run after both sides' ``update_from_output`` of step ``s`` (outputs ``a``, ``b``)."""
    count_split: Callable[[Any, Any, dict[str, int]], None] = lambda sched, rest, counts: None
    """Counts of the scenario's own from a split (``rest``: the part left to vLLM)."""


def _core_serves(sc: Any, cand: Any) -> None:
    """hscache's core serves the candidate, not vLLM's manager after a fallback (vLLM
    0.30's Mamba rules are not built: its Mamba layouts fall back, logged and allowlisted
    in docs/vllm_versions.md, which proves nothing here)."""
    manager = cand.kv_cache_manager
    parity = type(manager).__name__ == "ParityKVCacheManager"
    assert parity == sc.parity, type(manager)
    core = manager.hscache if parity else manager
    if not isinstance(core, KVCacheCore):
        if "mamba" in sc.layout and vllm.__version__.startswith("0.30."):
            pytest.skip("vLLM 0.30's Mamba rules are not built: hscache falls back")
        raise AssertionError(f"{type(core)} serves the candidate")


def _agree_with_scheduler_counts(cand: Any, counts: dict[str, int]) -> None:
    """The scheduler's own per-phase counters, where it has them, are the harness's."""
    own = getattr(cand, "fast_path_counts", None)
    if own is None:
        return
    assert own["schedule_steps"] == counts["schedule_tried"], (own, counts)
    assert own["schedule_served"] == counts["schedule"], (own, counts)
    assert own["update_served"] == counts["update_requests"], (own, counts)


def run_differential(
    sc: Any, hooks: Hooks | None = None, extra: tuple[str, ...] = ()
) -> dict[str, int]:
    """Steps both schedulers; raises AssertionError at the first difference. Returns
    :data:`COUNTS` (and the ``extra`` counts of ``hooks.count_split``)."""
    hooks = hooks or Hooks()
    counts = dict.fromkeys((*COUNTS, *extra), 0)
    ref_cls, cand_cls = (
        (VllmAsyncScheduler, HscacheAsyncScheduler)
        if sc.async_scheduling
        else (VllmScheduler, HscacheScheduler)
    )
    ref, ref_events, hbs = hooks.build(ref_cls, sc)
    with pytest.MonkeyPatch.context() as env:
        for name in ("HSCACHE_DISABLE", "HSCACHE_PARITY", "HSCACHE_FAST_STEP"):
            env.delenv(name, raising=False)
        if sc.parity:
            env.setenv("HSCACHE_PARITY", "1")
        # The differential proves the fast path on every version, also where the
        # profile has it off (what turning it on there rests on).
        env.setattr(step_rules, "_PROFILE", dataclasses.replace(PROFILE, fast_step=True))
        cand, cand_events, _ = hooks.build(cand_cls, sc)
    assert cand.fast_step
    _core_serves(sc, cand)
    orig_schedule, orig_split = fast_step.schedule, fast_step.split_update

    def counted_schedule(sched: Any, *a: Any, **kw: Any) -> Any:
        counts["schedule_tried"] += 1
        bound = sched.prefill_capacity_bound
        exit_ = _queue_exit(sched)
        out = orig_schedule(sched, *a, **kw)
        if out is not None:
            counts["schedule"] += 1
            if exit_ is not None and not out.preempted_req_ids:
                counts[exit_] += 1
            counts["preempt"] += bool(out.preempted_req_ids)
            counts["all_token_ids"] += bool(out.scheduled_cached_reqs.all_token_ids)
            counts["capacity_reset"] += bound and not sched.prefill_capacity_bound
            sizes = set(out.num_scheduled_tokens.values())
            chunked = any(k > 1 for k in sizes)
            counts["chunk"] += chunked
            counts["chunk_decode"] += chunked and 1 in sizes
        return out

    def counted_split(sched: Any, out: Any, *a: Any, **kw: Any) -> Any:
        counts["update_tried"] += 1
        split = orig_split(sched, out, *a, **kw)
        if split is not None:
            rest, built = split
            counts["update"] += 1
            counts["update_requests"] += len(built)
            counts["update_mixed"] += bool(rest.num_scheduled_tokens)
            hooks.count_split(sched, rest, counts)
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
        hooks.after_update(ref, cand, step, out_ref, out_cand)
        assert _scheduler_state(cand) == _scheduler_state(ref), f"step {step}: after update"
        assert _norm(cand_events) == _norm(ref_events), f"step {step}: KV events"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_step, "schedule", counted_schedule)
        mp.setattr(fast_step, "split_update", counted_split)
        for step, (new_ref, new_cand) in enumerate(zip(*streams, strict=True)):
            counts["steps"] += 1
            for a, b in zip(hooks.batch(new_ref), hooks.batch(new_cand), strict=True):
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
            throttle = bool(sc.throttle_every) and step % sc.throttle_every == 0
            out_ref = ref.schedule(throttle_prefills=throttle)
            out_cand = cand.schedule(throttle_prefills=throttle)
            assert _norm(out_cand) == _norm(out_ref), f"step {step}: SchedulerOutput"
            assert _scheduler_state(cand) == _scheduler_state(ref), f"step {step}: after schedule"
            ro_ref = hooks.runner_output(sc, step, out_ref, ref.requests)
            ro_cand = hooks.runner_output(sc, step, out_cand, cand.requests)
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
    _agree_with_scheduler_counts(cand, counts)
    return counts


def check_floors(sc: Any, counts: dict[str, int]) -> None:
    """The fast path was asked at every step and served what the scenario's floors say
    (a silent decline fails); the boundaries the scenario is there for were crossed."""
    steps = counts["steps"]
    assert counts["schedule_tried"] >= steps, counts
    assert counts["update_tried"] > steps // 2, counts
    if sc.schedule_served:
        floor = steps // 4 if sc.schedule_floor is None else sc.schedule_floor
        assert max(floor, 1) <= counts["schedule"] < counts["schedule_tried"], (floor, counts)
    else:
        assert counts["schedule"] == 0, counts
    if sc.update_served:
        floor = steps // 4 if sc.update_floor is None else sc.update_floor
        assert max(floor, 1) <= counts["update"] < counts["update_tried"], (floor, counts)
        assert counts["update_requests"] > counts["update"], counts
    else:
        assert counts["update"] == 0, counts
    for boundary in sc.expect:
        assert counts[boundary] > 0, (boundary, counts)
