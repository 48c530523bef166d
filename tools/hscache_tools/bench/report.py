"""Reporting for ``python -m hscache bench``: statistics, text tables, JSON and the plot.

Owns the reduction of a :class:`~hscache_tools.bench.results.RunResult` to medians, p90s and ratios
(per-step KV bookkeeping time and per-operation cost per call, vLLM / hscache), their
plain-text rendering, the machine-readable JSON document and the optional bar chart (matplotlib
is imported only when a plot is asked for).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hscache_tools.bench.results import RunResult

__all__ = [
    "OpSummary",
    "ScenarioSummary",
    "format_events_table",
    "format_scenario",
    "format_summary",
    "percentile",
    "summarize",
    "to_json",
    "write_json",
    "write_plot",
]


def percentile(values: Sequence[int | float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return float(data[lo] + (data[hi] - data[lo]) * (pos - lo))


def _median(values: Sequence[int | float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or b <= 0:
        return math.nan
    return a / b


@dataclass
class OpSummary:
    """One operation's cost in one scenario (times in ns per call, over measured steps)."""

    name: str
    calls_per_step: float
    vllm_median_ns: float
    hscache_median_ns: float
    vllm_mean_ns: float
    hscache_mean_ns: float
    vllm_share: float
    """Fraction of vLLM's measured bookkeeping time spent in this operation."""
    hscache_share: float
    ratio: float
    """vLLM / hscache, medians per call."""


@dataclass
class ScenarioSummary:
    """One scenario's headline numbers (per-step times in µs)."""

    name: str
    description: str
    measured_steps: int
    vllm_class: str
    hscache_class: str
    vllm_median_us: float
    vllm_p90_us: float
    hscache_median_us: float
    hscache_p90_us: float
    ratio: float
    """vLLM / hscache, per-step medians."""
    ratio_total: float
    """vLLM / hscache, total measured time."""
    wall_s: float
    timer_overhead_ns: int
    workload: dict[str, float] = field(default_factory=dict)
    ops: list[OpSummary] = field(default_factory=list)
    repeat_ratios: list[float] = field(default_factory=list)
    """With --repeat: each repeat's own median ratio (the headline ratio pools all steps)."""
    base_name: str = ""
    """The scenario's own name (``name`` may carry an ``--events all`` pass label)."""
    events_mode: str = "vllm"
    """The candidate's KV events: ``vllm`` (vLLM's stream), ``compact`` or ``off``."""
    vllm_events_per_step: float = math.nan
    hscache_events_per_step: float = math.nan


def step_ratio(run: RunResult) -> float:
    """vLLM / hscache of one run's per-step medians."""
    return _ratio(_median(run.reference.step_ns), _median(run.candidate.step_ns))


