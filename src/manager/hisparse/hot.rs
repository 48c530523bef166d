//! `HiSparseHotManager`: a request's fixed hot region, allocated once it reads
//! host-backed history.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::HiSparseHotManager` (a
//! `_HiSparseAuxiliaryManager`: never prefix cached, never hit).
//!
//! Key properties:
//! - The region is `blocks_per_request` blocks, allocated in one go and only for
//!   requests that need it (`hot_required`): an external import, a new request
//!   resuming a host prefix, or a request the coordinator asked to move to host
//!   reads (pool pressure, a full admission window, a lost page).
//! - A running request keeps its earlier answer: `get_num_blocks_to_allocate` asks
//!   for the region only when one of the reasons above holds.
//! - Every allocation marks the request running (`num_cached_block = 0`), even a
//!   cold admission that allocates nothing here.

use rustc_hash::FxHashSet;

use crate::error::Result;
use crate::manager::single_type::{
    never_hit_hooks, reject_prefix_hits, GroupBlocks, ManagerBase, NumBlocksQuery,
    SingleTypeManager,
};
use crate::pool::BlockPool;
use crate::types::BlockId;

/// A HiSparse hot group (see module docs).
#[derive(Debug)]
pub struct HiSparseHotManager {
    base: ManagerBase,
    blocks_per_request: usize,
    /// vLLM's `hot_required`: requests that need their hot region.
    hot_required: FxHashSet<Box<str>>,
    /// The layout has resident groups (vLLM reads `coordinator.resident_managers`):
    /// without them every admission needs the region.
    has_resident_groups: bool,
}

impl HiSparseHotManager {
    pub fn new(base: ManagerBase, blocks_per_request: usize) -> Self {
        Self {
            base,
            blocks_per_request,
            hot_required: FxHashSet::default(),
            has_resident_groups: true,
        }
    }

    /// Set by the coordinator once it knows the layout.
    pub(crate) fn set_has_resident_groups(&mut self, has: bool) {
        self.has_resident_groups = has;
    }

    /// `blocks_per_request`.
    #[inline]
    pub fn blocks_per_request(&self) -> usize {
        self.blocks_per_request
    }

    /// vLLM's `require_hot`.
    pub fn require_hot(&mut self, request_id: &str) {
        if !self.hot_required.contains(request_id) {
            self.hot_required.insert(request_id.into());
        }
    }

    /// Whether `request_id` is in `hot_required`.
    #[inline]
    pub fn is_hot_required(&self, request_id: &str) -> bool {
        self.hot_required.contains(request_id)
    }

    /// `hot_required`, for the Python views.
    pub fn hot_required(&self) -> impl Iterator<Item = &str> {
        self.hot_required.iter().map(|k| &**k)
    }

    /// vLLM's `has_hot` for a request whose table here has `table_len` blocks.
    #[inline]
    pub fn has_hot(&self, table_len: usize) -> bool {
        table_len == self.blocks_per_request
    }

    /// vLLM's `get_num_required_blocks`.
    #[inline]
    pub fn get_num_required_blocks(&self, table_len: usize) -> usize {
        self.blocks_per_request.saturating_sub(table_len)
    }
}

