//! `SinkFullAttentionManager`: full attention with attention sinks.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::SinkFullAttentionManager`,
//! which changes nothing of full attention's bookkeeping but checks at construction
//! that the sink spans whole blocks.

use super::full_attention::{cache_full_attention_blocks, find_full_attention_hit};
use super::single_type::{CacheQuery, GroupBlocks, HitQuery, ManagerBase, SingleTypeManager};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::BlockId;

/// Full attention with a sink of `sink_len` tokens (see module docs).
#[derive(Debug)]
pub struct SinkFullAttentionManager {
    base: ManagerBase,
}

impl SinkFullAttentionManager {
    /// `Err` unless the sink is a positive number of whole blocks.
    pub fn new(base: ManagerBase, sink_len: usize) -> Result<Self> {
        if sink_len == 0 || sink_len % base.block_size != 0 {
            return Err(Error::InvalidArgument(format!(
                "sink_len {sink_len} must be a positive multiple of the block size {}",
                base.block_size
            )));
        }
        Ok(Self { base })
    }
}

impl SingleTypeManager for SinkFullAttentionManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        q: &HitQuery<'_>,
        out: &mut [Vec<BlockId>],
    ) -> Result<usize> {
        find_full_attention_hit(pool, self.base.block_size, q, out)
    }

    fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        req: &mut GroupBlocks,
        q: &CacheQuery<'_>,
    ) -> Result<()> {
        cache_full_attention_blocks(self, pool, req, q)
    }

    fn extra_hash_reads(
        &self,
        _slot: u32,
        num_prompt_tokens: usize,
        num_hashes: usize,
        num_tokens: usize,
        _query_end: usize,
        out: &mut smallvec::SmallVec<[usize; 4]>,
    ) {
        super::full_attention::full_attention_extra_hash_reads(
            &self.base,
            self.base.hash_block_size,
            num_prompt_tokens,
            num_hashes,
            num_tokens,
            out,
        );
    }
}
