"""Rejected speculative draft rows are never served: hscache's ``OmniHiddenStateCache``
under vLLM 0.30's real ``Scheduler`` with draft tokens, against full recomputation.

A decode step with drafts computes ``1 + k`` positions: the last sampled token and ``k``
draft tokens, whose rows land in the request's KV slots. The sampler accepts a prefix of
the drafts and replaces the first rejected one by its own token; the scheduler rolls
``num_computed_tokens`` back over the rejected ones, so their rows stay in slots of
positions that the next step computes again with the real tokens. A hit on a block that
once held rejected rows must serve the real rows. Here the drafts are token ids no real
token ever takes (and never repeat), so a served rejected row cannot pass for a real one:
every served prefix is compared with the rows of the real tokens (:func:`toy_rows`, a
function of token and position: the recomputation), and the hits are made to land on
such blocks (follow-up prompts continue a finished request's prompt *and output*, as a
next chat turn does). ``test_a_mirror_without_the_rollback_is_caught``: fed the
positions a runner that ignored the rollback would write at, the same check fails.

Synchronous scheduling only: with async scheduling vLLM corrects the positions of a step
scheduled before the previous step's rejections were known inside the model runner, not
in the ``SchedulerOutput``; vllm-omni 0.30 refuses speculative decoding for any prefix
cache (``check_prefix_cache_token_accounting``, which hscache's switch leaves in place).
Needs vLLM 0.30 with vllm-omni (``scripts/vllm030_env.sh``); skipped elsewhere.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import pytest

pytest.importorskip(
    "vllm_omni.core.prefix_cache",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

import torch
from hscache.omni import OmniHiddenStateCache, OmniSettings

from tests.omni.steps import BatchView, toy_rows

BS = 4
NUM_DRAFTS = 3
REAL_VOCAB = 1000  # real tokens (prompts, the sampler's own) are below this
FIRST_DRAFT = 1000  # drafts count up from here: never a real token, never twice
KEY = "__hidden_states__"


@dataclass
class Counts:
    steps: int = 0
    rejected_rows: int = 0
    hits: int = 0
    rows_compared: int = 0
    rows_over_rejected: int = 0
    """Served cached rows whose slot held a rejected draft row in the block's tenancy."""
    mismatches: list[str] = field(default_factory=list)


def _unrolled(r: str, n: int, scheduled: int, planned_end: dict[str, int], table: list[int]) -> int:
    """Where a request's step would start had its rejected drafts not been rolled back
    (its last step's end), where the request's blocks hold that many positions."""
    end = planned_end.get(r, n)
    return end if end + scheduled <= len(table) * BS else n


