"""Compact KV events (``kv_events_mode="compact"`` / ``HSCACHE_KV_EVENTS=compact``):
fewer events carrying exactly the same keys as vLLM's stream, still vLLM's structs.

- Two identical managers driven identically, one per mode, on an eviction-heavy trace:
  the compact stream has strictly fewer events, the same multiset of stored and removed
  ``(hash, group)`` keys, and each compact batch is exactly ``coalesce_kv_events`` of the
  exact batch (the in-call merge and the rule applied afterwards agree).
- A store that continues its chain in the same batch (a chunked prefill, a request
  extending another's prefix) merges into the store before it, unless a field differs
  (session); its lists are vLLM's, concatenated.
- ``coalesce_kv_events`` on hand-made batches: barriers, no reordering, groups and media,
  the input left unchanged.
- Selection: the keyword, else ``HSCACHE_KV_EVENTS`` read when the manager is built;
  bad names raise; parity mode keeps vLLM's stream.

The replay into an independent index under both modes is ``tests/events/test_events_replay.py``;
the rule's unit tests are in ``src/events/compact.rs``.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import msgspec
import pytest
from hscache._core import coalesce_kv_events
from hscache.exceptions import InvalidArgumentError
from hscache.vllm import KVCacheManager
from hscache.vllm.version import require
from hscache_tools.testing.kv_cache import (
    full_attention,
    full_attention_config,
    kv_cache_config,
    sliding_window,
)
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

_LAYOUTS = {
    "full": lambda: full_attention_config(40),
    "full+swa": lambda: kv_cache_config([full_attention(16), sliding_window(16, 32)], 48),
}


def _manager(layout: str, mode: str, **kwargs: Any) -> Any:
    return KVCacheManager(
        **manager_kwargs(_LAYOUTS[layout](), enable_kv_cache_events=True, **kwargs),
        kv_events_mode=mode,
    )


def _drive(m: Any, seed: int, steps: int = 200) -> list[list[Any]]:
    """A seeded eviction-heavy trace (shared prefixes, random tails, a small pool); the
    events of every step."""
    rng = random.Random(seed)
    prefixes = [[p * 10_000 + i for i in range(rng.choice((16, 32, 48)))] for p in range(4)]
    running: list[Any] = []
    batches = []
    for step in range(steps):
        for _ in range(rng.randrange(1, 3)):
            if running and (rng.random() < 0.4 or len(running) > 3):
                m.free(running.pop(rng.randrange(len(running))))
            else:
                tail = [rng.randrange(10**6) for _ in range(rng.randrange(8, 90))]
                req = make_request(f"s{step}-{len(running)}", rng.choice(prefixes) + tail)
                blocks, hit, _ = m.get_computed_blocks(req)
                if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                    running.append(req)
        batches.append(m.take_events())
    return batches


def _keys(batches: list[list[Any]]) -> Counter[tuple[str, Any, int]]:
    out: Counter[tuple[str, Any, int]] = Counter()
    for batch in batches:
        for e in batch:
            kind = {BlockStored: "stored", BlockRemoved: "removed"}.get(type(e), "other")
            for h in getattr(e, "block_hashes", [None]):
                out[(kind, h, e.group_idx if kind != "other" else -1)] += 1
    return out


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_compact_stream_has_fewer_events_and_the_same_keys(layout: str) -> None:
    exact = _drive(_manager(layout, "vllm"), seed=5)
    compact = _drive(_manager(layout, "compact"), seed=5)
    n_exact = sum(map(len, exact))
    n_compact = sum(map(len, compact))
    assert n_compact < n_exact, (n_compact, n_exact)
    removals = [e for b in exact for e in b if isinstance(e, BlockRemoved)]
    assert len(removals) > 50, "the trace must evict"
    assert all(len(e.block_hashes) == 1 for e in removals)
    assert _keys(compact) == _keys(exact)
    for i, (a, b) in enumerate(zip(exact, compact, strict=True)):
        assert coalesce_kv_events(a) == b, f"step {i}"


def test_default_mode_is_vllms_stream() -> None:
    m = _manager("full", "vllm")
    assert m.kv_events_mode == "vllm"
    for batch in _drive(m, seed=3, steps=80):
        for e in batch:
            if isinstance(e, BlockRemoved):
                assert len(e.block_hashes) == 1


def _two_chunks(m: Any, req: Any, first: int) -> None:
    """A chunked prefill of ``req`` in two calls of one batch."""
    assert m.allocate_slots(req, first) is not None
    req.num_computed_tokens = first
    assert m.allocate_slots(req, req.num_tokens - first) is not None


def test_a_store_that_continues_its_chain_merges() -> None:
    exact, compact = _manager("full", "vllm"), _manager("full", "compact")
    prompt = list(range(1000, 1000 + 16 * 5 + 3))
    for m in (exact, compact):
        _two_chunks(m, make_request("r", prompt), 32)
    a, b = exact.take_events(), compact.take_events()
    assert [len(e.block_hashes) for e in a] == [2, 3]
    assert all(isinstance(e, BlockStored) for e in a)
    (e,) = b
    assert e.block_hashes == a[0].block_hashes + a[1].block_hashes
    assert a[1].parent_block_hash == a[0].block_hashes[-1]
    assert e.parent_block_hash is None
    assert e.token_ids == prompt[: 16 * 5]
    assert e.extra_keys == [None] * 5
    assert e.block_size == 16 and e.group_idx == 0 and e.medium == MEDIUM_GPU
    assert e.kv_cache_spec_kind == "full_attention"
    # Still vLLM's struct: it encodes and decodes as one.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(e), type=BlockStored) == e


@pytest.mark.skipif(not require().hash_lookahead, reason="vLLM 0.32 has no lookahead hashing")
def test_a_merged_store_concatenates_lookahead_token_ids() -> None:
    la = 4
    exact = _manager("full", "vllm", num_hash_lookahead_tokens=la)
    compact = _manager("full", "compact", num_hash_lookahead_tokens=la)
    prompt = list(range(500, 500 + 16 * 4 + la + 1))
    for m in (exact, compact):
        _two_chunks(m, make_request("r", prompt, num_hash_lookahead_tokens=la), 32)
    a, (b,) = exact.take_events(), compact.take_events()
    assert len(a) == 2
    assert b.lookahead_token_ids == a[0].lookahead_token_ids + a[1].lookahead_token_ids
    assert b.token_ids == a[0].token_ids + a[1].token_ids
    assert b.block_hashes == a[0].block_hashes + a[1].block_hashes
    assert b.parent_block_hash == a[0].parent_block_hash


@pytest.mark.parametrize("second_session", ["s1", "s2"])
def test_another_requests_continuation_merges_only_with_equal_fields(
    second_session: str,
) -> None:
    """R2 extends R1's cached prefix in the same batch: its store's parent is R1's last
    hash; the two merge only if every other field (here the session) is equal."""
    m = _manager("full", "compact")
    prefix = list(range(2000, 2000 + 32))
    r1 = make_request("r1", [*prefix, 7], session_id="s1")
    blocks, hit, _ = m.get_computed_blocks(r1)
    assert m.allocate_slots(r1, r1.num_tokens - hit, hit, blocks) is not None
    r2 = make_request("r2", prefix + list(range(9000, 9000 + 33)), session_id=second_session)
    blocks, hit, _ = m.get_computed_blocks(r2)
    assert hit == 32
    assert m.allocate_slots(r2, r2.num_tokens - hit, hit, blocks) is not None
    stores = m.take_events()
    if second_session == "s1":
        (e,) = stores
        assert len(e.block_hashes) == 4 and e.session_id == "s1"
        assert e.token_ids == (prefix + list(range(9000, 9000 + 33)))[:64]
    else:
        assert [(len(e.block_hashes), e.session_id) for e in stores] == [(2, "s1"), (2, "s2")]
        assert stores[1].parent_block_hash == stores[0].block_hashes[-1]


def _removed(hashes: list[int], group: int = 0, medium: str = MEDIUM_GPU) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def _stored(hashes: list[int], parent: int | None, session: str | None = None) -> BlockStored:
    n = len(hashes)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[h * 10 + i for h in hashes for i in range(2)],
        block_size=2,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=[None] * n,
        group_idx=0,
        session_id=session,
    )


def test_coalesce_merges_runs_and_keeps_everything_else_in_order() -> None:
    batch = [
        _removed([1]),
        _removed([2]),
        _removed([3], group=1),
        _removed([4], medium=MEDIUM_CPU),
        _stored([10, 11], None),
        _stored([12], 11),
        _removed([5]),
        AllBlocksCleared(),
        _removed([6]),
        _removed([7]),
        _stored([13], 12),  # continues the chain, but after a barrier and removals
        _stored([14], 13, session="other"),
    ]
    before = msgspec.msgpack.encode(batch)
    out = coalesce_kv_events(batch)
    assert msgspec.msgpack.encode(batch) == before, "the input must be left unchanged"
    assert out == [
        _removed([1, 2]),
        _removed([3], group=1),
        _removed([4], medium=MEDIUM_CPU),
        BlockStored(
            block_hashes=[10, 11, 12],
            parent_block_hash=None,
            token_ids=[100, 101, 110, 111, 120, 121],
            block_size=2,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
            extra_keys=[None, None, None],
            group_idx=0,
        ),
        _removed([5]),
        AllBlocksCleared(),
        _removed([6, 7]),
        _stored([13], 12),
        _stored([14], 13, session="other"),
    ]
    assert coalesce_kv_events([]) == []


def test_coalesce_leaves_stores_with_left_out_blocks_alone() -> None:
    """A store whose token ids are not ``block_size`` per hash (vLLM leaves masked blocks
    out of the hashes, not of the tokens) is never merged."""
    masked = _stored([20, 21], None)
    masked.token_ids = [*masked.token_ids, 0, 0]
    after = _stored([22], 21)
    assert coalesce_kv_events([masked, after]) == [masked, after]
    assert coalesce_kv_events([_stored([20], None), masked]) == [_stored([20], None), masked]


def test_mode_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HSCACHE_KV_EVENTS", raising=False)
    kwargs = manager_kwargs(full_attention_config(16), enable_kv_cache_events=True)
    assert KVCacheManager(**kwargs).kv_events_mode == "vllm"
    monkeypatch.setenv("HSCACHE_KV_EVENTS", "compact")
    m = KVCacheManager(**kwargs)
    assert m.kv_events_mode == "compact"
    monkeypatch.setenv("HSCACHE_KV_EVENTS", "vllm")  # read once, when it was built
    assert m.kv_events_mode == "compact"
    assert KVCacheManager(**kwargs, kv_events_mode="compact").kv_events_mode == "compact"
    monkeypatch.setenv("HSCACHE_KV_EVENTS", "compact")
    assert KVCacheManager(**kwargs, kv_events_mode="vllm").kv_events_mode == "vllm"
    with pytest.raises(InvalidArgumentError, match="vllm, compact"):
        KVCacheManager(**kwargs, kv_events_mode="fast")
    monkeypatch.setenv("HSCACHE_KV_EVENTS", "bogus")
    with pytest.raises(InvalidArgumentError, match="bogus"):
        KVCacheManager(**kwargs)
    with pytest.raises(InvalidArgumentError):
        m.core_set_kv_events_mode("bogus")
    assert m.kv_events_mode == "compact"


def test_parity_mode_keeps_vllms_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``HSCACHE_PARITY=1`` a compact request is ignored: the parity manager hands
    out, batch for batch, exactly the events vLLM's own manager publishes on the same
    trace, where the same request without parity would have merged some."""
    from hscache.vllm.parity import ParityKVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    kwargs = manager_kwargs(full_attention_config(40), enable_kv_cache_events=True)
    compact = _drive(KVCacheManager(**kwargs, kv_events_mode="compact"), seed=5, steps=60)
    theirs = _drive(VllmKVCacheManager(**kwargs), seed=5, steps=60)
    monkeypatch.setenv("HSCACHE_PARITY", "1")
    m = KVCacheManager(**kwargs, kv_events_mode="compact")
    assert isinstance(m, ParityKVCacheManager)
    ours = _drive(m, seed=5, steps=60)
    assert sum(map(len, compact)) < sum(map(len, theirs)), "the trace must merge some events"
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        encode = msgspec.msgpack.encode
        assert [encode(e) for e in a] == [encode(e) for e in b], f"step {i}"


def test_taken_events_are_never_extended() -> None:
    """A store that would continue an event of an earlier batch starts a new event: what
    ``take_events`` returned is the consumer's, and stays as it was."""
    m = _manager("full", "compact")
    req = make_request("r", list(range(3000, 3000 + 16 * 4 + 1)))
    assert m.allocate_slots(req, 32) is not None
    (first,) = m.take_events()
    encoded = msgspec.msgpack.encode(first)
    req.num_computed_tokens = 32
    assert m.allocate_slots(req, req.num_tokens - 32) is not None
    (second,) = m.take_events()
    assert msgspec.msgpack.encode(first) == encoded
    assert len(first.block_hashes) == 2 and len(second.block_hashes) == 2
    assert second.parent_block_hash == first.block_hashes[-1]
