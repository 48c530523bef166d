"""vLLM's KV-cache configuration, read into the plain values the Rust core takes.

Conversion only: each KV-cache group's spec object becomes a dict of the fields the
core's single-type managers read (``src/python/convert/spec.rs`` reads it), with the
manager kind vLLM's own registry (``KVCacheSpecRegistry``) picks for the spec. The
rules live in the core; this module also names the configurations the core does not
serve (``unsupported_reason``), each a logged fallback to vLLM's manager, or an error
with ``HSCACHE_STRICT=1``.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.core import single_type_kv_cache_manager as stm
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from hscache.vllm.version import require

_PROFILE = require()


def env_flag(name: str) -> bool:
    """Whether an environment flag is set (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no", "off")


# vLLM's manager class -> the core's manager kind (`ManagerKind` in src/manager/spec.rs).
_KINDS: dict[type, str] = {
    stm.FullAttentionManager: "full_attention",
    stm.SinkFullAttentionManager: "sink_full_attention",
    stm.RSWAManager: "rswa",
    stm.CircularBufferManager: "circular_buffer",
    stm.SlidingWindowManager: "sliding_window",
    stm.ChunkedLocalAttentionManager: "chunked_local",
    stm.MambaManager: "mamba",
    stm.CrossAttentionManager: "cross_attention",
    stm.HiSparseSourceManager: "hisparse_source",
    stm.HiSparseResidentManager: "hisparse_resident",
    stm.HiSparseHotManager: "hisparse_hot",
}


def manager_class(group: Any) -> Any:
    """The vLLM manager class of a KV-cache group (None if none is registered)."""
    try:
        return KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec, group.role)
    except Exception:  # an unregistered custom spec
        return None


def _dcp_sharded(spec: Any) -> bool:
    """Whether DCP shards the spec's KV (its block size scales with the DCP size): the
    spec's ``dcp_sharded`` field (0.32, 0.33); vLLM 0.30 has none and shards full
    attention (MLA included), judged by a uniform spec's first layer."""
    if _PROFILE.spec_dcp_sharded_field:
        return bool(spec.dcp_sharded)
    inner = spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = next(iter(spec.kv_cache_specs.values()))
    return isinstance(inner, FullAttentionSpec)


def unsupported_reason(
    config: KVCacheConfig, hash_block_size: int | None = None, enable_caching: bool = True
) -> str | None:
    """Why the core cannot serve this configuration, or None if it can.

    ``hash_block_size``: the manager's (checked against a HiSparse source group);
    ``enable_caching``: the manager's prefix caching.
    """
    if env_flag("HSCACHE_DISABLE"):
        return "HSCACHE_DISABLE is set"
    if not _PROFILE.mamba_rules_implemented:
        for i, group in enumerate(config.kv_cache_groups):
            if _KINDS.get(manager_class(group)) == "mamba":
                return f"group {i}: vLLM {_PROFILE.version}'s Mamba caching rules"
    if not _PROFILE.hisparse_residency_updates:
        for i, group in enumerate(config.kv_cache_groups):
            if manager_class(group) is stm.HiSparseSourceManager:
                return f"group {i}: vLLM {_PROFILE.version}'s HiSparse residency"
    if enable_caching and not _PROFILE.mamba_caching_needs_align:
        # vLLM 0.32 prefix-caches Mamba groups in every mode (0.33 asserts 'align'); the
        # core implements align-mode caching only, so 0.32 keeps serving the others.
        for i, group in enumerate(config.kv_cache_groups):
            mode = getattr(group.kv_cache_spec, "mamba_cache_mode", "align")
            if _KINDS.get(manager_class(group)) == "mamba" and mode != "align":
                return f"group {i}: vLLM 0.32 prefix-caches Mamba in mamba_cache_mode={mode!r}"
    classes = []
    for i, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        cls = manager_class(group)
        if cls is None:
            return f"group {i}: no manager registered for {type(spec).__name__}"
        if cls not in _KINDS:
            return f"group {i}: {type(spec).__name__} needs {getattr(cls, '__name__', cls)}"
        classes.append(cls)
    return _hisparse_reason(config, classes, hash_block_size)


