"""Differential tests: hscache.vllm.KVCacheManager against vLLM 0.33.0's own KVCacheManager.

Randomized scheduler-like traces (``tests/vllm_diff/``) drive both managers with
identical requests and compare, after every call, every return value, the free-block count,
usage, the free-queue order, the block tables, every KV event and the prefix-cache stats, and
every few calls every block's ref count and hash.  Plus targeted scenarios and self-tests
proving that the harness notices a divergence.  CLI for soaks and repros:
``cd tests && python -m vllm_diff --help``.

Knobs (environment):
  HSCACHE_DIFF_TRACES      number of random traces (default 240)
  HSCACHE_DIFF_OPS         manager calls per trace (default 600)
  HSCACHE_DIFF_SEED0       first seed (default 0)
  HSCACHE_DIFF_CANDIDATE   module:Class to test (default hscache.vllm:KVCacheManager)
  HSCACHE_DIFF_MINIMIZE    shrink the first N divergences into short repros (default 2)
  HSCACHE_DIFF_REPRO_DIR   also write them there as JSON (replay: python -m vllm_diff --replay)
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

from tests import vllm_diff as diff
from tests.vllm_diff import mutants
from tests.vllm_diff.config import FAMILIES, MAMBA_SERVED

pytestmark = pytest.mark.vllm

N_TRACES = int(os.environ.get("HSCACHE_DIFF_TRACES", "240"))
N_OPS = int(os.environ.get("HSCACHE_DIFF_OPS", "600"))
SEED0 = int(os.environ.get("HSCACHE_DIFF_SEED0", "0"))
_MINIMIZE_LEFT = [int(os.environ.get("HSCACHE_DIFF_MINIMIZE", "2"))]

REFERENCE = diff.ReferenceKVCacheManager


@pytest.fixture(scope="module")
def candidate():
    # An unimportable candidate is a failure, never a skip that leaves the run green.
    return diff.load_candidate()


def _run(seed: int, cfg: diff.TraceConfig, candidate) -> dict:
    try:
        return diff.run_trace(seed, cfg, candidate)
    except diff.Divergence as d:
        if _MINIMIZE_LEFT[0] <= 0:
            raise
        _MINIMIZE_LEFT[0] -= 1
        actions, best = diff.minimize(d, candidate, search_seeds=30)
        where = ""
        out_dir = os.environ.get("HSCACHE_DIFF_REPRO_DIR")
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"seed{seed}.json")
            diff.dump_repro(path, dataclasses.replace(best.config, deep_every=1), actions)
            where = f"\nwritten to {path} (cd tests && python -m vllm_diff --replay {path})"
        raise AssertionError(
            f"{d}\n\nminimized repro ({len(actions)} actions, trace seed={best.seed}, "
            f"config {best.config}):\n{diff.format_actions(actions)}{where}"
        ) from None


# ------------------------------------------------------------------------- random traces

_SEEDS = list(range(SEED0, SEED0 + N_TRACES))


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed", _SEEDS, ids=[f"{s}-{diff.config_for_seed(s).short()}" for s in _SEEDS]
)
def test_random_trace(seed, candidate):
    cfg = diff.config_for_seed(seed, num_ops=N_OPS)
    _run(seed, cfg, candidate)


_HASHER_SEEDS = _SEEDS[:40]


@pytest.mark.slow
@pytest.mark.parametrize("seed", _HASHER_SEEDS)
def test_random_trace_with_hscache_hasher(seed, candidate):
    """What the plugin installs in production: hscache's manager fed by hscache's block
    hasher, against vLLM's manager fed by vLLM's."""
    from hscache.vllm.block_hasher import get_request_block_hasher

    cfg = diff.config_for_seed(seed, num_ops=N_OPS // 2)
    diff.run_trace(seed, cfg, candidate, cand_hasher_factory=get_request_block_hasher)


def test_candidate_does_not_fall_back(candidate):
    """Every configuration the random traces use must run on the candidate itself (not on
    vLLM's manager through a constructor fall-back), or the comparison proves nothing
    (each trace also refuses a fall-back when it builds its managers)."""
    if candidate is REFERENCE:
        pytest.skip("the candidate is vLLM's manager")
    fell_back = []
    for seed in _SEEDS:
        cfg = diff.config_for_seed(seed)
        mgr = candidate(**diff.manager_kwargs(cfg))
        if type(mgr) is REFERENCE:
            fell_back.append(cfg.short())
    assert not fell_back, f"candidate fell back to vLLM's manager for {fell_back}"


# ------------------------------------------------------------------------- scenarios


def _pair(candidate, name: str, **cfg_kw) -> diff.Pair:
    cfg = diff.TraceConfig(
        **{
            "block_size": 4,
            "num_blocks": 16,
            "max_model_len": 64,
            "deep_every": 1,
            "events_every_call": False,
            **cfg_kw,
        }
    )
    return diff.Pair(cfg, candidate, seed=name)


def _spec(rid: str, prompt: list[int], **kw) -> dict:
    return {"rid": rid, "prompt": list(prompt), "max_tokens": kw.pop("max_tokens", 8), **kw}


def _admit(p: diff.Pair, rid: str, n: int | None = None, running: bool = False):
    """Lookup + allocate + stats + get_blocks, like the Scheduler's waiting loop."""
    req = p.req(rid)
    blocks, hit, _ = p.call("get_computed_blocks", rid=rid)
    n = req.num_tokens - hit if n is None else n
    new = p.call(
        "allocate_slots",
        rid=rid,
        n=n,
        hit="hit",
        kw={"num_new_computed_tokens": hit, "has_scheduled_reqs": running},
    )
    if new is not None:
        p.call("record_prefix_cache_stats", rid=rid, hits=hit)
        p.call("get_blocks", rid=rid)
        p.do(["set", rid, "num_computed_tokens", hit + n])
        p.do(["set", rid, "status", "RUNNING"])
    return blocks, hit, new


def test_duplicate_blocks_then_eviction_order(candidate):
    """Two identical prompts admitted before either is cached each compute (and cache) their
    own copy of the blocks; lookups return the first copy; evicting it exposes the second."""
    p = _pair(candidate, "duplicates", num_blocks=12)
    prompt = list(range(100, 113))  # 13 tokens = 3 full blocks + 1
    p.do(["new", _spec("a", prompt)])
    p.do(["new", _spec("b", prompt)])
    # both look up before either allocates: both miss
    _, hit_a, _ = p.call("get_computed_blocks", rid="a")
    _, hit_b, _ = p.call("get_computed_blocks", rid="b")
    assert hit_a == hit_b == 0
    for rid, running in (("a", False), ("b", True)):
        p.call(
            "allocate_slots",
            rid=rid,
            n=13,
            hit="hit",
            kw={"num_new_computed_tokens": 0, "has_scheduled_reqs": running},
        )
        p.call("record_prefix_cache_stats", rid=rid, hits=0)
    ids_a = p.call("get_block_ids", rid="a")[0]
    ids_b = p.call("get_block_ids", rid="b")[0]
    assert ids_a == [1, 2, 3, 4] and ids_b == [5, 6, 7, 8]
    # duplicates are kept: a third identical prompt hits the first copy
    p.do(["new", _spec("c", prompt)])
    blocks, hit, _ = p.call("get_computed_blocks", rid="c")
    assert hit == 12 and blocks.get_block_ids() == ([1, 2, 3],)
    p.call("take_events")
    # free both (tail first; unhashed tails go to the head of the queue)
    p.call("free", rid="a")
    p.call("free", rid="b")
    free_order = [b.block_id for b in p.ref.mgr.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order == [8, 4, 9, 10, 11, 3, 2, 1, 7, 6, 5]
    # evict the first copy's head: that key survives through the second copy, the others
    # still resolve to the first copy (each key independently returns its first block)
    p.call("evict_blocks", ids=[1])
    blocks, hit, _ = p.call("get_computed_blocks", rid="c")
    assert hit == 12 and blocks.get_block_ids() == ([5, 2, 3],)
    # a big unrelated request evicts from the head of the queue (BlockRemoved in order)
    p.do(["new", _spec("d", list(range(300, 336)), max_tokens=1)])
    _admit(p, "d")
    events = p.call("take_events")
    assert [type(e).__name__ for e in events][:2] == ["BlockRemoved", "BlockRemoved"]
    p.call("free", rid="d")
    p.call("make_prefix_cache_stats")
    p.check_state(deep=True)


def test_prompt_logprobs_skip_prefix_cache_read(candidate):
    """Requests asking for prompt logprobs never read the prefix cache (and are not counted
    in the stats) but their blocks are still cached for others."""
    p = _pair(candidate, "prompt-logprobs")
    prompt = list(range(7, 24))  # 17 tokens
    p.do(["new", _spec("warm", prompt)])
    _admit(p, "warm")
    p.do(["new", _spec("lp", prompt, logprobs=True)])
    assert p.req("lp").skip_reading_prefix_cache
    blocks, hit, boundary = p.call("get_computed_blocks", rid="lp")
    assert (hit, boundary) == (0, 0)
    assert blocks is p.ref.mgr.empty_kv_cache_blocks
    assert p.call("prefix_cache_lookup_enabled", rid="lp") is False
    p.call(
        "allocate_slots",
        rid="lp",
        n=17,
        hit="hit",
        kw={"num_new_computed_tokens": 0, "has_scheduled_reqs": True},
    )
    p.call("record_prefix_cache_stats", rid="lp", hits=0)
    stats = p.call("make_prefix_cache_stats")
    assert (stats.requests, stats.queries, stats.hits) == (1, 17, 0)  # only "warm"
    p.call("free", rid="warm")
    p.call("free", rid="lp")
    p.do(["new", _spec("plain", prompt)])
    _, hit, _ = p.call("get_computed_blocks", rid="plain")
    assert hit == 16
    p.call("take_events")


def test_reset_prefix_cache_fails_while_in_use(candidate):
    p = _pair(candidate, "reset", enable_events=True)
    p.do(["new", _spec("a", list(range(1, 11)))])
    _admit(p, "a")
    assert p.call("reset_prefix_cache") is False
    stats = p.call("make_prefix_cache_stats")
    assert stats.reset is False
    p.call("free", rid="a")
    assert p.call("reset_prefix_cache") is True
    events = p.call("take_events")
    assert type(events[-1]).__name__ == "AllBlocksCleared"
    stats = p.call("make_prefix_cache_stats")
    assert stats.reset is True
    p.do(["new", _spec("b", list(range(1, 11)))])
    _, hit, _ = p.call("get_computed_blocks", rid="b")
    assert hit == 0
    p.check_state(deep=True)


def test_allocation_failure_leaves_hit_blocks_untouched(candidate):
    """A hit on evictable cached blocks followed by an allocation that does not fit must not
    touch the hit blocks (they stay in the free queue, in place)."""
    p = _pair(candidate, "alloc-fail", num_blocks=8)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
    p.do(["new", _spec("a", prompt)])
    _admit(p, "a")
    p.call("free", rid="a")
    p.do(["new", _spec("hog", list(range(400, 412)))])
    _admit(p, "hog")  # takes 3 blocks from the head, evicting nothing hashed
    p.do(["new", _spec("b", prompt + list(range(900, 930)))])
    _, hit, new = _admit(p, "b", running=True)
    assert hit == 12 and new is None
    p.check_state(deep=True)


def test_deferred_free_and_preemption_roundtrip(candidate):
    p = _pair(candidate, "deferred", num_blocks=10, watermark=0.1)
    p.do(["new", _spec("a", list(range(1, 15)))])
    _admit(p, "a")
    for tok in (5, 6, 7):
        req = p.req("a")
        p.call("allocate_slots", rid="a", n=1, kw={"num_lookahead_tokens": 2})
        p.do(["set", "a", "num_computed_tokens", req.num_tokens])
        p.do(["append", "a", [tok]])
    p.call("pop_blocks_for_free", rid="a", key="k1")
    p.do(["set", "a", "status", "PREEMPTED"])
    p.do(["set", "a", "num_computed_tokens", 0])
    p.do(["set", "a", "num_preemptions", 1])
    p.call("free_popped", rid="a", key="k1")
    _, hit, _ = _admit(p, "a")
    assert hit == 16
    stats = p.call("make_prefix_cache_stats")
    assert (stats.preempted_requests, stats.preempted_hits) == (1, 16)
    p.call("take_events")


def test_streaming_session_rewrites_block_hashes_in_place(candidate):
    """A streaming-input session keeps its blocks between turns while the Scheduler truncates
    and re-extends ``request.block_hashes`` in place: a block hash that covered the dropped
    last sampled token is replaced, and the manager must use the new one."""
    p = _pair(candidate, "session", enable_events=True)
    p.do(["new", _spec("s", list(range(1, 9)), max_tokens=4, resumable=True)])
    _admit(p, "s")  # 8 prompt tokens computed
    p.do(["append", "s", [69]])  # sampled at the end of the prefill
    for tok in (70, 71, 72):  # decode; the turn ends at max_tokens
        p.call("allocate_slots", rid="s", n=1)
        p.do(["set", "s", "num_computed_tokens", p.req("s").num_tokens])
        p.do(["append", "s", [tok]])
    old_hash = p.req("s").block_hashes[2]  # covers [69, 70, 71, 72]
    p.do(["set", "s", "status", "WAITING_FOR_STREAMING_REQ"])
    # next chunk: 72 is dropped, hashes cut back to 11 // 4 = 2 and re-extended
    p.do(["session_update", "s", [30, 31, 32, 33, 34, 35], 3])
    assert len(p.req("s").block_hashes) == 4  # 11 kept + 6 new = 17 tokens
    assert p.req("s").block_hashes[2] != old_hash  # now covers [69, 70, 71, 30]
    req = p.req("s")
    p.call(
        "allocate_slots",
        rid="s",
        n=req.num_tokens - req.num_computed_tokens,
        hit="empty",
        kw={"has_scheduled_reqs": False},
    )
    p.call("take_events")
    p.do(["new", _spec("t", [*range(1, 9), 69, 70, 71, 30, 31, 32, 33, 34, 99])])
    _, hit, _ = p.call("get_computed_blocks", rid="t")
    assert hit == 16
    p.call("free", rid="s")
    p.check_state(deep=True)


# ------------------------------------------------------------------------- self-tests


@pytest.mark.parametrize("seed", range(5))
def test_harness_vllm_against_itself(seed):
    """The harness itself: vLLM against vLLM never diverges (no candidate needed)."""
    summary = diff.run_trace(seed, diff.config_for_seed(seed, num_ops=300), REFERENCE)
    assert summary["calls"] >= 300


@pytest.mark.parametrize("mutant", mutants.ALL, ids=lambda m: m.__name__)
def test_harness_detects_divergence(mutant):
    """Each deliberately broken manager is caught within a few traces (80 at most: the
    seeds walk every layout family, and the rarest, full_sequence_must_fit admissions
    that would not fit, shows first at seed 50)."""
    if mutant is mutants.CachesReprefillableTokens and not hasattr(
        KVCacheCoordinator, "get_num_cacheable_tokens"
    ):
        pytest.skip("this vLLM (0.30) computes the cacheable tokens inline: nothing to patch")
    for seed in range(80):
        try:
            diff.run_trace(seed, diff.config_for_seed(seed, num_ops=300), mutant)
        except diff.Divergence as d:
            assert f"seed={seed}" in str(d) and d.call in str(d)
            return
    pytest.fail(f"{mutant.__name__} was not detected in 80 traces")


@pytest.mark.parametrize("mutant", list(mutants.HYBRID), ids=lambda m: m.__name__)
def test_harness_detects_hybrid_divergence(mutant):
    """Each mutant of one group type (or of the groups' interplay) is caught by the traces
    of the layout family it shows in."""
    family = mutants.HYBRID[mutant]
    if "mamba" in family and not MAMBA_SERVED:
        pytest.skip("Mamba layouts stay on this vLLM's manager (0.30): no Mamba traces")
    seeds = [s for s in range(400) if FAMILIES[s % len(FAMILIES)] == family][:12]
    for seed in seeds:
        try:
            diff.run_trace(seed, diff.config_for_seed(seed, num_ops=300), mutant)
        except diff.Divergence as d:
            assert f"seed={seed}" in str(d)
            return
    pytest.fail(f"{mutant.__name__} was not detected in the {family} traces {seeds}")


def test_harness_shrinks_to_a_short_repro():
    err = None
    for seed in range(10):
        try:
            diff.run_trace(seed, diff.config_for_seed(seed, num_ops=300), mutants.FreeForwardOrder)
        except diff.Divergence as d:
            err = d
            break
    assert err is not None
    actions, best = diff.minimize(err, mutants.FreeForwardOrder, search_seeds=20)
    assert len(actions) < len(err.actions)
    with pytest.raises(diff.Divergence):
        diff.replay(
            actions, dataclasses.replace(best.config, deep_every=1), mutants.FreeForwardOrder
        )
    diff.replay(actions, best.config, REFERENCE)  # a valid trace for vLLM itself


def test_generator_covers_the_features():
    """The random traces really exercise what they claim to (guards against a generator
    change silently dropping a path)."""
    total: dict[str, int] = {}
    for seed in range(40):
        s = diff.run_trace(seed, diff.config_for_seed(seed, num_ops=300), REFERENCE)
        for k, v in s.items():
            total[k] = total.get(k, 0) + v
    for key in (
        "lookup_hit",
        "lookup_miss",
        "alloc_none",
        "alloc_external",
        "alloc_delayed",
        "alloc_after_remote",
        "ev_BlockStored",
        "ev_BlockRemoved",
        "ev_AllBlocksCleared",
        "reset_ok",
        "reset_refused",
        "req_mm",
        "req_lora",
        "req_salt",
        "req_logprobs",
        "req_report_full",
        "req_session",
        "req_embeds_seed",
        "status_PREEMPTED",
        "pop_blocks_for_free",
        "free_popped",
        "evict_blocks",
        "cache_blocks",
        "estimate_cached_tokens",
        "make_prefix_cache_stats",
        "get_computed_blocks_for_connector",
        "truncate_computed_blocks",
        "new_block_ids_to_zero",
        "block_pool.get_cached_block",
        "async_placeholder",
        "session_update",
        "rehash",
        "dup_keys_seen",
        "invalid_blocks",
        "status_WAITING_FOR_STREAMING_REQ",
        "request_id_reused",
    ):
        if key == "rehash" and not diff.config.HAS_HASH_LOOKAHEAD:
            continue  # no lookahead hashing in this vLLM (0.32)
        assert total.get(key, 0) > 0, f"no trace exercised {key}: {total}"
