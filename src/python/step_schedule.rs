//! `StepSchedule`: the `schedule()` phase of the fast path
//! (`crate::step::schedule`, `hscache.vllm.step.schedule`), one call per step.
//!
//! `StepSchedule.decodes` reads each running `Request`'s fields once (interned
//! `getattr`), checks that the manager (a `KVCacheCore`) holds every request, plans the
//! running loop with [`crate::step::schedule::num_new_tokens`] in running order under
//! the token budget (nothing changes when one request is not served, or when the step
//! defers prefill chunks: [`crate::step::schedule::defers_prefills`]), starts the
//! manager's step (`new_step_starts`), then runs the manager's own
//! `allocate_slots(request, num_new_tokens, num_lookahead_tokens=L)` per planned request
//! in order (the same core path as the per-call binding, so every layout gets vLLM's
//! decisions and per-group block ids), building each request's KV events with that
//! request. A request the loop skips (`continue`: planned 0 tokens) is not allocated
//! and gets None as its block ids; requests past the spent budget are not scheduled
//! (vLLM's loop stops). It
//! stops at the first request that does not fit (vLLM's `None`): the caller preempts
//! from the tail with vLLM's `_preempt_request` and calls again from that index
//! (`start`, with the plan's `tokens`), which allocates only. `StepSchedule.plain_decodes`
//! is the same plan for a manager that is not the core (parity mode, vLLM's own manager).
//!
//! The scheduler's constants (`is_async`, `max_model_len`, ...) are the object's, given
//! once; the step's (budget, threshold, throttle) are the call's; the mutants are the
//! process's ([`crate::step::armed`]). This file only converts: the rule is the core's,
//! the allocation the manager's.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};
use smallvec::SmallVec;

use super::convert::expect_attr;
use super::convert::request::{PyRequest, StatusObjects};
use super::errors::{count, InvalidArgumentError, UnknownRequestError};
use super::manager::PyKVCacheCore;
use crate::manager::{AllocateSlots, GroupedBlocks};
use crate::step::schedule::{
    defers_prefills, num_new_tokens, ScheduleFacts, ScheduleRule, StepFacts,
};
use crate::step::{armed, BrokenRules, RuleSet};
use crate::types::BlockId;

/// `(next, new_block_ids, num_computed_tokens, num_output_tokens, num_new_tokens,
/// first_chunk, any_decode)`.
type Scheduled<'py> = (
    usize,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Option<usize>,
    bool,
);

/// `(num_computed_tokens, num_output_tokens, num_new_tokens, first_chunk, any_decode)`.
type Planned = (Vec<i64>, Vec<i64>, Vec<i64>, Option<usize>, bool);

/// The running loop's plan of one step: per planned request (in running order, up to
/// where the budget is spent) its counts and tokens (0: vLLM's loop skips it); the
/// first scheduled request that is a prefill chunk; whether any running request is not
/// one.
#[derive(Default)]
struct Plan {
    computed: Vec<i64>,
    outputs: Vec<i64>,
    tokens: Vec<i64>,
    first_chunk: Option<usize>,
    any_decode: bool,
}

impl Plan {
    fn into_tuple(self) -> Planned {
        (
            self.computed,
            self.outputs,
            self.tokens,
            self.first_chunk,
            self.any_decode,
        )
    }
}

/// The step's budget and throttle, as the call gives them.
#[derive(Clone, Copy)]
struct StepLimits {
    /// The tokens the step may schedule (the smaller of vLLM's token and input budget).
    budget: i64,
    /// The step holds prefill chunks back when a decode runs (see
    /// [`defers_prefills`]).
    throttle: bool,
    /// A queue vLLM's waiting loop could admit from unless the running requests spend
    /// the budget: the most budget the plan may leave (None: no such queue).
    queue_left: Option<i64>,
}

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

/// What [`num_new_tokens`] reads of `r`, and its `num_output_tokens` (output tokens and
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

