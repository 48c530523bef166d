//! The `schedule()` phase of the steady decode step (`crate::step::schedule`,
//! `hscache.vllm.fast_step.schedule`): `KVCacheCore.schedule_decodes`, one call per
//! step, and `plain_decodes`, the same decision for a manager that is not the core
//! (parity mode, vLLM's own manager).
//!
//! `schedule_decodes` reads each running `Request`'s fields once (interned `getattr`),
//! checks that the core holds every request, decides with
//! [`crate::step::schedule::plain_decode`] (nothing changes when one request is not a
//! plain decode), starts the manager's step (`new_step_starts`), then runs the
//! manager's own `allocate_slots(request, 1, num_lookahead_tokens=L)` per request in
//! order (the same core path as the per-call binding, so every layout gets vLLM's
//! decisions and per-group block ids), building each request's KV events with that
//! request. It stops at the first request that does not fit (vLLM's `None`): the
//! caller preempts from the tail with vLLM's `_preempt_request` and calls again from
//! that index (`start`), which allocates only.
//!
//! This file only converts: the rule is the core's, the allocation the manager's.

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};
use smallvec::SmallVec;

use super::convert::expect_attr;
use super::convert::request::{PyRequest, StatusObjects};
use super::errors::{count, InvalidArgumentError, UnknownRequestError};
use super::manager::PyKVCacheCore;
use crate::manager::{AllocateSlots, GroupedBlocks};
use crate::step::schedule::{plain_decode, ScheduleFacts, StepFacts};
use crate::step::{BrokenRules, Rule};
use crate::types::BlockId;

/// `(next, new_block_ids, num_computed_tokens, num_output_tokens)`.
type Scheduled<'py> = (
    usize,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
);

/// The rules named in `names` (an iterable of `fast_step.RULES` names): `TypeError` for
/// anything but names, `InvalidArgumentError` for an unknown one. Both phases read it.
pub(super) fn broken_rules(names: &Bound<'_, PyAny>) -> PyResult<BrokenRules> {
    let mut broken = BrokenRules::NONE;
    for name in names.try_iter()? {
        let name = name?;
        let name = name
            .cast::<PyString>()
            .map_err(|_| PyTypeError::new_err("broken rules must be rule names (str)"))?;
        let name = name.to_str()?;
        let rule = Rule::from_name(name)
            .ok_or_else(|| InvalidArgumentError::new_err(format!("no fast-path rule {name:?}")))?;
        broken = broken.with(rule);
    }
    Ok(broken)
}

/// The step's facts, checked.
fn step_facts(
    step: i64,
    is_async: bool,
    max_model_len: i64,
    num_sampled_tokens_per_step: i64,
) -> PyResult<StepFacts> {
    count("max_model_len", max_model_len)?;
    count("num_sampled_tokens_per_step", num_sampled_tokens_per_step)?;
    Ok(StepFacts {
        step,
        is_async,
        max_model_len,
        num_sampled_tokens_per_step,
    })
}

/// A `Request` attribute (a `TypeError` for an object without it).
fn attr<'py>(r: &Bound<'py, PyAny>, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
    expect_attr(r, name, "a vLLM Request")
}

