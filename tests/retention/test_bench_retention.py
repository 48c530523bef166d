"""Smoke test of ``python -m hscache bench --retention`` (``hscache_tools.bench.retention``):
a tiny multi-tenant trace runs under every policy, the table names each, a policy
that protects shared prompts beats LRU's hit rate, and the pinned tenant's prompt
hits more under ``pin`` than under ``lru``."""

from __future__ import annotations

import pytest
from hscache.__main__ import main
from hscache_tools.bench.retention import POLICIES, TraceConfig, compare, make_trace


def test_trace_is_deterministic() -> None:
    cfg = TraceConfig(steps=200)
    a, b = make_trace(cfg), make_trace(cfg)
    assert [(x.step, x.prompt, x.hints) for x in a] == [(x.step, x.prompt, x.hints) for x in b]
    assert any("hscache_pin" in x.hints for x in a)


def test_policies_side_by_side() -> None:
    results = {r.policy: r for r in compare(TraceConfig(steps=120), POLICIES, repeat=1)}
    assert set(results) == set(POLICIES)
    lru = results["lru"]
    assert max(r.hit_rate for r in results.values()) > lru.hit_rate
    assert results["pin"].pinned_hit_rate > lru.pinned_hit_rate
    assert all(r.step_us for r in results.values())


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--retention", "--steps", "40", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for policy in POLICIES:
        assert f"\n{policy} " in out
