"""Rows of ``hscache.vllm.KVCacheManager`` (the drop-in and its Rust base ``KVCacheCore``).

Its public surface is what vLLM's Scheduler, connectors and users call (vLLM's
``KVCacheManager`` methods) plus what hscache documents (the batched calls, ``explain``,
``check_invariants``, ``state_digest``, the retention calls, ``block``). The ``core_*``
bindings are internal: the Python ``BlockPool``, coordinator, HiSparse and retention views
call them, and their public entry points have rows here and in ``pool.py``.

The fingerprint is ``state_digest()`` (pool, free queue, index, request tables) with the
``PrefixCacheStats`` object vLLM's ``record_prefix_cache_stats`` fills.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hscache import exceptions as hx
from hscache._core import HiSparseCore, KVCacheCoordinatorCore
from hscache.vllm import KVCacheManager
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request

from . import Ctx, Surface, makers, needs_hooks

PROMPT = list(range(70))
IA, BI, UR, TE = hx.InvalidArgumentError, hx.BlockIdError, hx.UnknownRequestError, TypeError


def _kwargs(num_blocks: int = 32, **overrides: Any) -> dict[str, Any]:
    return {**manager_kwargs(full_attention_config(num_blocks)), **overrides}


def _req(rid: str = "z", tokens: list[int] | None = None) -> Any:
    return make_request(rid, PROMPT if tokens is None else tokens)


def _ctx(m: KVCacheManager, **extra: Any) -> Ctx:
    return Ctx(m, lambda: (m.state_digest(), repr(m.prefix_cache_stats)), extra)


def manager(**overrides: Any) -> Ctx:
    """Request ``a`` holds 5 blocks (4 cached), ``c``'s 3 blocks are free and cached
    (blocks 6-8), blocks 9+ were never used; ``other`` is a second manager."""
    m = KVCacheManager(**_kwargs(**overrides))
    a = _req("a")
    blocks, hit, _ = m.get_computed_blocks(a)
    assert m.allocate_slots(a, 70, hit, blocks) is not None
    c = _req("c", list(range(1000, 1040)))
    assert m.allocate_slots(c, 40) is not None
    m.free(c)
    other = KVCacheManager(**_kwargs())
    assert other.allocate_slots(_req("x"), 70) is not None
    return _ctx(m, a=a, other=other)


@needs_hooks
def poisoned() -> Ctx:
    """A manager poisoned by a broken invariant found after a call (checked mode)."""
    ctx = manager()
    m = ctx.t
    m._break_invariant("broken_link")
    m.check_invariants_after_ops = True
    try:
        m.free(ctx.x["a"])
    except hx.InvariantError:
        pass
    assert m.poisoned is not None
    return ctx


@needs_hooks
def broken() -> Ctx:
    """A broken invariant that no call has checked yet (the manager is not poisoned)."""
    ctx = manager()
    ctx.t._break_invariant("missing_decrement")
    return ctx


def zeroing() -> Ctx:
    return manager(kv_cache_config=full_attention_config(32, needs_zeroing=True))


def explaining() -> Ctx:
    return manager(explain=True)


def stale_hit() -> Ctx:
    """Checked mode; ``a2``'s hit was looked up, then ``reset_prefix_cache`` dropped it."""
    m = KVCacheManager(**_kwargs())
    m.check_invariants_after_ops = True
    a = _req("a")
    assert m.allocate_slots(a, 70) is not None
    m.free(a)
    a2 = _req("a2")
    hit, n, _ = m.get_computed_blocks(a2)
    assert n == 64 and m.reset_prefix_cache()
    return _ctx(m, stale=(a2, hit, n))


def _alloc_stale(f: Any, c: Ctx) -> Any:
    req, hit, n = c.x["stale"]
    return c.t.allocate_slots(req, req.num_tokens - n, n, hit)


