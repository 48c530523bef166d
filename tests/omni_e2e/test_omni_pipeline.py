"""Checks of hscache's vllm-omni end-to-end run (``scripts/omni_e2e.sh``), read from its JSONs.

Each arm of ``run_pipeline.py`` served the same rounds of prompts through a real
thinker -> talker pipeline (vllm-omni 0.30 on vLLM 0.30, CPU). Here: the talker's tokens of
every request, fed the thinker's hidden states, equal the cold run's (thinker prefix caching
off) with vllm-omni's cache and with hscache's, preemption included; the hard cases
really happened in every arm (identical prompts scheduled in one step and hitting each
other's blocks, a preemption, an abort of a request holding blocks, then freed); the
thinker's cached tokens are the same under vLLM's and hscache's KV-cache managers, and the
repeat rounds really hit; and in the hscache arm hscache served both parts (its
KV-cache manager in the thinker's scheduler, its hidden-state cache in the thinker's
runner, nonzero counters, rows served from the cache), ``HSCACHE_STRICT=1`` ruling out a
fallback, and both stages ran hscache's omni scheduler with the fast path serving
``schedule()`` steps (``fast_path_counts``; updates where a step leaves it any). The
``hybrid`` arm (a thinker with a full-attention and a sliding-window layer, which
vllm-omni's own cache refuses): its talker tokens equal its in-engine cold reference's,
its hits are vLLM's under the window, the thinker really had the two KV-cache groups
(vllm-omni's check refused them), hscache served both parts.
``HSCACHE_OMNI_E2E_RESULTS`` names the folder of ``<arm>.json`` files (``cold``, ``omni``,
``hscache``, optionally with a ``-sync`` suffix for ``async_scheduling: false``;
``hybrid``; ``cold_spec`` / ``hscache_spec``, the thinker drafting with ngram, and their
``.rows.pt`` files); without it the module is skipped. The drafting arms (``--spec``): the
rows the talker received and its tokens equal the cold drafting run's, rejected drafts'
rows included, drafts were proposed, accepted and rejected, and prefix-cache hits were
served with drafting on, by hscache's cache on a synchronous thinker.
Preemption and resumption (rounds ``preempt``, ``solo_q1``, ``solo_q2``): with hscache's
cache each preempted and resumed request hands the talker exactly the rows a never-preempted
run of it hands on (its prompt and decode rows once, in order); with vllm-omni's cache and
with caching off, a preempted request's recomputed rows follow the ones it had handed on
(vllm-omni 0.30's own accumulator: asserted to happen, as ``docs/omni.md`` records).
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


def _requests(arm: dict[str, Any]) -> dict[tuple[int, str], Any]:
    """Every generated request by (round, name) (the aborted request has no output)."""
    return {
        (i, name): rec
        for i, rnd in enumerate(arm["rounds"])
        if rnd.get("kind") != "abort"
        for name, rec in rnd["requests"].items()
    }


def _round(arm: dict[str, Any], kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The round of that kind, and the thinker's probe record of the round before it."""
    kinds = [rnd.get("kind") for rnd in arm["rounds"]]
    assert kind in kinds, kinds
    i = kinds.index(kind)
    return arm["rounds"][i], (arm["rounds"][i - 1]["thinker"] if i else {})


def _suffixes() -> list[str]:
    assert RESULTS is not None
    found = {p.stem.removeprefix("cold") for p in Path(RESULTS).glob("cold*.json")}
    return sorted(found - {"_spec"}) or [""]  # the drafting arms have tests of their own


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


