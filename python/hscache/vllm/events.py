"""Turns the core's compact event records into vLLM's KV-cache event structs.

The core records ``("stored", group, start_block, end_block, block_size)``,
``("removed", hash, group)`` and ``("cleared",)`` in pool-operation order. A stored
record is converted right after the call that produced it, with the request of that
call, so that token ids, LoRA, extra keys and session id are read exactly when vLLM
reads them. Extra keys come from vLLM's own helpers, so the event shape is vLLM's.
"""

from __future__ import annotations

from typing import Any

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


def block_stored(
    request: Any,
    start_block: int,
    end_block: int,
    block_size: int,
    group_idx: int,
    num_hash_lookahead_tokens: int,
    medium: str = MEDIUM_GPU,
) -> BlockStored:
    """The ``BlockStored`` event of blocks ``start_block..end_block`` of ``request``."""
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
) -> list[KVCacheEvent]:
    """vLLM events of the core's records; ``request`` is the call's request."""
    out: list[KVCacheEvent] = []
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
                    request, start, end, block_size, group, num_hash_lookahead_tokens, medium
                )
            )
        else:
            out.append(AllBlocksCleared())
    return out
