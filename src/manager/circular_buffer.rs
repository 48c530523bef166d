//! `CircularBufferManager`: one ring block per request, never cached.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::CircularBufferManager` (the
//! compressor ring of GLM-5.3-Flash-style indexers): a request claims a single block
//! the first time it allocates, keeps it for its lifetime, and never hits, caches or
//! skips anything.

use super::single_type::{
    never_hit_hooks, GroupBlocks, ManagerBase, NumBlocksQuery, SingleTypeManager,
};
use crate::error::Result;
use crate::pool::BlockPool;
use crate::types::BlockId;

/// One ring block per request (see module docs).
#[derive(Debug)]
pub struct CircularBufferManager {
    base: ManagerBase,
}

impl CircularBufferManager {
    pub fn new(base: ManagerBase) -> Self {
        Self { base }
    }

    fn claim_ring_block(
        &mut self,
        pool: &mut BlockPool,
        req: &mut GroupBlocks,
        record_for_zeroing: bool,
        out: Option<&mut Vec<BlockId>>,
    ) -> Result<()> {
        if !req.blocks.is_empty() {
            return Ok(());
        }
        let record = self.base.record_new_block_ids && record_for_zeroing;
        self.base.grow(pool, &mut req.blocks, 1, record, out)
    }
}

impl SingleTypeManager for CircularBufferManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    never_hit_hooks!();

    fn get_num_blocks_to_allocate(
        &mut self,
        _pool: &BlockPool,
        _slot: u32,
        req: Option<&GroupBlocks>,
        _q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        Ok(i64::from(req.is_none_or(|r| r.blocks.is_empty())))
    }

    fn add_local_computed_blocks(
        &mut self,
        _pool: &mut BlockPool,
        _request_id: &str,
        _req: &mut GroupBlocks,
        _hits: &[BlockId],
        _num_local: usize,
        _num_external: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        _request_id: &str,
        req: &mut GroupBlocks,
        _num_local: usize,
        _num_external: usize,
        record_for_zeroing: bool,
    ) -> Result<()> {
        self.claim_ring_block(pool, req, record_for_zeroing, None)
    }

    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        _request_id: &str,
        req: &mut GroupBlocks,
        _num_tokens: usize,
        _num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        self.claim_ring_block(pool, req, true, Some(out))
    }

    fn remove_skipped_blocks(
        &mut self,
        _pool: &mut BlockPool,
        _slot: u32,
        _req: &mut GroupBlocks,
        _processed_computed_tokens: usize,
        _num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        Ok(())
    }
}
