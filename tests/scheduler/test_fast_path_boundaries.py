"""The steady decode step's fast path at its boundaries: spec decoding, structured output,
KV connectors and every layout family, against vLLM's schedulers.

The same differential as ``test_scheduler_fast_path.py`` (the shared harness
``differential.py``: its stream, comparisons, runner outputs, the check that hscache's
core served, and the per-scenario floors of what each phase served): vLLM's own
``Scheduler`` / ``AsyncScheduler`` and hscache's with the fast path forced on get the
same seeded stream and sampled tokens, and after every call the whole
``SchedulerOutput``, the ``EngineCoreOutputs``, the step counters and queues, every
request's state and the published KV events must be equal. Here the stream
crosses the fast path's boundaries, and each scenario asserts what the fast path did
there (how many steps and requests it served, how many it left to vLLM):

- speculative decoding (an ngram ``SpeculativeConfig``, drafts fed back with
  ``update_draft_token_ids`` as vLLM's engine does, some accepted by the stub model):
  the fast path declines every ``schedule()`` and every ``update_from_output()``;
- structured output (a request with ``structured_output_request`` set, its grammar a
  stub that accepts every token but one): steps with such a request running are vLLM's,
  and ``update_from_output()`` leaves those requests to vLLM and serves the others;
- a KV connector (vLLM's ``ExampleConnector`` over an empty directory): the fast path
  declines both phases;
- the layout families beyond full attention and full + sliding window (which
  ``test_scheduler_fast_path.py`` runs): full + chunked local attention, full + Mamba in
  ``align`` mode (vLLM's block-aligned split: the fast path declines ``schedule()``) and
  in ``none`` mode (prefix caching off: it serves).

Blind mutants: each boundary hidden from the fast path for one phase must make the
differential fail (else the scenario would not see it). And the decode bench
(``bench-scheduler --decode --layout``) runs the hybrids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hscache.vllm import step as fast_step
from hscache_tools.bench.layouts import layout_config
from hscache_tools.testing.offline_scheduler import make_scheduler
from vllm.config import KVTransferConfig, SpeculativeConfig
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request

from tests.scheduler.differential import (
    Hooks,
    Scenario,
    _runner_output,
    _stream,
    _token,
    check_floors,
    run_differential,
)

pytestmark = pytest.mark.vllm

REJECT = 13
"""The one token the stub grammar rejects (vLLM then finishes the request with an error)."""


@dataclasses.dataclass(frozen=True)
class Boundary(Scenario):
    """A scenario of ``test_scheduler_fast_path.py`` with a boundary of the fast path."""

    spec_tokens: int = 0
    """Speculative decoding with this many ngram drafts per step (0: off)."""
    structured: int = 0
    """Every ``structured``-th request uses structured output (0: none)."""
    connector: bool = False
    """vLLM's ``ExampleConnector`` over an empty directory."""


SPEC = Boundary(spec_tokens=2, aborts=0.0, schedule_served=False, update_served=False)
STRUCTURED = Boundary(structured=4, expect=("update_mixed", "structured_left"))
STRUCTURED_ASYNC = Boundary(
    structured=4, seed=1, async_scheduling=True, expect=("structured_left",)
)
CONNECTOR = Boundary(connector=True, schedule_served=False, update_served=False)
CONNECTOR_ASYNC = Boundary(
    connector=True, seed=1, async_scheduling=True, schedule_served=False, update_served=False
)

BOUNDARIES = [
    # Speculative decoding: both phases declined, every step.
    SPEC,
    Boundary(spec_tokens=3, seed=1, kv_events=True, schedule_served=False, update_served=False),
    Boundary(
        spec_tokens=2,
        seed=2,
        async_scheduling=True,
        schedule_served=False,
        update_served=False,
    ),
    # Structured output among plain decodes.
    STRUCTURED,
    Boundary(structured=3, seed=3, kv_events=True, expect=("update_mixed", "structured_left")),
    STRUCTURED_ASYNC,
    Boundary(structured=5, layout="full+swa", num_blocks=96, seed=4, expect=("update_mixed",)),
    # A KV connector: both phases declined.
    CONNECTOR,
    CONNECTOR_ASYNC,
    # Layout families.
    Boundary(layout="full+chunked", num_blocks=96, seed=2, expect=("update_mixed",)),
    Boundary(layout="full+chunked", num_blocks=96, kv_events=True, seed=5, async_scheduling=True),
    Boundary(layout="full+mamba-none", num_blocks=120, seed=6, expect=("update_mixed",)),
    Boundary(layout="full+mamba-none", num_blocks=120, seed=7, async_scheduling=True),
    # Mamba 'align': vLLM's block-aligned split, schedule() declined; the update served.
    Boundary(layout="full+mamba", num_blocks=160, seed=8, schedule_served=False),
    Boundary(
        layout="full+mamba", num_blocks=160, seed=9, async_scheduling=True, schedule_served=False
    ),
]

