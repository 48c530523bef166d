//! Spills: writing resident pages back to the host, and host copy-on-write.
//!
//! Mirrors vLLM 0.33 `HiSparseCoordinator.plan_prefix_materialization`,
//! `_plan_page_transfer`, `build_offload_command`, `update_spills`,
//! `_apply_enqueued_spills`, `_complete_host_writes`, `has_pending_reclamation`,
//! `has_pending_work`, `take_host_block_copies` and
//! `release_completed_host_copies`.
//!
//! Key properties:
//! - A planned spill leases both endpoints (the host block and the page's GPU block
//!   in every resident group) until every worker reported it: the GPU leases drop
//!   when the enqueue count is reached, the host lease when the transfer completed.
//! - At most `max_spill_pages` transfers wait to be sent; sealed pages are written
//!   back eagerly, from the durable prefix on.
//! - A completed write makes its page valid (a restore re-validates nothing) and,
//!   for a request that can read from the host, releases the page; then the
//!   durable prefix grows and publishes. Completions of a freed request publish its
//!   detached pages instead.

use smallvec::SmallVec;

use super::{HiSparseCoordinator, HiSparseCtx, PublicationRequests, StateId};
use crate::error::{Error, Result};
use crate::types::{cdiv, BlockId, NULL_BLOCK_ID};

/// One page copy between the host and the resident groups (vLLM's
/// `SparseKVPageTransfer`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTransfer {
    pub transfer_id: u64,
    pub host_block_id: BlockId,
    pub resident_block_ids: SmallVec<[BlockId; 4]>,
    /// Written after the step's forward pass (a write-back), else before it (an
    /// import's restore).
    pub after_forward: bool,
    pub restore: bool,
}

/// A planned transfer until every worker reported it (vLLM's `_PendingSpill`).
#[derive(Clone, Debug)]
pub struct PendingSpill {
    pub transfer_id: u64,
    pub request_id: Box<str>,
    pub page: usize,
    pub state: StateId,
    pub host_block: BlockId,
    pub resident_blocks: SmallVec<[BlockId; 4]>,
    pub restore: bool,
    pub expected_worker_completions: u64,
    pub worker_completions: u64,
    pub enqueue_applied: bool,
}

impl HiSparseCoordinator {
    /// vLLM's `plan_prefix_materialization`: writes back every sealed page of the
    /// first `num_computed_tokens` that has no host copy yet, within the budget.
    pub fn plan_prefix_materialization(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        num_computed_tokens: usize,
    ) -> Result<()> {
        if !self.has_resident() {
            return Ok(());
        }
        let bs = self.layout.block_size;
        let num_pages = num_computed_tokens / bs;
        let importing_pages = cdiv(
            self.pending_imports.get(request_id).copied().unwrap_or(0),
            bs,
        );
        let id = self.get_request_state(request_id);
        let mut budget = self
            .layout
            .max_spill_pages
            .saturating_sub(self.spills_to_send.len());
        let first_page = self
            .state(id)
            .map_or(0, |s| s.ready_prefix_pages)
            .max(importing_pages);
        for page in first_page..num_pages {
            if budget == 0 {
                break;
            }
            let skip = self.state(id).is_some_and(|s| {
                s.pending_pages.contains_key(&page) || s.valid_pages.contains(&page)
            });
            if skip {
                continue;
            }
            let mut resident = true;
            for &g in &self.layout.resident_groups {
                if ctx.resident_page(g, request_id, page)?.is_none() {
                    resident = false;
                    break;
                }
            }
            if !resident {
                continue;
            }
            if self.plan_page_transfer(ctx, request_id, page, true, false)? {
                budget -= 1;
            }
        }
        Ok(())
    }

    /// vLLM's `_plan_page_transfer`: leases both endpoints and queues the transfer;
    /// false if the page has one in flight or lacks an endpoint.
    pub(crate) fn plan_page_transfer(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        page: usize,
        after_forward: bool,
        restore: bool,
    ) -> Result<bool> {
        let id = self.get_request_state(request_id);
        if self
            .state(id)
            .is_some_and(|s| s.pending_pages.contains_key(&page))
        {
            return Ok(false);
        }
        let host = self.layout.host_group;
        let Some(&host_block) = ctx.table(request_id, host).and_then(|t| t.get(page)) else {
            return Ok(false);
        };
        if host_block == NULL_BLOCK_ID {
            return Ok(false);
        }
        let mut blocks: SmallVec<[BlockId; 4]> = SmallVec::new();
        for &g in &self.layout.resident_groups {
            match ctx.resident_page(g, request_id, page)? {
                Some(b) => blocks.push(b),
                None => return Ok(false),
            }
        }
        ctx.with_host(host, None, |pool| pool.touch(&[host_block]))?;
        for &b in &blocks {
            ctx.pool.touch(&[b])?;
        }
        let transfer_id = self.next_spill_id;
        self.next_spill_id += 1;
        self.spills_to_send.push(PageTransfer {
            transfer_id,
            host_block_id: host_block,
            resident_block_ids: blocks.clone(),
            after_forward,
            restore,
        });
        self.pending_spills.insert(
            transfer_id,
            PendingSpill {
                transfer_id,
                request_id: request_id.into(),
                page,
                state: id,
                host_block,
                resident_blocks: blocks,
                restore,
                expected_worker_completions: 0,
                worker_completions: 0,
                enqueue_applied: false,
            },
        );
        self.retain_state(id);
        self.state_mut(id)?.pending_pages.insert(page, transfer_id);
        Ok(true)
    }

    /// vLLM's `build_offload_command`: the planned transfers, drained (None without
    /// resident groups).
    pub fn build_offload_command(&mut self) -> Option<Vec<PageTransfer>> {
        if !self.has_resident() {
            return None;
        }
        Some(std::mem::take(&mut self.spills_to_send))
    }

