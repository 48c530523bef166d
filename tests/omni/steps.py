"""Seeded step sequences that drive vllm-omni's prefix cache and hscache's side by side.

The KV side is vLLM 0.30's own ``Scheduler`` (stock ``KVCacheManager``), built offline by
:mod:`hscache_tools.testing.offline_scheduler`: its real ``SchedulerOutput`` of every step goes to
both caches. The model is an exact toy: the row of a token at a position is a function of
(token id, position) alone (:func:`toy_rows`), exact in its dtype, so what a cache must
return is known without either cache (:class:`Oracle`). The model runner's batch is
emulated by :class:`BatchView` (group 0's block tables from the same outputs, a shuffled
batch order), which is what vllm-omni's manager reads through its ``FullAttentionGroupView``.

Per step: requests arrive (shared prefixes, exact repeats, identical prompts in one step),
some are aborted, the scheduler schedules (chunked prefill, preemption and resumption in a
small pool, block reuse), both caches begin the step, save the toy outputs (padded like a
CUDA graph's), and the step is materialized at once, one step late, or discarded; every
materialized request's rows are compared across the two caches and with the oracle.

A first hit hscache sends back for recomputation (``take_invalid_blocks``) goes back as
the runner hook sends it (``hscache.omni.refusals``): its blocks in the step's
``KVConnectorOutput.invalid_block_ids``, which vLLM's scheduler turns into a rollback of
the request; the oracle then drops the request's rows of that step (the scheduler drops
its output) and expects its next scheduled step to be a first hit (rows from 0).

Test scaffolding only: no vLLM or vllm-omni code is copied here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

HIDDEN_WIDTH = 4
# Per-token multimodal outputs: an immediately cached one and a deferred one (vllm-omni's
# JOIN_NEXT_STEP and JOIN_ON_FINISH schedules).
MM_KEYS: dict[str, tuple[int, torch.dtype]] = {
    "talker.codes": (3, torch.float32),
    "talker.audio": (2, torch.float16),
}
DEFERRED_KEYS = frozenset({"talker.audio"})
# Outputs that are not one row per token (passed through per request, not cached): a 1-D
# per-token tensor, a list, a per-request tensor. Compared across the caches only.
PASS_KEYS = ("meta.token_flags", "meta.items", "meta.per_request")
VOCAB = 4000  # token ids stay below this: toy rows are exact in float32 and float16


def toy_rows(key: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows of ``key`` for these tokens at these positions (exact in the key's dtype)."""
    t = tokens.to(torch.int64).unsqueeze(1)
    p = positions.to(torch.int64).unsqueeze(1)
    if key == "__hidden_states__":
        d = torch.arange(HIDDEN_WIDTH).unsqueeze(0)
        return (t * 4096 + p * 4 + d).to(torch.float32)
    width, dtype = MM_KEYS[key]
    d = torch.arange(width).unsqueeze(0)
    if dtype is torch.float16:
        return ((t * 7 + p * 3 + d) % 1024).to(dtype)
    return (p * 64 + (t % 16) * 4 + d).to(dtype)


ALL_KEYS = ("__hidden_states__", *MM_KEYS)


@dataclass
class Params:
    """One sequence's shape."""

    seed: int
    steps: int = 60
    num_blocks: int = 24
    block_size: int = 4
    max_num_batched_tokens: int = 20
    max_num_seqs: int = 6
    arrivals: float = 0.6
    abort: float = 0.08
    late: float = 0.25
    discard: float = 0.15
    subset: float = 0.2
    """The chance a materialize names only some of the step's requests."""
    unsaved: float = 0.0
    pad: int = 3
    window: int = 0
    """A hybrid layout when > 0: a sliding-window group of this many tokens (group 0)
    beside the full-attention group (group 1), both of ``block_size``-token blocks."""


