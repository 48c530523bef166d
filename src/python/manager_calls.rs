//! The manager calls vLLM's Scheduler makes besides the allocations, in Rust so
//! that they cost no Python frame: `record_prefix_cache_stats` (every admission)
//! and `take_events` (every step), plus the pool-level event queue the Python
//! `BlockPool` view exposes (`kv_event_queue`, `BlockPool.take_events`).
//!
//! Both keep vLLM's objects as vLLM's code leaves them, at every point:
//! `record_prefix_cache_stats` updates the manager's `prefix_cache_stats` (vLLM's
//! `PrefixCacheStats`) in place, field by field, exactly as
//! `PrefixCacheStats.record` does, and calls `record` itself for any other stats
//! object (a subclass, a patched `record`); `take_events` hands over the queued
//! events with each `BlockStored` carrying its group's spec kind and sliding
//! window, as vLLM's `KVCacheManager.take_events` leaves them, with vLLM's warning
//! for a group index outside the metadata. The annotation is made when an event is
//! built (the spec table, `src/python/events/spec.rs`): while the manager's
//! `kv_cache_event_metadata` is the tuple the table was made from, a take is the
//! swap of one list, with no per-event work; otherwise vLLM's loop runs over the
//! taken events and a table is made for the next ones. The pool-level take and the
//! live `kv_event_queue` give vLLM's pool's events, un-annotated.
//!
//! `KVCacheCore`'s one `#[pymethods]` block (`manager.rs`) holds these methods'
//! signatures and docstrings and calls the longer bodies here.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyList, PyString};

use super::convert::expect_attr;
use super::convert::request::vllm_request_num_tokens;
use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;

/// vLLM's `PrefixCacheStats` class and its own `record` function, imported once;
/// None where vLLM is not importable or `record` is not vLLM's.
static PREFIX_CACHE_STATS: PyOnceLock<Option<(Py<PyAny>, Py<PyAny>)>> = PyOnceLock::new();

/// Whether `stats` is an instance of vLLM's own `PrefixCacheStats` (not a
/// subclass) whose `record` is vLLM's: its fields can then be counted here.
fn counts_in_place(stats: &Bound<'_, PyAny>) -> bool {
    let py = stats.py();
    let known = PREFIX_CACHE_STATS.get_or_init(py, || {
        let cls = py
            .import("vllm.v1.metrics.stats")
            .and_then(|m| m.getattr("PrefixCacheStats"))
            .ok()?;
        let record = cls.getattr("record").ok()?;
        let name = |attr: &str| -> Option<String> { record.getattr(attr).ok()?.extract().ok() };
        // Captured when first used: a `record` patched before then is not vLLM's.
        (name("__module__").as_deref() == Some("vllm.v1.metrics.stats")
            && name("__qualname__").as_deref() == Some("PrefixCacheStats.record"))
        .then(|| (cls.unbind(), record.unbind()))
    });
    let Some((cls, record)) = known.as_ref() else {
        return false;
    };
    let ty = stats.get_type();
    ty.is(cls.bind(py))
        && ty
            .getattr(intern!(py, "record"))
            .is_ok_and(|r| r.is(record.bind(py)))
}

/// `stats.<name> += by`.
fn bump(
    stats: &Bound<'_, PyAny>,
    name: &Bound<'_, PyString>,
    by: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let value = stats.getattr(name)?.add(by)?;
    stats.setattr(name, value)
}

/// vLLM's `kv_cache_manager` logger (the warning of `take_events`).
static VLLM_MANAGER_LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