/// An integer `Request` attribute.
fn int_attr(r: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<i64> {
    attr(r, name)?.extract()
}

/// What [`plain_decode`] reads of `r`, and its `num_output_tokens` (output tokens and
/// placeholders, as `CachedRequestData` reports them).
fn read_facts(r: &Bound<'_, PyAny>) -> PyResult<(ScheduleFacts, i64)> {
    let py = r.py();
    let mut facts = ScheduleFacts {
        num_computed_tokens: int_attr(r, intern!(py, "num_computed_tokens"))?,
        num_tokens: attr(r, intern!(py, "_all_token_ids"))?.len()? as i64,
        num_output_placeholders: int_attr(r, intern!(py, "num_output_placeholders"))?,
        next_decode_eligible_step: int_attr(r, intern!(py, "next_decode_eligible_step"))?,
        is_prefill_chunk: attr(r, intern!(py, "is_prefill_chunk"))?.is_truthy()?,
        has_drafts: attr(r, intern!(py, "spec_token_ids"))?.is_truthy()?,
        has_mm_features: attr(r, intern!(py, "mm_features"))?.is_truthy()?,
        structured_output: !attr(r, intern!(py, "structured_output_request"))?.is_none(),
        ..ScheduleFacts::default()
    };
    // Counts vLLM keeps non-negative: a caller's mistake is refused before anything
    // changes (the allocation reads `num_computed_tokens` as a count).
    count("request.num_computed_tokens", facts.num_computed_tokens)?;
    count(
        "request.num_output_placeholders",
        facts.num_output_placeholders,
    )?;
    if facts.reads_length() {
        facts.num_prompt_tokens = int_attr(r, intern!(py, "num_prompt_tokens"))?;
        facts.max_tokens = int_attr(r, intern!(py, "max_tokens"))?;
    }
    let outputs = attr(r, intern!(py, "_output_token_ids"))?.len()? as i64;
    Ok((facts, outputs + facts.num_output_placeholders))
}

/// Every request's counts (`num_computed_tokens`, `num_output_tokens`) when each is a
/// plain decode this step; None (after reading only) when one is not.
fn decide(
    running: &Bound<'_, PyList>,
    step: &StepFacts,
    broken: BrokenRules,
) -> PyResult<Option<(Vec<i64>, Vec<i64>)>> {
    let mut computed = Vec::with_capacity(running.len());
    let mut outputs = Vec::with_capacity(running.len());
    for r in running.iter() {
        let (facts, num_output_tokens) = read_facts(&r)?;
        if !plain_decode(&facts, step, broken) {
            return Ok(None);
        }
        computed.push(facts.num_computed_tokens);
        outputs.push(num_output_tokens);
    }
    Ok(Some((computed, outputs)))
}

/// `request.request_id` as a `str`.
fn request_id<'py>(r: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    attr(r, intern!(r.py(), "request_id"))?
        .cast_into::<PyString>()
        .map_err(|_| InvalidArgumentError::new_err("request.request_id must be a str"))
}

/// See `hscache._core.plain_decodes`.
#[pyfunction]
#[pyo3(signature = (running, step, is_async, max_model_len, num_sampled_tokens_per_step,
    broken_rules=None))]
pub(crate) fn plain_decodes<'py>(
    running: &Bound<'py, PyList>,
    step: i64,
    is_async: bool,
    max_model_len: i64,
    num_sampled_tokens_per_step: i64,
    broken_rules: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<(Vec<i64>, Vec<i64>)>> {
    let broken = broken_rules.map_or(Ok(BrokenRules::NONE), self::broken_rules)?;
    let step = step_facts(step, is_async, max_model_len, num_sampled_tokens_per_step)?;
    decide(running, &step, broken)
}

/// The new block ids of one allocation as `KVCacheBlocks.get_block_ids(allow_none=True)`
/// gives them: None when every group is empty, else one list per group.
fn block_ids<'py>(py: Python<'py>, ids: &[BlockId], ends: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    if ids.is_empty() {
        return Ok(py.None().into_bound(py));
    }
    let grouped = GroupedBlocks { ids, ends };
    let lists = (0..ends.len())
        .map(|g| PyList::new(py, grouped.group(g)))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyTuple::new(py, lists)?.into_any())
}

