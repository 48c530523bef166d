"""Small factories for tests: requests with vLLM's own hasher and one-group configs."""

from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

init_none_hash(sha256)


def make_request(
    request_id: str, token_ids: list[int], block_size: int = 16, **sampling: Any
) -> Request:
    sampling.setdefault("max_tokens", 16)
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(**sampling),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def full_attention_config(num_blocks: int, block_size: int = 16) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def hybrid_config(num_blocks: int, block_size: int = 16) -> KVCacheConfig:
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    swa = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=4 * block_size,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["swa"], swa)],
    )


def manager_kwargs(num_blocks: int, block_size: int = 16, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kv_cache_config": full_attention_config(num_blocks, block_size),
        "max_model_len": 8192,
        "scheduler_block_size": block_size,
        "hash_block_size": block_size,
        "enable_caching": True,
        "log_stats": True,
        "enable_kv_cache_events": True,
    }
    out.update(kw)
    return out
