//! What the core knows about each KV-cache group: its manager kind and the spec
//! parameters the manager's rules read.
//!
//! Mirrors vLLM 0.33 `v1/kv_cache_interface.py` (the `KVCacheSpec` classes) and the
//! registry `v1/kv_cache_spec_registry.py` / `register_all_kvcache_specs` (which
//! manager class serves which spec). The Python adapter builds a [`GroupSpec`] per
//! group from vLLM's spec objects; nothing here reads Python.

/// Which of vLLM's single-type managers serves a group (one file per kind in
/// `src/manager/`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ManagerKind {
    /// `FullAttentionManager`: full attention, MLA, hidden-state caches.
    FullAttention,
    /// `SinkFullAttentionManager`: full attention with attention sinks.
    SinkFullAttention { sink_len: usize },
    /// `RSWAManager`: reference sliding window (frees the gap between the prompt
    /// and the decode window).
    Rswa { rswa_window: usize },
    /// `CircularBufferManager`: one ring block per request, never cached.
    CircularBuffer,
    /// `SlidingWindowManager` (incl. `SlidingWindowMLASpec`).
    SlidingWindow {
        sliding_window: usize,
        extra_retained_tokens: usize,
    },
    /// `ChunkedLocalAttentionManager`.
    ChunkedLocal { attention_chunk_size: usize },
    /// `MambaManager`.
    Mamba(MambaParams),
    /// `CrossAttentionManager` (encoder–decoder models).
    CrossAttention,
    /// `HiSparseSourceManager` (group role `hisparse_source`): full attention on
    /// HiSparse's private host pool; publishes its hashes once host copies are
    /// durable. `host_num_blocks`: `kv_cache_config.hisparse_host_num_blocks`.
    HiSparseSource { host_num_blocks: u32 },
    /// `HiSparseResidentManager` (`HiSparseResidentSpec`): GPU-resident pages of
    /// otherwise host-backed KV.
    HiSparseResident,
    /// `HiSparseHotManager` (`HiSparseHotSpec`): a fixed per-request hot region,
    /// allocated once the request reads host-backed history.
    HiSparseHot { blocks_per_request: usize },
}

/// vLLM's `mamba_cache_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MambaCacheMode {
    None,
    All,
    Align,
}

/// The `MambaSpec` fields the manager reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MambaParams {
    pub mode: MambaCacheMode,
    pub num_speculative_blocks: usize,
    pub num_prefill_checkpoint_blocks: usize,
    pub prefill_checkpoint_alignment: Option<usize>,
}

/// One KV-cache group as the core sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    pub kind: ManagerKind,
    /// `kv_cache_spec.block_size` (before decode-context-parallel scaling).
    pub block_size: usize,
    /// `kv_cache_spec.dcp_sharded`: DCP/PCP scale this group's block size.
    pub dcp_sharded: bool,
    /// `kv_cache_spec.prefix_cacheable`.
    pub prefix_cacheable: bool,
    /// `KVCacheGroupSpec.is_eagle_group`.
    pub is_eagle_group: bool,
    /// `isinstance(spec, FullAttentionSpec)` (MLA, R-SWA, sink and hidden-state specs
    /// included): the hybrid lookup orders these first and truncates them last.
    pub is_full_attention_spec: bool,
    /// `isinstance(spec, AttentionSpec)`.
    pub is_attention_spec: bool,
    /// Cross-attention or encoder-only: never prefix cached, not clipped to the
    /// computed tokens.
    pub is_cross_or_encoder_only: bool,
    /// Groups with the same `spec_class` have equal specs (vLLM's `spec == spec`)
    /// and are looked up together.
    pub spec_class: u32,
    /// `spec.max_admission_blocks_per_request(...)` for the kinds that recycle
    /// blocks (sliding window, chunked local).
    pub max_admission_blocks_per_request: Option<usize>,
}

impl GroupSpec {
    /// A plain full-attention group of `block_size` tokens (tests, benches).
    pub fn full_attention(block_size: usize) -> Self {
        Self {
            kind: ManagerKind::FullAttention,
            block_size,
            dcp_sharded: true,
            prefix_cacheable: true,
            is_eagle_group: false,
            is_full_attention_spec: true,
            is_attention_spec: true,
            is_cross_or_encoder_only: false,
            spec_class: 0,
            max_admission_blocks_per_request: None,
        }
    }

    /// A sliding-window group (tests, benches).
    pub fn sliding_window(block_size: usize, sliding_window: usize) -> Self {
        Self {
            kind: ManagerKind::SlidingWindow {
                sliding_window,
                extra_retained_tokens: 0,
            },
            is_full_attention_spec: false,
            spec_class: 1,
            ..Self::full_attention(block_size)
        }
    }

    /// A Mamba group in `mode` (tests, benches).
    pub fn mamba(block_size: usize, mode: MambaCacheMode) -> Self {
        Self {
            kind: ManagerKind::Mamba(MambaParams {
                mode,
                num_speculative_blocks: 0,
                num_prefill_checkpoint_blocks: 0,
                prefill_checkpoint_alignment: None,
            }),
            dcp_sharded: false,
            is_full_attention_spec: false,
            is_attention_spec: false,
            spec_class: 2,
            ..Self::full_attention(block_size)
        }
    }

    /// Whether the worker zeroes this group's new blocks when the config asks for
    /// zeroing: attention groups except circular buffers (vLLM's
    /// `_record_new_block_ids`).
    #[inline]
    pub fn zeroes_new_blocks(&self) -> bool {
        self.is_attention_spec && self.kind != ManagerKind::CircularBuffer
    }

    /// Whether this group is one of HiSparse's (source, resident or hot).
    #[inline]
    pub fn is_hisparse(&self) -> bool {
        matches!(
            self.kind,
            ManagerKind::HiSparseSource { .. }
                | ManagerKind::HiSparseResident
                | ManagerKind::HiSparseHot { .. }
        )
    }

    /// Whether this is a Mamba group (`isinstance(spec, MambaSpec)`).
    #[inline]
    pub fn is_mamba(&self) -> bool {
        matches!(self.kind, ManagerKind::Mamba(_))
    }

    /// The Mamba cache mode, for Mamba groups.
    #[inline]
    pub fn mamba_mode(&self) -> Option<MambaCacheMode> {
        match &self.kind {
            ManagerKind::Mamba(p) => Some(p.mode),
            _ => None,
        }
    }

    /// vLLM's class attribute `supports_fine_grained_hash_lookup` of the manager.
    #[inline]
    pub fn supports_fine_grained_hash_lookup(&self) -> bool {
        matches!(
            self.kind,
            ManagerKind::FullAttention
                | ManagerKind::SinkFullAttention { .. }
                | ManagerKind::Rswa { .. }
                | ManagerKind::Mamba(_)
                | ManagerKind::HiSparseSource { .. }
        )
    }

    /// The manager's block size: the spec's, times the DCP world size for sharded
    /// specs.
    #[inline]
    pub fn manager_block_size(&self, dcp_world_size: usize) -> usize {
        self.block_size * self.effective_cp(dcp_world_size)
    }

    /// The context-parallel world size that applies to this group (1 unless sharded).
    #[inline]
    pub fn effective_cp(&self, world_size: usize) -> usize {
        if self.dcp_sharded {
            world_size.max(1)
        } else {
            1
        }
    }
}