class BatchView:
    """The model runner's batch as vllm-omni's ``FullAttentionGroupView`` exposes it: the
    full-attention group's block tables (the last group here: group 0 of a one-group
    layout), the computed tokens at the step's start, the batch order."""

    def __init__(self, block_size: int, rng: random.Random) -> None:
        self.block_size = block_size
        self._rng = rng
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.order: list[str] = []

    def update(self, so: Any) -> None:
        for r in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            self.tables.pop(r, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[-1])
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, r in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if r in cached.resumed_req_ids:
                self.tables[r] = list(ids[-1])
            elif ids is not None:
                self.tables[r].extend(ids[-1])
            self.computed[r] = cached.num_computed_tokens[i]
        self.order = list(so.num_scheduled_tokens)
        self._rng.shuffle(self.order)

    def batch_req_ids(self) -> list[str]:
        return list(self.order)

    def step_slots_cpu(self, req_ids: list[str], num_scheduled: dict[str, int]) -> torch.Tensor:
        bs = self.block_size
        out: list[int] = []
        for r in req_ids:
            start = self.computed[r]
            for pos in range(start, start + int(num_scheduled.get(r, 0))):
                out.append(self.tables[r][pos // bs] * bs + pos % bs)
        return torch.tensor(out, dtype=torch.long)


@dataclass
class StepRecord:
    """What the oracle needs of one saved step: per request, the positions it served
    from and its tokens up to the step's end."""

    first_from: dict[str, int]
    tokens: dict[str, list[int]]
    end: dict[str, int]
    scheduled: dict[str, int] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)
    step_ids: dict[str, int] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    """Requests sent back for recomputation at this step: the scheduler drops their
    output of the step, so no rows of theirs are compared."""


@dataclass
class Counts:
    steps: int = 0
    saved: int = 0
    materialized: int = 0
    late: int = 0
    discarded: int = 0
    requests_compared: int = 0
    rows_compared: int = 0
    hit_requests: int = 0
    same_step_hits: int = 0
    preemptions: int = 0
    resumptions: int = 0
    aborts: int = 0
    chunked: int = 0
    recomputed: int = 0
    """First hits sent back for recomputation (their step's output dropped)."""
    recomputed_served: int = 0
    """Recomputed requests' later steps compared from position 0."""
    mismatches: list[str] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    """Per request, its tokens up to the furthest step end seen."""
    cold_streams: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per request, the positions ``[start, end)`` of every materialized step's rows as a
    runner without any cache hands them on: the step's scheduled rows."""


Materialize = Callable[[int, list[str]], Any]


class Side:
    """One cache under test: how to build it, what it returns."""

    def __init__(self, name: str, cache: Any, deliver_once: bool = False) -> None:
        self.name = name
        self.cache = cache
        self.deliver_once = deliver_once
        """Hands each row out once, in order (hscache's delivery watermark): from a
        request's resumption on, its rows start at the furthest position it had handed
        out; a first hit sent back hands out none."""
        self.delivered: dict[str, int] = {}
        self.floors: dict[str, int] = {}
        self.streams: dict[str, list[torch.Tensor]] = {}
        """Per request, the hidden-state rows of every materialize, in order (what
        vllm-omni's runner appends to the request's payload for the next stage)."""

    def materialize(self, step_id: int, req_ids: list[str]) -> dict[str, dict[str, Any]]:
        out = self.cache.materialize(step_id, req_ids)
        rows: dict[str, dict[str, Any]] = {}
        if out.hidden_states is not None:
            rows["__hidden_states__"] = dict(out.hidden_states)
        for key, per_req in out.mm_outputs.items():
            rows[key] = dict(per_req)
        return rows


def run_sequence(
    params: Params,
    make_sides: Callable[[BatchView], list[Side]],
    *,
    after_first_save: Callable[[list[Side]], None] | None = None,
) -> Counts:
    """Drives one seeded sequence through vLLM 0.30's scheduler and every side."""
    from hscache_tools.testing.kv_cache import full_attention, kv_cache_config, sliding_window
    from hscache_tools.testing.offline_scheduler import make_scheduler, stub_runner_output
    from hscache_tools.testing.requests import make_request
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    rng = random.Random(params.seed)
    bs = params.block_size
    layout: Any = params.num_blocks
    if params.window:
        layout = kv_cache_config(
            [sliding_window(bs, params.window), full_attention(bs)], params.num_blocks
        )
    sched = make_scheduler(
        Scheduler,
        layout,
        block_size=bs,
        max_num_batched_tokens=params.max_num_batched_tokens,
        max_num_seqs=params.max_num_seqs,
        max_model_len=256,
    )
    view = BatchView(bs, rng)
    sides = make_sides(view)
    counts = Counts()
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 25))] for _ in range(3)]
    recent: list[list[int]] = []
    live: set[str] = set()
    recomputing: set[str] = set()  # sent back, not scheduled again yet
    pending_late: list[tuple[StepRecord, list[str]]] = []
    next_id = 0
    first_saved = False

    def compare(rec: StepRecord, req_ids: list[str]) -> None:
        results: dict[str, dict[str, dict[str, Any]] | Exception] = {}
        for side in sides:
            try:
                results[side.name] = side.materialize(rec.step_ids[side.name], req_ids)
            except Exception as e:  # a refusal: recorded, and the step discarded
                results[side.name] = e
                counts.refused[side.name] = counts.refused.get(side.name, 0) + 1
                try:
                    side.cache.discard_step(rec.step_ids[side.name])
                except Exception:  # vllm-omni consumed it already
                    pass
        counts.materialized += 1
        for r in req_ids:
            span = (rec.end[r] - rec.scheduled[r], rec.end[r])
            counts.cold_streams.setdefault(r, []).append(span)
            for side in sides:
                res = results[side.name]
                if not isinstance(res, Exception) and r in res.get("__hidden_states__", {}):
                    side.streams.setdefault(r, []).append(res["__hidden_states__"][r])
            if len(rec.tokens[r]) > len(counts.tokens.get(r, ())):
                counts.tokens[r] = rec.tokens[r]
            end = rec.end[r]
            starts: dict[str, int] = {}
            for side in sides:
                if not side.deliver_once:
                    starts[side.name] = rec.first_from[r]
                elif isinstance(results[side.name], Exception):
                    pass
                elif r in rec.dropped:
                    if r in rec.resumed:
                        side.floors[r] = side.delivered.get(r, 0)
                    starts[side.name] = end  # sent back: nothing handed out
                else:
                    if r in rec.resumed:
                        side.floors[r] = side.delivered.get(r, 0)
                    floor = side.floors.get(r, 0)
                    starts[side.name] = min(end, max(rec.first_from[r], floor))
                    if floor and end >= floor:
                        del side.floors[r]
                    side.delivered[r] = max(side.delivered.get(r, 0), end)
            if r in rec.dropped and not any(side.deliver_once for side in sides):
                continue
            counts.requests_compared += 1
            for key in ALL_KEYS:
                for side in sides:
                    res = results[side.name]
                    if isinstance(res, Exception):
                        continue
                    if r in rec.dropped and not side.deliver_once:
                        continue
                    start = starts[side.name]
                    want = toy_rows(
                        key, torch.tensor(rec.tokens[r][start:end]), torch.arange(start, end)
                    )
                    got = res.get(key, {}).get(r)
                    counts.rows_compared += int(want.shape[0])
                    if got is None or got.dtype != want.dtype or not torch.equal(got, want):
                        counts.mismatches.append(
                            f"step {counts.steps} {side.name} {r} {key}: got "
                            f"{None if got is None else tuple(got.shape)}, want "
                            f"{tuple(want.shape)} from position {start}"
                        )
            if r in rec.dropped:
                continue
            served = [res for res in results.values() if not isinstance(res, Exception)]
            for key in PASS_KEYS:
                values = [res.get(key, {}).get(r) for res in served]
                if any(not _same(values[0], v) for v in values[1:]):
                    counts.mismatches.append(f"step {counts.steps} {r} {key}: {values}")

    for _ in range(params.steps):
        counts.steps += 1
        # Arrivals: shared prefixes, exact repeats, identical prompts in one step.
        if rng.random() < params.arrivals:
            for _ in range(rng.choice((1, 1, 2, 3))):
                if recent and rng.random() < 0.3:
                    prompt = list(rng.choice(recent))
                else:
                    prefix = rng.choice(prefixes)
                    tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 13))]
                    prompt = prefix + tail
                recent = [*recent, prompt][-6:]
                copies = 2 if rng.random() < 0.2 else 1
                for _ in range(copies):
                    sched.add_request(
                        make_request(
                            f"r{next_id}",
                            prompt,
                            max_tokens=rng.randrange(1, 7),
                            hash_block_size=bs,
                            ignore_eos=True,
                        )
                    )
                    next_id += 1
        if sched.requests and rng.random() < params.abort:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            counts.aborts += 1
        so = sched.schedule()
        counts.preemptions += len(so.preempted_req_ids or ())
        counts.resumptions += len(so.scheduled_cached_reqs.resumed_req_ids)
        # The oracle's side of the contract: which requests get their prefix.
        live -= set(so.finished_req_ids)
        recomputing -= set(so.finished_req_ids)
        first_from: dict[str, int] = {}
        tokens: dict[str, list[int]] = {}
        end: dict[str, int] = {}
        new_ids = {n.req_id: n for n in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for r, n in so.num_scheduled_tokens.items():
            nc = new_ids[r].num_computed_tokens if r in new_ids else computed[r]
            first = r in new_ids and r not in live and nc > 0
            if r in recomputing:
                # Rolled back by the scheduler: its rows from 0 once more.
                recomputing.discard(r)
                first = nc > 0
                counts.recomputed_served += 1
            if r in new_ids:
                live.add(r)
            first_from[r] = 0 if first else nc
            end[r] = nc + n
            tokens[r] = list(sched.requests[r].all_token_ids[: nc + n])
            if first:
                counts.hit_requests += 1
            if nc + n < sched.requests[r].num_prompt_tokens:
                counts.chunked += 1
        counts.same_step_hits += _same_step_hits(so, bs)
        for side in sides:
            side.cache.new_step_starts(so)
        view.update(so)
        n = so.total_num_scheduled_tokens
        invalid: set[int] = set()
        save = n > 0 and not (first_saved and rng.random() < params.unsaved)
        rec = StepRecord(
            first_from, tokens, end, dict(so.num_scheduled_tokens), set(cached.resumed_req_ids)
        )
        if save:
            order = view.batch_req_ids()
            padded = n + rng.randrange(0, params.pad + 1)
            outputs: dict[str, torch.Tensor] = {}
            for key in ALL_KEYS:
                rows = [
                    toy_rows(
                        key,
                        torch.tensor(tokens[r][end[r] - so.num_scheduled_tokens[r] : end[r]]),
                        torch.arange(end[r] - so.num_scheduled_tokens[r], end[r]),
                    )
                    for r in order
                ]
                t = torch.cat(rows)
                outputs[key] = torch.cat(
                    [t, torch.full((padded - n, t.shape[1]), -1, dtype=t.dtype)]
                )
            hidden = outputs.pop("__hidden_states__")
            passed: dict[str, Any] = {
                "meta.token_flags": torch.arange(n) % 3,
                "meta.items": [f"item{counts.steps}-{i}" for i in range(len(order))],
                "meta.per_request": torch.arange(len(order)) * 10,
            }
            for side in sides:
                rec.step_ids[side.name] = side.cache.save_outputs(
                    hidden.clone(),
                    {**{k: v.clone() for k, v in outputs.items()}, **passed},
                    num_tokens_unpadded=n,
                    num_tokens_padded=padded,
                )
                # A first hit sent back: its blocks reach the scheduler with this step's
                # output (decided at save, whenever the step is materialized).
                take = getattr(side.cache, "take_invalid_blocks", None)
                if take is not None:
                    invalid |= set(take(rec.step_ids[side.name]))
                    sent_back = set(side.cache.rules.recomputing()) - recomputing
                    rec.dropped |= sent_back
                    recomputing |= sent_back
            counts.recomputed += len(rec.dropped)
            counts.saved += 1
            if not first_saved:
                first_saved = True
                if after_first_save is not None:
                    after_first_save(sides)
        # Steps saved earlier and materialized one step late (the async output thread).
        for old, req_ids in pending_late:
            compare(old, req_ids)
        pending_late = []
        if save:
            req_ids = view.batch_req_ids()
            if len(req_ids) > 1 and rng.random() < params.subset:
                req_ids = rng.sample(req_ids, rng.randrange(1, len(req_ids)))
            u = rng.random()
            if u < params.discard:
                for side in sides:
                    side.cache.discard_step(rec.step_ids[side.name])
                counts.discarded += 1
            elif u < params.discard + params.late:
                pending_late.append((rec, req_ids))
                counts.late += 1
            else:
                compare(rec, req_ids)
        sampled = [rng.randrange(VOCAB) for _ in so.num_scheduled_tokens]
        out = stub_runner_output(so, sampled.__getitem__, sched.requests)
        if invalid:
            from hscache.omni.refusals import report_invalid_blocks

            report_invalid_blocks(out, invalid)
        sched.update_from_output(so, out)
    for old, req_ids in pending_late:
        compare(old, req_ids)
    return counts


def _same_step_hits(so: Any, block_size: int) -> int:
    """New requests whose hit covers a block first assigned in this very step."""
    fresh: set[int] = set()
    hits = 0
    for new in so.scheduled_new_reqs:
        blocks = new.block_ids[-1]
        cut = new.num_computed_tokens // block_size
        if any(b in fresh for b in blocks[:cut]):
            hits += 1
        fresh.update(blocks[cut:])
    return hits


def _same(a: Any, b: Any) -> bool:
    """Deep equality of pass-through values (tensors by value and dtype)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)
