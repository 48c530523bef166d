//! `EncoderCacheCore`: the core `EncoderCacheManager` as a subclassable Python class.
//!
//! `hscache.vllm.EncoderCacheManager` subclasses it. Every method vLLM's Scheduler
//! calls (`check_and_update_cache`, `can_allocate`, `allocate`,
//! `free_encoder_input`, `free`, `get_cached_input_ids`,
//! `get_cached_num_encoder_embeds`, `get_freed_mm_hashes`, `reset`) is implemented
//! here with vLLM 0.33's exact signature, so a call costs one FFI crossing and no
//! Python frame. A `Request` is read for `request_id`,
//! `mm_features[input_id].identifier` and `get_num_encoder_embeds(input_id)` (a
//! method call: test doubles override it), before the core is borrowed.
//!
//! Views of vLLM's dicts (`cached`, `freeable`, ...) are built by the Python
//! subclass from the `core_`-prefixed accessors, which never shadow a vLLM name.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString};

use super::errors::InvalidArgumentError;
use crate::encoder_cache::input_ids::check_input_id;
use crate::encoder_cache::{compute_mm_encoder_budget, EncoderCacheManager, InputIdOp};

#[pyclass(name = "EncoderCacheCore", module = "hscache._core", subclass)]
pub struct PyEncoderCacheCore {
    core: EncoderCacheManager,
}

/// `request.request_id` as a Python str.
pub(super) fn request_id<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    super::convert::expect_attr(
        request,
        intern!(request.py(), "request_id"),
        "a vLLM Request",
    )?
    .cast_into::<PyString>()
    .map_err(|_| InvalidArgumentError::new_err("request.request_id must be a str"))
}

/// `request.mm_features[input_id].identifier` as a Python str.
pub(super) fn identifier<'py>(
    request: &Bound<'py, PyAny>,
    input_id: i64,
) -> PyResult<Bound<'py, PyString>> {
    let py = request.py();
    let features =
        super::convert::expect_attr(request, intern!(py, "mm_features"), "a vLLM Request")?;
    let feature = match (features.cast::<PyList>(), usize::try_from(input_id)) {
        (Ok(list), Ok(i)) => list.get_item(i)?,
        _ => features.get_item(input_id)?,
    };
    feature
        .getattr(intern!(py, "identifier"))?
        .cast_into::<PyString>()
        .map_err(|_| InvalidArgumentError::new_err("mm_features[i].identifier must be a str"))
}

/// `request.get_num_encoder_embeds(input_id)`.
pub(super) fn num_embeds(request: &Bound<'_, PyAny>, input_id: i64) -> PyResult<i64> {
    request
        .call_method1(intern!(request.py(), "get_num_encoder_embeds"), (input_id,))?
        .extract()
}

/// An input id as the core stores it.
pub(super) fn input_index(input_id: i64) -> PyResult<u32> {
    Ok(check_input_id(input_id)?)
}

/// A Python `set` made by replaying `log` on a fresh `set()`: the interpreter's own
/// table, iterated in the order vLLM's `request_cached_ids` set would be.
fn replay_set<'py>(
    py: Python<'py>,
    log: impl Iterator<Item = InputIdOp>,
) -> PyResult<Bound<'py, PySet>> {
    let set = PySet::empty(py)?;
    for op in log {
        match op {
            InputIdOp::Add(i) => set.add(i)?,
            InputIdOp::Remove(i) => {
                set.discard(i)?;
            }
        }
    }
    Ok(set)
}

#[pymethods]
impl PyEncoderCacheCore {
    #[new]
    #[pyo3(signature = (cache_size))]
    fn new(cache_size: i64) -> PyResult<Self> {
        Ok(Self {
            core: EncoderCacheManager::new(cache_size)?,
        })
    }

    // ---- vLLM's EncoderCacheManager interface ------------------------------------

