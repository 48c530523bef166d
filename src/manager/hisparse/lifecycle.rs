//! A request's admission and release, and the pages the pool takes back.
//!
//! Mirrors vLLM 0.33 `HiSparseCoordinator.commit_computed_blocks`,
//! `record_pending_host_import`, `_on_block_reused`, `_drop_copy`, `_lose_page` and
//! `free`.
//!
//! Key properties:
//! - A prefix hit on host pages makes them valid and durable at once; their GPU
//!   copies are adopted later (`update_residency`), after the admitting allocation.
//! - When the pool hands out an unpinned page, every request reading it loses the
//!   page: it reads the host from now on, the worker learns it (a stale page) and the
//!   request needs its hot region. A GPU copy indexed under a host hash is forgotten.
//! - Freeing a request releases its clean pages as free-queue copies (unpinned,
//!   still readable by a later hit); a finished request with spills in flight keeps
//!   its publication, and leases its host pages, until they complete.

use std::collections::BTreeSet;

use super::{HiSparseCoordinator, HiSparseCtx, PublicationRequests};
use crate::error::{Error, Result};
use crate::types::{BlockHashWithGroupId, BlockId, NULL_BLOCK_ID};

impl HiSparseCoordinator {
    // ---- admission hooks ------------------------------------------------------------

    /// vLLM's `commit_computed_blocks`: a prefix hit on host pages the request now
    /// references (the resident groups' `add_local_computed_blocks`).
    pub fn commit_computed_blocks(
        &mut self,
        ctx: &HiSparseCtx<'_>,
        request_id: &str,
        num_host_pages: usize,
    ) -> Result<()> {
        self.resident_requests.remove(request_id);
        if !self.has_resident() {
            return Ok(());
        }
        let host_len = ctx
            .table(request_id, self.layout.host_group)
            .map_or(0, <[BlockId]>::len);
        let num_host_pages = num_host_pages.min(host_len);
        if num_host_pages == 0 {
            return Ok(());
        }
        let id = self.get_request_state(request_id);
        let state = self.state_mut(id)?;
        state.valid_pages.extend(0..num_host_pages);
        state.ready_prefix_pages = state.ready_prefix_pages.max(num_host_pages);
        // Adopting pins copies out of the free pool, so it waits until the
        // admission's allocation ran (`update_residency`).
        state.pages_to_adopt = state.pages_to_adopt.max(num_host_pages);
        state.copies_recorded_blocks = state.copies_recorded_blocks.max(num_host_pages);
        Ok(())
    }

    /// vLLM's `record_pending_host_import`: an external load populates host pages.
    pub fn record_pending_host_import(&mut self, request_id: &str, num_tokens: usize) {
        self.resident_requests.remove(request_id);
        self.pending_imports.insert(request_id.into(), num_tokens);
    }

    // ---- reuse of unpinned pages ------------------------------------------------------

    /// Runs vLLM's `_on_block_reused` for every reuse notification of the device
    /// pool, in order.
    pub fn process_reused(&mut self, ctx: &mut HiSparseCtx<'_>) -> Result<()> {
        if !ctx.pool.has_reused_watched() {
            return Ok(());
        }
        for block in ctx.pool.take_reused_watched() {
            self.on_block_reused(ctx, block)?;
        }
        Ok(())
    }

    fn on_block_reused(&mut self, ctx: &mut HiSparseCtx<'_>, block: BlockId) -> Result<()> {
        if let Some(key) = self.copy_by_block.get(&block).copied() {
            self.drop_copy(&key);
        }
        if let Some(owners) = self.owners.remove(&block) {
            // A set in vLLM: each loss touches its own request only.
            let mut owners: Vec<_> = owners.into_iter().collect();
            owners.sort_unstable();
            for (rid, page) in owners {
                self.lose_page(ctx, &rid, page)?;
            }
        }
        Ok(())
    }

    /// vLLM's `_drop_copy`.
    pub(crate) fn drop_copy(&mut self, key: &BlockHashWithGroupId) {
        if let Some(blocks) = self.copies.remove(key) {
            for b in blocks {
                self.copy_by_block.remove(&b);
            }
        }
    }