/// The step's plan over `running` (the requests in running order), or None (after
/// reading only) when the fast path does not serve it.
fn decide<'py>(
    running: impl Iterator<Item = Bound<'py, PyAny>>,
    step: &StepFacts,
    limits: StepLimits,
    broken: BrokenRules,
) -> PyResult<Option<Plan>> {
    let mut plan = Plan::default();
    let mut any_chunk = false;
    let mut left = limits.budget;
    for (i, r) in running.enumerate() {
        if left <= 0 {
            // vLLM's loop has stopped; whether a prefill chunk waits still decides
            // whether the step defers them.
            let chunk = attr(&r, intern!(r.py(), "is_prefill_chunk"))?.is_truthy()?;
            any_chunk |= chunk;
            plan.any_decode |= !chunk;
            continue;
        }
        let (facts, num_output_tokens) = read_facts(&r)?;
        let Some(n) = num_new_tokens(&facts, step, left, broken) else {
            return Ok(None);
        };
        if facts.is_prefill_chunk {
            any_chunk = true;
            if n > 0 {
                plan.first_chunk.get_or_insert(i);
            }
        } else {
            plan.any_decode = true;
        }
        left -= n;
        plan.computed.push(facts.num_computed_tokens);
        plan.outputs.push(num_output_tokens);
        plan.tokens.push(n);
    }
    if any_chunk && defers_prefills(limits.throttle, plan.any_decode) {
        return Ok(None);
    }
    if limits.queue_left.is_some_and(|most| left > most) {
        return Ok(None);
    }
    Ok(Some(plan))
}

/// The step's token budget: `None` is no limit.
fn budget(token_budget: Option<i64>) -> i64 {
    token_budget.unwrap_or(i64::MAX)
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
    fn facts(&self, step: i64, long_prefill_token_threshold: i64) -> StepFacts {
        StepFacts {
            step,
            is_async: self.is_async,
            max_model_len: self.max_model_len,
            num_sampled_tokens_per_step: self.num_sampled_tokens_per_step,
            long_prefill_token_threshold,
        }
    }
}

#[pymethods]
impl PyStepSchedule {
    /// `is_async`: an `AsyncScheduler`; the others are the scheduler's own.
    #[new]
    #[pyo3(signature = (*, is_async, max_model_len: "int", num_sampled_tokens_per_step: "int", num_lookahead_tokens: "int"=0))]
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

    /// The step's plan `(num_computed_tokens, num_output_tokens, num_new_tokens,
    /// first_chunk, any_decode)` at step `step`, else None; for a manager that is not
    /// the core. `token_budget`: the tokens the step may schedule (None: no limit);
    /// `long_prefill_token_threshold`: the step's effective threshold (0: none);
    /// `throttle`: the step holds prefill chunks back beside a decode; `queue_left`:
    /// a queue waits that vLLM's waiting loop could admit from unless the budget is
    /// spent, so the plan may leave at most this many tokens of it (None: no such queue).
    #[pyo3(signature = (running: "list[Any]", step: "int", *, token_budget: "int | None"=None, long_prefill_token_threshold: "int"=0, throttle=false, queue_left: "int | None"=None))]
    fn plain_decodes(
        &self,
        running: &Bound<'_, PyList>,
        step: i64,
        token_budget: Option<i64>,
        long_prefill_token_threshold: i64,
        throttle: bool,
        queue_left: Option<i64>,
    ) -> PyResult<Option<Planned>> {
        let limits = StepLimits {
            budget: budget(token_budget),
            throttle,
            queue_left,
        };
        let step = self.facts(step, long_prefill_token_threshold);
        Ok(decide(running.iter(), &step, limits, armed())?.map(Plan::into_tuple))
    }

