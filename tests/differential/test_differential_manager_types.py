"""Scripted differential scenarios, one per rule of a single-type manager (and of the
hybrid coordinator), and the mutants each one must catch.

Each scenario drives vLLM 0.33.0's ``KVCacheManager`` and the candidate in lock-step
(``vllm_diff.Pair``: every answer and the whole observable state compared after every
call) through the calls vLLM's Scheduler makes, and pins a few of vLLM's answers, the
same numbers ``tests/core/managers/`` asserts for the Rust core. The random traces of
``test_differential_vllm.py`` reach every layout too (``mutants.HYBRID`` maps each mutant
to the family whose traces catch it); these scenarios catch each mutant deterministically,
on purpose, and keep doing so however the generator evolves.

Sink attention has no scenario: vLLM 0.33's own manager cannot be built over a
``SinkFullAttentionSpec`` (its ``SinkFullAttentionManager.__init__`` rejects the
``needs_kv_cache_zeroing`` keyword the coordinator passes), so there is no reference to
compare with; ``tests/core/managers/sink.rs`` checks it against full attention.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)

from tests import vllm_diff as diff
from tests.vllm_diff import mutants

pytestmark = pytest.mark.vllm

Scenario = Callable[[diff.Pair], None]
SCENARIOS: dict[str, tuple[Scenario, dict]] = {}


def scenario(**cfg):
    """Register a scenario run on ``diff.TraceConfig(**cfg)`` (every call compared, the
    deep state after every call)."""

    def register(fn: Scenario) -> Scenario:
        SCENARIOS[fn.__name__] = (fn, cfg)
        return fn

    return register


def _run(name: str, candidate) -> None:
    fn, cfg = SCENARIOS[name]
    base = {"num_blocks": 24, "max_model_len": 128, "deep_every": 1, "events_every_call": True}
    fn(diff.Pair(diff.TraceConfig(**(base | cfg)), candidate, seed=name))


@pytest.fixture(scope="module")
def candidate():
    return diff.load_candidate()


# ------------------------------------------------------------------ the Scheduler's calls


def _new(p: diff.Pair, rid: str, prompt, max_tokens: int = 64) -> None:
    p.do(["new", {"rid": rid, "prompt": list(prompt), "max_tokens": max_tokens}])


def _admit(p: diff.Pair, rid: str, n: int | None = None, **kw):
    """Lookup + allocation of a waiting request; returns (hit, hit block ids, new ids)."""
    blocks, hit, _ = p.call("get_computed_blocks", rid=rid)
    n = p.req(rid).num_tokens - hit if n is None else n
    new = p.call(
        "allocate_slots", rid=rid, n=n, hit="hit", kw={"num_new_computed_tokens": hit, **kw}
    )
    if new is not None:
        p.do(["set", rid, "num_computed_tokens", hit + n])
        p.do(["set", rid, "status", "RUNNING"])
    return hit, blocks.get_block_ids(), None if new is None else new.get_block_ids()


def _chunk(p: diff.Pair, rid: str, n: int, **kw):
    """A running request computes ``n`` more tokens; returns the new block ids."""
    new = p.call("allocate_slots", rid=rid, n=n, kw=kw)
    if new is not None:
        p.do(["set", rid, "num_computed_tokens", p.req(rid).num_computed_tokens + n])
    return None if new is None else new.get_block_ids()


def _decode(p: diff.Pair, rid: str, token: int, **kw):
    p.do(["append", rid, [token]])
    return _chunk(p, rid, 1, **kw)


def _end_step(p: diff.Pair) -> list[tuple[int, int]]:
    """The worker ran the step's copies; their endpoints are released; a step starts."""
    key = f"cow@{len(p.actions)}"
    copies, _ = p.call("take_kv_cache_block_copies", key=key)
    p.call("block_pool.free_blocks", key=key)
    p.call("new_step_starts")
    return [(c.src_block_id, c.dst_block_id) for c in copies]


def _ids(p: diff.Pair, rid: str):
    return p.call("get_block_ids", rid=rid)


def _hit(p: diff.Pair, rid: str):
    blocks, hit, _ = p.call("get_computed_blocks", rid=rid)
    return hit, blocks.get_block_ids()


# ------------------------------------------------------------------ scenarios


