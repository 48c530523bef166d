//! The one mapping from core errors to Python exceptions.
//!
//! Each class subclasses the builtin a vLLM caller expects (`KeyError`,
//! `ValueError`, `RuntimeError`, `NotImplementedError`; `InvalidArgumentError` is
//! also an `AssertionError`, what vLLM's checks raise); `hscache.exceptions`
//! re-exports them with docstrings. A failed allocation is the builtin `MemoryError`.

use pyo3::create_exception;
use pyo3::exceptions::{
    PyKeyError, PyMemoryError, PyNotImplementedError, PyRuntimeError, PyValueError,
};
use pyo3::prelude::*;

use crate::error::{Error, ErrorKind};
use crate::slots::OmniRuleError;

create_exception!(hscache._core, UnknownRequestError, PyKeyError);
create_exception!(hscache._core, BlockIdError, PyValueError);
create_exception!(hscache._core, DoubleFreeError, PyValueError);
create_exception!(hscache._core, BlockHashError, PyValueError);
create_exception!(hscache._core, OutOfBlocksError, PyValueError);
create_exception!(hscache._core, InvalidArgumentError, PyValueError);
create_exception!(hscache._core, FreeQueueError, PyRuntimeError);
create_exception!(hscache._core, UnsupportedError, PyNotImplementedError);
create_exception!(hscache._core, EncoderCacheFullError, PyValueError);
create_exception!(hscache._core, UnknownEncoderEntryError, PyKeyError);
create_exception!(hscache._core, InternalError, PyRuntimeError);
create_exception!(hscache._core, InvariantError, InternalError);
create_exception!(
    hscache._core,
    StepIdError,
    InvalidArgumentError,
    "A step id that is not an unconsumed step of this cache: consumed already, never \
     saved, issued by another cache, or one too many steps left unconsumed."
);
create_exception!(
    hscache._core,
    UnservableHitError,
    PyRuntimeError,
    "A request's prefix hit whose cached rows the slot mirror could not validate (never \
     written in the blocks' current versions). vllm-omni's contract makes this fatal (its \
     ``OmniPrefixCacheUnmatchError``): serving only the step's rows would hand the next \
     stage a truncated prompt."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("BlockIdError", py.get_type::<BlockIdError>())?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("BlockHashError", py.get_type::<BlockHashError>())?;
    m.add("OutOfBlocksError", py.get_type::<OutOfBlocksError>())?;
    // Where vLLM's manager checks an argument, it `assert`s: InvalidArgumentError is
    // also an AssertionError, so a caller's `except AssertionError` (vLLM's own tests
    // among them) sees the same class of error from hscache as from vLLM.
    let invalid = py.get_type::<InvalidArgumentError>();
    let bases = pyo3::types::PyTuple::new(
        py,
        [
            py.get_type::<PyValueError>(),
            py.get_type::<pyo3::exceptions::PyAssertionError>(),
        ],
    )?;
    invalid.setattr("__bases__", bases)?;
    m.add("InvalidArgumentError", invalid)?;
    m.add("FreeQueueError", py.get_type::<FreeQueueError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add(
        "EncoderCacheFullError",
        py.get_type::<EncoderCacheFullError>(),
    )?;
    m.add(
        "UnknownEncoderEntryError",
        py.get_type::<UnknownEncoderEntryError>(),
    )?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    // A broken invariant is also an AssertionError: what a test's `assert` on the
    // structure would raise.
    let invariant = py.get_type::<InvariantError>();
    let bases = pyo3::types::PyTuple::new(
        py,
        [
            py.get_type::<InternalError>(),
            py.get_type::<pyo3::exceptions::PyAssertionError>(),
        ],
    )?;
    invariant.setattr("__bases__", bases)?;
    m.add("InvariantError", invariant)?;
    m.add("StepIdError", py.get_type::<StepIdError>())?;
    m.add("UnservableHitError", py.get_type::<UnservableHitError>())?;
    Ok(())
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e.kind() {
            ErrorKind::UnknownRequest => UnknownRequestError::new_err(msg),
            ErrorKind::BlockIdOutOfRange => BlockIdError::new_err(msg),
            ErrorKind::DoubleFree => DoubleFreeError::new_err(msg),
            ErrorKind::BadHashLength => BlockHashError::new_err(msg),
            ErrorKind::NotEnoughFreeBlocks | ErrorKind::NoFreeBlocks => {
                OutOfBlocksError::new_err(msg)
            }
            ErrorKind::InvalidArgument => InvalidArgumentError::new_err(msg),
            ErrorKind::FreeQueueCorrupt => FreeQueueError::new_err(msg),
            ErrorKind::EncoderCacheFull => EncoderCacheFullError::new_err(msg),
            ErrorKind::UnknownEncoderEntry => UnknownEncoderEntryError::new_err(msg),
            ErrorKind::Unsupported => UnsupportedError::new_err(msg),
            ErrorKind::Internal => InternalError::new_err(msg),
            ErrorKind::Invariant => InvariantError::new_err(msg),
            ErrorKind::OutOfMemory => PyMemoryError::new_err(msg),
        }
    }
}

impl From<OmniRuleError> for PyErr {
    fn from(e: OmniRuleError) -> PyErr {
        let msg = e.to_string();
        match e {
            OmniRuleError::StepId { .. } | OmniRuleError::NoRoom { .. } => {
                StepIdError::new_err(msg)
            }
            OmniRuleError::UnknownRequests { .. } => UnknownRequestError::new_err(msg),
            OmniRuleError::Unservable { .. } => UnservableHitError::new_err(msg),
            OmniRuleError::MisalignedHit { .. } | OmniRuleError::Invalid(_) => {
                InvalidArgumentError::new_err(msg)
            }
        }
    }
}

/// A count argument: a non-negative Python int.
pub(crate) fn count(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value).map_err(|_| {
        InvalidArgumentError::new_err(format!("{name} must be non-negative, got {value}"))
    })
}