impl PyKVCacheCore {
    /// `KVCacheCore.record_prefix_cache_stats`'s body (the method: `manager.rs`).
    pub(super) fn record_prefix_cache_stats_impl(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_hits: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        if !slf.getattr(intern!(py, "log_stats"))?.is_truthy()? {
            return Ok(());
        }
        let caching = slf
            .try_borrow()?
            .core
            .read("record_prefix_cache_stats", |c| {
                PyResult::Ok(c.enable_caching())
            })?;
        if !caching
            || expect_attr(
                request,
                intern!(py, "skip_reading_prefix_cache"),
                "a vLLM Request",
            )?
            .is_truthy()?
        {
            return Ok(());
        }
        let stats = slf.getattr(intern!(py, "prefix_cache_stats"))?;
        if stats.is_none() {
            return Err(InvalidArgumentError::new_err(
                "prefix_cache_stats was replaced by None",
            ));
        }
        // vLLM's `record` counts the request before it adds the hits: a hit count
        // that is not an int would leave the stats half-updated.
        if !num_hits.is_instance_of::<PyInt>() || num_hits.is_instance_of::<PyBool>() {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "num_hits must be an int, got {}",
                num_hits.get_type().name()?
            )));
        }
        if num_hits.lt(0)? {
            return Err(InvalidArgumentError::new_err(format!(
                "num_hits must be non-negative, got {num_hits}"
            )));
        }
        let num_tokens = match vllm_request_num_tokens(request) {
            Some(n) => n.into_pyobject(py)?.into_any(),
            None => request.getattr(intern!(py, "num_tokens"))?,
        };
        let preempted = request.getattr(intern!(py, "num_preemptions"))?.gt(0)?;
        if !counts_in_place(&stats) {
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "num_tokens"), num_tokens)?;
            kwargs.set_item(intern!(py, "num_hits"), num_hits)?;
            kwargs.set_item(intern!(py, "preempted"), preempted)?;
            stats.call_method(intern!(py, "record"), (), Some(&kwargs))?;
            return Ok(());
        }
        // `PrefixCacheStats.record`'s body (the same in vLLM 0.30, 0.32 and 0.33
        // without `hits_by_source`, which the manager never passes).
        let one = 1i32.into_pyobject(py)?.into_any();
        let (requests, queries, hits) = if preempted {
            (
                intern!(py, "preempted_requests"),
                intern!(py, "preempted_queries"),
                intern!(py, "preempted_hits"),
            )
        } else {
            (
                intern!(py, "requests"),
                intern!(py, "queries"),
                intern!(py, "hits"),
            )
        };
        bump(&stats, requests, &one)?;
        bump(&stats, queries, &num_tokens)?;
        bump(&stats, hits, num_hits)
    }

    /// `KVCacheCore.take_events`'s body (the method: `manager.rs`).
    ///
    /// With the spec table in force made from the manager's current
    /// `kv_cache_event_metadata` (identity), the sink's events are annotated
    /// already: the list is handed over as it is. Otherwise vLLM's loop runs over
    /// it (with a table in force, an event of a group outside the metadata is reset
    /// to un-annotated, as vLLM's would be), and a table is made from the metadata
    /// for the sink left behind.
    pub(super) fn take_events_impl<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        // The fast path touches only the manager, the list and the metadata (each
        // step's first call, so mostly cold memory): the builder's class is read
        // below, for vLLM's loop only.
        let (events, in_force) = {
            let mut this = slf.try_borrow_mut()?;
            let events = this.take_event_queue(py);
            if !this.has_event_sink() {
                return Ok(events);
            }
            (events, this.spec_table_state(py))
        };
        let name = intern!(py, "kv_cache_event_metadata");
        // Read once; an error is vLLM's only where its loop reads it (below).
        let current = slf.getattr(name).ok();
        let annotated = match (&in_force, &current) {
            (Some(Some(made_from)), Some(m)) if m.is(made_from) => return Ok(events),
            (Some(_), _) => true,
            (None, _) => false,
        };
        let mut metadata = current;
        if !events.is_empty() {
            if let Some(stored) = slf.try_borrow()?.block_stored_class(py) {
                Self::annotate_taken(slf, &events, &stored, &mut metadata, annotated)?;
            }
        }
        if let Some(m) = &metadata {
            slf.try_borrow_mut()?.install_spec_table(py, m);
        }
        Ok(events)
    }

    /// vLLM's `KVCacheManager.take_events` loop over `events`; `annotated`: they
    /// carry a spec table's annotation, which a group outside `metadata` loses.
    fn annotate_taken<'py>(
        slf: &Bound<'py, Self>,
        events: &Bound<'py, PyList>,
        stored: &Bound<'py, PyAny>,
        metadata: &mut Option<Bound<'py, PyAny>>,
        annotated: bool,
    ) -> PyResult<()> {
        let py = slf.py();
        let group_idx = intern!(py, "group_idx");
        let kind_name = intern!(py, "kv_cache_spec_kind");
        let window_name = intern!(py, "kv_cache_spec_sliding_window");
        for event in events.iter() {
            if !event.is_instance(stored)? {
                continue;
            }
            let g = event.getattr(group_idx)?;
            if g.is_none() {
                continue;
            }
            let meta = match &*metadata {
                Some(m) => m,
                None => metadata.insert(slf.getattr(intern!(py, "kv_cache_event_metadata"))?),
            };
            if g.lt(0)? || g.ge(meta.len()?)? {
                let logger = VLLM_MANAGER_LOGGER.get_or_try_init(py, || {
                    py.import("vllm.v1.core.kv_cache_manager")
                        .and_then(|m| m.getattr("logger"))
                        .map(Bound::unbind)
                })?;
                logger.bind(py).call_method1(
                    intern!(py, "warning"),
                    ("Group index `%s` not in KV cache metadata", &g),
                )?;
                if annotated {
                    let none = py.None();
                    event.setattr(kind_name, &none)?;
                    event.setattr(window_name, &none)?;
                }
                continue;
            }
            let entry = meta.get_item(&g)?;
            let (kind, window): (Bound<'py, PyAny>, Bound<'py, PyAny>) = entry.extract()?;
            event.setattr(kind_name, kind)?;
            event.setattr(window_name, window)?;
        }
        Ok(())
    }
}
