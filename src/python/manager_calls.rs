//! `take_events` (every step) in Rust, so that it costs no Python frame, plus the
//! pool-level event queue the Python `BlockPool` view exposes (`kv_event_queue`,
//! `BlockPool.take_events`). The prefix-cache stats calls: `prefix_stats.rs`.
//!
//! `take_events` keeps vLLM's objects as vLLM's code leaves them: it hands over the
//! queued events with each `BlockStored` carrying its group's spec kind and sliding
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
use pyo3::types::PyList;

use super::manager::PyKVCacheCore;

/// vLLM's `kv_cache_manager` logger (the warning of `take_events`).
static VLLM_MANAGER_LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

impl PyKVCacheCore {
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
