//! `RSWAManager`: reference sliding-window attention.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::RSWAManager`: full attention
//! whose `remove_skipped_blocks`, given the prompt length, frees the gap between
//! the prompt's last block and the decode window, so a request holds its prompt
//! plus one window instead of its whole sequence.

use super::full_attention::{cache_full_attention_blocks, find_full_attention_hit};
use super::single_type::{
    base_remove_skipped_blocks, remove_blocks_in_range, CacheQuery, GroupBlocks, HitQuery,
    ManagerBase, SingleTypeManager,
};
use crate::error::Result;
use crate::pool::BlockPool;
use crate::types::{cdiv, BlockId};

/// R-SWA (see module docs).
#[derive(Debug)]
pub struct RswaManager {
    base: ManagerBase,
    rswa_window: usize,
}

impl RswaManager {
    pub fn new(base: ManagerBase, rswa_window: usize) -> Self {
        Self { base, rswa_window }
    }
}

impl SingleTypeManager for RswaManager {
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

    /// Frees the blocks wholly inside `[cdiv(prompt, bs) * bs, max(prompt,
    /// processed - window))`; without the prompt length, the base rule (no-op).
    fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        req: &mut GroupBlocks,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        let Some(prompt) = num_prompt_tokens else {
            return base_remove_skipped_blocks(self, pool, req, processed_computed_tokens);
        };
        let bs = self.base.block_size;
        let first_gap_block = cdiv(prompt, bs);
        let window_start = prompt.max(processed_computed_tokens.saturating_sub(self.rswa_window));
        remove_blocks_in_range(pool, req, first_gap_block, window_start / bs)
    }
}
