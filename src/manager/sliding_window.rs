//! `SlidingWindowManager`: sliding-window attention (incl. the MLA variant).
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::SlidingWindowManager`.
//!
//! Key properties:
//! - A token attends to the last `sliding_window` tokens, so blocks wholly before
//!   the window are skipped: freed (on the *processed*-token basis, as the
//!   Scheduler's in-flight steps still read them) and replaced by the null block.
//!   `extra_retained_tokens` keeps a few more for multi-module MTP re-prefill.
//! - A hit needs `cdiv(window - 1, block)` contiguous cached blocks ending at the
//!   hit (one more with EAGLE, which then drops it); the lookup scans right to left
//!   and returns nulls for the skipped prefix, e.g. `[null, null, b7, b8]`. Without
//!   a full run, the run starting at block 0 is the hit.
//! - With groups of other block sizes, a run's right edge must land on an
//!   `alignment_tokens` boundary.
//! - Caching can be sparse (`reachable_block_mask`): only the blocks that can end a
//!   hit at some aligned boundary are worth a hash, and a retention interval thins
//!   them further.

use super::single_type::{
    GroupBlocks, HitQuery, ManagerBase, MaskQuery, SingleTypeManager, SteadyQuery,
};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::{cdiv, BlockHashSource, BlockId, HashView, NULL_BLOCK_ID};

/// Sliding-window attention (see module docs).
#[derive(Debug)]
pub struct SlidingWindowManager {
    base: ManagerBase,
    sliding_window: usize,
    extra_retained_tokens: usize,
}

impl SlidingWindowManager {
    pub fn new(base: ManagerBase, sliding_window: usize, extra_retained_tokens: usize) -> Self {
        Self {
            base,
            sliding_window: sliding_window.max(1),
            extra_retained_tokens,
        }
    }

    /// Contiguous cached blocks a hit needs (vLLM's `_contiguous_blocks_for_hit`).
    pub fn contiguous_blocks_for_hit(window: usize, block_size: usize, use_eagle: bool) -> usize {
        cdiv(window.saturating_sub(1), block_size) + usize::from(use_eagle)
    }
}

impl SingleTypeManager for SlidingWindowManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    /// Tokens before the window of the next token:
    /// `max(0, n - sliding_window + 1 - extra_retained_tokens)`.
    fn get_num_skipped_tokens(&self, num_computed_tokens: usize) -> usize {
        (num_computed_tokens + 1).saturating_sub(self.sliding_window + self.extra_retained_tokens)
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
        if self.base.dcp_world_size > 1 || self.base.pcp_world_size > 1 {
            return Err(Error::Unsupported(
                "context parallelism with sliding-window attention (as in vLLM)".into(),
            ));
        }
        let bs = self.base.spec.block_size;
        let align = q.alignment_tokens;
        let view = HashView::new(q.block_hashes, pool.hash_scale(bs)?);
        let need = Self::contiguous_blocks_for_hit(self.sliding_window, bs, q.drop_eagle_block);
        let max_blocks = q.max_length / bs;
        for o in out.iter_mut() {
            o.clear();
            o.resize(max_blocks, NULL_BLOCK_ID);
        }
        let mut contiguous = 0usize;
        let mut matched = false;
        let mut found: smallvec::SmallVec<[Vec<BlockId>; 2]> =
            out.iter().map(|_| Vec::with_capacity(1)).collect();
        for i in (0..max_blocks).rev() {
            for f in found.iter_mut() {
                f.clear();
            }
            if pool.get_cached_blocks(&view.get(i)?, q.group_ids, &mut found) {
                if contiguous == 0 && bs != align {
                    let post_pop = if q.drop_eagle_block { i } else { i + 1 };
                    if (post_pop * bs) % align != 0 {
                        continue;
                    }
                }
                for (o, f) in out.iter_mut().zip(&found) {
                    o[i] = f[0];
                }
                contiguous += 1;
                if contiguous >= need {
                    for o in out.iter_mut() {
                        o.truncate(i + contiguous);
                    }
                    matched = true;
                    break;
                }
            } else {
                contiguous = 0;
            }
        }
        let realign = |out: &mut [Vec<BlockId>]| {
            while bs != align && out[0].len() * bs % align != 0 {
                for o in out.iter_mut() {
                    o.pop();
                }
            }
        };
        if !matched {
            // The run starting at block 0 is a hit even if shorter than needed.
            for o in out.iter_mut() {
                o.truncate(contiguous);
            }
            realign(out);
        }
        if q.drop_eagle_block && !out[0].is_empty() {
            for o in out.iter_mut() {
                o.pop();
            }
            realign(out);
        }
        Ok(out[0].len() * bs)
    }

    fn reachable_block_mask(&self, q: &MaskQuery<'_>) -> Option<Vec<bool>> {
        let bs = self.base.spec.block_size * self.base.dcp_world_size;
        if q.alignment_tokens % bs != 0 {
            // A block-granular mask cannot represent a sub-block alignment: dense.
            return None;
        }
        let need = Self::contiguous_blocks_for_hit(self.sliding_window, bs, q.use_eagle);
        // The matched run's right edge sits on the aligned boundary block when EAGLE
        // peeks one block past it, else on the last block before the boundary.
        let shift = usize::from(q.use_eagle);
        let mut mask = vec![false; q.end_block - q.start_block];
        // (1) Segment-boundary tails: every alignment boundary (dense), none (0), or
        // one per retention interval.
        let segment_tokens = match q.retention_interval {
            None => Some(q.alignment_tokens),
            Some(0) => None,
            Some(r) => Some(r),
        };
        if let Some(segment) = segment_tokens {
            let per_segment = segment / bs;
            if need >= per_segment {
                return None;
            }
            for i in q.start_block..q.end_block {
                if i >= shift && (i - shift) % per_segment >= per_segment - need {
                    mask[i - q.start_block] = true;
                }
            }
        }
        // (2) The tails ending on each reachable boundary (replay boundary,
        // shared-prefix junction), kept explicitly under sparse retention.
        if q.retention_interval.is_some() {
            let (align, bs_i) = (q.alignment_tokens as i64, bs as i64);
            for &boundary in q.reachable_boundaries {
                let aligned = boundary.div_euclid(align) * align;
                let end = aligned.div_euclid(bs_i) + shift as i64;
                let lo = (q.start_block as i64).max(end - need as i64);
                let hi = (q.end_block as i64).min(end);
                for j in lo..hi {
                    mask[j as usize - q.start_block] = true;
                }
            }
        }
        Some(mask)
    }
}