def _run(seed: int, steps: int = 160, rollback: bool = True) -> Counts:
    from hscache_tools.testing.offline_scheduler import make_scheduler
    from hscache_tools.testing.requests import make_request
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm_omni.core.prefix_cache import PrefixCacheConfig

    rng = random.Random(seed)
    sched = make_scheduler(
        Scheduler, 40, block_size=BS, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256
    )
    sched.log_stats = False  # its spec-decode stats want a speculative config
    view = BatchView(BS, rng)
    cache = OmniHiddenStateCache(
        PrefixCacheConfig(num_blocks=40, block_size=BS), view, settings=OmniSettings(storage="cpu")
    )
    counts = Counts()
    next_draft = FIRST_DRAFT
    finished: list[list[int]] = []  # finished requests' prompt + output tokens
    prefixes = [[rng.randrange(REAL_VOCAB) for _ in range(rng.randrange(5, 14))] for _ in range(2)]
    dirty: set[int] = set()  # slots holding a rejected draft row in their block's tenancy
    planned_end: dict[str, int] = {}  # where each request's last step ended (no rollback)
    next_id = 0

    def slot(req_id: str, pos: int) -> int:
        return view.tables[req_id][pos // BS] * BS + pos % BS

    for _ in range(steps):
        counts.steps += 1
        if rng.random() < 0.35 and len(sched.requests) < 6:
            if finished and rng.random() < 0.6:  # a next turn: a finished sequence + a tail
                seq = rng.choice(finished)
                prompt = seq[: rng.randrange(len(seq) // 2, len(seq) + 1)]
            else:
                prompt = list(rng.choice(prefixes))
            prompt = prompt + [rng.randrange(REAL_VOCAB) for _ in range(rng.randrange(1, 6))]
            sched.add_request(
                make_request(
                    f"r{next_id}", prompt, max_tokens=rng.randrange(6, 20), hash_block_size=BS
                )
            )
            next_id += 1
        so = sched.schedule()
        if not so.num_scheduled_tokens:
            continue
        view.update(so)
        for new in so.scheduled_new_reqs:  # fresh blocks start a new tenancy
            for b in new.block_ids[-1][new.num_computed_tokens // BS :]:
                dirty.difference_update(range(b * BS, (b + 1) * BS))
        cached = so.scheduled_cached_reqs
        for ids in cached.new_block_ids:
            for b in (ids or ([],))[-1]:
                dirty.difference_update(range(b * BS, (b + 1) * BS))
        seen = so
        if not rollback:  # the runner's positions as if no draft had been rejected
            seen = copy.deepcopy(so)
            seen.scheduled_cached_reqs.num_computed_tokens = [
                _unrolled(r, n, so.num_scheduled_tokens[r], planned_end, view.tables[r])
                if r not in cached.resumed_req_ids
                else n
                for r, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            ]
        cache.new_step_starts(seen)
        order = view.batch_req_ids()
        first_hits = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        rows: list[torch.Tensor] = []
        real: dict[str, list[int]] = {}
        for r in order:
            req = sched.requests[r]
            start, n = view.computed[r], so.num_scheduled_tokens[r]
            drafts = list(so.scheduled_spec_decode_tokens.get(r, ()))
            real[r] = list(req.all_token_ids)
            tokens = [
                real[r][p] if p < req.num_tokens else drafts[p - req.num_tokens]
                for p in range(start, start + n)
            ]
            rows.append(toy_rows(KEY, torch.tensor(tokens), torch.arange(start, start + n)))
            planned_end[r] = start + n
        hidden = torch.cat(rows)
        step_id = cache.save_outputs(
            hidden, {}, num_tokens_unpadded=len(hidden), num_tokens_padded=len(hidden)
        )
        assert step_id is not None
        out = cache.materialize(step_id, order)
        assert out.hidden_states is not None
        for r, step_rows in zip(order, rows, strict=True):
            start = view.computed[r]
            hit = first_hits.get(r, 0)
            want = step_rows
            if hit:
                counts.hits += 1
                counts.rows_over_rejected += sum(slot(r, p) in dirty for p in range(hit))
                want = torch.cat(
                    [toy_rows(KEY, torch.tensor(real[r][:hit]), torch.arange(hit)), step_rows]
                )
            got = out.hidden_states.get(r)
            counts.rows_compared += len(want)
            if got is None or not torch.equal(got, want):
                counts.mismatches.append(f"step {counts.steps} {r}: hit {hit}, start {start}")
        # The sampler: a prefix of the drafts accepted, the first rejected one replaced.
        sampled: list[list[int]] = []
        for r in so.num_scheduled_tokens:
            req = sched.requests[r]
            if view.computed[r] + so.num_scheduled_tokens[r] < req.num_tokens:
                sampled.append([])  # a partial prefill samples nothing
                continue
            drafts = list(so.scheduled_spec_decode_tokens.get(r, ()))
            accepted = rng.randrange(len(drafts) + 1)
            sampled.append([*drafts[:accepted], rng.randrange(REAL_VOCAB)])
            for p in range(req.num_tokens + accepted, req.num_tokens + len(drafts)):
                dirty.add(slot(r, p))
                counts.rejected_rows += 1
        req_ids = list(so.num_scheduled_tokens)
        requests = {r: sched.requests[r] for r in req_ids}
        done = sched.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
            ),
        )
        for outs in done.values():
            for o in outs.outputs:
                if o.finished:
                    finished.append(list(requests[o.request_id].all_token_ids))
                    planned_end.pop(o.request_id, None)
        # The drafter: NUM_DRAFTS fresh drafts for every decoding request.
        decoding = [r.request_id for r in sched.running if not r.is_prefill_chunk]
        drafts_now = [
            list(range(next_draft + i * NUM_DRAFTS, next_draft + (i + 1) * NUM_DRAFTS))
            for i in range(len(decoding))
        ]
        next_draft += NUM_DRAFTS * len(decoding)
        assert next_draft < 4000, "toy rows stay exact in float32 below token 4096"
        sched.update_draft_token_ids(DraftTokenIds(decoding, drafts_now))
    return counts


@pytest.mark.parametrize("seed", range(4))
def test_rejected_draft_rows_are_never_served(seed: int) -> None:
    counts = _run(seed)
    print(counts)
    assert not counts.mismatches, "\n".join(counts.mismatches[:10])
    assert counts.rejected_rows > 0 and counts.hits > 0
    assert counts.rows_over_rejected > 0, "no hit covered a slot that held a rejected row"


def test_a_mirror_without_the_rollback_is_caught() -> None:
    """The check has teeth: fed the positions a runner that ignored the rollback would
    write at (where they fit in the request's blocks), hscache's cache stores rows at the
    wrong slots and later hits serve rows this comparison rejects."""
    wrong = [len(_run(seed, rollback=False).mismatches) for seed in range(4)]
    print("wrong rows served per seed:", wrong)
    assert all(wrong), wrong