    /// Total capacity in encoder embeddings.
    #[getter]
    fn cache_size(&self) -> i64 {
        self.core.cache_size()
    }

    /// Capacity held by no entry.
    #[getter]
    fn num_free_slots(&self) -> i64 {
        self.core.num_free_slots()
    }

    /// Free capacity plus the capacity of unreferenced (evictable) entries.
    #[getter]
    fn num_freeable_slots(&self) -> i64 {
        self.core.num_freeable_slots()
    }

    #[setter]
    fn set_cache_size(&mut self, n: i64) -> PyResult<()> {
        Ok(self.core.set_cache_size(n)?)
    }

    #[setter]
    fn set_num_free_slots(&mut self, n: i64) -> PyResult<()> {
        Ok(self.core.set_num_free_slots(n)?)
    }

    #[setter]
    fn set_num_freeable_slots(&mut self, n: i64) -> PyResult<()> {
        Ok(self.core.set_num_freeable_slots(n)?)
    }

    /// vLLM's `reset`: forget every entry and reference.
    fn reset(&mut self) {
        self.core.reset();
    }

    /// vLLM's `check_and_update_cache`.
    fn check_and_update_cache(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: i64,
    ) -> PyResult<bool> {
        let ident = identifier(request, input_id)?;
        // A miss (the common case for a new item) does not read the rest of the request.
        let Some(entry) = slf.try_borrow()?.core.find_cached(ident.to_str()?) else {
            return Ok(false);
        };
        let rid = request_id(request)?;
        let input = input_index(input_id)?;
        let hit = slf.try_borrow_mut()?.core.add_cached_reference(
            entry,
            ident.to_str()?,
            rid.to_str()?,
            input,
        )?;
        Ok(hit)
    }

    /// vLLM's `get_cached_num_encoder_embeds`.
    fn get_cached_num_encoder_embeds(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: i64,
    ) -> PyResult<Option<i64>> {
        let ident = identifier(request, input_id)?;
        let n = slf
            .try_borrow()?
            .core
            .get_cached_num_encoder_embeds(ident.to_str()?);
        Ok(n)
    }

    /// vLLM's `can_allocate` (evicts unreferenced entries when that makes room).
    fn can_allocate(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: i64,
        encoder_compute_budget: i64,
        num_embeds_to_schedule: i64,
    ) -> PyResult<bool> {
        let n = num_embeds(request, input_id)?;
        let ok = slf.try_borrow_mut()?.core.can_allocate(
            n,
            encoder_compute_budget,
            num_embeds_to_schedule,
        )?;
        Ok(ok)
    }

    /// vLLM's `allocate`.
    fn allocate(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>, input_id: i64) -> PyResult<()> {
        let ident = identifier(request, input_id)?;
        let rid = request_id(request)?;
        let n = num_embeds(request, input_id)?;
        let input = input_index(input_id)?;
        slf.try_borrow_mut()?
            .core
            .allocate(rid.to_str()?, input, ident.to_str()?, n)?;
        Ok(())
    }

    /// vLLM's `free_encoder_input`.
    fn free_encoder_input(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: i64,
    ) -> PyResult<()> {
        let ident = identifier(request, input_id)?;
        let rid = request_id(request)?;
        let input = input_index(input_id)?;
        slf.try_borrow_mut()?
            .core
            .free_encoder_input(rid.to_str()?, input, ident.to_str()?)?;
        Ok(())
    }