# Per boundary, (schedule_floor, update_floor): three quarters of what each phase served
# on vLLM 0.33 (a running structured-output request makes the step vLLM's: few
# schedule() steps are served there).
FLOORS = [
    (None, None),  # declined: no floor, none served
    (None, None),  # declined: no floor, none served
    (None, None),  # declined: no floor, none served
    (5, 159),  # served 7, 213
    (18, 164),  # served 25, 219
    (53, 122),  # served 71, 163
    (39, 156),  # served 53, 208
    (None, None),  # declined: no floor, none served
    (None, None),  # declined: no floor, none served
    (143, 164),  # served 191, 219
    (141, 135),  # served 188, 181
    (153, 162),  # served 204, 216
    (142, 76),  # served 190, 102
    (0, 161),  # served 0, 215
    (0, 90),  # served 0, 120
]
BOUNDARIES = [
    dataclasses.replace(b, schedule_floor=s, update_floor=u)
    for b, (s, u) in zip(BOUNDARIES, FLOORS, strict=True)
]


def _id(b: Boundary) -> str:
    parts = [b.layout, "async" if b.async_scheduling else "sync", f"seed{b.seed}"]
    if b.spec_tokens:
        parts.append(f"spec{b.spec_tokens}")
    if b.structured:
        parts.append(f"structured{b.structured}")
    if b.connector:
        parts.append("connector")
    return "-".join(parts)


class _GrammarStub:
    """Stands in for vLLM's ``StructuredOutputManager`` (no grammar backend on CPU): the
    grammar accepts every token but :data:`REJECT`, and records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def accept_tokens(self, request: Request, new_token_ids: list[int]) -> bool:
        if request.structured_output_request is None or not new_token_ids:
            return True
        self.calls.append((request.request_id, list(new_token_ids)))
        return REJECT not in new_token_ids

    def validate_tokens(self, request: Request, spec_token_ids: list[int]) -> list[int]:
        return spec_token_ids


@dataclasses.dataclass
class _StructuredStub:
    """A request's ``structured_output_request``: its grammar compiled (never awaited)."""

    grammar: object = dataclasses.field(default_factory=object)
    reasoning_ended: bool = True


def _build(cls: type, b: Boundary, storage: Path) -> tuple[Any, list[Any], int]:
    lc = layout_config(b.layout, b.num_blocks)
    spec = None
    if b.spec_tokens:
        # vLLM's own tests' drafters: async scheduling takes only the GPU ngram one.
        kw: dict[str, Any] = {"model": "ngram", "num_speculative_tokens": b.spec_tokens}
        if b.async_scheduling:
            kw.update(method="ngram_gpu", prompt_lookup_max=b.spec_tokens, prompt_lookup_min=1)
        spec = SpeculativeConfig(**kw)
    transfer = (
        KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(storage)},
        )
        if b.connector
        else None
    )
    sched = make_scheduler(
        cls,
        lc.kv_cache_config,
        async_scheduling=b.async_scheduling,
        block_size=lc.scheduler_block_size,
        cache=lc.cache,
        enable_prefix_caching=lc.enable_prefix_caching,
        max_num_seqs=b.max_num_seqs,
        max_num_batched_tokens=b.max_num_batched_tokens,
        max_model_len=b.max_model_len,
        kv_cache_events=b.kv_events,
        speculative_config=spec,
        kv_transfer_config=transfer,
    )
    if b.structured:
        sched.structured_output_manager = _GrammarStub()
    published: list[Any] = []
    sched.kv_event_publisher.publish = published.append
    return sched, published, lc.hash_block_size


