//! `KVCacheCore`'s calls on HiSparse's single-type managers and host pool, for the
//! Python views (`python/hscache/vllm/hisparse.py`): what vLLM code calls on a
//! resident or hot manager directly, one group's allocation or admission count, and
//! the host pool's `BlockPool` methods. Conversion only, as `hisparse.rs`.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::block::PyKVCacheBlock;
use super::convert::blocks::{id_in, ids_in};
use super::convert::count;
use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;
use crate::error::Error;
use crate::manager::single_type::{GroupBlocks, NumBlocksQuery};
use crate::types::BlockId;

#[pymethods]
impl PyKVCacheCore {
    // ---- resident and hot managers --------------------------------------------------

    /// vLLM's `get_resident_page` of resident group `g`.
    fn core_resident_page(
        &self,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let page = count("block_idx", page)?;
        self.core.read("get_resident_page", |c| {
            let m = resident(c, g)?;
            Ok(m.get_resident_page(request_id, c.get_blocks(request_id, g), page))
        })
    }

    /// vLLM's `get_residency_row(request_id, start)` of resident group `g` (ids).
    fn core_residency_row(&self, g: usize, request_id: &str, start: i64) -> PyResult<Vec<BlockId>> {
        let start = count("start", start)?;
        self.core.read("get_residency_row", |c| {
            let m = resident(c, g)?;
            let mut out = Vec::new();
            m.residency_row(request_id, c.get_blocks(request_id, g), start, &mut out);
            Ok(out)
        })
    }

    /// vLLM's `adopt_resident_page` of resident group `g`.
    fn core_adopt_resident_page(
        slf: &Bound<'_, Self>,
        g: usize,
        request_id: &str,
        page: i64,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let page = count("block_idx", page)?;
        let id = id_in(slf, block, false)?;
        let mut this = slf.try_borrow_mut()?;
        Ok(this.core.hisparse_call(|_, ctx| {
            let table = ctx
                .requests
                .get(request_id)
                .map(|s| s.groups[g].blocks.clone());
            let m = ctx.managers[g]
                .hisparse_resident_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not resident")))?;
            Ok(m.adopt_resident_page(request_id, table.as_deref(), page, id))
        })?)
    }

    /// vLLM's `drop_resident_page` of resident group `g`.
    fn core_drop_resident_page(
        &mut self,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let page = count("block_idx", page)?;
        Ok(self.core.hisparse_call(|_, ctx| {
            let table = ctx
                .requests
                .get(request_id)
                .map(|s| s.groups[g].blocks.clone());
            let m = ctx.managers[g]
                .hisparse_resident_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not resident")))?;
            Ok(m.drop_resident_page(request_id, table.as_deref(), page))
        })?)
    }

    /// `residency_changes` of resident group `g`: `[(request, [(page, block)])]`.
    #[allow(clippy::type_complexity)]
    fn core_residency_changes(&self, g: usize) -> PyResult<Vec<(String, Vec<(usize, BlockId)>)>> {
        self.core.read("residency_changes", |c| {
            let m = resident(c, g)?;
            Ok(m.requests_with_changes()
                .map(|rid| {
                    let changes = m
                        .residency_changes(rid)
                        .map(|c| c.iter().map(|(&p, &b)| (p, b)).collect())
                        .unwrap_or_default();
                    (rid.to_owned(), changes)
                })
                .collect())
        })
    }

    /// vLLM's `require_hot` of hot group `g`.
    fn core_hot_require(&mut self, g: usize, request_id: &str) -> PyResult<()> {
        Ok(self.core.hisparse_call(|_, ctx| {
            ctx.managers[g]
                .hisparse_hot_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not hot")))?
                .require_hot(request_id);
            Ok(())
        })?)
    }

    /// `hot_required` of hot group `g`.
    fn core_hot_required(&self, g: usize) -> PyResult<Vec<String>> {
        self.core.read("hot_required", |c| {
            let m = c
                .coordinator()
                .managers()
                .get(g)
                .and_then(|m| m.hisparse_hot())
                .ok_or_else(|| InvalidArgumentError::new_err(format!("group {g} is not hot")))?;
            Ok(m.hot_required().map(str::to_owned).collect())
        })
    }

    /// One group's `allocate_new_blocks` (vLLM code may call a manager directly):
    /// the new block ids.
    fn core_group_allocate_new_blocks(
        slf: &Bound<'_, Self>,
        g: usize,
        request_id: &str,
        num_tokens: i64,
        num_tokens_main_model: i64,
    ) -> PyResult<Vec<BlockId>> {
        let n = count("num_tokens", num_tokens)?;
        let main = count("num_tokens_main_model", num_tokens_main_model)?;
        let out = slf
            .try_borrow_mut()?
            .core
            .group_allocate_new_blocks(g, request_id, n, main)?;
        Self::flush(slf, None)?;
        Ok(out)
    }

