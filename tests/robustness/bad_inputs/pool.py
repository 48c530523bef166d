"""Rows of ``hscache.vllm.block_pool.BlockPool``, the manager's ``block_pool`` view, and
of the core's pool class under it, ``hscache._core.BlockPoolCore``.

Its surface is vLLM's ``BlockPool`` methods that the Scheduler, connectors and tests call,
``_insert_block_hash`` included (private by name, called by vLLM's connectors). The
fingerprint is the manager's ``state_digest()``. The state: blocks 1-5 are request ``a``'s
(1-4 cached), 6-8 free and cached, 9+ never used (``manager.manager``).
"""

from __future__ import annotations

from typing import Any

from hscache import exceptions as hx
from hscache._core import BlockPoolCore
from hscache.vllm.block_pool import BlockPool
from hscache_tools.testing.requests import make_request

from . import Ctx, Surface, makers, needs_hooks
from . import manager as mgr

IA, BI, BH, DF, TE = (
    hx.InvalidArgumentError,
    hx.BlockIdError,
    hx.BlockHashError,
    hx.DoubleFreeError,
    TypeError,
)


def _view(ctx: Ctx) -> Ctx:
    ctx.x["manager"] = ctx.t
    ctx.x["foreign"] = ctx.x["other"].block_pool.blocks
    ctx.t = ctx.t.block_pool
    return ctx


def pool() -> Ctx:
    return _view(mgr.manager())


@needs_hooks
def poisoned() -> Ctx:
    return _view(mgr.poisoned())


def checked() -> Ctx:
    """``pool()`` in the checked mode (``HSCACHE_CHECK_INVARIANTS=1``)."""
    ctx = pool()
    ctx.x["manager"].check_invariants_after_ops = True
    return ctx


def _blocks(c: Ctx) -> Any:
    """Request ``a``'s blocks (group 0)."""
    return c.x["manager"].get_blocks("a").blocks[0]


def _full(c: Ctx, *args: Any, **kw: Any) -> Any:
    """``cache_full_blocks(a, a's blocks, *args)``."""
    return c.t.cache_full_blocks(c.x["a"], _blocks(c), *args, **kw)


def _partial(c: Ctx, block: Any, *args: Any) -> Any:
    return c.t.cache_partial_block(c.x["a"], block, *args)


P = "BlockPool"
R, A = makers(P, pool)


def pool_core() -> Ctx:
    """The device pool's ``BlockPoolCore`` of ``manager.manager()``."""
    ctx = mgr.manager()
    ctx.x["manager"] = ctx.t
    ctx.t = ctx.t.block_pool.pool_core
    return ctx


RC, _ = makers("BlockPoolCore", pool_core)
HUGE = 2**70
KEY = b"k" * 32 + b"\0\0\0\0"  # a BlockHashWithGroupId: digest + 4-byte group id

