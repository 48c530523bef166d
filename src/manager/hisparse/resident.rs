//! `HiSparseResidentManager`: GPU-resident pages of otherwise host-backed KV.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::HiSparseResidentManager`
//! (a `_HiSparseAuxiliaryManager`: never prefix cached, never hit).
//!
//! Key properties:
//! - The block table is append-only and position aligned with the host group's;
//!   a page the request reads from the host is the null block. Residency changes
//!   after allocation (a page adopted from a GPU copy, a page whose unpinned block
//!   the pool handed out again) live beside the table in `residency_changes` and
//!   reach the worker through the coordinator's residency updates, never through
//!   the table.
//! - A new request that resumes a host prefix starts with one null page per host
//!   page; an external (connector) import reserves only a writable tail page, the
//!   earlier imported pages stay host-only.
//! - Admission is capped at `max_admission_blocks_per_request` pages (the
//!   in-flight window), assuming older pages move to the host.
//! - `pop_blocks_for_free` hands back the residency row (changes applied), so an
//!   adopted copy is released and a lost page is not.

use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::manager::single_type::{
    never_hit_hooks, null_head_len, reject_prefix_hits, GroupBlocks, ManagerBase, NumBlocksQuery,
    SingleTypeManager,
};
use crate::pool::BlockPool;
use crate::types::{cdiv, BlockId, NULL_BLOCK_ID};

/// A HiSparse resident group (see module docs).
#[derive(Debug)]
pub struct HiSparseResidentManager {
    base: ManagerBase,
    /// vLLM's `residency_changes`: per request, page index -> the block the page is
    /// read from now (the null block: from the host).
    residency_changes: FxHashMap<Box<str>, BTreeMap<usize, BlockId>>,
}

impl HiSparseResidentManager {
    pub fn new(base: ManagerBase) -> Self {
        Self {
            base,
            residency_changes: FxHashMap::default(),
        }
    }

    /// `max_admission_blocks_per_request` (the in-flight window in pages).
    #[inline]
    pub fn max_admission_blocks_per_request(&self) -> usize {
        self.base
            .spec
            .max_admission_blocks_per_request
            .unwrap_or(usize::MAX)
    }

    /// vLLM's `get_resident_page`: the GPU block page `block_idx` is read from, or
    /// None (host-only, or past the table) — `table` is the request's table.
    pub fn get_resident_page(
        &self,
        request_id: &str,
        table: &[BlockId],
        block_idx: usize,
    ) -> Option<BlockId> {
        let mut block = *table.get(block_idx)?;
        if let Some(changes) = self.residency_changes.get(request_id) {
            if let Some(&b) = changes.get(&block_idx) {
                block = b;
            }
        }
        (block != NULL_BLOCK_ID).then_some(block)
    }

    /// vLLM's `get_residency_row`: the table from `start` with the changes applied
    /// (host-only pages stay the null block), appended to `out`.
    pub fn residency_row(
        &self,
        request_id: &str,
        table: &[BlockId],
        start: usize,
        out: &mut Vec<BlockId>,
    ) {
        let changes = self.residency_changes.get(request_id);
        for (i, &b) in table.iter().enumerate().skip(start) {
            out.push(changes.and_then(|c| c.get(&i).copied()).unwrap_or(b));
        }
    }

    /// vLLM's `adopt_resident_page`: points a host-only page at a GPU copy of its
    /// contents; false when the page is past the table or already resident.
    pub fn adopt_resident_page(
        &mut self,
        request_id: &str,
        table: Option<&[BlockId]>,
        block_idx: usize,
        block: BlockId,
    ) -> bool {
        let Some(table) = table else {
            return false;
        };
        if block_idx >= table.len()
            || self
                .get_resident_page(request_id, table, block_idx)
                .is_some()
        {
            return false;
        }
        self.changes_mut(request_id).insert(block_idx, block);
        true
    }

    /// vLLM's `drop_resident_page`: the page is read from the host from now on; the
    /// block it was read from, if any.
    pub fn drop_resident_page(
        &mut self,
        request_id: &str,
        table: Option<&[BlockId]>,
        block_idx: usize,
    ) -> Option<BlockId> {
        let block = self.get_resident_page(request_id, table?, block_idx)?;
        self.changes_mut(request_id)
            .insert(block_idx, NULL_BLOCK_ID);
        Some(block)
    }

