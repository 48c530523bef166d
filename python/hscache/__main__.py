"""``python -m hscache``: the command line (sub-commands ``bench`` and ``info``).

``bench`` runs the side-by-side benchmark of vLLM's KVCacheManager and hscache's (see
:mod:`hscache.bench`); ``bench --hidden-states [options]`` the hidden-state cache against bare
torch index ops (see :mod:`hscache.bench_hidden_states`, whose options follow); ``info``
prints the installed version and the build profile of the compiled core, tolerating a missing
or older core.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def info() -> int:
    """Print the version, build profile and location of hscache (and vLLM's version)."""
    from hscache.bench.runner import core_build_info

    core = core_build_info()
    version = core["version"] or _dist_version("hscache") or "unknown"
    print(f"hscache {version}")
    print(f"build profile: {core['build_profile'] or 'unknown'}")
    if core["core_error"]:
        print(f"hscache._core: not importable ({core['core_error']})")
    else:
        import hscache._core

        print(f"hscache._core: {getattr(hscache._core, '__file__', '?')}")
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    print(f"vllm: {_dist_version('vllm') or 'not installed'}")
    profile = core["build_profile"]
    if profile is not None and "debug" in profile.lower():
        print("WARNING: this is a DEBUG build; do not benchmark it.")
    return 0


def bench_scheduler_main(args: argparse.Namespace) -> int:
    """Print the scheduler-level comparison (see :mod:`hscache.bench.scheduler_level`)."""
    from hscache.bench.layouts import LAYOUTS
    from hscache.bench.scheduler_level import bench_scheduler

    layouts = list(LAYOUTS) if args.layout == "all" else [args.layout]
    for layout in layouts:
        res = bench_scheduler(
            seed=args.seed,
            steps=args.steps,
            num_blocks=args.num_blocks,
            prompt_len=args.prompt_len,
            arrivals_per_step=args.arrivals,
            repeat=args.repeat,
            layout=layout,
        )
        print(
            f"[{layout}] {LAYOUTS[layout]}\n"
            f"  medians per step over {res['steps']} steps x {res['repeat']} runs"
            "        whole step   KV-cache manager calls\n"
            f"  vLLM Scheduler (stock manager)            {res['vllm_median_us']:10.1f} us"
            f"   {res['vllm_kv_median_us']:10.1f} us\n"
            f"  hscache.vllm.Scheduler                    {res['hscache_median_us']:10.1f} us"
            f"   {res['hscache_kv_median_us']:10.1f} us\n"
            f"  ratio vLLM/hscache                        {res['speedup']:10.2f} x"
            f"   {res['kv_speedup']:10.2f} x   (decisions identical at every step)"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["bench"] and "--hidden-states" in args_in:
        from hscache.bench_hidden_states import main as bench_hidden_states

        return bench_hidden_states([a for a in args_in[1:] if a != "--hidden-states"])
    if args_in[:1] == ["bench"] and "--retention" in args_in:
        # The retention policies on a multi-tenant trace (hscache.bench.retention).
        from hscache.bench.retention import main as bench_retention

        return bench_retention([a for a in args_in[1:] if a != "--retention"])

    from hscache.bench.runner import add_arguments, run

    parser = argparse.ArgumentParser(prog="python -m hscache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="benchmark vLLM's KVCacheManager against hscache's, side by side",
        description="Drive vLLM's and hscache's KVCacheManager with the same seeded scheduler "
        "trace in one process, time only the manager calls, check that every decision "
        "matches, and report per-step medians, p90s and ratios.",
    )
    add_arguments(bench)
    bench.add_argument(
        "--hidden-states",
        action="store_true",
        help="benchmark the hidden-state cache against bare torch index ops instead "
        "(python -m hscache.bench_hidden_states; its options follow)",
    )
    sched = sub.add_parser(
        "bench-scheduler",
        help="vLLM's real Scheduler stepping with stub model outputs: stock vs hscache",
    )
    sched.add_argument("--steps", type=int, default=400)
    sched.add_argument("--repeat", type=int, default=3)
    sched.add_argument("--seed", type=int, default=0)
    sched.add_argument("--prompt-len", type=int, default=1024)
    sched.add_argument("--arrivals", type=float, default=2.0, help="new requests per step")
    sched.add_argument("--num-blocks", type=int, default=65536, help="blocks per KV group")
    sched.add_argument(
        "--layout",
        default="full",
        help="full, full+swa, full+mamba, full+chunked, or all",
    )
    sub.add_parser("info", help="print the version and build profile")
    args = parser.parse_args(args_in)
    if args.command == "info":
        return info()
    if args.command == "bench-scheduler":
        return bench_scheduler_main(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