@scenario(layout="fa:4+swa:4:w=9")
def sliding_window(p: diff.Pair) -> None:
    """Window 9, block 4: a hit needs cdiv(8, 4) = 2 contiguous blocks ending at it; a
    decode frees the blocks before the next token's window into the null block."""
    _new(p, "a", range(1, 21))
    assert _admit(p, "a")[2] == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert _decode(p, "a", 99) == ([11], [12])
    # 20 processed tokens: the window of token 21 starts at 12, blocks 0..2 are skipped
    assert _ids(p, "a") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    _new(p, "b", [*range(1, 21), 50, 51, 52, 53])
    assert _hit(p, "b") == (20, ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10]))
    p.call("evict_blocks", ids=[9])
    assert _hit(p, "b") == (12, ([1, 2, 3], [0, 7, 8]))
    _admit(p, "b")
    p.call("free", rid="a")
    p.call("free", rid="b")


@scenario(layout="fa:4+cl:4:c=8")
def chunked_local(p: diff.Pair) -> None:
    """Chunk 8, block 4: the chunks before the last token's count as computed (nulls);
    only the current chunk's blocks are looked up; decode frees earlier chunks."""
    _new(p, "a", range(1, 21))
    _admit(p, "a")
    assert _decode(p, "a", 99) == ([11], [12])
    assert _ids(p, "a") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12])
    _new(p, "b", [*range(1, 21), 77, 77, 77])
    assert _hit(p, "b") == (20, ([1, 2, 3, 4, 5], [0, 0, 0, 0, 10]))
    p.call("evict_blocks", ids=[4])
    assert _hit(p, "b") == (12, ([1, 2, 3], [0, 0, 8]))
    assert _admit(p, "b")[2] == ([13, 14, 15], [16, 17, 18])
    p.call("free", rid="b")
    p.call("free", rid="a")


@scenario(layout="fa:4+mamba:8:mode=align")
def mamba_partial_hit(p: diff.Pair) -> None:
    """Full attention 4 + Mamba "align" 8 (hash block 4, partial hash hits): the
    producer's state at its prompt boundary 12 lies inside a Mamba block; a consumer
    hitting it copies that block on write."""
    _new(p, "a", range(1, 14))
    assert _admit(p, "a", 8)[2] == ([1, 2], [3])
    _end_step(p)
    assert _chunk(p, "a", 4) == ([4], [5])
    _end_step(p)
    assert _chunk(p, "a", 1) == ([6], [])
    assert _end_step(p) == [(5, 7)]
    _new(p, "b", [*range(1, 13), 70, 71, 72, 73, 74])
    hit, hits, new = _admit(p, "b", 4)
    assert (hit, hits, new) == (12, ([1, 2, 4], [0, 7]), ([8], [9]))
    assert _end_step(p) == [(7, 9)]
    p.call("free", rid="a")
    p.call("free", rid="b")


@scenario(layout="fa:4+mamba:4:mode=align:s=1")
def mamba_speculative_blocks(p: diff.Pair) -> None:
    """Mamba "align" with one speculative block: the state block plus a scratch block,
    which later moves to the table's end."""
    _new(p, "a", range(1, 11))
    la = {"num_lookahead_tokens": 1}
    assert _admit(p, "a", **la)[2] == ([1, 2, 3], [0, 0, 4, 5])
    for token in range(90, 96):
        _decode(p, "a", token, **la)
        p.call("new_step_starts")
    assert _ids(p, "a") == ([1, 2, 3, 6, 8], [0, 0, 0, 5, 7])
    p.call("free", rid="a")


@scenario(layout="fa:4+mamba:4:mode=align", num_blocks=16)
def mamba_evicted_state(p: diff.Pair) -> None:
    """A connector evicts a running request's state block at the prompt's last full
    block; the next allocation keys it again. (hscache once raised InternalError here:
    "block hash 2 was read but not planned"; tests/core/managers/hybrid_proptest.rs found it.)"""
    _new(p, "a", range(1, 14))
    assert _admit(p, "a", 12)[2] == ([1, 2, 3], [0, 0, 4])
    p.call("new_step_starts")
    p.call("evict_blocks", ids=[4])
    assert _chunk(p, "a", 1) == ([5], [6])
    p.call("free", rid="a")


@scenario(layout="fa:4+cross:4", enable_caching=False, num_blocks=16)
def cross_attention(p: diff.Pair) -> None:
    """The encoder's tokens get cross-attention blocks once, at admission; an encoder
    input larger than the pool does not fit."""
    _new(p, "a", range(1, 6))
    assert _admit(p, "a", num_encoder_tokens=10)[2] == ([1, 2], [3, 4, 5])
    for token in (99, 98, 97, 96):
        _decode(p, "a", token)
    assert _ids(p, "a") == ([1, 2, 6], [3, 4, 5])
    p.call("free", rid="a")
    _new(p, "b", range(1, 6))
    assert _admit(p, "b", num_encoder_tokens=60)[2] is None