    /// One group's `get_num_blocks_to_allocate` (vLLM code may call a manager
    /// directly); `new_computed_blocks` are handles of the group's pool.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (g, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
        num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=false,
        prefill_end=0))]
    fn core_group_num_blocks_to_allocate(
        slf: &Bound<'_, Self>,
        g: usize,
        request_id: &str,
        num_tokens: i64,
        new_computed_blocks: &Bound<'_, PyAny>,
        total_computed_tokens: i64,
        num_local_computed_tokens: i64,
        num_tokens_main_model: i64,
        apply_admission_cap: bool,
        prefill_end: i64,
    ) -> PyResult<i64> {
        let host = slf.try_borrow()?.core.host_group() == Some(g);
        let mut hits = Vec::new();
        ids_in(slf, new_computed_blocks, host, &mut hits)?;
        let q = NumBlocksQuery {
            request_id,
            num_tokens: count("num_tokens", num_tokens)?,
            new_computed_blocks: &hits,
            total_computed_tokens: count("total_computed_tokens", total_computed_tokens)?,
            num_local_computed_tokens: count(
                "num_local_computed_tokens",
                num_local_computed_tokens,
            )?,
            num_tokens_main_model: count("num_tokens_main_model", num_tokens_main_model)?,
            apply_admission_cap,
            prefill_end: count("prefill_end", prefill_end)?,
        };
        Ok(slf
            .try_borrow_mut()?
            .core
            .group_num_blocks_to_allocate(g, &q)?)
    }

    // ---- the host pool ----------------------------------------------------------------

    /// The host pool's block count (null block included).
    fn core_host_num_blocks(&self) -> u32 {
        self.core
            .host_pool()
            .map_or(0, super::super::pool::BlockPool::num_gpu_blocks)
    }

    /// The host pool's free blocks.
    fn core_host_num_free_blocks(&self) -> usize {
        self.core
            .host_pool()
            .map_or(0, super::super::pool::BlockPool::get_num_free_blocks)
    }

    /// The host pool's usage.
    fn core_host_usage(&self) -> f64 {
        self.core
            .host_pool()
            .map_or(0.0, super::super::pool::BlockPool::get_usage)
    }

    /// The handle of host block `block_id`.
    fn core_host_block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<Py<PyKVCacheBlock>> {
        let mut this = slf.try_borrow_mut()?;
        let id = host_pool(&this.core)?.check_block_id(block_id)?;
        Self::pool_handle(slf, &mut this, id, true)
    }

    /// Host free block ids, head first.
    fn core_host_free_block_ids(&self) -> PyResult<Vec<BlockId>> {
        Ok(host_pool(&self.core)?
            .free_block_queue()
            .get_all_free_blocks())
    }

    /// The host pool's `get_new_blocks`.
    fn core_host_get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = count("num_blocks", num_blocks)?;
        let list = {
            let mut this = slf.try_borrow_mut()?;
            let mut ids = Vec::new();
            this.core
                .host_pool_call(|pool| pool.get_new_blocks(n, &mut ids))?;
            Self::pool_handles_list(slf, &mut this, &ids, true)?
        };
        Self::flush(slf, None)?;
        Ok(list)
    }

    /// The host pool's `free_blocks` (handles of the host pool).
    fn core_host_free_blocks(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        ids_in(slf, blocks, true, &mut ids)?;
        slf.try_borrow_mut()?
            .core
            .host_pool_call(|pool| pool.free_blocks(&ids))?;
        Self::flush(slf, None)
    }

    /// The host pool's `touch`.
    fn core_host_touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        ids_in(slf, blocks, true, &mut ids)?;
        slf.try_borrow_mut()?
            .core
            .host_pool_call(|pool| pool.touch(&ids))?;
        Self::flush(slf, None)
    }

    /// The host pool's `evict_blocks`.
    fn core_host_evict_blocks(slf: &Bound<'_, Self>, block_ids: Vec<i64>) -> PyResult<()> {
        slf.try_borrow_mut()?
            .core
            .host_pool_call(|pool| pool.evict_blocks(&block_ids))?;
        Self::flush(slf, None)
    }

    /// The host pool's `reset_prefix_cache`.
    fn core_host_reset_prefix_cache(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let ok = slf
            .try_borrow_mut()?
            .core
            .host_pool_call(|pool| Ok(pool.reset_prefix_cache()))?;
        Self::flush(slf, None)?;
        Ok(ok)
    }

    /// The host pool's first-inserted block cached under `(block_hash, group_id)`.
    fn core_host_get_cached_block(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        group_id: u32,
    ) -> PyResult<Option<Py<PyKVCacheBlock>>> {
        let hash = super::convert::hashes::hash_from_bytes(block_hash)?;
        let mut this = slf.try_borrow_mut()?;
        match host_pool(&this.core)?.get_cached_block(&hash, group_id) {
            Some(id) => Ok(Some(Self::pool_handle(slf, &mut this, id, true)?)),
            None => Ok(None),
        }
    }

    /// The host pool's index keys: `[(key bytes, [block ids])]`.
    fn core_host_index_items<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Bound<'py, PyBytes>, Vec<BlockId>)>> {
        Ok(host_pool(&self.core)?
            .cached_block_hash_to_block()
            .iter()
            .map(|(k, blocks)| (PyBytes::new(py, &k.to_vllm_bytes()), blocks))
            .collect())
    }

    /// Every request's table of group `g`, for `req_to_blocks` views: ids.
    fn core_group_tables(&self, g: usize) -> Vec<(String, Vec<BlockId>, Option<usize>)> {
        self.core
            .coordinator()
            .request_tables(g)
            .map(|(rid, gb): (&str, &GroupBlocks)| {
                (rid.to_owned(), gb.blocks.clone(), gb.num_cached_block)
            })
            .collect()
    }
}

fn resident(
    core: &crate::manager::KVCacheManager,
    g: usize,
) -> PyResult<&crate::manager::hisparse::HiSparseResidentManager> {
    core.coordinator()
        .managers()
        .get(g)
        .and_then(|m| m.hisparse_resident())
        .ok_or_else(|| InvalidArgumentError::new_err(format!("group {g} is not resident")))
}

fn host_pool(core: &crate::manager::KVCacheManager) -> PyResult<&crate::pool::BlockPool> {
    core.host_pool()
        .ok_or_else(|| InvalidArgumentError::new_err("this KV-cache layout has no host pool"))
}
