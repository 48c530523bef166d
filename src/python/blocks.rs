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
//! - One list per KV-cache group: group `g` is `ids[ends[g - 1]..ends[g]]`.
//! - The manager's empty singleton holds empty tuples (vLLM's immutable
//!   `KVCacheBlocks(tuple(() for _ in groups))`); other objects hold lists.
//! - A snapshot: the ids are those of the call that made the object. (vLLM's
//!   `get_blocks` shares the live table lists; the Scheduler reads them at once.)

use std::sync::OnceLock;

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::PyTraverseError;
use smallvec::SmallVec;

use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;
use crate::manager::{GroupedBlockIds, GroupedBlocks};
use crate::types::{BlockId, NULL_BLOCK_ID};

#[pyclass(name = "KVCacheBlocks", module = "hscache._core", frozen)]
pub struct PyKVCacheBlocks {
    pub(crate) ids: Vec<BlockId>,
    pub(crate) ends: SmallVec<[usize; 4]>,
    pub(crate) core: Py<PyKVCacheCore>,
    /// The empty singleton: groups are empty tuples.
    singleton: bool,
    blocks: OnceLock<Py<PyTuple>>,
}

impl PyKVCacheBlocks {
    /// Blocks of every group (`ends` closes each group).
    pub(crate) fn new(
        core: Py<PyKVCacheCore>,
        ids: Vec<BlockId>,
        ends: SmallVec<[usize; 4]>,
    ) -> Self {
        Self {
            ids,
            ends,
            core,
            singleton: false,
            blocks: OnceLock::new(),
        }
    }

    /// The manager's empty singleton for `num_groups` groups.
    pub(crate) fn empty_singleton(core: Py<PyKVCacheCore>, num_groups: usize) -> Self {
        Self {
            ids: Vec::new(),
            ends: SmallVec::from_elem(0, num_groups),
            core,
            singleton: true,
            blocks: OnceLock::new(),
        }
    }

    /// The ids grouped.
    pub(crate) fn grouped(&self) -> GroupedBlocks<'_> {
        GroupedBlocks {
            ids: &self.ids,
            ends: &self.ends,
        }
    }

    #[inline]
    fn group(&self, g: usize) -> &[BlockId] {
        self.grouped().group(g)
    }

    fn num_groups(&self) -> usize {
        self.ends.len()
    }

    fn group_list<'py>(&self, py: Python<'py>, g: usize) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.group(g))
    }
}

#[pymethods]
impl PyKVCacheBlocks {
    /// `copy.copy()`: the object is immutable, so the copy is itself (vLLM's
    /// dataclass copies; both name the same blocks).
    fn __copy__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// `blocks[g][j]`: the j-th block of group g.
    #[getter]
    fn blocks(&self, py: Python<'_>) -> PyResult<Py<PyTuple>> {
        if let Some(b) = self.blocks.get() {
            return Ok(b.clone_ref(py));
        }
        let core = self.core.bind(py);
        let mut groups: Vec<Bound<'_, PyAny>> = Vec::with_capacity(self.num_groups());
        for g in 0..self.num_groups() {
            groups.push(if self.singleton {
                PyTuple::empty(py).into_any()
            } else {
                PyKVCacheCore::handles_for(core, g, self.group(g))?.into_any()
            });
        }
        let tuple = PyTuple::new(py, groups)?.unbind();
        Ok(self.blocks.get_or_init(|| tuple).clone_ref(py))
    }

    /// vLLM's `get_block_ids`: one id list per (selected) group, or None with
    /// `allow_none` when every selected group is empty.
    #[pyo3(signature = (allow_none=false, *, group_ids=None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<Vec<i64>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let n = self.num_groups();
        let selected: Vec<usize> = match group_ids {
            None => (0..n).collect(),
            Some(ids) => ids
                .into_iter()
                .map(|g| {
                    usize::try_from(g).ok().filter(|&g| g < n).ok_or_else(|| {
                        pyo3::exceptions::PyIndexError::new_err(format!(
                            "KV-cache group id {g} out of range ({n} groups)"
                        ))
                    })
                })
                .collect::<PyResult<_>>()?,
        };
        if allow_none && selected.iter().all(|&g| self.group(g).is_empty()) {
            return Ok(None);
        }
        let lists = selected
            .iter()
            .map(|&g| self.group_list(py, g))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, lists).map(Some)
    }

    /// Ids of the blocks without a hash (one group only, as in vLLM).
    fn get_unhashed_block_ids(&self, py: Python<'_>) -> PyResult<Vec<BlockId>> {
        if self.num_groups() != 1 {
            return Err(InvalidArgumentError::new_err(
                "get_unhashed_block_ids needs exactly one KV-cache group",
            ));
        }
        let core = self.core.bind(py).try_borrow()?;
        let pool = core.core.pool_of(0);
        Ok(self
            .group(0)
            .iter()
            .copied()
            .filter(|&b| pool.block_hash(b).is_none())
            .collect())
    }

    /// Per group, ids of unhashed blocks, null blocks dropped.
    fn get_unhashed_block_ids_all_groups(&self, py: Python<'_>) -> PyResult<Vec<Vec<BlockId>>> {
        let core = self.core.bind(py).try_borrow()?;
        Ok((0..self.num_groups())
            .map(|g| {
                let pool = core.core.pool_of(g);
                self.group(g)
                    .iter()
                    .copied()
                    .filter(|&b| b != NULL_BLOCK_ID && pool.block_hash(b).is_none())
                    .collect()
            })
            .collect())
    }

    /// An empty `KVCacheBlocks` of the same shape.
    fn new_empty(&self, py: Python<'_>) -> Self {
        Self::empty_singleton(self.core.clone_ref(py), self.num_groups())
    }

    /// Concatenation per group (vLLM's `__add__`).
    fn __add__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        let other = other.cast::<PyKVCacheBlocks>()?.get();
        if !other.core.bind(py).is(self.core.bind(py)) {
            return Err(InvalidArgumentError::new_err(
                "cannot add KVCacheBlocks of another KV-cache pool",
            ));
        }
        let n = self.num_groups().max(other.num_groups());
        let mut sum = GroupedBlockIds::with_capacity(self.ids.len() + other.ids.len());
        for g in 0..n {
            sum.extend(self.group(g));
            sum.extend(other.group(g));
            sum.end_group();
        }
        let (ids, ends) = sum.into_parts();
        Ok(Self::new(self.core.clone_ref(py), ids, ends))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyKVCacheBlocks>().is_ok_and(|o| {
            let o = o.get();
            o.ids == self.ids && o.ends == self.ends
        })
    }

    fn __repr__(&self) -> String {
        let groups: Vec<&[BlockId]> = (0..self.num_groups()).map(|g| self.group(g)).collect();
        format!("KVCacheBlocks(block_ids={groups:?})")
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.core)?;
        if let Some(b) = self.blocks.get() {
            visit.call(b)?;
        }
        Ok(())
    }
}
