//! A vLLM `Request` read as the core's [`RequestLike`], attribute by attribute,
//! each read at most once per call and only when the core asks for it.

use std::cell::{OnceCell, RefCell};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyType};

use super::count;
use super::hashes::PyListHashes;
use crate::error::{Error, Result};
use crate::manager::{RequestLike, RequestStatus};
use crate::python::errors::InvalidArgumentError;

/// The `RequestStatus` members the watermark rule compares with (the core asks
/// whether a request is one of them; the binding knows vLLM's objects).
pub(crate) struct StatusObjects<'a, 'py> {
    pub waiting: &'a Bound<'py, PyAny>,
    pub preempted: &'a Bound<'py, PyAny>,
}

/// A vLLM `Request` (see module docs). A failed lazy read keeps its Python error,
/// which [`PyRequest::error`] re-raises instead of the core's typed error.
pub(crate) struct PyRequest<'a, 'py> {
    request: Bound<'py, PyAny>,
    /// Borrowed from the caller's `request_id(request)` string: the core asks for it
    /// several times per call, and a `&str` costs nothing to hand out.
    request_id: &'a str,
    num_computed_tokens: usize,
    statuses: Option<StatusObjects<'a, 'py>>,
    num_tokens: OnceCell<usize>,
    num_prompt_tokens: OnceCell<usize>,
    num_in_flight_tokens: OnceCell<usize>,
    shared_prefix_boundary: OnceCell<usize>,
    block_hashes: OnceCell<PyListHashes<'py>>,
    /// What [`RequestLike::check_before_changes`] runs (the caller's check that KV
    /// events can describe the request), if anything.
    precheck: Option<&'a dyn Fn() -> PyResult<()>>,
    py_err: RefCell<Option<PyErr>>,
}

/// `request.request_id` as a `str`.
pub(crate) fn request_id<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let id = super::expect_attr(
        request,
        intern!(request.py(), "request_id"),
        "a vLLM Request",
    )?
    .cast_into::<PyString>()
    .map_err(|_| InvalidArgumentError::new_err("request.request_id must be a str"))?;
    id.to_str()?;
    Ok(id)
}

/// vLLM's `Request` class (`vllm.v1.request`), imported once; None where vLLM is not
/// importable.
static VLLM_REQUEST_TYPE: PyOnceLock<Option<Py<PyType>>> = PyOnceLock::new();

/// `request.num_tokens` of an instance of vLLM's own `Request` class (not a
/// subclass), read as `len(request._all_token_ids)`: the property's body, without a
/// Python frame (~55 ns a read). None for any other object, or an unexpected
/// attribute, which the caller then reads through `num_tokens`.
pub(crate) fn vllm_request_num_tokens(request: &Bound<'_, PyAny>) -> Option<usize> {
    let py = request.py();
    let class = VLLM_REQUEST_TYPE
        .get_or_init(py, || {
            py.import("vllm.v1.request")
                .and_then(|m| m.getattr("Request"))
                .and_then(|c| c.cast_into::<PyType>().map_err(Into::into))
                .map(Bound::unbind)
                .ok()
        })
        .as_ref()?;
    if !request.get_type().is(class.bind(py)) {
        return None;
    }
    let tokens = request.getattr(intern!(py, "_all_token_ids")).ok()?;
    tokens.cast::<PyList>().ok().map(PyListMethods::len)
}

impl<'a, 'py> PyRequest<'a, 'py> {
    /// Reads `num_computed_tokens` (every call needs it); `request_id` is the text of
    /// [`request_id`]`(request)`, which the caller keeps alive for the call.
    pub(crate) fn read(
        request: &Bound<'py, PyAny>,
        request_id: &'a str,
        statuses: Option<StatusObjects<'a, 'py>>,
    ) -> PyResult<Self> {
        let py = request.py();
        let num_computed_tokens = count(
            "request.num_computed_tokens",
            request
                .getattr(intern!(py, "num_computed_tokens"))?
                .extract()?,
        )?;
        Ok(Self::with_computed(
            request,
            request_id,
            num_computed_tokens,
            statuses,
        ))
    }

    /// A request whose `num_computed_tokens` the caller has already read.
    pub(crate) fn with_computed(
        request: &Bound<'py, PyAny>,
        request_id: &'a str,
        num_computed_tokens: usize,
        statuses: Option<StatusObjects<'a, 'py>>,
    ) -> Self {
        Self {
            request: request.clone(),
            request_id,
            num_computed_tokens,
            statuses,
            num_tokens: OnceCell::new(),
            num_prompt_tokens: OnceCell::new(),
            num_in_flight_tokens: OnceCell::new(),
            shared_prefix_boundary: OnceCell::new(),
            block_hashes: OnceCell::new(),
            precheck: None,
            py_err: RefCell::new(None),
        }
    }

