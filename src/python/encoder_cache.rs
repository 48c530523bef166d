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

use super::convert::Int;
use super::errors::InvalidArgumentError;
use crate::encoder_cache::input_ids::check_input_id;
use crate::encoder_cache::{compute_mm_encoder_budget, EncoderCacheManager, InputIdOp};
use crate::shield::Shielded;

/// Every call runs behind the core's panic shield (`src/shield.rs`): a panic is
/// `InternalError`, and one inside a mutating call poisons this cache.
#[pyclass(name = "EncoderCacheCore", module = "hscache._core", subclass)]
pub struct PyEncoderCacheCore {
    core: Shielded<EncoderCacheManager>,
}

/// What the shield calls this object.
const OBJECT: &str = "encoder cache";

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

/// `request.get_num_encoder_embeds(input_id)`; `TypeError` for an object without
/// the method (not a bare `AttributeError`).
pub(super) fn num_embeds(request: &Bound<'_, PyAny>, input_id: i64) -> PyResult<i64> {
    super::convert::expect_attr(
        request,
        intern!(request.py(), "get_num_encoder_embeds"),
        "a vLLM Request",
    )?
    .call1((input_id,))?
    .extract::<Int>()
    .map(|n| n.0)
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
    #[pyo3(signature = (cache_size: "int"))]
    fn new(cache_size: Int) -> PyResult<Self> {
        Ok(Self {
            core: Shielded::new(EncoderCacheManager::new(cache_size.0)?, OBJECT),
        })
    }

    // ---- vLLM's EncoderCacheManager interface ------------------------------------

    /// Total capacity in encoder embeddings.
    #[getter]
    fn cache_size(&self) -> PyResult<i64> {
        self.core.read("cache_size", |c| Ok(c.cache_size()))
    }

    /// Capacity held by no entry.
    #[getter]
    fn num_free_slots(&self) -> PyResult<i64> {
        self.core.read("num_free_slots", |c| Ok(c.num_free_slots()))
    }

    /// Free capacity plus the capacity of unreferenced (evictable) entries.
    #[getter]
    fn num_freeable_slots(&self) -> PyResult<i64> {
        self.core
            .read("num_freeable_slots", |c| Ok(c.num_freeable_slots()))
    }

    #[setter]
    fn set_cache_size(&mut self, n: Int) -> PyResult<()> {
        let n = n.0;
        self.core
            .write("set_cache_size", |c| Ok(c.set_cache_size(n)?))
    }

    #[setter]
    fn set_num_free_slots(&mut self, n: Int) -> PyResult<()> {
        let n = n.0;
        self.core
            .write("set_num_free_slots", |c| Ok(c.set_num_free_slots(n)?))
    }

    #[setter]
    fn set_num_freeable_slots(&mut self, n: Int) -> PyResult<()> {
        let n = n.0;
        self.core.write("set_num_freeable_slots", |c| {
            Ok(c.set_num_freeable_slots(n)?)
        })
    }

    /// vLLM's `reset`: forget every entry and reference.
    fn reset(&mut self) -> PyResult<()> {
        self.core.write("reset", |c| {
            c.reset();
            Ok(())
        })
    }

    /// vLLM's `check_and_update_cache`.
    #[pyo3(signature = (request, input_id: "int"))]
    fn check_and_update_cache(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: Int,
    ) -> PyResult<bool> {
        let input_id = input_id.0;
        let ident = identifier(request, input_id)?;
        // A miss (the common case for a new item) does not read the rest of the request.
        let ident = ident.to_str()?;
        let found = slf.try_borrow()?.core.read("check_and_update_cache", |c| {
            Ok::<_, PyErr>(c.find_cached(ident))
        })?;
        let Some(entry) = found else {
            return Ok(false);
        };
        let rid = request_id(request)?;
        let input = input_index(input_id)?;
        let rid = rid.to_str()?;
        slf.try_borrow_mut()?
            .core
            .write("check_and_update_cache", |c| {
                Ok(c.add_cached_reference(entry, ident, rid, input)?)
            })
    }

    /// vLLM's `get_cached_num_encoder_embeds`.
    #[pyo3(signature = (request, input_id: "int"))]
    fn get_cached_num_encoder_embeds(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: Int,
    ) -> PyResult<Option<i64>> {
        let input_id = input_id.0;
        let ident = identifier(request, input_id)?;
        let ident = ident.to_str()?;
        slf.try_borrow()?
            .core
            .read("get_cached_num_encoder_embeds", |c| {
                Ok(c.get_cached_num_encoder_embeds(ident))
            })
    }

    /// vLLM's `can_allocate` (evicts unreferenced entries when that makes room).
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
        slf.try_borrow_mut()?.core.write("can_allocate", |c| {
            Ok(c.can_allocate(n, encoder_compute_budget, num_embeds_to_schedule)?)
        })
    }

    /// vLLM's `allocate`.
    #[pyo3(signature = (request, input_id: "int"))]
    fn allocate(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>, input_id: Int) -> PyResult<()> {
        let input_id = input_id.0;
        let ident = identifier(request, input_id)?;
        let rid = request_id(request)?;
        let n = num_embeds(request, input_id)?;
        let input = input_index(input_id)?;
        let (rid, ident) = (rid.to_str()?, ident.to_str()?);
        slf.try_borrow_mut()?.core.write("allocate", |c| {
            crate::fault::point("encoder_cache.allocate");
            Ok(c.allocate(rid, input, ident, n)?)
        })
    }

    /// vLLM's `free_encoder_input`.
    #[pyo3(signature = (request, input_id: "int"))]
    fn free_encoder_input(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        input_id: Int,
    ) -> PyResult<()> {
        let input_id = input_id.0;
        let ident = identifier(request, input_id)?;
        let rid = request_id(request)?;
        let input = input_index(input_id)?;
        let (rid, ident) = (rid.to_str()?, ident.to_str()?);
        slf.try_borrow_mut()?.core.write("free_encoder_input", |c| {
            Ok(c.free_encoder_input(rid, input, ident)?)
        })
    }

    /// vLLM's `free`: every cached input of the request.
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let rid = request_id(request)?;
        let rid = rid.to_str()?;
        slf.try_borrow_mut()?
            .core
            .write("free", |c| Ok(c.free(rid)?))
    }

    /// vLLM's `get_cached_input_ids`: a new set that iterates in vLLM's order (the
    /// Scheduler frees inputs in that order).
    #[pyo3(signature = (request) -> "set[int]")]
    fn get_cached_input_ids<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PySet>> {
        let rid = request_id(request)?;
        let rid = rid.to_str()?;
        slf.try_borrow()?.core.read("get_cached_input_ids", |c| {
            replay_set(slf.py(), c.cached_input_ids_log(rid))
        })
    }

    /// vLLM's `get_freed_mm_hashes`: drains the evicted identifiers.
    #[pyo3(signature = () -> "list[str]")]
    fn get_freed_mm_hashes<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.core.write("get_freed_mm_hashes", |c| {
            PyList::new(py, c.get_freed_mm_hashes())
        })
    }

    /// The request's cached input ids in the core's (CPython set) iteration order.
    fn core_input_id_order(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.core.read("core_input_id_order", |c| {
            Ok(c.get_cached_input_ids(request_id).collect())
        })
    }

    // ---- views of vLLM's dicts (cold) --------------------------------------------

    /// The keys of vLLM's `cached`.
    #[pyo3(signature = () -> "list[str]")]
    fn core_cached_identifiers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.core.read("core_cached_identifiers", |c| {
            PyList::new(py, c.cached_identifiers())
        })
    }

    /// `cached[identifier]` (a new set), or None if not cached.
    #[pyo3(signature = (identifier) -> "set[str] | None")]
    fn core_cached_request_ids<'py>(
        &self,
        py: Python<'py>,
        identifier: &str,
    ) -> PyResult<Option<Bound<'py, PySet>>> {
        self.core.read("core_cached_request_ids", |c| {
            c.cached_request_ids(identifier)
                .map(|ids| PySet::new(py, ids))
                .transpose()
        })
    }

    /// `freeable` as `[(identifier, num_embeds)]`, oldest first.
    fn core_freeable_items(&self) -> PyResult<Vec<(String, i64)>> {
        self.core.read("core_freeable_items", |c| {
            Ok(c.freeable().map(|(k, n)| (k.to_owned(), n)).collect())
        })
    }

    /// `freeable.get(identifier)`.
    fn core_freeable_get(&self, identifier: &str) -> PyResult<Option<i64>> {
        self.core
            .read("core_freeable_get", |c| Ok(c.freeable_get(identifier)))
    }

    /// `len(freeable)`.
    fn core_num_freeable_entries(&self) -> PyResult<usize> {
        self.core.read(
            "core_num_freeable_entries",
            |c| Ok(c.num_freeable_entries()),
        )
    }

    /// `num_embeds_by_hash` as `[(identifier, num_embeds)]`.
    fn core_num_embeds_items(&self) -> PyResult<Vec<(String, i64)>> {
        self.core.read("core_num_embeds_items", |c| {
            Ok(c.num_embeds_by_hash()
                .map(|(k, n)| (k.to_owned(), n))
                .collect())
        })
    }

    /// `num_embeds_by_hash.get(identifier)`.
    fn core_num_embeds_get(&self, identifier: &str) -> PyResult<Option<i64>> {
        self.core.read("core_num_embeds_get", |c| {
            Ok(c.get_cached_num_encoder_embeds(identifier))
        })
    }

    /// The keys of `request_cached_ids` (requests with cached inputs).
    #[pyo3(signature = () -> "list[str]")]
    fn core_request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.core
            .read("core_request_ids", |c| PyList::new(py, c.request_ids()))
    }

    /// `request_cached_ids[request_id]` (a new set), or None.
    #[pyo3(signature = (request_id) -> "set[int] | None")]
    fn core_request_cached_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Option<Bound<'py, PySet>>> {
        self.core.read("core_request_cached_ids", |c| {
            if c.get_cached_input_ids(request_id).next().is_none() {
                return Ok(None);
            }
            replay_set(py, c.cached_input_ids_log(request_id)).map(Some)
        })
    }

    /// `request_hash_refs[request_id]` (a new dict), or None.
    #[pyo3(signature = (request_id) -> "dict[str, int] | None")]
    fn core_request_hash_refs<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.core.read("core_request_hash_refs", |c| {
            let Some(refs) = c.request_hash_refs(request_id) else {
                return Ok(None);
            };
            let dict = PyDict::new(py);
            for (k, n) in refs {
                dict.set_item(k, n)?;
            }
            Ok(Some(dict))
        })
    }

    /// `freed` (not drained), in eviction order.
    #[pyo3(signature = () -> "list[str]")]
    fn core_freed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.core.read("core_freed", |c| PyList::new(py, c.freed()))
    }

    /// `cached = {}`: empties `cached` only, as rebinding the dict does in vLLM.
    fn core_clear_cached(&mut self) -> PyResult<()> {
        self.core.write("core_clear_cached", |c| {
            c.clear_cached();
            Ok(())
        })
    }

    /// Why the cache refuses every call, if a panic poisoned it.
    #[getter]
    fn core_poisoned(&self) -> Option<String> {
        self.core.poisoned().map(str::to_owned)
    }
}