@pytest.mark.parametrize("name", ["cold", "omni", "hscache"])
def test_the_hard_cases_happened(name: str, suffix: str) -> None:
    """The thinker's probe records, round by round, prove each hard case happened."""
    arm = _load(name + suffix)
    warm = name != "cold"
    rnd, before = _round(arm, "same_step")
    after = rnd["thinker"]
    # The three identical prompts were scheduled for the first time in one step, and (with
    # prefix caching) two of them hit the first one's block computed in that step. Cold,
    # the 64-token budget admits two of them (40 tokens, then a 24-token chunk).
    assert after["same_step_max"] >= (3 if warm else 2), after
    hits = after.get("same_step_hits", 0) - before.get("same_step_hits", 0)
    assert hits == (2 if warm else 0), (before, after)
    cached = [r["thinker_num_cached_tokens"] for r in rnd["requests"].values()]
    assert sorted(cached) == ([0, arm["block_size"], arm["block_size"]] if warm else [0] * 3)
    rnd, before = _round(arm, "preempt")
    assert rnd["thinker"]["preemptions"] > before.get("preemptions", 0), (before, rnd)
    rnd, before = _round(arm, "abort")
    (rec,) = rnd["requests"].values()
    after = rnd["thinker"]
    assert rec["aborted_at_computed_tokens"] > rec["prompt_len"], rec  # it was decoding
    assert after["aborted"] == before.get("aborted", 0) + 1, (before, after)
    held = after["aborted_blocks"] - before.get("aborted_blocks", 0)
    assert held * arm["block_size"] >= rec["prompt_len"], (before, after)
    assert after["unfinished"] == 0 and after["kv_usage"] == 0, after  # all freed


def test_thinker_cached_tokens_equal_between_vllm_and_hscache(suffix: str) -> None:
    """Hits that do not depend on timing are equal; the others are whole blocks.

    Requests reach the thinker one by one while it steps, so whether a round-1 request
    finds its twin's blocks already computed depends on timing; the ``deterministic``
    rounds only repeat and continue prefixes left cached (round 2; after the abort, the
    aborted request's), or are gated by the probe (same step, preemption)."""
    min_hits = {"repeat": 4, "after_abort": 3}
    arms = {name: _load(name + suffix) for name in ("cold", "omni", "hscache")}
    block = arms["hscache"]["block_size"]
    for name, arm in arms.items():
        for rnd in arm["rounds"]:
            if rnd.get("kind") == "abort":
                continue
            for req, rec in rnd["requests"].items():
                cached = rec["thinker_num_cached_tokens"]
                assert cached % block == 0 and cached < rec["prompt_len"], (name, req, cached)
                assert name != "cold" or cached == 0, (req, cached)
    for i, rnd in enumerate(arms["omni"]["rounds"]):
        if not rnd["deterministic"] or rnd.get("kind") == "abort":
            continue
        ours = arms["hscache"]["rounds"][i]["requests"]
        for req, rec in rnd["requests"].items():
            hit = min_hits.get(rnd.get("kind", "repeat"), 0) * block
            assert rec["thinker_num_cached_tokens"] >= hit, (req, rec)
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


def test_hscache_arm_served_steps_on_the_fast_path(suffix: str) -> None:
    """Both stages of the hscache arm ran hscache's omni scheduler (the arm's
    ``scheduler_cls``, matching its scheduling mode) with the fast path on, and the fast
    path served ``schedule()`` steps in each. Updates: a step whose runner output carries
    multimodal or inter-stage outputs (a stage handing hidden states on, as both stages
    of qwen2_5_omni do on every step that samples) or whose stage has KV-transfer
    criteria is vllm-omni's loop's whole (``hscache.omni.fast``); where a stage had any
    other sampling step, the fast path must have served updates there. A silent decline
    fails here (the probe's class-level wrappers once turned the path off unseen)."""
    arm = _load("hscache" + suffix)
    expected = "OmniARAsyncScheduler" if arm["async_scheduling"] else "OmniARScheduler"
    assert arm["scheduler_cls"] == f"hscache.omni.{expected}", arm["scheduler_cls"]
    stages = {s["stage"]: s for p in arm["probes"] for s in p["schedulers"]}
    assert sorted(stages) == ["talker", "thinker"], list(stages)
    for stage, sched in stages.items():
        assert sched["scheduler"] == f"hscache.omni.scheduler.{expected}", (stage, sched)
        assert sched["kv_cache_manager"] == HSCACHE_MANAGER, (stage, sched)
        assert sched["fast_step"] is True, (stage, sched)
        counts = sched["fast_path_counts"]
        assert counts["schedule_steps"] > 0 and counts["update_requests"] > 0, (stage, counts)
        assert counts["schedule_served"] > 0, (stage, counts)
        steps = sched.get("update_steps", 0)
        assert steps > 0, (stage, sched)
        servable = steps - sched.get("update_steps_stage_outputs", 0)
        if servable > 0 and not sched["kv_transfer_criteria"]:
            assert counts["update_served"] > 0, (stage, counts, sched)
        print(
            f"hscache{suffix} {stage}: {counts}; sampling update steps {steps}, "
            f"with stage outputs {sched.get('update_steps_stage_outputs', 0)}, declined "
            f"(vLLM's step rules) {sched.get('update_steps_declined_vllm', 0)}, "
            f"(vllm-omni's) {sched.get('update_steps_declined_omni', 0)}"
        )


