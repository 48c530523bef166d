"""``BlockStored`` events built by the core against the pure-Python conversion.

``hscache.vllm.events.block_stored`` (the core's ``EventBuilder``) takes its per-block
fields from ``hscache._core.block_stored_fields``; ``events._block_stored_py`` is the conversion
with vLLM's own helpers (``generate_block_hash_extra_keys``, its lookahead variant,
``maybe_convert_block_hash``, ``to_event_extra_keys``), i.e. what vLLM's
``BlockPool.cache_full_blocks`` emits. On thousands of random requests (LoRA,
multimodal items with negative and overlapping offsets, cache salts, prompt
embeddings, lookahead, session ids) and random block ranges, with integer hashes on
and off, both give equal events (equal values, equal msgpack bytes, the same hash
objects), the same memoized prompt-embedding digests, and the core never falls back.
Requests the core cannot convert exactly fall back and still give vLLM's event.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import msgspec
import pytest
import torch
import vllm.v1.core.kv_cache_utils as kcu
from hscache import _core
from hscache.exceptions import UnsupportedError
from hscache.vllm import events
from vllm import envs
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils import hashing
from vllm.v1.request import Request

from tests.hashing.test_block_hasher import make_request, random_request_args

pytestmark = pytest.mark.vllm

INT_FLAG = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def set_int_hashes(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """vLLM's flag as both paths read it (a module attribute shadows ``envs.__getattr__``)."""
    monkeypatch.setattr(envs, INT_FLAG, on, raising=False)
    assert envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is on


def encode(ev: Any) -> bytes:
    return msgspec.msgpack.encode(ev)


def assert_same_event(ours: Any, ref: Any) -> None:
    assert type(ours) is type(ref)
    assert ours == ref
    assert encode(ours) == encode(ref)
    for field in ours.__struct_fields__:
        a, b = getattr(ours, field), getattr(ref, field)
        assert type(a) is type(b), field
    if ours.extra_keys is not None:
        for a, b in zip(ours.extra_keys, ref.extra_keys, strict=True):
            assert type(a) is type(b)
            if a is not None:
                assert [type(x) for x in a] == [type(x) for x in b]


def assert_hash_objects(ev: Any, request: Any, start: int) -> None:
    hashes = request.block_hashes
    assert all(h is hashes[start + i] for i, h in enumerate(ev.block_hashes))
    if start > 0:
        assert ev.parent_block_hash is hashes[start - 1]


def native(request: Any, start: int, end: int, bs: int, la: int, group: int = 0) -> Any:
    """``events.block_stored`` with its fallback turned into a failure."""
    try:
        _core.block_stored_fields(
            request, start, end, bs, la, envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        )
    except UnsupportedError as e:
        raise AssertionError(f"the core fell back: {e}") from e
    return events.block_stored(request, start, end, bs, group, la)


def random_pair(rng: random.Random) -> tuple[Request, Request, int, int]:
    """Two equal requests (ours, the reference's) with hashes of ``hbs``-token blocks."""
    hbs = rng.choice([1, 2, 3, 4, 5, 8, 16, 17])
    la = rng.choice([0, 0, 1, 2])
    args = random_request_args(rng, max_prompt=rng.choice([8, 40, 120]))
    args["session_id"] = rng.choice([None, None, "sess-1", f"s-{rng.randrange(99)}"])
    pair = []
    for _ in range(2):
        r = make_request(dict(args), kcu.get_request_block_hasher(hbs, hashing.sha256, la))
        pair.append(r)
    for _ in range(rng.randrange(0, 3)):
        out = [rng.randrange(2**31) for _ in range(rng.choice([1, hbs, 3 * hbs + 1]))]
        for r in pair:
            r.append_output_token_ids(list(out))
    return pair[0], pair[1], hbs, la


def random_range(rng: random.Random, num_hashes: int) -> tuple[int, int]:
    start = rng.randrange(0, num_hashes + 1)
    end = rng.randrange(start, num_hashes + 1)
    if rng.random() < 0.05:
        end = start + rng.randrange(0, 4)  # past the hashes: slices come back short
    return start, end


