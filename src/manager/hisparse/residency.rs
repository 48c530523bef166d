//! Residency: which GPU pages a request reads, and what the worker learns of it.
//!
//! Mirrors vLLM 0.33 `HiSparseCoordinator` (`_can_read_from_host`,
//! `_fills_admission_window`, `_resident_page_blocks`, `_unpin_page`,
//! `_unpin_clean_pages`, `_page_became_clean`, `_adopt_copies`, `update_residency`,
//! `advance_scheduled`, `build_row_mirrors`, `all_context_pages_resident`,
//! `take_residency_updates`).
//!
//! Key properties:
//! - A request reads from the host only once every hot group holds its region;
//!   until then its clean pages stay pinned. It asks for the region when the device
//!   pool runs low (`transition_watermark`) or its resident pages fill the
//!   admission window; the region is allocated on a later scheduling pass.
//! - A request that can read from the host releases every clean sealed page, tail
//!   first, except the last `ACTIVE_TAIL_PAGES` pages of the table.
//! - A new request's prefix hit adopts surviving GPU copies of its host pages only
//!   after its admitting allocation ran (adoption pins blocks the admission counted
//!   as free).
//! - Residency updates carry the stale pages (changed since sent) and the pages
//!   appended since the last update, per resident group; the table itself stays
//!   append-only.

use smallvec::SmallVec;

use super::{HiSparseCoordinator, HiSparseCtx, StateId, ACTIVE_TAIL_PAGES};
use crate::error::{Error, Result};
use crate::types::{cdiv, BlockId, NULL_BLOCK_ID};

/// One contiguous span of scheduled rows to mirror into the host cache (vLLM's
/// `SparseKVRowMirror`): row starts per resident group, and in the host pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowMirror {
    pub source_starts: SmallVec<[usize; 4]>,
    pub destination_start: usize,
    pub num_rows: usize,
}

/// A request's residency the worker lacks (vLLM's `SparseKVResidencyUpdate`):
/// `block_ids[k][i]` is page `pages[i]`'s block in resident group `k` (the null
/// block: read from the host).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidencyUpdate {
    pub pages: Vec<usize>,
    pub block_ids: Vec<Vec<BlockId>>,
}