def test_the_omni_arm_ran_vllm_omnis_cache(suffix: str) -> None:
    arm = _load("omni" + suffix)
    thinker = _thinker(arm["probes"])
    assert not thinker["kv_cache_manager"].startswith("hscache.")
    assert [c["class"] for c in _caches(arm["probes"])] == [OMNI_CACHE]


# The hybrid arm's thinker hits (run_pipeline.hybrid_workload, round "hits"), vLLM 0.30's
# rule: with its default prefix_cache_retention_interval (0) the sliding-window group keeps
# a finished request's window blocks only at its replay boundary (its prompt's last block)
# and shared-prefix junctions, so `h3` (the first 3 of the 6 shared blocks and a new tail)
# hits nothing where full attention alone would hit 96 tokens; vLLM's own manager decides
# the same offline on this workload.
HYBRID_HITS = {"h1_again": 192, "h2": 192, "h3": 0, "g1_again": 160}


def _hybrid() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The hybrid arm, its warm requests by name and its cold references by name."""
    arm = _load("hybrid")
    rounds = {rnd["kind"]: rnd for rnd in arm["rounds"]}
    assert list(rounds) == ["seed", "hits", "reference"], list(rounds)
    warm = {
        f"{kind}/{name}": rec
        for kind in ("seed", "hits")
        for name, rec in rounds[kind]["requests"].items()
    }
    return arm, warm, rounds["reference"]["requests"]


def test_hybrid_talker_tokens_equal_the_cold_reference() -> None:
    """Every request of the hybrid thinker, hits included, hands the talker the rows that
    give the tokens of its cold recomputation (a ``cache_salt`` of its own: no hit)."""
    _, warm, reference = _hybrid()
    assert warm.keys() == reference.keys()
    for key, ref in reference.items():
        assert ref["thinker_num_cached_tokens"] == 0, (key, ref)
        assert ref["talker_token_ids"], f"{key}: the talker produced no tokens"
        assert warm[key]["thinker_token_ids"] == ref["thinker_token_ids"], key
        assert warm[key]["talker_token_ids"] == ref["talker_token_ids"], key
    hits = {key.split("/", 1)[1]: rec["thinker_num_cached_tokens"] for key, rec in warm.items()}
    assert {k: hits[k] for k in HYBRID_HITS} == HYBRID_HITS, hits
    assert hits["h1"] == hits["g1"] == 0, hits


def test_hybrid_thinker_had_two_groups_that_vllm_omni_refuses() -> None:
    """The thinker's KV-cache config (read by the probe in its scheduler) had a
    full-attention and a sliding-window group, of the model's window; vllm-omni's own
    check refuses it (its message), the talker's one group it accepts."""
    arm, _, _ = _hybrid()
    text = arm["thinker_text_config"]
    assert text["layer_types"] == ["full_attention", "sliding_attention"], text
    thinker = _thinker(arm["probes"])
    groups = thinker["kv_cache_groups"]
    assert [(g["spec"], g["sliding_window"]) for g in groups] == [
        ("FullAttentionSpec", None),
        ("SlidingWindowSpec", text["sliding_window"]),
    ], groups
    assert thinker["omni_prefix_cache_check"] == (
        "OmniPrefixCacheUnmatchError: omni prefix caching requires a single full-attention "
        "kv-cache group; found 2. disable enable_prefix_caching for this model"
    ), thinker
    (talker,) = [s for p in arm["probes"] for s in p["schedulers"] if s["stage"] == "talker"]
    assert talker["omni_prefix_cache_check"] == "accepted", talker


