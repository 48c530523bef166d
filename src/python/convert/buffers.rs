//! Integer arrays across the boundary without the `numpy` crate.
//!
//! Outputs are `bytearray`s that Rust fills in place (`PyByteArray::new_with`), so
//! `np.frombuffer` / `torch.frombuffer` view them without a copy. Inputs are a
//! `list` of ints (read item by item) or a `bytes` / `bytearray` of native-endian
//! int64 (`ndarray.tobytes()`, one memcpy). Why not the `numpy` crate: the
//! extension targets abi3-py310, whose limited API has no buffer protocol, and these
//! two forms give the same zero-copy results without pulling `ndarray` into every
//! build.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList};

use crate::python::errors::InvalidArgumentError;

/// A `bytearray` of native-endian int64 holding `n` values.
pub(crate) fn i64_bytearray<'py>(
    py: Python<'py>,
    n: usize,
    values: impl Iterator<Item = i64>,
) -> PyResult<Bound<'py, PyByteArray>> {
    PyByteArray::new_with(py, n * 8, |buf| {
        for (chunk, v) in buf.chunks_exact_mut(8).zip(values) {
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    })
}

/// A `bytearray` of native-endian int32 holding `values`.
pub(crate) fn u32_as_i32_bytearray<'py>(
    py: Python<'py>,
    values: &[u32],
) -> PyResult<Bound<'py, PyByteArray>> {
    PyByteArray::new_with(py, values.len() * 4, |buf| {
        for (chunk, &v) in buf.chunks_exact_mut(4).zip(values) {
            // Block ids and offsets are below 2^31 (pools hold at most i32::MAX blocks).
            chunk.copy_from_slice(&(v as i32).to_ne_bytes());
        }
        Ok(())
    })
}

fn from_ne_bytes(name: &str, bytes: &[u8], out: &mut Vec<i64>) -> PyResult<()> {
    if bytes.len() % 8 != 0 {
        return Err(InvalidArgumentError::new_err(format!(
            "{name}: {} bytes is not a whole number of int64 values",
            bytes.len()
        )));
    }
    out.extend(bytes.chunks_exact(8).map(|c| {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        i64::from_ne_bytes(b)
    }));
    Ok(())
}

/// Reads a list of ints, or native-endian int64 bytes, into `out` (cleared first).
pub(crate) fn read_i64s(name: &str, obj: &Bound<'_, PyAny>, out: &mut Vec<i64>) -> PyResult<()> {
    out.clear();
    if let Ok(list) = obj.cast::<PyList>() {
        out.reserve(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(item.extract().map_err(|_| {
                let got = item
                    .repr()
                    .map_or_else(|_| "?".to_owned(), |r| r.to_string());
                InvalidArgumentError::new_err(format!(
                    "{name} must hold ints of 64 bits: {name}[{i}] is {got}"
                ))
            })?);
        }
        return Ok(());
    }
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        return from_ne_bytes(name, bytes.as_bytes(), out);
    }
    if let Ok(array) = obj.cast::<PyByteArray>() {
        return from_ne_bytes(name, &array.to_vec(), out);
    }
    Err(InvalidArgumentError::new_err(format!(
        "{name} must be a list of ints or int64 bytes, got {}",
        obj.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}
