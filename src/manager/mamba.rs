//! `MambaManager`: the state blocks of Mamba (linear-attention) layers.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::MambaManager` and the two
//! checkpoint helpers of `kv_cache_interface.py`
//! (`get_mamba_prefill_checkpoint_position`, `is_mamba_prefill_checkpoint_valid`).
//!
//! Key properties:
//! - Only the state after the last computed token matters, so every earlier block
//!   is skipped. Prefix caching needs `mamba_cache_mode == "align"`: states are
//!   kept at block boundaries and a hit is the *last* cached state, with nulls
//!   before it (fine-grained: at a hash-block boundary inside a block).
//! - A state cached by another request in the current step is not usable yet: the
//!   allocation reports "does not fit" (`num_gpu_blocks + 1`) so the request waits.
//! - Align mode (the `align_*` methods) allocates at most one running state block
//!   (+ speculative blocks + a prefill checkpoint block) per step: earlier positions
//!   become null, the previous state block is retired two steps later, speculative
//!   scratch blocks are relocated to the table's end, a partial hit is copied on
//!   write, and every committed boundary state is offered to KV connectors.
//!
//! Per-request state is keyed by the request's slot in the coordinator's table and
//! dropped in `pop_request`.
//!
//! The `align` mode is one state machine over a request's running state, spec and
//! checkpoint blocks, whose steps read one another's per-request state: this file
//! owns it whole, beside the other modes' hooks.

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use super::single_type::{
    apply_cow, base_allocate_new_blocks, base_cache_blocks, base_get_num_blocks_to_allocate,
    base_is_steady, BoundaryOffload, CacheQuery, GroupBlocks, HitQuery, ManagerBase, MaskQuery,
    NumBlocksQuery, SingleTypeManager, SteadyQuery,
};
use super::spec::{MambaCacheMode, MambaParams};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::{cdiv, BlockHashSource, BlockHashWithGroupId, BlockId, HashView, NULL_BLOCK_ID};

/// vLLM's `get_mamba_prefill_checkpoint_position`: the reusable state boundary of a
/// prefill of `num_tokens` tokens, leaving tokens to recompute for logits (or the
/// EAGLE drop) and for the boundary's lookahead hash.
pub fn prefill_checkpoint_position(
    num_tokens: usize,
    hash_block_size: usize,
    drop_eagle_block: bool,
    num_hash_lookahead_tokens: usize,
) -> usize {
    let hbs = hash_block_size as i64;
    let n = num_tokens as i64;
    let proof_limit = if drop_eagle_block {
        n
    } else {
        n - (num_hash_lookahead_tokens as i64).max(1)
    };
    let mut position = proof_limit.div_euclid(hbs) * hbs;
    if drop_eagle_block {
        position -= hbs;
    }
    position.max(0) as usize
}

/// vLLM's `is_mamba_prefill_checkpoint_valid`: whether a backend can export the
/// checkpoint at `checkpoint_position` within the query `[query_start, query_end)`.
pub fn is_prefill_checkpoint_valid(
    query_start: usize,
    query_end: usize,
    checkpoint_position: usize,
    hash_block_size: usize,
    mamba_block_size: usize,
    checkpoint_alignment: Option<usize>,
) -> bool {
    let Some(alignment) = checkpoint_alignment.filter(|&a| a > 0) else {
        return false;
    };
    let (qs, qe, cp) = (
        query_start as i64,
        query_end as i64,
        checkpoint_position as i64,
    );
    let mbs = mamba_block_size as i64;
    let initial_state_col = (qs - 1).div_euclid(mbs);
    let checkpoint_col = (qe + mbs - 1).div_euclid(mbs) - 2;
    query_start % hash_block_size == 0
        && checkpoint_col > initial_state_col
        && qs + hash_block_size as i64 <= cp
        && qs < cp
        && cp < qe
        && (checkpoint_position - query_start) % alignment == 0
}

/// Mamba state blocks (see module docs).
#[derive(Debug)]
pub struct MambaManager {
    base: ManagerBase,
    params: MambaParams,
    has_prefill_checkpoint_blocks: bool,
    /// Checkpoints follow EAGLE's replay boundary.
    pub drop_eagle_checkpoint_block: bool,
    /// Keys cached during the current step (not hittable until the next).
    pub cached_blocks_this_step: FxHashSet<BlockHashWithGroupId>,
    /// Align mode's bookkeeping, by request slot: vLLM's five per-request dicts in
    /// one entry, so a call reads one place.
    align_reqs: FxHashMap<u32, AlignRequest>,
}