def test_hybrid_hscache_served_both_parts() -> None:
    """hscache's KV-cache manager held the two groups; its hidden-state cache followed the
    full-attention group and served the hits' rows: no miss, stale or partial read."""
    arm, _, _ = _hybrid()
    thinker = _thinker(arm["probes"])
    assert thinker["kv_cache_manager"] == HSCACHE_MANAGER and thinker["enable_caching"]
    caches = _caches(arm["probes"])
    assert [c["class"] for c in caches] == [HSCACHE_CACHE], caches
    full = [g["spec"] for g in thinker["kv_cache_groups"]].index("FullAttentionSpec")
    assert caches[0]["kv_cache_group"] == full, caches
    stats = caches[0]["stats"]
    served = sum(v for k, v in HYBRID_HITS.items())
    assert stats["reads_served"] == 3 and stats["cached_rows_served"] == served, stats
    assert stats["read_misses"] == stats["stale_reads"] == stats["partial_reads"] == 0, stats


# The drafting arms (``scripts/omni_e2e.sh --spec``, run_pipeline.spec_workload): the round
# "spec_hits" only repeats and continues round 1's prompts, whose first 2 blocks are hit.
SPEC_HITS = {"r1_again": 64, "r1_branch": 64, "r3_again": 64}
#: float32 rounding: the warm and cold runs batch the same rows differently.
ROW_RTOL = 1e-5


def _spec() -> tuple[dict[str, Any], dict[str, Any]]:
    return _load("cold_spec"), _load("hscache_spec")


def _rows(name: str) -> dict[str, Any]:
    import torch

    assert RESULTS is not None
    path = Path(RESULTS) / f"{name}.rows.pt"
    assert path.exists(), f"{path}: the probe kept no rows"
    rows: dict[str, Any] = torch.load(path)
    return rows


def test_spec_talker_rows_and_tokens_equal_the_cold_drafting_run() -> None:
    """Every request of the drafting thinker hands the talker the rows the cold drafting run
    hands it (prompt rows, accepted and rejected drafts' rows, vllm-omni's payload), within
    float32 rounding, none zero; the talker's tokens and the thinker's are equal."""
    import torch

    cold, warm = _spec()
    cold_req, warm_req = _requests(cold), _requests(warm)
    assert warm_req.keys() == cold_req.keys() and cold_req
    for key, rec in cold_req.items():
        assert rec["talker_token_ids"], f"{key}: the talker produced no tokens"
        assert warm_req[key]["thinker_token_ids"] == rec["thinker_token_ids"], key
        assert warm_req[key]["talker_token_ids"] == rec["talker_token_ids"], key
    cold_rows, warm_rows = _rows("cold_spec"), _rows("hscache_spec")
    names = {f"{cold['rounds'][i]['kind']}/{name}" for i, name in cold_req}
    assert cold_rows.keys() == warm_rows.keys() == names, (cold_rows.keys(), names)
    worst = 0.0
    for key, ref in cold_rows.items():
        got = warm_rows[key]
        assert got.shape == ref.shape and ref.shape[0] >= 1, (key, got.shape, ref.shape)
        assert bool((got.abs().amax(dim=-1) > 0).all()), f"{key}: a zero row"
        scale = ref.abs().amax().clamp_min(1e-12)
        worst = max(worst, float((got - ref).abs().amax() / scale))
    assert worst <= ROW_RTOL, worst
    assert torch.cat(list(warm_rows.values())).shape[0] > 0


def test_spec_drafts_were_proposed_accepted_and_rejected() -> None:
    """The thinker drafted (ngram, synchronous scheduling) in both arms, the same drafts
    (the same tokens), some accepted and some rejected, in the round whose prompts hit the
    cache (its drafts come from the random model's own repeats)."""
    seen = []
    for arm in _spec():
        thinker = _thinker(arm["probes"])
        assert thinker["speculative_method"] == "ngram", thinker
        assert thinker["async_scheduling"] is False, thinker
        rnd, before = _round(arm, "spec_hits")
        after = rnd["thinker"]
        delta = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in ("draft_tokens", "drafts_accepted", "drafts_rejected")
        }
        assert delta["draft_tokens"] > 0, (arm["arm"], delta)
        assert delta["drafts_accepted"] > 0 and delta["drafts_rejected"] > 0, (arm["arm"], delta)
        seen.append(delta)
    assert seen[0] == seen[1], seen