    /// vLLM's `free`: every cached input of the request.
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let rid = request_id(request)?;
        slf.try_borrow_mut()?.core.free(rid.to_str()?)?;
        Ok(())
    }

    /// vLLM's `get_cached_input_ids`: a new set that iterates in vLLM's order (the
    /// Scheduler frees inputs in that order).
    fn get_cached_input_ids<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PySet>> {
        let rid = request_id(request)?;
        let this = slf.try_borrow()?;
        replay_set(slf.py(), this.core.cached_input_ids_log(rid.to_str()?))
    }

    /// vLLM's `get_freed_mm_hashes`: drains the evicted identifiers.
    fn get_freed_mm_hashes<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core.get_freed_mm_hashes())
    }

    /// The request's cached input ids in the core's (CPython set) iteration order.
    fn core_input_id_order(&self, request_id: &str) -> Vec<u32> {
        self.core.get_cached_input_ids(request_id).collect()
    }

    // ---- views of vLLM's dicts (cold) --------------------------------------------

    /// The keys of vLLM's `cached`.
    fn core_cached_identifiers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core.cached_identifiers())
    }

    /// `cached[identifier]` (a new set), or None if not cached.
    fn core_cached_request_ids<'py>(
        &self,
        py: Python<'py>,
        identifier: &str,
    ) -> PyResult<Option<Bound<'py, PySet>>> {
        self.core
            .cached_request_ids(identifier)
            .map(|ids| PySet::new(py, ids))
            .transpose()
    }

    /// `freeable` as `[(identifier, num_embeds)]`, oldest first.
    fn core_freeable_items(&self) -> Vec<(String, i64)> {
        self.core
            .freeable()
            .map(|(k, n)| (k.to_owned(), n))
            .collect()
    }

    /// `freeable.get(identifier)`.
    fn core_freeable_get(&self, identifier: &str) -> Option<i64> {
        self.core.freeable_get(identifier)
    }

    /// `len(freeable)`.
    fn core_num_freeable_entries(&self) -> usize {
        self.core.num_freeable_entries()
    }

    /// `num_embeds_by_hash` as `[(identifier, num_embeds)]`.
    fn core_num_embeds_items(&self) -> Vec<(String, i64)> {
        self.core
            .num_embeds_by_hash()
            .map(|(k, n)| (k.to_owned(), n))
            .collect()
    }

    /// `num_embeds_by_hash.get(identifier)`.
    fn core_num_embeds_get(&self, identifier: &str) -> Option<i64> {
        self.core.get_cached_num_encoder_embeds(identifier)
    }

    /// The keys of `request_cached_ids` (requests with cached inputs).
    fn core_request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core.request_ids())
    }

    /// `request_cached_ids[request_id]` (a new set), or None.
    fn core_request_cached_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Option<Bound<'py, PySet>>> {
        if self.core.get_cached_input_ids(request_id).next().is_none() {
            return Ok(None);
        }
        replay_set(py, self.core.cached_input_ids_log(request_id)).map(Some)
    }

    /// `request_hash_refs[request_id]` (a new dict), or None.
    fn core_request_hash_refs<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(refs) = self.core.request_hash_refs(request_id) else {
            return Ok(None);
        };
        let dict = PyDict::new(py);
        for (k, n) in refs {
            dict.set_item(k, n)?;
        }
        Ok(Some(dict))
    }

    /// `freed` (not drained), in eviction order.
    fn core_freed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core.freed())
    }

    /// `cached = {}`: empties `cached` only, as rebinding the dict does in vLLM.
    fn core_clear_cached(&mut self) {
        self.core.clear_cached();
    }
}

/// vLLM's `compute_mm_encoder_budget` over plain values:
/// `(encoder_compute_budget, encoder_cache_size)`.
#[pyfunction]
#[pyo3(name = "compute_mm_encoder_budget")]
pub fn py_compute_mm_encoder_budget(
    max_num_encoder_input_tokens: i64,
    encoder_cache_size: i64,
    max_num_batched_tokens: i64,
    disable_chunked_mm_input: bool,
    mm_max_toks_per_item: Vec<i64>,
) -> PyResult<(i64, i64)> {
    Ok(compute_mm_encoder_budget(
        max_num_encoder_input_tokens,
        encoder_cache_size,
        max_num_batched_tokens,
        disable_chunked_mm_input,
        &mm_max_toks_per_item,
    )?)
}
