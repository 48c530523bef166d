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

use super::{GroupedBlocks, KVCacheManager, ManagerKind, RequestLike};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::{BlockHashSource, BlockHashWithGroupId, BlockId, NULL_BLOCK_ID};

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
