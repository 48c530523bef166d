"""KV-sharing fast prefill on hscache: a toy YOCO-style thinker whose later layers reuse an
earlier layer's KV cache, scheduled by vLLM, with a hidden-state cache for a second stage.

The thinker has *self* layers, each with its own paged KV cache written through the slot
mapping, and *cross* layers that attend over the last self layer's cache and write no KV of
their own (Gemma-3n's / YOCO's KV sharing, vLLM's ``--kv-sharing-fast-prefill``). So the
cross layers only need the tokens whose logits are sampled: every step the model runner
asks hscache for the reduced batch (``plan.prefill_skip``, computed on the host in the same
Rust call that plans the hidden-state cache) and runs the cross layers on it alone.

Each step also runs the cross layers on the full batch and checks that the kept tokens'
outputs and the sampled tokens are the same, and that the hidden-state cache (key ``self``:
the self layers' output, every token; key ``hidden``: the cross layers' output, a skip-layer
key) returns, for every request, only rows equal to a full recomputation: it never serves a
``hidden`` row the cross layers did not compute (such hits are reported ``partial``).

Run (CPU, offline) from a checkout, after ``source scripts/env.sh`` (the offline vLLM
scheduler it drives is built by hscache's tools, ``tools/hscache_tools/testing/``, which
the wheel does not ship)::

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 python examples/kv_sharing_fast_prefill.py

``tests/kv_manager/test_kv_sharing.py`` drives randomized traces through the same pieces.
"""

from __future__ import annotations

import argparse
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from hscache.hidden_states import HiddenStateCache, KeySpec, StepPlan, StepRows
from hscache.vllm import Scheduler
from hscache_tools.testing.offline_scheduler import make_scheduler
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

init_none_hash(sha256)

VOCAB = 97
WIDTH = 16
MAX_POS = 2048
KEYS: dict[str, KeySpec] = {"self": (WIDTH, torch.float64), "hidden": (WIDTH, torch.float64)}
SKIP_KEYS = ("hidden",)


class KVSharingModel:
    """``n_self`` attention layers with their own paged KV, then ``n_cross`` layers that
    attend over the last self layer's KV (float64, small random weights)."""

    def __init__(
        self, num_blocks: int, block_size: int, n_self: int = 2, n_cross: int = 2, seed: int = 0
    ) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[0])

        self.bs = block_size
        self.embed = w(VOCAB, WIDTH) * 4
        self.pos = w(MAX_POS, WIDTH)
        self.self_layers = [
            (w(WIDTH, WIDTH), w(WIDTH, WIDTH), w(WIDTH, WIDTH), w(WIDTH, WIDTH))
            for _ in range(n_self)
        ]
        self.cross_layers = [
            (w(WIDTH, WIDTH), w(WIDTH, WIDTH), w(WIDTH, WIDTH)) for _ in range(n_cross)
        ]
        self.lm_head = w(WIDTH, VOCAB)
        slots = num_blocks * block_size
        self.k = [torch.zeros(slots, WIDTH, dtype=torch.float64) for _ in range(n_self)]
        self.v = [torch.zeros(slots, WIDTH, dtype=torch.float64) for _ in range(n_self)]

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention of queries at ``q_pos`` over keys at positions ``0..``."""
        scores = q @ k.T / math.sqrt(WIDTH)
        mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
        return torch.softmax(scores.masked_fill(mask, -math.inf), dim=-1) @ v

    def _slots(self, table: Sequence[int], end: int) -> torch.Tensor:
        bs = self.bs
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(end)])

    def self_decoder(self, batch: list[tuple[list[int], range, list[int]]]) -> torch.Tensor:
        """Rows of the self layers for each ``(token_ids, positions, block_table)``, writing
        their KV into the paged caches."""
        xs = [
            self.embed[torch.tensor([t[p] for p in pos])] + self.pos[list(pos)]
            for t, pos, _ in batch
        ]
        for layer, (wq, wk, wv, wo) in enumerate(self.self_layers):
            for x, (_, pos, table) in zip(xs, batch, strict=True):
                slots = self._slots(table, pos.stop)
                self.k[layer][slots[pos.start :]] = x @ wk
                self.v[layer][slots[pos.start :]] = x @ wv
            xs = [
                x
                + self._attend(
                    x @ wq,
                    self.k[layer][self._slots(table, pos.stop)],
                    self.v[layer][self._slots(table, pos.stop)],
                    torch.tensor(list(pos)),
                )
                @ wo
                for x, (_, pos, table) in zip(xs, batch, strict=True)
            ]
        return torch.cat(xs) if xs else torch.zeros(0, WIDTH, dtype=torch.float64)

    def cross_decoder(
        self, x: torch.Tensor, positions: torch.Tensor, tables: list[Sequence[int]]
    ) -> torch.Tensor:
        """The cross layers for rows ``x`` at ``positions`` (row ``i`` of request
        ``tables[i]``), over the last self layer's KV: no KV of their own."""
        out = []
        for row, p, table in zip(x, positions.tolist(), tables, strict=True):
            h = row[None, :]
            slots = self._slots(table, p + 1)
            k, v = self.k[-1][slots], self.v[-1][slots]
            for wq, wo, wm in self.cross_layers:
                h = h + self._attend(h @ wq, k, v, torch.tensor([p])) @ wo
                h = h + torch.tanh(h @ wm)
            out.append(h)
        return torch.cat(out) if out else torch.zeros(0, WIDTH, dtype=torch.float64)

    def reference(self, token_ids: Sequence[int], end: int) -> dict[str, torch.Tensor]:
        """Both keys' rows of positions ``0..end-1``, computed densely from scratch."""
        pos = torch.arange(end)
        x = self.embed[torch.tensor(list(token_ids[:end]))] + self.pos[:end]
        ks = vs = x
        for wq, wk, wv, wo in self.self_layers:
            ks, vs = x @ wk, x @ wv
            x = x + self._attend(x @ wq, ks, vs, pos) @ wo
        rows = []
        for i in range(end):
            h = x[i : i + 1]
            for wq, wo, wm in self.cross_layers:
                h = h + self._attend(h @ wq, ks[: i + 1], vs[: i + 1], pos[i : i + 1]) @ wo
                h = h + torch.tanh(h @ wm)
            rows.append(h)
        return {"self": x, "hidden": torch.cat(rows) if rows else x[:0]}

    def sample(self, hidden_row: torch.Tensor) -> int:
        return int(torch.argmax(hidden_row @ self.lm_head))


