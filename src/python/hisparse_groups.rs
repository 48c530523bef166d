//! `HiSparseCore`'s calls on HiSparse's resident and hot managers, for the Python
//! views (`python/hscache/vllm/hisparse.py`): what vLLM code calls on a resident or
//! hot manager directly. One group's allocation or admission count is the
//! coordinator's (`coordinator.rs`), the host pool a `BlockPoolCore` (`pool.rs`).
//! Conversion only, as `hisparse.rs`.

use pyo3::prelude::*;

use super::convert::blocks::id_in;
use super::convert::count;
use super::errors::InvalidArgumentError;
use super::hisparse::PyHiSparseCore;
use crate::error::Error;
use crate::types::BlockId;

#[pymethods]
impl PyHiSparseCore {
    // ---- resident and hot managers --------------------------------------------------

    /// vLLM's `get_resident_page` of resident group `g`.
    fn get_resident_page(
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

    /// vLLM's `get_residency_row(request_id, start)` of resident group `g` (ids).
    fn get_residency_row(
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

    /// vLLM's `adopt_resident_page` of resident group `g`.
    fn adopt_resident_page(
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

    /// vLLM's `drop_resident_page` of resident group `g`.
    fn drop_resident_page(
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

    /// `residency_changes` of resident group `g`: `[(request, [(page, block)])]`.
    #[allow(clippy::type_complexity)]
    fn residency_changes(
        &self,
        py: Python<'_>,
        g: usize,
    ) -> PyResult<Vec<(String, Vec<(usize, BlockId)>)>> {
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

    /// vLLM's `require_hot` of hot group `g`.
    fn require_hot(&self, py: Python<'_>, g: usize, request_id: &str) -> PyResult<()> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        Ok(this.core.hisparse_call(|_, ctx| {
            ctx.managers[g]
                .hisparse_hot_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not hot")))?
                .require_hot(request_id);
            Ok(())
        })?)
    }

    /// `hot_required` of hot group `g`.
    fn hot_required(&self, py: Python<'_>, g: usize) -> PyResult<Vec<String>> {
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
