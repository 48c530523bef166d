"""``vllm.v1.request.Request`` factories and the block hashers that feed them.

:func:`make_request` builds a request the way vLLM's ``InputProcessor`` hands one to the
Scheduler: prompt token ids (or prompt embeddings), sampling parameters (``max_tokens``,
prompt logprobs, the KV-cache report mode), multimodal features, a LoRA adapter, a cache
salt, and the block hasher that fills ``request.block_hashes`` (vLLM's by default, for a hash
algorithm, a hash block size and a hash lookahead). :func:`init_none_hash` seeds vLLM's
global ``NONE_HASH`` for an algorithm, as ``EngineCore`` does once at start-up: call it
before building requests whose hashes are compared.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

__all__ = [
    "BlockHasher",
    "init_none_hash",
    "lora",
    "make_request",
    "mm_feature",
    "request_block_hasher",
]

_HAS_HASH_LOOKAHEAD = (
    "num_hash_lookahead_tokens"
    in inspect.signature(kv_cache_utils.get_request_block_hasher).parameters
)

BlockHasher = Callable[[Request], list[Any]]
"""What ``Request(block_hasher=...)`` takes: the request's new block hashes."""


def init_none_hash(hash_algo: str = "sha256") -> None:
    """Seed vLLM's ``NONE_HASH`` (the parent of every first block) for ``hash_algo``, one of
    vLLM's ``--prefix-caching-hash-algo`` names."""
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(hash_algo))


@functools.cache
def request_block_hasher(
    hash_block_size: int = 16, hash_algo: str = "sha256", num_hash_lookahead_tokens: int = 0
) -> BlockHasher:
    """vLLM's own block hasher (``get_request_block_hasher``), one per argument set."""
    hash_fn = get_hash_fn_by_name(hash_algo)
    if not _HAS_HASH_LOOKAHEAD:  # vLLM 0.32: the factory takes two arguments
        if num_hash_lookahead_tokens:
            raise ValueError("this vLLM has no lookahead hashing: num_hash_lookahead_tokens=0")
        return kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn)
    return kv_cache_utils.get_request_block_hasher(
        hash_block_size, hash_fn, num_hash_lookahead_tokens
    )


def mm_feature(
    identifier: str, offset: int, length: int, modality: str = "image"
) -> MultiModalFeatureSpec:
    """A multimodal item (no data: only its hash and placeholder range matter here)
    covering prompt positions ``[offset, offset + length)``."""
    return MultiModalFeatureSpec(
        data=None,
        modality=modality,
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
        mm_hash=identifier,
    )


def lora(name: str, int_id: int, path: str) -> LoRARequest:
    """A LoRA adapter (its name and path key the block hashes)."""
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int] | None,
    *,
    max_tokens: int = 16,
    hash_block_size: int = 16,
    hash_algo: str = "sha256",
    num_hash_lookahead_tokens: int = 0,
    block_hasher: BlockHasher | None = None,
    mm_features: Sequence[MultiModalFeatureSpec] = (),
    lora_request: LoRARequest | None = None,
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
    kv_cache_report_full: bool = False,
    prompt_embeds: torch.Tensor | None = None,
    arrival_time: float | None = None,
    resumable: bool = False,
    session_id: str | None = None,
    **sampling: Any,
) -> Request:
    """A ``Request`` whose hashes come from ``block_hasher`` (default: vLLM's hasher for
    ``hash_block_size`` / ``hash_algo`` / ``num_hash_lookahead_tokens``).

    ``prompt_token_ids`` may be None with ``prompt_embeds`` (embedding inputs);
    ``prompt_logprobs`` makes the request skip prefix-cache reads, as in vLLM;
    ``kv_cache_report_full`` sets the ``kv_cache_report_mode`` extra argument; further
    keywords go to ``SamplingParams`` (``ignore_eos=True``, ...). ``arrival_time`` None is
    vLLM's default (now)."""
    sampling["max_tokens"] = max_tokens
    if prompt_logprobs is not None:
        sampling["prompt_logprobs"] = prompt_logprobs
    if kv_cache_report_full:
        sampling["extra_args"] = {"kv_cache_report_mode": "full"}
    if block_hasher is None:
        block_hasher = request_block_hasher(hash_block_size, hash_algo, num_hash_lookahead_tokens)
    return Request(
        request_id=request_id,
        prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
        sampling_params=SamplingParams(**sampling),
        pooling_params=None,
        arrival_time=arrival_time,
        prompt_embeds=prompt_embeds,
        mm_features=list(mm_features) or None,
        lora_request=lora_request,
        cache_salt=cache_salt,
        block_hasher=block_hasher,
        resumable=resumable,
        session_id=session_id,
    )
