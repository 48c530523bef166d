//! The batched running-set calls of `KVCacheCore` (`crate::manager::batch`).
//!
//! `core_allocate_slots_batch` reads its arrays once, validates every entry, then
//! runs the core batch. Only entries that may have filled a block touch their
//! `Request` (for `block_hashes` and `num_tokens`, checked to belong to the
//! entry's handle). With KV events on, the core stops after each entry that recorded
//! events so that its events are built with that entry's request (the pool's
//! `EventBuilder`, `src/python/events.rs`), and resumes.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList, PyString};

use super::convert::buffers::{read_i64s, u32_as_i32_bytearray};
use super::convert::hashes::PyListHashes;
use super::errors::{count, InvalidArgumentError, UnknownRequestError};
use super::manager::PyKVCacheCore;
use crate::error::Error;
use crate::manager::{BatchStop, RequestHandle, RunningBatch};

/// `(num_allocated, new_block_ids, offsets)`: int32 bytearrays.
pub(crate) type BatchResult<'py> = (usize, Bound<'py, PyByteArray>, Bound<'py, PyByteArray>);

fn handles(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<RequestHandle>> {
    let mut raw = Vec::new();
    read_i64s(name, obj, &mut raw)?;
    raw.into_iter()
        .map(|h| {
            RequestHandle::try_from(h)
                .map_err(|_| UnknownRequestError::new_err(format!("{name}: bad handle {h}")))
        })
        .collect()
}

fn counts(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let mut raw = Vec::new();
    read_i64s(name, obj, &mut raw)?;
    raw.into_iter().map(|n| count(name, n)).collect()
}

/// See `KVCacheCore.core_allocate_slots_batch`.
pub(crate) fn allocate_slots_batch<'py>(
    slf: &Bound<'py, PyKVCacheCore>,
    requests: &Bound<'py, PyList>,
    handles_obj: &Bound<'py, PyAny>,
    num_computed_tokens: &Bound<'py, PyAny>,
    num_new_tokens: &Bound<'py, PyAny>,
    num_lookahead_tokens: i64,
) -> PyResult<BatchResult<'py>> {
    // One piece: its stages are the module doc's, in that order (read, validate, check
    // the requests, plan, run), each borrowing what the one before built.
    let py = slf.py();
    let handles = handles("handles", handles_obj)?;
    let computed = counts("num_computed_tokens", num_computed_tokens)?;
    let new = counts("num_new_tokens", num_new_tokens)?;
    let batch = RunningBatch {
        handles: &handles,
        num_computed_tokens: &computed,
        num_new_tokens: &new,
        num_lookahead_tokens: count("num_lookahead_tokens", num_lookahead_tokens)?,
    };
    // One request per entry: a longer list is as much a caller's mistake as a
    // shorter one (entry `i` is `requests[i]`).
    if requests.len() != batch.len() {
        return Err(InvalidArgumentError::new_err(format!(
            "{} requests for {} batch entries",
            requests.len(),
            batch.len()
        )));
    }
    let mut may_cache = Vec::new();
    let events = {
        let mut this = slf.try_borrow_mut()?;
        this.core.check_running_batch(&batch, &mut may_cache)?;
        this.core.config().coordinator.enable_kv_cache_events
    };
    // The requests of entries that may fill a block, checked against their handles
    // before anything changes: their hashes must be the request's own.
    let mut prepared: Vec<(PyListHashes<'py>, usize)> = Vec::with_capacity(may_cache.len());
    for &i in &may_cache {
        let request = requests.get_item(i)?;
        let rid = request
            .getattr(intern!(py, "request_id"))?
            .cast_into::<PyString>()
            .map_err(|_| InvalidArgumentError::new_err("request.request_id must be a str"))?;
        if slf.try_borrow()?.core.request_id_of(handles[i]) != Some(rid.to_str()?) {
            return Err(InvalidArgumentError::new_err(format!(
                "entry {i}: requests[{i}] ({rid}) is not the request of handle {:#x}",
                handles[i]
            )));
        }
        let hashes = PyListHashes::new(&request.getattr(intern!(py, "block_hashes"))?)?;
        let n: i64 = request.getattr(intern!(py, "num_tokens"))?.extract()?;
        prepared.push((hashes, count("request.num_tokens", n)?));
    }
    let prepared_of = |i: usize| {
        may_cache
            .binary_search(&i)
            .ok()
            .and_then(|k| prepared.get(k))
            .ok_or_else(|| Error::InvalidArgument(format!("entry {i} was not prepared")))
    };
    let hashes_of = |i: usize| prepared_of(i).map(|p| p.0.clone());
    let num_tokens_of = |i: usize| prepared_of(i).map(|p| p.1);
    // What each entry may cache, read before the first entry changes anything.
    let planned = slf.try_borrow()?.core.plan_running_batch(
        &batch,
        &may_cache,
        &hashes_of,
        &num_tokens_of,
    )?;
    let mut ids = Vec::with_capacity(batch.len());
    let mut offsets = Vec::with_capacity(batch.len() + 1);
    offsets.push(0u32);
    // With events on, the core stops after each entry that recorded events, whose
    // events are built with that entry's request, and resumes.
    let mut start = 0;
    loop {
        let progress = slf.try_borrow_mut()?.core.shielded("allocate_slots", |c| {
            c.allocate_running_batch(
                &batch,
                start,
                &may_cache,
                &planned,
                events,
                &mut ids,
                &mut offsets,
            )
        })?;
        start = progress.next;
        if progress.stop != BatchStop::Events {
            break;
        }
        PyKVCacheCore::flush(slf, Some(&requests.get_item(start - 1)?))?;
    }
    Ok((
        start,
        u32_as_i32_bytearray(py, &ids)?,
        u32_as_i32_bytearray(py, &offsets)?,
    ))
}

/// See `KVCacheCore.core_free_batch`.
pub(crate) fn free_batch(
    slf: &Bound<'_, PyKVCacheCore>,
    handles_obj: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let handles = handles("handles", handles_obj)?;
    Ok(slf
        .try_borrow_mut()?
        .core
        .shielded("free", |c| c.free_batch(&handles))?)
}