@pytest.mark.parametrize("int_hashes", [True, False])
def test_events_match_vllms_helpers_on_random_requests(
    monkeypatch: pytest.MonkeyPatch, int_hashes: bool
) -> None:
    set_int_hashes(monkeypatch, int_hashes)
    rng = random.Random(f"events-{int_hashes}")
    seen = {"lora": 0, "mm": 0, "neg_mm": 0, "salt": 0, "embeds": 0, "lookahead": 0}
    blocks = 0
    for _ in range(2000):
        ours, ref, hbs, la = random_pair(rng)
        n = len(ref.block_hashes)
        for _ in range(rng.randrange(1, 5)):
            # Mostly the hashing block size; sometimes another one, so that the
            # prompt-embedding digests are not memoized yet and the core computes them.
            bs = hbs if rng.random() < 0.8 else rng.choice([1, 2, 3, 2 * hbs])
            start, end = random_range(rng, n)
            group = rng.randrange(3)
            ev = native(ours, start, end, bs, la, group)
            want = events._block_stored_py(ref, start, end, bs, group, la)
            assert_same_event(ev, want)
            if not int_hashes:  # vLLM publishes the hash objects themselves
                assert_hash_objects(ev, ours, start)
            assert ours._prompt_embeds_per_block_hashes == ref._prompt_embeds_per_block_hashes
            blocks += end - start
            keys = [k for k in want.extra_keys or [] if k is not None]
            flat = [x for k in keys for x in k]
            seen["lora"] += want.lora_name is not None and bool(keys)
            seen["mm"] += any(type(x) is tuple for x in flat)
            seen["neg_mm"] += any(type(x) is tuple and x[1] < 0 for x in flat)
            seen["salt"] += bool(ref.cache_salt) and start == 0 and end > 0
            seen["embeds"] += ref.prompt_embeds is not None and end > start
            seen["lookahead"] += want.lookahead_token_ids is not None and end > start
    assert blocks > 10_000
    assert min(seen.values()) >= 100, seen


def test_plain_request_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    set_int_hashes(monkeypatch, True)
    rng = random.Random(1)
    args = {"prompt_token_ids": [rng.randrange(32000) for _ in range(1030)]}
    r = make_request(
        {"mm_features": None, "lora_request": None, "cache_salt": None, **args},
        kcu.get_request_block_hasher(16, hashing.sha256),
    )
    assert len(r.block_hashes) == 64
    for start, end in [(0, 64), (3, 10), (64, 64), (0, 0), (5, 4)]:
        ev = native(r, start, end, 16, 0)
        assert_same_event(ev, events._block_stored_py(r, start, end, 16, 0, 0))
    ev = native(r, 0, 64, 16, 0)
    assert ev.extra_keys == [None] * 64
    assert ev.block_hashes == [int.from_bytes(h, "big") & (2**64 - 1) for h in r.block_hashes]


def feature(offset: int, length: int, identifier: Any) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def same_outcome(call: Any, reference: Any) -> Any:
    """``call()`` gives ``reference()``'s event (returned), or raises the same exception type."""
    try:
        want = reference()
    except Exception as e:  # whatever vLLM's helpers raise
        with pytest.raises(type(e)):
            call()
        return None
    ev = call()
    assert_same_event(ev, want)
    return ev


def _none_identifier(r: Request) -> None:  # an item vLLM never scans: no assertion
    r.mm_features = [feature(2, 3, "a"), feature(30, 2, None)]


def _negative_offset(r: Request) -> None:
    r.mm_features = [feature(-3, 6, "a")]


def _bool_offset(r: Request) -> None:
    r.mm_features = [feature(True, 6, "a")]  # type: ignore[arg-type]


def _bytearray_hashes(r: Request) -> None:
    r.block_hashes[:] = [bytearray(h) for h in r.block_hashes]


def _memoryview_hashes(r: Request) -> None:
    r.block_hashes[:] = [memoryview(h[:5]) for h in r.block_hashes]


def _short_hashes(r: Request) -> None:  # bytes, fewer than 8 of them: native
    r.block_hashes[:] = [h[: i % 9] for i, h in enumerate(r.block_hashes)]


def _tuple_token_ids(r: Request) -> None:
    r.all_token_ids = tuple(r._all_token_ids)  # type: ignore[assignment]


def _embeds(r: Request) -> None:
    r.prompt_embeds = torch.randn(len(r._all_token_ids), 2)


def _str_digests(r: Request) -> None:
    _embeds(r)
    for s in range(0, len(r._all_token_ids), 4):
        r._prompt_embeds_per_block_hashes[(s, s + 4)] = f"digest-{s}"  # type: ignore[assignment]


def _memo_not_a_dict(r: Request) -> None:
    _embeds(r)
    r._prompt_embeds_per_block_hashes = collections.OrderedDict()  # type: ignore[assignment]


def _no_memo(r: Request) -> None:
    _embeds(r)
    del r._prompt_embeds_per_block_hashes


# name -> (mutation, converted natively with int hashes, without)
CASES: dict[str, tuple[Any, bool, bool]] = {
    "none_identifier": (_none_identifier, False, False),
    "negative_offset": (_negative_offset, False, False),
    "bool_offset": (_bool_offset, True, True),
    "bytearray_hashes": (_bytearray_hashes, False, True),
    "memoryview_hashes": (_memoryview_hashes, False, True),
    "short_hashes": (_short_hashes, True, True),
    "tuple_token_ids": (_tuple_token_ids, False, False),
    "embeds_not_memoized": (_embeds, True, True),
    "str_digests": (_str_digests, False, False),
    "memo_not_a_dict": (_memo_not_a_dict, False, False),
    "no_memo": (_no_memo, False, False),
}


