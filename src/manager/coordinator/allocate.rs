//! Allocation over the groups: `get_num_blocks_to_allocate` summed over them,
//! `allocate_new_computed_blocks` (every group adopts its hits before any group
//! allocates for external tokens) and `allocate_new_blocks`, with the per-group
//! entry points and HiSparse's `after_allocate` hook.

use smallvec::SmallVec;

use super::{state_of, KVCacheCoordinator, NumBlocksToAllocate};
use crate::error::{Error, Result};
use crate::manager::single_type::{running_cannot_adopt, NumBlocksQuery, RequestState};
use crate::manager::spec::ManagerKind;
use crate::request_table::RequestTable;
use crate::types::BlockId;

impl KVCacheCoordinator {
    /// HiSparse's `after_allocate` hook after a group took device blocks (nothing
    /// on other layouts).
    #[inline]
    fn after_allocate(&mut self) -> Result<()> {
        match self.hisparse_split() {
            Some((h, mut ctx)) => h.after_allocate(&mut ctx),
            None => Ok(()),
        }
    }

    /// Drains the device pool's reuse notifications (vLLM's callbacks) after a pool
    /// call outside the group loops.
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
        let state = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))?;
        self.managers[g].allocate_new_blocks(
            &mut self.pool,
            slot,
            request_id,
            &mut state.groups[g],
            num_tokens,
            num_tokens_main_model,
            out,
        )?;
        self.process_reused()
    }

    /// One group's `get_num_blocks_to_allocate` (a single-type manager called
    /// directly).
    pub(crate) fn group_num_blocks_to_allocate(
        &mut self,
        g: usize,
        q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        let slot = self.slot_of(q.request_id).unwrap_or(u32::MAX);
        let req = self
            .requests
            .get(q.request_id)
            .and_then(|s| s.groups.get(g));
        self.managers[g].get_num_blocks_to_allocate(&self.pool, slot, req, q)
    }

    /// vLLM's `get_num_blocks_to_allocate`, summed over the groups.
    pub fn get_num_blocks_to_allocate(&mut self, q: &NumBlocksToAllocate<'_>) -> Result<i64> {
        let request_id = q.request_id;
        // Mamba "align" keeps per-request state from here on (vLLM's defaultdict
        // creates the request's entry too).
        let slot = if self.mamba_align {
            Some(self.state_mut(request_id).0)
        } else {
            self.requests.get_mut_with_slot(request_id).map(|(s, _)| s)
        };
        let retention_applies = self.retention_interval == Some(0);
        let state = self.requests.get(request_id);
        let mut total: i64 = 0;
        for (g, m) in self.managers.iter_mut().enumerate() {
            let req = state.and_then(|s| s.groups.get(g));
            let cross = m.base().spec.kind == ManagerKind::CrossAttention;
            let gq = q.group_query(g, cross, retention_applies);
            total +=
                m.get_num_blocks_to_allocate(&self.pool, slot.unwrap_or(u32::MAX), req, &gq)?;
        }
        Ok(total)
    }

    /// vLLM's `allocate_new_computed_blocks`: every group adopts its hits, then every
    /// group allocates its external-token blocks (HiSparse's hooks run between the
    /// groups, where vLLM's HiSparse managers call their coordinator).
    pub fn allocate_new_computed_blocks<'h>(
        &mut self,
        request_id: &str,
        hits: &dyn Fn(usize) -> &'h [BlockId],
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
        skip_zeroing: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let n = self.managers.len();
        let spare = &mut self.spare_states;
        let handle = self
            .requests
            .handle_or_insert_with(request_id, || Self::new_state(spare, n));
        if self
            .requests
            .get_by_handle(handle)
            .is_some_and(RequestState::is_running)
        {
            if (0..n).any(|g| !hits(g).is_empty()) {
                return Err(running_cannot_adopt(request_id));
            }
            return Ok(());
        }
        for g in 0..n {
            let state = state_of(&mut self.requests, handle, request_id)?;
            self.managers[g].add_local_computed_blocks(
                &mut self.pool,
                request_id,
                &mut state.groups[g],
                hits(g),
                num_local_computed_tokens,
                num_external_computed_tokens,
            )?;
            if let Some((h, ctx)) = self.hisparse_split() {
                h.after_adopt(&ctx, g, request_id, num_local_computed_tokens)?;
            }
        }
        if num_external_computed_tokens == 0 {
            return Ok(());
        }
        let num_tokens = num_local_computed_tokens + num_external_computed_tokens;
        for g in 0..n {
            if let Some(h) = self.hisparse.as_deref_mut() {
                h.before_external(g, request_id, num_tokens);
            }
            let state = state_of(&mut self.requests, handle, request_id)?;
            self.managers[g].allocate_external_computed_blocks(
                &mut self.pool,
                request_id,
                &mut state.groups[g],
                num_local_computed_tokens,
                num_external_computed_tokens,
                !skip_zeroing(g),
            )?;
            self.after_allocate()?;
        }
        Ok(())
    }

    /// vLLM's `allocate_new_blocks`: every group's new blocks, appended to `out`
    /// group after group (`ends[g]` marks the end of group `g`).
    pub fn allocate_new_blocks(
        &mut self,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        num_encoder_tokens: usize,
        out: &mut Vec<BlockId>,
        ends: &mut SmallVec<[usize; 4]>,
    ) -> Result<()> {
        let n = self.managers.len();
        let spare = &mut self.spare_states;
        let handle = self
            .requests
            .handle_or_insert_with(request_id, || Self::new_state(spare, n));
        let slot = RequestTable::<RequestState>::slot_of_handle(handle);
        for g in 0..n {
            let m = &mut self.managers[g];
            let tokens = if m.base().spec.kind == ManagerKind::CrossAttention {
                num_encoder_tokens
            } else {
                num_tokens
            };
            let state = state_of(&mut self.requests, handle, request_id)?;
            m.allocate_new_blocks(
                &mut self.pool,
                slot,
                request_id,
                &mut state.groups[g],
                tokens,
                num_tokens_main_model,
                out,
            )?;
            ends.push(out.len());
            self.after_allocate()?;
        }
        Ok(())
    }
}
