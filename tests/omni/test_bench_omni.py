"""``python -m hscache bench-omni`` runs and prints its table (a tiny run: no timing is
asserted). Needs vllm-omni 0.30 on vLLM 0.30 (``scripts/vllm030_env.sh``)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm_omni.core.prefix_cache",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

from hscache.__main__ import main


def test_bench_omni_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench-omni", "--concurrency", "3", "--steps", "6", "--warmup", "2"]
    argv += ["--hidden", "32", "--prefix-len", "32", "--tail-len", "8", "--decode", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| concurrent | arm | step median | step mean | scheduler median" in out
    for c in (3,):
        for arm in ("none", "none+hs-kv", "vllm-omni", "hscache", "hscache-w1"):
            assert sum(line.startswith(f"| {c} | {arm} |") for line in out.splitlines()) == 1
        ratios = [line for line in out.splitlines() if line.startswith(f"| {c} | 6 |")]
        assert len(ratios) == 1 and ratios[0].count("x") >= 5
        assert "| concurrent | hscache cache | bookkeeping | row copies |" in out
        split = [line for line in out.splitlines() if line.startswith(f"| {c} | ")]
        assert len(split) == 5 + 1 + 1 and split[-1].count("x") == 3
