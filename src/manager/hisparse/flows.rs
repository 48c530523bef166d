//! The KV-cache coordinator's calls on a HiSparse layout.
//!
//! vLLM's HiSparse managers call their coordinator from inside their hooks (a
//! resident group's admission commits the host pages, the source group's caching
//! publishes, the source group's free detaches the request), and the device pool's
//! reuse callbacks fire inside `get_new_blocks`. Here the KV-cache coordinator makes
//! those calls at the same points of its group loops: [`KVCacheCoordinator`]'s
//! allocation, caching, freeing and reset go through these versions when the layout
//! has a HiSparse source group. Each loop visits the groups in order and drains the
//! reuse notifications after every group, so what a later group reads is what vLLM's
//! callbacks would have left.
//!
//! Where it differs: a HiSparse free is not all-or-nothing (vLLM's is not either:
//! each group frees in turn); a broken invariant midway poisons the manager.

use std::ops::Range;

use smallvec::SmallVec;

use super::{HiSparseCoordinator, HiSparseCtx, HiSparseLayout, PublicationRequests};
use crate::error::{Error, Result};
use crate::manager::coordinator::KVCacheCoordinator;
use crate::manager::request::PlannedHashes;
use crate::manager::single_type::{running_cannot_adopt, CacheQuery};
use crate::manager::spec::ManagerKind;
use crate::types::{cdiv, BlockId};

impl KVCacheCoordinator {
    /// Builds the HiSparse coordinator of a layout with HiSparse groups (vLLM's
    /// `get_hisparse_coordinator`, run with the manager).
    pub(crate) fn enable_hisparse(&mut self, num_blocks: u32, max_model_len: usize) -> Result<()> {
        let specs: Vec<_> = self
            .managers
            .iter()
            .map(|m| m.base().spec.clone())
            .collect();
        let sizes: Vec<usize> = self.managers.iter().map(|m| m.base().block_size).collect();
        let layout = HiSparseLayout::new(
            &specs,
            num_blocks,
            max_model_len,
            self.num_reprefillable_tokens(),
            |g| sizes[g],
        )?;
        let Some(layout) = layout else {
            return Ok(());
        };
        let has_resident = !layout.resident_groups.is_empty();
        for &g in &layout.hot_groups {
            if let Some(h) = self.managers[g].hisparse_hot_mut() {
                h.set_has_resident_groups(has_resident);
            }
        }
        self.hisparse = Some(Box::new(HiSparseCoordinator::new(layout)));
        Ok(())
    }

    /// The HiSparse coordinator and the rest of this coordinator, borrowed apart.
    pub(crate) fn hisparse_split(&mut self) -> Option<(&mut HiSparseCoordinator, HiSparseCtx<'_>)> {
        let h = self.hisparse.as_deref_mut()?;
        Some((
            h,
            HiSparseCtx {
                pool: &mut self.pool,
                managers: &mut self.managers,
                requests: &mut self.requests,
            },
        ))
    }

    /// Runs `f` on the HiSparse coordinator (`Err` on a layout without one).
    pub fn with_hisparse<T>(
        &mut self,
        f: impl FnOnce(&mut HiSparseCoordinator, &mut HiSparseCtx<'_>) -> Result<T>,
    ) -> Result<T> {
        let Some((h, mut ctx)) = self.hisparse_split() else {
            return Err(Error::InvalidArgument(
                "this KV-cache layout has no HiSparse group".into(),
            ));
        };
        f(h, &mut ctx)
    }

    /// The HiSparse coordinator, read only.
    #[inline]
    pub fn hisparse(&self) -> Option<&HiSparseCoordinator> {
        self.hisparse.as_deref()
    }

    /// Drains the device pool's reuse notifications (vLLM's callbacks).
    pub(crate) fn process_reused(&mut self) -> Result<()> {
        if !self.pool.has_reused_watched() {
            return Ok(());
        }
        match self.hisparse_split() {
            Some((h, mut ctx)) => h.process_reused(&mut ctx),
            None => {
                self.pool.take_reused_watched();
                Ok(())
            }
        }
    }

    /// `allocate_new_computed_blocks` on a HiSparse layout.
    pub(crate) fn hisparse_allocate_new_computed_blocks<'h>(
        &mut self,
        request_id: &str,
        hits: &dyn Fn(usize) -> &'h [BlockId],
        num_local: usize,
        num_external: usize,
        skip_zeroing: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let n = self.managers.len();
        let state = self.state_mut(request_id).1;
        if state.is_running() {
            if (0..n).any(|g| !hits(g).is_empty()) {
                return Err(running_cannot_adopt(request_id));
            }
            return Ok(());
        }
        for g in 0..n {
            self.group_hook(request_id, g, |m, pool, gb| {
                m.add_local_computed_blocks(pool, request_id, gb, hits(g), num_local, num_external)
            })?;
        }
        // vLLM's resident groups commit their host pages as they adopt their (null)
        // hits; nothing in between reads what the commit changes.
        if let Some((h, ctx)) = self.hisparse_split() {
            if h.has_resident() {
                let num_host_pages = cdiv(num_local, h.layout().block_size);
                h.commit_computed_blocks(&ctx, request_id, num_host_pages)?;
            }
        }
        if num_external > 0 {
            if let Some(h) = self.hisparse.as_deref_mut() {
                h.record_pending_host_import(request_id, num_local + num_external);
            }
            for g in 0..n {
                self.group_hook(request_id, g, |m, pool, gb| {
                    m.allocate_external_computed_blocks(
                        pool,
                        request_id,
                        gb,
                        num_local,
                        num_external,
                        !skip_zeroing(g),
                    )
                })?;
                self.process_reused()?;
            }
        }
        Ok(())
    }

