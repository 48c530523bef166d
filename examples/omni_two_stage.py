"""Two-stage omni pipeline on hscache: a thinker scheduled by vLLM, a talker fed full hidden states.

The thinker stage runs vLLM 0.33's real ``Scheduler`` with hscache's KV-cache manager
(``hscache.vllm.Scheduler``) over requests that share prefixes, so vLLM reports prefix hits
and computes only the uncached tail. A small deterministic causal model stands in for the
network: the hidden state at position ``t`` is an exact integer function of tokens
``0..t`` (a prefix hash turned into features), so any two computations of a position agree
bit for bit however the prompt was chunked. ``HiddenStateCache`` stores every computed row
and serves each hit request's *full* rows; the talker stage consumes them and checks them
against a full recomputation.

Run (CPU, offline) from a checkout, after ``source scripts/env.sh`` (the offline vLLM
scheduler it drives is built by hscache's tools, ``tools/hscache_tools/testing/``, which
the wheel does not ship)::

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 python examples/omni_two_stage.py [--device cuda]

``tests/hidden_states/test_hidden_states.py`` drives randomized traces through the same pieces.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from hscache.hidden_states import HiddenStateCache, KeySpec, StepPlan, StepRows
from hscache.vllm import Scheduler
from hscache_tools.testing import requests
from hscache_tools.testing.offline_scheduler import make_scheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

requests.init_none_hash("sha256")

VOCAB = 1000
_P = 2_147_483_647  # 2^31 - 1: every product below stays under 2^62


class ToyCausalModel:
    """Stands in for the thinker network: exact, causal, chunking-independent.

    ``state[t] = mix(sum_{i <= t} embed(token_i, i))`` in integer arithmetic, and each key's
    row is a fixed integer feature map of ``state[t]`` cast to the key's dtype, so
    ``forward(tokens, s, e)`` equals ``forward(tokens, 0, e)[s:e]`` exactly.
    """

    def __init__(self, keys: Mapping[str, KeySpec], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = dict(keys)
        self._mult = {
            k: torch.randint(1, _P, (width,), generator=g, dtype=torch.int64)
            for k, (width, _) in self.keys.items()
        }

    def state(self, token_ids: Sequence[int], end: int) -> torch.Tensor:
        """The integer prefix state of positions ``0..end-1``."""
        t = torch.tensor(list(token_ids[:end]), dtype=torch.int64)
        pos = torch.arange(end, dtype=torch.int64)
        a = ((t + 7) * 1_000_003 + pos * 97 + 1) % _P
        return (torch.cumsum(a, 0) % _P) * 48271 % _P

    def features(self, state: torch.Tensor, device: torch.device | str) -> dict[str, torch.Tensor]:
        out = {}
        for k, (_, dtype) in self.keys.items():
            f = state[:, None] * self._mult[k][None, :] % _P
            if dtype.is_floating_point:
                v = ((f % 65536).to(torch.float64) / 65536.0 - 0.5).to(dtype)
            else:
                v = (f % 1000).to(dtype)
            out[k] = v.to(device)
        return out

    def forward(
        self, token_ids: Sequence[int], start: int, end: int, device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Rows of positions ``start..end-1``."""
        return self.features(self.state(token_ids, end)[start:end], device)

    def sample(self, token_ids: Sequence[int], end: int) -> int:
        """The next token after position ``end - 1`` (greedy on the toy state)."""
        return int(self.state(token_ids, end)[-1]) % VOCAB


def build_scheduler(
    *,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    long_prefill_token_threshold: int = 0,
    max_model_len: int = 1024,
    use_v2_model_runner: bool = False,
) -> Scheduler:
    """vLLM's ``Scheduler`` with hscache's manager, built offline the way vLLM's tests do."""
    scheduler: Scheduler = make_scheduler(
        Scheduler,
        num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        watermark=0.0,
    )
    scheduler.use_v2_model_runner = use_v2_model_runner
    return scheduler


def make_request(req_id: str, prompt: Sequence[int], max_tokens: int, block_size: int) -> Request:
    return requests.make_request(
        req_id, prompt, max_tokens=max_tokens, hash_block_size=block_size, ignore_eos=True
    )


@dataclass
class Talker:
    """The second stage: assembles every request's full thinker rows, position by position."""

    keys: Sequence[str]
    rows: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    filled: dict[str, int] = field(default_factory=dict)

    def feed(self, req_id: str, start: int, rows: Mapping[str, torch.Tensor]) -> None:
        have = self.filled.get(req_id, 0)
        if start > have:
            raise AssertionError(f"{req_id}: rows from {start} leave a hole after {have}")
        n = next(iter(rows.values())).shape[0]
        skip = have - start  # rows already held (a resumed request's served prefix)
        if skip < n:
            per_key = self.rows.setdefault(req_id, {k: [] for k in self.keys})
            for k in self.keys:
                per_key[k].append(rows[k][skip:])
            self.filled[req_id] = start + n

    def take(self, req_id: str) -> dict[str, torch.Tensor]:
        """The full rows of a finished request (the talker's input)."""
        self.filled.pop(req_id, None)
        per_key = self.rows.pop(req_id, {k: [] for k in self.keys})
        return {k: torch.cat(v) if v else torch.empty(0) for k, v in per_key.items()}