/// Align mode's bookkeeping of one request (vLLM's `last_state_block_idx`,
/// `_num_retired_blocks`, `_allocated_block_reqs`, `_checkpoints` and
/// `_producer_partial_tail_reqs`, one field each; `None` / `false`: not in vLLM's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AlignRequest {
    /// The state block allocated in the previous step.
    pub last_state_block_idx: Option<usize>,
    /// The table's prefix already retired.
    pub num_retired_blocks: Option<usize>,
    /// The request already got its state blocks.
    pub allocated: bool,
    /// `(checkpoint position, reserved block index)` of this allocation.
    pub checkpoint: Option<(usize, usize)>,
    /// A producer of its own last-prompt partial tail: `(block, tokens)`.
    pub producer_partial_tail: Option<(BlockId, usize)>,
}

impl MambaManager {
    /// `Err` for prefix caching outside `mamba_cache_mode == "align"` (vLLM asserts).
    pub fn new(base: ManagerBase, params: MambaParams) -> Result<Self> {
        if base.enable_caching && params.mode != MambaCacheMode::Align {
            return Err(Error::InvalidArgument(
                "Mamba prefix caching requires mamba_cache_mode='align'".into(),
            ));
        }
        Ok(Self {
            has_prefill_checkpoint_blocks: params.mode == MambaCacheMode::Align
                && params.num_prefill_checkpoint_blocks > 0,
            drop_eagle_checkpoint_block: base.eagle_checkpoints,
            params,
            base,
            cached_blocks_this_step: FxHashSet::default(),
            align_reqs: FxHashMap::default(),
        })
    }

    #[inline]
    fn align(&self) -> bool {
        self.params.mode == MambaCacheMode::Align
    }

    #[inline]
    fn nsb(&self) -> usize {
        self.params.num_speculative_blocks
    }

    /// Align mode's bookkeeping of a slot (all empty for an unknown one).
    #[inline]
    pub fn align_request(&self, slot: u32) -> AlignRequest {
        self.align_reqs.get(&slot).copied().unwrap_or_default()
    }

    /// The slot's bookkeeping, created empty if absent (for a write).
    #[inline]
    fn align_request_mut(&mut self, slot: u32) -> &mut AlignRequest {
        self.align_reqs.entry(slot).or_default()
    }

    /// Every slot's align-mode bookkeeping (Python views).
    pub fn align_requests(&self) -> impl Iterator<Item = (u32, &AlignRequest)> {
        self.align_reqs.iter().map(|(&s, r)| (s, r))
    }

    /// The producer partial tail of a slot: `(block, tokens)` (Python views).
    pub fn producer_partial_tail(&self, slot: u32) -> Option<(BlockId, usize)> {
        self.align_request(slot).producer_partial_tail
    }

    /// vLLM's `_needs_internal_checkpoint`.
    fn needs_internal_checkpoint(
        &self,
        slot: u32,
        req: Option<&GroupBlocks>,
        query_start: usize,
        query_end: usize,
        checkpoint_position: usize,
        prefill_end: usize,
    ) -> bool {
        let bs = self.base.block_size;
        let Some(checkpoint_idx) = cdiv(query_end, bs).checked_sub(2) else {
            return false;
        };
        let blocks = req.map_or(&[][..], |r| r.blocks.as_slice());
        self.has_prefill_checkpoint_blocks
            && query_end >= prefill_end
            && is_prefill_checkpoint_valid(
                query_start,
                query_end,
                checkpoint_position,
                self.base.hash_block_size,
                bs,
                self.params.prefill_checkpoint_alignment,
            )
            && (checkpoint_idx >= blocks.len()
                || blocks[checkpoint_idx] == NULL_BLOCK_ID
                || (self.align_request(slot).allocated
                    && checkpoint_idx + self.nsb() >= blocks.len()))
    }

    /// vLLM's `_remove_blocks_in_range` in align mode: nulls are gaps between states
    /// awaiting retirement (skipped, not a stop), and the retired prefix is
    /// remembered.
    fn align_remove_blocks_in_range(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        req: &mut GroupBlocks,
        first: usize,
        last: usize,
    ) -> Result<()> {
        let first = first.max(self.align_request(slot).num_retired_blocks.unwrap_or(0));
        let last = last.min(req.blocks.len());
        if first >= last {
            return Ok(());
        }
        let mut freed: SmallVec<[BlockId; 4]> = SmallVec::new();
        for i in (first..last).rev() {
            if req.blocks[i] == NULL_BLOCK_ID {
                continue;
            }
            freed.push(req.blocks[i]);
            req.blocks[i] = NULL_BLOCK_ID;
        }
        if !freed.is_empty() {
            pool.free_blocks(&freed)?;
        }
        self.align_request_mut(slot).num_retired_blocks = Some(last);
        Ok(())
    }