@pytest.mark.parametrize("int_hashes", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_unusual_requests_convert_exactly_or_fall_back(
    monkeypatch: pytest.MonkeyPatch, int_hashes: bool, name: str
) -> None:
    set_int_hashes(monkeypatch, int_hashes)
    mutate, native_int, native_bytes = CASES[name]
    base = {
        "prompt_token_ids": list(range(100, 124)),
        "mm_features": None,
        "lora_request": LoRARequest("l", 1, "/l"),
        "cache_salt": "salt",
    }
    ours, ref = (
        make_request(dict(base), kcu.get_request_block_hasher(4, hashing.sha256)) for _ in "ab"
    )
    torch.manual_seed(0)
    mutate(ours)
    torch.manual_seed(0)
    mutate(ref)
    for start, end in [(0, 6), (2, 5), (0, 3), (1, 1)]:
        try:
            _core.block_stored_fields(ours, start, end, 4, 0, int_hashes)
            native_ok = True
        except UnsupportedError:
            native_ok = False
        expected = native_int if int_hashes else native_bytes
        if name == "str_digests" and start == end:
            expected = True  # no block, no digest read
        assert native_ok == expected, (start, end)
        ev = same_outcome(
            lambda: events.block_stored(ours, start, end, 4, 0, 0),  # noqa: B023
            lambda: events._block_stored_py(ref, start, end, 4, 0, 0),  # noqa: B023
        )
        if ev is not None and not int_hashes:
            assert_hash_objects(ev, ours, start)
        memo = "_prompt_embeds_per_block_hashes"
        assert getattr(ours, memo, None) == getattr(ref, memo, None)


@pytest.mark.parametrize(
    "args",
    [(-1, 2, 4, 0), (2**70, 2**70, 4, 0), (0, 2, -4, 0), (0, 2, 4, -1), (1.0, 2, 4, 0)],
)
def test_odd_arguments_fall_back_to_pythons_answer(args: tuple[Any, ...]) -> None:
    r = make_request(
        {"prompt_token_ids": list(range(16)), "mm_features": None, "lora_request": None},
        kcu.get_request_block_hasher(4, hashing.sha256),
    )
    with pytest.raises(UnsupportedError):
        _core.block_stored_fields(r, *args, True)
    start, end, bs, la = args
    same_outcome(
        lambda: events.block_stored(r, start, end, bs, 0, la),
        lambda: events._block_stored_py(r, start, end, bs, 0, la),
    )


def test_scanned_item_without_identifier_raises_vllms_assertion() -> None:
    r = make_request(
        {"prompt_token_ids": list(range(16)), "mm_features": None, "lora_request": None},
        kcu.get_request_block_hasher(4, hashing.sha256),
    )
    r.mm_features = [feature(1, 2, None)]
    # vLLM's own helper asserts on the item; hscache's conversion raises the same.
    with pytest.raises(AssertionError):
        kcu.generate_block_hash_extra_keys(r, 0, 4, 0)
    with pytest.raises(AssertionError):
        events.block_stored(r, 0, 2, 4, 0, 0)


def test_parent_out_of_range_raises_like_python() -> None:
    r = make_request(
        {"prompt_token_ids": list(range(16)), "mm_features": None, "lora_request": None},
        kcu.get_request_block_hasher(4, hashing.sha256),
    )
    for fn in (events.block_stored, events._block_stored_py):
        with pytest.raises(IndexError):
            fn(r, 6, 7, 4, 0, 0)


def test_a_huge_range_is_refused_without_allocating() -> None:
    """The core never records one; a caller-made range far past the hashes must not make
    the extension size lists by it (it raises instead, and nothing is built)."""
    r = make_request(
        {"prompt_token_ids": list(range(16)), "mm_features": None, "lora_request": None},
        kcu.get_request_block_hasher(4, hashing.sha256),
    )
    with pytest.raises(UnsupportedError, match="far past"):
        _core.block_stored_fields(r, 0, 2**40, 4, 0, False)


class _ReorderedStored(msgspec.Struct, kw_only=True):
    """A ``BlockStored`` look-alike whose fields are not in vLLM's order."""

    group_idx: int | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


def test_builder_uses_keywords_for_a_struct_in_another_field_order() -> None:
    """Positional construction only for vLLM 0.33's exact field order; any other
    class gets keywords, so every field still lands where it belongs."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    r = make_request(
        {"prompt_token_ids": list(range(40)), "mm_features": None, "lora_request": None},
        kcu.get_request_block_hasher(4, hashing.sha256),
    )
    ints = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    vllm_order = events.make_event_builder(0)
    reordered = _core.EventBuilder(
        _ReorderedStored, BlockRemoved, AllBlocksCleared, "GPU", 0, ints, events._block_stored_py
    )
    want = vllm_order.block_stored(r, 2, 5, 4, 0)
    assert type(want).__name__ == "BlockStored"
    assert_same_event(want, events._block_stored_py(r, 2, 5, 4, 0, 0))
    got = reordered.block_stored(r, 2, 5, 4, 0)
    assert isinstance(got, _ReorderedStored)
    for field in _ReorderedStored.__struct_fields__:
        assert getattr(got, field) == getattr(want, field), field
