"""``python -m hscache bench-omni-e2e --quick``: vllm-omni's real thinker -> talker pipeline
(a tiny random Qwen2.5-Omni on CPU) ran in every arm, each arm's thinker ran the caches it
names, the caching arms hit on shared prefixes, and every request's thinker and talker
tokens equal the caching-off arm's. No timing is asserted. Needs vllm-omni 0.30 on vLLM 0.30
(``scripts/vllm030_env.sh``) and this checkout's ``tests/omni_e2e`` scaffolding (found on
the path; nothing is installed). Starts one pair of stage engines per arm: minutes (1-2
each on a quiet 2-core host, 5-10 on a loaded one), so it lives here, skipped in the main
venv, rather than in ``tests/omni`` (which the vllm-omni step of ``scripts/test.sh`` runs
whole, no skip allowed): run it with
``$HSCACHE_PY030 -m pytest tests/bench/test_bench_omni_e2e.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm_omni.core.prefix_cache",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

from hscache.bench.omni_e2e import ARMS, QUICK, TRAFFIC, check_served, main


def test_quick_run_agrees_across_arms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["--quick", "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    report = capsys.readouterr().out
    assert "| traffic | arm | requests | thinker TTFT p50" in report
    data = json.loads(out.read_text())
    results = data["results"]
    assert sorted(r["arm"] for r in results) == sorted(ARMS)
    assert check_served(results) == []
    table = data["summary"]["table"]
    for arm in ARMS:
        for traffic in TRAFFIC:
            row = table[f"{arm}|{traffic}"]
            # Every request of the round came back through both stages, timed in both.
            assert row["requests"] == row["timed"] == QUICK.concurrency * QUICK.repeats
            assert all(math.isfinite(row[k]) for k in ("thinker_p50", "talker_p99", "rps"))
            # The same thinker and talker tokens as with caching off, request by request.
            assert row["same_as_off"] == f"{row['requests']}/{row['requests']}", (arm, traffic)
            cached = row["cached_tokens"]
            if arm == "off" or traffic == "unique":
                assert cached == 0, (arm, traffic)
            elif traffic == "shared-warm":
                # Every warm request hit at least its system prompt's whole blocks.
                per = QUICK.system_len // 32 * 32
                assert cached >= per * QUICK.concurrency, (arm, cached)
    for res in results:
        for rnd in res["rounds"]:
            for rec in rnd["requests"].values():
                assert rec["thinker_token_ids"] and rec["talker_token_ids"]
                assert 0 < rec["thinker_ttft_s"] <= rec["talker_ttft_s"]
    # hscache's and vLLM's managers cached the same tokens on the shared rounds.
    for traffic in ("shared-warm",):
        cached = {a: table[f"{a}|{traffic}"]["cached_tokens"] for a in ARMS if a != "off"}
        assert len(set(cached.values())) == 1, cached
