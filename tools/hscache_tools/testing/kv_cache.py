"""vLLM ``KVCacheConfig``s for any list of KV-cache groups, and their resolved block sizes.

A group is one ``KVCacheGroupSpec``: a spec (one of the builders below, each with its own
block size) plus layer names and the EAGLE flag. :func:`kv_cache_config` puts any list of
them into one pool of ``num_blocks`` blocks, as vLLM's engine does after profiling;
:func:`block_sizes` returns the ``(scheduler_block_size, hash_block_size)`` pair vLLM's
``resolve_kv_cache_block_sizes`` picks for it (the lcm of the group block sizes, and the
hash granularity), which :func:`hscache_tools.testing.manager.manager_kwargs` hands to the manager.

The page geometry (heads, head size, dtype) is irrelevant to the manager's decisions; the
builders default to the smallest (1 head of size 1, float32) and take the real one as
keywords where a benchmark wants realistic specs.

Example, a hybrid model (full attention every fourth layer, sliding window elsewhere, an
EAGLE draft layer)::

    cfg = kv_cache_config(
        [group(full_attention(16), "full"), group(sliding_window(16, 64), "swa"),
         group(full_attention(16), "draft", eagle=True)],
        num_blocks=256,
    )
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, Literal, cast

import torch
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

__all__ = [
    "MambaCacheMode",
    "block_sizes",
    "chunked_local",
    "circular_buffer",
    "cross_attention",
    "full_attention",
    "full_attention_config",
    "group",
    "hisparse_config",
    "hisparse_hot",
    "hisparse_resident",
    "kv_cache_config",
    "mamba",
    "mla",
    "rswa",
    "sink",
    "sliding_window",
]

MambaCacheMode = Literal["none", "align", "all"]
"""A ``MambaSpec``'s ``mamba_cache_mode``: vLLM 0.33's ``CacheConfig`` values (``none``,
``align``: prefix-cacheable) and ``all``, which the spec and vLLM's ``MambaManager`` take
as a non-``align`` mode (without prefix caching only)."""


def full_attention(
    block_size: int = 16,
    *,
    num_kv_heads: int = 1,
    head_size: int = 1,
    dtype: torch.dtype = torch.float32,
) -> FullAttentionSpec:
    """A full-attention layer (dense decoder models)."""
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )


def mla(block_size: int = 16, *, head_size: int = 1) -> MLAAttentionSpec:
    """A multi-head latent attention layer (DeepSeek): full attention with one latent head."""
    return MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=torch.float32
    )


def sliding_window(
    block_size: int, window: int, *, mla: bool = False
) -> SlidingWindowSpec | SlidingWindowMLASpec:
    """A sliding-window layer of ``window`` tokens (``mla``: its MLA variant)."""
    cls = SlidingWindowMLASpec if mla else SlidingWindowSpec
    return cls(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=window,
    )


def chunked_local(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    """A chunked local attention layer (Llama 4) over chunks of ``chunk`` tokens."""
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        attention_chunk_size=chunk,
    )


def mamba(
    block_size: int,
    *,
    mode: MambaCacheMode = "none",
    num_speculative_blocks: int = 0,
    num_prefill_checkpoint_blocks: int = 0,
    prefill_checkpoint_alignment: int | None = None,
) -> MambaSpec:
    """A Mamba (state-space) layer; ``mode="align"`` makes its states prefix-cacheable
    (vLLM refuses prefix caching over a Mamba group in any other mode).
    ``num_prefill_checkpoint_blocks`` / ``prefill_checkpoint_alignment``: a backend that
    exports the prompt's checkpoint state inside the last prefill chunk (align mode)."""
    return MambaSpec(
        block_size=block_size,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        num_speculative_blocks=num_speculative_blocks,
        num_prefill_checkpoint_blocks=num_prefill_checkpoint_blocks,
        prefill_checkpoint_alignment=prefill_checkpoint_alignment,
    )


def rswa(block_size: int, window: int) -> RSWASpec:
    """Reference sliding-window attention: the prompt stays visible, only the last
    ``window`` generated tokens are kept (the gap between them is freed)."""
    return RSWASpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        rswa_window=window,
    )


def circular_buffer(block_size: int) -> CircularBufferSpec:
    """A compressor ring: one block of ``block_size`` rows per request, never cached."""
    return CircularBufferSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def cross_attention(block_size: int = 16) -> CrossAttentionSpec:
    """A cross-attention layer of an encoder-decoder model (Whisper)."""
    return CrossAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def sink(block_size: int, sink_len: int) -> SinkFullAttentionSpec:
    """Full attention with ``sink_len`` attention-sink tokens. (vLLM 0.33's own
    ``KVCacheManager`` cannot be built over it: ``SinkFullAttentionManager`` rejects the
    ``needs_kv_cache_zeroing`` keyword its coordinator passes.)"""
    return SinkFullAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sink_len=sink_len,
    )


