//! Block handles and `KVCacheBlocks` read as block ids.
//!
//! The Scheduler hands back the objects the manager gave it: `KVCacheBlock` handles
//! (deferred frees) and `KVCacheBlocks` lookup results (`new_computed_blocks`).
//! These functions turn them into ids of *this* core, refusing another core's
//! blocks, and tell the manager's empty singleton (vLLM's identity check: "no
//! lookup result") from an empty lookup result.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use smallvec::SmallVec;

use crate::python::block::PyKVCacheBlock;
use crate::python::blocks::PyKVCacheBlocks;
use crate::python::errors::InvalidArgumentError;
use crate::python::manager::PyKVCacheCore;
use crate::types::BlockId;

/// The id of a `KVCacheBlock` handle of `core`.
#[inline]
pub(crate) fn id_of(core: &Bound<'_, PyKVCacheCore>, item: &Bound<'_, PyAny>) -> PyResult<BlockId> {
    let block = item
        .cast::<PyKVCacheBlock>()
        .map_err(|_| InvalidArgumentError::new_err("expected hscache KVCacheBlock objects"))?
        .get();
    if !block.core.bind(core.py()).is(core) {
        return Err(InvalidArgumentError::new_err(format!(
            "block {} belongs to another KV-cache pool",
            block.block_id
        )));
    }
    Ok(block.block_id)
}

/// The ids of an iterable of `KVCacheBlock` handles of `core`, appended to `out`.
pub(crate) fn ids_of(
    core: &Bound<'_, PyKVCacheCore>,
    blocks: &Bound<'_, PyAny>,
    out: &mut Vec<BlockId>,
) -> PyResult<()> {
    if let Ok(list) = blocks.cast::<PyList>() {
        for item in list.iter() {
            out.push(id_of(core, &item)?);
        }
        return Ok(());
    }
    if let Ok(tuple) = blocks.cast::<PyTuple>() {
        for item in tuple.iter() {
            out.push(id_of(core, &item)?);
        }
        return Ok(());
    }
    for item in blocks.try_iter()? {
        out.push(id_of(core, &item?)?);
    }
    Ok(())
}

/// A lookup result handed back to `allocate_slots`: `Ok(false)` for the manager's
/// empty singleton (no lookup result); else its ids, group after group, into
/// `ids` / `ends`. Any `KVCacheBlocks`-shaped object of this core is accepted (its
/// `blocks` is read per group).
pub(crate) fn hit_ids(
    core: &Bound<'_, PyKVCacheCore>,
    empty: &Bound<'_, PyKVCacheBlocks>,
    blocks: &Bound<'_, PyAny>,
    ids: &mut Vec<BlockId>,
    ends: &mut SmallVec<[usize; 4]>,
) -> PyResult<bool> {
    let py = core.py();
    if let Ok(ours) = blocks.cast::<PyKVCacheBlocks>() {
        if ours.is(empty) {
            return Ok(false);
        }
        let ours = ours.get();
        if !ours.core.bind(py).is(core) {
            return Err(InvalidArgumentError::new_err(
                "new_computed_blocks belong to another KV-cache pool",
            ));
        }
        ids.extend_from_slice(&ours.ids);
        ends.extend_from_slice(&ours.ends);
        return Ok(true);
    }
    let groups = blocks.getattr(intern!(py, "blocks"))?;
    for group in groups.try_iter()? {
        ids_of(core, &group?, ids)?;
        ends.push(ids.len());
    }
    Ok(true)
}

/// Per-group lists of block ids of a `KVCacheBlocks`-shaped object.
pub(crate) fn grouped_ids(
    core: &Bound<'_, PyKVCacheCore>,
    blocks: &Bound<'_, PyAny>,
    ids: &mut Vec<BlockId>,
    ends: &mut SmallVec<[usize; 4]>,
) -> PyResult<()> {
    if let Ok(ours) = blocks.cast::<PyKVCacheBlocks>() {
        let ours = ours.get();
        if !ours.core.bind(core.py()).is(core) {
            return Err(InvalidArgumentError::new_err(
                "KVCacheBlocks of another KV-cache pool",
            ));
        }
        ids.extend_from_slice(&ours.ids);
        ends.extend_from_slice(&ours.ends);
        return Ok(());
    }
    let groups = blocks.getattr(intern!(core.py(), "blocks"))?;
    for group in groups.try_iter()? {
        ids_of(core, &group?, ids)?;
        ends.push(ids.len());
    }
    Ok(())
}
