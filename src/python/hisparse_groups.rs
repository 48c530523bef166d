//! `KVCacheCore`'s calls on HiSparse's single-type managers and host pool, for the
//! Python views (`python/hscache/vllm/hisparse.py`): what vLLM code calls on a
//! resident or hot manager directly, one group's allocation or admission count, and
//! the host pool's `BlockPool` methods. Conversion only, as `hisparse.rs`.

use pyo3::prelude::*;

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
