"""Command-line front end of ``python -m hscache bench``: options, progress, output.

Owns the ``bench`` sub-command's arguments (:func:`add_arguments`), the selection of scenarios,
the build-profile banner (with a loud warning for debug builds of ``hscache._core``), the
progress display (on a terminal: tqdm when importable, else a one-line stderr counter;
redirected to a file or under CI, one line per scenario run) and :func:`run`, which runs the
scenarios through :mod:`hscache_tools.bench.driver` and prints/writes the
:mod:`~hscache_tools.bench.report`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TextIO

from hscache.observability import core_build_info

from hscache_tools.bench.scenarios import (
    DEFAULT_SCENARIOS,
    QUICK_SCENARIOS,
    Scenario,
    all_scenarios,
)

__all__ = ["EVENT_CHOICES", "add_arguments", "run", "select_scenarios"]

EVENT_CHOICES = ("on", "off", "compact", "all")
# --events all: the candidate's event modes, one pass each, vLLM's events on in all.
_ALL_VARIANTS = ("vllm", "off", "compact")
_VARIANT_LABELS = {"vllm": "events on", "off": "events off", "compact": "compact events"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` sub-command's options."""
    from hscache_tools.bench.managers import CANDIDATE_SPEC, REFERENCE_SPEC

    parser.add_argument(
        "--quick", action="store_true", help="small scenarios, about 20 s (smoke run)"
    )
    parser.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help="run only this scenario (repeatable, or comma separated); see --list",
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--steps", type=int, metavar="N", help="measured steps per scenario")
    parser.add_argument(
        "--warmup", type=int, metavar="N", help="warm-up steps per scenario (not measured)"
    )
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="K",
        help="run each scenario K times (fresh managers, same trace) and pool the samples",
    )
    parser.add_argument("--json", metavar="FILE", help="write machine-readable results here")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="per-scenario bars of both managers' step times with the ratios "
        "(needs matplotlib: requirements/bench-plot.txt)",
    )
    parser.add_argument(
        "--candidate",
        default=CANDIDATE_SPEC,
        metavar="MODULE:CLASS",
        help=f"manager under test (default {CANDIDATE_SPEC})",
    )
    parser.add_argument(
        "--reference",
        default=REFERENCE_SPEC,
        metavar="MODULE:CLASS",
        help=f"baseline manager (default {REFERENCE_SPEC})",
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="do not compare the two managers' decisions after each step",
    )
    parser.add_argument(
        "--events",
        choices=EVENT_CHOICES,
        default="on",
        help="KV events: on (default, both managers, vLLM's stream); off (neither); compact "
        "(vLLM's stream vs hscache's compact one, HSCACHE_KV_EVENTS=compact); all (vLLM "
        "with events on against hscache with events on, off and compact, one pass each, "
        "and a table of per-step medians, ratios and events per step)",
    )
    parser.add_argument(
        "--no-events",
        action="store_true",
        help="same as --events off (diagnostic)",
    )
    parser.add_argument(
        "--mode",
        choices=("both", "drop-in", "batched"),
        default="both",
        help="drop-in: the candidate gets vLLM's per-request calls; batched: it serves the "
        "running set and finishes with one call each per step (allocate_slots_batch / "
        "free_batch); both (default): one pass of each",
    )
    parser.add_argument("--batched", action="store_true", help="same as --mode batched")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def select_scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The scenarios the options ask for, with --steps / --warmup applied."""
    if args.scenario:
        from hscache_tools.bench.scenarios import find_scenario

        names = [n.strip() for item in args.scenario for n in item.split(",") if n.strip()]
        try:
            chosen = [find_scenario(n) for n in names]
        except KeyError as exc:
            raise SystemExit(f"--scenario: {exc.args[0]}") from None
    elif args.quick:
        chosen = list(QUICK_SCENARIOS)
    else:
        chosen = list(DEFAULT_SCENARIOS)
    if args.steps is not None or args.warmup is not None:
        chosen = [s.with_steps(args.steps, args.warmup) for s in chosen]
    events = _events(args)
    if events == "off":
        chosen = [replace(s, kv_events=False) for s in chosen]
    elif events == "compact":
        chosen = [replace(s, candidate_events="compact") for s in chosen]
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    for s in chosen:
        if s.steps <= 0:
            raise SystemExit(f"scenario {s.name}: --steps must be positive")
        if s.warmup_steps < 0:
            raise SystemExit(f"scenario {s.name}: --warmup must not be negative")
    return chosen


def _events(args: argparse.Namespace) -> str:
    """``--events``, with ``--no-events`` as ``off``."""
    if getattr(args, "no_events", False):
        return "off"
    return str(getattr(args, "events", "on"))


def _variants(args: argparse.Namespace, sc: Scenario) -> list[Scenario]:
    """The passes of one scenario: itself, or with ``--events all`` one per candidate event
    mode (same name, so the same seeded trace)."""
    if _events(args) != "all":
        return [sc]
    return [replace(sc, candidate_events=v) for v in _ALL_VARIANTS]


def _pass_name(args: argparse.Namespace, sc: Scenario) -> str:
    """The scenario's name in the report (with ``--events all``, its pass's label)."""
    if _events(args) != "all":
        return sc.name
    return f"{sc.name} [{_VARIANT_LABELS[sc.candidate_events]}]"


def _events_banner(events: str) -> str:
    return {
        "on": "on (both managers, vLLM's stream)",
        "off": "off (both managers)",
        "compact": "vLLM's stream vs hscache's compact stream",
        "all": "vLLM on; hscache on, off and compact (one pass each)",
    }[events]


def _is_debug(profile: str | None) -> bool:
    return profile is not None and "debug" in profile.lower()


def _modes(args: argparse.Namespace) -> list[str]:
    """The candidate paths to measure, in order."""
    if args.batched or args.mode == "batched":
        return ["batched"]
    if args.mode == "drop-in":
        return ["drop-in"]
    return ["drop-in", "batched"]


def _banner(
    out: TextIO, args: argparse.Namespace, scenarios: Sequence[Scenario], info: dict[str, Any]
) -> None:
    print("hscache bench: vLLM KVCacheManager vs candidate, same process, same trace", file=out)
    print(f"  reference : {args.reference}", file=out)
    print(f"  candidate : {args.candidate}", file=out)
    print(f"  paths     : {', '.join(_modes(args))}", file=out)
    print(
        f"  hscache._core: version {info['version'] or '?'}, "
        f"build profile {info['build_profile'] or 'unknown'}"
        + (f" (not importable: {info['core_error']})" if info["core_error"] else ""),
        file=out,
    )
    print(
        f"  python {platform.python_version()}, {os.cpu_count()} CPUs, seed {args.seed}, "
        f"decision check {'off' if args.no_check else 'on'}, "
        f"KV events {_events_banner(_events(args))}",
        file=out,
    )
    print(f"  scenarios : {', '.join(s.name for s in scenarios)}", file=out)
    if _is_debug(info["build_profile"]):
        bar = "!" * 78
        print(
            f"\n{bar}\n!! WARNING: hscache._core is a DEBUG build "
            f"({info['build_profile']}); its timings are meaningless.\n"
            f"!! Rebuild with `maturin develop --release` before trusting the ratios.\n{bar}\n",
            file=out,
        )
    if args.candidate == args.reference:
        print("  note: candidate == reference (harness check): expect ratios of about 1", file=out)
    out.flush()


def _interactive() -> bool:
    """A terminal to redraw a progress bar on: stderr is a TTY and not under CI (``CI`` set
    to anything but ``false`` / ``0``, as CI services do)."""
    ci = os.environ.get("CI", "").strip().lower()
    return sys.stderr.isatty() and ci in ("", "0", "false")


class _Progress:
    """On a terminal, tqdm when importable, else a throttled one-line stderr counter;
    otherwise (output to a file, CI) no redrawn bar but one line per scenario run, written
    when it ends: a log holds no carriage-return updates."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total = total
        self.desc = desc
        self.enabled = enabled
        self.interactive = enabled and _interactive()
        self._bar: Any = None
        self._last = 0.0
        self._done = 0
        self._t0 = time.monotonic()
        self._closed = False
        if not self.interactive:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr)

    def update(self, done: int, total: int) -> None:
        self._done = done
        if not self.interactive:
            return
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or done == total:
            self._last = now
            sys.stderr.write(f"\r  {self.desc}: step {done}/{total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.interactive:
            sys.stderr.write("\r" + " " * (len(self.desc) + 30) + "\r")
            sys.stderr.flush()
        elif self.enabled:
            elapsed = time.monotonic() - self._t0
            sys.stderr.write(f"  {self.desc}: {self._done}/{self.total} steps in {elapsed:.1f} s\n")
            sys.stderr.flush()


def _load_managers(args: argparse.Namespace) -> tuple[type, type]:
    from hscache_tools.bench.managers import load_class

    try:
        reference = load_class(args.reference)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise SystemExit(f"cannot load the reference manager {args.reference!r}: {exc}") from exc
    try:
        candidate = load_class(args.candidate)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise SystemExit(
            f"cannot load the candidate manager {args.candidate!r}: {exc}\n"
            f"(to check the harness alone: --candidate {args.reference})"
        ) from exc
    return reference, candidate


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the ``bench`` sub-command; returns the process exit status."""
    # One piece: the `bench` sub-command from arguments to report, in the order the report
    # prints.
    stream = sys.stdout if out is None else out
    if args.list:
        for s in all_scenarios():
            kind = "quick" if s in QUICK_SCENARIOS else "default" if s in DEFAULT_SCENARIOS else ""
            print(
                f"{s.name:22s} {kind:8s} {s.warmup_steps:4d}+{s.steps:<5d} {s.description}",
                file=stream,
            )
        return 0

    scenarios = select_scenarios(args)
    info = core_build_info()
    _banner(stream, args, scenarios, info)

    from hscache_tools.bench.driver import calibrate_timer
    from hscache_tools.bench.report import ScenarioSummary, format_events_table, format_summary
    from hscache_tools.bench.results import RunResult

    t0 = time.perf_counter()
    reference, candidate = _load_managers(args)
    print(f"  (managers imported in {time.perf_counter() - t0:.1f} s)", file=stream)
    overhead = calibrate_timer()
    print(
        f"  timer overhead {overhead} ns per call, subtracted from every timed call\n", file=stream
    )
    stream.flush()

    runs: list[RunResult] = []
    summaries: list[ScenarioSummary] = []
    modes_of_runs: list[str] = []
    fallbacks: list[str] = []
    t_all = time.perf_counter()
    for mode in _modes(args):
        batched = mode == "batched"
        title = (
            "drop-in path: vLLM's per-request calls"
            if not batched
            else "batched path: one allocate_slots_batch + one free_batch per step"
        )
        print(f"#### {title}\n", file=stream)
        mode_summaries: list[ScenarioSummary] = []
        skipped = False
        for sc in scenarios:
            if skipped:
                break
            if batched and sc.layout != "full":
                print(
                    f"{sc.name}: skipped on the batched path (the batched API serves one "
                    f"full-attention group; layout {sc.layout} runs drop-in)\n",
                    file=stream,
                )
                continue
            passes = _run_passes(sc, mode, args, stream, reference, candidate, overhead)
            if passes is None:  # this path cannot run: skip its other scenarios
                skipped = True
                continue
            if isinstance(passes, int):
                return passes
            for result, summary in passes:
                runs.append(result)
                summaries.append(summary)
                modes_of_runs.append(mode)
                mode_summaries.append(summary)
                if result.candidate.class_name == result.reference.class_name and (
                    args.candidate != args.reference
                ):
                    fallbacks.append(summary.name)
        if mode_summaries:
            print(format_summary(mode_summaries, mode), file=stream)
            print("", file=stream)
            if _events(args) == "all":
                print(format_events_table(mode_summaries, mode), file=stream)
                print("", file=stream)

    print(
        f"{len(runs)} scenario runs in {time.perf_counter() - t_all:.1f} s; decisions "
        + ("identical at every step." if not args.no_check else "not checked (--no-check)."),
        file=stream,
    )
    if _is_debug(info["build_profile"]):
        print(
            "WARNING: hscache._core is a DEBUG build; these numbers are not meaningful.",
            file=stream,
        )
    if not _write_outputs(args, info, overhead, summaries, runs, modes_of_runs, fallbacks, stream):
        return 1
    return 0


def _run_passes(
    sc: Scenario,
    mode: str,
    args: argparse.Namespace,
    stream: TextIO,
    reference: type,
    candidate: type,
    overhead: int,
) -> list[tuple[Any, Any]] | int | None:
    """The passes of one scenario (``--events all``: one per candidate event mode), each
    run ``--repeat`` times, round-robin over the passes so that a change of machine load
    favours none, then pooled and printed: each pass's result and summary; an exit status
    (a divergence); or None (this path cannot run it)."""
    from hscache_tools.bench.driver import DivergenceError, UnsupportedScenarioError, run_scenario
    from hscache_tools.bench.report import format_scenario, summarize
    from hscache_tools.bench.results import RunResult, merge_runs

    batched = mode == "batched"
    variants = _variants(args, sc)
    repeats: list[list[RunResult]] = [[] for _ in variants]
    for k in range(args.repeat):
        for variant, done in zip(variants, repeats, strict=True):
            name = _pass_name(args, variant)
            desc = name if args.repeat == 1 else f"{name} [{k + 1}/{args.repeat}]"
            bar = _Progress(variant.total_steps, f"{desc} ({mode})", not args.no_progress)
            try:
                done.append(
                    run_scenario(
                        variant,
                        reference,
                        candidate,
                        seed=args.seed,
                        check=not args.no_check,
                        progress=bar.update,
                        timer_overhead_ns=overhead,
                        batched=batched,
                    )
                )
            except DivergenceError as exc:
                bar.close()
                print(
                    f"\nDIVERGENCE in scenario {name} ({mode}, seed {args.seed}):\n{exc}",
                    file=stream,
                )
                print("The candidate made a different decision from vLLM; aborting.", file=stream)
                return 3
            except UnsupportedScenarioError as exc:
                bar.close()
                print(f"\n{exc}; skipping", file=stream)
                return None
            except AttributeError as exc:
                bar.close()
                if not batched:
                    raise
                print(f"\nthe candidate has no batched API ({exc}); skipping", file=stream)
                return None
            finally:
                bar.close()
    out = []
    for variant, done in zip(variants, repeats, strict=True):
        name = _pass_name(args, variant)
        result = merge_runs(done)
        if result.candidate.class_name == result.reference.class_name and (
            args.candidate != args.reference
        ):
            print(
                f"WARNING: in {name} the candidate constructed "
                f"{result.candidate.class_name} (a fallback to the reference manager); "
                "its ratio measures nothing.",
                file=stream,
            )
        summary = summarize(result, done)
        summary.name = name
        print(format_scenario(summary), file=stream)
        print(f"   ({result.wall_s:.1f} s wall for both managers)\n", file=stream)
        stream.flush()
        out.append((result, summary))
    return out


def _write_outputs(
    args: argparse.Namespace,
    info: dict[str, Any],
    overhead: int,
    summaries: list[Any],
    runs: list[Any],
    modes_of_runs: list[str],
    fallbacks: list[str],
    stream: TextIO,
) -> bool:
    """``--json`` and ``--plot``; False when a file that was asked for could not be
    written (``--plot`` without matplotlib): the run then exits non-zero."""
    from hscache_tools.bench.report import to_json, write_json, write_plot

    if args.json:
        meta = {
            "reference": args.reference,
            "candidate": args.candidate,
            "seed": args.seed,
            "checked": not args.no_check,
            "hscache_version": info["version"],
            "build_profile": info["build_profile"],
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "timer_overhead_ns": overhead,
            "quick": bool(args.quick),
            "kv_events": _events(args) != "off",
            "events": _events(args),
            "paths": _modes(args),
            "repeat": args.repeat,
            "candidate_fallback_scenarios": fallbacks,
        }
        doc = to_json(summaries, runs, meta, paths=modes_of_runs)
        write_json(args.json, doc)
        print(f"results written to {args.json}", file=stream)
    if args.plot:
        if write_plot(args.plot, summaries, modes_of_runs):
            print(f"plot written to {args.plot}", file=stream)
        else:
            print(
                "--plot: matplotlib is not installed; no plot written "
                "(pip install -r requirements/bench-plot.txt, or run scripts/bench.sh once)",
                file=stream,
            )
            return False
    return True
