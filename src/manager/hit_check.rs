//! The hits handed back to `allocate_slots`: which prefix of them a group keeps
//! (vLLM's `retained_hit_group_ids`), the checks every call makes before anything
//! changes (one list per group, ids in range, no hits for a running request, the
//! hit covers the computed tokens claimed), and the checked mode's proofs below.
//!
//! Checked-mode proof that a hit handed to `allocate_slots` is the request's own.
//!
//! `allocate_slots` takes back the `KVCacheBlocks` that `get_computed_blocks`
//! returned, and vLLM trusts them: a caller may hand in blocks found for another
//! request, or blocks that were evicted and reassigned since the lookup, and the
//! request then reads another prompt's KV. In the checked mode
//! (`HSCACHE_CHECK_INVARIANTS=1`, debug builds) [`KVCacheManager::check_hits_are_the_requests`]
//! demands that every hit block of every group be indexed under the hash the request
//! itself has at that position, so a foreign or stale hit is an `InvalidArgument`
//! raised before anything changes.
//!
//! The position rule covers every way a lookup finds a block: block `i` of a group of
//! `block_size` tokens (`s = block_size / hash_block_size` hashes per block) is found
//! under one of the request's raw hashes `s*i .. s*(i+1)` — its full-block hash
//! `s*(i+1) - 1` (`HashView`), or a hash boundary inside it (fine-grained and partial
//! hits, Mamba's fine-grained checkpoints). Null-block placeholders of sliding-window,
//! chunked-local and Mamba groups are exempt; full attention (and its sink / R-SWA
//! subclasses) never hits the null block, so there it is refused.
//!
//! Off by default: the cost is one hash read and compare per hit block (a probe of the
//! index for blocks reached through a secondary key), measured in the CHANGELOG.

use super::single_type::running_cannot_adopt;
use super::{GroupedBlockIds, GroupedBlocks, KVCacheManager, ManagerKind, RequestLike};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::{cdiv, BlockHashSource, BlockHashWithGroupId, BlockId, NULL_BLOCK_ID};

/// Whether a group of this kind places null blocks in its hits (blocks outside the
/// window, before the local chunk, or before Mamba's one state block).
fn hits_hold_placeholders(kind: &ManagerKind) -> bool {
    matches!(
        kind,
        ManagerKind::SlidingWindow { .. }
            | ManagerKind::ChunkedLocal { .. }
            | ManagerKind::Mamba(_)
    )
}