def _hisparse_reason(
    config: KVCacheConfig, classes: list[Any], hash_block_size: int | None
) -> str | None:
    """Why a HiSparse layout cannot be served: the layouts vLLM's
    ``HiSparseCoordinator`` refuses when the connector binds it (the manager then
    stays vLLM's, so the refusal comes from vLLM, at the same call), and what the
    core does not implement."""
    groups = config.kv_cache_groups
    sources = [i for i, c in enumerate(classes) if c is stm.HiSparseSourceManager]
    residents = [i for i, c in enumerate(classes) if c is stm.HiSparseResidentManager]
    hots = [i for i, c in enumerate(classes) if c is stm.HiSparseHotManager]
    if not sources:
        if residents or hots:
            return "HiSparse resident or hot groups without a HiSparse source group"
        return None
    if len(sources) > 1:
        return "several HiSparse source groups (vLLM's HiSparseCoordinator refuses them)"
    if config.hisparse_host_num_blocks is None:
        return "a HiSparse source group without hisparse_host_num_blocks"
    host = sources[0]
    if any(groups[i].host_resident for i in residents + hots):
        return "a host-resident HiSparse resident or hot group (vLLM asserts against it)"
    if residents:
        if host > min(residents):
            return "HiSparse host group after a resident group (vLLM refuses it)"
        sizes = {groups[i].kv_cache_spec.block_size for i in residents}
        if len(sizes) != 1 or groups[host].kv_cache_spec.block_size not in sizes:
            return "HiSparse host and resident block sizes differ (vLLM refuses it)"
    bs = groups[host].kv_cache_spec.block_size
    if hash_block_size is not None and bs != hash_block_size:
        return (
            f"a HiSparse source group of block size {bs} over hash blocks of "
            f"{hash_block_size} tokens (partial host entries are not implemented)"
        )
    return None


def group_specs(
    config: KVCacheConfig, max_in_flight_tokens: int, max_model_len: int
) -> list[dict[str, Any]]:
    """One dict per KV-cache group (see module docs); `unsupported_reason` is None."""
    out: list[dict[str, Any]] = []
    classes: list[tuple[Any, Any]] = []  # (spec, manager class) of each spec class
    for group in config.kv_cache_groups:
        # The kind-specific fields below exist on the spec class the kind came from.
        spec: Any = group.kv_cache_spec
        cls = manager_class(group)
        # Groups with equal specs and managers are looked up together (vLLM's
        # `verify_and_split_kv_cache_groups`).
        key = next(
            (k for k, (s, c) in enumerate(classes) if c is cls and s == spec),
            None,
        )
        if key is None:
            classes.append((spec, cls))
            key = len(classes) - 1
        d: dict[str, Any] = {
            "kind": _KINDS[cls],
            "block_size": spec.block_size,
            "dcp_sharded": _dcp_sharded(spec),
            "prefix_cacheable": bool(spec.prefix_cacheable),
            "is_eagle_group": bool(group.is_eagle_group),
            "is_full_attention_spec": isinstance(spec, FullAttentionSpec),
            "is_attention_spec": isinstance(spec, AttentionSpec),
            "is_cross_or_encoder_only": isinstance(
                spec, CrossAttentionSpec | EncoderOnlyAttentionSpec
            ),
            "spec_class": key,
            "max_admission_blocks_per_request": None,
        }
        if isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec | HiSparseResidentSpec):
            d["max_admission_blocks_per_request"] = spec.max_admission_blocks_per_request(
                max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len
            )
        kind = d["kind"]
        if kind == "sink_full_attention":
            d["sink_len"] = spec.sink_len or 0
        elif kind == "rswa":
            d["rswa_window"] = spec.rswa_window
        elif kind == "sliding_window":
            d["sliding_window"] = spec.sliding_window
            d["extra_retained_tokens"] = spec.extra_retained_tokens
        elif kind == "chunked_local":
            d["attention_chunk_size"] = spec.attention_chunk_size
        elif kind == "mamba":
            d["mamba_cache_mode"] = spec.mamba_cache_mode
            d["num_speculative_blocks"] = spec.num_speculative_blocks
            d["num_prefill_checkpoint_blocks"] = spec.num_prefill_checkpoint_blocks
            d["prefill_checkpoint_alignment"] = spec.prefill_checkpoint_alignment
        elif kind == "hisparse_source":
            d["host_num_blocks"] = config.hisparse_host_num_blocks
        elif kind == "hisparse_hot":
            d["blocks_per_request"] = spec.blocks_per_request
        out.append(d)
    return out
