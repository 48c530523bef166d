//! The conversion layer: Python objects in, core values out (and back).
//!
//! Review rule (CONTRIBUTING.md): nothing here decides anything. No vLLM rule, no
//! comparison of a token count, no branch on a request's state — only reading an
//! attribute, checking its type and range, and building the core's plain value (or
//! the Python object of a core value). Every rule lives in `crate::manager` and its
//! siblings; `src/python/*.rs` call the core with what these functions read.

pub mod blocks;
pub mod buffers;
pub mod hashes;
pub mod request;
pub mod spec;

pub(crate) use crate::python::errors::count;

use pyo3::exceptions::{PyAttributeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyString;

/// `obj.<name>`, where a missing attribute means the caller passed the wrong kind
/// of object: `TypeError` naming what was expected and what came, instead of a
/// bare `AttributeError` (the "untyped errors"). Costs nothing on success.
pub(crate) fn expect_attr<'py>(
    obj: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
    expected: &str,
) -> PyResult<Bound<'py, PyAny>> {
    obj.getattr(name).map_err(|e| {
        if e.is_instance_of::<PyAttributeError>(obj.py()) {
            let got = obj
                .get_type()
                .name()
                .map_or_else(|_| "?".to_owned(), |n| n.to_string());
            PyTypeError::new_err(format!(
                "expected {expected} (an object with `.{name}`), got {got}"
            ))
        } else {
            e
        }
    })
}
