"""Command line for the differential harness.

    cd tests && python -m vllm_diff --seeds 0:200 --ops 500            # hscache.vllm vs vLLM
    cd tests && python -m vllm_diff --long              # soak: >= 1M manager calls, all layouts
    cd tests && python -m vllm_diff --seeds 5000: --min-calls 200000 --keep-going
    cd tests && python -m vllm_diff --real --seeds 0:50      # vLLM's real Scheduler, parity
    cd tests && python -m vllm_diff --candidate vllm_diff.mutants:FreeForwardOrder --seeds 0:5
    cd tests && python -m vllm_diff --seeds 17 --minimize --dump /tmp/repro   # short repro
    cd tests && python -m vllm_diff --replay /tmp/repro/seed17.json

Environment: VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 (set by default).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import logging
import os
import sys
import time
from collections.abc import Iterator


def _seeds(spec: str) -> Iterator[int]:
    """``0:200``, ``3,17,40:50``; ``5000:`` is open-ended (with ``--min-calls``)."""
    for part in spec.split(","):
        if ":" in part:
            a, b = part.split(":")
            yield from (itertools.count(int(a)) if b == "" else range(int(a), int(b)))
        else:
            yield int(part)


# --long: seeds of their own (CI runs 0..~300), every layout family, 1M calls at least.
LONG_SEEDS = "100000:"
LONG_MIN_CALLS = 1_000_000
LONG_OPS = 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_diff",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--candidate",
        default=None,
        help="module:Class (default $HSCACHE_DIFF_CANDIDATE or hscache.vllm:KVCacheManager)",
    )
    ap.add_argument("--seeds", default="0:200", help="e.g. 0:200 or 3,17,40:50")
    ap.add_argument("--ops", type=int, default=500, help="manager calls per trace")
    ap.add_argument("--minimize", action="store_true", help="shrink each divergence")
    ap.add_argument("--dump", default=None, help="write <dir>/seed<N>.json replay files")
    ap.add_argument("--replay", default=None, help="replay a dumped .json trace")
    ap.add_argument("--keep-going", action="store_true", help="do not stop at the first failure")
    ap.add_argument(
        "--min-calls",
        type=int,
        default=0,
        help="stop once the traces made this many manager calls (with an open seed range)",
    )
    ap.add_argument(
        "--long",
        action="store_true",
        help=f"soak mode: --seeds {LONG_SEEDS} --ops {LONG_OPS} --min-calls {LONG_MIN_CALLS} "
        "--keep-going (explicit flags win)",
    )
    ap.add_argument(
        "--real",
        action="store_true",
        help="drive vLLM's real Scheduler (parity mode) instead of the trace generator "
        "(--ops: scheduler steps per stream, default 120)",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.long:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--seeds" not in given:
            args.seeds = LONG_SEEDS
        if "--ops" not in given:
            args.ops = LONG_OPS
        if "--min-calls" not in given:
            args.min_calls = LONG_MIN_CALLS
        args.keep_going = True
    if args.seeds.endswith(":") and not args.min_calls:
        ap.error("an open seed range needs --min-calls")

    from . import shrinking, trace
    from .actions import dump_repro, format_actions, load_repro
    from .config import config_for_seed, load_candidate
    from .errors import Divergence, HarnessError

    if not args.verbose:
        for name in ("vllm", "vllm.v1.core.block_pool", "hscache"):
            logging.getLogger(name).setLevel(logging.ERROR)

    candidate = load_candidate(args.candidate)
    print(f"candidate: {candidate.__module__}.{candidate.__qualname__}", flush=True)

    if args.replay:
        cfg, actions = load_repro(args.replay)
        print(format_actions(actions))
        try:
            n = shrinking.replay(actions, cfg, candidate)
        except Divergence as d:
            print(d)
            return 1
        print(f"no divergence ({n} calls)")
        return 0

    if args.real:
        return _run_real(args)

    total: collections.Counter[str] = collections.Counter()
    failures = 0
    traces = 0
    t0 = time.perf_counter()
    for seed in _seeds(args.seeds):
        if args.min_calls and total["calls"] >= args.min_calls:
            break
        traces += 1
        cfg = config_for_seed(seed, num_ops=args.ops)
        t1 = time.perf_counter()
        try:
            summary = trace.run_trace(seed, cfg, candidate)
        except HarnessError as e:
            failures += 1
            print(f"--- seed {seed} [{cfg.short()}]\nHARNESS ERROR: {e}", flush=True)
            if not args.keep_going:
                return 1
            continue
        except Divergence as d:
            failures += 1
            print(f"--- seed {seed} [{cfg.short()}]\n{d}", flush=True)
            actions = d.actions
            if args.minimize:
                actions, best = shrinking.minimize(d, candidate)
                print(
                    f"--- minimized ({len(d.actions)} -> {len(actions)} actions; "
                    f"from trace seed={best.seed}, config {best.config.short()}):"
                )
                print(format_actions(actions))
                print(f"config: {best.config}")
                d = best
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                path = os.path.join(args.dump, f"seed{seed}.json")
                dump_repro(
                    path,
                    dataclasses.replace(d.config, deep_every=1) if args.minimize else d.config,
                    actions,
                )
                print(f"wrote {path}")
            if not args.keep_going:
                return 1
            continue
        total.update(summary)
        if args.verbose:
            print(
                f"seed {seed} [{cfg.short()}] ok: {summary.get('calls')} calls "
                f"{time.perf_counter() - t1:.2f}s",
                flush=True,
            )
    dt = time.perf_counter() - t0
    print(
        f"{traces - failures} traces ok, {failures} failed, {total['calls']} manager calls "
        f"compared, {dt:.1f}s"
    )
    known = {k: v for k, v in total.items() if k.startswith("vllm_exception:")}
    if known:
        print("documented vLLM crashes (traces ended there):", known)
    print("coverage:", dict(sorted(total.items())))
    return 1 if failures else 0


def _run_real(args: argparse.Namespace) -> int:
    """``--real``: seeded request streams on vLLM's real Scheduler, both managers in
    parity mode (see ``real_scheduler``)."""
    from .real_scheduler import real_config_for_seed, run_real_scheduler

    steps = args.ops if "--ops" in sys.argv[1:] else 120
    total: collections.Counter[str] = collections.Counter()
    failures = streams = 0
    t0 = time.perf_counter()
    for seed in _seeds(args.seeds):
        if args.min_calls and total["calls"] >= args.min_calls:
            break
        streams += 1
        cfg = real_config_for_seed(seed, steps=steps)
        try:
            summary = run_real_scheduler(seed, cfg)
        except AssertionError as e:  # ParityError, RealSchedulerDivergence
            failures += 1
            print(f"--- seed {seed} [{cfg.short()}]\n{type(e).__name__}: {e}", flush=True)
            if not args.keep_going:
                return 1
            continue
        total.update(summary)
        if args.verbose:
            print(f"seed {seed} [{cfg.short()}] ok: {summary}", flush=True)
    dt = time.perf_counter() - t0
    print(
        f"{streams - failures} streams ok, {failures} failed, {total['calls']} manager calls "
        f"compared, {dt:.1f}s"
    )
    print("coverage:", dict(sorted(total.items())))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