    /// Runs `check` where `allocate_slots` has decided the call may fit, before it
    /// changes anything (a refused call skips it).
    pub(crate) fn with_precheck(mut self, check: &'a dyn Fn() -> PyResult<()>) -> Self {
        self.precheck = Some(check);
        self
    }

    /// Keeps a Python error for the caller; the core sees a typed error.
    fn stash(&self, e: PyErr) -> Error {
        let msg = e.to_string();
        *self.py_err.borrow_mut() = Some(e);
        Error::InvalidArgument(msg)
    }

    /// A count attribute (`name`: an interned attribute name), read once.
    fn counted(&self, cell: &OnceCell<usize>, name: &Bound<'py, PyString>) -> Result<usize> {
        if let Some(&v) = cell.get() {
            return Ok(v);
        }
        let read = || -> PyResult<usize> {
            let n: i64 = self.request.getattr(name)?.extract()?;
            count(name.to_str()?, n)
        };
        let v = read().map_err(|e| self.stash(e))?;
        Ok(*cell.get_or_init(|| v))
    }

    /// The error to raise for a failed core call: the stashed Python error, if any.
    pub(crate) fn error(&self, e: Error) -> PyErr {
        self.py_err.borrow_mut().take().unwrap_or_else(|| e.into())
    }

    /// `getattr(request, "kv_cache_report_mode", "incremental") == "full"`.
    pub(crate) fn report_mode_full(&self) -> Result<bool> {
        let py = self.request.py();
        match self.request.getattr(intern!(py, "kv_cache_report_mode")) {
            Ok(mode) => mode.eq("full").map_err(|e| self.stash(e)),
            Err(_) => Ok(false),
        }
    }
}

impl<'py> RequestLike for PyRequest<'_, 'py> {
    type Hashes = PyListHashes<'py>;

    fn request_id(&self) -> &str {
        self.request_id
    }

    fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }

    fn num_tokens(&self) -> Result<usize> {
        if let Some(&v) = self.num_tokens.get() {
            return Ok(v);
        }
        if let Some(n) = vllm_request_num_tokens(&self.request) {
            return Ok(*self.num_tokens.get_or_init(|| n));
        }
        self.counted(&self.num_tokens, intern!(self.request.py(), "num_tokens"))
    }

    fn num_prompt_tokens(&self) -> Result<usize> {
        self.counted(
            &self.num_prompt_tokens,
            intern!(self.request.py(), "num_prompt_tokens"),
        )
    }

    fn num_in_flight_tokens(&self) -> Result<usize> {
        self.counted(
            &self.num_in_flight_tokens,
            intern!(self.request.py(), "num_in_flight_tokens"),
        )
    }

    fn shared_prefix_boundary(&self) -> Result<usize> {
        if let Some(&v) = self.shared_prefix_boundary.get() {
            return Ok(v);
        }
        let py = self.request.py();
        // vLLM sets it from the lookup; a request built by hand may lack it (0).
        let v = match self.request.getattr(intern!(py, "shared_prefix_boundary")) {
            Ok(obj) if obj.is_none() => 0,
            Ok(obj) => obj
                .extract::<i64>()
                .and_then(|n| count("request.shared_prefix_boundary", n))
                .map_err(|e| self.stash(e))?,
            Err(_) => 0,
        };
        Ok(*self.shared_prefix_boundary.get_or_init(|| v))
    }

    fn status(&self) -> Result<RequestStatus> {
        let Some(s) = &self.statuses else {
            return Ok(RequestStatus::Other);
        };
        let py = self.request.py();
        let status = self
            .request
            .getattr(intern!(py, "status"))
            .map_err(|e| self.stash(e))?;
        Ok(if status.is(s.waiting) || status.is(s.preempted) {
            RequestStatus::WaitingOrPreempted
        } else {
            RequestStatus::Other
        })
    }

    fn skip_reading_prefix_cache(&self) -> Result<bool> {
        let py = self.request.py();
        self.request
            .getattr(intern!(py, "skip_reading_prefix_cache"))
            .and_then(|v| v.is_truthy())
            .map_err(|e| self.stash(e))
    }

    fn block_hashes(&self) -> Result<&PyListHashes<'py>> {
        if let Some(h) = self.block_hashes.get() {
            return Ok(h);
        }
        let py = self.request.py();
        let hashes = self
            .request
            .getattr(intern!(py, "block_hashes"))
            .and_then(|obj| PyListHashes::new(&obj))
            .map_err(|e| self.stash(e))?;
        Ok(self.block_hashes.get_or_init(|| hashes))
    }

    fn check_before_changes(&self) -> Result<()> {
        match self.precheck {
            Some(check) => check().map_err(|e| self.stash(e)),
            None => Ok(()),
        }
    }

    fn explain_facts(
        &self,
        block_size: usize,
        start: usize,
        end: usize,
    ) -> Result<Option<crate::explain::RequestFacts>> {
        super::facts::request_facts(&self.request, block_size, start, end)
    }
}