/// Whether `block` is indexed under `(hashes[j], group_id)` for a raw hash `j` that
/// ends inside block `i` (`scale` hashes per block); the full-block hash first.
fn cached_at<H: BlockHashSource + ?Sized>(
    pool: &BlockPool,
    hashes: &H,
    block: BlockId,
    group_id: u32,
    i: usize,
    scale: usize,
) -> Result<bool> {
    let first = i.saturating_mul(scale);
    let end = first.saturating_add(scale).min(hashes.len());
    for j in (first..end).rev() {
        let key = BlockHashWithGroupId {
            hash: hashes.get(j)?,
            group_id,
        };
        // The block's primary key is an array read; secondary keys need a probe.
        if pool.block_hash(block) == Some(&key)
            || pool.cached_block_hash_to_block().contain(&key, block)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

impl KVCacheManager {
    /// Validates a lookup result handed back to `allocate_slots`: one list per
    /// group, ids in range, ref-0 hits still in the free queue, no hits for a
    /// running request or a request that already holds blocks, none with caching
    /// off.
    pub(super) fn check_hits(
        &self,
        rid: &str,
        hits: GroupedBlocks<'_>,
        running: bool,
    ) -> Result<()> {
        let n = self.num_kv_cache_groups();
        if !hits.ends.is_empty() && hits.ends.len() != n {
            return Err(Error::InvalidArgument(format!(
                "new_computed_blocks has {} groups; the manager has {n}",
                hits.ends.len()
            )));
        }
        if self.coordinator.hisparse().is_some() {
            for g in 0..hits.ends.len() {
                self.coordinator.pool_of(g).validate_touch(hits.group(g))?;
            }
        } else {
            self.block_pool().validate_touch(hits.ids)?;
        }
        if hits.ids.is_empty() {
            return Ok(());
        }
        if running {
            return Err(running_cannot_adopt(rid));
        }
        if !self.enable_caching() && hits.ids.iter().any(|&b| b != NULL_BLOCK_ID) {
            return Err(Error::InvalidArgument(
                "computed blocks must be empty when prefix caching is disabled".into(),
            ));
        }
        if let Some(state) = self.coordinator.request(rid) {
            for (g, m) in self.coordinator.managers().iter().enumerate() {
                let takes_hits = !matches!(
                    m.base().spec.kind,
                    ManagerKind::CrossAttention | ManagerKind::CircularBuffer
                );
                if takes_hits && !state.groups[g].blocks.is_empty() {
                    return Err(Error::InvalidArgument(format!(
                        "request {rid:?} already has blocks and cannot adopt prefix hits"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The hit handed back must cover the computed tokens the caller claims for it:
    /// in every attention group that caches, at least `num_local / block_size`
    /// blocks (the blocks the caching plan counts as already cached). A shorter hit
    /// (`num_new_computed_tokens` beyond the hit the lookup returned) would claim
    /// tokens no block holds; vLLM takes it and leaves the request's cached count
    /// past its table. Empty hits (no lookup, or a connector's external tokens) are
    /// not checked.
    pub(super) fn check_hits_cover(&self, hits: GroupedBlocks<'_>, num_local: usize) -> Result<()> {
        if hits.ids.is_empty() || self.coordinator.hisparse().is_some() {
            return Ok(());
        }
        for (g, m) in self.coordinator.managers().iter().enumerate() {
            let b = m.base();
            // Attention groups' hits cover the hit (null blocks stand for what a
            // window skips); Mamba's and the auxiliary groups' do not.
            let full_length = matches!(
                b.spec.kind,
                ManagerKind::FullAttention
                    | ManagerKind::SlidingWindow { .. }
                    | ManagerKind::ChunkedLocal { .. }
            );
            let held = hits.group(g).len();
            if full_length && b.spec.prefix_cacheable && held < num_local / b.block_size {
                return Err(Error::InvalidArgument(format!(
                    "{num_local} computed tokens claimed, but the hit of group {g} holds \
                     {held} blocks of {} tokens (num_new_computed_tokens beyond the hit \
                     handed back)",
                    b.block_size
                )));
            }
        }
        Ok(())
    }

    /// The stale or malformed hits vLLM accepts, rejected in the checked mode
    /// (`HSCACHE_CHECK_INVARIANTS=1`): in a full-attention group every hit block
    /// must be a cached block (not the null block, not evicted, reset or reassigned
    /// since the lookup: it still carries a hash), appear once, and the hit must
    /// cover `num_new_computed_tokens`. Off by default: vLLM's own tests hand
    /// `allocate_slots` hand-made hits.
    #[cold]
    #[inline(never)]
    pub(super) fn check_hits_strictly(
        &self,
        hits: GroupedBlocks<'_>,
        num_new_computed_tokens: usize,
    ) -> Result<()> {
        if self.coordinator.hisparse().is_some() || hits.ends.is_empty() {
            return Ok(());
        }
        let pool = self.block_pool();
        for (g, m) in self.coordinator.managers().iter().enumerate() {
            if !matches!(m.base().spec.kind, ManagerKind::FullAttention) {
                continue;
            }
            let group = hits.group(g);
            let mut seen: Vec<BlockId> = group.to_vec();
            seen.sort_unstable();
            if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
                return Err(Error::InvalidArgument(format!(
                    "new_computed_blocks group {g} holds block {} more than once",
                    w[0]
                )));
            }
            for &b in group {
                if b == NULL_BLOCK_ID {
                    return Err(Error::InvalidArgument(format!(
                        "new_computed_blocks group {g} holds the null block"
                    )));
                }
                if pool.block_hash(b).is_none() {
                    return Err(Error::InvalidArgument(format!(
                        "new_computed_blocks group {g}: block {b} is no longer cached \
                         (evicted, reset or reassigned since the lookup)"
                    )));
                }
            }
            let covered = group.len().saturating_mul(m.base().block_size);
            if num_new_computed_tokens > covered {
                return Err(Error::InvalidArgument(format!(
                    "num_new_computed_tokens = {num_new_computed_tokens} but the hit of \
                     group {g} covers {covered} tokens"
                )));
            }
        }
        Ok(())
    }

    /// `hits` with the groups that retain a longer hit cut to the blocks of
    /// `reused` tokens; None when no group does.
    pub(super) fn retained_hits(
        &self,
        hits: GroupedBlocks<'_>,
        reused: usize,
    ) -> Option<GroupedBlockIds> {
        let managers = self.coordinator.managers();
        if !managers.iter().any(|m| m.retains_longer_hit()) {
            return None;
        }
        let mut retained = GroupedBlockIds::with_capacity(hits.ids.len());
        for g in 0..hits.num_groups() {
            let group = hits.group(g);
            let keep = match managers.get(g) {
                Some(m) if m.retains_longer_hit() => cdiv(reused, m.base().block_size),
                _ => group.len(),
            };
            retained.push_group(&group[..keep.min(group.len())]);
        }
        Some(retained)
    }

    /// The checked mode's hash check of `hits` against `request.block_hashes` (see
    /// module docs): `Err(InvalidArgument)` naming the first block that is not cached
    /// under the request's own hash at its position.
    #[cold]
    #[inline(never)]
    pub(super) fn check_hits_are_the_requests<R: RequestLike>(
        &self,
        request: &R,
        hits: GroupedBlocks<'_>,
    ) -> Result<()> {
        if self.coordinator.hisparse().is_some() || hits.ids.is_empty() {
            return Ok(());
        }
        let hashes = request.block_hashes()?;
        let pool = self.block_pool();
        for (g, m) in self.coordinator.managers().iter().enumerate() {
            let base = m.base();
            let group = hits.group(g);
            if group.is_empty() {
                continue;
            }
            let placeholders = hits_hold_placeholders(&base.spec.kind);
            let scale = pool.hash_scale(base.block_size)?;
            for (i, &b) in group.iter().enumerate() {
                if b == NULL_BLOCK_ID {
                    if placeholders {
                        continue;
                    }
                    return Err(Error::InvalidArgument(format!(
                        "new_computed_blocks group {g} holds the null block at position {i}"
                    )));
                }
                if !cached_at(pool, hashes, b, base.group_id, i, scale)? {
                    return Err(Error::InvalidArgument(format!(
                        "new_computed_blocks group {g}: block {b} at position {i} is not cached \
                         under request {:?}'s hash there (a hit of another request, or one \
                         evicted, reset or reassigned since the lookup)",
                        request.request_id()
                    )));
                }
            }
        }
        Ok(())
    }
}
