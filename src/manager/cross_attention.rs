//! `CrossAttentionManager`: the cross-attention KV of encoder–decoder models.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::CrossAttentionManager`.
//! Encoder states are unique per request and computed once, so nothing is shared:
//! hits are refused, external loads ignored, caching is an error. The coordinator
//! sizes this group by the request's encoder tokens (one static allocation).

use super::single_type::{
    reject_prefix_hits, CacheQuery, GroupBlocks, HitQuery, ManagerBase, SingleTypeManager,
};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::BlockId;

/// Cross attention (see module docs).
#[derive(Debug)]
pub struct CrossAttentionManager {
    base: ManagerBase,
}

impl CrossAttentionManager {
    pub fn new(base: ManagerBase) -> Self {
        Self { base }
    }
}

impl SingleTypeManager for CrossAttentionManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    fn find_longest_cache_hit(
        &self,
        _pool: &BlockPool,
        _q: &HitQuery<'_>,
        _out: &mut [Vec<BlockId>],
    ) -> Result<usize> {
        Err(Error::Unsupported(
            "cross-attention KV is never prefix cached (vLLM's CrossAttentionManager \
             does not support caching)"
                .into(),
        ))
    }

    fn add_local_computed_blocks(
        &mut self,
        _pool: &mut BlockPool,
        _request_id: &str,
        _req: &mut GroupBlocks,
        hits: &[BlockId],
        _num_local: usize,
        _num_external: usize,
    ) -> Result<()> {
        reject_prefix_hits(hits, "cross-attention")
    }

    fn allocate_external_computed_blocks(
        &mut self,
        _pool: &mut BlockPool,
        _request_id: &str,
        _req: &mut GroupBlocks,
        _num_local: usize,
        _num_external: usize,
        _record_for_zeroing: bool,
    ) -> Result<()> {
        Ok(())
    }

    fn cache_blocks(
        &mut self,
        _pool: &mut BlockPool,
        _slot: u32,
        _req: &mut GroupBlocks,
        _q: &CacheQuery<'_>,
    ) -> Result<()> {
        Err(Error::InvalidArgument(
            "cache_blocks must not be called for cross attention: prefix caching is \
             disabled for it"
                .into(),
        ))
    }
}
