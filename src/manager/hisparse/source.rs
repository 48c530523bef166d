//! `HiSparseSourceManager`: full attention on HiSparse's private host pool.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::HiSparseSourceManager`
//! (a `FullAttentionManager` whose `block_pool` `bind_host_pool` replaced by a
//! `SharedEventQueueBlockPool` of `hisparse_host_num_blocks` blocks, medium CPU).
//!
//! Key properties:
//! - Every page of a request gets a host block: the host pool, not the device pool,
//!   backs this group. Its blocks are never counted against the device pool; when
//!   the host pool cannot back an allocation, `get_num_blocks_to_allocate` answers
//!   the admission sentinel `num_gpu_blocks + 1` (as Mamba does), else 0.
//! - Hits are looked up, touched and freed in the host pool; the group's hit is
//!   kept longer than the reconciled hit (`retains_longer_hit`): the facade trims it
//!   to the local plus external tokens.
//! - Caching is not this manager's: the coordinator publishes the host pages' hashes
//!   once their host copies are durable (`HiSparseCoordinator::publish_when_ready`),
//!   through [`HiSparseSourceManager::publish_blocks`].
//! - New block ids are never recorded for zeroing, and copy-on-write pairs of
//!   partial host hits go to the HiSparse connector (`take_host_block_copies`), not
//!   to the worker's generic copy path.
//! - The host pool records events into its own queue; every hook moves them to the
//!   device pool's queue before it returns, so the two pools' events stay in
//!   operation order (vLLM's shared queue).
//!
//! Where it differs: vLLM builds the host pool when the connector first calls
//! `get_hisparse_coordinator`; hscache builds it with the manager (a HiSparse
//! layout cannot serve a request before that call in vLLM either). The host pool
//! records no block-metrics calls (vLLM gives it a collector of its own, read only by
//! the HiSparse connector's stats).

use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::manager::full_attention::{
    cache_full_attention_blocks, find_full_attention_hit, full_attention_extra_hash_reads,
    FullAttentionManager,
};
use crate::manager::single_type::{
    base_add_local_computed_blocks, base_allocate_external_computed_blocks,
    base_allocate_new_blocks, base_get_num_blocks_to_allocate, CacheQuery, CowCopy, GroupBlocks,
    HitQuery, ManagerBase, NumBlocksQuery, SingleTypeManager,
};
use crate::pool::BlockPool;
use crate::types::BlockId;

/// The HiSparse source group (see module docs).
#[derive(Debug)]
pub struct HiSparseSourceManager {
    inner: FullAttentionManager,
    host_pool: BlockPool,
}

impl HiSparseSourceManager {
    /// The source group of `base`, over a host pool of `host_num_blocks` blocks.
    pub fn new(
        mut base: ManagerBase,
        host_num_blocks: u32,
        enable_kv_cache_events: bool,
    ) -> Result<Self> {
        if base.block_size != base.hash_block_size {
            return Err(Error::Unsupported(format!(
                "a HiSparse source group of block size {} over hash blocks of {} tokens \
                 (partial host entries)",
                base.block_size, base.hash_block_size
            )));
        }
        let caching = base.enable_caching && base.spec.prefix_cacheable;
        let host_pool = BlockPool::new(
            host_num_blocks,
            caching,
            base.hash_block_size,
            enable_kv_cache_events,
            false,
        )?;
        base.record_new_block_ids = false;
        Ok(Self {
            inner: FullAttentionManager::new(base),
            host_pool,
        })
    }

    /// The host pool.
    #[inline]
    pub fn host_pool(&self) -> &BlockPool {
        &self.host_pool
    }

    /// The host pool, mutable. Callers move its events to the device pool
    /// ([`BlockPool::absorb_host_events`]) after each change.
    #[inline]
    pub fn host_pool_mut(&mut self) -> &mut BlockPool {
        &mut self.host_pool
    }

    /// vLLM's `publish_blocks`: `FullAttentionManager.cache_blocks` on the host pool.
    pub fn publish_blocks(&mut self, req: &mut GroupBlocks, q: &CacheQuery<'_>) -> Result<()> {
        cache_full_attention_blocks(&mut self.inner, &mut self.host_pool, req, q)
    }

    /// vLLM's `take_host_cow_copies`: the host copy-on-write pairs, drained.
    pub fn take_host_cow_copies(&mut self) -> Vec<CowCopy> {
        std::mem::take(&mut self.inner.base_mut().pending_cow_copies)
    }
}

impl SingleTypeManager for HiSparseSourceManager {
    fn base(&self) -> &ManagerBase {
        self.inner.base()
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        self.inner.base_mut()
    }

    fn host_pool(&self) -> Option<&BlockPool> {
        Some(&self.host_pool)
    }

    fn retains_longer_hit(&self) -> bool {
        true
    }

    fn find_longest_cache_hit(
        &self,
        _pool: &BlockPool,
        q: &HitQuery<'_>,
        out: &mut [Vec<BlockId>],
    ) -> Result<usize> {
        find_full_attention_hit(&self.host_pool, self.inner.base().block_size, q, out)
    }

    fn get_num_blocks_to_allocate(
        &mut self,
        pool: &BlockPool,
        _slot: u32,
        req: Option<&GroupBlocks>,
        q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        // vLLM calls the base without the admission cap or the prefill end.
        let q = NumBlocksQuery {
            apply_admission_cap: false,
            prefill_end: 0,
            ..*q
        };
        let required = base_get_num_blocks_to_allocate(&self.inner, &self.host_pool, req, &q)?;
        if required > self.host_pool.get_num_free_blocks() as i64 {
            return Ok(i64::from(pool.num_gpu_blocks()) + 1);
        }
        Ok(0)
    }

    fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        _request_id: &str,
        req: &mut GroupBlocks,
        hits: &[BlockId],
        num_local: usize,
        num_external: usize,
    ) -> Result<()> {
        let r = base_add_local_computed_blocks(
            &mut self.inner,
            &mut self.host_pool,
            req,
            hits,
            num_local,
            num_external,
        );
        pool.absorb_host_events(&mut self.host_pool, None);
        r
    }

    fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        _request_id: &str,
        req: &mut GroupBlocks,
        num_local: usize,
        num_external: usize,
        record_for_zeroing: bool,
    ) -> Result<()> {
        let r = base_allocate_external_computed_blocks(
            &mut self.inner,
            &mut self.host_pool,
            req,
            num_local,
            num_external,
            record_for_zeroing,
        );
        pool.absorb_host_events(&mut self.host_pool, None);
        r
    }

    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        _request_id: &str,
        req: &mut GroupBlocks,
        num_tokens: usize,
        _num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let r =
            base_allocate_new_blocks(&mut self.inner, &mut self.host_pool, req, num_tokens, out);
        pool.absorb_host_events(&mut self.host_pool, None);
        r
    }

    fn cache_blocks(
        &mut self,
        _pool: &mut BlockPool,
        _slot: u32,
        _req: &mut GroupBlocks,
        _q: &CacheQuery<'_>,
    ) -> Result<()> {
        // The coordinator publishes this group (`publish_when_ready`).
        Err(Error::Internal(
            "the HiSparse source group is cached by its coordinator".into(),
        ))
    }

    fn extra_hash_reads(
        &self,
        _slot: u32,
        num_prompt_tokens: usize,
        num_hashes: usize,
        num_tokens: usize,
        _query_end: usize,
        out: &mut SmallVec<[usize; 4]>,
    ) {
        let base = self.inner.base();
        full_attention_extra_hash_reads(
            base,
            base.hash_block_size,
            num_prompt_tokens,
            num_hashes,
            num_tokens,
            out,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::spec::{GroupSpec, ManagerKind};
    use crate::testing::prompt_hashes;

    fn manager(host_blocks: u32) -> HiSparseSourceManager {
        let spec = GroupSpec {
            kind: ManagerKind::HiSparseSource {
                host_num_blocks: host_blocks,
            },
            ..GroupSpec::full_attention(4)
        };
        let base = ManagerBase::new(spec, 0, true, 4, 4, 1, 1, true);
        HiSparseSourceManager::new(base, host_blocks, true).unwrap()
    }

    fn query(num_tokens: usize, hits: &[BlockId]) -> NumBlocksQuery<'_> {
        NumBlocksQuery {
            request_id: "r",
            num_tokens,
            new_computed_blocks: hits,
            total_computed_tokens: hits.len() * 4,
            num_local_computed_tokens: hits.len() * 4,
            num_tokens_main_model: num_tokens,
            apply_admission_cap: false,
            prefill_end: 0,
        }
    }

    #[test]
    fn host_pool_backs_the_group_and_never_counts_against_the_device() {
        let mut m = manager(4);
        let mut device = BlockPool::new(10, true, 4, true, false).unwrap();
        // Three usable host blocks back three pages: nothing to take from the device.
        assert_eq!(
            m.get_num_blocks_to_allocate(&device, 0, None, &query(12, &[]))
                .unwrap(),
            0
        );
        // Four pages do not fit: the admission sentinel.
        assert_eq!(
            m.get_num_blocks_to_allocate(&device, 0, None, &query(16, &[]))
                .unwrap(),
            11
        );
        let mut req = GroupBlocks::default();
        let mut out = vec![];
        m.allocate_new_blocks(&mut device, 0, "r", &mut req, 12, 12, &mut out)
            .unwrap();
        assert_eq!(req.blocks, vec![1, 2, 3]);
        assert_eq!(m.host_pool().get_num_free_blocks(), 0);
        assert_eq!(device.get_num_free_blocks(), 9);
        // New host blocks are never recorded for zeroing.
        assert!(m.base().new_block_ids.is_empty());
    }

    #[test]
    fn publishing_caches_in_the_host_pool_with_host_events() {
        let mut m = manager(6);
        let mut device = BlockPool::new(10, true, 4, true, false).unwrap();
        let mut req = GroupBlocks::default();
        let mut out = vec![];
        m.allocate_new_blocks(&mut device, 0, "r", &mut req, 8, 8, &mut out)
            .unwrap();
        let hashes = prompt_hashes(1, 2, 0, 0);
        let q = CacheQuery {
            request_id: "r",
            block_hashes: &hashes,
            num_tokens: 8,
            retention_interval: None,
            replay_boundaries: &[],
            num_prompt_tokens: 8,
            num_computed_tokens: 8,
            shared_prefix_boundary: 0,
        };
        m.publish_blocks(&mut req, &q).unwrap();
        assert!(m.host_pool().block_hash(1).is_some());
        assert!(device.block_hash(1).is_none());
        device.absorb_host_events(m.host_pool_mut(), Some(7));
        let events = device.take_events();
        assert!(matches!(
            events.as_slice(),
            [crate::events::KVCacheEvent::Host {
                publication: Some(7),
                ..
            }]
        ));
        // Hits are looked up in the host pool.
        let mut found = vec![Vec::new()];
        let hit = m
            .find_longest_cache_hit(
                &device,
                &HitQuery {
                    block_hashes: &hashes,
                    max_length: 8,
                    group_ids: &[0],
                    drop_eagle_block: false,
                    alignment_tokens: 4,
                },
                &mut found,
            )
            .unwrap();
        assert_eq!((hit, found[0].clone()), (8, vec![1, 2]));
    }
}