    /// The phase on `manager` (see the module docs). `tokens`: in a resuming call
    /// (`start > 0`), the deciding call's `num_new_tokens` (None: one each).
    #[pyo3(signature = (manager, running: "list[Any]", start: "int", step: "int", *, token_budget: "int | None"=None, long_prefill_token_threshold: "int"=0, throttle=false, queue_left: "int | None"=None, tokens: "list[int] | None"=None) -> "tuple[int, list[tuple[list[int], ...] | None], list[int], list[int], list[int], int | None, bool] | None")]
    #[allow(clippy::too_many_arguments)]
    fn decodes<'py>(
        &self,
        manager: &Bound<'py, PyKVCacheCore>,
        running: &Bound<'py, PyList>,
        start: i64,
        step: i64,
        token_budget: Option<i64>,
        long_prefill_token_threshold: i64,
        throttle: bool,
        queue_left: Option<i64>,
        tokens: Option<Vec<i64>>,
    ) -> PyResult<Option<Scheduled<'py>>> {
        let limits = StepLimits {
            budget: budget(token_budget),
            throttle,
            queue_left,
        };
        PyKVCacheCore::schedule_decodes(
            manager,
            running,
            start,
            &self.facts(step, long_prefill_token_threshold),
            limits,
            tokens,
            self.num_lookahead_tokens,
            armed(),
        )
    }
}

/// A `decodes` call's `start`, checked against the `n` running requests.
fn start_index(start: i64, n: usize) -> PyResult<usize> {
    let start = count("start", start)?;
    if start > n {
        return Err(InvalidArgumentError::new_err(format!(
            "start {start} is past the {n} running requests"
        )));
    }
    Ok(start)
}

/// A `decodes` call's result: the deciding call's plan goes back with it (a
/// resuming call's lists are empty).
fn scheduled<'py>(
    py: Python<'py>,
    next: usize,
    new_block_ids: Bound<'py, PyList>,
    plan: Plan,
    deciding: bool,
) -> PyResult<Scheduled<'py>> {
    let (computed, outputs, tokens) = if deciding {
        (plan.computed, plan.outputs, plan.tokens)
    } else {
        (Vec::new(), Vec::new(), Vec::new())
    };
    Ok((
        next,
        new_block_ids,
        PyList::new(py, computed)?,
        PyList::new(py, outputs)?,
        PyList::new(py, tokens)?,
        plan.first_chunk,
        plan.any_decode,
    ))
}

/// A resuming call's plan: the `tokens` it is given (one each by default), checked.
fn given_plan(tokens: Option<Vec<i64>>, n: usize) -> PyResult<Plan> {
    let tokens = tokens.unwrap_or_else(|| vec![1; n]);
    for &t in &tokens {
        if t < 0 {
            return Err(InvalidArgumentError::new_err(format!(
                "tokens must be non-negative (0: skipped), got {t}"
            )));
        }
    }
    Ok(Plan {
        tokens,
        ..Plan::default()
    })
}