def _spec_runner_output(b: Boundary, step: int, out: Any, requests: dict[str, Any]) -> Any:
    """The stub model with drafts: a request accepts a seeded number of its scheduled
    drafts (their values in sync mode, fresh tokens for async mode's placeholders) and
    samples one more token; a partial prefill samples nothing."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
            continue
        drafts = list(out.scheduled_spec_decode_tokens.get(rid, ()))
        accepted = zlib.crc32(f"accept:{b.seed}:{step}:{rid}".encode()) % (len(drafts) + 1)
        tokens = [
            d if d >= 0 else _token(b.seed, 1000 + step * 8 + j, rid)
            for j, d in enumerate(drafts[:accepted])
        ]
        sampled.append([*tokens, _token(b.seed, step, rid)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _drafts(b: Boundary, step: int, out: Any) -> DraftTokenIds:
    """The drafter's proposals after a synchronous step: up to ``spec_tokens`` per
    scheduled request (sometimes none, as an ngram drafter finds no match)."""
    req_ids = list(out.num_scheduled_tokens)
    drafts = []
    for rid in req_ids:
        n = zlib.crc32(f"draft:{b.seed}:{step}:{rid}".encode()) % (b.spec_tokens + 1)
        drafts.append([_token(b.seed, 5000 + step * 8 + j, rid) for j in range(n)])
    return DraftTokenIds(req_ids, drafts)


def _with_structured(b: Boundary, batch: list[Request]) -> list[Request]:
    if b.structured:
        for r in batch:
            if int(r.request_id[1:]) % b.structured == 0:
                r.structured_output_request = _StructuredStub()  # type: ignore[assignment]
    return batch


def _count_structured_left(sched: Any, rest: Any, counts: dict[str, int]) -> None:
    counts["structured_left"] += any(
        sched.requests[r].structured_output_request is not None
        for r in rest.num_scheduled_tokens
        if r in sched.requests
    )


def _after_update(b: Boundary, ref: Any, cand: Any, step: int, out_ref: Any, out_cand: Any) -> None:
    if b.spec_tokens and not b.async_scheduling:
        # vLLM's engine hands the drafter's proposals over after the update.
        ref.update_draft_token_ids(_drafts(b, step, out_ref))
        cand.update_draft_token_ids(_drafts(b, step, out_cand))
    if b.structured:
        calls = cand.structured_output_manager.calls
        assert calls == ref.structured_output_manager.calls, f"step {step}: grammar"


def run_boundary(b: Boundary, storage: Path) -> dict[str, int]:
    """The shared differential (``differential.run_differential``) with the boundary's
    schedulers, drafts, grammar and structured-output requests; its counts, with
    ``structured_left`` (splits that left a structured-output request to vLLM)."""

    def runner_output(sc: Any, step: int, out: Any, requests: dict[str, Any]) -> Any:
        if b.spec_tokens:
            return _spec_runner_output(b, step, out, requests)
        return _runner_output(b, step, out, requests)

    hooks = Hooks(
        build=lambda cls, sc: _build(cls, b, storage),
        runner_output=runner_output,
        batch=lambda batch: _with_structured(b, batch),
        after_update=lambda *a: _after_update(b, *a),
        count_split=_count_structured_left,
    )
    return run_differential(b, hooks, extra=("structured_left",))


@pytest.mark.parametrize("b", BOUNDARIES, ids=_id)
def test_fast_path_boundary_keeps_vllms_decisions(b: Boundary, tmp_path: Path) -> None:
    check_floors(b, run_boundary(b, tmp_path))


@contextlib.contextmanager
def _hidden(sched: Any, boundary: str) -> Iterator[None]:
    """Hides ``boundary`` from the fast path for one call: what it sees is a scheduler
    without structured-output requests, without a connector, or without drafting."""
    if boundary == "structured":
        saved = [(r, r.structured_output_request) for r in sched.requests.values()]
        for r, _ in saved:
            r.structured_output_request = None
    elif boundary == "connector":
        saved_connector, sched.connector = sched.connector, None
    else:
        config, num_spec = sched.vllm_config.speculative_config, sched.num_spec_tokens
        object.__setattr__(sched.vllm_config, "speculative_config", None)
        sched.num_spec_tokens = 0
    try:
        yield
    finally:
        if boundary == "structured":
            for r, so in saved:
                r.structured_output_request = so
        elif boundary == "connector":
            sched.connector = saved_connector
        else:
            object.__setattr__(sched.vllm_config, "speculative_config", config)
            sched.num_spec_tokens = num_spec


# (boundary hidden, phase it is hidden from, scenario). Hiding a boundary from the other
# phases goes unnoticed: a connector from update_from_output (ExampleConnector has
# nothing to do for a request that continues, and the step has no connector output),
# drafting from the synchronous update (the per-request check on scheduled drafts
# suffices there) and from async scheduling (every decode carries draft placeholders,
# which the per-request checks decline).
BLIND = [
    ("structured", "schedule", STRUCTURED),
    ("structured", "split_update", STRUCTURED),
    ("structured", "split_update", STRUCTURED_ASYNC),
    ("connector", "schedule", CONNECTOR),
    ("connector", "schedule", CONNECTOR_ASYNC),
    ("spec", "schedule", SPEC),
]


@pytest.mark.parametrize(
    ("boundary", "phase", "b"), BLIND, ids=[f"{x}-{p}-{_id(b)}" for x, p, b in BLIND]
)
def test_fast_path_blind_to_its_boundary_is_caught(
    boundary: str, phase: str, b: Boundary, tmp_path: Path
) -> None:
    """Each boundary is one the scenarios see: the fast path with it hidden from one
    phase makes a decision or output differ from vLLM's."""
    real = getattr(fast_step, phase)

    def blind(sched: Any, *a: Any, **kw: Any) -> Any:
        with _hidden(sched, boundary):
            return real(sched, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_step, phase, blind)
        with pytest.raises(AssertionError, match=r"^step \d+: "):
            run_boundary(b, tmp_path)