def delayed() -> Ctx:
    """``manager()`` plus request ``d``: 40 of its 70 prompt tokens (4 full blocks
    hashed) in 3 blocks, its caching delayed (as for a connector's asynchronous load)."""
    ctx = manager()
    d = _req("d", list(range(2000, 2070)))
    assert ctx.t.allocate_slots(d, 40, delay_cache_blocks=True) is not None
    ctx.x["d"] = d
    return ctx


def _alloc_beyond_hit(f: Any, c: Ctx) -> Any:
    """``c``'s prompt again: the lookup hits 2 blocks (32 tokens); one block is handed
    back with the 32 tokens claimed."""
    req = _req("c2", list(range(1000, 1040)))
    hit, n, _ = c.t.get_computed_blocks(req)
    assert n == 32
    one = c.t.create_kv_cache_blocks((hit.blocks[0][:1],))
    return f(req, 40 - n, n, one)


def _handle(c: Ctx) -> int:
    h = c.t.request_handle("a")
    assert h is not None
    return int(h)


def _batch(c: Ctx, computed: Any = None, new: Any = None, **kw: Any) -> Any:
    """``allocate_slots_batch`` for request ``a`` (one entry per ``computed`` value)."""
    computed = [70] if computed is None else computed
    n = len(computed)
    reqs = kw.pop("requests", [c.x["a"]] * n)
    handles = kw.pop("handles", [_handle(c)] * n)
    return c.t.allocate_slots_batch(reqs, handles, computed, [1] * n if new is None else new, **kw)


M = "KVCacheManager"
R, A = makers(M, manager)
HUGE = 2**70  # past 64 bits: pyo3 alone would raise the builtin OverflowError

