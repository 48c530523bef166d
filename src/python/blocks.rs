//! `KVCacheBlocks`: vLLM's allocation result, with block ids held in Rust.
//!
//! Duck-typed drop-in for vLLM 0.33's `KVCacheBlocks` dataclass (`blocks`,
//! `get_block_ids`, `get_unhashed_block_ids`, `get_unhashed_block_ids_all_groups`,
//! `new_empty`, `+`); vLLM never checks its type. The Scheduler calls
//! `get_block_ids()` on every result it gets, so the ids are kept as integers and
//! the block handles behind `blocks` are only built when someone reads `blocks`
//! (then once: the tuple is identity-stable per object).
//!
//! Key properties:
//! - One KV-cache group (the configurations the core serves).
//! - A snapshot: the ids are those of the call that made the object. (vLLM's
//!   `get_blocks` shares the live table list; the Scheduler reads it at once.)

use std::sync::OnceLock;

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::PyTraverseError;

use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;
use crate::types::BlockId;

#[pyclass(name = "KVCacheBlocks", module = "hscache._core", frozen)]
pub struct PyKVCacheBlocks {
    pub(crate) ids: Vec<BlockId>,
    pub(crate) core: Py<PyKVCacheCore>,
    blocks: OnceLock<Py<PyTuple>>,
}

impl PyKVCacheBlocks {
    pub(crate) fn new(core: Py<PyKVCacheCore>, ids: Vec<BlockId>) -> Self {
        Self {
            ids,
            core,
            blocks: OnceLock::new(),
        }
    }

    fn ids_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, [PyList::new(py, &self.ids)?])
    }
}

#[pymethods]
impl PyKVCacheBlocks {
    /// `blocks[g][j]`: the j-th block of group g (one group here).
    #[getter]
    fn blocks(&self, py: Python<'_>) -> PyResult<Py<PyTuple>> {
        if let Some(b) = self.blocks.get() {
            return Ok(b.clone_ref(py));
        }
        let group: Bound<'_, PyAny> = if self.ids.is_empty() {
            PyTuple::empty(py).into_any()
        } else {
            PyKVCacheCore::handles_for(self.core.bind(py), &self.ids)?.into_any()
        };
        let tuple = PyTuple::new(py, [group])?.unbind();
        Ok(self.blocks.get_or_init(|| tuple).clone_ref(py))
    }

    /// vLLM's `get_block_ids`: `([ids],)`, or None with `allow_none` when empty.
    #[pyo3(signature = (allow_none=false, *, group_ids=None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<Vec<i64>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if let Some(groups) = group_ids {
            if groups.iter().any(|&g| g != 0) {
                return Err(pyo3::exceptions::PyIndexError::new_err(
                    "KV-cache group id out of range (one group)",
                ));
            }
            if allow_none && (groups.is_empty() || self.ids.is_empty()) {
                return Ok(None);
            }
            let lists = groups
                .iter()
                .map(|_| PyList::new(py, &self.ids))
                .collect::<PyResult<Vec<_>>>()?;
            return PyTuple::new(py, lists).map(Some);
        }
        if allow_none && self.ids.is_empty() {
            return Ok(None);
        }
        self.ids_list(py).map(Some)
    }

    /// Ids of the blocks without a hash (one group).
    fn get_unhashed_block_ids(&self, py: Python<'_>) -> PyResult<Vec<BlockId>> {
        let core = self.core.bind(py).try_borrow()?;
        let pool = core.core.block_pool();
        Ok(self
            .ids
            .iter()
            .copied()
            .filter(|&b| pool.block_hash(b).is_none())
            .collect())
    }

    /// Per group, ids of unhashed blocks, leading and other null blocks dropped.
    fn get_unhashed_block_ids_all_groups(&self, py: Python<'_>) -> PyResult<Vec<Vec<BlockId>>> {
        let core = self.core.bind(py).try_borrow()?;
        let pool = core.core.block_pool();
        Ok(vec![self
            .ids
            .iter()
            .copied()
            .filter(|&b| b != crate::types::NULL_BLOCK_ID && pool.block_hash(b).is_none())
            .collect()])
    }

    /// An empty `KVCacheBlocks` of the same shape.
    fn new_empty(&self, py: Python<'_>) -> Self {
        Self::new(self.core.clone_ref(py), Vec::new())
    }

    /// Concatenation per group (vLLM's `__add__`).
    fn __add__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        let other = other.cast::<PyKVCacheBlocks>()?.get();
        if !other.core.bind(py).is(self.core.bind(py)) {
            return Err(InvalidArgumentError::new_err(
                "cannot add KVCacheBlocks of another KV-cache pool",
            ));
        }
        let mut ids = self.ids.clone();
        ids.extend_from_slice(&other.ids);
        Ok(Self::new(self.core.clone_ref(py), ids))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyKVCacheBlocks>()
            .is_ok_and(|o| o.get().ids == self.ids)
    }

    fn __repr__(&self) -> String {
        format!("KVCacheBlocks(block_ids=({:?},))", self.ids)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.core)?;
        if let Some(b) = self.blocks.get() {
            visit.call(b)?;
        }
        Ok(())
    }
}