def test_stub_model_exercises_the_boundaries(tmp_path: Path) -> None:
    """The stub model and drafter make vLLM accept drafts and reject some, and the stub
    grammar makes vLLM finish a structured-output request with an error (else the
    scenarios above prove less than they say)."""
    spec = SPEC
    sched, _, hbs = _build(VllmScheduler, spec, tmp_path)
    drafted = accepted = 0
    for step, new in enumerate(_stream(spec, hbs)):
        for r in new:
            sched.add_request(r)
        out = sched.schedule()
        drafted += sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
        ro = _spec_runner_output(spec, step, out, sched.requests)
        accepted += sum(
            len(t) - 1 for r, t in zip(ro.req_ids, ro.sampled_token_ids, strict=True) if t
        )
        sched.update_from_output(out, ro)
        sched.update_draft_token_ids(_drafts(spec, step, out))
    assert 0 < accepted < drafted, (accepted, drafted)

    structured = STRUCTURED
    sched, _, hbs = _build(VllmScheduler, structured, tmp_path)
    errors = 0
    for step, new in enumerate(_stream(structured, hbs)):
        for r in _with_structured(structured, new):
            sched.add_request(r)
        out = sched.schedule()
        eco = sched.update_from_output(out, _runner_output(structured, step, out, sched.requests))
        errors += sum(
            1
            for outs in eco.values()
            for o in outs.outputs
            if o.finish_reason is not None and o.finish_reason.name == "ERROR"
        )
    assert errors > 0


@pytest.mark.parametrize("layout", ["full+chunked", "full+mamba", "full+mamba-none"])
def test_decode_bench_runs_the_hybrids(layout: str) -> None:
    """``bench-scheduler --decode --layout``: the three sides agree on the hybrids
    (``bench_decode`` raises otherwise), and the bench says whether the fast path served
    the steady ``schedule()`` (not under Mamba 'align': vLLM's block-aligned split)."""
    from hscache_tools.bench.decode_step import bench_decode, fast_path_off_reason

    r = bench_decode(running=8, steps=12, repeat=1, layout=layout, mixed=True)
    assert r["vllm_us"] > 0 and r["hscache+fast_us"] > 0
    assert r["fast_served"] == (layout != "full+mamba"), r
    if layout == "full+mamba":
        assert "need_mamba_block_aligned_split" in fast_path_off_reason(layout)


def test_cli_decode_bench_marks_where_schedule_is_not_fast(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hscache.__main__ import main

    args = ["bench-scheduler", "--decode", "4", "--layout", "full+mamba", "--steps", "4"]
    assert main([*args, "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "schedule() not fast (1)" in out
    assert "(1) full+mamba: the fast path declines schedule()" in out