def test_spec_prefix_cache_hits_served_with_drafting_on() -> None:
    """With drafting on, hscache's KV-cache manager hit round 1's blocks (the cold run:
    none) and hscache's hidden-state cache served their rows: no miss, stale or partial
    read; vllm-omni's refusal of drafts with a prefix cache was hscache's rule instead."""
    cold, warm = _spec()
    for arm, expect in ((cold, dict.fromkeys(SPEC_HITS, 0)), (warm, SPEC_HITS)):
        rnd, _ = _round(arm, "spec_hits")
        hits = {k: v["thinker_num_cached_tokens"] for k, v in rnd["requests"].items()}
        assert hits == expect, (arm["arm"], hits)
    thinker = _thinker(warm["probes"])
    assert thinker["kv_cache_manager"] == HSCACHE_MANAGER and thinker["enable_caching"]
    caches = _caches(warm["probes"])
    assert [c["class"] for c in caches] == [HSCACHE_CACHE], caches
    stats = caches[0]["stats"]
    # Round 1's r2 may hit r1's first block too (it shares 48 tokens, timing decides).
    assert stats["reads_served"] >= len(SPEC_HITS), stats
    assert stats["cached_rows_served"] >= sum(SPEC_HITS.values()), stats
    assert stats["read_misses"] == stats["stale_reads"] == stats["partial_reads"] == 0, stats


def _preempt_rows(name: str) -> list[tuple[str, Any, Any, dict[str, Any], dict[str, Any]]]:
    """Per request of the preemption round: its rows, its never-preempted reference's
    (the same prompt, alone with a short partner, salted: cold in every arm), and both
    requests' records."""
    arm, rows = _load(name), _rows(name)
    rnd, _ = _round(arm, "preempt")
    out = []
    for req, rec in rnd["requests"].items():
        solo, _ = _round(arm, f"solo_{req}")
        out.append(
            (req, rows[f"preempt/{req}"], rows[f"solo_{req}/{req}"], rec, solo["requests"][req])
        )
    return out


def test_preempted_requests_hand_the_talker_the_never_preempted_rows(suffix: str) -> None:
    """hscache's cache (its delivery watermark): every request of the preemption round hands
    the talker its never-preempted run's rows, each once, in order (prompt rows and one row
    per decode step but the last), within float32 rounding."""
    worst = 0.0
    for req, got, ref, rec, solo in _preempt_rows("hscache" + suffix):
        assert rec["thinker_token_ids"] == solo["thinker_token_ids"], req
        n = rec["prompt_len"] + len(rec["thinker_token_ids"]) - 1
        assert got.shape == ref.shape and ref.shape[0] == n, (req, got.shape, ref.shape, n)
        assert bool((got.abs().amax(dim=-1) > 0).all()), f"{req}: a zero row"
        scale = ref.abs().amax().clamp_min(1e-12)
        worst = max(worst, float((got - ref).abs().amax() / scale))
    assert worst <= ROW_RTOL, worst


@pytest.mark.parametrize("name", ["cold", "omni"])
def test_vllm_omni_hands_a_resumed_requests_rows_on_again(name: str, suffix: str) -> None:
    """vllm-omni 0.30, caching off or its own cache on: the preempted request's payload
    holds more rows than its tokens (the rows recomputed after the resumption follow the
    ones it had handed on), so the rows the talker reads from the preemption point on are
    not the never-preempted run's."""
    repeated = []
    for req, got, ref, rec, solo in _preempt_rows(name + suffix):
        assert rec["thinker_token_ids"] == solo["thinker_token_ids"], req
        if got.shape[0] > ref.shape[0]:
            repeated.append((req, got.shape[0] - ref.shape[0]))
            assert not bool(
                (got[: ref.shape[0]] - ref).abs().amax() <= ROW_RTOL * ref.abs().amax()
            ), req
    assert repeated, "no request of the preemption round handed rows on twice"
    print(f"{name}{suffix}: rows handed on twice {repeated}")
