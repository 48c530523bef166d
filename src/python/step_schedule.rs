//! `StepSchedule`: the `schedule()` phase of the steady decode step
//! (`crate::step::schedule`, `hscache.vllm.step.schedule`), one call per step.
//!
//! `StepSchedule.decodes` reads each running `Request`'s fields once (interned
//! `getattr`), checks that the manager (a `KVCacheCore`) holds every request, decides
//! with [`crate::step::schedule::plain_decode`] (nothing changes when one request is not
//! a plain decode), starts the manager's step (`new_step_starts`), then runs the
//! manager's own `allocate_slots(request, 1, num_lookahead_tokens=L)` per request in
//! order (the same core path as the per-call binding, so every layout gets vLLM's
//! decisions and per-group block ids), building each request's KV events with that
//! request. It stops at the first request that does not fit (vLLM's `None`): the
//! caller preempts from the tail with vLLM's `_preempt_request` and calls again from
//! that index (`start`), which allocates only. `StepSchedule.plain_decodes` is the same
//! decision for a manager that is not the core (parity mode, vLLM's own manager).
//!
//! The scheduler's constants (`is_async`, `max_model_len`, ...) are the object's, given
//! once; the mutants are the process's ([`crate::step::armed`]). This file only
//! converts: the rule is the core's, the allocation the manager's.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};
use smallvec::SmallVec;

use super::convert::expect_attr;
use super::convert::request::{PyRequest, StatusObjects};
use super::errors::{count, InvalidArgumentError, UnknownRequestError};
use super::manager::PyKVCacheCore;
use crate::manager::{AllocateSlots, GroupedBlocks};
use crate::step::schedule::{plain_decode, ScheduleFacts, ScheduleRule, StepFacts};
use crate::step::{armed, BrokenRules, RuleSet};
use crate::types::BlockId;

/// `(next, new_block_ids, num_computed_tokens, num_output_tokens)`.
type Scheduled<'py> = (
    usize,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
);

/// The rules named in `names` (an iterable of rule names of either core phase):
/// `TypeError` for anything but names, `InvalidArgumentError` for an unknown one.
#[cfg(feature = "mutants")]
fn broken_rules(names: &Bound<'_, PyAny>) -> PyResult<BrokenRules> {
    use pyo3::exceptions::PyTypeError;
    let mut list = Vec::new();
    for name in names.try_iter()? {
        let name = name?;
        let name = name
            .cast::<PyString>()
            .map_err(|_| PyTypeError::new_err("broken rules must be rule names (str)"))?;
        list.push(name.to_str()?.to_owned());
    }
    BrokenRules::from_names(list.iter().map(String::as_str))
        .map_err(|name| InvalidArgumentError::new_err(format!("no fast-path rule {name:?}")))
}

/// Test only (the `mutants` build): breaks the core rules named in `names` in this
/// process (an empty iterable disarms them); see `tests/scheduler/mutants.py`.
#[cfg(feature = "mutants")]
#[pyfunction]
pub(crate) fn _break_step_rules(names: &Bound<'_, PyAny>) -> PyResult<()> {
    crate::step::arm(broken_rules(names)?);
    Ok(())
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

/// The `schedule()` phase of one scheduler's steady decode steps: its constants, read
/// once at construction.
#[pyclass(name = "StepSchedule", module = "hscache._core", frozen)]
pub struct PyStepSchedule {
    is_async: bool,
    max_model_len: i64,
    num_sampled_tokens_per_step: i64,
    num_lookahead_tokens: usize,
}

impl PyStepSchedule {
    /// The facts of step `step`.
    fn facts(&self, step: i64) -> StepFacts {
        StepFacts {
            step,
            is_async: self.is_async,
            max_model_len: self.max_model_len,
            num_sampled_tokens_per_step: self.num_sampled_tokens_per_step,
        }
    }
}

#[pymethods]
impl PyStepSchedule {
    /// `is_async`: an `AsyncScheduler`; the others are the scheduler's own.
    #[new]
    #[pyo3(signature = (*, is_async, max_model_len, num_sampled_tokens_per_step,
        num_lookahead_tokens=0))]
    fn new(
        is_async: bool,
        max_model_len: i64,
        num_sampled_tokens_per_step: i64,
        num_lookahead_tokens: i64,
    ) -> PyResult<Self> {
        count("max_model_len", max_model_len)?;
        count("num_sampled_tokens_per_step", num_sampled_tokens_per_step)?;
        Ok(Self {
            is_async,
            max_model_len,
            num_sampled_tokens_per_step,
            num_lookahead_tokens: count("num_lookahead_tokens", num_lookahead_tokens)?,
        })
    }

    /// The names of this phase's core rules (`crate::step::schedule::ScheduleRule`).
    #[classattr]
    #[allow(non_snake_case)]
    fn RULES() -> Vec<&'static str> {
        ScheduleRule::names()
    }

    #[getter]
    fn is_async(&self) -> bool {
        self.is_async
    }

    #[getter]
    fn max_model_len(&self) -> i64 {
        self.max_model_len
    }

    #[getter]
    fn num_sampled_tokens_per_step(&self) -> i64 {
        self.num_sampled_tokens_per_step
    }

    #[getter]
    fn num_lookahead_tokens(&self) -> usize {
        self.num_lookahead_tokens
    }

    /// Every request's `(num_computed_tokens, num_output_tokens)` when each is a plain
    /// decode at step `step`, else None; for a manager that is not the core.
    fn plain_decodes(
        &self,
        running: &Bound<'_, PyList>,
        step: i64,
    ) -> PyResult<Option<(Vec<i64>, Vec<i64>)>> {
        decide(running, &self.facts(step), armed())
    }

    /// The phase on `manager` (see the module docs).
    fn decodes<'py>(
        &self,
        manager: &Bound<'py, PyKVCacheCore>,
        running: &Bound<'py, PyList>,
        start: i64,
        step: i64,
    ) -> PyResult<Option<Scheduled<'py>>> {
        PyKVCacheCore::schedule_decodes(
            manager,
            running,
            start,
            &self.facts(step),
            self.num_lookahead_tokens,
            armed(),
        )
    }
}

impl PyKVCacheCore {
    /// [`PyStepSchedule::decodes`].
    fn schedule_decodes<'py>(
        slf: &Bound<'py, Self>,
        running: &Bound<'py, PyList>,
        start: i64,
        step: &StepFacts,
        lookahead: usize,
        broken: BrokenRules,
    ) -> PyResult<Option<Scheduled<'py>>> {
        let py = slf.py();
        let step = *step;
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