def make_request(req_id: str, prompt: Sequence[int], max_tokens: int, block_size: int) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


@dataclass
class StepCheck:
    """What one step showed."""

    kept: int
    rows: int
    partial: list[str]
    hits: list[str]


@dataclass
class FastPrefillThinker:
    """vLLM's scheduler, the KV-sharing model and the hidden-state cache, one step at a time."""

    scheduler: Scheduler
    model: KVSharingModel
    cache: HiddenStateCache
    requests: dict[str, Request] = field(default_factory=dict)
    tol: float = 1e-9
    #: Share of steps run with fast prefill (the others compute every row in every layer,
    #: so later hits on their blocks serve the skip-layer key too).
    fast_prefill_rate: float = 1.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    #: Hand the cache the merged full-length output, as Gemma-3n's forward returns it (the
    #: self layers' rows where the skip layers did not run), instead of the reduced one.
    merged_output: bool = False

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> tuple[SchedulerOutput, StepPlan, StepRows, StepCheck]:
        so = self.scheduler.schedule()
        fast = self.rng.random() < self.fast_prefill_rate
        plan = self.cache.update_from_scheduler_output(so, fast_prefill=fast)
        skip = plan.prefill_skip
        tables = [self.cache.mirror.block_table(r) for r in plan.req_ids]
        batch = [
            (
                self.requests[r].all_token_ids,
                range(int(plan.compute_start[i]), int(plan.num_tokens[i])),
                tables[i],
            )
            for i, r in enumerate(plan.req_ids)
        ]
        h_self = self.model.self_decoder(batch)
        positions = (
            torch.cat([torch.tensor(list(p), dtype=torch.int64) for _, p, _ in batch])
            if batch
            else torch.zeros(0, dtype=torch.int64)
        )
        row_tables = [t for _, p, t in batch for _ in p]
        kept = skip.logits_indices.long() if skip is not None else torch.arange(plan.num_rows)
        # The skip layers on the reduced batch (fast prefill) ...
        reduced = self.model.cross_decoder(
            h_self[kept], positions[kept], [row_tables[i] for i in kept.tolist()]
        )
        # ... and on the full batch (what vLLM runs without it): the kept rows agree.
        full = self.model.cross_decoder(h_self, positions, row_tables)
        if not torch.allclose(full[kept], reduced, rtol=0, atol=self.tol):
            raise AssertionError("the skip layers' reduced batch changed the kept rows")
        sampled: list[list[int]] = []
        offset = 0
        for i, req_id in enumerate(plan.req_ids):
            n_kept = int(plan.kept[i])
            end = int(plan.num_tokens[i])
            offset += n_kept
            if end < self.requests[req_id].num_tokens:
                sampled.append([])  # a partial prefill samples nothing
                continue
            token = self.model.sample(reduced[offset - 1])
            if token != self.model.sample(full[int(plan.query_start_loc[i + 1]) - 1]):
                raise AssertionError(f"{req_id}: fast prefill sampled another token")
            sampled.append([token])
        hidden = reduced
        if self.merged_output:
            hidden = h_self.clone()
            hidden[kept] = reduced
        rows = self.cache.write_and_gather(plan, {"self": h_self, "hidden": hidden})
        self._check_rows(plan, rows)
        output = ModelRunnerOutput(
            req_ids=list(plan.req_ids),
            req_id_to_index={r: i for i, r in enumerate(plan.req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        outs = self.scheduler.update_from_output(so, output)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.requests.pop(o.request_id)
        return so, plan, rows, StepCheck(plan.num_kept, plan.num_rows, rows.partial, rows.hits)

    def _check_rows(self, plan: StepPlan, rows: StepRows) -> None:
        """Every row the cache returns equals a full recomputation of its position: it never
        serves a row that was not computed (for ``hidden``: by the skip layers)."""
        for i, req_id in enumerate(plan.req_ids):
            end = int(plan.num_tokens[i])
            want = self.model.reference(self.requests[req_id].all_token_ids, end)
            for key in KEYS:
                start = rows.start(req_id, key)
                got = rows.rows(req_id, key)
                if got.shape[0] != end - start or not torch.allclose(
                    got, want[key][start:end], rtol=0, atol=self.tol
                ):
                    raise AssertionError(f"{req_id}: rows of {key!r} from {start} differ")


def build(
    num_blocks: int, block_size: int, seed: int = 0, fast_prefill_rate: float = 1.0, **sched: Any
) -> FastPrefillThinker:
    scheduler: Scheduler = make_scheduler(
        Scheduler, num_blocks, block_size=block_size, watermark=0.0, **sched
    )
    return FastPrefillThinker(
        scheduler,
        KVSharingModel(num_blocks, block_size, seed=seed),
        HiddenStateCache(num_blocks, block_size, KEYS, skip_layer_keys=SKIP_KEYS),
        fast_prefill_rate=fast_prefill_rate,
        rng=random.Random(seed),
    )


def run(
    *,
    num_requests: int = 24,
    block_size: int = 4,
    num_blocks: int = 64,
    seed: int = 0,
    fast_prefill_rate: float = 1.0,
) -> dict[str, int]:
    rng = random.Random(seed)
    thinker = build(
        num_blocks,
        block_size,
        seed,
        fast_prefill_rate,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=10,
        max_num_seqs=6,
    )
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    pending = [
        make_request(
            f"r{i}",
            rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))],
            rng.randrange(1, 8),
            block_size,
        )
        for i in range(num_requests)
    ]
    counts = {"steps": 0, "rows": 0, "kept_rows": 0, "hits": 0, "partial_hits": 0}
    while pending or thinker.scheduler.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randrange(0, 3))):
            thinker.add(pending.pop(0))
        _, _, _, check = thinker.step()
        counts["steps"] += 1
        counts["rows"] += check.rows
        counts["kept_rows"] += check.kept
        counts["hits"] += len(check.hits)
        counts["partial_hits"] += len(check.partial)
        if counts["steps"] > 5000:
            raise AssertionError("the trace does not finish")
    return {**counts, **{f"mirror_{k}": v for k, v in thinker.cache.stats().items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast-prefill-rate", type=float, default=1.0)
    args = parser.parse_args()
    stats = run(
        num_requests=args.requests, seed=args.seed, fast_prefill_rate=args.fast_prefill_rate
    )
    for k, v in stats.items():
        print(f"{k:>28}: {v}")
    print(
        "skip layers on the reduced batch: same kept rows and sampled tokens as the full "
        "batch; the cache served only computed rows"
    )


if __name__ == "__main__":
    main()