impl HiSparseCoordinator {
    /// vLLM's `_can_read_from_host`: every hot group holds the request's region.
    pub fn can_read_from_host(&self, ctx: &HiSparseCtx<'_>, request_id: &str) -> Result<bool> {
        if self.layout.hot_groups.is_empty() {
            return Ok(false);
        }
        for &g in &self.layout.hot_groups {
            let len = ctx.table(request_id, g).map_or(0, <[BlockId]>::len);
            if !ctx.hot(g)?.has_hot(len) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// vLLM's `_fills_admission_window`.
    fn fills_admission_window(&self, ctx: &HiSparseCtx<'_>, request_id: &str) -> Result<bool> {
        for &g in &self.layout.resident_groups {
            let len = ctx.table(request_id, g).map_or(0, <[BlockId]>::len);
            if len >= ctx.resident(g)?.max_admission_blocks_per_request() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// vLLM's `_resident_page_blocks`: the page's block in every resident group, if
    /// it is resident everywhere and sealed behind the active tail.
    fn resident_page_blocks(
        &self,
        ctx: &HiSparseCtx<'_>,
        request_id: &str,
        page: usize,
    ) -> Result<Option<SmallVec<[BlockId; 4]>>> {
        let mut blocks = SmallVec::new();
        for &g in &self.layout.resident_groups {
            let num_pages = ctx.table(request_id, g).map_or(0, <[BlockId]>::len);
            let block = ctx.resident_page(g, request_id, page)?;
            match block {
                Some(b) if page + ACTIVE_TAIL_PAGES < num_pages => blocks.push(b),
                _ => return Ok(None),
            }
        }
        Ok(Some(blocks))
    }

    /// vLLM's `_unpin_page`: releases a clean page's references (it stays read).
    fn unpin_page(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        id: StateId,
        page: usize,
    ) -> Result<bool> {
        let state = self
            .state(id)
            .ok_or_else(|| Error::Internal("HiSparse state gone".into()))?;
        if state.pending_pages.contains_key(&page) || !state.valid_pages.contains(&page) {
            return Ok(false);
        }
        let Some(blocks) = self.resident_page_blocks(ctx, request_id, page)? else {
            return Ok(false);
        };
        for b in blocks {
            self.owners
                .entry(b)
                .or_default()
                .insert((request_id.into(), page));
            ctx.pool.unpin_blocks(&[b])?;
        }
        let state = self.state_mut(id)?;
        state.pinned_clean.remove(&page);
        state.unpinned_pages.insert(page);
        Ok(true)
    }

    /// vLLM's `_unpin_clean_pages`: tail first, so a prefix loses its tail pages
    /// before its head.
    fn unpin_clean_pages(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        id: StateId,
    ) -> Result<()> {
        let pages: Vec<usize> = self
            .state(id)
            .map(|s| s.pinned_clean.iter().rev().copied().collect())
            .unwrap_or_default();
        for page in pages {
            self.unpin_page(ctx, request_id, id, page)?;
        }
        Ok(())
    }

    /// vLLM's `_page_became_clean`.
    pub(crate) fn page_became_clean(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        id: StateId,
        page: usize,
    ) -> Result<()> {
        self.state_mut(id)?.pinned_clean.insert(page);
        if self.can_read_from_host(ctx, request_id)? {
            self.unpin_page(ctx, request_id, id, page)?;
        }
        Ok(())
    }

    /// vLLM's `_adopt_copies`: points host-only prefix pages at surviving GPU copies.
    fn adopt_copies(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        id: StateId,
        num_pages: usize,
    ) -> Result<()> {
        if self.copies.is_empty() {
            return Ok(());
        }
        let host = self.layout.host_group;
        let host_blocks: Vec<BlockId> = ctx
            .table(request_id, host)
            .map(|t| t[..num_pages.min(t.len())].to_vec())
            .unwrap_or_default();
        for (page, &host_block) in host_blocks.iter().enumerate() {
            if host_block == NULL_BLOCK_ID {
                continue;
            }
            let Some(key) = ctx.host_pool(host)?.block_hash(host_block).copied() else {
                continue;
            };
            let Some(copies) = self.copies.get(&key).cloned() else {
                continue;
            };
            for (&g, &block) in self
                .layout
                .resident_groups
                .clone()
                .iter()
                .zip(copies.iter())
            {
                let table = ctx
                    .requests
                    .get(request_id)
                    .map(|s| s.groups[g].blocks.clone());
                let m = ctx.managers[g]
                    .hisparse_resident_mut()
                    .ok_or_else(|| Error::Internal(format!("group {g} is not resident")))?;
                if m.adopt_resident_page(request_id, table.as_deref(), page, block) {
                    ctx.pool.touch(&[block])?;
                    let state = self.state_mut(id)?;
                    state.pinned_clean.insert(page);
                    if page < state.synced_pages {
                        state.stale_pages.insert(page);
                    }
                }
            }
        }
        Ok(())
    }

    /// vLLM's `update_residency`: the per-step residency policy of a scheduled
    /// request (see module docs).
    pub fn update_residency(&mut self, ctx: &mut HiSparseCtx<'_>, request_id: &str) -> Result<()> {
        if !self.has_resident() {
            return Ok(());
        }
        let id = self.get_request_state(request_id);
        let to_adopt = self.state(id).map_or(0, |s| s.pages_to_adopt);
        if to_adopt > 0 {
            self.adopt_copies(ctx, request_id, id, to_adopt)?;
            self.state_mut(id)?.pages_to_adopt = 0;
        }
        if !self.can_read_from_host(ctx, request_id)? {
            if ctx.pool.get_num_free_blocks() >= self.layout.transition_watermark
                && !self.fills_admission_window(ctx, request_id)?
            {
                return Ok(());
            }
            for &g in &self.layout.hot_groups {
                ctx.hot_mut(g)?.require_hot(request_id);
            }
            return Ok(());
        }
        self.unpin_clean_pages(ctx, request_id, id)
    }

    /// vLLM's `advance_scheduled`: each scheduled request's write-backs and
    /// residency, with the tokens computed once the step completes (the last
    /// `num_reprefillable_tokens` are not final and are not written back).
    pub fn advance_scheduled(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        requests: &[(Box<str>, usize)],
    ) -> Result<()> {
        if !self.has_resident() {
            return Ok(());
        }
        for (rid, num_tokens) in requests {
            let n = num_tokens.saturating_sub(self.layout.num_reprefillable_tokens);
            self.plan_prefix_materialization(ctx, rid, n)?;
            self.update_residency(ctx, rid)?;
        }
        Ok(())
    }

    /// vLLM's `build_row_mirrors`: the scheduled rows `(request, num_computed,
    /// num_scheduled)` mapped to resident and host rows. A page without a GPU copy
    /// or without a host block is skipped alone: its neighbours stay mirrorable.
    pub fn build_row_mirrors(
        &self,
        ctx: &HiSparseCtx<'_>,
        requests: &[(Box<str>, usize, usize)],
    ) -> Result<Vec<RowMirror>> {
        let mut mirrors = Vec::new();
        if !self.has_resident() {
            return Ok(mirrors);
        }
        let bs = self.layout.block_size;
        let host = self.layout.host_group;
        for (rid, num_computed, num_scheduled) in requests {
            let Some(host_blocks) = ctx.table(rid, host) else {
                continue;
            };
            let mut pos = *num_computed;
            let end = pos + num_scheduled;
            while pos < end {
                let (page, offset) = (pos / bs, pos % bs);
                let num_rows = (bs - offset).min(end - pos);
                pos += num_rows;
                let mut starts: SmallVec<[usize; 4]> = SmallVec::new();
                for &g in &self.layout.resident_groups {
                    match ctx.resident_page(g, rid, page)? {
                        Some(b) => starts.push(b as usize * bs + offset),
                        None => break,
                    }
                }
                if starts.len() != self.layout.resident_groups.len() {
                    continue;
                }
                let Some(&host_block) = host_blocks.get(page) else {
                    continue;
                };
                if host_block == NULL_BLOCK_ID {
                    continue;
                }
                mirrors.push(RowMirror {
                    source_starts: starts,
                    destination_start: host_block as usize * bs + offset,
                    num_rows,
                });
            }
        }
        Ok(mirrors)
    }

    /// vLLM's `all_context_pages_resident`: whether every scheduled request reads
    /// only resident KV (remembering the requests found so).
    pub fn all_context_pages_resident(
        &mut self,
        ctx: &HiSparseCtx<'_>,
        requests: &[(Box<str>, usize, usize)],
    ) -> Result<bool> {
        let Some(&first) = self.layout.resident_groups.first() else {
            return Ok(false);
        };
        let bs = self.layout.block_size;
        let mut row = Vec::new();
        for (rid, num_computed, num_scheduled) in requests {
            let num_pages = cdiv(num_computed + num_scheduled, bs);
            if ctx.table(rid, first).map_or(0, <[BlockId]>::len) < num_pages {
                return Ok(false);
            }
            if self.resident_requests.contains(&**rid) {
                continue;
            }
            for &g in &self.layout.resident_groups {
                row.clear();
                let table = ctx.table(rid, g).unwrap_or(&[]);
                ctx.resident(g)?.residency_row(rid, table, 0, &mut row);
                if row.contains(&NULL_BLOCK_ID) {
                    return Ok(false);
                }
            }
            self.resident_requests.insert(rid.clone());
        }
        Ok(true)
    }

    /// vLLM's `take_residency_updates`: the residency the worker lacks for each
    /// scheduled request (requests not scheduled keep theirs until they are).
    pub fn take_residency_updates(
        &mut self,
        ctx: &HiSparseCtx<'_>,
        request_ids: &[Box<str>],
    ) -> Result<Vec<(Box<str>, ResidencyUpdate)>> {
        let mut out = Vec::new();
        let Some(&first) = self.layout.resident_groups.first() else {
            return Ok(out);
        };
        for rid in request_ids {
            let id = self.get_request_state(rid);
            let num_pages = ctx.table(rid, first).map_or(0, <[BlockId]>::len);
            let state = self.state_mut(id)?;
            let start = state.synced_pages;
            if state.stale_pages.is_empty() && start >= num_pages {
                continue;
            }
            let stale: Vec<usize> = state.stale_pages.iter().copied().collect();
            let mut block_ids = Vec::with_capacity(self.layout.resident_groups.len());
            for &g in &self.layout.resident_groups {
                let mut ids = Vec::new();
                for &page in &stale {
                    ids.push(ctx.resident_page(g, rid, page)?.unwrap_or(NULL_BLOCK_ID));
                }
                let table = ctx.table(rid, g).unwrap_or(&[]);
                ctx.resident(g)?.residency_row(rid, table, start, &mut ids);
                block_ids.push(ids);
            }
            let mut pages = stale;
            pages.extend(start..num_pages);
            let state = self.state_mut(id)?;
            state.stale_pages.clear();
            state.synced_pages = num_pages;
            out.push((rid.clone(), ResidencyUpdate { pages, block_ids }));
        }
        Ok(out)
    }
}