/// vLLM's `compute_mm_encoder_budget` over plain values:
/// `(encoder_compute_budget, encoder_cache_size)`.
#[pyfunction]
#[pyo3(name = "compute_mm_encoder_budget")]
#[pyo3(signature = (max_num_encoder_input_tokens: "int", encoder_cache_size: "int", max_num_batched_tokens: "int", disable_chunked_mm_input, mm_max_toks_per_item: "list[int]"))]
pub fn py_compute_mm_encoder_budget(
    max_num_encoder_input_tokens: Int,
    encoder_cache_size: Int,
    max_num_batched_tokens: Int,
    disable_chunked_mm_input: bool,
    mm_max_toks_per_item: Vec<Int>,
) -> PyResult<(i64, i64)> {
    let (max_num_encoder_input_tokens, encoder_cache_size, max_num_batched_tokens) = (
        max_num_encoder_input_tokens.0,
        encoder_cache_size.0,
        max_num_batched_tokens.0,
    );
    let mm_max_toks_per_item: Vec<i64> = mm_max_toks_per_item.into_iter().map(|n| n.0).collect();
    Ok(compute_mm_encoder_budget(
        max_num_encoder_input_tokens,
        encoder_cache_size,
        max_num_batched_tokens,
        disable_chunked_mm_input,
        &mm_max_toks_per_item,
    )?)
}
