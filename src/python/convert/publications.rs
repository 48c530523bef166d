//! HiSparse publications' requests for the core: the core names a publication's
//! request by id (it publishes later, in another call) and asks, through
//! [`PublicationRequests`], whether that request has finished and what the
//! interpreter's `hash()` of a request id is (it orders what vLLM iterates as a
//! `set`). [`Publications`] answers from the request objects the manager's binding
//! keeps by publication id (`PyKVCacheCore::publications`, `src/python/manager.rs`); the
//! manager's and `HiSparseCore`'s (`src/python/hisparse.rs`) calls both use it.

use std::cell::RefCell;

use pyo3::prelude::*;
use pyo3::types::PyString;
use rustc_hash::FxHashMap;

use crate::error::{Error, Result};
use crate::manager::hisparse::PublicationRequests;

/// [`PublicationRequests`] over the publications' request objects.
pub(crate) struct Publications<'a, 'py> {
    py: Python<'py>,
    requests: &'a FxHashMap<u64, Py<PyAny>>,
    err: RefCell<Option<PyErr>>,
}

impl<'a, 'py> Publications<'a, 'py> {
    pub(crate) fn new(py: Python<'py>, requests: &'a FxHashMap<u64, Py<PyAny>>) -> Self {
        Self {
            py,
            requests,
            err: RefCell::new(None),
        }
    }

    fn stash(&self, e: PyErr) -> Error {
        let msg = e.to_string();
        *self.err.borrow_mut() = Some(e);
        Error::InvalidArgument(msg)
    }

    /// The error to raise for a failed call: the Python error behind it, if any.
    pub(crate) fn error(&self, e: Error) -> PyErr {
        self.err.borrow_mut().take().unwrap_or_else(|| e.into())
    }
}

impl PublicationRequests for Publications<'_, '_> {
    fn is_finished(&self, publication: u64) -> Result<bool> {
        let Some(request) = self.requests.get(&publication) else {
            return Err(Error::Internal(format!(
                "HiSparse publication {publication} has no request"
            )));
        };
        request
            .bind(self.py)
            .call_method0("is_finished")
            .and_then(|v| v.is_truthy())
            .map_err(|e| self.stash(e))
    }

    fn request_hash(&self, request_id: &str) -> Result<u64> {
        PyString::new(self.py, request_id)
            .hash()
            .map(|h| h as u64)
            .map_err(|e| self.stash(e))
    }
}