#[pymethods]
impl PyKVCacheCore {
    /// The `schedule()` phase of a steady decode step (see `step_schedule.rs`).
    #[pyo3(signature = (running, start, step, is_async, max_model_len,
        num_sampled_tokens_per_step, num_lookahead_tokens=0, broken_rules=None))]
    #[allow(clippy::too_many_arguments)]
    fn schedule_decodes<'py>(
        slf: &Bound<'py, Self>,
        running: &Bound<'py, PyList>,
        start: i64,
        step: i64,
        is_async: bool,
        max_model_len: i64,
        num_sampled_tokens_per_step: i64,
        num_lookahead_tokens: i64,
        broken_rules: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Scheduled<'py>>> {
        let py = slf.py();
        let broken = broken_rules.map_or(Ok(BrokenRules::NONE), self::broken_rules)?;
        let step = step_facts(step, is_async, max_model_len, num_sampled_tokens_per_step)?;
        let lookahead = count("num_lookahead_tokens", num_lookahead_tokens)?;
        let n = running.len();
        let start = count("start", start)?;
        if start > n {
            return Err(InvalidArgumentError::new_err(format!(
                "start {start} is past the {n} running requests"
            )));
        }
        let statuses = Self::watermark_statuses(slf, true)?;
        // One pass before anything changes: every request is one the core holds and, in
        // the deciding call (`start == 0`), a plain decode.
        let deciding = start == 0;
        let mut requests = Vec::with_capacity(n - start);
        let (mut computed, mut outputs) = if deciding {
            (Vec::with_capacity(n), Vec::with_capacity(n))
        } else {
            (Vec::new(), Vec::new())
        };
        let plain = slf.try_borrow()?.core.read("schedule_decodes", |c| {
            for (i, r) in running.iter().enumerate().skip(start) {
                let rid = request_id(&r)?;
                if c.coordinator().request(rid.to_str()?).is_none() {
                    return Err(UnknownRequestError::new_err(format!(
                        "running[{i}]: request {rid} holds no blocks in this manager"
                    )));
                }
                let num_computed = if deciding {
                    let (facts, num_output_tokens) = read_facts(&r)?;
                    if !plain_decode(&facts, &step, broken) {
                        return Ok(false);
                    }
                    computed.push(facts.num_computed_tokens);
                    outputs.push(num_output_tokens);
                    facts.num_computed_tokens
                } else {
                    int_attr(&r, intern!(py, "num_computed_tokens"))?
                };
                let num_computed = count("request.num_computed_tokens", num_computed)?;
                requests.push((r, rid, num_computed));
            }
            Ok::<_, PyErr>(true)
        })?;
        if !plain {
            return Ok(None);
        }
        if deciding {
            slf.try_borrow_mut()?
                .core
                .shielded("new_step_starts", |c| {
                    c.new_step_starts();
                    Ok(())
                })?;
        }
        let args = AllocateSlots {
            num_new_tokens: 1,
            num_lookahead_tokens: lookahead,
            ..AllocateSlots::default()
        };
        let new_block_ids = PyList::empty(py);
        let mut blocks: Vec<BlockId> = Vec::new();
        let mut ends: SmallVec<[usize; 4]> = SmallVec::new();
        let mut next = start;
        for (k, (request, rid, num_computed)) in requests.iter().enumerate() {
            let i = start + k;
            let num_computed = *num_computed;
            let rid = rid.to_str()?;
            blocks.clear();
            ends.clear();
            let (fits, flush) = {
                let mut this = slf.try_borrow_mut()?;
                let req = PyRequest::with_computed(
                    request,
                    rid,
                    num_computed,
                    statuses
                        .as_ref()
                        .map(|[waiting, preempted]| StatusObjects { waiting, preempted }),
                );
                let fits = this
                    .core
                    .shielded("allocate_slots", |c| {
                        c.allocate_slots(&req, &args, &mut blocks, &mut ends)
                    })
                    .map_err(|e| req.error(e));
                let pool = this.core.block_pool();
                let flush = pool.has_events()
                    || pool.has_metrics_ops()
                    || this.core.has_publication_changes();
                (fits, flush)
            };
            if flush {
                Self::flush(slf, Some(request))?;
            }
            if !fits? {
                break;
            }
            new_block_ids.append(block_ids(py, &blocks, &ends)?)?;
            next = i + 1;
        }
        Ok(Some((
            next,
            new_block_ids,
            PyList::new(py, computed)?,
            PyList::new(py, outputs)?,
        )))
    }
}
