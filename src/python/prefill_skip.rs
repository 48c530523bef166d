//! `prefill_skip`: the core `crate::prefill_skip` as a Python function, and the one
//! encoding of its result shared with `SlotMirror` plans.
//!
//! Conversion only. Counts come in as lists of ints or native-endian int64 bytes
//! (`ndarray.tobytes()`), flags as lists of bools or bytes of 0/1; the result goes
//! out as `(num_logits, max_query_len, reduced, lengths, ints, computed)` where `ints`
//! is one `bytearray` of native-endian int32 holding the padded logits indices, the
//! reduced `query_start_loc` and the per-request kept counts, back to back (one
//! buffer, so the Python side stages it into pinned memory and copies it to the
//! device in one transfer), `lengths` their three lengths, and `computed` a
//! `bytearray` of one 0/1 byte per token.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList};

use super::buffers::read_i64s;
use super::errors::InvalidArgumentError;
use crate::prefill_skip::{plan_prefill_skip, PrefillSkip, PrefillSkipInput};

/// `(num_logits, max_query_len, reduced, lengths, ints, computed)` (module docs).
pub(crate) type SkipTuple<'py> = (
    usize,
    u32,
    bool,
    (usize, usize, usize),
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
);

/// Encodes a result (module docs).
pub(crate) fn skip_tuple<'py>(py: Python<'py>, s: &PrefillSkip) -> PyResult<SkipTuple<'py>> {
    let values = s
        .logits_indices
        .iter()
        .chain(&s.query_start_loc)
        .copied()
        .chain(s.num_kept.iter().map(|&k| k as i32));
    let lengths = (
        s.logits_indices.len(),
        s.query_start_loc.len(),
        s.num_kept.len(),
    );
    let n = lengths.0 + lengths.1 + lengths.2;
    let ints = PyByteArray::new_with(py, n * 4, |buf| {
        for (chunk, v) in buf.chunks_exact_mut(4).zip(values) {
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    })?;
    let computed = PyByteArray::new_with(py, s.computed.len(), |buf| {
        for (b, &c) in buf.iter_mut().zip(&s.computed) {
            *b = u8::from(c);
        }
        Ok(())
    })?;
    Ok((
        s.num_logits,
        s.max_query_len,
        s.reduced,
        lengths,
        ints,
        computed,
    ))
}

/// Reads counts (list of ints or int64 bytes) as `u32`s.
pub(crate) fn read_u32s(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let mut raw = Vec::new();
    read_i64s(name, obj, &mut raw)?;
    raw.into_iter()
        .map(|v| {
            u32::try_from(v).map_err(|_| {
                InvalidArgumentError::new_err(format!("{name}: {v} is not a count in 0..2^32"))
            })
        })
        .collect()
}

/// Reads flags (list of bools or bytes of 0/1).
fn read_flags(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        return Ok(bytes.as_bytes().iter().map(|&b| b != 0).collect());
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .map(|item| {
                item.extract::<bool>()
                    .map_err(|_| InvalidArgumentError::new_err(format!("{name} must hold bools")))
            })
            .collect();
    }
    Err(InvalidArgumentError::new_err(format!(
        "{name} must be a list of bools or bytes of 0/1"
    )))
}

/// The reduced batch of the KV-sharing layers (see `crate::prefill_skip`).
#[pyfunction]
#[pyo3(signature = (num_scheduled_tokens: "list[int] | bytes", num_spec_tokens: "list[int] | bytes | None"=None, samples: "list[bool] | bytes | None"=None, *, num_reqs_padded: "int | None"=None, num_logits_padded: "int"=0, query_start_loc: "list[int] | bytes | None"=None) -> "PrefillSkipRaw")]
pub fn prefill_skip<'py>(
    py: Python<'py>,
    num_scheduled_tokens: &Bound<'py, PyAny>,
    num_spec_tokens: Option<&Bound<'py, PyAny>>,
    samples: Option<&Bound<'py, PyAny>>,
    num_reqs_padded: Option<usize>,
    num_logits_padded: usize,
    query_start_loc: Option<&Bound<'py, PyAny>>,
) -> PyResult<SkipTuple<'py>> {
    // Stateless: a panic is InternalError, with nothing to poison.
    crate::shield::catch("prefill_skip", || {
        let sched = read_u32s("num_scheduled_tokens", num_scheduled_tokens)?;
        let spec = match num_spec_tokens {
            Some(obj) => read_u32s("num_spec_tokens", obj)?,
            None => Vec::new(),
        };
        let samples = match samples {
            Some(obj) => read_flags("samples", obj)?,
            None => Vec::new(),
        };
        let mut qsl = Vec::new();
        if let Some(obj) = query_start_loc {
            read_i64s("query_start_loc", obj, &mut qsl)?;
        }
        let mut out = PrefillSkip::default();
        plan_prefill_skip(
            &PrefillSkipInput {
                num_scheduled_tokens: &sched,
                num_spec_tokens: &spec,
                samples: &samples,
                num_reqs_padded: num_reqs_padded.unwrap_or(sched.len()),
                num_logits_padded,
                query_start_loc: query_start_loc.map(|_| qsl.as_slice()),
            },
            &mut out,
        )?;
        skip_tuple(py, &out)
    })
}
