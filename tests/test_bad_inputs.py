"""The bad-input matrix: every public method of ``hscache.vllm.KVCacheManager``, its
``BlockPool`` view, ``EncoderCacheManager``, the request block hasher and the hidden-state
mirror, called with malformed arguments, must raise a typed exception and change nothing.

Each row builds a fresh target in a known state, takes its fingerprint (the manager's
``state_digest()``; a snapshot of every public field for the other targets), makes the bad
call, asserts the exception type, and asserts the fingerprint did not move. ``ROWS`` is
the single source of the table in ``docs/bad_inputs.md``: regenerate it with
``python tests/test_bad_inputs.py --write-doc``; ``test_doc_is_up_to_date`` fails when it is
stale.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache import exceptions as hx
from hscache.hidden_states import HiddenStateCache
from hscache.testing.kv_cache import full_attention_config
from hscache.testing.manager import manager_kwargs
from hscache.testing.requests import init_none_hash, make_request
from hscache.vllm import KVCacheManager
from hscache.vllm.block_hasher import get_request_block_hasher
from hscache.vllm.encoder_cache_manager import EncoderCacheManager
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad_inputs.md"
PROMPT = list(range(70))


@dataclass
class Ctx:
    """One fresh target and what the rows need beside it."""

    target: Any
    fingerprint: Callable[[], Any]
    extra: dict[str, Any]


# ---------------------------------------------------------------- targets


def _manager() -> Ctx:
    init_none_hash("sha256")
    m = KVCacheManager(**manager_kwargs(full_attention_config(32)))
    a = make_request("a", PROMPT)
    blocks, hit, _ = m.get_computed_blocks(a)
    assert m.allocate_slots(a, 70, hit, blocks) is not None
    c = make_request("c", list(range(1000, 1040)))
    assert m.allocate_slots(c, 40) is not None
    m.free(c)
    other = KVCacheManager(**manager_kwargs(full_attention_config(32)))
    assert other.allocate_slots(make_request("x", PROMPT), 70) is not None
    return Ctx(m, m.state_digest, {"a": a, "other": other})


def _pool() -> Ctx:
    ctx = _manager()
    ctx.extra["manager"] = ctx.target
    ctx.target = ctx.target.block_pool
    return ctx


class _EncoderRequest:
    """What the encoder cache reads: ``request_id``, ``mm_features``, embed counts."""

    def __init__(self, request_id: str, sizes: list[int]) -> None:
        self.request_id = request_id
        self.sizes = sizes
        self.mm_features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=f"img{i}",
                mm_position=PlaceholderRange(offset=0, length=n),
            )
            for i, n in enumerate(sizes)
        ]

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self.sizes[input_id]


def _encoder_snapshot(m: EncoderCacheManager) -> Any:
    return (
        m.cache_size,
        m.num_free_slots,
        m.num_freeable_slots,
        {k: set(v) for k, v in m.cached.items()},
        dict(m.num_embeds_by_hash),
        list(m.freeable.items()),
        {k: list(v) for k, v in m.request_cached_ids.items()},
        list(m.freed),
    )


def _encoder() -> Ctx:
    m = EncoderCacheManager(cache_size=100)
    r = _EncoderRequest("r", [10, 20])
    assert m.can_allocate(r, 0, 100, 0)
    m.allocate(r, 0)
    return Ctx(m, lambda: _encoder_snapshot(m), {"r": r})


def _hasher() -> Ctx:
    init_none_hash("sha256")
    r = make_request("h", PROMPT)
    hasher = get_request_block_hasher(16, sha256)
    return Ctx(hasher, lambda: list(r.block_hashes), {"r": r})


KEYS = {"h": (8, torch.float32)}


def _hidden() -> Ctx:
    cache = HiddenStateCache(16, 4, KEYS)
    plan = cache.plan_step(new=[("a", [3, 7, 2], 0, 11)])
    cache.write_and_gather(plan, {"h": torch.zeros((11, 8))})
    pending = cache.plan_step(running=[("a", [], 1)])

    def snap() -> Any:
        return (
            cache.stats(),
            cache.mirror.num_requests,
            cache.mirror.pending_step,
            cache.tensor("h").clone(),
        )

    def fingerprint() -> Any:
        s = snap()
        return (*s[:3], s[3].sum().item())

    return Ctx(cache, fingerprint, {"plan": pending})


TARGETS: dict[str, Callable[[], Ctx]] = {
    "KVCacheManager": _manager,
    "BlockPool": _pool,
    "EncoderCacheManager": _encoder,
    "request block hasher": _hasher,
    "HiddenStateCache": _hidden,
}


# ---------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    target: str
    method: str
    case: str
    call: Callable[[Ctx], Any]
    raises: type[BaseException]

    @property
    def id(self) -> str:
        return f"{self.target}.{self.method}: {self.case}"


def _req(rid: str = "z", tokens: list[int] | None = None) -> Any:
    return make_request(rid, PROMPT if tokens is None else tokens)


def _nan_watermark(_: Ctx) -> Any:
    return KVCacheManager(**{**manager_kwargs(full_attention_config(32)), "watermark": math.nan})


M, P, E, H, S = (
    "KVCacheManager",
    "BlockPool",
    "EncoderCacheManager",
    "request block hasher",
    "HiddenStateCache",
)

ROWS: list[Row] = [
    # KVCacheManager
    Row(
        M,
        "__init__",
        "num_blocks = 0",
        lambda c: KVCacheManager(**manager_kwargs(full_attention_config(0))),
        hx.InvalidArgumentError,
    ),
    Row(M, "__init__", "NaN watermark", _nan_watermark, hx.InvalidArgumentError),
    Row(
        M,
        "get_computed_blocks",
        "request is None",
        lambda c: c.target.get_computed_blocks(None),
        TypeError,
    ),
    Row(
        M,
        "get_computed_blocks",
        "request is a str",
        lambda c: c.target.get_computed_blocks("a"),
        TypeError,
    ),
    Row(
        M,
        "allocate_slots",
        "negative num_new_tokens",
        lambda c: c.target.allocate_slots(c.extra["a"], -1),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "allocate_slots",
        "num_new_tokens past max_model_len",
        lambda c: c.target.allocate_slots(c.extra["a"], 2**62),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "allocate_slots",
        "num_new_tokens is a str",
        lambda c: c.target.allocate_slots(c.extra["a"], "3"),
        TypeError,
    ),
    Row(
        M,
        "allocate_slots",
        "num_new_tokens is a float",
        lambda c: c.target.allocate_slots(c.extra["a"], 1.5),
        TypeError,
    ),
    Row(
        M,
        "allocate_slots",
        "request is None",
        lambda c: c.target.allocate_slots(None, 1),
        TypeError,
    ),
    Row(
        M,
        "allocate_slots",
        "negative num_lookahead_tokens",
        lambda c: c.target.allocate_slots(_req(), 16, num_lookahead_tokens=-1),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "allocate_slots",
        "negative num_external_computed_tokens",
        lambda c: c.target.allocate_slots(_req(), 16, num_external_computed_tokens=-5),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "allocate_slots",
        "foreign KVCacheBlocks as new_computed_blocks",
        lambda c: c.target.allocate_slots(_req(), 6, 64, c.extra["other"].get_blocks("x")),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "allocate_slots",
        "new_computed_blocks is a list of ints",
        lambda c: c.target.allocate_slots(_req(), 6, 16, [[1]]),
        TypeError,
    ),
    Row(
        M,
        "allocate_slots_batch",
        "float64 token counts",
        lambda c: c.target.allocate_slots_batch(
            [c.extra["a"]], [c.target.request_handle("a")], np.array([70.0]), np.array([1.0])
        ),
        TypeError,
    ),
    Row(
        M,
        "free_batch",
        "float64 handles",
        lambda c: c.target.free_batch(np.array([float(c.target.request_handle("a"))])),
        TypeError,
    ),
    Row(
        M,
        "allocate_slots_batch",
        "arrays of different lengths",
        lambda c: c.target.allocate_slots_batch(
            [c.extra["a"]], [c.target.request_handle("a")], [70, 70], [1]
        ),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "allocate_slots_batch",
        "a stale handle",
        lambda c: c.target.allocate_slots_batch([c.extra["a"]], [12345], [70], [1]),
        hx.UnknownRequestError,
    ),
    Row(
        M,
        "free_batch",
        "one handle twice",
        lambda c: c.target.free_batch([c.target.request_handle("a")] * 2),
        hx.InvalidArgumentError,
    ),
    Row(M, "free", "request is None", lambda c: c.target.free(None), TypeError),
    Row(M, "free", "request id is an int", lambda c: c.target.free(5), TypeError),
    Row(
        M,
        "cache_blocks",
        "negative num_computed_tokens",
        lambda c: c.target.cache_blocks(c.extra["a"], -1),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "cache_blocks",
        "unknown request with full blocks",
        lambda c: c.target.cache_blocks(_req("q"), 32),
        hx.UnknownRequestError,
    ),
    Row(M, "evict_blocks", "block id -1", lambda c: c.target.evict_blocks({-1}), hx.BlockIdError),
    Row(
        M,
        "evict_blocks",
        "block id past the pool",
        lambda c: c.target.evict_blocks({10**6}),
        hx.BlockIdError,
    ),
    Row(M, "evict_blocks", "block id is a str", lambda c: c.target.evict_blocks({"x"}), TypeError),
    Row(M, "evict_blocks", "None", lambda c: c.target.evict_blocks(None), TypeError),
    Row(M, "get_blocks", "request id is an int", lambda c: c.target.get_blocks(5), TypeError),
    Row(M, "get_block_ids", "request id is an int", lambda c: c.target.get_block_ids(5), TypeError),
    Row(
        M,
        "remove_skipped_blocks",
        "negative token count",
        lambda c: c.target.remove_skipped_blocks("a", -1),
        hx.InvalidArgumentError,
    ),
    Row(
        M,
        "take_events",
        "after reset_prefix_cache with blocks in use (no events on)",
        lambda c: (c.target.reset_prefix_cache(), c.target.evict_blocks({-1})),
        hx.BlockIdError,
    ),
    # BlockPool view
    Row(
        P,
        "get_new_blocks",
        "negative count",
        lambda c: c.target.get_new_blocks(-1),
        hx.InvalidArgumentError,
    ),
    Row(
        P,
        "get_new_blocks",
        "more than the free blocks",
        lambda c: c.target.get_new_blocks(10**6),
        hx.OutOfBlocksError,
    ),
    Row(P, "get_new_blocks", "count is a str", lambda c: c.target.get_new_blocks("2"), TypeError),
    Row(
        P,
        "touch",
        "blocks of another manager",
        lambda c: c.target.touch(c.extra["other"].block_pool.blocks[1:3]),
        hx.InvalidArgumentError,
    ),
    Row(
        P,
        "touch",
        "ints instead of blocks",
        lambda c: c.target.touch([1, 2]),
        hx.InvalidArgumentError,
    ),
    Row(
        P,
        "free_blocks",
        "a block already freed",
        lambda c: c.target.free_blocks([c.target.blocks[20]]),
        hx.DoubleFreeError,
    ),
    Row(
        P,
        "free_blocks",
        "one block three times",
        lambda c: c.target.free_blocks([c.target.blocks[1]] * 3),
        hx.DoubleFreeError,
    ),
    Row(
        P,
        "free_blocks",
        "blocks of another manager",
        lambda c: c.target.free_blocks(c.extra["other"].block_pool.blocks[1:2]),
        hx.InvalidArgumentError,
    ),
    Row(
        P,
        "free_blocks",
        "a freed block after reset_prefix_cache",
        lambda c: (c.target.reset_prefix_cache(), c.target.free_blocks([c.target.blocks[25]])),
        hx.DoubleFreeError,
    ),
    Row(
        P,
        "get_cached_block",
        "empty hash",
        lambda c: c.target.get_cached_block(b"", [0]),
        hx.BlockHashError,
    ),
    Row(
        P,
        "get_cached_block",
        "hash of 40 bytes",
        lambda c: c.target.get_cached_block(b"x" * 40, [0]),
        hx.BlockHashError,
    ),
    Row(
        P,
        "get_cached_block",
        "hash is a str",
        lambda c: c.target.get_cached_block("x" * 32, [0]),
        hx.BlockHashError,
    ),
    Row(P, "evict_blocks", "block id -1", lambda c: c.target.evict_blocks({-1}), hx.BlockIdError),
    Row(
        P,
        "cache_full_blocks",
        "more full blocks than the request has",
        lambda c: c.target.cache_full_blocks(
            c.extra["a"], c.extra["manager"].get_blocks("a").blocks[0], 0, 99, 16, 0
        ),
        hx.InvalidArgumentError,
    ),
    # EncoderCacheManager
    Row(
        E,
        "__init__",
        "negative cache_size",
        lambda c: EncoderCacheManager(cache_size=-1),
        hx.InvalidArgumentError,
    ),
    Row(
        E,
        "check_and_update_cache",
        "input id past the request's inputs",
        lambda c: c.target.check_and_update_cache(c.extra["r"], 7),
        IndexError,
    ),
    Row(
        E,
        "allocate",
        "input id past the request's inputs",
        lambda c: c.target.allocate(c.extra["r"], 9),
        IndexError,
    ),
    Row(E, "allocate", "request is None", lambda c: c.target.allocate(None, 0), TypeError),
    Row(
        E,
        "free_encoder_input",
        "input id is a str",
        lambda c: c.target.free_encoder_input(c.extra["r"], "0"),
        TypeError,
    ),
    Row(E, "free", "request is None", lambda c: c.target.free(None), TypeError),
    Row(
        E,
        "get_cached_input_ids",
        "request is None",
        lambda c: c.target.get_cached_input_ids(None),
        TypeError,
    ),
    # request block hasher
    Row(
        H,
        "get_request_block_hasher",
        "block size 0",
        lambda c: get_request_block_hasher(0, sha256)(c.extra["r"]),
        hx.InvalidArgumentError,
    ),
    Row(
        H,
        "get_request_block_hasher",
        "negative block size",
        lambda c: get_request_block_hasher(-16, sha256)(c.extra["r"]),
        hx.InvalidArgumentError,
    ),
    Row(H, "__call__", "request is None", lambda c: c.target(None), TypeError),
    # hidden-state mirror
    Row(
        S,
        "__init__",
        "num_blocks = 0",
        lambda c: HiddenStateCache(0, 4, KEYS),
        hx.InvalidArgumentError,
    ),
    Row(
        S,
        "plan_step",
        "negative num_computed_tokens",
        lambda c: c.target.plan_step(new=[("b", [5], -1, 4)]),
        hx.InvalidArgumentError,
    ),
    Row(
        S,
        "plan_step",
        "block id past the pool",
        lambda c: c.target.plan_step(new=[("b", [99], 0, 4)]),
        hx.BlockIdError,
    ),
    Row(
        S,
        "plan_step",
        "unknown running request",
        lambda c: c.target.plan_step(running=[("nope", [], 1)]),
        hx.UnknownRequestError,
    ),
    Row(
        S,
        "plan_step",
        "one request twice",
        lambda c: c.target.plan_step(new=[("b", [5], 0, 4), ("b", [6], 0, 4)]),
        hx.InvalidArgumentError,
    ),
    Row(
        S,
        "write",
        "wrong dtype",
        lambda c: c.target.write(c.extra["plan"], {"h": torch.zeros((1, 8), dtype=torch.int64)}),
        hx.InvalidArgumentError,
    ),
    Row(
        S,
        "write",
        "numpy array instead of a tensor",
        lambda c: c.target.write(c.extra["plan"], {"h": np.zeros((1, 8), np.float32)}),
        hx.InvalidArgumentError,
    ),
    Row(
        S,
        "write",
        "missing key",
        lambda c: c.target.write(c.extra["plan"], {}),
        hx.InvalidArgumentError,
    ),
    Row(
        S,
        "write",
        "too few rows",
        lambda c: c.target.write(c.extra["plan"], {"h": torch.zeros((0, 8))}),
        hx.InvalidArgumentError,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_raises_typed_and_changes_nothing(row: Row) -> None:
    ctx = TARGETS[row.target]()
    before = ctx.fingerprint()
    with pytest.raises(row.raises) as info:
        row.call(ctx)
    assert type(info.value).__module__ != "builtins" or row.raises.__module__ == "builtins"
    assert not isinstance(info.value, AttributeError), "untyped error"
    assert ctx.fingerprint() == before, "state changed"


def test_every_target_has_rows() -> None:
    assert {r.target for r in ROWS} == set(TARGETS)


def render_doc() -> str:
    """The markdown table of ``ROWS`` (``docs/bad_inputs.md``)."""
    lines = [
        "# The bad-input matrix",
        "",
        "Generated from `tests/test_bad_inputs.py` (`python tests/test_bad_inputs.py "
        "--write-doc`); a test fails when this file is stale. Every row calls the method on a "
        "fresh target in a known state, asserts the exception type, and asserts the target's "
        "fingerprint (`state_digest()` for the KV-cache manager and its `BlockPool` view, a "
        "snapshot of every public field otherwise) is unchanged.",
        "",
        f"{len(ROWS)} rows over {len(TARGETS)} targets.",
        "",
        "| target | method | malformed input | raises |",
        "|---|---|---|---|",
    ]
    for r in ROWS:
        lines.append(f"| {r.target} | `{r.method}` | {r.case} | `{r.raises.__name__}` |")
    return "\n".join(lines) + "\n"


def test_doc_is_up_to_date() -> None:
    assert DOC.read_text() == render_doc(), "run: python tests/test_bad_inputs.py --write-doc"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-doc"]:
        DOC.write_text(render_doc())
        print(f"wrote {DOC}")
    else:
        sys.exit("usage: python tests/test_bad_inputs.py --write-doc")
