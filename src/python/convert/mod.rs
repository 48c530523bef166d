//! The conversion layer: Python objects in, core values out (and back).
//!
//! Review rule (CONTRIBUTING.md): nothing here decides anything. No vLLM rule, no
//! comparison of a token count, no branch on a request's state — only reading an
//! attribute, checking its type and range, and building the core's plain value (or
//! the Python object of a core value). Every rule lives in `crate::manager` and its
//! siblings; `src/python/*.rs` call the core with what these functions read.

pub mod blocks;
pub mod buffers;
pub mod facts;
pub mod hashes;
pub mod publications;
pub mod request;
pub mod spec;

pub(crate) use crate::python::errors::count;

use pyo3::exceptions::{PyAttributeError, PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::python::errors::{BlockIdError, InvalidArgumentError};

/// An integer argument. pyo3's `i64` extraction raises the builtin `OverflowError`
/// for an int beyond 64 bits (`2**70`); this one raises `InvalidArgumentError` (a
/// `ValueError`) naming the value, so that a huge count is the same typed error as a
/// count past its range. Anything else (a `str`, a `float`) stays pyo3's `TypeError`.
/// pyo3 adds the argument's name as a note ("while processing 'block_size'").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Int(pub i64);

/// A block id argument: like [`Int`], but an int beyond 64 bits is `BlockIdError`,
/// the error of every other out-of-range block id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockIdInt(pub i64);

/// `obj` as an `i64`; `OverflowError` becomes `out_of_range(obj)`.
fn extract_i64(
    obj: Borrowed<'_, '_, PyAny>,
    out_of_range: impl FnOnce(String) -> PyErr,
) -> PyResult<i64> {
    obj.extract::<i64>().map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(obj.py()) {
            out_of_range(obj.str().map_or_else(|_| "?".to_owned(), |s| s.to_string()))
        } else {
            e
        }
    })
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        extract_i64(obj, |v| {
            InvalidArgumentError::new_err(format!("{v} does not fit in a 64-bit integer"))
        })
        .map(Int)
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for BlockIdInt {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        extract_i64(obj, |v| {
            BlockIdError::new_err(format!("block id {v} is out of range"))
        })
        .map(BlockIdInt)
    }
}

/// [`Int`] for an argument with a default (`#[pyo3(from_py_with = int64)] x: i64`):
/// the signature keeps its literal default (`x=0`), which stubs and `inspect` read.
pub(crate) fn int64(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    obj.extract::<Int>().map(|i| i.0)
}

/// A count argument ([`Int`]) that must be non-negative.
pub(crate) fn count_arg(name: &str, value: Int) -> PyResult<usize> {
    count(name, value.0)
}

/// An id argument ([`Int`]) that must fit `u32` (KV-cache group ids): a negative
/// one is `InvalidArgumentError`, not pyo3's `OverflowError`.
pub(crate) fn u32_arg(name: &str, value: Int) -> PyResult<u32> {
    u32::try_from(value.0).map_err(|_| {
        InvalidArgumentError::new_err(format!("{name} must be in 0..2**32, got {}", value.0))
    })
}

/// A step or mirror id ([`Int`]): a negative one is `InvalidArgumentError`.
pub(crate) fn u64_arg(name: &str, value: Int) -> PyResult<u64> {
    u64::try_from(value.0).map_err(|_| {
        InvalidArgumentError::new_err(format!("{name} must be non-negative, got {}", value.0))
    })
}

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
