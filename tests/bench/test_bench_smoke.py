"""Smoke tests of ``python -m hscache bench``: the step driver on a tiny scenario.

Owns the checks that the benchmark harness runs vLLM's manager against itself and against
hscache's with identical decisions at every step, that its decision check catches a manager
that decides differently, and that the command line writes its JSON. No timing assertions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache_tools.bench.driver import DivergenceError, run_scenario
from hscache_tools.bench.managers import REFERENCE_SPEC, load_class
from hscache_tools.bench.results import RunResult
from hscache_tools.bench.scenarios import TINY_SCENARIO, make_trace

pytestmark = pytest.mark.vllm


def _reference() -> type:
    return load_class(REFERENCE_SPEC)


def _check_result(result: RunResult) -> None:
    c = result.counters
    assert c.steps == TINY_SCENARIO.total_steps
    assert c.admissions > 0 and c.finishes > 0
    assert c.hit_tokens > 0, "the tiny trace must produce prefix hits"
    assert c.preemptions > 0, "the tiny pool must force preemptions"
    assert c.resumed > 0
    assert len(result.reference.step_ns) == TINY_SCENARIO.steps
    assert len(result.candidate.step_ns) == TINY_SCENARIO.steps
    assert "allocate_slots(running)" in result.reference.op_ns
    assert set(result.reference.op_ns) == set(result.candidate.op_ns)


def test_trace_is_deterministic() -> None:
    a = make_trace(TINY_SCENARIO, seed=7, num_requests=20)
    b = make_trace(TINY_SCENARIO, seed=7, num_requests=20)
    c = make_trace(TINY_SCENARIO, seed=8, num_requests=20)
    assert a == b
    assert a != c


def test_harness_vllm_against_itself() -> None:
    ref = _reference()
    result = run_scenario(TINY_SCENARIO, ref, ref, seed=0, check=True)
    _check_result(result)


def test_vllm_against_hscache() -> None:
    candidate = load_class("hscache.vllm:KVCacheManager")
    for seed in (0, 1):
        result = run_scenario(TINY_SCENARIO, _reference(), candidate, seed=seed, check=True)
        _check_result(result)
        # hscache's own manager ran (no constructor fall-back to vLLM's).
        assert result.candidate.class_name == "hscache.vllm.kv_cache_manager.KVCacheManager"


def test_divergence_is_caught() -> None:
    ref = _reference()

    class NoPrefixHits(ref):  # type: ignore[valid-type, misc]
        """A manager that never reports a prefix hit: a wrong decision the check must catch."""

        def get_computed_blocks(self, request: Any, max_cache_hit_length: Any = None) -> Any:
            return self.empty_kv_cache_blocks, 0, 0

    with pytest.raises(DivergenceError, match="divergence at step"):
        run_scenario(TINY_SCENARIO, ref, NoPrefixHits, seed=0, check=True)


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hscache.__main__ import main

    out = tmp_path / "bench.json"
    status = main(
        [
            "bench",
            "--scenario",
            "tiny",
            "--steps",
            "10",
            "--warmup",
            "3",
            "--candidate",
            REFERENCE_SPEC,
            "--repeat",
            "2",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    text = capsys.readouterr().out
    assert "Summary" in text and "tiny" in text
    doc = json.loads(out.read_text())
    (entry,) = doc["scenarios"]
    assert entry["name"] == "tiny"
    assert entry["measured_steps"] == 20  # two repeats of 10 measured steps, pooled
    assert len(entry["raw_step_ns"]["vllm"]) == 20
    assert len(entry["repeat_ratios"]) == 2
    assert entry["ratio"] is None or entry["ratio"] > 0


def test_cli_plot_is_a_png_of_every_scenario_and_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--plot`` with both paths writes a real PNG. matplotlib is required here:
    scripts/env.sh installs requirements/bench-plot.txt into the test venv (as
    scripts/bench.sh does for a user), so its absence fails, never skips."""
    import matplotlib  # a hard requirement: a venv without it fails here
    from hscache.__main__ import main

    assert matplotlib.__version__ == _pinned("matplotlib")
    png = tmp_path / "bench.png"
    args = ["bench", "--scenario", "tiny", "--steps", "5", "--warmup", "2", "--no-progress"]
    assert main([*args, "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert f"plot written to {png}" in text
    width, height = png_size(png.read_bytes())
    assert 300 <= width <= 10_000 and 200 <= height <= 10_000, (width, height)
    assert png.stat().st_size > 5_000, "a PNG of a few bytes draws nothing"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG from its signature and IHDR chunk (raises if not one)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR", "a PNG starts with its IHDR chunk"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _pinned(name: str) -> str:
    """The version requirements/bench-plot.txt pins for ``name``."""
    reqs = Path(__file__).resolve().parents[2] / "requirements" / "bench-plot.txt"
    for line in reqs.read_text().splitlines():
        pkg, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep and pkg.strip().lower() == name:
            return version.strip()
    raise AssertionError(f"{reqs} pins no {name}")


def test_cli_plot_without_matplotlib_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for a plot it cannot draw, the bench says why and exits non-zero (a run that
    was told to write a file and wrote none is not a success)."""
    import builtins

    from hscache.__main__ import main

    real_import = builtins.__import__

    def no_matplotlib(name: str, *a: Any, **k: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError("no matplotlib (test)")
        return real_import(name, *a, **k)

    for mod in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    png = tmp_path / "bench.png"
    args = ["bench", "--scenario", "tiny", "--steps", "3", "--warmup", "1", "--no-progress"]
    assert main([*args, "--mode", "drop-in", "--plot", str(png)]) != 0
    assert "requirements/bench-plot.txt" in capsys.readouterr().out
    assert not png.exists()


@pytest.mark.parametrize("layout", ["full+swa", "full+mamba", "full+chunked"])
def test_hybrid_scenarios_run_on_the_real_scheduler(layout: str) -> None:
    """A hybrid scenario runs both managers under vLLM's own Scheduler, decisions compared
    at every step, with preemptions and prefix hits on the tiny pool."""
    from dataclasses import replace

    scenario = replace(TINY_SCENARIO, name=f"tiny-{layout}", layout=layout, num_blocks=160)
    candidate = load_class("hscache.vllm:KVCacheManager")
    result = run_scenario(scenario, _reference(), candidate, seed=0, check=True)
    c = result.counters
    assert c.steps == scenario.total_steps and c.admissions > 0 and c.finishes > 0
    assert c.hit_tokens > 0
    assert len(result.candidate.step_ns) == scenario.steps
    assert result.candidate.class_name == "hscache.vllm.kv_cache_manager.KVCacheManager"
    assert "allocate_slots(running)" in result.candidate.op_ns
    with pytest.raises(Exception, match="batched API"):
        run_scenario(scenario, _reference(), candidate, seed=0, check=True, batched=True)


# The batched API serves one full-attention group: no batched pass of the hybrid.
@pytest.mark.parametrize(
    ("layout", "batched"), [("full", False), ("full", True), ("full+swa", False)]
)
def test_candidate_event_modes(layout: str, batched: bool) -> None:
    """``--events`` passes: vLLM keeps its events; hscache publishes the same stream
    (decisions and events compared), a compact one (compared with vLLM's coalesced by the
    same rule, fewer events under eviction) or none."""
    from dataclasses import replace

    candidate = load_class("hscache.vllm:KVCacheManager")
    counts = {}
    for mode in ("vllm", "compact", "off"):
        scenario = replace(TINY_SCENARIO, layout=layout, num_blocks=160 if layout != "full" else 96)
        scenario = replace(scenario, candidate_events=mode)
        result = run_scenario(scenario, _reference(), candidate, check=True, batched=batched)
        assert result.measured_counters.events > 0, "vLLM's events are counted"
        counts[mode] = (result.measured_counters.events, result.candidate_events)
    ref = counts["vllm"][0]
    assert {c[0] for c in counts.values()} == {ref}, "the same trace in every pass"
    assert counts["vllm"][1] == ref
    assert counts["off"][1] == 0
    assert 0 < counts["compact"][1] < ref


def test_cli_events_all_prints_the_events_table(capsys: pytest.CaptureFixture[str]) -> None:
    from hscache.__main__ import main

    args = ["bench", "--scenario", "tiny", "--steps", "8", "--warmup", "2", "--no-progress"]
    assert main([*args, "--events", "all", "--mode", "drop-in"]) == 0
    text = capsys.readouterr().out
    for label in ("tiny [events on]", "tiny [events off]", "tiny [compact events]"):
        assert label in text
    assert "KV events (drop-in path)" in text
    assert main([*args, "--events", "compact", "--mode", "drop-in"]) == 0
    assert "(compact)" in capsys.readouterr().out


def test_hot_decode_splits_the_calls_and_hscache_takes_the_steady_step() -> None:
    """``bench --hot-decode``: every layout runs on both managers, the calls split into
    steady / new block / caching, and hscache's core decides the steady ones itself."""
    from hscache_tools.bench.hot_decode import run_hot_decode
    from hscache_tools.bench.layouts import LAYOUTS

    results = run_hot_decode(list(LAYOUTS), running=4, steps=40, repeat=1)
    assert {(r.layout, r.manager) for r in results} == {
        (layout, m) for layout in LAYOUTS for m in ("vllm", "hscache")
    }
    for r in results:
        assert set(r.median_ns) == {"steady", "new block", "caching", "all"}
        if r.manager == "vllm":
            assert r.steady_steps is None
        else:
            # 160 calls: a block opened or filled in 2 of every 16 (block 16), and Mamba
            # align retires its previous state block once per 64 tokens.
            assert r.steady_steps is not None and r.steady_steps >= 160 * 3 // 4


def test_cli_hot_decode_prints_the_ratio_table(capsys: pytest.CaptureFixture[str]) -> None:
    from hscache.__main__ import main

    args = ["bench", "--hot-decode", "--layout", "full+swa", "--running", "2"]
    assert main([*args, "--steps", "20", "--repeat", "1", "--no-events"]) == 0
    text = capsys.readouterr().out
    assert "KV events off" in text
    assert "full+swa       ratio" in text