def summarize(run: RunResult, repeats: Sequence[RunResult] = ()) -> ScenarioSummary:
    """Reduce one scenario run (``repeats`` pooled into it, if any) to medians, p90s, ratios
    and per-operation costs."""
    ref, cand = run.reference, run.candidate
    steps = len(ref.step_ns)
    ref_total = sum(ref.step_ns)
    cand_total = sum(cand.step_ns)
    names = list(ref.op_ns)
    names += [n for n in cand.op_ns if n not in ref.op_ns]
    ops: list[OpSummary] = []
    for name in names:
        r = ref.op_ns.get(name, [])
        c = cand.op_ns.get(name, [])
        r_med, c_med = _median(r), _median(c)
        ops.append(
            OpSummary(
                name=name,
                # The candidate's own operations (the batched path) count its calls.
                calls_per_step=len(r or c) / steps if steps else math.nan,
                vllm_median_ns=r_med,
                hscache_median_ns=c_med,
                vllm_mean_ns=sum(r) / len(r) if r else math.nan,
                hscache_mean_ns=sum(c) / len(c) if c else math.nan,
                vllm_share=sum(r) / ref_total if ref_total else math.nan,
                hscache_share=sum(c) / cand_total if cand_total else math.nan,
                ratio=_ratio(r_med, c_med),
            )
        )
    ops.sort(key=lambda o: -(o.vllm_share if not math.isnan(o.vllm_share) else 0.0))
    ref_med, cand_med = _median(ref.step_ns), _median(cand.step_ns)
    return ScenarioSummary(
        name=run.scenario.name,
        description=run.scenario.description,
        measured_steps=steps,
        vllm_class=ref.class_name,
        hscache_class=cand.class_name,
        vllm_median_us=ref_med / 1e3,
        vllm_p90_us=percentile(ref.step_ns, 90) / 1e3,
        hscache_median_us=cand_med / 1e3,
        hscache_p90_us=percentile(cand.step_ns, 90) / 1e3,
        ratio=_ratio(ref_med, cand_med),
        ratio_total=_ratio(ref_total, cand_total),
        wall_s=run.wall_s,
        timer_overhead_ns=run.timer_overhead_ns,
        workload=run.measured_counters.as_dict(),
        ops=ops,
        repeat_ratios=[step_ratio(r) for r in repeats] if len(repeats) > 1 else [],
        base_name=run.scenario.name,
        events_mode=run.scenario.candidate_events if run.scenario.kv_events else "off",
        vllm_events_per_step=_ratio(run.measured_counters.events, run.measured_counters.steps),
        hscache_events_per_step=_ratio(run.candidate_events, run.measured_counters.steps),
    )


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def _fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.2f}x"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def format_scenario(s: ScenarioSummary) -> str:
    """The per-scenario block: workload, per-step times, per-operation costs."""
    w = s.workload
    steps = max(1.0, w.get("steps", 1.0))
    lines = [
        f"== {s.name}: {s.description}",
        (
            f"   workload over {s.measured_steps} measured steps: "
            f"{_fmt(w.get('mean_running', math.nan))} running on average, "
            f"{_fmt(w.get('prefill_tokens', 0) / steps, 0)} prefill + "
            f"{_fmt(w.get('decode_tokens', 0) / steps, 0)} decode tokens/step, "
            f"{int(w.get('admissions', 0))} admissions "
            f"({int(w.get('resumed', 0))} resumed), "
            f"{int(w.get('admission_failures', 0))} failed admissions, "
            f"{int(w.get('preemptions', 0))} preemptions, {int(w.get('finishes', 0))} finishes, "
            f"prefix hit rate {_fmt(100 * w.get('hit_rate', 0.0))}%"
        ),
        (
            f"   KV events per step: vLLM {_fmt(s.vllm_events_per_step)}, "
            f"hscache {_fmt(s.hscache_events_per_step)} ({s.events_mode})"
        ),
        "",
        _table(
            ["per-step KV bookkeeping", "median us", "p90 us"],
            [
                [f"vLLM     ({s.vllm_class})", _fmt(s.vllm_median_us), _fmt(s.vllm_p90_us)],
                [
                    f"hscache  ({s.hscache_class})",
                    _fmt(s.hscache_median_us),
                    _fmt(s.hscache_p90_us),
                ],
                ["ratio vLLM/hscache", _fmt_ratio(s.ratio), ""],
            ],
        ),
        *(
            ["   per-repeat ratios: " + ", ".join(_fmt_ratio(r) for r in s.repeat_ratios)]
            if s.repeat_ratios
            else []
        ),
        "",
        _table(
            [
                "operation (ns per call)",
                "calls/step",
                "vLLM med",
                "hscache med",
                "ratio",
                "vLLM share",
                "hscache share",
            ],
            [
                [
                    o.name,
                    _fmt(o.calls_per_step, 2),
                    _fmt(o.vllm_median_ns, 0),
                    _fmt(o.hscache_median_ns, 0),
                    _fmt_ratio(o.ratio),
                    f"{_fmt(100 * o.vllm_share)}%",
                    f"{_fmt(100 * o.hscache_share)}%",
                ]
                for o in s.ops
            ],
        ),
    ]
    return "\n".join(lines)


def geometric_mean(values: Sequence[float]) -> float:
    good = [v for v in values if not math.isnan(v) and v > 0]
    if not good:
        return math.nan
    return math.exp(sum(math.log(v) for v in good) / len(good))


