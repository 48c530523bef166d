//! The calls vLLM code makes past the facade: on `kv_cache_manager.block_pool`
//! (`get_new_blocks`, `touch`, `free_blocks`), on the coordinator and one
//! single-type manager (`get_num_blocks_to_allocate`, `allocate_new_blocks`,
//! `_pending_cow_copies`, `retention_interval`, `use_eagle`) and on HiSparse's
//! coordinator and host pool. vLLM's `kv_cache_manager.py` has none of them; the
//! Scheduler's own calls are in `mod.rs`.
//!
//! The references these calls hand out beside the request tables are counted
//! (`external_refs`), so that the invariant check demands ref count == owners
//! exactly.

use super::single_type::NumBlocksQuery;
use super::{HiSparseCoordinator, HiSparseCtx, KVCacheManager, NumBlocksToAllocate};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::{BlockId, NULL_BLOCK_ID};

/// One more external reference to each non-null block of `ids`.
fn add_refs(external_refs: &mut [i32], ids: &[BlockId]) {
    for &b in ids {
        if b != NULL_BLOCK_ID {
            if let Some(e) = external_refs.get_mut(b as usize) {
                *e += 1;
            }
        }
    }
}

impl KVCacheManager {
    /// The device pool's `get_new_blocks` (then HiSparse's reuse callbacks).
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        self.guard()?;
        let start = out.len();
        self.coordinator.block_pool_mut().get_new_blocks(n, out)?;
        add_refs(&mut self.external_refs, &out[start..]);
        let r = self.coordinator.process_reused();
        let r = self.applied(r);
        self.after("get_new_blocks", r)
    }

    /// The device pool's `touch` (the `BlockPool` view): the caller now holds one
    /// more reference to each block.
    pub fn touch(&mut self, block_ids: &[BlockId]) -> Result<()> {
        self.guard()?;
        self.coordinator.block_pool_mut().touch(block_ids)?;
        self.add_external(block_ids);
        self.after("touch", Ok(()))
    }

    /// Runs `f` on HiSparse's coordinator (`Err` on other layouts); a failure or a
    /// panic midway poisons the manager.
    pub fn hisparse_call<T>(
        &mut self,
        f: impl FnOnce(&mut HiSparseCoordinator, &mut HiSparseCtx<'_>) -> Result<T>,
    ) -> Result<T> {
        self.shielded("a HiSparse call", |m| {
            m.guard()?;
            if m.coordinator.hisparse().is_none() {
                return Err(Error::InvalidArgument(
                    "this KV-cache layout has no HiSparse group".into(),
                ));
            }
            let r = m.coordinator.with_hisparse(f);
            let r = m.applied(r);
            m.after("a HiSparse call", r)
        })
    }

    /// Runs `f` on HiSparse's host pool and moves its events to the device pool's
    /// queue (`Err` on other layouts). Pool calls validate before they change
    /// anything, so an `Err` leaves everything as it was.
    pub fn host_pool_call<T>(&mut self, f: impl FnOnce(&mut BlockPool) -> Result<T>) -> Result<T> {
        self.shielded("a HiSparse host-pool call", |m| {
            m.guard()?;
            let host_group = m.coordinator.hisparse().map(|h| h.layout().host_group);
            let Some(g) = host_group else {
                return Err(Error::InvalidArgument(
                    "this KV-cache layout has no HiSparse host pool".into(),
                ));
            };
            m.coordinator
                .with_hisparse(|_, ctx| ctx.with_host(g, None, f))
        })
    }

    /// HiSparse publications made and dropped since the last call: `(made, dropped)`
    /// ids; a made one's request is the request of the call that made it.
    pub fn take_publication_changes(&mut self) -> Option<(Vec<u64>, Vec<u64>)> {
        let h = self.coordinator.hisparse.as_deref_mut()?;
        if !h.has_publication_changes() {
            return None;
        }
        Some((h.take_publication_binds(), h.take_publication_releases()))
    }

    /// Whether HiSparse publications were made or dropped since the last look.
    pub fn has_publication_changes(&self) -> bool {
        self.coordinator
            .hisparse()
            .is_some_and(HiSparseCoordinator::has_publication_changes)
    }

    /// One group's `allocate_new_blocks`, as vLLM code may call a single-type
    /// manager directly (the request's tables are created if absent): the new ids.
    pub fn group_allocate_new_blocks(
        &mut self,
        g: usize,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> Result<Vec<BlockId>> {
        self.guard()?;
        if g >= self.num_kv_cache_groups() {
            return Err(Error::InvalidArgument(format!("no KV-cache group {g}")));
        }
        self.check_tokens("num_tokens", num_tokens)?;
        let mut out = Vec::new();
        let r = self.coordinator.group_allocate_new_blocks(
            g,
            request_id,
            num_tokens,
            num_tokens_main_model,
            &mut out,
        );
        let r = self.applied(r);
        self.after("allocate_new_blocks", r)?;
        Ok(out)
    }

    /// One group's `get_num_blocks_to_allocate` (vLLM code may call a single-type
    /// manager directly).
    pub fn group_num_blocks_to_allocate(
        &mut self,
        g: usize,
        q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        self.guard()?;
        if g >= self.num_kv_cache_groups() {
            return Err(Error::InvalidArgument(format!("no KV-cache group {g}")));
        }
        self.coordinator
            .pool_of(g)
            .validate_touch(q.new_computed_blocks)?;
        self.coordinator.group_num_blocks_to_allocate(g, q)
    }

    /// HiSparse's host pool, on a HiSparse layout.
    pub fn host_pool(&self) -> Option<&BlockPool> {
        self.host_group().map(|g| self.coordinator.pool_of(g))
    }

    /// HiSparse's source group (whose blocks are host pool blocks).
    pub fn host_group(&self) -> Option<usize> {
        self.coordinator.hisparse().map(|h| h.layout().host_group)
    }

    /// The pool of group `g`'s blocks (HiSparse's host pool for its source group).
    #[inline]
    pub fn pool_of(&self, g: usize) -> &BlockPool {
        self.coordinator.pool_of(g)
    }

    /// Drops one reference per listed block, first = evicted first (deferred frees
    /// through vLLM's `block_pool.free_blocks`).
    /// In the checked mode, blocks still held by a live block table are refused
    /// ([`KVCacheCoordinator::check_free_keeps_tables`]); vLLM accepts them.
    pub fn free_blocks(&mut self, ordered_blocks: &[BlockId]) -> Result<()> {
        self.guard()?;
        if self.check_after_ops {
            self.coordinator.check_free_keeps_tables(ordered_blocks)?;
        }
        let r = self
            .coordinator
            .block_pool_mut()
            .free_blocks(ordered_blocks);
        if r.is_ok() {
            self.drop_external(ordered_blocks);
        }
        self.after("free_blocks", r)
    }

    /// vLLM's `free_blocks` over blocks of both HiSparse pools: the device pool's
    /// first, then the host pool's (each in the given order).
    pub fn free_blocks_mixed(&mut self, device: &[BlockId], host: &[BlockId]) -> Result<()> {
        self.guard()?;
        if !host.is_empty() {
            let Some(g) = self.coordinator.hisparse().map(|h| h.layout().host_group) else {
                return Err(Error::InvalidArgument("no HiSparse host pool".into()));
            };
            // Validate both before changing either.
            let hp = self.coordinator.pool_of(g);
            for &b in host {
                hp.check_block_id(i64::from(b))?;
            }
        }
        if self.check_after_ops {
            self.coordinator.check_free_keeps_tables(device)?;
        }
        self.coordinator.block_pool_mut().free_blocks(device)?;
        self.drop_external(device);
        if host.is_empty() {
            return self.after("free_blocks", Ok(()));
        }
        let r = self.host_pool_call(|pool| pool.free_blocks(host));
        let r = self.applied(r);
        self.after("free_blocks", r)
    }

    /// vLLM's `take_kv_cache_block_copies`: the queued copy-on-write pairs; both
    /// endpoints hold a reference the caller frees once the copy ran.
    pub fn take_kv_cache_block_copies(&mut self) -> Vec<(BlockId, BlockId)> {
        let copies = self.coordinator.take_pending_cow_copies();
        for &(src, cow) in &copies {
            self.add_external(&[src, cow]);
        }
        copies
    }

    /// vLLM's `coordinator.get_num_blocks_to_allocate`, as the Scheduler calls it
    /// directly (async-load admission) and tests probe it.
    pub fn coordinator_num_blocks_to_allocate(
        &mut self,
        q: &NumBlocksToAllocate<'_>,
    ) -> Result<i64> {
        self.guard()?;
        for g in 0..q.hits.ends.len() {
            for &b in q.hits.group(g) {
                self.coordinator.pool_of(g).check_block_id(i64::from(b))?;
            }
        }
        self.coordinator.get_num_blocks_to_allocate(q)
    }

    /// Queues a copy-on-write pair on group `g` (what vLLM code does by appending to
    /// a manager's `_pending_cow_copies`).
    pub fn push_cow_copy(&mut self, g: usize, pair: (BlockId, BlockId)) -> Result<()> {
        self.guard()?;
        self.coordinator
            .pool_of(g)
            .check_block_id(i64::from(pair.0))?;
        self.coordinator
            .pool_of(g)
            .check_block_id(i64::from(pair.1))?;
        self.coordinator.push_cow_copy(g, pair);
        if self.coordinator.pool_of(g).num_gpu_blocks() == self.block_pool().num_gpu_blocks()
            && self.host_group() != Some(g)
        {
            // The pair took no reference (vLLM code appended it by hand), but the
            // invariant check counts a queued pair as holding one of each endpoint.
            for b in [pair.0, pair.1] {
                if let Some(e) = self.external_refs.get_mut(b as usize) {
                    *e -= 1;
                }
            }
        }
        self.after("push_cow_copy", Ok(()))
    }

    /// vLLM code sets `coordinator.retention_interval` after construction.
    pub fn set_retention_interval(&mut self, retention: Option<usize>) -> Result<()> {
        self.guard()?;
        self.coordinator.set_retention_interval(retention)
    }

    /// vLLM code sets a single-type manager's `use_eagle` after construction.
    pub fn set_group_use_eagle(&mut self, g: usize, use_eagle: bool) -> Result<()> {
        self.guard()?;
        if g >= self.coordinator.managers().len() {
            return Err(Error::InvalidArgument(format!("no KV-cache group {g}")));
        }
        self.coordinator.set_group_use_eagle(g, use_eagle);
        Ok(())
    }

    /// The external references (see the field), for the state digest and tests.
    pub fn external_refs(&self) -> &[i32] {
        &self.external_refs
    }

    /// Test-only: the external reference counts, mutable (invariant mutants).
    #[doc(hidden)]
    #[cfg(any(test, feature = "testing", feature = "mutants"))]
    pub fn corrupt_external_refs_for_tests(&mut self) -> &mut Vec<i32> {
        &mut self.external_refs
    }

    /// Test-only: the device pool, mutable, past the poison guard (invariant
    /// mutants).
    #[doc(hidden)]
    #[cfg(any(test, feature = "testing", feature = "mutants"))]
    pub fn corrupt_pool_for_tests(&mut self) -> &mut BlockPool {
        self.coordinator.block_pool_mut()
    }

    pub(super) fn add_external(&mut self, ids: &[BlockId]) {
        add_refs(&mut self.external_refs, ids);
    }

    /// A reference given back through `free_blocks`: one the caller held (a free
    /// of a block with none is a table's reference freed behind the manager's
    /// back, which the check must see, so the count stays).
    pub(super) fn drop_external(&mut self, ids: &[BlockId]) {
        for &b in ids {
            if let Some(e) = self.external_refs.get_mut(b as usize) {
                if *e > 0 {
                    *e -= 1;
                }
            }
        }
    }
}