    /// vLLM's `_relocate_speculative_block`: an exclusively owned scratch block moves
    /// to the table's end.
    fn relocate_speculative_block(
        pool: &BlockPool,
        blocks: &mut Vec<BlockId>,
        block_idx: usize,
    ) -> Result<()> {
        let block = blocks[block_idx];
        if !pool.is_block_writable(block) {
            return Err(Error::Internal(format!(
                "speculative Mamba block {block} must be exclusively owned and unhashed \
                 before relocation"
            )));
        }
        blocks.push(block);
        blocks[block_idx] = NULL_BLOCK_ID;
        Ok(())
    }

    /// Align-mode `get_num_blocks_to_allocate` (may be negative: over-allocated
    /// speculative blocks count against the other groups, as in vLLM).
    fn align_num_blocks_to_allocate(
        &mut self,
        pool: &BlockPool,
        slot: u32,
        req: Option<&GroupBlocks>,
        q: &NumBlocksQuery<'_>,
    ) -> i64 {
        let bs = self.base.block_size;
        let num_tokens = q.num_tokens_main_model;
        let have = req.map_or(0, |r| r.blocks.len());
        let required = cdiv(num_tokens, bs) + self.nsb();
        let mut new = required as i64 - q.new_computed_blocks.len() as i64 - have as i64;
        let has_partial = self
            .base
            .has_partial_local_hit(q.new_computed_blocks, q.num_local_computed_tokens)
            || req.is_some_and(|r| r.partial_hit.is_some());
        if has_partial {
            new = new.max(0) + 1;
        }
        let mut checkpoint_position = prefill_checkpoint_position(
            num_tokens,
            self.base.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
            self.base.num_hash_lookahead_tokens,
        );
        if !self.needs_internal_checkpoint(
            slot,
            req,
            q.total_computed_tokens,
            num_tokens,
            checkpoint_position,
            q.prefill_end,
        ) {
            checkpoint_position = 0;
        }
        let checkpoint_block = i64::from(checkpoint_position > 0);
        if !q.apply_admission_cap {
            if checkpoint_position > 0 {
                let idx = cdiv(num_tokens, bs) - 2;
                self.align_request_mut(slot).checkpoint = Some((checkpoint_position, idx));
            } else if let Some(r) = self.align_reqs.get_mut(&slot) {
                r.checkpoint = None;
            }
        }
        if new > 0 {
            let mut cap = 1 + i64::from(has_partial) + checkpoint_block;
            if !self.align_request(slot).allocated {
                cap += self.nsb() as i64;
            }
            new = new.min(cap);
        }
        let evictable = q
            .new_computed_blocks
            .iter()
            .filter(|&&b| b != NULL_BLOCK_ID && pool.ref_cnt(b) == 0)
            .count() as i64;
        new + evictable
    }