    /// Runs a hook of group `g` on the request's table there.
    fn group_hook(
        &mut self,
        request_id: &str,
        g: usize,
        f: impl FnOnce(
            &mut dyn crate::manager::single_type::SingleTypeManager,
            &mut crate::pool::BlockPool,
            &mut crate::manager::single_type::GroupBlocks,
        ) -> Result<()>,
    ) -> Result<()> {
        let state = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))?;
        f(&mut *self.managers[g], &mut self.pool, &mut state.groups[g])
    }

    /// One group's `allocate_new_blocks` (a single-type manager called directly).
    pub(crate) fn group_allocate_new_blocks(
        &mut self,
        g: usize,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let slot = self.state_mut(request_id).0;
        self.group_hook(request_id, g, |m, pool, gb| {
            m.allocate_new_blocks(
                pool,
                slot,
                request_id,
                gb,
                num_tokens,
                num_tokens_main_model,
                out,
            )
        })?;
        self.process_reused()
    }

    /// One group's `get_num_blocks_to_allocate` (a single-type manager called
    /// directly).
    pub(crate) fn group_num_blocks_to_allocate(
        &mut self,
        g: usize,
        q: &crate::manager::single_type::NumBlocksQuery<'_>,
    ) -> Result<i64> {
        let slot = self.slot_of(q.request_id).unwrap_or(u32::MAX);
        let req = self
            .requests
            .get(q.request_id)
            .and_then(|s| s.groups.get(g));
        self.managers[g].get_num_blocks_to_allocate(&self.pool, slot, req, q)
    }

    /// `allocate_new_blocks` on a HiSparse layout.
    pub(crate) fn hisparse_allocate_new_blocks(
        &mut self,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        num_encoder_tokens: usize,
        out: &mut Vec<BlockId>,
        ends: &mut SmallVec<[usize; 4]>,
    ) -> Result<()> {
        let slot = self.state_mut(request_id).0;
        for g in 0..self.managers.len() {
            let tokens = if self.managers[g].base().spec.kind == ManagerKind::CrossAttention {
                num_encoder_tokens
            } else {
                num_tokens
            };
            self.group_hook(request_id, g, |m, pool, gb| {
                m.allocate_new_blocks(
                    pool,
                    slot,
                    request_id,
                    gb,
                    tokens,
                    num_tokens_main_model,
                    out,
                )
            })?;
            ends.push(out.len());
            self.process_reused()?;
        }
        Ok(())
    }

    /// `cache_blocks` on a HiSparse layout: the source group publishes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hisparse_cache_blocks(
        &mut self,
        request_id: &str,
        block_hashes: &PlannedHashes,
        cacheable: &[usize],
        boundaries: &[i64],
        num_prompt_tokens: usize,
        request_num_computed_tokens: usize,
        shared_prefix_boundary: usize,
    ) -> Result<()> {
        let retention = self.retention_interval();
        let slot = self
            .slot_of(request_id)
            .ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))?;
        for (g, &num_tokens) in cacheable.iter().enumerate() {
            if !self.managers[g].base().enable_caching {
                continue;
            }
            if self.managers[g].host_pool().is_some() {
                let Some((h, mut ctx)) = self.hisparse_split() else {
                    return Err(Error::Internal("no HiSparse coordinator".into()));
                };
                h.publish_when_ready(
                    &mut ctx,
                    request_id,
                    block_hashes,
                    num_tokens,
                    retention,
                    boundaries,
                )?;
                continue;
            }
            let q = CacheQuery {
                request_id,
                block_hashes,
                num_tokens,
                retention_interval: retention,
                replay_boundaries: boundaries,
                num_prompt_tokens,
                num_computed_tokens: request_num_computed_tokens,
                shared_prefix_boundary,
            };
            self.group_hook(request_id, g, |m, pool, gb| {
                m.cache_blocks(pool, slot, gb, &q)
            })?;
        }
        Ok(())
    }

    /// vLLM's `free` / `pop_blocks_for_free` on a HiSparse layout: group by group,
    /// the source group detaching the request from the HiSparse coordinator first.
    /// With `out`, the blocks are handed back (group after group; the returned range
    /// is the host group's) instead of freed.
    pub(crate) fn hisparse_free(
        &mut self,
        request_id: &str,
        pubs: &dyn PublicationRequests,
        mut out: Option<&mut Vec<BlockId>>,
    ) -> Result<Option<Range<usize>>> {
        if self.requests.get(request_id).is_none() {
            // vLLM still detaches the request (its spills may be in flight).
            if let Some((h, mut ctx)) = self.hisparse_split() {
                h.free(&mut ctx, request_id, pubs)?;
            }
            return Ok(None);
        }
        let mut host_range = None;
        let mut blocks = Vec::new();
        // vLLM 0.32 hands back (and frees) the leading nulls too.
        let keep_nulls = self.pool.vllm_rules().null_block_ref_counted;
        for g in 0..self.managers.len() {
            let is_host = self.managers[g].host_pool().is_some();
            if is_host {
                if let Some((h, mut ctx)) = self.hisparse_split() {
                    h.free(&mut ctx, request_id, pubs)?;
                }
            }
            blocks.clear();
            if let Some(state) = self.requests.get(request_id) {
                self.managers[g].blocks_for_free(
                    request_id,
                    &state.groups[g],
                    keep_nulls,
                    &mut blocks,
                );
            }
            if let Some(out) = out.as_deref_mut() {
                let start = out.len();
                out.extend_from_slice(&blocks);
                if is_host {
                    host_range = Some(start..out.len());
                }
                continue;
            }
            blocks.reverse();
            if is_host {
                let m = &mut self.managers[g];
                let src = m
                    .hisparse_source_mut()
                    .ok_or_else(|| Error::Internal("no HiSparse source".into()))?;
                let r = src.host_pool_mut().free_blocks(&blocks);
                self.pool.absorb_host_events(src.host_pool_mut(), None);
                r?;
            } else {
                self.pool.free_blocks(&blocks)?;
            }
        }
        self.pop_request_state(request_id);
        Ok(host_range)
    }

    /// `reset_prefix_cache` on a HiSparse layout: each pool once, in the order the
    /// groups first use them (vLLM's `dict.fromkeys` of the managers' pools).
    pub(crate) fn hisparse_reset_prefix_cache(&mut self) -> Result<bool> {
        let host_first = self
            .managers
            .iter()
            .position(|m| m.host_pool().is_some())
            .is_some_and(|g| g == 0);
        let mut ok = true;
        if host_first {
            ok &= self.reset_host_prefix_cache()?;
            ok &= self.reset_device_prefix_cache()?;
        } else {
            ok &= self.reset_device_prefix_cache()?;
            ok &= self.reset_host_prefix_cache()?;
        }
        Ok(ok)
    }

    /// The device pool's `reset_prefix_cache`, with its reuse notifications.
    pub fn reset_device_prefix_cache(&mut self) -> Result<bool> {
        let ok = self.pool.reset_prefix_cache();
        self.process_reused()?;
        Ok(ok)
    }

    /// The host pool's `reset_prefix_cache` (true without one).
    pub fn reset_host_prefix_cache(&mut self) -> Result<bool> {
        let Some(g) = self.managers.iter().position(|m| m.host_pool().is_some()) else {
            return Ok(true);
        };
        let Some(src) = self.managers[g].hisparse_source_mut() else {
            return Ok(true);
        };
        let ok = src.host_pool_mut().reset_prefix_cache();
        self.pool.absorb_host_events(src.host_pool_mut(), None);
        Ok(ok)
    }
}
