"""The keyword arguments vLLM 0.33's ``Scheduler`` passes to ``KVCacheManager``.

:func:`manager_kwargs` returns all sixteen, in the Scheduler's order, for a
``KVCacheConfig`` (any list of groups, see :mod:`hscache_tools.testing.kv_cache`; on vLLM 0.32,
which has no lookahead hashing, fifteen: no ``num_hash_lookahead_tokens``);
``scheduler_block_size`` and ``hash_block_size`` are resolved as vLLM's engine resolves them
(:func:`hscache_tools.testing.kv_cache.block_sizes`) unless given. Both vLLM's manager and
``hscache.vllm.KVCacheManager`` take them unchanged: ``cls(**manager_kwargs(config))``.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig

from hscache_tools.testing.kv_cache import block_sizes

_HAS_HASH_LOOKAHEAD = (
    "num_hash_lookahead_tokens" in inspect.signature(VllmKVCacheManager.__init__).parameters
)

__all__ = ["build_manager", "manager_kwargs"]


def _mamba_prefix_keyword() -> str:
    from hscache.vllm.version import require

    return require().mamba_prefix_keyword


def manager_kwargs(
    kv_cache_config: KVCacheConfig,
    *,
    max_model_len: int = 8192,
    max_in_flight_tokens: int | None = None,
    enable_caching: bool = True,
    use_eagle: bool = False,
    num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0,
    log_stats: bool = True,
    enable_kv_cache_events: bool = True,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    watermark: float = 0.0,
    enable_mamba_shared_prefix_checkpoint: bool = False,
    scheduler_block_size: int | None = None,
    hash_block_size: int | None = None,
    prefix_match_unit: int | None = None,
    kv_connector: bool = False,
) -> dict[str, Any]:
    """``KVCacheManager``'s keywords as the Scheduler passes them (``metrics_collector`` is
    None: ``--kv-cache-metrics`` off). ``prefix_match_unit`` and ``kv_connector`` are the
    engine settings that steer the resolved hash block size; they are not keywords."""
    if scheduler_block_size is None or hash_block_size is None:
        resolved = block_sizes(
            kv_cache_config,
            enable_caching=enable_caching,
            prefix_match_unit=prefix_match_unit,
            dcp_world_size=dcp_world_size,
            kv_connector=kv_connector,
        )
        scheduler_block_size = resolved[0] if scheduler_block_size is None else scheduler_block_size
        hash_block_size = resolved[1] if hash_block_size is None else hash_block_size
    kwargs: dict[str, Any] = {
        "kv_cache_config": kv_cache_config,
        "max_model_len": max_model_len,
        "max_in_flight_tokens": max_in_flight_tokens,
        "enable_caching": enable_caching,
        "use_eagle": use_eagle,
        "num_hash_lookahead_tokens": num_hash_lookahead_tokens,
        "num_prefill_lookahead": num_prefill_lookahead,
        "log_stats": log_stats,
        "enable_kv_cache_events": enable_kv_cache_events,
        "dcp_world_size": dcp_world_size,
        "pcp_world_size": pcp_world_size,
        "scheduler_block_size": scheduler_block_size,
        "hash_block_size": hash_block_size,
        "metrics_collector": None,
        "watermark": watermark,
        # 0.30 names it enable_mamba_fine_grained_prefix_cache (the version profile).
        _mamba_prefix_keyword(): enable_mamba_shared_prefix_checkpoint,
    }
    if not _HAS_HASH_LOOKAHEAD:  # vLLM 0.32: no lookahead hashing, no such keyword
        if num_hash_lookahead_tokens:
            raise ValueError("this vLLM has no lookahead hashing: num_hash_lookahead_tokens=0")
        del kwargs["num_hash_lookahead_tokens"]
    return kwargs


def build_manager(cls: type, kv_cache_config: KVCacheConfig, **kwargs: Any) -> Any:
    """``cls(**manager_kwargs(kv_cache_config, **kwargs))``: a manager built as the Scheduler
    builds one (``cls`` is vLLM's ``KVCacheManager`` or a drop-in replacement). A HiSparse
    layout is bound to its connector-side coordinator at once, as vLLM's HiSparse connector
    does before the first admission (``get_hisparse_coordinator``)."""
    manager = cls(**manager_kwargs(kv_cache_config, **kwargs))
    if kv_cache_config.hisparse_host_num_blocks is not None:
        from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

        get_hisparse_coordinator(manager)
    return manager
