//! The single-type managers by kind: the factory (vLLM 0.33's
//! `get_manager_for_kv_cache_spec` and its `spec_manager_map`) and the kind-typed
//! views of a `dyn SingleTypeManager` (Mamba's internals, HiSparse's groups).
//!
//! Key properties:
//! - The only module that names every implementor: `single_type.rs` (the trait)
//!   names none of them, so a manager file depends on the trait and never the
//!   other way round.
//! - A view is `Some` exactly for its concrete type (a downcast through
//!   [`AsAny`](super::single_type::AsAny)); every other manager answers `None`.

use super::chunked_local::ChunkedLocalAttentionManager;
use super::circular_buffer::CircularBufferManager;
use super::cross_attention::CrossAttentionManager;
use super::full_attention::FullAttentionManager;
use super::hisparse::{HiSparseHotManager, HiSparseResidentManager, HiSparseSourceManager};
use super::mamba::MambaManager;
use super::rswa::RswaManager;
use super::single_type::{ManagerBase, SingleTypeManager};
use super::sink::SinkFullAttentionManager;
use super::sliding_window::SlidingWindowManager;
use super::spec::ManagerKind;
use crate::error::Result;

/// The manager of `spec` (vLLM's `get_manager_for_kv_cache_spec` + registry);
/// `enable_kv_cache_events` is the device pool's (HiSparse's host pool follows it).
pub fn new_manager(
    base: ManagerBase,
    enable_kv_cache_events: bool,
) -> Result<Box<dyn SingleTypeManager>> {
    Ok(match base.spec.kind.clone() {
        ManagerKind::FullAttention => Box::new(FullAttentionManager::new(base)),
        ManagerKind::SinkFullAttention { sink_len } => {
            Box::new(SinkFullAttentionManager::new(base, sink_len)?)
        }
        ManagerKind::Rswa { rswa_window } => Box::new(RswaManager::new(base, rswa_window)),
        ManagerKind::CircularBuffer => Box::new(CircularBufferManager::new(base)),
        ManagerKind::SlidingWindow {
            sliding_window,
            extra_retained_tokens,
        } => Box::new(SlidingWindowManager::new(
            base,
            sliding_window,
            extra_retained_tokens,
        )),
        ManagerKind::ChunkedLocal {
            attention_chunk_size,
        } => Box::new(ChunkedLocalAttentionManager::new(
            base,
            attention_chunk_size,
        )),
        ManagerKind::Mamba(params) => Box::new(MambaManager::new(base, params)?),
        ManagerKind::CrossAttention => Box::new(CrossAttentionManager::new(base)),
        ManagerKind::HiSparseSource { host_num_blocks } => Box::new(HiSparseSourceManager::new(
            base,
            host_num_blocks,
            enable_kv_cache_events,
        )?),
        ManagerKind::HiSparseResident => Box::new(HiSparseResidentManager::new(base)),
        ManagerKind::HiSparseHot { blocks_per_request } => {
            Box::new(HiSparseHotManager::new(base, blocks_per_request))
        }
    })
}

impl dyn SingleTypeManager {
    /// Mamba "align" internals for the Python views (`_checkpoints`, ...).
    pub fn mamba(&self) -> Option<&MambaManager> {
        self.as_any().downcast_ref()
    }

    /// HiSparse's source group, for its coordinator.
    pub fn hisparse_source_mut(&mut self) -> Option<&mut HiSparseSourceManager> {
        self.as_any_mut().downcast_mut()
    }

    /// A HiSparse resident group, for its coordinator and the Python views.
    pub fn hisparse_resident(&self) -> Option<&HiSparseResidentManager> {
        self.as_any().downcast_ref()
    }

    /// A HiSparse resident group, mutable.
    pub fn hisparse_resident_mut(&mut self) -> Option<&mut HiSparseResidentManager> {
        self.as_any_mut().downcast_mut()
    }

    /// A HiSparse hot group, for its coordinator and the Python views.
    pub fn hisparse_hot(&self) -> Option<&HiSparseHotManager> {
        self.as_any().downcast_ref()
    }

    /// A HiSparse hot group, mutable.
    pub fn hisparse_hot_mut(&mut self) -> Option<&mut HiSparseHotManager> {
        self.as_any_mut().downcast_mut()
    }
}
