"""A real vLLM 0.33 ``Scheduler`` built offline on CPU, its stub model outputs and a summary.

vLLM's ``Scheduler`` reads the model's config for lengths and modality, never weights or a
tokenizer, so :func:`model_dir` writes a config-only stand-in (OPT-125m's architecture) and
:func:`make_scheduler` builds the ``VllmConfig`` around it the way vLLM's own scheduler tests
do, with any ``KVCacheConfig`` (one full-attention group by default). :func:`stub_runner_output`
is the model: scheduled requests sample tokens chosen by the caller.
:func:`summarize_output` reduces a ``SchedulerOutput`` to the decisions two schedulers must
agree on. Used by the scheduler-level benchmark, tests, ``examples/`` and the wheel smoke test.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from hscache_tools.testing.kv_cache import block_sizes, full_attention_config

__all__ = [
    "make_scheduler",
    "make_vllm_config",
    "model_dir",
    "stub_runner_output",
    "summarize_output",
]

# A config-only stand-in for a small decoder (OPT-125m's architecture).
_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "word_embed_proj_dim": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 16384,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
}


def model_dir() -> Path:
    """A directory holding only the stand-in ``config.json`` (one per process)."""
    d = Path(tempfile.gettempdir()) / f"hscache-bench-model-{os.getpid()}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return d


def make_vllm_config(
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 16384,
    async_scheduling: bool = False,
    long_prefill_token_threshold: int = 0,
    watermark: float | None = None,
    scheduler_reserve_full_isl: bool | None = None,
    enable_prefix_caching: bool = True,
    model_path: Path | None = None,
    cache: Mapping[str, Any] | None = None,
    kv_cache_events: bool | KVEventsConfig = False,
    speculative_config: SpeculativeConfig | None = None,
    kv_transfer_config: KVTransferConfig | None = None,
    lora_config: LoRAConfig | None = None,
) -> VllmConfig:
    """The engine configuration of an offline scheduler (see :func:`make_scheduler`).
    ``cache``: further ``CacheConfig`` fields (``mamba_cache_mode``, ``prefix_match_unit``,
    ``enable_mamba_shared_prefix_checkpoint``, ...); ``kv_cache_events``: KV events on
    (published nowhere), or the ``KVEventsConfig`` to use (a real publisher);
    ``speculative_config`` and ``kv_transfer_config`` as vLLM's own scheduler tests pass
    them (an ngram drafter, a KV connector); ``lora_config``: LoRA on (``max_loras``)."""
    model_config = ModelConfig(
        model=str(model_path or model_dir()),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    extra: dict[str, Any] = {} if watermark is None else {"watermark": watermark}
    if scheduler_reserve_full_isl is not None:
        extra["scheduler_reserve_full_isl"] = scheduler_reserve_full_isl
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        **extra,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    for name, value in (cache or {}).items():
        setattr(cache_config, name, value)
    events = (
        kv_cache_events
        if isinstance(kv_cache_events, KVEventsConfig)
        else KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if kv_cache_events
        else None
    )
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_events_config=events,
        speculative_config=speculative_config,
        kv_transfer_config=kv_transfer_config,
        lora_config=lora_config,
    )


def make_scheduler(
    cls: type,
    kv_cache: int | KVCacheConfig,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 16384,
    async_scheduling: bool = False,
    long_prefill_token_threshold: int = 0,
    watermark: float | None = None,
    scheduler_reserve_full_isl: bool | None = None,
    enable_prefix_caching: bool = True,
    model_path: Path | None = None,
    cache: Mapping[str, Any] | None = None,
    kv_cache_events: bool | KVEventsConfig = False,
    speculative_config: SpeculativeConfig | None = None,
    kv_transfer_config: KVTransferConfig | None = None,
    lora_config: LoRAConfig | None = None,
) -> Any:
    """A vLLM ``Scheduler`` (or subclass ``cls``) over ``kv_cache``: a ``KVCacheConfig``, or a
    block count for one full-attention group of ``block_size``-token blocks. The scheduler
    and hash block sizes are resolved from the config as vLLM's engine resolves them.
    ``watermark`` and ``scheduler_reserve_full_isl`` (admissions need the whole prompt to
    fit: ``full_sequence_must_fit``) are vLLM's defaults when None. ``cache`` and
    ``kv_cache_events``, ``speculative_config``, ``kv_transfer_config``, ``lora_config``: see
    :func:`make_vllm_config` (``cache["block_size"]`` is the
    engine's ``cache_config.block_size`` when it differs from ``block_size``, as for a
    Mamba model, whose scheduler block is the Mamba block)."""
    vllm_config = make_vllm_config(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold,
        watermark=watermark,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl,
        enable_prefix_caching=enable_prefix_caching,
        model_path=model_path,
        cache=cache,
        kv_cache_events=kv_cache_events,
        speculative_config=speculative_config,
        kv_transfer_config=kv_transfer_config,
        lora_config=lora_config,
    )
    kv_cache_config = (
        full_attention_config(kv_cache, block_size) if isinstance(kv_cache, int) else kv_cache
    )
    scheduler_block_size, hash_block_size = block_sizes(
        kv_cache_config,
        enable_caching=enable_prefix_caching,
        prefix_match_unit=(cache or {}).get("prefix_match_unit"),
        kv_connector=kv_transfer_config is not None,
    )
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    register_all_kvcache_specs(vllm_config)  # type: ignore[no-untyped-call]
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def stub_runner_output(
    out: Any, token_of: Callable[[int], int], requests: Mapping[str, Any] | None = None
) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` for the ``SchedulerOutput`` ``out`` in which the ``i``-th
    scheduled request samples ``token_of(i)``.

    With ``requests`` (the scheduler's ``requests`` map, read after ``schedule()``) a request
    whose prefill is still partial samples nothing, as vLLM's model runner discards those
    samples; without it every scheduled request samples a token (the scheduler-level
    benchmark's and older tests' stub, kept so that their streams stay comparable)."""
    req_ids = list(out.num_scheduled_tokens)

    def sampled(i: int, rid: str) -> list[int]:
        if requests is not None:
            req = requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                return []
        return [token_of(i)]

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled(i, r) for i, r in enumerate(req_ids)],
    )


def summarize_output(out: Any) -> tuple[Any, ...]:
    """The decisions of one ``SchedulerOutput``: new requests with their block ids and
    computed tokens, running requests' new block ids, token counts, finishes, resumptions
    and preemptions, each sorted by request id."""
    cached = out.scheduled_cached_reqs
    return (
        sorted((r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs),
        sorted(zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)),
        sorted(out.num_scheduled_tokens.items()),
        sorted(out.finished_req_ids),
        sorted(cached.resumed_req_ids),
        sorted(out.preempted_req_ids or ()),
    )
