//! `take_events` (every step) in Rust, so that it costs no Python frame, plus the
//! pool-level event queue the Python `BlockPool` view exposes (`kv_event_queue`,
//! `BlockPool.take_events`). The prefix-cache stats calls: `prefix_stats.rs`.
//!
//! `take_events` keeps vLLM's objects as vLLM's code leaves them: it hands over the
//! queued events and annotates each `BlockStored` with its group's spec kind and
//! sliding window, as vLLM's `KVCacheManager.take_events` does, with vLLM's warning
//! for a group index outside the metadata.
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
    pub(super) fn take_events_impl<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let (events, stored) = {
            let mut this = slf.try_borrow_mut()?;
            let events = this.take_event_queue(py);
            if events.is_empty() {
                return Ok(events);
            }
            (events, this.block_stored_class(py))
        };
        let Some(stored) = stored else {
            return Ok(events);
        };
        let mut metadata: Option<Bound<'py, PyAny>> = None;
        let group_idx = intern!(py, "group_idx");
        let kind_name = intern!(py, "kv_cache_spec_kind");
        let window_name = intern!(py, "kv_cache_spec_sliding_window");
        for event in events.iter() {
            if !event.is_instance(&stored)? {
                continue;
            }
            let g = event.getattr(group_idx)?;
            if g.is_none() {
                continue;
            }
            let meta = match &metadata {
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
                continue;
            }
            let entry = meta.get_item(&g)?;
            let (kind, window): (Bound<'py, PyAny>, Bound<'py, PyAny>) = entry.extract()?;
            event.setattr(kind_name, kind)?;
            event.setattr(window_name, window)?;
        }
        Ok(events)
    }
}