impl SingleTypeManager for HiSparseHotManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    never_hit_hooks!();

    fn get_num_blocks_to_allocate(
        &mut self,
        _pool: &BlockPool,
        _slot: u32,
        req: Option<&GroupBlocks>,
        q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        reject_prefix_hits(q.new_computed_blocks, "HiSparse hot")?;
        let host_import = q.total_computed_tokens > q.num_local_computed_tokens;
        let running = req.is_some_and(GroupBlocks::is_running);
        let resumes_host_prefix = q.num_local_computed_tokens > 0 && !running;
        if host_import || resumes_host_prefix || self.is_hot_required(q.request_id) {
            let len = req.map_or(0, |r| r.blocks.len());
            return Ok(self.get_num_required_blocks(len) as i64);
        }
        Ok(0)
    }

    fn add_local_computed_blocks(
        &mut self,
        _pool: &mut BlockPool,
        request_id: &str,
        req: &mut GroupBlocks,
        hits: &[BlockId],
        num_local: usize,
        _num_external: usize,
    ) -> Result<()> {
        reject_prefix_hits(hits, "HiSparse hot")?;
        req.num_cached_block = Some(0);
        if num_local > 0 || !self.has_resident_groups {
            self.require_hot(request_id);
        }
        Ok(())
    }

    fn allocate_external_computed_blocks(
        &mut self,
        _pool: &mut BlockPool,
        request_id: &str,
        _req: &mut GroupBlocks,
        _num_local: usize,
        _num_external: usize,
        _record_for_zeroing: bool,
    ) -> Result<()> {
        self.require_hot(request_id);
        Ok(())
    }

    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        request_id: &str,
        req: &mut GroupBlocks,
        _num_tokens: usize,
        _num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        // Cold admissions can bypass `add_local_computed_blocks`.
        req.num_cached_block = Some(0);
        if !self.is_hot_required(request_id) {
            return Ok(());
        }
        let n = self.get_num_required_blocks(req.blocks.len());
        self.base.grow(pool, &mut req.blocks, n, false, Some(out))
    }

    fn pop_request(&mut self, _slot: u32, request_id: &str) {
        self.hot_required.remove(request_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::spec::{GroupSpec, ManagerKind};

    fn manager() -> HiSparseHotManager {
        let spec = GroupSpec {
            kind: ManagerKind::HiSparseHot {
                blocks_per_request: 2,
            },
            prefix_cacheable: false,
            is_full_attention_spec: false,
            is_attention_spec: false,
            ..GroupSpec::full_attention(4)
        };
        HiSparseHotManager::new(ManagerBase::new(spec, 3, true, 4, 4, 1, 1, false), 2)
    }

    fn query(rid: &str, total: usize, local: usize) -> NumBlocksQuery<'_> {
        NumBlocksQuery {
            request_id: rid,
            num_tokens: 64,
            new_computed_blocks: &[],
            total_computed_tokens: total,
            num_local_computed_tokens: local,
            num_tokens_main_model: 64,
            apply_admission_cap: false,
            prefill_end: 0,
        }
    }

    #[test]
    fn cold_admission_needs_no_hot_region() {
        let mut m = manager();
        let mut pool = BlockPool::new(8, true, 4, false, false).unwrap();
        assert_eq!(
            m.get_num_blocks_to_allocate(&pool, 0, None, &query("r", 0, 0))
                .unwrap(),
            0
        );
        let mut req = GroupBlocks::default();
        let mut out = vec![];
        m.allocate_new_blocks(&mut pool, 0, "r", &mut req, 64, 64, &mut out)
            .unwrap();
        assert!(req.blocks.is_empty());
        assert_eq!(req.num_cached_block, Some(0));
    }

    #[test]
    fn host_prefix_resume_allocates_the_whole_region_once() {
        let mut m = manager();
        let mut pool = BlockPool::new(8, true, 4, false, false).unwrap();
        assert_eq!(
            m.get_num_blocks_to_allocate(&pool, 0, None, &query("r", 8, 8))
                .unwrap(),
            2
        );
        let mut req = GroupBlocks::default();
        m.add_local_computed_blocks(&mut pool, "r", &mut req, &[], 8, 0)
            .unwrap();
        assert!(m.is_hot_required("r"));
        let mut out = vec![];
        m.allocate_new_blocks(&mut pool, 0, "r", &mut req, 64, 64, &mut out)
            .unwrap();
        assert_eq!(req.blocks, vec![1, 2]);
        assert!(m.has_hot(req.blocks.len()));
        m.allocate_new_blocks(&mut pool, 0, "r", &mut req, 64, 64, &mut out)
            .unwrap();
        assert_eq!(req.blocks.len(), 2);
        m.pop_request(0, "r");
        assert!(!m.is_hot_required("r"));
    }

    #[test]
    fn a_capacity_query_does_not_require_hot() {
        let mut m = manager();
        let pool = BlockPool::new(8, true, 4, false, false).unwrap();
        m.get_num_blocks_to_allocate(&pool, u32::MAX, None, &query("q", 16, 16))
            .unwrap();
        assert!(!m.is_hot_required("q"));
    }
}
