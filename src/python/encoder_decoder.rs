//! `EncoderDecoderCacheCore`: the core `EncoderDecoderCacheManager` as a subclassable
//! Python class.
//!
//! `hscache.vllm.encoder_cache_manager.EncoderDecoderCacheManager` subclasses it. The
//! methods vLLM's Scheduler calls for encoder-decoder models (`can_allocate`,
//! `allocate`, `free_encoder_input`, `free`, `get_cached_input_ids`,
//! `get_freed_mm_hashes`, `check_and_update_cache`, `reset`) have vLLM 0.33's exact
//! signatures; a `Request` is read for `mm_features[input_id].identifier` and
//! `get_num_encoder_embeds(input_id)` before the core is borrowed.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PySet};

use super::convert::Int;
use super::encoder_cache::{identifier, num_embeds};
use crate::encoder_cache::EncoderDecoderCacheManager;
use crate::shield::Shielded;

/// Every call runs behind the core's panic shield (`src/shield.rs`).
#[pyclass(name = "EncoderDecoderCacheCore", module = "hscache._core", subclass)]
pub struct PyEncoderDecoderCacheCore {
    core: Shielded<EncoderDecoderCacheManager>,
}

/// `len(request.mm_features)`; `TypeError` for an object without them.
fn num_inputs(request: &Bound<'_, PyAny>) -> PyResult<usize> {
    super::convert::expect_attr(
        request,
        intern!(request.py(), "mm_features"),
        "a vLLM Request",
    )?
    .len()
}

#[pymethods]
impl PyEncoderDecoderCacheCore {
    #[new]
    #[pyo3(signature = (cache_size: "int"))]
    fn new(cache_size: Int) -> PyResult<Self> {
        Ok(Self {
            core: Shielded::new(
                EncoderDecoderCacheManager::new(cache_size.0)?,
                "encoder-decoder cache",
            ),
        })
    }

    #[getter]
    fn cache_size(&self) -> PyResult<i64> {
        self.core.read("cache_size", |c| Ok(c.cache_size()))
    }

    #[setter]
    fn set_cache_size(&mut self, n: Int) -> PyResult<()> {
        let n = n.0;
        self.core
            .write("set_cache_size", |c| Ok(c.set_cache_size(n)?))
    }

    #[getter]
    fn num_free_slots(&self) -> PyResult<i64> {
        self.core.read("num_free_slots", |c| Ok(c.num_free_slots()))
    }

    #[setter]
    fn set_num_free_slots(&mut self, n: Int) -> PyResult<()> {
        let n = n.0;
        self.core
            .write("set_num_free_slots", |c| Ok(c.set_num_free_slots(n)?))
    }

    /// vLLM's `allocated` (a copy): identifiers allocated in the current window.
    #[getter]
    fn allocated<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.core
            .read("allocated", |c| PyList::new(py, c.allocated()))
    }

    /// vLLM's `to_free` (a copy): what the next `get_freed_mm_hashes` returns.
    #[getter]
    fn to_free<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.core.read("to_free", |c| PyList::new(py, c.to_free()))
    }

    /// vLLM's `reset`.
    fn reset(&mut self) -> PyResult<()> {
        self.core.write("reset", |c| {
            c.reset();
            Ok(())
        })
    }

    /// Never a hit: encoder outputs are not shared between requests.
    #[pyo3(signature = (request, input_id: "int"))]
    fn check_and_update_cache(&self, request: &Bound<'_, PyAny>, input_id: Int) -> bool {
        let _ = (request, input_id);
        false
    }

    /// vLLM's `can_allocate` (no eviction: nothing is kept).
    #[pyo3(signature = (request, input_id: "int", encoder_compute_budget: "int", num_embeds_to_schedule: "int"))]
    fn can_allocate(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: Int,
        encoder_compute_budget: Int,
        num_embeds_to_schedule: Int,
    ) -> PyResult<bool> {
        let (input_id, encoder_compute_budget, num_embeds_to_schedule) = (
            input_id.0,
            encoder_compute_budget.0,
            num_embeds_to_schedule.0,
        );
        let n = num_embeds(request, input_id)?;
        slf.try_borrow()?.core.read("can_allocate", |c| {
            Ok(c.can_allocate(n, encoder_compute_budget, num_embeds_to_schedule)?)
        })
    }

    /// vLLM's `allocate`.
    #[pyo3(signature = (request, input_id: "int"))]
    fn allocate(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>, input_id: Int) -> PyResult<()> {
        let input_id = input_id.0;
        let n = num_embeds(request, input_id)?;
        let ident = identifier(request, input_id)?;
        let ident = ident.to_str()?;
        slf.try_borrow_mut()?
            .core
            .write("allocate", |c| Ok(c.allocate(ident, n)?))
    }

    /// vLLM's `free_encoder_input`: the input's embeddings come back.
    #[pyo3(signature = (request, input_id: "int"))]
    fn free_encoder_input(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: Int,
    ) -> PyResult<()> {
        let n = num_embeds(request, input_id.0)?;
        slf.try_borrow_mut()?
            .core
            .write("free_encoder_input", |c| Ok(c.free_encoder_input(n)?))
    }

    /// vLLM's `free`: every input of the request comes back.
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let counts = (0..num_inputs(request)?)
            .map(|i| num_embeds(request, i as i64))
            .collect::<PyResult<Vec<i64>>>()?;
        slf.try_borrow_mut()?
            .core
            .write("free", |c| Ok(c.free(&counts)?))
    }

    /// vLLM's `get_cached_input_ids`: all of the request's input ids.
    #[pyo3(signature = (request) -> "set[int]")]
    fn get_cached_input_ids<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PySet>> {
        PySet::new(py, 0..num_inputs(request)?)
    }

    /// vLLM's `get_freed_mm_hashes`: the previous window's identifiers.
    #[pyo3(signature = () -> "list[str]")]
    fn get_freed_mm_hashes<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.core.write("get_freed_mm_hashes", |c| {
            PyList::new(py, c.get_freed_mm_hashes())
        })
    }
}
