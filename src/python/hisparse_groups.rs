//! `HiSparseCore`'s calls on HiSparse's resident and hot managers, for the Python
//! views (`python/hscache/vllm/hisparse.py`): what vLLM code calls on a resident or
//! hot manager directly. One group's allocation or admission count is the
//! coordinator's (`coordinator.rs`), the host pool a `BlockPoolCore` (`pool.rs`).
//! Conversion only, as `hisparse.rs`.
//!
//! `HiSparseCore`'s one `#[pymethods]` block (`hisparse.rs`) holds these methods'
//! signatures and docstrings and calls the longer bodies here.

use pyo3::prelude::*;

use super::convert::blocks::id_in;
use super::convert::count;
use super::errors::InvalidArgumentError;
use super::hisparse::PyHiSparseCore;
use crate::error::Error;
use crate::types::BlockId;

/// Per request with changes: its `(page, block id)` changes (`residency_changes`).
type ResidencyChanges = Vec<(String, Vec<(usize, BlockId)>)>;

impl PyHiSparseCore {
    // ---- resident and hot managers --------------------------------------------------

    /// `HiSparseCore.get_resident_page`'s body (the method: `hisparse.rs`).
    pub(super) fn get_resident_page_impl(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let this = self.owner.bind(py).try_borrow()?;
        let page = count("block_idx", page)?;
        this.core.read("get_resident_page", |c| {
            let m = resident(c, g)?;
            Ok(m.get_resident_page(request_id, c.get_blocks(request_id, g), page))
        })
    }

    /// `HiSparseCore.get_residency_row`'s body (the method: `hisparse.rs`).
    pub(super) fn get_residency_row_impl(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        start: i64,
    ) -> PyResult<Vec<BlockId>> {
        let this = self.owner.bind(py).try_borrow()?;
        let start = count("start", start)?;
        this.core.read("get_residency_row", |c| {
            let m = resident(c, g)?;
            let mut out = Vec::new();
            m.residency_row(request_id, c.get_blocks(request_id, g), start, &mut out);
            Ok(out)
        })
    }

    /// `HiSparseCore.adopt_resident_page`'s body (the method: `hisparse.rs`).
    pub(super) fn adopt_resident_page_impl(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        page: i64,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let slf = self.owner.bind(py);
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

    /// `HiSparseCore.drop_resident_page`'s body (the method: `hisparse.rs`).
    pub(super) fn drop_resident_page_impl(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        let page = count("block_idx", page)?;
        Ok(this.core.hisparse_call(|_, ctx| {
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

    /// `HiSparseCore.residency_changes`'s body (the method: `hisparse.rs`).
    pub(super) fn residency_changes_impl(
        &self,
        py: Python<'_>,
        g: usize,
    ) -> PyResult<ResidencyChanges> {
        let this = self.owner.bind(py).try_borrow()?;
        this.core.read("residency_changes", |c| {
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

    /// `HiSparseCore.require_hot`'s body (the method: `hisparse.rs`).
    pub(super) fn require_hot_impl(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
    ) -> PyResult<()> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        Ok(this.core.hisparse_call(|_, ctx| {
            ctx.managers[g]
                .hisparse_hot_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not hot")))?
                .require_hot(request_id);
            Ok(())
        })?)
    }

    /// `HiSparseCore.hot_required`'s body (the method: `hisparse.rs`).
    pub(super) fn hot_required_impl(&self, py: Python<'_>, g: usize) -> PyResult<Vec<String>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.core.read("hot_required", |c| {
            let m = c
                .coordinator()
                .managers()
                .get(g)
                .and_then(|m| m.hisparse_hot())
                .ok_or_else(|| InvalidArgumentError::new_err(format!("group {g} is not hot")))?;
            Ok(m.hot_required().map(str::to_owned).collect())
        })
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