def format_summary(summaries: Sequence[ScenarioSummary], path: str | None = None) -> str:
    """The final table: one row per scenario plus the geometric mean of the ratios."""
    rows = [
        [
            s.name,
            str(s.measured_steps),
            _fmt(s.vllm_median_us),
            _fmt(s.vllm_p90_us),
            _fmt(s.hscache_median_us),
            _fmt(s.hscache_p90_us),
            _fmt_ratio(s.ratio),
            _fmt_ratio(s.ratio_total),
        ]
        for s in summaries
    ]
    repeated = any(s.repeat_ratios for s in summaries)
    if repeated:
        for row, s in zip(rows, summaries, strict=True):
            good = [r for r in s.repeat_ratios if not math.isnan(r)]
            row.append(f"{min(good):.2f}-{max(good):.2f}x ({len(good)})" if good else "-")
    if len(summaries) > 1:
        rows.append(
            [
                "geometric mean",
                "",
                "",
                "",
                "",
                "",
                _fmt_ratio(geometric_mean([s.ratio for s in summaries])),
                _fmt_ratio(geometric_mean([s.ratio_total for s in summaries])),
                *([""] if repeated else []),
            ]
        )
    header = [
        "scenario",
        "steps",
        "vLLM med us",
        "vLLM p90 us",
        "hscache med us",
        "hscache p90 us",
        "ratio (med)",
        "ratio (total)",
        *(["ratio range over repeats"] if repeated else []),
    ]
    which = f" ({path} path)" if path else ""
    return f"Summary{which}: KV bookkeeping time per scheduler step\n" + _table(header, rows)


def format_events_table(summaries: Sequence[ScenarioSummary], path: str | None = None) -> str:
    """``--events all``: per scenario, vLLM (events on) against hscache with events on, off
    and compact: per-step medians, each pass's ratio to its own vLLM run, events per step."""
    by_name: dict[str, dict[str, ScenarioSummary]] = {}
    for s in summaries:
        by_name.setdefault(s.base_name, {})[s.events_mode] = s
    modes = ("vllm", "off", "compact")
    nan = math.nan
    rows = []
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for name, passes in by_name.items():
        vllm_us = [p.vllm_median_us for p in passes.values()]
        row = [name, _fmt(_median(vllm_us)) if vllm_us else "-"]
        for m in modes:
            p = passes.get(m)
            row += [_fmt(p.hscache_median_us) if p else "-", _fmt_ratio(p.ratio if p else nan)]
            ratios[m].append(p.ratio if p else nan)
        on, compact = passes.get("vllm"), passes.get("compact")
        anyp = next(iter(passes.values()))
        row += [
            _fmt(anyp.vllm_events_per_step),
            _fmt(on.hscache_events_per_step if on else nan),
            _fmt(compact.hscache_events_per_step if compact else nan),
        ]
        rows.append(row)
    if len(rows) > 1:
        gm = ["geometric mean", ""]
        for m in modes:
            gm += ["", _fmt_ratio(geometric_mean(ratios[m]))]
        rows.append([*gm, "", "", ""])
    header = [
        "scenario",
        "vLLM us",
        "on us",
        "ratio",
        "off us",
        "ratio",
        "compact us",
        "ratio",
        "ev/step vLLM",
        "on",
        "compact",
    ]
    which = f" ({path} path)" if path else ""
    return (
        f"KV events{which}: per-step medians, vLLM with events on in every pass (its median "
        "over the passes); each ratio is vLLM / hscache within one pass\n" + _table(header, rows)
    )


