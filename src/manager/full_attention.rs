//! `FullAttentionManager`: full attention (and MLA, hidden-state caches).
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::FullAttentionManager`.
//!
//! Key properties:
//! - Hits are a prefix: the lookup stops at the first miss (hashes are chained, so
//!   no later block can hit).
//! - Fine-grained lookups (hybrid models whose hits land on hash-block
//!   boundaries, `alignment_tokens < block_size`) then probe the hash boundaries
//!   inside the next block, longest first, and end the hit inside that block.
//! - EAGLE drops one hash unit (fine-grained) or one block from a hit; the hit is
//!   then rounded down to the alignment.
//! - With a block larger than the hash block, the prompt's last hash boundary inside
//!   a block is registered as a partial entry, so a resend can hit it.

use smallvec::SmallVec;

use super::single_type::{
    base_cache_blocks, CacheQuery, GroupBlocks, HitQuery, ManagerBase, SingleTypeManager,
    SteadyQuery,
};
use crate::error::Result;
use crate::pool::BlockPool;
use crate::types::{cdiv, BlockHashSource, BlockId, HashView};

/// Full attention (see module docs).
#[derive(Debug)]
pub struct FullAttentionManager {
    base: ManagerBase,
}

impl FullAttentionManager {
    pub fn new(base: ManagerBase) -> Self {
        Self { base }
    }
}

/// vLLM's `FullAttentionManager.find_longest_cache_hit` for a group of `block_size`
/// tokens (shared by the subclasses: sink, R-SWA).
pub fn find_full_attention_hit(
    pool: &BlockPool,
    block_size: usize,
    q: &HitQuery<'_>,
    out: &mut [Vec<BlockId>],
) -> Result<usize> {
    let hbs = pool.hash_block_size();
    let align = q.alignment_tokens;
    let fine_grained = align < block_size && block_size % align == 0;
    let scale = if fine_grained {
        block_size / align
    } else {
        pool.hash_scale(block_size)?
    };
    let full = HashView::new(q.block_hashes, scale);
    // Phase 1: the longest run of cached full blocks from the start.
    let max_blocks = (q.max_length / block_size).min(full.len());
    for i in 0..max_blocks {
        if !pool.get_cached_blocks(&full.get(i)?, q.group_ids, out) {
            break;
        }
    }
    let num_full = out.first().map_or(0, Vec::len);
    let mut hit = num_full * block_size;
    // Phase 2 (fine-grained): the longest cached hash boundary inside the next block.
    if fine_grained {
        let first = num_full * scale;
        let last = (first + scale - 1)
            .min(q.max_length / align)
            .min(q.block_hashes.len());
        for fine_idx in (first..last).rev() {
            if pool.get_cached_blocks(&q.block_hashes.get(fine_idx)?, q.group_ids, out) {
                hit = (fine_idx + 1) * align;
                break;
            }
        }
    }
    debug_assert!(hbs > 0);
    if q.drop_eagle_block && hit > 0 {
        hit -= align.min(block_size);
    }
    hit -= hit % align;
    let keep = cdiv(hit, block_size);
    for o in out.iter_mut() {
        o.truncate(keep);
    }
    Ok(hit)
}

/// The prompt boundary full attention registers as a partial entry when its block
/// is larger than the hash block (vLLM's `_cache_partial_tail_block`): the token
/// count, if there is one to register.
pub fn partial_tail_boundary(
    base: &ManagerBase,
    hash_block_size: usize,
    num_prompt_tokens: usize,
    num_hashes: usize,
    num_tokens: usize,
) -> Option<usize> {
    if base.block_size == hash_block_size {
        return None;
    }
    // A resend matches at most `prompt - 1` tokens; EAGLE lookups read the whole
    // prompt before dropping a hash unit. vLLM 0.30 keys the whole prompt's last hash
    // boundary (it asserts the hash exists; the core skips a boundary past the
    // request's hashes instead).
    let boundary = if base.partial_tail_at_prompt_floor {
        let b = num_prompt_tokens / hash_block_size;
        if b > num_hashes {
            return None;
        }
        b * hash_block_size
    } else {
        let limit = if base.use_eagle {
            num_prompt_tokens
        } else {
            num_prompt_tokens.saturating_sub(1)
        };
        (limit / hash_block_size).min(num_hashes) * hash_block_size
    };
    (boundary != 0 && boundary <= num_tokens && boundary % base.block_size != 0).then_some(boundary)
}

/// vLLM's `FullAttentionManager.cache_blocks`: the base caching, then the partial
/// prompt tail.
pub fn cache_full_attention_blocks<M: SingleTypeManager + ?Sized>(
    m: &mut M,
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    q: &CacheQuery<'_>,
) -> Result<()> {
    base_cache_blocks(m, pool, req, q)?;
    let base = m.base();
    let Some(boundary) = partial_tail_boundary(
        base,
        pool.hash_block_size(),
        q.num_prompt_tokens,
        q.block_hashes.len(),
        q.num_tokens,
    ) else {
        return Ok(());
    };
    let block_idx = boundary / base.block_size;
    let Some(&block) = req.blocks.get(block_idx) else {
        return Ok(());
    };
    let (gid, bs) = (base.group_id, base.block_size);
    pool.cache_partial_block(q.block_hashes, block, boundary, gid, bs, false)?;
    Ok(())
}

/// The hash read of [`cache_full_attention_blocks`]'s partial tail.
pub fn full_attention_extra_hash_reads(
    base: &ManagerBase,
    hash_block_size: usize,
    num_prompt_tokens: usize,
    num_hashes: usize,
    num_tokens: usize,
    out: &mut SmallVec<[usize; 4]>,
) {
    if let Some(boundary) = partial_tail_boundary(
        base,
        hash_block_size,
        num_prompt_tokens,
        num_hashes,
        num_tokens,
    ) {
        out.push(boundary / hash_block_size - 1);
    }
}

/// vLLM's `FullAttentionManager` hooks that its subclasses (sink, R-SWA) inherit
/// unchanged: the prefix hit search, caching newly full blocks, and the hash reads
/// caching needs. Expands inside an `impl SingleTypeManager` of a manager with a
/// `base: ManagerBase` field, the way a vLLM subclass inherits these methods.
macro_rules! full_attention_hooks {
    () => {
        fn find_longest_cache_hit(
            &self,
            pool: &$crate::pool::BlockPool,
            q: &$crate::manager::single_type::HitQuery<'_>,
            out: &mut [Vec<$crate::types::BlockId>],
        ) -> $crate::error::Result<usize> {
            $crate::manager::full_attention::find_full_attention_hit(
                pool,
                self.base.block_size,
                q,
                out,
            )
        }

        fn cache_blocks(
            &mut self,
            pool: &mut $crate::pool::BlockPool,
            _slot: u32,
            req: &mut $crate::manager::single_type::GroupBlocks,
            q: &$crate::manager::single_type::CacheQuery<'_>,
        ) -> $crate::error::Result<()> {
            $crate::manager::full_attention::cache_full_attention_blocks(self, pool, req, q)
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
            $crate::manager::full_attention::full_attention_extra_hash_reads(
                &self.base,
                self.base.hash_block_size,
                num_prompt_tokens,
                num_hashes,
                num_tokens,
                out,
            );
        }
    };
}
pub(crate) use full_attention_hooks;

impl SingleTypeManager for FullAttentionManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    super::full_attention::full_attention_hooks!();

    fn is_steady(&self, _slot: u32, req: &GroupBlocks, q: &SteadyQuery) -> bool {
        super::single_type::base_is_steady(self, req, q.num_tokens, q.processed_computed_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::spec::GroupSpec;

    fn base(block_size: usize, hash_block_size: usize, prompt_floor: bool) -> ManagerBase {
        let mut b = ManagerBase::new(
            GroupSpec::full_attention(block_size),
            0,
            true,
            block_size,
            hash_block_size,
            1,
            1,
            false,
        );
        b.partial_tail_at_prompt_floor = prompt_floor;
        b
    }

    #[test]
    fn partial_tail_boundary_follows_the_rules() {
        // Blocks of 16, hashes of 4, a 24-token prompt with 6 hashes, all computed.
        let (b033, b030) = (base(16, 4, false), base(16, 4, true));
        // 0.32 / 0.33: (24 - 1) / 4 = 5 hash blocks; 0.30: 24 / 4 = 6.
        assert_eq!(partial_tail_boundary(&b033, 4, 24, 6, 24), Some(20));
        assert_eq!(partial_tail_boundary(&b030, 4, 24, 6, 24), Some(24));
        // A 32-token prompt: 0.30's boundary is block aligned (no partial entry),
        // 0.33 stops one hash block short of it.
        assert_eq!(partial_tail_boundary(&b030, 4, 32, 8, 32), None);
        assert_eq!(partial_tail_boundary(&b033, 4, 32, 8, 32), Some(28));
        // Past the request's hashes: 0.33 caps, the core skips 0.30's (vLLM asserts).
        assert_eq!(partial_tail_boundary(&b033, 4, 24, 5, 24), Some(20));
        assert_eq!(partial_tail_boundary(&b030, 4, 24, 5, 24), None);
        // Not yet computed: nothing to register.
        assert_eq!(partial_tail_boundary(&b030, 4, 24, 6, 20), None);
    }
}