    fn changes_mut(&mut self, request_id: &str) -> &mut BTreeMap<usize, BlockId> {
        self.residency_changes.entry(request_id.into()).or_default()
    }

    /// The request's residency changes (page -> block), for the Python views.
    pub fn residency_changes(&self, request_id: &str) -> Option<&BTreeMap<usize, BlockId>> {
        self.residency_changes.get(request_id)
    }

    /// Every request with residency changes, for the Python views.
    pub fn requests_with_changes(&self) -> impl Iterator<Item = &str> {
        self.residency_changes.keys().map(|k| &**k)
    }
}

impl SingleTypeManager for HiSparseResidentManager {
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
        reject_prefix_hits(q.new_computed_blocks, "HiSparse resident")?;
        let bs = self.base.block_size;
        let table: &[BlockId] = req.map_or(&[], |r| r.blocks.as_slice());
        let existing = table.len();
        if q.total_computed_tokens > q.num_local_computed_tokens {
            // Keep the last imported page writable (the last-token replay of a full
            // prompt hit included); earlier imported pages stay host-only.
            let imported_pages = cdiv(q.total_computed_tokens, bs);
            let needs_tail = self
                .get_resident_page(q.request_id, table, imported_pages - 1)
                .is_none();
            let more = cdiv(q.num_tokens, bs).saturating_sub(imported_pages.max(existing));
            return Ok((usize::from(needs_tail) + more) as i64);
        }
        let host_pages = cdiv(q.num_local_computed_tokens, bs);
        let mut required = cdiv(q.num_tokens, bs);
        if q.apply_admission_cap {
            required = required.min(self.max_admission_blocks_per_request());
        }
        Ok(required.saturating_sub(existing.max(host_pages)) as i64)
    }

    fn add_local_computed_blocks(
        &mut self,
        _pool: &mut BlockPool,
        _request_id: &str,
        req: &mut GroupBlocks,
        hits: &[BlockId],
        num_local: usize,
        _num_external: usize,
    ) -> Result<()> {
        reject_prefix_hits(hits, "HiSparse resident")?;
        if !req.blocks.is_empty() {
            return Err(Error::InvalidArgument(
                "a HiSparse resident table must be empty when the request adopts its hits".into(),
            ));
        }
        let num_host_pages = cdiv(num_local, self.base.block_size);
        req.blocks
            .extend(std::iter::repeat_n(NULL_BLOCK_ID, num_host_pages));
        req.num_cached_block = Some(0);
        // The coordinator commits the host pages (`commit_computed_blocks`).
        Ok(())
    }

    fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        request_id: &str,
        req: &mut GroupBlocks,
        num_local: usize,
        num_external: usize,
        _record_for_zeroing: bool,
    ) -> Result<()> {
        if num_external == 0 {
            return Err(Error::InvalidArgument(
                "a HiSparse resident import needs external tokens".into(),
            ));
        }
        let num_tokens = num_local + num_external;
        let tail_page = (num_tokens - 1) / self.base.block_size;
        if req.blocks.len() <= tail_page {
            req.blocks.resize(tail_page + 1, NULL_BLOCK_ID);
        }
        if self
            .get_resident_page(request_id, &req.blocks, tail_page)
            .is_none()
        {
            let mut new = Vec::with_capacity(1);
            pool.get_new_blocks(1, &mut new)?;
            req.blocks[tail_page] = new[0];
        }
        Ok(())
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
        let n = cdiv(num_tokens, self.base.block_size).saturating_sub(req.blocks.len());
        self.base.grow(pool, &mut req.blocks, n, false, Some(out))
    }

    fn blocks_for_free(
        &self,
        request_id: &str,
        req: &GroupBlocks,
        keep_null_head: bool,
        out: &mut Vec<BlockId>,
    ) {
        let start = out.len();
        self.residency_row(request_id, &req.blocks, 0, out);
        if !keep_null_head {
            let head = null_head_len(&out[start..]);
            out.drain(start..start + head);
        }
    }

    fn pop_request(&mut self, _slot: u32, request_id: &str) {
        self.residency_changes.remove(request_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::spec::{GroupSpec, ManagerKind};

    fn manager(window_pages: usize) -> HiSparseResidentManager {
        let spec = GroupSpec {
            kind: ManagerKind::HiSparseResident,
            prefix_cacheable: false,
            is_full_attention_spec: false,
            is_attention_spec: false,
            max_admission_blocks_per_request: Some(window_pages),
            ..GroupSpec::full_attention(4)
        };
        HiSparseResidentManager::new(ManagerBase::new(spec, 2, true, 4, 4, 1, 1, false))
    }

    fn query(rid: &str, num_tokens: usize, total: usize, local: usize) -> NumBlocksQuery<'_> {
        NumBlocksQuery {
            request_id: rid,
            num_tokens,
            new_computed_blocks: &[],
            total_computed_tokens: total,
            num_local_computed_tokens: local,
            num_tokens_main_model: num_tokens,
            apply_admission_cap: false,
            prefill_end: 0,
        }
    }

    #[test]
    fn host_prefix_pages_start_null_and_are_not_allocated() {
        let mut m = manager(64);
        let mut pool = BlockPool::new(16, true, 4, false, false).unwrap();
        // 8 tokens of host prefix, 12 tokens in all: one new page.
        let q = query("r", 12, 8, 8);
        assert_eq!(m.get_num_blocks_to_allocate(&pool, 0, None, &q).unwrap(), 1);
        let mut req = GroupBlocks::default();
        m.add_local_computed_blocks(&mut pool, "r", &mut req, &[], 8, 0)
            .unwrap();
        assert_eq!(req.blocks, vec![0, 0]);
        let mut out = vec![];
        m.allocate_new_blocks(&mut pool, 0, "r", &mut req, 12, 12, &mut out)
            .unwrap();
        assert_eq!(req.blocks, vec![0, 0, 1]);
        assert_eq!(out, vec![1]);
    }

    #[test]
    fn external_import_reserves_only_a_writable_tail() {
        let mut m = manager(64);
        let mut pool = BlockPool::new(16, true, 4, false, false).unwrap();
        let q = query("r", 17, 16, 0);
        // The tail page (page 3) plus page 4 for token 17.
        assert_eq!(m.get_num_blocks_to_allocate(&pool, 0, None, &q).unwrap(), 2);
        let mut req = GroupBlocks::default();
        m.allocate_external_computed_blocks(&mut pool, "r", &mut req, 0, 16, true)
            .unwrap();
        assert_eq!(req.blocks, vec![0, 0, 0, 1]);
    }

    #[test]
    fn admission_cap_limits_the_pages_counted() {
        let mut m = manager(2);
        let pool = BlockPool::new(16, true, 4, false, false).unwrap();
        let q = NumBlocksQuery {
            apply_admission_cap: true,
            ..query("r", 40, 0, 0)
        };
        assert_eq!(m.get_num_blocks_to_allocate(&pool, 0, None, &q).unwrap(), 2);
    }

    #[test]
    fn residency_changes_override_the_table_until_freed() {
        let mut m = manager(64);
        let table = vec![0, 5, 6];
        assert_eq!(m.get_resident_page("r", &table, 0), None);
        assert!(m.adopt_resident_page("r", Some(&table), 0, 9));
        assert!(!m.adopt_resident_page("r", Some(&table), 1, 9));
        assert_eq!(m.drop_resident_page("r", Some(&table), 2), Some(6));
        let mut row = vec![];
        m.residency_row("r", &table, 0, &mut row);
        assert_eq!(row, vec![9, 5, 0]);
        let req = GroupBlocks {
            blocks: table.clone(),
            ..GroupBlocks::default()
        };
        let mut freed = vec![];
        m.blocks_for_free("r", &req, false, &mut freed);
        assert_eq!(freed, vec![9, 5, 0]);
        m.pop_request(0, "r");
        assert_eq!(m.get_resident_page("r", &table, 2), Some(6));
    }
}