@scenario(layout="fa:4+ring:4", num_blocks=16)
def circular_buffer(p: diff.Pair) -> None:
    """A ring group claims one block per request, never hit or cached."""
    _new(p, "a", range(1, 11))
    assert _admit(p, "a")[2] == ([1, 2, 3], [4])
    for token in (99, 98, 97):
        _decode(p, "a", token)
    assert _ids(p, "a") == ([1, 2, 3, 5], [4])
    _new(p, "b", [*range(1, 11), 5])
    assert _admit(p, "b") == (8, ([1, 2], []), ([6], [7]))
    p.call("free", rid="a")
    p.call("free", rid="b")


@scenario(layout="rswa:4:w=8")
def rswa(p: diff.Pair) -> None:
    """R-SWA frees the blocks between the prompt (10 tokens: blocks 0..2) and the last 8
    tokens during decode."""
    _new(p, "a", range(1, 11))
    assert _admit(p, "a")[2] == ([1, 2, 3],)
    for token in range(100, 124):
        _decode(p, "a", token)
    assert _ids(p, "a") == ([1, 2, 3, 0, 0, 0, 7, 8, 9],)
    p.call("free", rid="a")


@scenario(layout="fa:4+swa:4:w=8+mamba:4:mode=align", num_blocks=40)
def fixed_point(p: diff.Pair) -> None:
    """Three groups: full attention hits 24, the window then 16, Mamba 8; the next round
    the window re-checks 8 and every group agrees."""
    _new(p, "a", range(1, 26))
    _admit(p, "a", 8)
    p.call("new_step_starts")
    for n in (8, 8, 1):
        _chunk(p, "a", n)
        p.call("new_step_starts")
    p.call("free", rid="a")
    _new(p, "b", [*range(1, 25), 70, 71, 72, 73])
    assert _hit(p, "b") == (
        24,
        ([1, 2, 6, 7, 11, 12], [0, 0, 0, 0, 13, 14], [0, 0, 0, 0, 0, 15]),
    )
    p.call("evict_blocks", ids=[13, 10])
    assert _hit(p, "b") == (8, ([1, 2], [3, 4], [0, 5]))
    _admit(p, "b")
    p.call("free", rid="b")


@scenario(layout="fa:4+swa:8:w=16")
def mixed_block_sizes(p: diff.Pair) -> None:
    """Full attention 4 + sliding window 8: hits and caching stop at the scheduler block
    (8), where every group can end a hit."""
    _new(p, "a", range(1, 21))
    assert _admit(p, "a")[2] == ([1, 2, 3, 4, 5], [6, 7, 8])
    _new(p, "b", [*range(1, 21), 5, 6])
    assert _hit(p, "b") == (16, ([1, 2, 3, 4], [6, 7]))
    p.call("free", rid="a")


KILLED_BY = {
    mutants.SlidingWindowHitNeedsWholeWindow: "sliding_window",
    mutants.SlidingWindowKeepsOldBlocks: "sliding_window",
    mutants.ChunkedLocalLooksUpEarlierChunks: "chunked_local",
    mutants.ChunkedLocalKeepsOldChunks: "chunked_local",
    mutants.MambaPartialHitWithoutCopy: "mamba_partial_hit",
    mutants.MambaAlignIgnoresSpeculativeBlocks: "mamba_speculative_blocks",
    mutants.CrossAttentionNotCountedInFit: "cross_attention",
    mutants.CrossAttentionIgnoresEncoder: "cross_attention",
    mutants.RingClaimsBlockEveryStep: "circular_buffer",
    mutants.RswaGapStartsInsidePrompt: "rswa",
    mutants.HybridHitSinglePass: "fixed_point",
    mutants.FreesGroupsLastFirst: "fixed_point",
    mutants.HybridCachesPastTheSchedulerBlock: "mixed_block_sizes",
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_matches_vllm(name, candidate):
    _run(name, candidate)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_is_valid_for_vllm_itself(name):
    _run(name, diff.ReferenceKVCacheManager)


@pytest.mark.parametrize("mutant", list(KILLED_BY), ids=lambda m: m.__name__)
def test_scenario_catches_its_mutant(mutant):
    with pytest.raises(diff.Divergence):
        _run(KILLED_BY[mutant], mutant)


def test_every_manager_type_has_a_mutant_and_a_scenario():
    kinds = {
        "sliding_window",
        "chunked_local",
        "mamba_partial_hit",
        "mamba_speculative_blocks",
        "cross_attention",
        "circular_buffer",
        "rswa",
        "fixed_point",
        "mixed_block_sizes",
    }
    assert kinds <= set(KILLED_BY.values()) <= set(SCENARIOS)
