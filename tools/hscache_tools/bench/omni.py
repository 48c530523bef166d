"""``python -m hscache bench-omni``: a thinker stage's host time per step, with and without
a hidden-state prefix cache, side by side (vLLM 0.30 + vllm-omni 0.30's environment).

Four arms step the same seeded request stream in lockstep, one step of each in turn (the
order rotates), on vllm-omni's own ``OmniARScheduler`` built offline
(:mod:`hscache_tools.testing.offline_scheduler`) with a stub model:

- ``none``: no hidden-state cache, vLLM's KV-cache manager (vllm-omni's default stage);
- ``none+hs-kv``: no hidden-state cache, hscache's KV-cache manager;
- ``vllm-omni``: vllm-omni's ``OmniPrefixCacheManager``, vLLM's KV-cache manager;
- ``hscache``: hscache's ``OmniHiddenStateCache`` and KV-cache manager
  (``hscache.omni.OmniARScheduler``);
- ``hscache-w1``: the same with every per-token output one element wide, the control
  that splits hscache's cost: its cache time is the **bookkeeping** (step begin, the
  rules' and the mirror's decisions, the ledger, the hit decisions, and every torch call's
  fixed cost, with next to no bytes copied); ``hscache`` minus ``hscache-w1`` is the
  **row copies** (the cache write, the host copy of the plain requests' rows, the hits'
  gather), side by side in one run.

Per step and arm: ``schedule()``, the cache's ``new_step_starts`` (before the runner's
batch update, as vllm-omni's runners call it), ``save_outputs`` of the step's hidden states
(``--hidden`` wide, ``--dtype``) and one per-token multimodal output (``--mm-width``
float32 columns), padded like a CUDA graph's batch, ``materialize`` of the whole batch,
then ``update_from_output``. Timed: the scheduler's two calls and the cache's three; not
timed: the stub model and the runner's batch update (an emulated ``InputBatch`` whose CPU
block table feeds vllm-omni's own ``FullAttentionGroupView``, which both caches read).
Workload: ``--concurrency`` requests in flight, each a shared system prompt (one of
``--prefixes``) plus a unique tail, decoding ``--decode`` tokens on average (half to one
and a half times that, so that arrivals spread over the steps); a finished request is
replaced at once, so prefix hits happen on every arrival. All four arms must make the same
scheduling decisions (checked every step).

Reported per concurrency: medians over the measured steps of the whole step's bookkeeping
(scheduler + cache) and of the cache's own three calls, and ratios measured in the same run:
hscache's step against the no-cache step in total and in bookkeeping only (the
``hscache-w1`` step), beside its row copies.
``--threads`` (default 1) sets torch's intra-op threads: with torch's default, every op
above its parallel grain size (a few hundred rows of a narrow key) wakes the OpenMP pool,
which on a loaded host costs milliseconds per op in the arms that use torch (both caches)
and measures the host's load, not the cache.
CPU only: the rows live in host memory (``cpu`` storage for hscache; vllm-omni's pool is
pinned only with CUDA), so device and pinned-host storage are not compared here.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["ARMS", "OmniBenchConfig", "main", "run"]

ARMS = ("none", "none+hs-kv", "vllm-omni", "hscache", "hscache-w1")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MM_KEY = "talker.codes"


@dataclass
class OmniBenchConfig:
    concurrency: int = 16
    steps: int = 200
    warmup: int = 20
    hidden: int = 3584
    dtype: str = "bf16"
    mm_width: int = 16
    block_size: int = 16
    prefix_len: int = 256
    prefixes: int = 4
    tail_len: int = 48
    decode: int = 48
    token_budget: int = 2048
    seed: int = 0


@dataclass
class ArmTimes:
    step_ns: list[int] = field(default_factory=list)
    sched_ns: list[int] = field(default_factory=list)
    cache_ns: list[int] = field(default_factory=list)


class _InputBatch:
    """The runner's batch as vllm-omni's ``FullAttentionGroupView`` reads it: a CPU block
    table (one row per request slot), the batch order, the computed tokens at step start."""

    class _Table:
        use_hybrid_blocks = False
        blocks_per_kv_block = 1
        dcp_world_size = 1

        def __init__(self, rows: int, cols: int, block_size: int) -> None:
            self.kv_cache_block_size = block_size
            self.block_table = type("T", (), {})()
            self.block_table.cpu = torch.zeros((rows, cols), dtype=torch.int32)

    def __init__(self, max_reqs: int, max_blocks: int, block_size: int) -> None:
        self.block_table = [self._Table(max_reqs, max_blocks, block_size)]
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu = np.zeros(max_reqs, dtype=np.int64)
        self._lengths = np.zeros(max_reqs, dtype=np.int64)
        self._free = list(range(max_reqs - 1, -1, -1))

    def _row(self, req_id: str) -> int:
        idx = self.req_id_to_index.get(req_id)
        if idx is None:
            idx = self._free.pop()
            self.req_id_to_index[req_id] = idx
            self._lengths[idx] = 0
        return idx

    def _set(self, idx: int, ids: Sequence[int], append: bool) -> None:
        table = self.block_table[0].block_table.cpu
        start = int(self._lengths[idx]) if append else 0
        table[idx, start : start + len(ids)] = torch.tensor(list(ids), dtype=torch.int32)
        self._lengths[idx] = start + len(ids)

    def update(self, so: Any) -> None:
        for r in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            idx = self.req_id_to_index.pop(r, None)
            if idx is not None:
                self._free.append(idx)
        for new in so.scheduled_new_reqs:
            idx = self._row(new.req_id)
            self._set(idx, new.block_ids[0], append=False)
            self.num_computed_tokens_cpu[idx] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, r in enumerate(cached.req_ids):
            idx = self._row(r)
            ids = cached.new_block_ids[i]
            if r in cached.resumed_req_ids:
                self._set(idx, ids[0], append=False)
            elif ids is not None:
                self._set(idx, ids[0], append=True)
            self.num_computed_tokens_cpu[idx] = cached.num_computed_tokens[i]
        self.req_ids = list(so.num_scheduled_tokens)


@dataclass
class _Arm:
    name: str
    sched: Any
    batch: _InputBatch
    cache: Any = None
    times: ArmTimes = field(default_factory=ArmTimes)


def _build_arms(cfg: OmniBenchConfig) -> list[_Arm]:
    import hscache.omni
    from hscache.omni import OmniHiddenStateCache, OmniSettings
    from vllm_omni.core.prefix_cache import (
        ModelCachePolicy,
        OmniPrefixCacheManager,
        PrefixCacheConfig,
    )
    from vllm_omni.core.prefix_cache.group_view import FullAttentionGroupView
    from vllm_omni.core.sched.omni_ar_scheduler import OmniARScheduler

    from hscache_tools.testing.offline_scheduler import make_scheduler

    bs = cfg.block_size
    per_req = -(-(cfg.prefix_len + cfg.tail_len + cfg.decode) // bs) + 1
    num_blocks = cfg.concurrency * per_req + cfg.prefixes * per_req + 64
    max_blocks = per_req + 2
    arms: list[_Arm] = []
    for name in ARMS:
        ours = name in ("none+hs-kv", "hscache", "hscache-w1")
        cls = hscache.omni.OmniARScheduler if ours else OmniARScheduler
        sched = make_scheduler(
            cls,
            num_blocks,
            block_size=bs,
            max_num_seqs=cfg.concurrency,
            max_num_batched_tokens=cfg.token_budget,
            max_model_len=max(4096, max_blocks * bs),
        )
        batch = _InputBatch(cfg.concurrency, max_blocks, bs)
        arm = _Arm(name, sched, batch)
        if name == "vllm-omni":
            pc = PrefixCacheConfig(
                num_blocks=num_blocks, block_size=bs, staging_capacity_tokens=cfg.token_budget
            )
            arm.cache = OmniPrefixCacheManager(pc, FullAttentionGroupView(batch, bs))  # type: ignore[arg-type,unused-ignore]
            arm.cache.register_policy(ModelCachePolicy())
        elif name in ("hscache", "hscache-w1"):
            pc = PrefixCacheConfig(num_blocks=num_blocks, block_size=bs)
            arm.cache = OmniHiddenStateCache(
                pc, FullAttentionGroupView(batch, bs), settings=OmniSettings(storage="cpu")
            )  # type: ignore[arg-type,unused-ignore]
            arm.cache.register_policy(ModelCachePolicy())
        arms.append(arm)
    return arms


def _decisions(so: Any) -> tuple[Any, ...]:
    from hscache_tools.testing.offline_scheduler import summarize_output

    return summarize_output(so)


def run(cfg: OmniBenchConfig) -> dict[str, Any]:
    """One concurrency: every arm's per-step times (ns) and the medians and ratios."""
    # One piece: every arm steps through the same generated step in one loop, so that the arms
    # see the same requests and rows in the same order.
    from vllm.v1.outputs import ModelRunnerOutput

    from hscache_tools.testing.requests import init_none_hash, make_request

    init_none_hash("sha256")
    rng = random.Random(cfg.seed)
    arms = _build_arms(cfg)
    # As vLLM's EngineCore does after start: what exists now is never collected again.
    gc.collect()
    gc.freeze()
    dtype = _DTYPES[cfg.dtype]
    pad = 8
    hidden_buf = torch.randn(cfg.token_budget + pad, cfg.hidden).to(dtype)
    mm_buf = torch.randn(cfg.token_budget + pad, cfg.mm_width)
    # The control's outputs: one element per token and key.
    narrow = (hidden_buf[:, :1].clone(), mm_buf[:, :1].clone())
    prefixes = [
        [rng.randrange(1, 30000) for _ in range(cfg.prefix_len)] for _ in range(cfg.prefixes)
    ]
    next_id = 0
    hits = 0
    total = cfg.warmup + cfg.steps
    for step in range(total):
        # Keep `concurrency` requests in flight: a finished one is replaced at once.
        while len(arms[0].sched.requests) < cfg.concurrency:
            prompt = list(rng.choice(prefixes))
            prompt += [rng.randrange(1, 30000) for _ in range(cfg.tail_len)]
            # Staggered lengths: arrivals spread over the steps instead of in waves.
            max_tokens = rng.randint(max(1, cfg.decode // 2), cfg.decode * 3 // 2)
            for arm in arms:
                arm.sched.add_request(
                    make_request(
                        f"r{next_id}",
                        prompt,
                        max_tokens=max_tokens,
                        hash_block_size=cfg.block_size,
                        ignore_eos=True,
                    )
                )
            next_id += 1
        decisions = None
        start = step % len(arms)
        for arm in arms[start:] + arms[:start]:
            sched, cache = arm.sched, arm.cache
            t0 = time.perf_counter_ns()
            so = sched.schedule()
            t1 = time.perf_counter_ns()
            if cache is not None:
                cache.new_step_starts(so)
            t2 = time.perf_counter_ns()
            arm.batch.update(so)  # the runner's batch update: not timed
            n = so.total_num_scheduled_tokens
            padded = n + (-n % pad)
            c_ns = t2 - t1
            if cache is not None and n:
                hid, mm = narrow if arm.name == "hscache-w1" else (hidden_buf, mm_buf)
                t3 = time.perf_counter_ns()
                step_id = cache.save_outputs(
                    hid[:padded],
                    {MM_KEY: mm[:padded]},
                    num_tokens_unpadded=n,
                    num_tokens_padded=padded,
                )
                cache.materialize(step_id, list(arm.batch.req_ids))
                t4 = time.perf_counter_ns()
                c_ns += t4 - t3
            req_ids = list(so.num_scheduled_tokens)
            mro = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[
                    [(step * 31 + i) % 29999 + 1]
                    if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                    else []
                    for i, r in enumerate(req_ids)
                ],
            )
            sched._last_stats_time = float("-inf")  # every step's stats, every arm
            t5 = time.perf_counter_ns()
            sched.update_from_output(so, mro)
            t6 = time.perf_counter_ns()
            if step >= cfg.warmup:
                arm.times.step_ns.append((t1 - t0) + c_ns + (t6 - t5))
                arm.times.sched_ns.append((t1 - t0) + (t6 - t5))
                arm.times.cache_ns.append(c_ns)
            d = _decisions(so)
            if decisions is None:
                decisions = d
                hits += sum(1 for new in so.scheduled_new_reqs if new.num_computed_tokens)
            elif d != decisions:
                raise RuntimeError(f"step {step}: arm {arm.name} scheduled differently")
    ours = next(a for a in arms if a.name == "hscache")
    return {
        "concurrency": cfg.concurrency,
        "steps": cfg.steps,
        "hit_requests": hits,
        "requests": next_id,
        "arms": {a.name: _summary(a.times) for a in arms},
        "rows": {k: v / total for k, v in ours.cache.row_copies().items()},
    }


def _summary(t: ArmTimes) -> dict[str, float]:
    """Medians and means in microseconds."""
    return {
        "step": statistics.median(t.step_ns) / 1e3,
        "step_mean": statistics.fmean(t.step_ns) / 1e3,
        "sched": statistics.median(t.sched_ns) / 1e3,
        "cache": statistics.median(t.cache_ns) / 1e3,
        "cache_mean": statistics.fmean(t.cache_ns) / 1e3,
    }


def format_table(results: Sequence[dict[str, Any]], cfg: OmniBenchConfig) -> str:
    lines = [
        f"thinker stage host time per step (us), torch threads {torch.get_num_threads()}; "
        f"hidden {cfg.hidden} {cfg.dtype} + one per-token mm key ({cfg.mm_width} x fp32), "
        f"block {cfg.block_size}, {cfg.prefixes} shared {cfg.prefix_len}-token prefixes + "
        f"{cfg.tail_len}-token tails, ~{cfg.decode} decode tokens; CPU tensors",
        "",
        "| concurrent | arm | step median | step mean | scheduler median | cache median "
        "| cache mean |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for name, a in r["arms"].items():
            cache = (
                ("-", "-")
                if name.startswith("none")
                else (
                    f"{a['cache']:.0f}",
                    f"{a['cache_mean']:.0f}",
                )
            )
            lines.append(
                f"| {r['concurrency']} | {name} | {a['step']:.0f} | {a['step_mean']:.0f} "
                f"| {a['sched']:.0f} | {cache[0]} | {cache[1]} |"
            )
    lines += [
        "",
        "| concurrent | steps | hits/arrivals | vllm-omni cache / hscache cache (median, mean) "
        "| hscache step / none step (median, mean) | hscache step / none+hs-kv step |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        a = r["arms"]
        om, hs, no, nh = a["vllm-omni"], a["hscache"], a["none"], a["none+hs-kv"]
        lines.append(
            f"| {r['concurrency']} | {r['steps']} | {r['hit_requests']}/{r['requests']} "
            f"| {om['cache'] / hs['cache']:.2f}x, {om['cache_mean'] / hs['cache_mean']:.2f}x "
            f"| {hs['step'] / no['step']:.2f}x, {hs['step_mean'] / no['step_mean']:.2f}x "
            f"| {hs['step'] / nh['step']:.2f}x |"
        )
    lines += [
        "",
        "hscache's cache split (medians, us): bookkeeping = the hscache-w1 arm's cache time "
        "(outputs 1 element wide), row copies = hscache's cache time minus it; the goal: "
        "hscache's step in bookkeeping at most 1.2x the no-cache step",
        "",
        "| concurrent | hscache cache | bookkeeping | row copies | hscache step / none step "
        "(total) | hscache-w1 step / none step (bookkeeping, median, mean) "
        "| rows per step: written / gathered / kept |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        a = r["arms"]
        hs, w1, no = a["hscache"], a["hscache-w1"], a["none"]
        rows = r["rows"]
        lines.append(
            f"| {r['concurrency']} | {hs['cache']:.0f} | {w1['cache']:.0f} "
            f"| {hs['cache'] - w1['cache']:.0f} | {hs['step'] / no['step']:.2f}x "
            f"| {w1['step'] / no['step']:.2f}x, {w1['step_mean'] / no['step_mean']:.2f}x "
            f"| {rows['written']:.1f} / {rows['gathered']:.1f} / {rows['kept']:.1f} |"
        )
    lines.append("")
    lines.append(
        "rows per step (means over every step, per key): written into the cache, gathered "
        "for the hits, kept as the host copy of the plain requests' rows (a copy of the "
        "whole step would keep every written row)."
    )
    lines.append(
        "step = schedule() + update_from_output() + the cache's new_step_starts, "
        "save_outputs and materialize; scheduler = the first two; cache = the last three. "
        "Same requests and decisions in every arm, one step of each in turn."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hscache bench-omni", description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 64])
    defaults = OmniBenchConfig()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=defaults.dtype)
    parser.add_argument("--mm-width", type=int, default=defaults.mm_width)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--prefix-len", type=int, default=defaults.prefix_len)
    parser.add_argument("--prefixes", type=int, default=defaults.prefixes)
    parser.add_argument("--tail-len", type=int, default=defaults.tail_len)
    parser.add_argument("--decode", type=int, default=defaults.decode)
    parser.add_argument("--token-budget", type=int, default=defaults.token_budget)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default); see the module doc",
    )
    args = parser.parse_args(argv)
    try:
        import vllm_omni  # noqa: F401
    except ImportError:
        print(
            "bench-omni needs vllm-omni 0.30 on vLLM 0.30 (the environment of "
            "scripts/vllm030_env.sh)"
        )
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    import logging

    for name in ("vllm", "vllm_omni", "hscache"):
        logging.getLogger(name).setLevel(logging.WARNING)
    results = []
    cfg = defaults
    for c in args.concurrency:
        cfg = OmniBenchConfig(
            concurrency=c,
            steps=args.steps,
            warmup=args.warmup,
            hidden=args.hidden,
            dtype=args.dtype,
            mm_width=args.mm_width,
            block_size=args.block_size,
            prefix_len=args.prefix_len,
            prefixes=args.prefixes,
            tail_len=args.tail_len,
            decode=args.decode,
            token_budget=args.token_budget,
            seed=args.seed,
        )
        results.append(run(cfg))
    print(format_table(results, cfg))
    return 0
