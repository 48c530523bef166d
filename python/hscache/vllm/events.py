"""Turns the core's compact event records into vLLM's KV-cache event structs.

The core records ``("stored", group, start_block, end_block, block_size)``,
``("removed", hash, group)`` and ``("cleared",)`` in pool-operation order. A stored
record is converted with the request of the call that produced it, when the pool's
event queue is next read (``hscache.vllm.block_pool``): it reads only what a request
never changes once those blocks are cached (their token ids and hashes, LoRA,
multimodal features, salt, session id), so the event equals the one vLLM builds inside
the call.

The per-block fields of a ``BlockStored`` (converted hashes, token ids, extra keys in
the untagged shape of vLLM's ``to_event_extra_keys``, lookahead token ids) are built by
the core (``hscache._core.block_stored_fields``, ``src/python/events.rs``) with its
port of vLLM's extra-key functions; this module owns the event structs and the
fallback: a request the core cannot convert exactly raises ``UnsupportedError`` and
that event is built by :func:`_block_stored_py`, the same conversion with vLLM's own
helpers end to end, kept whole on purpose: it is also the reference of the
differential tests (``tests/test_events.py``).
"""

from __future__ import annotations

from typing import Any

from vllm import envs
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from hscache._core import block_stored_fields
from hscache.exceptions import UnsupportedError


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
    """The ``BlockStored`` event of blocks ``start_block..end_block`` of ``request``.

    ``int_block_hashes``: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, read now if None.
    """
    if int_block_hashes is None:
        int_block_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    try:
        (
            block_hashes,
            parent_block_hash,
            token_ids,
            lora_id,
            lora_name,
            extra_keys,
            session_id,
            lookahead_token_ids,
        ) = block_stored_fields(
            request,
            start_block,
            end_block,
            block_size,
            num_hash_lookahead_tokens,
            int_block_hashes,
        )
    except UnsupportedError:
        return _block_stored_py(
            request,
            start_block,
            end_block,
            block_size,
            group_idx,
            num_hash_lookahead_tokens,
            medium,
        )
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
        group_idx=group_idx,
        session_id=session_id,
        lookahead_token_ids=lookahead_token_ids,
    )


def _block_stored_py(
    request: Any,
    start_block: int,
    end_block: int,
    block_size: int,
    group_idx: int,
    num_hash_lookahead_tokens: int,
    medium: str = MEDIUM_GPU,
) -> BlockStored:
    """:func:`block_stored` with vLLM's own helpers, one call per block (the fallback)."""
    hashes = request.block_hashes
    all_token_ids = request.all_token_ids
    extra_keys_list: list[tuple[Any, ...] | None] = []
    lookahead_token_ids: list[list[int]] | None = [] if num_hash_lookahead_tokens else None
    mm_idx = 0
    for i in range(start_block, end_block):
        start = i * block_size
        end = start + block_size
        if num_hash_lookahead_tokens:
            keys, mm_idx = generate_lookahead_block_hash_extra_keys(
                request, start, end, end + num_hash_lookahead_tokens, mm_idx
            )
        else:
            keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
        extra_keys_list.append(keys)
        if lookahead_token_ids is not None:
            lookahead_token_ids.append(all_token_ids[end : end + num_hash_lookahead_tokens])
    lora = request.lora_request
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes[start_block:end_block]],
        parent_block_hash=(
            maybe_convert_block_hash(hashes[start_block - 1]) if start_block > 0 else None
        ),
        token_ids=all_token_ids[start_block * block_size : end_block * block_size],
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        medium=medium,
        lora_name=lora.name if lora else None,
        extra_keys=to_event_extra_keys(extra_keys_list),
        group_idx=group_idx,
        session_id=request.session_id,
        lookahead_token_ids=lookahead_token_ids,
    )


def convert(
    records: list[Any],
    request: Any | None,
    num_hash_lookahead_tokens: int,
    medium: str = MEDIUM_GPU,
    int_block_hashes: bool | None = None,
) -> list[KVCacheEvent]:
    """vLLM events of the core's records; ``request`` is the call's request."""
    out: list[KVCacheEvent] = []
    if int_block_hashes is None:
        int_block_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    for rec in records:
        kind = rec[0]
        if kind == "removed":
            out.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(rec[1])],
                    medium=medium,
                    group_idx=rec[2],
                )
            )
        elif kind == "stored":
            if request is None:
                raise RuntimeError("a BlockStored record needs the request of its call")
            _, group, start, end, block_size = rec
            out.append(
                block_stored(
                    request,
                    start,
                    end,
                    block_size,
                    group,
                    num_hash_lookahead_tokens,
                    medium,
                    int_block_hashes,
                )
            )
        else:
            out.append(AllBlocksCleared())
    return out