def hisparse_resident(
    block_size: int = 16, *, page_size: int | None = None
) -> HiSparseResidentSpec:
    """HiSparse's GPU-resident pages of host-backed KV."""
    return HiSparseResidentSpec(block_size=block_size, page_size=page_size or 4 * block_size)


def hisparse_hot(
    block_size: int = 16, blocks_per_request: int = 2, *, page_size: int | None = None
) -> HiSparseHotSpec:
    """HiSparse's per-request hot region of ``blocks_per_request`` blocks."""
    return HiSparseHotSpec(
        block_size=block_size,
        page_size=page_size or 4 * block_size,
        blocks_per_request=blocks_per_request,
    )


def hisparse_config(
    num_blocks: int,
    host_num_blocks: int,
    *,
    block_size: int = 16,
    blocks_per_request: int = 2,
    num_resident_groups: int = 1,
    transfer_device_cache: bool = False,
) -> KVCacheConfig:
    """vLLM's HiSparse layout, as its engine builds it for a sparse MLA model: a source
    group (role ``hisparse_source``, on a host pool of ``host_num_blocks`` blocks), an
    indexer group (role ``hisparse_indexer``, full attention on the device pool), then
    ``num_resident_groups`` pairs of a resident and a hot group."""
    source = full_attention(block_size)
    groups = [
        KVCacheGroupSpec(
            ["source"], source, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True
        ),
        KVCacheGroupSpec(
            ["indexer"],
            source,
            enable_kv_transfer=transfer_device_cache,
            role=KVCacheGroupRole.HISPARSE_INDEXER,
        ),
    ]
    for i in range(num_resident_groups):
        suffix = f"_{i}" if i else ""
        groups.append(
            KVCacheGroupSpec(
                [f"resident{suffix}"],
                hisparse_resident(block_size),
                enable_kv_transfer=transfer_device_cache,
            )
        )
        groups.append(
            KVCacheGroupSpec(
                [f"hot{suffix}"],
                hisparse_hot(block_size, blocks_per_request),
                enable_kv_transfer=False,
            )
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        hisparse_host_num_blocks=host_num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
    )


def group(spec: KVCacheSpec, *layer_names: str, eagle: bool = False) -> KVCacheGroupSpec:
    """One KV-cache group: ``spec`` for ``layer_names`` (default ``["layer"]``);
    ``eagle``: the group holds draft layers and takes EAGLE's last-block drop."""
    return KVCacheGroupSpec(list(layer_names) or ["layer"], spec, is_eagle_group=eagle)


class _ZeroingKVCacheConfig(KVCacheConfig):
    """A config whose new blocks must be zeroed (in vLLM: Mamba or mixed-precision caches),
    so that plain attention groups exercise the new-block-id bookkeeping too."""

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        return True


def kv_cache_config(
    groups: Sequence[KVCacheGroupSpec | KVCacheSpec],
    num_blocks: int,
    *,
    needs_zeroing: bool = False,
    retention_interval: int | None = None,
) -> KVCacheConfig:
    """One pool of ``num_blocks`` blocks (the null block included) shared by ``groups``.

    A bare spec becomes a group of its own: layer ``"layer"`` when it is the only group,
    ``"layer{i}"`` otherwise. ``needs_zeroing`` forces ``needs_kv_cache_zeroing`` on.
    ``retention_interval``: ``prefix_cache_retention_interval`` (None: dense caching, as a
    bare ``KVCacheConfig``; the engine resolves 0 by default: sparse sliding-window and
    Mamba caching)."""
    made = [
        g
        if isinstance(g, KVCacheGroupSpec)
        else group(g, "layer" if len(groups) == 1 else f"layer{i}")
        for i, g in enumerate(groups)
    ]
    cls = _ZeroingKVCacheConfig if needs_zeroing else KVCacheConfig
    return cls(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=made,
        prefix_cache_retention_interval=retention_interval,
    )


def full_attention_config(
    num_blocks: int, block_size: int = 16, *, needs_zeroing: bool = False
) -> KVCacheConfig:
    """The common case: one full-attention group."""
    return kv_cache_config([full_attention(block_size)], num_blocks, needs_zeroing=needs_zeroing)


def block_sizes(
    config: KVCacheConfig,
    *,
    enable_caching: bool = True,
    prefix_match_unit: int | None = None,
    dcp_world_size: int = 1,
    kv_connector: bool = False,
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` as vLLM's engine resolves them for
    ``config`` (``vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes``, called with
    the few engine settings it reads): one group, its block size (times DCP) twice; several,
    the lcm of the group block sizes and, with prefix caching or a KV connector, the gcd of
    the prefix-cacheable ones (or ``prefix_match_unit``), falling back to the lcm when a
    Mamba group is not in ``align`` mode."""
    groups = config.kv_cache_groups
    engine = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=groups[0].kv_cache_spec.block_size if groups else 16,
            prefix_match_unit=prefix_match_unit,
            enable_prefix_caching=enable_caching,
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp_world_size),
        kv_transfer_config=object() if kv_connector else None,
    )
    return resolve_kv_cache_block_sizes(config, cast(Any, engine))