    /// vLLM's `has_pending_reclamation`: an in-flight spill will free a device or
    /// host block when it completes.
    pub fn has_pending_reclamation(&self, ctx: &HiSparseCtx<'_>) -> Result<bool> {
        let host_pool = ctx.host_pool(self.layout.host_group)?;
        for p in self.pending_spills.values() {
            if host_pool.ref_cnt(p.host_block) == 1 {
                return Ok(true);
            }
            if self.request_states.contains_key(&*p.request_id)
                && self.can_read_from_host(ctx, &p.request_id)?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// vLLM's `has_pending_work`.
    pub fn has_pending_work(&self) -> bool {
        !self.spills_to_send.is_empty()
            || !self.pending_spills.is_empty()
            || !self.retained_copies.is_empty()
    }

    /// vLLM's `update_spills`: the workers' enqueue and completion counts by
    /// transfer id, in the order given.
    pub fn update_spills(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        enqueued: &[(u64, u64)],
        completed: &[(u64, u64)],
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        for &(id, count) in enqueued {
            if let Some(p) = self.pending_spills.get_mut(&id) {
                if p.expected_worker_completions == 0 {
                    p.expected_worker_completions = count;
                }
            }
        }
        for &(id, count) in completed {
            if let Some(p) = self.pending_spills.get_mut(&id) {
                p.worker_completions += count;
            }
        }
        self.apply_enqueued_spills(ctx)?;
        self.complete_host_writes(ctx, pubs)
    }

    /// vLLM's `_apply_enqueued_spills`: drops the GPU leases of transfers every
    /// worker completed.
    fn apply_enqueued_spills(&mut self, ctx: &mut HiSparseCtx<'_>) -> Result<()> {
        for p in self.pending_spills.values_mut() {
            if p.enqueue_applied
                || p.expected_worker_completions == 0
                || p.worker_completions < p.expected_worker_completions
            {
                continue;
            }
            for &b in &p.resident_blocks {
                ctx.pool.free_blocks(&[b])?;
            }
            p.enqueue_applied = true;
        }
        Ok(())
    }

    /// vLLM's `_complete_host_writes`.
    fn complete_host_writes(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        let completed: Vec<u64> = self
            .pending_spills
            .values()
            .filter(|p| {
                p.enqueue_applied
                    && p.expected_worker_completions > 0
                    && p.worker_completions >= p.expected_worker_completions
            })
            .map(|p| p.transfer_id)
            .collect();
        let host = self.layout.host_group;
        let mut completed_requests: Vec<Box<str>> = Vec::new();
        for transfer_id in completed {
            let Some(p) = self.pending_spills.remove(&transfer_id) else {
                continue;
            };
            let state = self.state_mut(p.state)?;
            state.pending_pages.remove(&p.page);
            let current = self.request_states.get(&*p.request_id) == Some(&p.state);
            if current {
                let state = self.state_mut(p.state)?;
                if !p.restore {
                    state.valid_pages.insert(p.page);
                }
                if state.valid_pages.contains(&p.page) {
                    self.page_became_clean(ctx, &p.request_id, p.state, p.page)?;
                    if p.restore {
                        self.record_copy(ctx, &p.request_id, p.page, p.host_block)?;
                    }
                }
                if !completed_requests.contains(&p.request_id) {
                    completed_requests.push(p.request_id.clone());
                }
            } else if self.state(p.state).is_some_and(|s| s.publication.is_some()) {
                if !p.restore {
                    self.state_mut(p.state)?.valid_pages.insert(p.page);
                }
                self.publish_detached(ctx, p.state)?;
            }
            ctx.with_host(host, None, |pool| pool.free_blocks(&[p.host_block]))?;
            self.release_state(p.state);
        }
        // vLLM iterates these ids as a `set`.
        let hashes = completed_requests
            .iter()
            .map(|rid| pubs.request_hash(rid))
            .collect::<Result<Vec<_>>>()?;
        for k in super::cpython_set_order(&hashes) {
            let rid = &completed_requests[k];
            let Some(&id) = self.request_states.get(&**rid) else {
                return Err(Error::Internal(format!("no HiSparse state for {rid:?}")));
            };
            let state = self.state_mut(id)?;
            while state.valid_pages.contains(&state.ready_prefix_pages) {
                state.ready_prefix_pages += 1;
            }
            self.publish_if_ready(ctx, rid)?;
        }
        Ok(())
    }

    /// vLLM's `take_host_block_copies`: the source group's host copy-on-write pairs,
    /// retained (both endpoints) until the worker reports them run.
    pub fn take_host_block_copies(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
    ) -> Result<Vec<(BlockId, BlockId)>> {
        let pairs = ctx
            .source_mut(self.layout.host_group)?
            .take_host_cow_copies();
        for &(src, cow) in &pairs {
            self.retained_copies.insert(cow, (src, cow));
        }
        Ok(pairs)
    }

    /// vLLM's `release_completed_host_copies`: drops both endpoints of the host
    /// copies the worker ran (`dst_block_ids` in the order reported).
    pub fn release_completed_host_copies(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        dst_block_ids: &[BlockId],
    ) -> Result<()> {
        let mut blocks: Vec<BlockId> = Vec::new();
        for dst in dst_block_ids {
            if let Some((src, cow)) = self.retained_copies.remove(dst) {
                blocks.push(src);
                blocks.push(cow);
            }
        }
        if blocks.is_empty() {
            return Ok(());
        }
        blocks.reverse();
        ctx.with_host(self.layout.host_group, None, |pool| {
            pool.free_blocks(&blocks)
        })
    }
}