impl PyKVCacheCore {
    /// [`PyStepSchedule::decodes`].
    #[allow(clippy::too_many_arguments)]
    fn schedule_decodes<'py>(
        slf: &Bound<'py, Self>,
        running: &Bound<'py, PyList>,
        start: i64,
        step: &StepFacts,
        limits: StepLimits,
        tokens: Option<Vec<i64>>,
        lookahead: usize,
        broken: BrokenRules,
    ) -> PyResult<Option<Scheduled<'py>>> {
        let py = slf.py();
        let step = *step;
        let n = running.len();
        let start = start_index(start, n)?;
        let statuses = Self::watermark_statuses(slf, true)?;
        let requests = Self::held_requests(slf, running, start)?;
        // The deciding call (`start == 0`) plans the step; a resuming one allocates the
        // plan it is given.
        let deciding = start == 0;
        let plan = if deciding {
            let Some(plan) = decide(
                requests.iter().map(|(r, _)| r.clone()),
                &step,
                limits,
                broken,
            )?
            else {
                return Ok(None);
            };
            plan
        } else {
            given_plan(tokens, n)?
        };
        // The planned requests of this call: `running[start..end]`.
        let end = if deciding {
            plan.tokens.len()
        } else {
            plan.tokens.len().min(n)
        };
        if deciding {
            Self::start_step(slf)?;
        }
        let new_block_ids = PyList::empty(py);
        let mut blocks: Vec<BlockId> = Vec::new();
        let mut ends: SmallVec<[usize; 4]> = SmallVec::new();
        let mut next = start;
        for (k, (request, rid)) in requests.iter().enumerate().take(end.saturating_sub(start)) {
            let i = start + k;
            if plan.tokens[i] == 0 {
                // Skipped by vLLM's loop: nothing allocated, a placeholder entry.
                new_block_ids.append(py.None())?;
                next = i + 1;
                continue;
            }
            let num_computed = if deciding {
                plan.computed[i]
            } else {
                int_attr(request, intern!(py, "num_computed_tokens"))?
            };
            let num_computed = count("request.num_computed_tokens", num_computed)?;
            let args = AllocateSlots {
                num_new_tokens: count("num_new_tokens", plan.tokens[i])?,
                num_lookahead_tokens: lookahead,
                ..AllocateSlots::default()
            };
            let rid = rid.to_str()?;
            blocks.clear();
            ends.clear();
            let req = PyRequest::with_computed(
                request,
                rid,
                num_computed,
                statuses
                    .as_ref()
                    .map(|[waiting, preempted]| StatusObjects { waiting, preempted }),
            );
            if !Self::allocate_planned(slf, request, &req, &args, &mut blocks, &mut ends)? {
                break;
            }
            new_block_ids.append(block_ids(py, &blocks, &ends)?)?;
            next = i + 1;
        }
        scheduled(py, next, new_block_ids, plan, deciding).map(Some)
    }

    /// The manager's `new_step_starts`, behind the shield.
    fn start_step(slf: &Bound<'_, Self>) -> PyResult<()> {
        slf.try_borrow_mut()?
            .core
            .shielded("new_step_starts", |c| {
                c.new_step_starts();
                Ok(())
            })?;
        Ok(())
    }

    /// The requests of `running[start..]` with their ids, checked in one pass before
    /// anything changes: every request is one the core holds.
    fn held_requests<'py>(
        slf: &Bound<'py, Self>,
        running: &Bound<'py, PyList>,
        start: usize,
    ) -> PyResult<Vec<(Bound<'py, PyAny>, Bound<'py, PyString>)>> {
        let mut requests = Vec::with_capacity(running.len() - start);
        slf.try_borrow()?.core.read("schedule_decodes", |c| {
            for (i, r) in running.iter().enumerate().skip(start) {
                let rid = request_id(&r)?;
                if c.coordinator().request(rid.to_str()?).is_none() {
                    return Err(UnknownRequestError::new_err(format!(
                        "running[{i}]: request {rid} holds no blocks in this manager"
                    )));
                }
                requests.push((r, rid));
            }
            Ok::<_, PyErr>(())
        })?;
        Ok(requests)
    }

    /// One planned request through the manager's `allocate_slots` (its new block
    /// ids into `blocks` / `ends`), its KV events flushed with it; whether it fit.
    fn allocate_planned(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        req: &PyRequest<'_, '_>,
        args: &AllocateSlots<'_>,
        blocks: &mut Vec<BlockId>,
        ends: &mut SmallVec<[usize; 4]>,
    ) -> PyResult<bool> {
        let (fits, flush) = {
            let mut this = slf.try_borrow_mut()?;
            let fits = this
                .core
                .shielded("allocate_slots", |c| {
                    c.allocate_slots(req, args, blocks, ends)
                })
                .map_err(|e| req.error(e));
            let pool = this.core.block_pool();
            let flush =
                pool.has_events() || pool.has_metrics_ops() || this.core.has_publication_changes();
            (fits, flush)
        };
        if flush {
            Self::flush(slf, Some(request))?;
        }
        fits
    }
}
