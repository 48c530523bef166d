//! Python bindings of explain mode (`crate::explain`): turning it on and the record
//! of a request's last lookup as a dict (cold paths only: nothing here runs with
//! explain mode off). A vLLM `Request`'s token ids and extra-key fields for the
//! core's fingerprints are read in `convert/facts.rs`. `hscache.explain` is the typed
//! glue over the dict.
//!
//! `KVCacheCore`'s one `#[pymethods]` block (`manager.rs`) holds these methods'
//! signatures and docstrings and calls the longer bodies here.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::manager::PyKVCacheCore;
use crate::explain::Detail;

fn detail_value<'py>(py: Python<'py>, d: &Detail) -> PyResult<Bound<'py, PyAny>> {
    Ok(match d {
        Detail::Int(n) => n.into_pyobject(py)?.into_any(),
        Detail::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        Detail::Str(s) => s.into_pyobject(py)?.into_any(),
        Detail::List(items) => PyList::new(py, items)?.into_any(),
    })
}

impl PyKVCacheCore {
    /// `KVCacheCore.core_set_explain`'s body (the method: `manager.rs`).
    pub(super) fn core_set_explain_impl(
        &mut self,
        on: bool,
        history_capacity: Option<i64>,
    ) -> PyResult<()> {
        let capacity = history_capacity
            .map(|c| super::convert::count("history_capacity", c))
            .transpose()?;
        Ok(self.core.set_explain(on, capacity)?)
    }

    /// `KVCacheCore.core_explain_summary`'s body (the method: `manager.rs`).
    pub(super) fn core_explain_summary_impl<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let Some(e) = self.core.explainer() else {
            return Err(crate::error::Error::Unsupported(
                "explain mode is off: build the manager with explain=True or set HSCACHE_EXPLAIN=1"
                    .into(),
            )
            .into());
        };
        let lookups = PyDict::new(py);
        for (reason, n) in crate::explain::Reason::ALL.iter().zip(e.reason_counts()) {
            lookups.set_item(reason.name(), n)?;
        }
        let out = PyDict::new(py);
        out.set_item("lookups", lookups)?;
        out.set_item("requests", e.num_requests())?;
        Ok(out)
    }

    /// `KVCacheCore.core_explain`'s body (the method: `manager.rs`).
    pub(super) fn core_explain_impl<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyDict>> {
        let record = self.core.explain(request_id)?;
        let out = PyDict::new(py);
        out.set_item("hit_blocks", record.hit_blocks)?;
        out.set_item("hit_tokens", record.hit_tokens)?;
        out.set_item("num_full_blocks", record.num_full_blocks)?;
        out.set_item("num_tokens", record.num_tokens)?;
        out.set_item("reason", record.reason.name())?;
        out.set_item("lookup_seq", record.lookup_seq)?;
        let detail = PyDict::new(py);
        for (k, v) in &record.detail {
            detail.set_item(*k, detail_value(py, v)?)?;
        }
        out.set_item("detail", detail)?;
        Ok(out)
    }
}