ROWS = [
    R("__init__", "core is None", TE, lambda f, c: BlockPool(None, True, 16, False)),
    R("get_new_blocks", "negative count", IA, lambda f, c: f(-1)),
    R("get_new_blocks", "more than the free blocks", hx.OutOfBlocksError, lambda f, c: f(10**6)),
    R("get_new_blocks", "count = 2**70", IA, lambda f, c: f(HUGE)),
    R("get_new_blocks", "count is a str", TE, lambda f, c: f("2")),
    R("get_new_blocks", "count is a float", TE, lambda f, c: f(2.0)),
    R("get_new_blocks", "on a poisoned manager", hx.InternalError, lambda f, c: f(1), poisoned),
    R("touch", "blocks of another manager", IA, lambda f, c: f(c.x["foreign"][1:3])),
    R("touch", "ints instead of blocks", IA, lambda f, c: f([1, 2])),
    R("touch", "None", TE, lambda f, c: f(None)),
    R(
        "touch",
        "on a poisoned manager",
        hx.InternalError,
        lambda f, c: f(c.t.blocks[9:10]),
        poisoned,
    ),
    R("free_blocks", "a block already freed", DF, lambda f, c: f([c.t.blocks[20]])),
    R("free_blocks", "one block three times", DF, lambda f, c: f([c.t.blocks[1]] * 3)),
    R(
        "free_blocks",
        "a held block, then a freed one",
        DF,
        lambda f, c: f([c.t.blocks[1], c.t.blocks[20]]),
    ),
    R("free_blocks", "blocks of another manager", IA, lambda f, c: f(c.x["foreign"][1:2])),
    R(
        "free_blocks",
        "a block of a live request's table (checked mode)",
        IA,
        lambda f, c: f(_blocks(c)[4:5]),
        checked,
    ),
    R("free_blocks", "ints instead of blocks", IA, lambda f, c: f([1])),
    R("free_blocks", "None", TE, lambda f, c: f(None)),
    R(
        "free_blocks",
        "a freed block after reset_prefix_cache",
        DF,
        lambda f, c: (c.t.reset_prefix_cache(), f([c.t.blocks[25]])),
    ),
    R("get_cached_block", "empty hash", BH, lambda f, c: f(b"", [0])),
    R("get_cached_block", "hash of 40 bytes", BH, lambda f, c: f(b"x" * 40, [0])),
    R("get_cached_block", "hash of 33 bytes", BH, lambda f, c: f(b"x" * 33, [0])),
    R("get_cached_block", "hash is a str", BH, lambda f, c: f("x" * 32, [0])),
    R("get_cached_block", "group id -1", IA, lambda f, c: f(b"x" * 32, [-1])),
    R("get_cached_block", "group id is a str", TE, lambda f, c: f(b"x" * 32, ["0"])),
    R("get_cached_block", "group ids None", TE, lambda f, c: f(b"x" * 32, None)),
    R("is_block_writable", "an int", IA, lambda f, c: f(1)),
    R("is_block_writable", "None", IA, lambda f, c: f(None)),
    R("is_block_writable", "a block of another manager", IA, lambda f, c: f(c.x["foreign"][1])),
    R("evict_blocks", "block id -1", BI, lambda f, c: f({-1})),
    R("evict_blocks", "block id = 2**70", BI, lambda f, c: f({HUGE})),
    R("evict_blocks", "None", TE, lambda f, c: f(None)),
    R("reset_prefix_cache", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R("get_num_free_blocks", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R("get_usage", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R("drain_core_events", "on a poisoned manager", hx.InternalError, lambda f, c: f(), poisoned),
    R(
        "cache_full_blocks",
        "more full blocks than the request has",
        IA,
        lambda f, c: f(c.x["a"], _blocks(c), 0, 99, 16, 0),
    ),
    R("cache_full_blocks", "request is None", TE, lambda f, c: f(None, _blocks(c), 0, 4, 16, 0)),
    R(
        "cache_full_blocks",
        "blocks of another manager",
        IA,
        lambda f, c: f(c.x["a"], c.x["foreign"][1:5], 0, 4, 16, 0),
    ),
    R(
        "cache_full_blocks",
        "ints instead of blocks",
        IA,
        lambda f, c: f(c.x["a"], [1], 0, 1, 16, 0),
    ),
    R("cache_full_blocks", "negative num_cached_blocks", IA, lambda f, c: _full(c, -1, 4, 16, 0)),
    R("cache_full_blocks", "block_size 0", IA, lambda f, c: _full(c, 0, 4, 0, 0)),
    R("cache_full_blocks", "block_size not a hash multiple", IA, lambda f, c: _full(c, 0, 4, 7, 0)),
    R("cache_full_blocks", "group id -1", IA, lambda f, c: _full(c, 0, 4, 16, -1)),
    R(
        "cache_full_blocks",
        "mask of the wrong length",
        IA,
        lambda f, c: _full(c, 0, 4, 16, 0, [True]),
    ),
    R("cache_partial_block", "request is None", TE, lambda f, c: f(None, c.t.blocks[5], 6, 0, 16)),
    R(
        "cache_partial_block",
        "negative num_tokens",
        IA,
        lambda f, c: _partial(c, c.t.blocks[5], -1, 0, 16),
    ),
    R(
        "cache_partial_block",
        "past the request's tokens",
        IA,
        lambda f, c: _partial(c, c.t.blocks[5], 99, 0, 16),
    ),
    R(
        "cache_partial_block",
        "a block of another manager",
        IA,
        lambda f, c: _partial(c, c.x["foreign"][5], 6, 0, 16),
    ),
    R(
        "cache_partial_block",
        "an int instead of a block",
        IA,
        lambda f, c: _partial(c, 5, 6, 0, 16),
    ),
    R("cache_partial_block", "group id -1", IA, lambda f, c: _partial(c, c.t.blocks[5], 6, -1, 16)),
    R("cache_partial_block", "block_size 0", IA, lambda f, c: _partial(c, c.t.blocks[5], 6, 0, 0)),
    R(
        "move_block_hashes",
        "source of another manager",
        IA,
        lambda f, c: f(c.x["foreign"][1], c.t.blocks[20]),
    ),
    R("move_block_hashes", "ints instead of blocks", IA, lambda f, c: f(1, 20)),
    R("move_block_hashes", "onto itself", IA, lambda f, c: f(c.t.blocks[1], c.t.blocks[1])),
    R("move_block_hashes", "onto a cached block", IA, lambda f, c: f(c.t.blocks[1], c.t.blocks[2])),
    R(
        "move_block_hashes",
        "onto the null block",
        IA,
        lambda f, c: f(c.t.blocks[1], c.t.null_block),
    ),
    R(
        "_insert_block_hash",
        "key of 1 byte (no group id)",
        BH,
        lambda f, c: f(b"x", c.t.blocks[20], None),
    ),
    R("_insert_block_hash", "key of 40 bytes", BH, lambda f, c: f(b"x" * 40, c.t.blocks[20], None)),
    R(
        "_insert_block_hash",
        "a block of another manager",
        IA,
        lambda f, c: f(KEY, c.x["foreign"][1], None),
    ),
    R("_insert_block_hash", "the null block", IA, lambda f, c: f(KEY, c.t.null_block, None)),
    R(
        "emit_cached_block_events",
        "vLLM's own step, run by the core",
        hx.UnsupportedError,
        lambda f, c: f(c.x["a"], _blocks(c)),
    ),
    R(
        "unpin_blocks",
        "vLLM's own step, run by the core",
        hx.UnsupportedError,
        lambda f, c: f(_blocks(c)[:1], None),
    ),
    R("_insert_block_hash", "negative num_tokens", IA, lambda f, c: f(KEY, c.t.blocks[20], -1)),
]

CORE_ROWS = [
    RC("__init__", "owner is None", TE, lambda f, c: BlockPoolCore(None)),  # type: ignore[arg-type]
    RC("__init__", "owner is a BlockPool view", TE, lambda f, c: BlockPoolCore(c.t)),
    RC(
        "__init__",
        "the host pool of a layout without one",
        IA,
        lambda f, c: BlockPoolCore(c.x["manager"], host=True),
    ),
    RC("block", "block id -1", BI, lambda f, c: f(-1)),
    RC("block", "block id past the pool", BI, lambda f, c: f(32)),
    RC("block", "block id = 2**70", BI, lambda f, c: f(HUGE)),
    RC("block", "block id is a str", TE, lambda f, c: f("1")),
]
ROWS += CORE_ROWS

ACCEPTED = [
    A(
        "touch",
        "a free cached block (a hit)",
        "vLLM: takes it out of the free queue",
        lambda f, c: f(c.t.blocks[6:7]),
    ),
    A(
        "free_blocks",
        "the null block",
        "vLLM: the null block is never freed",
        lambda f, c: f([c.t.null_block]),
    ),
    A(
        "free_blocks",
        "a block of a live request's table",
        "vLLM takes it; the checked mode refuses it (HSCACHE_CHECK_INVARIANTS=1)",
        lambda f, c: f(_blocks(c)[4:5]),
    ),
    A(
        "get_cached_block",
        "group id naming no group",
        "vLLM: no hit",
        lambda f, c: f(b"x" * 32, [99]),
    ),
    A(
        "cache_full_blocks",
        "free blocks under another request's hashes",
        "vLLM: caching does not look at reference counts",
        lambda f, c: f(
            make_request("q", mgr.PROMPT), [c.t.blocks[20], c.t.blocks[21]], 0, 2, 16, 0
        ),
    ),
]

SURFACES = [
    Surface(
        P,
        classes=(BlockPool,),
        extra=("_insert_block_hash",),
        exempt={
            "take_events": "no argument; hands over the core's event queue (built), not annotated",
        },
    ),
    Surface(
        "BlockPoolCore",
        classes=(BlockPoolCore,),
        exempt={
            name: "a binding of the BlockPool views, whose entry points have rows"
            for name in (
                "blocks_with_secondary_keys",
                "cache_full_blocks",
                "cache_partial_block",
                "evict_blocks",
                "free_block_ids",
                "free_blocks",
                "free_list_end",
                "get_cached_block",
                "get_new_blocks",
                "index_detach_key",
                "index_items",
                "index_pop",
                "index_reattach",
                "insert_block_hash",
                "is_block_writable",
                "move_block_hashes",
                "reset_prefix_cache",
                "secondary_keys",
                "touch",
            )
        },
    ),
]
