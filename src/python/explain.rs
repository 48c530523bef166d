//! Python bindings of explain mode (`crate::explain`): turning it on, the record of a
//! request's last lookup as a dict, and reading a vLLM `Request`'s token ids and
//! extra-key fields for the core's fingerprints (cold paths only: nothing here runs
//! with explain mode off). `hscache.explain` is the typed glue over the dict.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::manager::PyKVCacheCore;
use crate::error::Error;
use crate::explain::{Detail, RequestFacts};

fn opt_str(obj: PyResult<Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    match obj {
        Ok(o) if o.is_none() => Ok(None),
        Ok(o) => Ok(Some(o.str()?.to_str()?.to_owned())),
        Err(_) => Ok(None),
    }
}

/// Why a request skips reading the prefix cache (vLLM's
/// `Request.get_skip_reading_prefix_cache`), named for the user.
fn skip_cause(request: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let py = request.py();
    if let Ok(sp) = request.getattr(intern!(py, "sampling_params")) {
        if !sp.is_none() {
            if sp
                .getattr(intern!(py, "prompt_logprobs"))
                .is_ok_and(|p| !p.is_none())
            {
                return Ok(Some("prompt_logprobs".into()));
            }
            if sp
                .getattr(intern!(py, "skip_reading_prefix_cache"))
                .and_then(|v| v.is_truthy())
                .unwrap_or(false)
            {
                return Ok(Some("sampling_params.skip_reading_prefix_cache".into()));
            }
        }
    }
    if let Ok(pp) = request.getattr(intern!(py, "pooling_params")) {
        if !pp.is_none() {
            return Ok(Some("pooling".into()));
        }
    }
    Ok(None)
}

/// Reads what explanations compare from a vLLM `Request`: the token ids of blocks
/// `[start, end)` and the extra-key fields.
pub(crate) fn read_request_facts(
    request: &Bound<'_, PyAny>,
    block_size: usize,
    start: usize,
    end: usize,
) -> PyResult<RequestFacts> {
    let py = request.py();
    let mut facts = RequestFacts::default();
    if end > start {
        let tokens = request.getattr(intern!(py, "all_token_ids"))?;
        let slice = tokens.get_item(pyo3::types::PySlice::new(
            py,
            (start * block_size) as isize,
            (end * block_size) as isize,
            1,
        ))?;
        facts.tokens = slice.extract()?;
    }
    facts.cache_salt = opt_str(request.getattr(intern!(py, "cache_salt")))?;
    if let Ok(lora) = request.getattr(intern!(py, "lora_request")) {
        if !lora.is_none() {
            facts.lora = opt_str(lora.getattr(intern!(py, "lora_name")))?;
        }
    }
    if let Ok(features) = request.getattr(intern!(py, "mm_features")) {
        if !features.is_none() {
            for f in features.try_iter()? {
                let f = f?;
                let pos = f.getattr(intern!(py, "mm_position"))?;
                let offset: usize = pos.getattr(intern!(py, "offset"))?.extract()?;
                let length: usize = pos.getattr(intern!(py, "length"))?.extract()?;
                let id = opt_str(f.getattr(intern!(py, "identifier")))?.unwrap_or_default();
                facts.mm.push((offset, length, id));
            }
        }
    }
    if let Ok(embeds) = request.getattr(intern!(py, "prompt_embeds")) {
        if !embeds.is_none() {
            facts.num_prompt_embeds = embeds.len()?;
        }
    }
    facts.skip_cause = skip_cause(request)?;
    Ok(facts)
}

/// [`read_request_facts`] with the core's error type (a Python error becomes
/// `InvalidArgument`; the explanation then skips the comparison).
pub(crate) fn request_facts(
    request: &Bound<'_, PyAny>,
    block_size: usize,
    start: usize,
    end: usize,
) -> crate::error::Result<Option<RequestFacts>> {
    read_request_facts(request, block_size, start, end)
        .map(Some)
        .map_err(|e| Error::InvalidArgument(e.to_string()))
}

fn detail_value<'py>(py: Python<'py>, d: &Detail) -> PyResult<Bound<'py, PyAny>> {
    Ok(match d {
        Detail::Int(n) => n.into_pyobject(py)?.into_any(),
        Detail::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        Detail::Str(s) => s.into_pyobject(py)?.into_any(),
        Detail::List(items) => PyList::new(py, items)?.into_any(),
    })
}

#[pymethods]
impl PyKVCacheCore {
    /// Turns explain mode on or off (`history_capacity`: evicted keys and cached
    /// fingerprints remembered; default 4 per block, at least 4096).
    #[pyo3(signature = (on=true, history_capacity=None))]
    fn core_set_explain(&mut self, on: bool, history_capacity: Option<i64>) -> PyResult<()> {
        let capacity = history_capacity
            .map(|c| super::convert::count("history_capacity", c))
            .transpose()?;
        Ok(self.core.set_explain(on, capacity)?)
    }

    /// Whether explain mode is on.
    #[getter]
    fn explain_enabled(&self) -> bool {
        self.core.explain_enabled()
    }

    /// Explain mode's summary: `{"lookups": {reason: count}, "requests": n}`: every
    /// explained lookup since explain mode was turned on by reason, and how many
    /// requests' last lookups are remembered. `UnsupportedError` with explain mode off.
    fn core_explain_summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let Some(e) = self.core.explainer() else {
            return Err(crate::error::Error::Unsupported(
                "explain mode is off: build the manager with explain=True or set HSCACHE_EXPLAIN=1"
                    .into(),
            )
            .into());
        };
        let lookups = PyDict::new(py);
        for (reason, n) in crate::explain::Reason::ALL.iter().zip(e.reason_counts()) {
            lookups.set_item(reason.name(), n)?;
        }
        let out = PyDict::new(py);
        out.set_item("lookups", lookups)?;
        out.set_item("requests", e.num_requests())?;
        Ok(out)
    }

    /// The record of the request's last lookup as a dict (`hit_blocks`,
    /// `hit_tokens`, `num_full_blocks`, `num_tokens`, `reason`, `detail`,
    /// `lookup_seq`). `UnsupportedError` (a `NotImplementedError`, so a `RuntimeError`)
    /// with explain mode off, `UnknownRequestError` (a `KeyError`) for a request without
    /// an explained lookup.
    fn core_explain<'py>(&self, py: Python<'py>, request_id: &str) -> PyResult<Bound<'py, PyDict>> {
        let record = self.core.explain(request_id)?;
        let out = PyDict::new(py);
        out.set_item("hit_blocks", record.hit_blocks)?;
        out.set_item("hit_tokens", record.hit_tokens)?;
        out.set_item("num_full_blocks", record.num_full_blocks)?;
        out.set_item("num_tokens", record.num_tokens)?;
        out.set_item("reason", record.reason.name())?;
        out.set_item("lookup_seq", record.lookup_seq)?;
        let detail = PyDict::new(py);
        for (k, v) in &record.detail {
            detail.set_item(*k, detail_value(py, v)?)?;
        }
        out.set_item("detail", detail)?;
        Ok(out)
    }
}
