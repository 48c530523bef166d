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

use crate::manager::GroupedBlockIds;
use crate::python::block::PyKVCacheBlock;
use crate::python::blocks::PyKVCacheBlocks;
use crate::python::errors::InvalidArgumentError;
use crate::python::manager::PyKVCacheCore;
use crate::types::BlockId;

/// The id of a `KVCacheBlock` handle of `core` and whether it is a block of
/// HiSparse's host pool.
#[inline]
pub(crate) fn pooled_id_of(
    core: &Bound<'_, PyKVCacheCore>,
    item: &Bound<'_, PyAny>,
) -> PyResult<(BlockId, bool)> {
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
    Ok((block.block_id, block.host))
}

/// The id of a `KVCacheBlock` handle of `core`'s device pool (`host`: of its
/// HiSparse host pool instead).
#[inline]
pub(crate) fn id_in(
    core: &Bound<'_, PyKVCacheCore>,
    item: &Bound<'_, PyAny>,
    host: bool,
) -> PyResult<BlockId> {
    let (id, is_host) = pooled_id_of(core, item)?;
    if is_host != host {
        let (is, want) = if is_host {
            ("host", "device")
        } else {
            ("device", "host")
        };
        return Err(InvalidArgumentError::new_err(format!(
            "block {id} belongs to the {is} pool; expected a block of the {want} pool"
        )));
    }
    Ok(id)
}

/// The id of a `KVCacheBlock` handle of `core`'s device pool.
#[inline]
pub(crate) fn id_of(core: &Bound<'_, PyKVCacheCore>, item: &Bound<'_, PyAny>) -> PyResult<BlockId> {
    id_in(core, item, false)
}

/// The ids of an iterable of handles of one pool of `core`, appended to `out`.
pub(crate) fn ids_in(
    core: &Bound<'_, PyKVCacheCore>,
    blocks: &Bound<'_, PyAny>,
    host: bool,
    out: &mut Vec<BlockId>,
) -> PyResult<()> {
    for item in blocks.try_iter()? {
        out.push(id_in(core, &item?, host)?);
    }
    Ok(())
}

/// The ids of an iterable of handles of either pool, split by pool, each in order.
pub(crate) fn split_pooled_ids(
    core: &Bound<'_, PyKVCacheCore>,
    blocks: &Bound<'_, PyAny>,
    device: &mut Vec<BlockId>,
    host: &mut Vec<BlockId>,
) -> PyResult<()> {
    for item in blocks.try_iter()? {
        let (id, is_host) = pooled_id_of(core, &item?)?;
        if is_host {
            host.push(id);
        } else {
            device.push(id);
        }
    }
    Ok(())
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
    out: &mut GroupedBlockIds,
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
        out.extend_groups(ours.grouped());
        return Ok(true);
    }
    let groups = super::expect_attr(blocks, intern!(py, "blocks"), "KVCacheBlocks")?;
    let host_group = core.try_borrow()?.core.host_group();
    for (g, group) in groups.try_iter()?.enumerate() {
        ids_in(core, &group?, host_group == Some(g), out.open_group_mut())?;
        out.end_group();
    }
    Ok(true)
}

/// Per-group lists of block ids of a `KVCacheBlocks`-shaped object.
pub(crate) fn grouped_ids(
    core: &Bound<'_, PyKVCacheCore>,
    blocks: &Bound<'_, PyAny>,
    out: &mut GroupedBlockIds,
) -> PyResult<()> {
    if let Ok(ours) = blocks.cast::<PyKVCacheBlocks>() {
        let ours = ours.get();
        if !ours.core.bind(core.py()).is(core) {
            return Err(InvalidArgumentError::new_err(
                "KVCacheBlocks of another KV-cache pool",
            ));
        }
        out.extend_groups(ours.grouped());
        return Ok(());
    }
    let groups = super::expect_attr(blocks, intern!(core.py(), "blocks"), "KVCacheBlocks")?;
    let host_group = core.try_borrow()?.core.host_group();
    for (g, group) in groups.try_iter()?.enumerate() {
        ids_in(core, &group?, host_group == Some(g), out.open_group_mut())?;
        out.end_group();
    }
    Ok(())
}
