"""Checks of hscache's vllm-omni end-to-end run (``scripts/omni_e2e.sh``), read from its JSONs.

Each arm of ``run_pipeline.py`` served the same two rounds of prompts through a real
thinker -> talker pipeline (vllm-omni 0.30 on vLLM 0.30, CPU). Here: the talker's tokens of
every request, fed the thinker's hidden states, equal the cold run's (thinker prefix caching
off) with vllm-omni's cache and with hscache's; the thinker's cached tokens are the same
under vLLM's and hscache's KV-cache managers, and round 2 really hit; and in the hscache arm
hscache served both parts (its KV-cache manager in the thinker's scheduler, its
hidden-state cache in the thinker's runner, nonzero counters, rows served from the cache),
``HSCACHE_STRICT=1`` ruling out a fallback. ``HSCACHE_OMNI_E2E_RESULTS`` names the folder
of ``<arm>.json`` files (``cold``, ``omni``, ``hscache``, optionally with a ``-sync``
suffix for ``async_scheduling: false``); without it the module is skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

RESULTS = os.environ.get("HSCACHE_OMNI_E2E_RESULTS")
pytestmark = pytest.mark.skipif(
    not RESULTS, reason="HSCACHE_OMNI_E2E_RESULTS not set (scripts/omni_e2e.sh sets it)"
)
HSCACHE_MANAGER = "hscache.vllm.kv_cache_manager.KVCacheManager"
HSCACHE_CACHE = "hscache.omni.prefix_cache.OmniHiddenStateCache"
OMNI_CACHE = "vllm_omni.core.prefix_cache.manager.OmniPrefixCacheManager"


def _load(name: str) -> dict[str, Any]:
    assert RESULTS is not None
    path = Path(RESULTS) / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} was not run")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _requests(arm: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {
        (i, name): rec
        for i, rnd in enumerate(arm["rounds"])
        for name, rec in rnd["requests"].items()
    }


def _suffixes() -> list[str]:
    assert RESULTS is not None
    found = {p.stem.removeprefix("cold") for p in Path(RESULTS).glob("cold*.json")}
    return sorted(found) or [""]


@pytest.fixture(params=_suffixes() if RESULTS else [""])
def suffix(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _thinker(probes: list[dict[str, Any]]) -> dict[str, Any]:
    found = [s for p in probes for s in p["schedulers"] if s["stage"] == "thinker"]
    assert len(found) == 1, f"one thinker scheduler expected, probes: {probes}"
    return found[0]


def _caches(probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for p in probes for c in p["prefix_caches"]]


@pytest.mark.parametrize("arm", ["omni", "hscache"])
def test_talker_tokens_equal_the_cold_run(arm: str, suffix: str) -> None:
    cold, warm = _requests(_load("cold" + suffix)), _requests(_load(arm + suffix))
    assert warm.keys() == cold.keys()
    for key, rec in cold.items():
        assert rec["talker_token_ids"], f"{key}: the talker produced no tokens"
        assert warm[key]["thinker_token_ids"] == rec["thinker_token_ids"], key
        assert warm[key]["talker_token_ids"] == rec["talker_token_ids"], key


def test_thinker_cached_tokens_equal_between_vllm_and_hscache(suffix: str) -> None:
    """Hits that do not depend on timing are equal; the others are whole blocks.

    Requests reach the thinker one by one while it steps, so whether a round-1 request
    finds its twin's blocks already computed depends on timing; round 2 (``deterministic``)
    only repeats and continues prefixes that round 1 left cached."""
    arms = {name: _load(name + suffix) for name in ("cold", "omni", "hscache")}
    block = arms["hscache"]["block_size"]
    for name, arm in arms.items():
        for rnd in arm["rounds"]:
            for req, rec in rnd["requests"].items():
                cached = rec["thinker_num_cached_tokens"]
                assert cached % block == 0 and cached < rec["prompt_len"], (name, req, cached)
                assert name != "cold" or cached == 0, (req, cached)
    for i, rnd in enumerate(arms["omni"]["rounds"]):
        if not rnd["deterministic"]:
            continue
        ours = arms["hscache"]["rounds"][i]["requests"]
        for req, rec in rnd["requests"].items():
            assert rec["thinker_num_cached_tokens"] >= 4 * block, (req, rec)
            assert ours[req]["thinker_num_cached_tokens"] == rec["thinker_num_cached_tokens"], req


def test_hscache_served_both_parts(suffix: str) -> None:
    arm = _load("hscache" + suffix)
    thinker = _thinker(arm["probes"])
    assert thinker["kv_cache_manager"] == HSCACHE_MANAGER
    assert thinker["enable_caching"]
    caches = _caches(arm["probes"])
    assert [c["class"] for c in caches] == [HSCACHE_CACHE], caches
    stats = caches[0]["stats"]
    assert stats["reads_served"] > 0 and stats["cached_rows_served"] > 0, stats
    assert stats["read_misses"] == stats["stale_reads"] == stats["partial_reads"] == 0, stats
    calls = {
        op: vals.get("calls", 0)
        for p in arm["probes"]
        for op, vals in p.get("hscache_stats", {}).items()
    }
    assert sum(calls.values()) > 0, arm["probes"]


def test_the_omni_arm_ran_vllm_omnis_cache(suffix: str) -> None:
    arm = _load("omni" + suffix)
    thinker = _thinker(arm["probes"])
    assert not thinker["kv_cache_manager"].startswith("hscache.")
    assert [c["class"] for c in _caches(arm["probes"])] == [OMNI_CACHE]
