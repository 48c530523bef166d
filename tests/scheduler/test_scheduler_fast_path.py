"""The steady decode step's fast path (``hscache.vllm.step``) against vLLM's schedulers.

Differential: vLLM's own ``Scheduler`` (over vLLM's manager) and ``hscache.vllm.Scheduler``
with the fast path on get the same seeded stream (bursts of arrivals between stretches of
pure decode, shared prefixes, a small pool that forces preemptions, aborts, finishes by
EOS, stop token ids, ``max_tokens`` and ``max_model_len``, ``min_tokens``, requests asking
for logprobs, repetition detection) and the same sampled tokens. After every step these
must be equal: the whole ``SchedulerOutput`` (every field), the ``EngineCoreOutputs``
(every field but timestamps), the scheduler's step counters and queues, every request's
state (tokens, block hashes, counters, status, events) and the published KV events. Full
attention and a sliding-window hybrid, KV events on and off, a budget that binds, and a
queue that vLLM's waiting loop cannot admit from (the running decodes at ``max_num_seqs``,
or a token budget they spend), sync and async.

Async scheduling: vLLM's ``AsyncScheduler`` against ``hscache.vllm.AsyncScheduler``, driven
as vLLM's engine drives it with a batch queue of two (step N+1 is scheduled before step
N's ``update_from_output``; a step that schedules nothing drains the queue), with the same
comparisons after every call.

Mutants: each rule of the fast path (``step.RULES``) broken on its own
(``tests/scheduler/mutants.py``) must make the differential fail.

The harness (``differential.py``, shared with ``test_fast_path_boundaries.py``) asserts
that hscache's core served and holds each scenario to its floors: how many steps each
phase of the fast path served.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache.vllm import Scheduler as HscacheScheduler
from hscache.vllm import step as fast_step
from hscache.vllm.step import rules as step_rules
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from tests.scheduler import mutants
from tests.scheduler.differential import (
    PROFILE,
    STOP_ID,
    Scenario,
    _build,
    _runner_output,
    _stream,
    check_floors,
    run_differential,
)

pytestmark = pytest.mark.vllm


def _chunked(**kw: Any) -> list[Scenario]:
    """A chunked-prefill scenario (long prompts, a budget of 64), sync then async."""
    base = {
        "long_prompts": 0.4,
        "max_num_batched_tokens": 64,
        "num_blocks": 200,
        "expect": ("chunk", "chunk_decode"),
        **kw,
    }
    return [Scenario(**base), Scenario(**{**base, "async_scheduling": True})]


SCENARIOS = [
    Scenario(expect=("update_mixed",)),
    Scenario(kv_events=True, seed=1),
    Scenario(seed=2, aborts=0.0, expect=("preempt",)),
    Scenario(seed=2, aborts=0.0, kv_events=True, parity=True, expect=("preempt",)),
    Scenario(
        seed=7,
        max_num_seqs=6,
        num_blocks=400,
        abort_waiting=True,
        expect=("capacity_reset",),
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
    # A queue behind full seats (max_num_seqs running decodes): vLLM's waiting loop
    # stops before it looks at a request, so the fast path serves the step.
    Scenario(max_num_seqs=6, num_blocks=400, seed=11, expect=("queue_seats",)),
    Scenario(
        max_num_seqs=6, num_blocks=400, seed=12, async_scheduling=True, expect=("queue_seats",)
    ),
    # A queue behind a spent token budget (seats free): the same exit of that loop.
    Scenario(
        max_num_seqs=16,
        num_blocks=400,
        squeeze_budget=(20, 6, 200),
        seed=13,
        expect=("queue_budget", "queue_seats"),
    ),
    Scenario(
        max_num_seqs=16,
        num_blocks=400,
        squeeze_budget=(42, 5, 200),
        seed=16,
        async_scheduling=True,
        expect=("queue_budget",),
    ),
    # Prefill chunks among decodes: long prompts chunked under a small budget, with
    # long_prefill_token_threshold unset, set and adaptive, a queue behind full seats
    # while a prefill continues, preemption, the prefill cadence and the DP throttle.
    *_chunked(seed=21),
    *_chunked(seed=22, long_prefill_token_threshold=24),
    _chunked(seed=23, long_prefill_token_threshold=8, adaptive_threshold=True)[0],
    Scenario(
        seed=24,
        max_num_seqs=6,
        long_prompts=0.4,
        max_num_batched_tokens=96,
        num_blocks=400,
        long_prefill_token_threshold=32,
        expect=("chunk", "queue_seats"),
    ),
    Scenario(
        seed=24,
        async_scheduling=True,
        max_num_seqs=6,
        long_prompts=0.4,
        max_num_batched_tokens=96,
        num_blocks=400,
        long_prefill_token_threshold=32,
        expect=("chunk", "queue_seats"),
    ),
    Scenario(
        seed=32,
        aborts=0.0,
        long_prompts=0.3,
        max_num_batched_tokens=64,
        num_blocks=60,
        expect=("chunk", "preempt"),
    ),
    Scenario(
        seed=32,
        aborts=0.0,
        long_prompts=0.3,
        max_num_batched_tokens=64,
        num_blocks=60,
        async_scheduling=True,
        expect=("chunk", "preempt"),
    ),
    _chunked(seed=26, prefill_interval=3, throttle_every=5)[0],
    _chunked(seed=27, layout="full+swa", kv_events=True)[0],
]

# Per scenario, (schedule_floor, update_floor): three quarters of the steps each phase of
# the fast path served on vLLM 0.33, steps with a queue the waiting loop cannot admit
# from included (the traces are seeded: a count only moves when the scheduler or the
# fast path does), so that a fast path that silently declines fails.
FLOORS = [
    (134, 164),  # served 179, 219
    (156, 161),  # served 209, 215
    (87, 164),  # served 116, 219
    (87, 164),  # served 116, 219
    (150, 123),  # served 201, 165
    (153, 164),  # served 204, 219
    (155, 162),  # served 207, 216
    (156, 156),  # served 208, 208
    (153, 164),  # served 204, 219
    (123, 121),  # served 165, 162
    (152, 111),  # served 203, 148
    (83, 123),  # served 111, 165
    (83, 123),  # served 111, 165
    (144, 88),  # served 192, 118
    (147, 144),  # served 197, 193
    (156, 161),  # served 209, 215
    (152, 111),  # served 203, 148
    (143, 164),  # served 191, 219
    (132, 154),  # served 177, 206
    (59, 152),  # served 79, 203
    (55, 148),  # served 74, 198
    (132, 148),  # served 177, 198
    (126, 93),  # served 169, 125
    (139, 162),  # served 186, 217
    (127, 130),  # served 170, 174
    (152, 150),  # served 203, 200
    (144, 163),  # served 192, 218
    (133, 135),  # served 178, 180
    (79, 160),  # served 106, 214
    (75, 119),  # served 101, 159
    (118, 144),  # served 158, 192
    (136, 162),  # served 182, 217
]
SCENARIOS = [
    dataclasses.replace(sc, schedule_floor=s, update_floor=u)
    for sc, (s, u) in zip(SCENARIOS, FLOORS, strict=True)
]


@pytest.mark.parametrize(
    "sc",
    SCENARIOS,
    ids=lambda s: (
        f"{s.layout}-seed{s.seed}{'-parity' if s.parity else ''}"
        f"{'-hscache-hasher' if s.hscache_hasher else ''}"
    ),
)
def test_fast_path_makes_vllms_decisions_and_outputs(sc: Scenario) -> None:
    counts = run_differential(sc)
    check_floors(sc, counts)


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


# Rules of a mechanism this vLLM's schedule() does not have (0.32 and 0.30: no prefill
# cadence): their mutant has nothing to break here.
_ABSENT_RULES = set() if PROFILE.prefill_cadence else {"last_prefill_step"}


@pytest.mark.parametrize(
    "rule",
    [
        *(r for r in step_rules.GLUE_RULES if r not in _ABSENT_RULES),
        # The core's mutants exist only in the test-hooks extension.
        *(
            pytest.param(r, marks=pytest.mark.hooks)
            for r in step_rules.CORE_RULES
            if r not in _ABSENT_RULES
        ),
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
    from hscache_tools.bench.decode_step import bench_decode

    r = bench_decode(
        running=8,
        steps=12,
        repeat=1,
        mixed=mixed,
        kv_events=mixed,
        async_scheduling=async_scheduling,
    )
    assert r["vllm_us"] > 0 and r["hscache+fast_us"] > 0