def _clean(value: Any) -> Any:
    """JSON has no NaN: turn NaN floats into null, recursively."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def to_json(
    summaries: Sequence[ScenarioSummary],
    runs: Sequence[RunResult],
    meta: dict[str, Any],
    include_raw: bool = True,
    paths: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The machine-readable document written by ``--json``; ``paths[i]`` names the
    candidate path (``drop-in`` or ``batched``) of ``summaries[i]``."""
    paths = list(paths) if paths is not None else ["drop-in"] * len(summaries)
    scenarios = []
    for summary, run, path in zip(summaries, runs, paths, strict=True):
        entry = asdict(summary)
        entry["path"] = path
        entry["config"] = asdict(run.scenario)
        if include_raw:
            entry["raw_step_ns"] = {
                "vllm": run.reference.step_ns,
                "hscache": run.candidate.step_ns,
            }
        scenarios.append(entry)
    by_path = {
        p: geometric_mean([s.ratio for s, q in zip(summaries, paths, strict=True) if q == p])
        for p in dict.fromkeys(paths)
    }
    doc = {
        "meta": meta,
        "scenarios": scenarios,
        "geomean_ratio": by_path.get("drop-in", geometric_mean([s.ratio for s in summaries])),
        "geomean_ratio_by_path": by_path,
    }
    return dict(_clean(doc))


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


_PLOT_COLORS = {"vLLM": "#9a9a9a", "drop-in": "#2f6fce", "batched": "#1e9e6a"}


def write_plot(
    path: str | Path,
    summaries: Sequence[ScenarioSummary],
    paths: Sequence[str] | None = None,
) -> bool:
    """Grouped bars per scenario: vLLM's and each hscache path's median KV-bookkeeping time
    per step (µs, log scale), each hscache bar labelled with its ratio to vLLM; False (and
    nothing written) without matplotlib (``pip install -r requirements/bench-plot.txt``).

    A path's ratio is the report's: its hscache median against the vLLM run it ran beside.
    vLLM's bar is the median of those vLLM runs (one per path)."""
    # One piece: one matplotlib figure, built bar group by bar group; its parts only make sense
    # on the same axes.
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    paths = list(paths) if paths is not None else ["drop-in"] * len(summaries)
    scenarios = list(dict.fromkeys(s.name for s in summaries))
    path_names = list(dict.fromkeys(paths))
    by_key = {(s.name, p): s for s, p in zip(summaries, paths, strict=True)}
    series = ["vLLM", *path_names]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.8 * len(scenarios) + 2.0), 4.8))
    tops: list[float] = []
    for k, label in enumerate(series):
        xs: list[float] = []
        heights: list[float] = []
        ratios: list[float] = []
        for i, name in enumerate(scenarios):
            runs = [by_key[(name, p)] for p in path_names if (name, p) in by_key]
            if label == "vLLM":
                value = _median([r.vllm_median_us for r in runs])
                ratio = math.nan
            elif (name, label) in by_key:
                value = by_key[(name, label)].hscache_median_us
                ratio = by_key[(name, label)].ratio
            else:
                continue
            if math.isnan(value) or value <= 0:
                continue
            xs.append(i + (k - (len(series) - 1) / 2) * width)
            heights.append(value)
            ratios.append(ratio)
        shown = "hscache " + label if label != "vLLM" else "vLLM (Python)"
        bars = ax.bar(xs, heights, width * 0.92, label=shown, color=_PLOT_COLORS.get(label))
        tops.extend(heights)
        for bar, value, ratio in zip(bars, heights, ratios, strict=True):
            ax.annotate(
                f"{value:,.0f}" if value >= 10 else f"{value:.1f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, -3),
                textcoords="offset points",
                ha="center",
                va="top",
                fontsize=7,
                color="white",
            )
            if math.isnan(ratio):
                continue
            ax.annotate(
                f"{ratio:.1f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
                fontweight="bold",
            )
    ax.set_yscale("log")
    if tops:
        ax.set_ylim(min(tops) / 2.5, max(tops) * 2.5)
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios, fontsize=8)
    ax.set_ylabel("median µs per step (log scale)")
    means = [
        f"{p} {geometric_mean([by_key[(n, p)].ratio for n in scenarios if (n, p) in by_key]):.1f}x"
        for p in path_names
    ]
    ax.set_title(
        "KV-cache bookkeeping per scheduler step: vLLM's KVCacheManager vs hscache\n"
        "same trace, identical decisions; bold: vLLM / hscache median step time\n"
        f"geometric mean: {', '.join(means)}",
        fontsize=9,
    )
    ax.grid(axis="y", which="both", linewidth=0.4, alpha=0.5)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True