    /// vLLM's `_lose_page`: the pool reused an unpinned page under the request.
    fn lose_page(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        page: usize,
    ) -> Result<()> {
        self.resident_requests.remove(request_id);
        let Some(&id) = self.request_states.get(request_id) else {
            return Ok(());
        };
        for &g in &self.layout.resident_groups {
            let table = ctx
                .requests
                .get(request_id)
                .and_then(|s| s.groups.get(g))
                .map(|gb| gb.blocks.as_slice());
            let m = ctx.managers[g]
                .hisparse_resident_mut()
                .ok_or_else(|| Error::Internal(format!("group {g} is not resident")))?;
            let Some(block) = m.drop_resident_page(request_id, table, page) else {
                continue;
            };
            if let Some(owners) = self.owners.get_mut(&block) {
                owners.remove(&(request_id.into(), page));
            }
        }
        let state = self.state_mut(id)?;
        state.unpinned_pages.remove(&page);
        if page < state.synced_pages {
            state.stale_pages.insert(page);
        }
        for &g in &self.layout.hot_groups {
            ctx.hot_mut(g)?.require_hot(request_id);
        }
        Ok(())
    }

    // ---- freeing ----------------------------------------------------------------------

    /// vLLM's `free`: detaches the request; its clean pages stay readable copies in
    /// the pool. A finished request's publication outlives it while its spills are
    /// in flight (its host pages are leased until they publish).
    pub fn free(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        // One piece: the publication is settled (kept for in-flight spills, or dropped)
        // before the residency walk, and both run before `release_state(id)` ends the state.
        self.resident_requests.remove(request_id);
        self.pending_imports.remove(request_id);
        let Some(id) = self.request_states.remove(request_id) else {
            return Ok(());
        };
        let host_group = self.layout.host_group;
        let detach = match self.state(id) {
            Some(state) => match &state.publication {
                Some(p) if !state.pending_pages.is_empty() => pubs.is_finished(p.id)?,
                _ => false,
            },
            None => false,
        };
        if detach {
            let (host_blocks, num_cached) = match ctx.requests.get(request_id) {
                Some(s) => (
                    s.groups[host_group].blocks.clone(),
                    s.groups[host_group].num_cached_block.unwrap_or(0),
                ),
                None => (Vec::new(), 0),
            };
            let state = self.state_mut(id)?;
            let Some(p) = state.publication.as_mut() else {
                return Err(Error::Internal("publication vanished".into()));
            };
            let detached: Vec<BlockId> = host_blocks.into_iter().take(p.num_pages).collect();
            p.num_cached_blocks = num_cached;
            p.detached_blocks = Some(detached.clone());
            // Completed pages need leases too: another allocation may evict them
            // before the remaining copies finish and the prefix publishes.
            ctx.with_host(host_group, None, |host| host.touch(&detached))?;
        } else {
            // Preemption can cancel a scheduled forward after its spills were
            // planned, so its copies do not prove the KV was computed.
            self.set_publication(id, None)?;
        }
        let (unpinned, valid, pending) = {
            let s = self
                .state(id)
                .ok_or_else(|| Error::Internal("state gone".into()))?;
            (
                s.unpinned_pages.clone(),
                s.valid_pages.clone(),
                s.pending_pages.keys().copied().collect::<BTreeSet<_>>(),
            )
        };
        let mut row = Vec::new();
        for &g in &self.layout.resident_groups.clone() {
            row.clear();
            let table = ctx
                .requests
                .get(request_id)
                .map(|s| s.groups[g].blocks.clone())
                .unwrap_or_default();
            ctx.resident(g)?
                .residency_row(request_id, &table, 0, &mut row);
            // Tail first, so a prefix loses its tail pages before its head.
            for page in (0..row.len()).rev() {
                let block = row[page];
                if block == NULL_BLOCK_ID {
                    continue;
                }
                if unpinned.contains(&page) {
                    if let Some(owners) = self.owners.get_mut(&block) {
                        owners.remove(&(request_id.into(), page));
                    }
                } else if valid.contains(&page) && !pending.contains(&page) {
                    ctx.pool.unpin_blocks(&[block])?;
                } else {
                    continue;
                }
                let m = ctx.managers[g]
                    .hisparse_resident_mut()
                    .ok_or_else(|| Error::Internal(format!("group {g} is not resident")))?;
                m.drop_resident_page(request_id, Some(&table), page);
            }
        }
        self.release_state(id);
        Ok(())
    }
}
