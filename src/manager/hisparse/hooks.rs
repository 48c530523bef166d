//! HiSparse's after-group hooks: its calls from inside the KV-cache coordinator's
//! group loops.
//!
//! vLLM's HiSparse managers call their coordinator from inside their own hooks: a
//! resident group's `add_local_computed_blocks` commits the host pages, the source
//! group's `allocate_external_computed_blocks` records the pending host import, its
//! `cache_blocks` publishes and its `pop_blocks_for_free` detaches the request; the
//! device pool's reuse callbacks fire inside `get_new_blocks`. The KV-cache
//! coordinator runs one loop over the groups per call and calls these hooks at the
//! same points, group by group (on every other layout there is no HiSparse
//! coordinator and the loop pays one `None` check a group).
//!
//! Key properties:
//! - The device pool's reuse notifications are drained after every group that may
//!   have taken blocks (`after_allocate`), so what a later
//!   group reads is what vLLM's callbacks would have left.
//! - Each hook acts on its own group kind only and is a no-op elsewhere.

use super::{HiSparseCoordinator, HiSparseCtx, PublicationRequests};
use crate::error::Result;
use crate::manager::single_type::CacheQuery;
use crate::types::cdiv;

impl HiSparseCoordinator {
    /// After group `g` adopted the request's hits: a resident group commits the
    /// host pages the hit covers (vLLM's `HiSparseResidentManager
    /// .add_local_computed_blocks`; the host group precedes every resident group,
    /// so its table is already in place).
    pub(crate) fn after_adopt(
        &mut self,
        ctx: &HiSparseCtx<'_>,
        g: usize,
        request_id: &str,
        num_local_computed_tokens: usize,
    ) -> Result<()> {
        if !self.layout.resident_groups.contains(&g) {
            return Ok(());
        }
        let num_host_pages = cdiv(num_local_computed_tokens, self.layout.block_size);
        self.commit_computed_blocks(ctx, request_id, num_host_pages)
    }

    /// Before group `g` allocates the blocks of external tokens: the source group
    /// records the pending host import (vLLM's `HiSparseSourceManager
    /// .allocate_external_computed_blocks`).
    pub(crate) fn before_external(&mut self, g: usize, request_id: &str, num_tokens: usize) {
        if g == self.layout.host_group {
            self.record_pending_host_import(request_id, num_tokens);
        }
    }

    /// After a group may have taken blocks from the device pool: vLLM's reuse
    /// callbacks, in order.
    #[inline]
    pub(crate) fn after_allocate(&mut self, ctx: &mut HiSparseCtx<'_>) -> Result<()> {
        self.process_reused(ctx)
    }

    /// Group `g`'s `cache_blocks` when it is the source group: publishes the
    /// request's durable prefix (vLLM's `HiSparseSourceManager.cache_blocks` calls
    /// `publish_when_ready`). False for every other group: the manager caches.
    pub(crate) fn cache_group(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        g: usize,
        q: &CacheQuery<'_>,
    ) -> Result<bool> {
        if g != self.layout.host_group {
            return Ok(false);
        }
        self.publish_when_ready(
            ctx,
            q.request_id,
            q.block_hashes,
            q.num_tokens,
            q.retention_interval,
            q.replay_boundaries,
        )?;
        Ok(true)
    }

    /// Before group `g` hands back the request's blocks: the source group detaches
    /// the request first (vLLM's `HiSparseSourceManager.pop_blocks_for_free` calls
    /// `free`; the resident groups' later calls find it detached).
    pub(crate) fn before_free(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        g: usize,
        request_id: &str,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        if g != self.layout.host_group {
            return Ok(());
        }
        self.free(ctx, request_id, pubs)
    }
}
