//! Giving blocks back: `remove_skipped_blocks`, `free` / `free_handles`,
//! `pop_blocks_for_free`, the release of a request's tables (HiSparse's host
//! blocks included), the removal of its state, and the checked mode's refusal of a
//! pool `free_blocks` that would leave a live table short.

use smallvec::SmallVec;

use super::KVCacheCoordinator;
use crate::error::{Error, Result};
use crate::manager::hisparse::PublicationRequests;
use crate::manager::single_type::RequestState;
use crate::request_table::RequestTable;
use crate::types::{BlockId, NULL_BLOCK_ID};

/// Where [`KVCacheCoordinator::release`] hands a request's blocks.
enum Release<'a> {
    /// Freed: gathered into this scratch, then freed.
    Free(&'a mut Vec<BlockId>),
    /// Handed back (`pop_blocks_for_free`), appended here.
    Pop(&'a mut Vec<BlockId>),
}

impl KVCacheCoordinator {
    /// Refuses a `free_blocks` of the shared pool that would leave a block with
    /// fewer references than the live block tables holding it (a caller freeing a
    /// running request's block: vLLM takes it, and the block can then be handed to
    /// another request while the first still reads it). Scans every table: the
    /// checked mode's check, not the hot path's.
    #[cold]
    #[inline(never)]
    pub fn check_free_keeps_tables(&self, ids: &[BlockId]) -> Result<()> {
        let mut freed: Vec<(BlockId, u32)> = Vec::new();
        for &b in ids.iter().filter(|&&b| b != NULL_BLOCK_ID) {
            self.pool.check_block_id(i64::from(b))?;
            match freed.iter_mut().find(|(id, _)| *id == b) {
                Some((_, n)) => *n += 1,
                None => freed.push((b, 1)),
            }
        }
        for &(b, n) in &freed {
            let mut holders = 0u32;
            let mut first = None;
            for (rid, state) in self.requests.iter() {
                for (g, gb) in state.groups.iter().enumerate() {
                    if self.managers[g].host_pool().is_some() {
                        continue;
                    }
                    let k = gb.blocks.iter().filter(|&&x| x == b).count() as u32;
                    if k > 0 {
                        holders += k;
                        first.get_or_insert(rid);
                    }
                }
            }
            // More frees than references is a double free: the pool names it.
            let rc = self.pool.ref_cnt(b);
            if holders > 0 && rc >= n && rc - n < holders {
                return Err(Error::InvalidArgument(format!(
                    "block {b} is still in the block table of request {:?}: free the \
                     request, or pop its blocks (pop_blocks_for_free), before freeing them",
                    first.unwrap_or_default()
                )));
            }
        }
        Ok(())
    }

    /// vLLM's `remove_skipped_blocks` over the groups.
    pub fn remove_skipped_blocks(
        &mut self,
        request_id: &str,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        let Some((slot, state)) = self.requests.get_mut_with_slot(request_id) else {
            return Ok(());
        };
        for (g, m) in self.managers.iter_mut().enumerate() {
            m.remove_skipped_blocks(
                &mut self.pool,
                slot,
                &mut state.groups[g],
                processed_computed_tokens,
                num_prompt_tokens,
            )?;
        }
        Ok(())
    }

    /// vLLM's `free`: every group's table, tail first (no-op for an unknown
    /// request). All or nothing: a double free leaves every table in place (on a
    /// HiSparse layout, see `release`).
    pub fn free(
        &mut self,
        request_id: &str,
        scratch: &mut Vec<BlockId>,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        match self.requests.handle(request_id) {
            Some(h) => self.free_handles(&[h], scratch, pubs),
            None => self.release_untracked(request_id, pubs),
        }
    }

    /// `free` of each request `handles` name, in order, checked as one: either every
    /// reference is dropped or none (stale handles are an error).
    pub fn free_handles(
        &mut self,
        handles: &[crate::request_table::RequestHandle],
        scratch: &mut Vec<BlockId>,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        self.release(handles, pubs, Release::Free(scratch))
            .map(|_| ())
    }

    /// vLLM's `pop_blocks_for_free`: the request's blocks in allocation order, group
    /// after group, leading nulls trimmed; not freed.
    /// On a HiSparse layout the request is detached from the HiSparse coordinator
    /// first, and the host group's blocks (host pool ids) are the returned range.
    pub fn pop_blocks_for_free(
        &mut self,
        request_id: &str,
        out: &mut Vec<BlockId>,
        pubs: &dyn PublicationRequests,
    ) -> Result<Option<std::ops::Range<usize>>> {
        match self.requests.handle(request_id) {
            Some(h) => self.release(&[h], pubs, Release::Pop(out)),
            None => self.release_untracked(request_id, pubs).map(|_| None),
        }
    }

    /// `free` / `pop_blocks_for_free` of a request that holds no tables: nothing,
    /// but HiSparse still detaches it (vLLM does: its spills may be in flight).
    fn release_untracked(
        &mut self,
        request_id: &str,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        match self.hisparse_split() {
            Some((h, mut ctx)) => h.free(&mut ctx, request_id, pubs),
            None => Ok(()),
        }
    }

    /// The one group loop of `free`, the batch free and `pop_blocks_for_free`: each
    /// request's groups in order hand back their blocks (`blocks_for_free`) to
    /// `sink`. Freeing, the device pool's blocks are gathered (each group tail
    /// first) and freed as one checked call; the host group's go back to the host
    /// pool. Popping returns the host group's range of `out` (the last request's).
    ///
    /// HiSparse's `before_free` hook detaches the request at the source group; what
    /// the groups before it gathered is freed first, so the device pool sees vLLM's
    /// group-by-group order. A HiSparse free is therefore all or nothing only
    /// between two source groups (vLLM's is not either: each group frees in turn).
    fn release(
        &mut self,
        handles: &[crate::request_table::RequestHandle],
        pubs: &dyn PublicationRequests,
        mut sink: Release<'_>,
    ) -> Result<Option<std::ops::Range<usize>>> {
        // vLLM 0.32 hands back (and frees) the leading nulls too.
        let keep_nulls = self.pool.vllm_rules().null_block_ref_counted;
        let host_group = self.hisparse.as_deref().map(|h| h.layout().host_group);
        let mut ends: SmallVec<[usize; 8]> = SmallVec::new();
        let mut host_range = None;
        let stale = |h| Error::UnknownRequest(format!("handle {h:#x}"));
        if let Release::Free(scratch) = &mut sink {
            scratch.clear();
        }
        for &h in handles {
            for g in 0..self.managers.len() {
                let is_host = Some(g) == host_group;
                if is_host {
                    if let Release::Free(scratch) = &mut sink {
                        self.pool.free_block_segments(scratch, &ends)?;
                        scratch.clear();
                        ends.clear();
                    }
                    let Some(rid) = self.requests.key_of(h) else {
                        return Err(stale(h));
                    };
                    let rid: Box<str> = rid.into();
                    if let Some((hs, mut ctx)) = self.hisparse_split() {
                        hs.before_free(&mut ctx, g, &rid, pubs)?;
                    }
                }
                let (Some(rid), Some(state)) =
                    (self.requests.key_of(h), self.requests.get_by_handle(h))
                else {
                    return Err(stale(h));
                };
                let buf: &mut Vec<BlockId> = match &mut sink {
                    Release::Free(scratch) => scratch,
                    Release::Pop(out) => out,
                };
                let start = buf.len();
                self.managers[g].blocks_for_free(rid, &state.groups[g], keep_nulls, buf);
                let end = buf.len();
                match &mut sink {
                    Release::Pop(_) if is_host => host_range = Some(start..end),
                    Release::Pop(_) => {}
                    Release::Free(scratch) => {
                        scratch[start..].reverse();
                        if is_host {
                            self.free_host_blocks(g, &scratch[start..])?;
                            scratch.truncate(start);
                        } else {
                            ends.push(end);
                        }
                    }
                }
            }
        }
        if let Release::Free(scratch) = &mut sink {
            self.pool.free_block_segments(scratch, &ends)?;
        }
        for &h in handles {
            if let Some(rid) = self.requests.key_of(h) {
                let rid: Box<str> = rid.into();
                self.pop_request_state(&rid);
            }
        }
        Ok(host_range)
    }

    /// Frees `blocks` (tail first) into group `g`'s host pool, its events joining
    /// the device pool's queue.
    fn free_host_blocks(&mut self, g: usize, blocks: &[BlockId]) -> Result<()> {
        let src = self.managers[g]
            .hisparse_source_mut()
            .ok_or_else(|| Error::Internal("no HiSparse source".into()))?;
        let r = src.host_pool_mut().free_blocks(blocks);
        self.pool.absorb_host_events(src.host_pool_mut(), None);
        r
    }

    /// Removes the request's state and the managers' per-request state.
    pub(crate) fn pop_request_state(&mut self, request_id: &str) {
        let Some(handle) = self.requests.handle(request_id) else {
            return;
        };
        let slot = RequestTable::<RequestState>::slot_of_handle(handle);
        for m in &mut self.managers {
            m.pop_request(slot, request_id);
        }
        if let Some(state) = self.requests.remove_by_handle(handle) {
            self.recycle(state);
        }
    }
}
