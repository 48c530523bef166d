//! `ChunkedLocalAttentionManager`: chunked local attention (Llama 4 style).
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::ChunkedLocalAttentionManager`.
//!
//! Key properties:
//! - A token attends only within its chunk of `attention_chunk_size` tokens, so the
//!   blocks of earlier chunks are skipped (freed, replaced by the null block).
//! - A hit counts every block before the current chunk as computed (null blocks)
//!   and looks up the blocks of the current chunk from its start until a miss.
//!   E.g. chunk 8, block 4, max length 15 → `[null, null, b2?]`; max length 16 →
//!   four nulls.

use super::single_type::{GroupBlocks, HitQuery, ManagerBase, SingleTypeManager, SteadyQuery};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::{BlockHashSource, BlockId, HashView, NULL_BLOCK_ID};

/// Chunked local attention (see module docs).
#[derive(Debug)]
pub struct ChunkedLocalAttentionManager {
    base: ManagerBase,
    attention_chunk_size: usize,
}

impl ChunkedLocalAttentionManager {
    pub fn new(base: ManagerBase, attention_chunk_size: usize) -> Self {
        Self {
            base,
            attention_chunk_size: attention_chunk_size.max(1),
        }
    }
}

impl SingleTypeManager for ChunkedLocalAttentionManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    /// The tokens before the current chunk.
    fn get_num_skipped_tokens(&self, num_computed_tokens: usize) -> usize {
        num_computed_tokens / self.attention_chunk_size * self.attention_chunk_size
    }

    fn is_steady(&self, _slot: u32, req: &GroupBlocks, q: &SteadyQuery) -> bool {
        super::single_type::base_is_steady(self, req, q.num_tokens, q.processed_computed_tokens)
    }

    fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        q: &HitQuery<'_>,
        out: &mut [Vec<BlockId>],
    ) -> Result<usize> {
        let bs = self.base.spec.block_size;
        if q.drop_eagle_block {
            return Err(Error::Unsupported(
                "EAGLE with chunked local attention (as in vLLM)".into(),
            ));
        }
        if self.base.dcp_world_size > 1 || self.base.pcp_world_size > 1 {
            return Err(Error::Unsupported(
                "context parallelism with chunked local attention (as in vLLM)".into(),
            ));
        }
        if bs != q.alignment_tokens {
            return Err(Error::Unsupported(
                "chunked local attention with groups of other block sizes (as in vLLM)".into(),
            ));
        }
        let view = HashView::new(q.block_hashes, pool.hash_scale(bs)?);
        let max_blocks = q.max_length / bs;
        let chunk = self.attention_chunk_size;
        let local_start = if q.max_length > 0 {
            q.max_length / chunk * chunk
        } else {
            0
        };
        let start_block = local_start / bs;
        for o in out.iter_mut() {
            o.extend(std::iter::repeat_n(NULL_BLOCK_ID, start_block));
        }
        for i in start_block..max_blocks {
            if !pool.get_cached_blocks(&view.get(i)?, q.group_ids, out) {
                break;
            }
        }
        Ok(out.first().map_or(0, Vec::len) * bs)
    }
}
