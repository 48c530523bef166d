"""vLLM's KV-cache event structs for the core's event records.

The core records ``BlockStored`` (a block range of the recording call's request),
``BlockRemoved`` and ``AllBlocksCleared``. The core builds vLLM's structs itself, inside
the call that recorded them, as vLLM's ``BlockPool`` does: ``hscache._core.EventBuilder``
(``src/python/events.rs``) holds one pool's event configuration and computes the
per-block fields of a ``BlockStored`` (converted hashes, token ids, extra keys in the
untagged shape of vLLM's ``to_event_extra_keys``, lookahead token ids) with the core's
port of vLLM's extra-key functions.

This module makes the builder (:func:`make_event_builder`) and owns the fallback: a
request the core cannot convert exactly is built by :func:`_block_stored_py`, the same
conversion with vLLM's own helpers end to end, kept whole on purpose: it is also the
reference of the differential tests (``tests/events/test_events.py``).

vLLM 0.32 has no lookahead hashing: its ``BlockStored`` has no ``lookahead_token_ids``
field (14 fields, not 15) and its ``kv_cache_utils`` no lookahead extra-key helper. The
builder passes only the fields the installed class declares; the fallback asks the
version profile (``hscache.vllm.version``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm import envs
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.v1.core import kv_cache_utils as _kcu
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
)

from hscache._core import EventBuilder, normalize_kv_events_mode
from hscache.vllm.version import require

_PROFILE = require()


def _event_extra_keys(keys: list[tuple[Any, ...] | None]) -> list[Any] | None:
    """The ``extra_keys`` of a ``BlockStored``: vLLM's ``to_event_extra_keys`` (tagged
    keys made bare); vLLM 0.30's keys are bare already and go out as they are."""
    if _PROFILE.extra_keys_form == "untagged":
        return list(keys) or None
    out: list[Any] | None = _kcu.to_event_extra_keys(keys)
    return out


def _check_lookahead(num_hash_lookahead_tokens: int) -> None:
    if num_hash_lookahead_tokens and not _PROFILE.hash_lookahead:
        raise ValueError(
            f"num_hash_lookahead_tokens={num_hash_lookahead_tokens!r}: vLLM "
            f"{_PROFILE.version} has no lookahead block hashing (it must be 0)"
        )


def select_mode(kv_events_mode: str | None) -> str:
    """The KV-event stream a manager publishes: the ``kv_events_mode=`` keyword, else
    ``HSCACHE_KV_EVENTS`` (read when the manager is built), else ``"vllm"``: vLLM's
    events, event for event. ``"compact"`` coalesces consecutive events of one batch
    (``src/events/compact.rs``). Any other name is ``InvalidArgumentError``."""
    if kv_events_mode is None:
        kv_events_mode = os.environ.get("HSCACHE_KV_EVENTS", "vllm")
    return normalize_kv_events_mode(kv_events_mode)


def make_event_builder(
    num_hash_lookahead_tokens: int,
    medium: str = MEDIUM_GPU,
    int_block_hashes: bool | None = None,
) -> EventBuilder:
    """The event builder of one pool.

    ``int_block_hashes``: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, read now if None (a
    pool reads it once, when it is built).
    """
    _check_lookahead(num_hash_lookahead_tokens)
    if int_block_hashes is None:
        int_block_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    return EventBuilder(
        BlockStored,
        BlockRemoved,
        AllBlocksCleared,
        medium,
        num_hash_lookahead_tokens,
        int_block_hashes,
        _block_stored_py,
    )


def block_stored(
    request: Any,
    start_block: int,
    end_block: int,
    block_size: int,
    group_idx: int,
    num_hash_lookahead_tokens: int,
    medium: str = MEDIUM_GPU,
    int_block_hashes: bool | None = None,
) -> BlockStored:
    """The ``BlockStored`` event of blocks ``start_block..end_block`` of ``request``."""
    if not (isinstance(num_hash_lookahead_tokens, int) and num_hash_lookahead_tokens >= 0):
        # No pool has such a lookahead: vLLM's helpers give vLLM's answer.
        la = num_hash_lookahead_tokens
        return _block_stored_py(request, start_block, end_block, block_size, group_idx, la, medium)
    builder = make_event_builder(num_hash_lookahead_tokens, medium, int_block_hashes)
    event: BlockStored = builder.block_stored(
        request, start_block, end_block, block_size, group_idx
    )
    return event


def _block_stored_py(
    request: Any,
    start_block: int,
    end_block: int,
    block_size: int,
    group_idx: int,
    num_hash_lookahead_tokens: int,
    medium: str = MEDIUM_GPU,
    hash_scale: int = 1,
    skipped: Sequence[int] = (),
) -> BlockStored:
    """:func:`block_stored` with vLLM's own helpers, one call per block (the fallback).

    ``hash_scale``: hash blocks per block (block ``i``'s hash is the request's hash at
    ``(i + 1) * hash_scale - 1``); ``skipped``: blocks of the range that got no hash
    (null or masked out), left out of the hashes, extra keys and lookahead ids.
    """
    _check_lookahead(num_hash_lookahead_tokens)
    all_hashes = request.block_hashes
    all_token_ids = request.all_token_ids
    included = [i for i in range(start_block, end_block) if i not in set(skipped)]
    extra_keys_list: list[tuple[Any, ...] | None] = []
    lookahead_token_ids: list[list[int]] | None = [] if num_hash_lookahead_tokens else None
    mm_idx = 0
    for i in included:
        start = i * block_size
        end = start + block_size
        if num_hash_lookahead_tokens:
            from vllm.v1.core.kv_cache_utils import generate_lookahead_block_hash_extra_keys

            keys, mm_idx = generate_lookahead_block_hash_extra_keys(
                request, start, end, end + num_hash_lookahead_tokens, mm_idx
            )
        else:
            keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
        extra_keys_list.append(keys)
        if lookahead_token_ids is not None:
            lookahead_token_ids.append(all_token_ids[end : end + num_hash_lookahead_tokens])
    if hash_scale == 1 and not skipped:
        hashes = list(all_hashes[start_block:end_block])
    else:
        hashes = [all_hashes[(i + 1) * hash_scale - 1] for i in included]
    lora = request.lora_request
    lookahead: dict[str, Any] = (
        {"lookahead_token_ids": lookahead_token_ids} if _PROFILE.hash_lookahead else {}
    )
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes],
        parent_block_hash=(
            maybe_convert_block_hash(all_hashes[start_block * hash_scale - 1])
            if start_block > 0
            else None
        ),
        token_ids=all_token_ids[start_block * block_size : end_block * block_size],
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        medium=medium,
        lora_name=lora.name if lora else None,
        extra_keys=_event_extra_keys(extra_keys_list),
        group_idx=group_idx,
        session_id=request.session_id,
        **lookahead,
    )