    /// Align-mode `allocate_new_blocks`.
    #[allow(clippy::too_many_arguments)]
    fn align_allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        request_id: &str,
        req: &mut GroupBlocks,
        num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        // One piece: its steps (null fill, relocation, new blocks, copy-on-write) share
        // `prev_len` and `blocks_allocated`, and run in the order `out` lists blocks in.
        let bs = self.base.block_size;
        let nsb = self.nsb();
        let required = cdiv(num_tokens_main_model, bs) + nsb;
        let checkpoint_block = usize::from(self.align_request(slot).checkpoint.is_some());
        let partial_hit = req.partial_hit;
        if required <= req.blocks.len() && partial_hit.is_none() && checkpoint_block == 0 {
            self.align_request_mut(slot).allocated = true;
            return Ok(());
        }
        let prev_len = req.blocks.len();
        let blocks_allocated = self.align_request(slot).allocated;
        if blocks_allocated {
            // The running state lives in the last (1 + speculative) blocks.
            if let Some(idx) = prev_len.checked_sub(1 + nsb) {
                self.align_request_mut(slot).last_state_block_idx = Some(idx);
            }
        } else if prev_len > 0 {
            // A new request's hit: its last block holds the hit state.
            self.align_request_mut(slot).last_state_block_idx = Some(prev_len - 1);
        }
        let num_skipped = required - nsb - 1;
        if prev_len < num_skipped {
            // Null up to the skipped positions, except the internal checkpoint block.
            let null_end = num_skipped - checkpoint_block;
            let n = null_end.saturating_sub(prev_len);
            req.blocks.extend(std::iter::repeat_n(NULL_BLOCK_ID, n));
        }
        if blocks_allocated {
            // Relocate scratch blocks this step leaves behind (a checkpoint step keeps
            // the one at the checkpoint index: the worker exports into it).
            for block_idx in prev_len.saturating_sub(nsb)..prev_len {
                if block_idx + checkpoint_block < num_skipped {
                    Self::relocate_speculative_block(pool, &mut req.blocks, block_idx)?;
                } else {
                    break;
                }
            }
        }
        let mut new = required.saturating_sub(req.blocks.len());
        if partial_hit.is_some() {
            new += 1;
        }
        let mut max_new = 1 + usize::from(partial_hit.is_some()) + checkpoint_block;
        if !blocks_allocated {
            max_new += nsb;
        }
        if new > max_new {
            return Err(Error::Internal(format!(
                "Mamba align allocation of {new} blocks exceeds its cap of {max_new}"
            )));
        }
        let mut new_blocks = Vec::with_capacity(new);
        pool.get_new_blocks(new, &mut new_blocks)?;
        // What the call returns: the positions appended so far (nulls, relocated
        // blocks), then the new blocks.
        let returned_start = out.len();
        out.extend_from_slice(&req.blocks[prev_len..]);
        let mut fresh = &new_blocks[..];
        if let Some((block_idx, source)) = partial_hit {
            let cow = fresh[0];
            fresh = &fresh[1..];
            if blocks_allocated {
                self.running_partial_hit_cow(pool, slot, request_id, req, block_idx, source, cow)?;
            } else {
                apply_cow(&mut self.base, pool, req, block_idx, source, cow)?;
                out.insert(returned_start, cow);
            }
        }
        req.blocks.extend_from_slice(fresh);
        self.align_request_mut(slot).allocated = true;
        req.partial_hit = None;
        out.extend_from_slice(fresh);
        Ok(())
    }

    /// A running request's partial hit, copied on write: its worker table is
    /// append-only, so it stays on `source` and the cache entry moves to `cow`
    /// (the producer's boundary state, if any, offered from the copy).
    #[allow(clippy::too_many_arguments)]
    fn running_partial_hit_cow(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        request_id: &str,
        req: &GroupBlocks,
        block_idx: usize,
        source: BlockId,
        cow: BlockId,
    ) -> Result<()> {
        // A running request's worker table is append-only: it stays on
        // `source`, and the cache entry moves to the copy instead.
        if req.blocks.get(block_idx) != Some(&source) {
            return Err(Error::Internal(format!(
                "Mamba partial-hit source {source} is not block {block_idx}"
            )));
        }
        pool.move_block_hashes(source, cow)?;
        self.base.pending_cow_copies.push((source, cow));
        pool.retain(source);
        let producer_tail = self
            .align_reqs
            .get_mut(&slot)
            .and_then(|r| r.producer_partial_tail.take());
        if let Some((marker, tokens)) = producer_tail {
            if marker != source {
                return Err(Error::Internal(
                    "Mamba producer tail is not the partial-hit source".into(),
                ));
            }
            // The copy preserves the producer's boundary state: offer it.
            self.base
                .pending_boundary_state_offloads
                .push(BoundaryOffload {
                    request_id: request_id.into(),
                    group_id: self.base.group_id,
                    block: cow,
                    num_tokens: tokens,
                });
        }
        if let Some(key) = pool.block_hash(cow).copied() {
            // Filled only by this step's copy: defer same-step hits on it.
            self.cached_blocks_this_step.insert(key);
        }
        Ok(())
    }

    /// vLLM's `MambaManager._cache_partial_tail_block` (align mode); returns the
    /// key registered, if any.
    fn cache_partial_tail_block(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        req: &mut GroupBlocks,
        q: &CacheQuery<'_>,
    ) -> Result<Option<BlockHashWithGroupId>> {
        // One piece: two branches (a checkpoint, else a prompt boundary or junction), each
        // a chain of early `Ok(None)` exits that ends in its `cache_partial_block` call.
        let bs = self.base.block_size;
        let hbs = pool.hash_block_size();
        let gid = self.base.group_id;
        if let Some((position, idx)) = self.align_request(slot).checkpoint {
            let Some(&block) = req.blocks.get(idx) else {
                return Err(Error::Internal(format!(
                    "Mamba checkpoint index {idx} is outside the request's table"
                )));
            };
            // The prompt's final chunk keeps its checkpoint: the prompt's reusable
            // boundary, not a transient one.
            let is_prompt_checkpoint = position
                == prefill_checkpoint_position(
                    q.num_prompt_tokens,
                    self.base.cache_hit_alignment_tokens,
                    self.drop_eagle_checkpoint_block,
                    self.base.num_hash_lookahead_tokens,
                );
            let mut is_retained = false;
            if position % bs == 0 {
                let block_idx = position / bs - 1;
                let retained = self.reachable_block_mask(&MaskQuery {
                    start_block: block_idx,
                    end_block: block_idx + 1,
                    alignment_tokens: self.base.cache_hit_alignment_tokens,
                    use_eagle: self.drop_eagle_checkpoint_block,
                    retention_interval: q.retention_interval,
                    reachable_boundaries: &[],
                });
                is_retained = retained.is_none_or(|m| m[0]);
            }
            if !is_prompt_checkpoint && !is_retained && position != q.shared_prefix_boundary {
                // The transient state overwrites this slot: neither it nor the full
                // block's key registered earlier this step is reusable.
                pool.maybe_evict_cached_block(block);
                return Ok(None);
            }
            if pool.block_hash_num_tokens(block) == Some(position as u32) {
                return Ok(None);
            }
            return pool.cache_partial_block(q.block_hashes, block, position, gid, bs, true);
        }
        let n = q.num_tokens;
        if n == 0 || n % hbs != 0 {
            return Ok(None);
        }
        let latest_prompt_boundary = prefill_checkpoint_position(
            q.num_prompt_tokens,
            hbs,
            self.drop_eagle_checkpoint_block,
            self.base.num_hash_lookahead_tokens,
        );
        // The junction is the other position a sibling resumes at, bounded to the
        // prompt chunk being computed.
        let junction = self.base.shared_prefix_checkpoint
            && n == q.shared_prefix_boundary
            && q.num_computed_tokens < n
            && n <= q.num_prompt_tokens;
        if n != latest_prompt_boundary && !junction {
            return Ok(None);
        }
        let block_idx = cdiv(n, bs) - 1;
        let Some(&source) = req.blocks.get(block_idx) else {
            return Ok(None);
        };
        if source == NULL_BLOCK_ID {
            return Ok(None);
        }
        // Already keyed here by a hit or an earlier step: vLLM 0.33 does not cache it
        // again (that would defer every sibling hitting it); 0.32 does.
        if pool.block_hash_num_tokens(source) == Some(n as u32)
            && pool.vllm_rules().skip_keyed_mamba_checkpoint
        {
            return Ok(None);
        }
        let key = pool.cache_partial_block(q.block_hashes, source, n, gid, bs, false)?;
        if key.is_some() && n % bs != 0 {
            req.partial_hit = Some((block_idx, source));
            req.num_cached_block = Some(block_idx);
            // The boundary state lives in `source` until the next forward overwrites
            // it; the coming copy-on-write hands the durable copy to the connector.
            self.align_request_mut(slot).producer_partial_tail = Some((source, n));
        }
        Ok(key)
    }

    /// [`SingleTypeManager::is_steady`] in align mode: the call would retire no
    /// state, allocate nothing, copy nothing, reserve or drop no checkpoint, and key
    /// no partial tail. Each clause is the no-op case of one step of the general
    /// path (`remove_skipped_blocks`, `align_num_blocks_to_allocate`,
    /// `align_allocate_new_blocks`, `cache_partial_tail_block`); a clause that
    /// cannot be decided without more of the request (a junction at
    /// `shared_prefix_boundary`) answers `false`.
    fn align_is_steady(&self, slot: u32, req: &GroupBlocks, q: &SteadyQuery) -> bool {
        let bs = self.base.block_size;
        let state = self.align_request(slot);
        // Copy-on-write, the first allocation's bookkeeping, or a checkpoint to drop.
        if req.partial_hit.is_some() || !state.allocated || state.checkpoint.is_some() {
            return false;
        }
        // Nothing to allocate: the running state and speculative blocks cover it.
        if cdiv(q.num_tokens_main_model, bs) + self.nsb() > req.blocks.len() {
            return false;
        }
        // No prefill checkpoint to reserve (the query cannot export one).
        if self.has_prefill_checkpoint_blocks
            && is_prefill_checkpoint_valid(
                q.num_computed_tokens,
                q.num_tokens_main_model,
                prefill_checkpoint_position(
                    q.num_tokens_main_model,
                    self.base.cache_hit_alignment_tokens,
                    self.drop_eagle_checkpoint_block,
                    self.base.num_hash_lookahead_tokens,
                ),
                self.base.hash_block_size,
                bs,
                self.params.prefill_checkpoint_alignment,
            )
        {
            return false;
        }
        // No skipped state to retire: the retired prefix already reaches the skip
        // boundary, and the state block of two steps ago is gone or still needed.
        let processed = q.processed_computed_tokens;
        let skipped = processed.saturating_sub(1);
        if skipped > 0 {
            let n = (skipped / bs).min(req.blocks.len());
            if state.num_retired_blocks.unwrap_or(0) < n {
                return false;
            }
        }
        if let Some(idx) = state.last_state_block_idx {
            let limit = cdiv(processed, bs) as i64 - 1;
            if (idx as i64) < limit && req.blocks.get(idx).is_some_and(|&b| b != NULL_BLOCK_ID) {
                return false;
            }
        }
        // No partial tail to key: the cacheable tokens are off the hash grid, or
        // neither the prompt's boundary nor a possible junction.
        if let Some(n) = q.cacheable_tokens.filter(|_| self.base.enable_caching) {
            let hbs = self.base.hash_block_size;
            if n != 0 && n % hbs == 0 {
                let prompt_boundary = prefill_checkpoint_position(
                    q.num_prompt_tokens,
                    hbs,
                    self.drop_eagle_checkpoint_block,
                    self.base.num_hash_lookahead_tokens,
                );
                let junction = self.base.shared_prefix_checkpoint
                    && q.num_computed_tokens < n
                    && n <= q.num_prompt_tokens;
                if n == prompt_boundary || junction {
                    return false;
                }
            }
        }
        true
    }

    /// Whether the hit ends on a state another request cached in this step.
    fn hit_cached_this_step(&self, pool: &BlockPool, hits: &[BlockId]) -> bool {
        hits.last()
            .and_then(|&b| pool.block_hash(b))
            .is_some_and(|k| self.cached_blocks_this_step.contains(k))
    }
}