ROWS = [
    R("__init__", "num_blocks = 0", IA, lambda f, c: KVCacheManager(**_kwargs(0))),
    R("__init__", "num_blocks = 2**70", IA, lambda f, c: KVCacheManager(**_kwargs(HUGE))),
    R("__init__", "NaN watermark", IA, lambda f, c: KVCacheManager(**_kwargs(watermark=math.nan))),
    R(
        "__init__",
        "infinite watermark",
        IA,
        lambda f, c: KVCacheManager(**_kwargs(watermark=math.inf)),
    ),
    R("__init__", "negative watermark", IA, lambda f, c: KVCacheManager(**_kwargs(watermark=-0.1))),
    R(
        "__init__",
        "kv_cache_config is None",
        TE,
        lambda f, c: KVCacheManager(**_kwargs(kv_cache_config=None)),
    ),
    R(
        "__init__",
        "negative max_model_len",
        IA,
        lambda f, c: KVCacheManager(**_kwargs(max_model_len=-1)),
    ),
    R(
        "__init__",
        "hash_block_size 0",
        IA,
        lambda f, c: KVCacheManager(**_kwargs(hash_block_size=0)),
    ),
    R(
        "__init__",
        "hash_block_size not dividing the block size",
        IA,
        lambda f, c: KVCacheManager(**_kwargs(hash_block_size=5)),
    ),
    R(
        "__init__",
        "negative num_hash_lookahead_tokens",
        IA,
        lambda f, c: KVCacheManager(**_kwargs(num_hash_lookahead_tokens=-1)),
    ),
    R("__init__", "unknown keyword", TE, lambda f, c: KVCacheManager(**_kwargs(bogus=1))),
    R(
        "__init__",
        "unknown retention policy",
        IA,
        lambda f, c: KVCacheManager(**_kwargs(retention="mru")),
    ),
    R(
        "__init__",
        "called again on a built manager",
        hx.UnsupportedError,
        lambda f, c: f(**_kwargs()),
    ),
    R("build", "num_blocks = 0", IA, lambda f, c: KVCacheManager.build(**_kwargs(0))),
    R(
        "build",
        "NaN watermark",
        IA,
        lambda f, c: KVCacheManager.build(**_kwargs(watermark=math.nan)),
    ),
    R(
        "build",
        "kv_cache_config is a dict",
        TE,
        lambda f, c: KVCacheManager.build(**_kwargs(kv_cache_config={})),
    ),
    R("get_computed_blocks", "request is None", TE, lambda f, c: f(None)),
    R("get_computed_blocks", "request is a str", TE, lambda f, c: f("a")),
    R("get_computed_blocks", "negative max_cache_hit_length", IA, lambda f, c: f(_req(), -1)),
    R("get_computed_blocks", "max_cache_hit_length = 2**70", IA, lambda f, c: f(_req(), HUGE)),
    R("get_computed_blocks", "max_cache_hit_length is a str", TE, lambda f, c: f(_req(), "9")),
    R(
        "get_computed_blocks",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f(_req()),
        poisoned,
    ),
    R("get_computed_blocks_for_connector", "request is None", TE, lambda f, c: f(None)),
    R(
        "get_computed_blocks_for_connector",
        "negative max_cache_hit_length",
        IA,
        lambda f, c: f(_req(), -1),
    ),
    R(
        "get_computed_blocks_for_connector",
        "max_cache_hit_length is a str",
        TE,
        lambda f, c: f(_req(), "9"),
    ),
    R("allocate_slots", "negative num_new_tokens", IA, lambda f, c: f(c.x["a"], -1)),
    R("allocate_slots", "num_new_tokens past max_model_len", IA, lambda f, c: f(c.x["a"], 2**62)),
    R("allocate_slots", "num_new_tokens = 2**70", IA, lambda f, c: f(c.x["a"], HUGE)),
    R("allocate_slots", "num_new_tokens is a str", TE, lambda f, c: f(c.x["a"], "3")),
    R("allocate_slots", "num_new_tokens is a float", TE, lambda f, c: f(c.x["a"], 1.5)),
    R("allocate_slots", "request is None", TE, lambda f, c: f(None, 1)),
    R("allocate_slots", "negative num_new_computed_tokens", IA, lambda f, c: f(_req(), 16, -16)),
    R(
        "allocate_slots",
        "negative num_lookahead_tokens",
        IA,
        lambda f, c: f(_req(), 16, num_lookahead_tokens=-1),
    ),
    R(
        "allocate_slots",
        "negative num_external_computed_tokens",
        IA,
        lambda f, c: f(_req(), 16, num_external_computed_tokens=-5),
    ),
    R(
        "allocate_slots",
        "negative num_encoder_tokens",
        IA,
        lambda f, c: f(_req(), 16, num_encoder_tokens=-1),
    ),
    R(
        "allocate_slots",
        "reserved_blocks = 2**70",
        IA,
        lambda f, c: f(_req(), 16, reserved_blocks=HUGE),
    ),
    R(
        "allocate_slots",
        "skip_zeroing_group_ids holds a str",
        TE,
        lambda f, c: f(_req(), 16, skip_zeroing_group_ids=["0"]),
    ),
    R(
        "allocate_slots",
        "foreign KVCacheBlocks as new_computed_blocks",
        IA,
        lambda f, c: f(_req(), 6, 64, c.x["other"].get_blocks("x")),
    ),
    R(
        "allocate_slots",
        "new_computed_blocks is a list of ints",
        TE,
        lambda f, c: f(_req(), 6, 16, [[1]]),
    ),
    R(
        "allocate_slots",
        "num_new_computed_tokens beyond the hit handed back",
        IA,
        _alloc_beyond_hit,
    ),
    R(
        "allocate_slots",
        "a negative reserved_blocks, more blocks than the pool has free",
        hx.OutOfBlocksError,
        lambda f, c: f(_req("n", list(range(5000, 5000 + 16 * 30))), 480, reserved_blocks=-10),
    ),
    R(
        "allocate_slots",
        "hits looked up before reset_prefix_cache (checked mode)",
        IA,
        _alloc_stale,
        stale_hit,
    ),
    R(
        "allocate_slots_batch",
        "float64 token counts",
        TE,
        lambda f, c: _batch(c, np.array([70.0]), np.array([1.0])),
    ),
    R(
        "allocate_slots_batch",
        "bool array",
        TE,
        lambda f, c: _batch(c, np.array([70]), np.array([True])),
    ),
    R(
        "allocate_slots_batch",
        "2-D arrays",
        IA,
        lambda f, c: _batch(c, np.array([[70]]), np.array([[1]])),
    ),
    R(
        "allocate_slots_batch",
        "uint64 count past int64",
        IA,
        lambda f, c: _batch(c, np.array([70]), np.array([2**63], np.uint64)),
    ),
    R(
        "allocate_slots_batch",
        "arrays of different lengths",
        IA,
        lambda f, c: _batch(c, [70, 70], [1], requests=[c.x["a"]], handles=[_handle(c)]),
    ),
    R(
        "allocate_slots_batch",
        "more requests than entries",
        IA,
        lambda f, c: _batch(c, requests=[c.x["a"]] * 2),
    ),
    R("allocate_slots_batch", "negative num_new_tokens", IA, lambda f, c: _batch(c, [70], [-1])),
    R(
        "allocate_slots_batch",
        "negative num_lookahead_tokens",
        IA,
        lambda f, c: _batch(c, num_lookahead_tokens=-1),
    ),
    R("allocate_slots_batch", "a stale handle", UR, lambda f, c: _batch(c, handles=[12345])),
    R("allocate_slots_batch", "handles hold a str", IA, lambda f, c: _batch(c, handles=["a"])),
    R("allocate_slots_batch", "one handle twice", IA, lambda f, c: _batch(c, [70, 70], [1, 1])),
    R("free_batch", "float64 handles", TE, lambda f, c: f(np.array([float(_handle(c))]))),
    R("free_batch", "one handle twice", IA, lambda f, c: f([_handle(c)] * 2)),
    R("free_batch", "a handle naming no request", UR, lambda f, c: f([12345])),
    R("free_batch", "a live handle, then an unknown one", UR, lambda f, c: f([_handle(c), 12345])),
    R("free_batch", "handle = 2**70", IA, lambda f, c: f([HUGE])),
    R("free_batch", "None", TE, lambda f, c: f(None)),
    R("free", "request is None", TE, lambda f, c: f(None)),
    R("free", "request id is an int", TE, lambda f, c: f(5)),
    R("free", "on a poisoned manager", hx.InternalError, lambda f, c: f(_req("q")), poisoned),
    R("pop_blocks_for_free", "request is None", TE, lambda f, c: f(None)),
    R("pop_blocks_for_free", "request is a str", TE, lambda f, c: f("a")),
    R(
        "pop_blocks_for_free",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f(c.x["a"]),
        poisoned,
    ),
    R("num_common_prefix_blocks", "request id is None", TE, lambda f, c: f(None)),
    R("num_common_prefix_blocks", "request id is an int", TE, lambda f, c: f(5)),
    R(
        "num_common_prefix_blocks",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f("a"),
        poisoned,
    ),
    R("get_zeroing_block_ids_in_range", "negative start_token", IA, lambda f, c: f("a", -16, 32)),
    R("get_zeroing_block_ids_in_range", "negative end_token", IA, lambda f, c: f("a", 0, -1)),
    R("get_zeroing_block_ids_in_range", "start_token is a str", TE, lambda f, c: f("a", "0", 32)),
    R("get_zeroing_block_ids_in_range", "request id is None", TE, lambda f, c: f(None, 0, 32)),
    R("cache_blocks", "negative num_computed_tokens", IA, lambda f, c: f(c.x["a"], -1)),
    R("cache_blocks", "num_computed_tokens = 2**70", IA, lambda f, c: f(c.x["a"], HUGE)),
    R("cache_blocks", "num_computed_tokens is a str", TE, lambda f, c: f(c.x["a"], "16")),
    R("cache_blocks", "request is None", TE, lambda f, c: f(None, 16)),
    R("cache_blocks", "unknown request with full blocks", UR, lambda f, c: f(_req("q"), 32)),
    R(
        "cache_blocks",
        "more blocks than the request holds (caching delayed)",
        IA,
        lambda f, c: f(c.x["d"], 64),
        delayed,
    ),
    R("evict_blocks", "block id -1", BI, lambda f, c: f({-1})),
    R("evict_blocks", "block id past the pool", BI, lambda f, c: f({10**6})),
    R("evict_blocks", "block id = 2**70", BI, lambda f, c: f({HUGE})),
    R("evict_blocks", "a cached block, then one past the pool", BI, lambda f, c: f([6, 99])),
    R("evict_blocks", "block id is a str", TE, lambda f, c: f({"x"})),
    R("evict_blocks", "None", TE, lambda f, c: f(None)),
    R("get_blocks", "request id is an int", TE, lambda f, c: f(5)),
    R("get_blocks", "on a poisoned manager", hx.InternalError, lambda f, c: f("a"), poisoned),
    R("get_block_ids", "request id is an int", TE, lambda f, c: f(5)),
    R("get_block_ids", "on a poisoned manager", hx.InternalError, lambda f, c: f("a"), poisoned),
    R(
        "get_block_ids_for_computed_tokens",
        "negative num_computed_tokens",
        IA,
        lambda f, c: f("a", -1),
    ),
    R(
        "get_block_ids_for_computed_tokens",
        "num_computed_tokens = 2**70",
        IA,
        lambda f, c: f("a", HUGE),
    ),
    R("get_block_ids_for_computed_tokens", "request id is an int", TE, lambda f, c: f(5, 16)),
    R("estimate_cached_tokens", "request is None", TE, lambda f, c: f(None)),
    R("estimate_cached_tokens", "request is a str", TE, lambda f, c: f("a")),
    R(
        "estimate_cached_tokens",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f(c.x["a"]),
        poisoned,
    ),
    R("prefix_cache_lookup_enabled", "request is None", TE, lambda f, c: f(None)),
    R("prefix_cache_lookup_enabled", "request is a str", TE, lambda f, c: f("a")),
    R("record_prefix_cache_stats", "request is None", TE, lambda f, c: f(None, 16)),
    R(
        "record_prefix_cache_stats",
        "num_hits is a str (stats not half-updated)",
        TE,
        lambda f, c: f(_req(), "16"),
    ),
    R("record_prefix_cache_stats", "negative num_hits", IA, lambda f, c: f(_req(), -16)),
    R("remove_skipped_blocks", "negative token count", IA, lambda f, c: f("a", -1)),
    R("remove_skipped_blocks", "token count = 2**70", IA, lambda f, c: f("a", HUGE)),
    R("remove_skipped_blocks", "negative num_prompt_tokens", IA, lambda f, c: f("a", 16, -1)),
    R("remove_skipped_blocks", "request id is an int", TE, lambda f, c: f(5, 16)),
    R(
        "truncate_computed_blocks",
        "foreign KVCacheBlocks",
        IA,
        lambda f, c: f(c.x["other"].get_blocks("x"), 16),
    ),
    R(
        "truncate_computed_blocks",
        "negative num_computed_tokens",
        IA,
        lambda f, c: f(c.t.get_blocks("a"), -16),
    ),
    R(
        "truncate_computed_blocks",
        "num_computed_tokens not block aligned",
        IA,
        lambda f, c: f(c.t.get_blocks("a"), 5),
    ),
    R(
        "truncate_computed_blocks",
        "past the blocks given",
        IA,
        lambda f, c: f(c.t.get_blocks("a"), 160),
    ),
    R("truncate_computed_blocks", "blocks is a list", TE, lambda f, c: f([[1]], 16)),
    R("create_kv_cache_blocks", "blocks is None", TE, lambda f, c: f(None)),
    R("record_blocks_for_zeroing", "negative start_token", IA, lambda f, c: f("a", -1)),
    R("record_blocks_for_zeroing", "start_token = 2**70", IA, lambda f, c: f("a", HUGE)),
    R(
        "record_blocks_for_zeroing",
        "start_token not block aligned (zeroing on)",
        IA,
        lambda f, c: f("a", 5),
        zeroing,
    ),
    R("record_blocks_for_zeroing", "request id is an int", TE, lambda f, c: f(5, 0)),
    R("finalize_partial_tail_offloads", "request is None", TE, lambda f, c: f(None)),
    R(
        "finalize_partial_tail_offloads",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f(c.x["a"]),
        poisoned,
    ),
    R("request_handle", "request id is an int", TE, lambda f, c: f(5)),
    R("request_handle", "on a poisoned manager", hx.InternalError, lambda f, c: f("a"), poisoned),
    R("explain", "explain mode off", hx.UnsupportedError, lambda f, c: f("a")),
    R("explain", "a request never looked up", UR, lambda f, c: f("never"), explaining),
    R("explain", "request id is an int", TE, lambda f, c: f(5), explaining),
    R(
        "check_invariants",
        "a broken invariant (missing decrement)",
        hx.InvariantError,
        lambda f, c: f(),
        broken,
    ),
    R("retention_advance_clock", "NaN seconds", IA, lambda f, c: f(math.nan)),
    R("retention_advance_clock", "negative seconds", IA, lambda f, c: f(-1.0)),
    R("retention_advance_clock", "seconds is a str", TE, lambda f, c: f("1")),
    R("retention_pin_blocks", "block id -1", BI, lambda f, c: f([-1])),
    R("retention_pin_blocks", "block id past the pool", BI, lambda f, c: f([99])),
    R("retention_pin_blocks", "block id = 2**70", BI, lambda f, c: f([HUGE])),
    R("retention_pin_blocks", "block id is a str", TE, lambda f, c: f(["1"])),
    # Calls without arguments: their bad input is the state they are called in.
    R("new_step_starts", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R("take_new_block_ids", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R(
        "take_kv_cache_block_copies",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f(),
        poisoned,
    ),
    R(
        "take_boundary_state_offloads",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f(),
        poisoned,
    ),
    R("reset_prefix_cache", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R("retention_stats", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R("retention_unpin_all", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
]

ACCEPTED = [
    A("free", "unknown request", "vLLM: a no-op", lambda f, c: f(_req("q"))),
    A("get_blocks", "unknown request id", "vLLM: empty blocks", lambda f, c: f("q")),
    A("get_block_ids", "unknown request id", "vLLM: empty lists", lambda f, c: f("q")),
    A("pop_blocks_for_free", "unknown request", "vLLM: no blocks", lambda f, c: f(_req("q"))),
    A("estimate_cached_tokens", "unknown request", "vLLM: 0", lambda f, c: f(_req("q"))),
    A("remove_skipped_blocks", "unknown request id", "vLLM: a no-op", lambda f, c: f("q", 16)),
    A("request_handle", "unknown request id", "documented: None", lambda f, c: f("q")),
    A(
        "cache_blocks",
        "num_computed_tokens past the hashed tokens",
        "vLLM caps at the hashed tokens",
        lambda f, c: f(c.x["a"], 1000),
    ),
    A(
        "allocate_slots",
        "negative reserved_blocks",
        "vLLM: Mamba align's over-allocated blocks count against it",
        lambda f, c: f(_req(), 16, reserved_blocks=-1),
    ),
    A(
        "allocate_slots",
        "skip_zeroing_group_ids naming no group (-1, 99)",
        "vLLM tests set membership",
        lambda f, c: f(_req(), 16, skip_zeroing_group_ids=[-1, 99]),
    ),
    A(
        "allocate_slots_batch",
        "non-contiguous int64 arrays",
        "copied into one int64 buffer",
        lambda f, c: _batch(c, np.array([70, 0])[::2], np.array([1, 0])[::2]),
    ),
    A(
        "num_common_prefix_blocks",
        "unknown request id",
        "vLLM 0.30: zeros, and the id counts as a holder from then on (its defaultdict)",
        lambda f, c: f("q"),
    ),
    A(
        "get_zeroing_block_ids_in_range",
        "unknown request id, start past end",
        "vLLM 0.30: no blocks",
        lambda f, c: f("q", 64, 16),
    ),
    A(
        "get_num_common_prefix_blocks",
        "any request id",
        "vLLM's deprecated stub: zeros",
        lambda f, c: f(5),
    ),
]

# The core's coordinator and HiSparse classes (``src/python/coordinator.rs``,
# ``src/python/hisparse.rs``): built by the manager's views, which vLLM code calls.
CR, _ = makers("KVCacheCoordinatorCore", manager)
HR, _ = makers("HiSparseCore", manager)
ROWS += [
    CR("__init__", "owner is None", TE, lambda f, c: KVCacheCoordinatorCore(None)),  # type: ignore[arg-type]
    CR(
        "__init__",
        "owner is the coordinator view",
        TE,
        lambda f, c: KVCacheCoordinatorCore(c.t.coordinator),
    ),
    HR("__init__", "owner is None", TE, lambda f, c: HiSparseCore(None)),  # type: ignore[arg-type]
    HR("__init__", "a layout without HiSparse", IA, lambda f, c: HiSparseCore(c.t)),
]
_VIEW_BINDING = "a binding of the coordinator and manager views (vLLM's names, called by them)"
_HISPARSE_BINDING = "a binding of the HiSparse views (vLLM's names, called by them)"

SURFACES = [
    Surface(
        M,
        classes=(KVCacheManager,),
        internal={
            "core_": "bindings under the Python manager's own methods (batch API, retention, "
            "explain mode, KV events); their public entry points have rows",
        },
        exempt={
            "state_digest": "no argument; the fingerprint itself, readable on a poisoned "
            "manager for diagnostics",
            "make_prefix_cache_stats": "no argument; swaps vLLM's Python stats object, no "
            "core state",
            "take_events": "no argument; hands over the core's event queue, BlockStored annotated",
            "get_num_common_prefix_blocks": "vLLM's deprecated stub: any id, zeros (accepted row)",
        },
    ),
    Surface(
        "KVCacheCoordinatorCore",
        classes=(KVCacheCoordinatorCore,),
        exempt={
            name: _VIEW_BINDING
            for name in (
                "find_longest_cache_hit",
                "find_longest_cache_hit_per_group",
                "get_num_blocks_to_allocate",
                "group_allocate_new_blocks",
                "group_blocks",
                "group_info",
                "group_num_blocks_to_allocate",
                "hisparse_layout",
                "info",
                "mamba_state",
                "num_cached_block",
                "partial_hit_reqs",
                "push_cow_copy",
                "request_ids",
                "set_group_use_eagle",
                "set_retention_interval",
            )
        },
    ),
    Surface(
        "HiSparseCore",
        classes=(HiSparseCore,),
        exempt={
            name: _HISPARSE_BINDING
            for name in (
                "adopt_resident_page",
                "advance_scheduled",
                "all_context_pages_resident",
                "build_offload_command",
                "build_row_mirrors",
                "commit_computed_blocks",
                "complete_host_import",
                "drop_resident_page",
                "finish_host_import",
                "free",
                "get_resident_page",
                "get_residency_row",
                "has_pending_reclamation",
                "has_pending_work",
                "hot_required",
                "layout",
                "plan_prefix_materialization",
                "publication_request",
                "record_pending_host_import",
                "release_completed_host_copies",
                "request_ids",
                "request_state",
                "residency_changes",
                "require_hot",
                "set",
                "spills_to_send",
                "pending_spills",
                "state",
                "tables",
                "take_host_block_copies",
                "take_residency_updates",
                "update_residency",
                "update_spills",
            )
        },
    ),
]
