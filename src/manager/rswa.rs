//! `RSWAManager`: reference sliding-window attention.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::RSWAManager`: full attention
//! whose `remove_skipped_blocks`, given the prompt length, frees the gap between
//! the prompt's last block and the decode window, so a request holds its prompt
//! plus one window instead of its whole sequence.

use super::single_type::{
    base_remove_skipped_blocks, remove_blocks_in_range, GroupBlocks, ManagerBase, SingleTypeManager,
};
use crate::error::Result;
use crate::pool::BlockPool;
use crate::types::cdiv;

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

    super::full_attention::full_attention_hooks!();

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