impl SingleTypeManager for MambaManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    /// Only the last computed token's state is needed: `n - 1` skipped.
    fn get_num_skipped_tokens(&self, num_computed_tokens: usize) -> usize {
        num_computed_tokens.saturating_sub(1)
    }

    /// Align mode: [`MambaManager::align_is_steady`]. Otherwise vLLM's base rules
    /// over the tokens plus the speculative blocks' (caching is off there).
    fn is_steady(&self, slot: u32, req: &GroupBlocks, q: &SteadyQuery) -> bool {
        if self.align() {
            return self.align_is_steady(slot, req, q);
        }
        let bs = self.base.block_size;
        bs == self.base.spec.block_size
            && base_is_steady(
                self,
                req,
                q.num_tokens + self.nsb() * bs,
                q.processed_computed_tokens,
            )
    }

    fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        q: &HitQuery<'_>,
        out: &mut [Vec<BlockId>],
    ) -> Result<usize> {
        if self.base.dcp_world_size > 1 || self.base.pcp_world_size > 1 {
            return Err(Error::Unsupported(
                "context parallelism with Mamba prefix caching (as in vLLM)".into(),
            ));
        }
        let bs = self.base.spec.block_size;
        let align = q.alignment_tokens;
        let mut found: SmallVec<[Vec<BlockId>; 2]> =
            out.iter().map(|_| Vec::with_capacity(1)).collect();
        let place = |out: &mut [Vec<BlockId>], block_idx: usize, found: &[Vec<BlockId>]| {
            for (o, f) in out.iter_mut().zip(found) {
                o.extend(std::iter::repeat_n(NULL_BLOCK_ID, block_idx));
                o.push(f[0]);
            }
        };
        if align < bs && bs % align == 0 {
            // Fine-grained: the last cached hash boundary, right to left.
            let scale = bs / align;
            let max_units = (q.max_length / align).min(q.block_hashes.len());
            for fine_idx in (0..max_units).rev() {
                if pool.get_cached_blocks(&q.block_hashes.get(fine_idx)?, q.group_ids, &mut found) {
                    place(out, fine_idx / scale, &found);
                    return Ok((fine_idx + 1) * align);
                }
            }
            return Ok(0);
        }
        let view = HashView::new(q.block_hashes, pool.hash_scale(bs)?);
        for i in (0..q.max_length / bs).rev() {
            for f in found.iter_mut() {
                f.clear();
            }
            if pool.get_cached_blocks(&view.get(i)?, q.group_ids, &mut found) {
                if bs != align && (i + 1) * bs % align != 0 {
                    continue;
                }
                place(out, i, &found);
                return Ok((i + 1) * bs);
            }
        }
        Ok(0)
    }

    fn reachable_block_mask(&self, q: &MaskQuery<'_>) -> Option<Vec<bool>> {
        let retention = q.retention_interval?;
        let bs = self.base.spec.block_size;
        let mut mask = vec![false; q.end_block - q.start_block];
        // (1) One state per retention segment (0: none); block i ends at (i+1)*bs.
        if retention > 0 {
            let per_segment = retention / bs;
            if per_segment <= 1 {
                return None;
            }
            let first_boundary = (q.start_block + per_segment) / per_segment * per_segment - 1;
            let mut i = first_boundary - q.start_block;
            while i < mask.len() {
                mask[i] = true;
                i += per_segment;
            }
        }
        // (2) The state ending on each reachable boundary.
        let align = q.alignment_tokens as i64;
        for &boundary in q.reachable_boundaries {
            let aligned = boundary.div_euclid(align) * align;
            let block = aligned.div_euclid(bs as i64) - 1;
            if block >= q.start_block as i64 && block < q.end_block as i64 {
                mask[block as usize - q.start_block] = true;
            }
        }
        Some(mask)
    }

    fn get_num_blocks_to_allocate(
        &mut self,
        pool: &BlockPool,
        slot: u32,
        req: Option<&GroupBlocks>,
        q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        if self.hit_cached_this_step(pool, q.new_computed_blocks) {
            // Not usable before the next step: report that nothing fits.
            return Ok(i64::from(pool.num_gpu_blocks()) + 1);
        }
        if self.align() {
            return Ok(self.align_num_blocks_to_allocate(pool, slot, req, q));
        }
        let extra = self.params.num_speculative_blocks * self.base.spec.block_size;
        let q = NumBlocksQuery {
            num_tokens: q.num_tokens + extra,
            ..*q
        };
        base_get_num_blocks_to_allocate(self, pool, req, &q)
    }

    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        request_id: &str,
        req: &mut GroupBlocks,
        num_tokens: usize,
        num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        if self.align() {
            return self.align_allocate_new_blocks(
                pool,
                slot,
                request_id,
                req,
                num_tokens_main_model,
                out,
            );
        }
        let extra = self.base.block_size * self.params.num_speculative_blocks;
        base_allocate_new_blocks(self, pool, req, num_tokens + extra, out)
    }

    fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        req: &mut GroupBlocks,
        q: &CacheQuery<'_>,
    ) -> Result<()> {
        let before = req.num_cached_block.unwrap_or(0);
        base_cache_blocks(self, pool, req, q)?;
        let after = req.num_cached_block.unwrap_or(0);
        if self.align() {
            if let Some(key) = self.cache_partial_tail_block(pool, slot, req, q)? {
                self.cached_blocks_this_step.insert(key);
            }
        }
        for idx in before..after {
            let Some(&block) = req.blocks.get(idx) else {
                break;
            };
            // Null blocks (skipped states) and masked-out snapshots carry no hash.
            let Some(key) = pool.block_hash(block).copied() else {
                continue;
            };
            self.cached_blocks_this_step.insert(key);
            if self.align() {
                let tokens = pool.block_hash_num_tokens(block).unwrap_or(0) as usize;
                self.base
                    .pending_boundary_state_offloads
                    .push(BoundaryOffload {
                        request_id: q.request_id.into(),
                        group_id: self.base.group_id,
                        block,
                        num_tokens: tokens,
                    });
            }
        }
        Ok(())
    }

    /// Align mode's partial entries (`cache_partial_tail_block`) read the hash at
    /// their boundary, which may lie below the run of newly full blocks (a block the
    /// retention mask left unkeyed): the prompt boundary or junction at
    /// `num_tokens`, and the checkpoint, set by this call's allocation (derived from
    /// `query_end`) or by an earlier one.
    fn extra_hash_reads(
        &self,
        slot: u32,
        _num_prompt_tokens: usize,
        _num_hashes: usize,
        num_tokens: usize,
        query_end: usize,
        out: &mut SmallVec<[usize; 4]>,
    ) {
        if !self.align() {
            return;
        }
        let hbs = self.base.hash_block_size;
        let mut push = |tokens: usize| {
            if tokens >= hbs && tokens % hbs == 0 && !out.contains(&(tokens / hbs - 1)) {
                out.push(tokens / hbs - 1);
            }
        };
        push(num_tokens);
        if self.has_prefill_checkpoint_blocks {
            push(prefill_checkpoint_position(
                query_end,
                self.base.cache_hit_alignment_tokens,
                self.drop_eagle_checkpoint_block,
                self.base.num_hash_lookahead_tokens,
            ));
            if let Some((position, _)) = self.align_request(slot).checkpoint {
                push(position);
            }
        }
    }

    fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        slot: u32,
        req: &mut GroupBlocks,
        processed_computed_tokens: usize,
        _num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        let bs = self.base.block_size;
        let skipped = self.get_num_skipped_tokens(processed_computed_tokens);
        if skipped > 0 {
            let n = (skipped / bs).min(req.blocks.len());
            if self.align() {
                self.align_remove_blocks_in_range(pool, slot, req, 0, n)?;
            } else {
                super::single_type::remove_blocks_in_range(pool, req, 0, n)?;
            }
        }
        if self.align() {
            // The state block of two steps ago fed the previous step's copy and is
            // no longer needed.
            if let Some(idx) = self.align_request(slot).last_state_block_idx {
                let limit = cdiv(processed_computed_tokens, bs) as i64 - 1;
                if (idx as i64) < limit {
                    if let Some(&block) = req.blocks.get(idx) {
                        if block != NULL_BLOCK_ID {
                            pool.free_blocks(&[block])?;
                            req.blocks[idx] = NULL_BLOCK_ID;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn pop_request(&mut self, slot: u32, request_id: &str) {
        if !self.align() {
            return;
        }
        self.align_reqs.remove(&slot);
        // An offer holds committed bytes only until the end of the pass that made
        // it: a freed request's blocks may already be someone else's.
        self.base
            .pending_boundary_state_offloads
            .retain(|o| &*o.request_id != request_id);
    }

    fn new_step_starts(&mut self) {
        self.cached_blocks_this_step.clear();
    }

    fn finalize_partial_tail_offload(
        &mut self,
        slot: u32,
        num_computed_tokens: usize,
        num_in_flight_tokens: usize,
    ) -> Option<(u32, BlockId, usize)> {
        if !self.align() {
            return None;
        }
        let (source, tokens) = self
            .align_reqs
            .get_mut(&slot)
            .and_then(|r| r.producer_partial_tail.take())?;
        (num_in_flight_tokens == 0 && num_computed_tokens == tokens).then_some((
            self.base.group_id,
            source,
            tokens,
        ))
    }

    /// Align mode's bookkeeping of the request: its allocated mark, last state
    /// block, retired prefix, checkpoint and producer tail.
    fn request_state_digest(&self, slot: u32) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = rustc_hash::FxHasher::default();
        self.align_request(slot).hash(&mut h);
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_position_leaves_the_last_token_and_the_eagle_block() {
        assert_eq!(prefill_checkpoint_position(100, 16, false, 0), 96);
        assert_eq!(prefill_checkpoint_position(96, 16, false, 0), 80);
        assert_eq!(prefill_checkpoint_position(96, 16, true, 0), 80);
        assert_eq!(prefill_checkpoint_position(97, 16, false, 2), 80);
        assert_eq!(prefill_checkpoint_position(0, 16, false, 0), 0);
    }

    #[test]
    fn checkpoint_validity_follows_vllm() {
        // query [0, 200), checkpoint 128, block 64, hash 32, alignment 32.
        assert!(is_prefill_checkpoint_valid(0, 200, 128, 32, 64, Some(32)));
        assert!(!is_prefill_checkpoint_valid(0, 200, 128, 32, 64, None));
        // The checkpoint must lie strictly inside the query.
        assert!(!is_prefill_checkpoint_valid(0, 128, 128, 32, 64, Some(32)));
        // A query start off the hash grid cannot export.
        assert!(!is_prefill_checkpoint_valid(8, 200, 128, 32, 64, Some(32)));
    }
}