@dataclass
class Thinker:
    """The first stage: vLLM's scheduler, the toy model and the hidden-state cache."""

    scheduler: Scheduler
    model: ToyCausalModel
    cache: HiddenStateCache
    requests: dict[str, Request] = field(default_factory=dict)
    missed: set[str] = field(default_factory=set)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def forward(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """The step's rows, request after request in plan order (the gap of a non-aligned
        hit included: ``plan.compute_start`` may precede vLLM's ``num_computed_tokens``)."""
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in self.model.keys}
        for i, req_id in enumerate(plan.req_ids):
            tokens = self.requests[req_id].all_token_ids
            rows = self.model.forward(
                tokens, int(plan.compute_start[i]), int(plan.num_tokens[i]), self.cache.device
            )
            for k, t in rows.items():
                parts[k].append(t)
        device = self.cache.device
        return {
            k: torch.cat(v) if v else torch.empty((0, w), dtype=d, device=device)
            for (k, v), (w, d) in zip(parts.items(), self.model.keys.values(), strict=True)
        }

    def runner_output(self, plan: StepPlan) -> ModelRunnerOutput:
        sampled: list[list[int]] = []
        for i, req_id in enumerate(plan.req_ids):
            req = self.requests[req_id]
            end = int(plan.num_tokens[i])
            # A partial prefill samples nothing.
            sampled.append(
                [self.model.sample(req.all_token_ids, end)] if end >= req.num_tokens else []
            )
        return ModelRunnerOutput(
            req_ids=list(plan.req_ids),
            req_id_to_index={r: i for i, r in enumerate(plan.req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )

    def step(self) -> tuple[SchedulerOutput, StepPlan, StepRows, set[str]]:
        """One engine step: schedule, plan, forward, write + gather, update the scheduler.
        Returns the step's pieces and the ids of the requests that finished."""
        so = self.scheduler.schedule()
        plan = self.cache.update_from_scheduler_output(so)
        rows = self.cache.write_and_gather(plan, self.forward(plan))
        self.missed.update(rows.misses)
        outs = self.scheduler.update_from_output(so, self.runner_output(plan))
        finished = {
            o.request_id
            for eco in outs.values()
            for o in eco.outputs
            if o.finish_reason is not None
        }
        return so, plan, rows, finished


def run(
    *,
    num_requests: int = 48,
    block_size: int = 8,
    num_blocks: int = 96,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Runs the pipeline over requests that share a few system prompts; returns counters."""
    keys: dict[str, KeySpec] = {"hidden": (64, torch.float32), "layer24": (32, torch.bfloat16)}
    rng = random.Random(seed)
    model = ToyCausalModel(keys, seed)
    thinker = Thinker(
        build_scheduler(
            num_blocks=num_blocks, block_size=block_size, long_prefill_token_threshold=24
        ),
        model,
        HiddenStateCache(num_blocks, block_size, keys, device),
    )
    talker = Talker(list(keys))
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(16, 48))] for _ in range(4)]
    pending = [
        make_request(
            f"req-{i}",
            rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))],
            rng.randrange(1, 8),
            block_size,
        )
        for i in range(num_requests)
    ]
    served_tokens = 0
    checked = 0
    steps = 0
    while pending or thinker.scheduler.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randrange(0, 4))):
            thinker.add(pending.pop(0))
        _, _, rows, finished = thinker.step()
        steps += 1
        missed_now = set(rows.misses)
        for req_id in rows.req_ids:
            start = rows.start(req_id)
            if req_id in missed_now:
                # The cache refused a stale read: recompute the prefix (off the hot path).
                tokens = thinker.requests[req_id].all_token_ids
                talker.feed(req_id, 0, model.forward(tokens, 0, start, device))
            talker.feed(req_id, start, {k: rows.rows(req_id, k) for k in keys})
        served_tokens += sum(rows.reads.num_cached_tokens)
        for req_id in finished:
            req = thinker.requests.pop(req_id)
            full = talker.take(req_id)
            end = req.num_tokens - 1  # the last sampled token is never fed back
            want = model.forward(req.all_token_ids, 0, end, device)
            for k in keys:
                if not torch.equal(full[k], want[k]):
                    raise AssertionError(f"{req_id}: talker input for {k!r} differs")
            checked += 1
    return {
        "steps": steps,
        "requests_checked": checked,
        "cached_rows_served": served_tokens,
        "misses": len(thinker.missed),
        "memory_bytes": thinker.cache.memory_bytes(),
        "bytes_per_token": thinker.cache.bytes_per_token(),
        **{f"mirror_{k}": v for k, v in thinker.cache.stats().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stats = run(num_requests=args.requests, device=args.device, seed=args.seed)
    for k, v in stats.items():
        print(f"{k:>28}: {v}")
    print("talker inputs equal a full recomputation, bit for bit")


if __name__ == "__main__":
    main()
