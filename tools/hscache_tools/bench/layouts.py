"""The KV-cache layouts the benchmarks run: one full-attention group, and the hybrids.

Owns :data:`LAYOUTS` (name → the models that use it), :data:`VARIANTS` (layouts only the
scheduler-level benchmark and tests run: they need prefix caching off) and
:func:`layout_config`, which builds
a layout's ``KVCacheConfig`` with :mod:`hscache_tools.testing.kv_cache` and returns what vLLM's
engine derives from it (the scheduler and hash block sizes, the ``CacheConfig`` fields a
Mamba model sets). Shared by the scenario benchmark (:mod:`hscache_tools.bench.real_scheduler`)
and the scheduler-level one (:mod:`hscache_tools.bench.scheduler_level`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LAYOUTS", "VARIANTS", "LayoutConfig", "layout_config"]

LAYOUTS: dict[str, str] = {
    "full": "one full-attention group, 16-token blocks (Llama, Qwen3)",
    "full+swa": "full attention + a 128-token sliding window, 16-token blocks (gpt-oss, Gemma 3)",
    "full+mamba": "full attention (16-token blocks) + Mamba 'align' (64-token blocks) "
    "(Qwen3-Next, Nemotron-H, Jamba)",
    "full+chunked": "full attention + chunked local attention over 256-token chunks (Llama 4)",
}

VARIANTS: dict[str, str] = {
    "full+mamba-none": "full attention (16-token blocks) + Mamba 'none' (64-token blocks), "
    "prefix caching off (vLLM's default mamba_cache_mode)",
}
"""Layouts outside :data:`LAYOUTS` (whose benchmarks run with prefix caching on): vLLM
refuses prefix caching over a Mamba group outside ``align`` mode."""


@dataclass(frozen=True)
class LayoutConfig:
    """A layout's KV-cache configuration and what the engine derives from it."""

    kv_cache_config: Any
    scheduler_block_size: int
    hash_block_size: int
    cache: dict[str, Any]
    """Further ``CacheConfig`` fields (``mamba_cache_mode`` for a Mamba model)."""
    enable_prefix_caching: bool = True
    """False for the layouts vLLM serves only without prefix caching (:data:`VARIANTS`)."""


def layout_config(layout: str, num_blocks: int) -> LayoutConfig:
    """The configuration of ``layout`` (see :data:`LAYOUTS` and :data:`VARIANTS`) over a pool
    of ``num_blocks`` blocks shared by its groups."""
    import torch

    from hscache_tools.testing import kv_cache as kc

    # One full-attention group gets a realistic page (8 KV heads of 128, bfloat16); the
    # hybrids' pages do not matter to the manager.
    full = kc.full_attention(16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    cache: dict[str, Any] = {}
    caching = True
    if layout == "full":
        groups: list[Any] = [kc.group(full, "model.layers.0.self_attn")]
    elif layout == "full+swa":
        groups = [full, kc.sliding_window(16, 128)]
    elif layout == "full+mamba":
        groups = [full, kc.mamba(64, mode="align")]
        cache["mamba_cache_mode"] = "align"
    elif layout == "full+mamba-none":
        groups = [full, kc.mamba(64, mode="none")]
        cache["mamba_cache_mode"] = "none"
        caching = False
    elif layout == "full+chunked":
        groups = [full, kc.chunked_local(16, 256)]
    else:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join([*LAYOUTS, *VARIANTS])}")
    config = kc.kv_cache_config(groups, num_blocks)
    scheduler_block, hash_block = kc.block_sizes(config, enable_caching=caching)
    return LayoutConfig(config, scheduler_block, hash_block, cache, caching)
