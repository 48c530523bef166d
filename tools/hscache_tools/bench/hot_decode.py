"""``python -m hscache bench --hot-decode``: one decode token per call, everything in cache.

Owns the micro-benchmark behind the README's per-call table: for each layout of
:mod:`hscache_tools.bench.layouts`, ``R`` running requests (prompts already admitted and cached)
decode one token per step, and every ``allocate_slots(request, 1)`` is timed, vLLM's
manager and hscache's in the same process, the same requests and tokens, alternating which
runs first. The calls are split by what they do: **steady** (the new token fits in a held
block and fills none), **new block** (the token opens a block), **caching** (the token
fills a block, which is cached, with its ``BlockStored`` event when events are on). With
nothing else running between the calls, this is the floor of each manager's per-call
cost; the scenario benchmark (``python -m hscache bench``) measures calls with the
Scheduler's own work in between.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HotDecodeResult", "main", "run_hot_decode"]

_KINDS = ("steady", "new block", "caching")


@dataclass(frozen=True)
class HotDecodeResult:
    """Median ns per call kind and over all calls, for one manager on one layout."""

    layout: str
    manager: str
    median_ns: dict[str, float]
    """Per call kind (:data:`_KINDS`) and ``"all"``."""
    mean_ns: float
    steady_steps: int | None
    """Calls hscache's core decided as the steady decode step (None for vLLM's)."""


def _run_one(
    cls: type, layout: str, running: int, steps: int, events: bool, seed: int
) -> tuple[dict[str, list[int]], int | None]:
    from vllm.v1.request import RequestStatus

    from hscache_tools.bench.layouts import layout_config
    from hscache_tools.testing.manager import manager_kwargs
    from hscache_tools.testing.requests import init_none_hash, make_request, request_block_hasher

    lc = layout_config(layout, 2 * running * (steps // 16 + 64) + 64)
    init_none_hash("sha256")
    hasher = request_block_hasher(lc.hash_block_size, "sha256")
    kwargs = manager_kwargs(
        lc.kv_cache_config,
        max_model_len=16_384,
        scheduler_block_size=lc.scheduler_block_size,
        hash_block_size=lc.hash_block_size,
        enable_kv_cache_events=events,
    )
    m = cls(**kwargs)
    reqs = [
        make_request(
            f"r{i}",
            [(seed * 7919 + i * 7 + j) % 32_000 for j in range(300 + i)],
            max_tokens=steps + 1,
            block_hasher=hasher,
        )
        for i in range(running)
    ]
    for r in reqs:
        computed, hit, _ = m.get_computed_blocks(r)
        if m.allocate_slots(r, r.num_tokens - hit, hit, computed) is None:
            raise RuntimeError(f"{layout}: the pool cannot admit {running} requests")
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
    m.take_events()
    # A call opens or fills a block when it does so in the group of the smallest blocks
    # (the others' boundaries are multiples of it).
    bs = min(g.kv_cache_spec.block_size for g in lc.kv_cache_config.kv_cache_groups)
    samples: dict[str, list[int]] = {k: [] for k in _KINDS}
    pc = time.perf_counter_ns
    token = 1
    for _ in range(steps):
        for r in reqs:
            r.append_output_token_ids(token)
            token = token % 31_999 + 1
            t0 = pc()
            m.allocate_slots(r, 1, num_lookahead_tokens=0)
            t1 = pc()
            r.num_computed_tokens += 1
            n = r.num_computed_tokens
            kind = "new block" if n % bs == 1 else "caching" if n % bs == 0 else "steady"
            samples[kind].append(t1 - t0)
        m.take_events()
        m.new_step_starts()
    steady = getattr(m, "num_steady_steps", None)
    return samples, steady


def run_hot_decode(
    layouts: Sequence[str],
    running: int = 64,
    steps: int = 200,
    repeat: int = 3,
    events: bool = True,
    seed: int = 0,
) -> list[HotDecodeResult]:
    """vLLM's manager and hscache's on each layout; ``repeat`` rounds, alternating
    which goes first, samples pooled (the timer's own cost is not subtracted: it is
    the same for both)."""
    from hscache_tools.bench.managers import CANDIDATE_SPEC, REFERENCE_SPEC, load_class

    classes = {"vllm": load_class(REFERENCE_SPEC), "hscache": load_class(CANDIDATE_SPEC)}
    out: list[HotDecodeResult] = []
    gc.collect()
    gc.freeze()
    try:
        for layout in layouts:
            pooled: dict[str, dict[str, list[int]]] = {n: {k: [] for k in _KINDS} for n in classes}
            steady: dict[str, int | None] = {n: None for n in classes}
            for r in range(repeat):
                order = list(classes) if r % 2 == 0 else list(classes)[::-1]
                for name in order:
                    samples, s = _run_one(classes[name], layout, running, steps, events, seed)
                    for k in _KINDS:
                        pooled[name][k].extend(samples[k])
                    if s is not None:
                        steady[name] = (steady[name] or 0) + s
            for name in classes:
                every = [v for k in _KINDS for v in pooled[name][k]]
                med = {k: float(statistics.median(v)) for k, v in pooled[name].items() if v}
                med["all"] = float(statistics.median(every))
                out.append(
                    HotDecodeResult(layout, name, med, float(statistics.mean(every)), steady[name])
                )
    finally:
        gc.unfreeze()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from hscache_tools.bench.layouts import LAYOUTS

    parser = argparse.ArgumentParser(
        prog="python -m hscache bench --hot-decode", description=__doc__
    )
    parser.add_argument("--layout", default="all", help=f"{', '.join(LAYOUTS)} or all")
    parser.add_argument("--running", type=int, default=64, help="running requests")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per manager")
    parser.add_argument("--no-events", action="store_true", help="KV events off")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    layouts = list(LAYOUTS) if args.layout == "all" else [args.layout]
    results = run_hot_decode(
        layouts, args.running, args.steps, args.repeat, not args.no_events, args.seed
    )
    print(
        f"hot decode: allocate_slots(request, 1), {args.running} running, "
        f"{args.steps} steps x {args.repeat} rounds, KV events "
        f"{'off' if args.no_events else 'on'}; median ns per call"
    )
    header = f"{'layout':14s} {'manager':8s} " + " ".join(f"{k:>10s}" for k in (*_KINDS, "all"))
    print(header + f" {'mean':>8s}  steady calls")
    by: dict[tuple[str, str], Any] = {(r.layout, r.manager): r for r in results}
    for layout in layouts:
        for name in ("vllm", "hscache"):
            r = by[(layout, name)]
            cells = " ".join(f"{r.median_ns.get(k, float('nan')):10.0f}" for k in (*_KINDS, "all"))
            steady = "" if r.steady_steps is None else f"  {r.steady_steps}"
            print(f"{layout:14s} {name:8s} {cells} {r.mean_ns:8.0f}{steady}")
        v, h = by[(layout, "vllm")], by[(layout, "hscache")]
        ratios = " ".join(
            f"{v.median_ns[k] / h.median_ns[k]:9.1f}x" if k in h.median_ns else f"{'-':>10s}"
            for k in (*_KINDS, "all")
        )
        print(f"{layout:14s} {'ratio':8s} {ratios} {v.mean_ns / h.mean_ns:7.1f}x")
    return 0
