//! `StepUpdate`: the steady requests of a step's `update_from_output()` served in one
//! call (`hscache.vllm.step.update.split_update`), with the decisions of
//! `crate::step::update`.
//!
//! The call runs in three stages: read (each scheduled request's fields, once, in
//! `num_scheduled_tokens` order, and the core's decision whether it is steady), plan
//! (every write of a steady request, and what its writes and output read), and only
//! then write (`PyStepUpdate::write`) what
//! vLLM's `update_from_output` writes for them: `num_in_flight_tokens`, the token
//! appended to `_output_token_ids` and `_all_token_ids`, the block hashes extended by the
//! request's own hasher (skipped when hscache's hasher says no block completes: it would
//! return nothing), with async scheduling the placeholder resolved and the manager's
//! `cache_blocks` called, and the request's `EngineCoreOutput`. vLLM's `Request` stays
//! authoritative; nothing is kept here between calls.
//!
//! Cost: a C-level `getattr` on a `Request` is ~35 ns, three times Python's specialized
//! attribute load, so reading the same ~20 fields through `getattr` saved almost nothing
//! over the Python loop. The reads go through the instance `__dict__` (~20 ns a lookup)
//! where the class defines none of the fields as a property ([`Req`]), the no-op calls
//! (`take_events` without events, hscache's hasher where no block completes) are
//! skipped, and the output struct is built without a keyword dict.
//!
//! Bad input (wrong types, a request id missing from `req_id_to_index`, counts out of
//! range) raises before anything is written. An exception raised by vLLM's own code
//! during the writes (the hasher, `cache_blocks`, `take_events`) propagates as it would
//! from vLLM's loop.

use pyo3::exceptions::{PyKeyError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use super::convert::{expect_attr, Int};
use super::errors::InvalidArgumentError;
use crate::step::update::{
    completes_no_block, is_steady, plan_append, AppendCounts, AppendPlan, CacheBlocksAt, StepSplit,
    StopFacts, Take, UpdateFacts, UpdateRule, UpdateStep,
};
use crate::step::{armed, RuleSet};

/// The vLLM objects the call compares with and builds: read once, at construction.
#[pyclass(name = "StepUpdate", module = "hscache._core", frozen)]
pub struct PyStepUpdate {
    /// `RequestStatus.RUNNING`.
    running: Py<PyAny>,
    /// `EngineCoreOutput`.
    output_class: Py<PyAny>,
    /// Where `output_class` is a msgspec struct whose first fields are `request_id`,
    /// `new_token_ids` and whose [`OUTPUT_FIELDS`] have plain defaults: those defaults.
    /// An output is then built from the two positional fields, and the others set
    /// only where they differ from their default (the same struct, without the
    /// keyword dict a call from Rust needs).
    output_defaults: Option<Vec<Py<PyAny>>>,
    /// [`OUTPUT_FIELDS`], interned.
    output_names: Vec<Py<PyString>>,
    cache_blocks_at: CacheBlocksAt,
}

/// The fields of a steady request's `EngineCoreOutput` besides `request_id` and
/// `new_token_ids`, in the order the outputs are built (vLLM's: `take_events` runs
/// after `stop_reason` is read).
const OUTPUT_FIELDS: [&str; 4] = [
    "stop_reason",
    "events",
    "trace_headers",
    "num_nans_in_logits",
];

/// The defaults of [`OUTPUT_FIELDS`] in `class` (see `PyStepUpdate::output_defaults`),
/// or None where the class is not such a struct.
fn struct_defaults(class: &Bound<'_, PyAny>) -> Option<Vec<Py<PyAny>>> {
    let py = class.py();
    let fields: Vec<String> = class
        .getattr(intern!(py, "__struct_fields__"))
        .ok()?
        .extract()
        .ok()?;
    let defaults = class
        .getattr(intern!(py, "__struct_defaults__"))
        .ok()?
        .cast_into::<PyTuple>()
        .ok()?;
    if fields.get(..2)? != ["request_id", "new_token_ids"] {
        return None;
    }
    // The defaults belong to the last fields.
    let first_default = fields.len().checked_sub(defaults.len())?;
    OUTPUT_FIELDS
        .iter()
        .map(|name| {
            let i = fields
                .iter()
                .position(|f| f == name)?
                .checked_sub(first_default)?;
            let d = defaults.get_item(i).ok()?;
            // A plain value only: a default factory would make a fresh object per struct.
            (d.is_none() || d.is_exact_instance_of::<pyo3::types::PyInt>()).then(|| d.unbind())
        })
        .collect()
}

/// A steady request, read and planned, waiting for its writes.
struct Steady<'py> {
    request: Req<'py>,
    tokens: Bound<'py, PyAny>,
    token: Bound<'py, PyAny>,
    output_token_ids: Bound<'py, PyList>,
    all_token_ids: Bound<'py, PyList>,
    plan: AppendPlan,
    /// Read before any write, so that a request that cannot be served is refused with
    /// nothing changed: the output's fields, the hasher and its hashes.
    request_id: Bound<'py, PyAny>,
    stop_reason: Bound<'py, PyAny>,
    trace_headers: Bound<'py, PyAny>,
    num_nans_in_logits: Bound<'py, PyAny>,
    hasher: Bound<'py, PyAny>,
    block_hashes: Option<Bound<'py, PyAny>>,
}

const REQUEST: &str = "a vLLM Request";
const PARAMS: &str = "vLLM SamplingParams";

fn int_attr(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>, expected: &str) -> PyResult<i64> {
    Ok(expect_attr(obj, name, expected)?.extract::<Int>()?.0)
}

fn len_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// `hasher.hscache_hash_window` (`(hash_block_size, num_hash_lookahead_tokens)`, set on
/// hscache's request block hasher), or None for any other hasher.
fn hash_window(hasher: &Bound<'_, PyAny>) -> Option<(usize, usize)> {
    let window = hasher
        .getattr(intern!(hasher.py(), "hscache_hash_window"))
        .ok()?;
    let (size, lookahead): (usize, usize) = window.extract().ok()?;
    (size > 0).then_some((size, lookahead))
}

/// The `Request` attributes the call reads.
const REQUEST_FIELDS: [&str; 21] = [
    "client_index",
    "status",
    "num_output_placeholders",
    "sampling_params",
    "_output_token_ids",
    "_all_token_ids",
    "num_stale_output_tokens",
    "mm_features",
    "structured_output_request",
    "pooling_params",
    "prefill_stats",
    "max_tokens",
    "num_in_flight_tokens",
    "num_computed_tokens",
    "request_id",
    "stop_reason",
    "trace_headers",
    "num_nans_in_logits",
    "_block_hasher",
    "block_hashes",
    "events",
];

/// Whether `class` defines none of [`REQUEST_FIELDS`] as a data descriptor (a
/// property), so that an instance's `__dict__` entry is what `getattr` returns.
fn plain_fields(class: &Bound<'_, PyType>) -> bool {
    let py = class.py();
    REQUEST_FIELDS
        .iter()
        .all(|name| match class.getattr(*name) {
            Err(_) => true,
            Ok(attr) => {
                let kind = attr.get_type();
                !(kind.hasattr(intern!(py, "__set__")).unwrap_or(true)
                    || kind.hasattr(intern!(py, "__delete__")).unwrap_or(true))
            }
        })
}

/// A request whose attributes are read from its instance `__dict__` where its class
/// makes that the same as `getattr` (a dict lookup costs about half a C-level
/// `getattr`); a name missing from the dict is read with `getattr`.
struct Req<'py> {
    obj: Bound<'py, PyAny>,
    dict: Option<Bound<'py, PyDict>>,
}

impl<'py> Req<'py> {
    /// `obj`; `classes` caches, per class seen in this call, [`plain_fields`].
    fn new(obj: Bound<'py, PyAny>, classes: &mut Vec<(usize, bool)>) -> Self {
        let class = obj.get_type();
        let key = class.as_ptr() as usize;
        let plain = match classes.iter().find(|(k, _)| *k == key) {
            Some(&(_, plain)) => plain,
            None => {
                let plain = plain_fields(&class);
                classes.push((key, plain));
                plain
            }
        };
        let dict = if plain {
            obj.getattr(intern!(obj.py(), "__dict__"))
                .ok()
                .and_then(|d| d.cast_into_exact::<PyDict>().ok())
        } else {
            None
        };
        Self { obj, dict }
    }

    fn attr(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(dict) = &self.dict {
            if let Some(value) = dict.get_item(name)? {
                return Ok(value);
            }
        }
        expect_attr(&self.obj, name, REQUEST)
    }

    fn int(&self, name: &Bound<'py, PyString>) -> PyResult<i64> {
        Ok(self.attr(name)?.extract::<Int>()?.0)
    }

    fn list(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyList>> {
        self.attr(name)?
            .cast_into::<PyList>()
            .map_err(|_| PyTypeError::new_err(format!("request.{name} must be a list")))
    }
}

impl PyStepUpdate {
    /// The stop facts of `params` (a `SamplingParams`), with its stop token ids read
    /// into `stop_ids`.
    fn stop_facts<'b>(
        params: &Bound<'_, PyAny>,
        request: &Req<'_>,
        stop_ids: &'b mut Vec<i64>,
        num_tokens: i64,
        num_output_tokens: i64,
    ) -> PyResult<StopFacts<'b>> {
        let py = params.py();
        let eos = expect_attr(params, intern!(py, "eos_token_id"), PARAMS)?;
        let eos_token_id = if eos.is_none() {
            None
        } else {
            Some(eos.extract::<Int>()?.0)
        };
        stop_ids.clear();
        let ids = expect_attr(params, intern!(py, "stop_token_ids"), PARAMS)?;
        if !ids.is_none() {
            for id in ids.try_iter()? {
                stop_ids.push(id?.extract::<Int>()?.0);
            }
        }
        Ok(StopFacts {
            eos_token_id,
            stop_token_ids: stop_ids,
            max_tokens: request.int(intern!(py, "max_tokens"))?,
            min_tokens: int_attr(params, intern!(py, "min_tokens"), PARAMS)?,
            repetition_detection: !expect_attr(
                params,
                intern!(py, "repetition_detection"),
                PARAMS,
            )?
            .is_none(),
            num_tokens,
            num_output_tokens,
        })
    }

    /// `request.take_events()`, without the call where it would return None with
    /// nothing changed (no events: `take_events` starts with `if not self.events`).
    fn take_events<'py>(request: &Req<'py>) -> PyResult<Bound<'py, PyAny>> {
        let py = request.obj.py();
        if !request.attr(intern!(py, "events"))?.is_truthy()? {
            return Ok(py.None().into_bound(py));
        }
        request.obj.call_method0(intern!(py, "take_events"))
    }

    /// Appends the token's block hashes as `Request.update_block_hashes` does, without
    /// the call where hscache's hasher would return nothing.
    fn extend_block_hashes(
        s: &Steady<'_>,
        window: &mut Option<(usize, Option<(usize, usize)>)>,
    ) -> PyResult<()> {
        let py = s.request.obj.py();
        let hasher = &s.hasher;
        let Some(block_hashes) = &s.block_hashes else {
            return Ok(());
        };
        let key = hasher.as_ptr() as usize;
        let known = match *window {
            Some((k, w)) if k == key => w,
            _ => {
                let w = hash_window(hasher);
                *window = Some((key, w));
                w
            }
        };
        if let Some((size, lookahead)) = known {
            if completes_no_block(block_hashes.len()?, s.all_token_ids.len(), size, lookahead) {
                return Ok(());
            }
        }
        let new = hasher.call1((&s.request.obj,))?;
        if new.cast::<PyList>().is_ok_and(PyListMethods::is_empty) {
            return Ok(());
        }
        block_hashes.call_method1(intern!(py, "extend"), (new,))?;
        Ok(())
    }
}

/// One step's arguments to [`PyStepUpdate::split`], converted.
struct StepInputs<'py> {
    requests: Bound<'py, PyDict>,
    scheduled: Bound<'py, PyDict>,
    index: Bound<'py, PyDict>,
    sampled: Bound<'py, PyList>,
    /// `scheduled_spec_decode_tokens` when not empty.
    drafts: Option<Bound<'py, PyAny>>,
    /// The prompt logprob dicts that are not empty.
    prompt: Vec<Bound<'py, PyAny>>,
    cache_blocks: Option<Bound<'py, PyAny>>,
    step: UpdateStep,
}

/// A scheduled request as the decision reads it (the read stage).
struct Read<'py> {
    request: Req<'py>,
    tokens: Bound<'py, PyAny>,
    /// The sampled token, when exactly one was sampled.
    token: Option<Bound<'py, PyAny>>,
    output_token_ids: Bound<'py, PyList>,
    all_token_ids: Bound<'py, PyList>,
    placeholders: i64,
    steady: bool,
}

impl PyStepUpdate {
    /// The read and plan stages: every scheduled request read (in
    /// `num_scheduled_tokens` order) and decided, the steady ones' writes planned.
    /// None (nothing read has been changed) when the step is not served.
    #[allow(clippy::type_complexity)]
    fn read_and_plan<'py>(
        &self,
        py: Python<'py>,
        inputs: &StepInputs<'py>,
    ) -> PyResult<
        Option<(
            Vec<Steady<'py>>,
            Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
        )>,
    > {
        let mut split = StepSplit::new(inputs.step.is_async);
        let mut steady: Vec<Steady<'py>> = Vec::new();
        let mut rest: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = Vec::new();
        let mut stop_ids: Vec<i64> = Vec::new();
        let mut classes: Vec<(usize, bool)> = Vec::new();
        for (req_id, n) in inputs.scheduled.iter() {
            let Some(request) = inputs.requests.get_item(&req_id)? else {
                rest.push((req_id, n));
                continue;
            };
            let request = Req::new(request, &mut classes);
            let client = request.int(intern!(py, "client_index"))?;
            if !split.open() {
                if split.take(client, false) == Take::NotServed {
                    return Ok(None);
                }
                rest.push((req_id, n));
                continue;
            }
            let read = self.read(py, inputs, request, &req_id, &n, &mut stop_ids)?;
            match split.take(client, read.steady) {
                Take::NotServed => return Ok(None),
                Take::Rest => rest.push((req_id, n)),
                Take::Steady => steady.push(Self::plan(py, inputs, read)?),
            }
        }
        Ok(split.served().then_some((steady, rest)))
    }

    /// The read stage of one request: the facts of its decision, and the decision
    /// ([`is_steady`], whose stop facts are read only where it needs them).
    fn read<'py>(
        &self,
        py: Python<'py>,
        inputs: &StepInputs<'py>,
        request: Req<'py>,
        req_id: &Bound<'py, PyAny>,
        n: &Bound<'py, PyAny>,
        stop_ids: &mut Vec<i64>,
    ) -> PyResult<Read<'py>> {
        // One piece: the read stage, every Python field of one request read once, here, into
        // `UpdateFacts` (the decision) and `Read` (the plan stage's inputs).
        let i = inputs
            .index
            .get_item(req_id)?
            .ok_or_else(|| PyKeyError::new_err(req_id.clone().unbind()))?
            .extract::<Int>()?
            .0;
        let tokens = usize::try_from(i)
            .ok()
            .and_then(|i| inputs.sampled.get_item(i).ok())
            .ok_or_else(|| {
                InvalidArgumentError::new_err(format!(
                    "req_id_to_index[{req_id}] = {i} is not an index of sampled_token_ids"
                ))
            })?;
        let num_sampled_tokens = tokens.len()?;
        let output_token_ids = request.list(intern!(py, "_output_token_ids"))?;
        let all_token_ids = request.list(intern!(py, "_all_token_ids"))?;
        let status = request.attr(intern!(py, "status"))?;
        let placeholders = request.int(intern!(py, "num_output_placeholders"))?;
        let params = request.attr(intern!(py, "sampling_params"))?;
        let is_none =
            |name: &Bound<'py, PyString>| -> PyResult<bool> { Ok(request.attr(name)?.is_none()) };
        let num_logprobs = inputs.step.has_logprobs
            && !params.is_none()
            && !expect_attr(&params, intern!(py, "num_logprobs"), PARAMS)?.is_none();
        let mut prompt_logprobs = false;
        for d in &inputs.prompt {
            prompt_logprobs |= d.contains(req_id)?;
        }
        let token = if num_sampled_tokens == 1 {
            Some(tokens.get_item(0)?)
        } else {
            None
        };
        let token_id = match &token {
            Some(t) => t.extract::<Int>()?.0,
            None => 0,
        };
        let running = self.running.bind(py);
        let facts = UpdateFacts {
            num_scheduled_tokens: n.extract::<Int>()?.0,
            num_sampled_tokens,
            running: status.is(running) || status.eq(running)?,
            stale_output: request.int(intern!(py, "num_stale_output_tokens"))? != 0,
            num_output_placeholders: placeholders,
            mm_features: request.attr(intern!(py, "mm_features"))?.is_truthy()?,
            structured_output: !is_none(intern!(py, "structured_output_request"))?,
            pooling: !is_none(intern!(py, "pooling_params"))?,
            prefill_stats: !is_none(intern!(py, "prefill_stats"))?,
            drafts: match &inputs.drafts {
                Some(d) => d.contains(req_id)?,
                None => false,
            },
            num_logprobs,
            prompt_logprobs,
        };
        let steady = is_steady(&facts, token_id, &inputs.step, || {
            if params.is_none() {
                return Ok(None);
            }
            Self::stop_facts(
                &params,
                &request,
                stop_ids,
                len_i64(all_token_ids.len()),
                len_i64(output_token_ids.len()),
            )
            .map(Some)
        })?;
        Ok(Read {
            request,
            tokens,
            token,
            output_token_ids,
            all_token_ids,
            placeholders,
            steady,
        })
    }

    /// The plan stage of a steady request: its writes ([`plan_append`]) and everything
    /// they and its output read, so that a request that cannot be served is refused
    /// with nothing changed.
    fn plan<'py>(
        py: Python<'py>,
        inputs: &StepInputs<'py>,
        read: Read<'py>,
    ) -> PyResult<Steady<'py>> {
        let request = read.request;
        let counts = AppendCounts {
            num_in_flight_tokens: request.int(intern!(py, "num_in_flight_tokens"))?,
            num_output_placeholders: read.placeholders,
            num_computed_tokens: if read.placeholders != 0 {
                request.int(intern!(py, "num_computed_tokens"))?
            } else {
                0
            },
        };
        let plan = plan_append(&counts, &inputs.step)?;
        if plan.resolve.is_some() && inputs.cache_blocks.is_none() {
            return Err(InvalidArgumentError::new_err(
                "cache_blocks is required: a steady request has an output placeholder",
            ));
        }
        let token = read
            .token
            .ok_or_else(|| InvalidArgumentError::new_err("a steady request without its token"))?;
        let request_id = request.attr(intern!(py, "request_id"))?;
        request_id.hash()?;
        let hasher = request.attr(intern!(py, "_block_hasher"))?;
        let block_hashes = if hasher.is_none() {
            None
        } else {
            let hashes = request.attr(intern!(py, "block_hashes"))?;
            hashes.len()?;
            Some(hashes)
        };
        Ok(Steady {
            stop_reason: request.attr(intern!(py, "stop_reason"))?,
            trace_headers: request.attr(intern!(py, "trace_headers"))?,
            num_nans_in_logits: request.attr(intern!(py, "num_nans_in_logits"))?,
            request_id,
            hasher,
            block_hashes,
            request,
            tokens: read.tokens,
            token,
            output_token_ids: read.output_token_ids,
            all_token_ids: read.all_token_ids,
            plan,
        })
    }

    /// The write stage: request by request in scheduling order, as vLLM's loop; the
    /// outputs built, by request id.
    fn write<'py>(
        &self,
        py: Python<'py>,
        steady: &[Steady<'py>],
        cache_blocks: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let built = PyDict::new(py);
        let mut window = None;
        for s in steady {
            let r = &s.request.obj;
            r.setattr(
                intern!(py, "num_in_flight_tokens"),
                s.plan.num_in_flight_tokens,
            )?;
            s.output_token_ids.append(&s.token)?;
            s.all_token_ids.append(&s.token)?;
            Self::extend_block_hashes(s, &mut window)?;
            if let (Some((placeholders, upto)), Some(cache)) = (s.plan.resolve, cache_blocks) {
                r.setattr(intern!(py, "num_output_placeholders"), placeholders)?;
                cache.call1((r, upto))?;
            }
            let values = [
                s.stop_reason.clone(),
                Self::take_events(&s.request)?,
                s.trace_headers.clone(),
                s.num_nans_in_logits.clone(),
            ];
            built.set_item(&s.request_id, self.output(py, s, values)?)?;
        }
        Ok(built)
    }

    /// A steady request's `EngineCoreOutput`, with `values` for [`OUTPUT_FIELDS`].
    fn output<'py>(
        &self,
        py: Python<'py>,
        s: &Steady<'py>,
        values: [Bound<'py, PyAny>; 4],
    ) -> PyResult<Bound<'py, PyAny>> {
        let output_class = self.output_class.bind(py);
        let request_id = &s.request_id;
        match &self.output_defaults {
            Some(defaults) => {
                let output = output_class.call1((request_id, &s.tokens))?;
                for ((name, value), default) in self.output_names.iter().zip(&values).zip(defaults)
                {
                    // As the keyword would: unless it is the default (None, or an int
                    // equal to the default int).
                    let default = default.bind(py);
                    let same = value.is(default)
                        || (value.is_exact_instance_of::<pyo3::types::PyInt>()
                            && value.eq(default)?);
                    if !same {
                        output.setattr(name.bind(py), value)?;
                    }
                }
                Ok(output)
            }
            None => {
                let kwargs = PyDict::new(py);
                kwargs.set_item(intern!(py, "request_id"), request_id)?;
                kwargs.set_item(intern!(py, "new_token_ids"), &s.tokens)?;
                for (name, value) in self.output_names.iter().zip(values) {
                    kwargs.set_item(name.bind(py), value)?;
                }
                output_class.call(PyTuple::empty(py), Some(&kwargs))
            }
        }
    }
}

#[pymethods]
impl PyStepUpdate {
    /// `running`: vLLM's `RequestStatus.RUNNING`; `output_class`: its
    /// `EngineCoreOutput`; `cache_blocks_at`: `"in_flight"` (vLLM 0.33) or
    /// `"placeholders"` (0.32, 0.30), where a resolved placeholder's `cache_blocks` call
    /// caches up to.
    #[new]
    #[pyo3(signature = (*, running, output_class: "Callable[..., Any]", cache_blocks_at))]
    fn new(
        running: Py<PyAny>,
        output_class: &Bound<'_, PyAny>,
        cache_blocks_at: &str,
    ) -> PyResult<Self> {
        if !output_class.is_callable() {
            return Err(PyTypeError::new_err(
                "output_class must be callable (EngineCoreOutput)",
            ));
        }
        let cache_blocks_at = match cache_blocks_at {
            "in_flight" => CacheBlocksAt::InFlight,
            "placeholders" => CacheBlocksAt::Placeholders,
            other => {
                return Err(InvalidArgumentError::new_err(format!(
                    "cache_blocks_at must be \"in_flight\" or \"placeholders\", got {other:?}"
                )))
            }
        };
        Ok(Self {
            running,
            output_class: output_class.clone().unbind(),
            output_defaults: struct_defaults(output_class),
            output_names: OUTPUT_FIELDS
                .iter()
                .map(|n| PyString::intern(output_class.py(), n).unbind())
                .collect(),
            cache_blocks_at,
        })
    }

    /// The names of this phase's core rules (`crate::step::update::UpdateRule`).
    #[classattr]
    #[allow(non_snake_case)]
    fn RULES() -> Vec<&'static str> {
        UpdateRule::names()
    }

    /// Serves the steady requests of one step's `update_from_output` (see the module
    /// docs): returns the `EngineCoreOutput` built for each, by request id, and the
    /// `num_scheduled_tokens` of the others (vLLM's to serve), or None (nothing
    /// changed) when no request is steady, a request belongs to a client other than 0,
    /// or (async) the step's first request is vLLM's.
    ///
    /// `requests`: the scheduler's `requests`; `num_scheduled_tokens`,
    /// `sampled_token_ids`, `req_id_to_index`: the step's; `drafts`: its
    /// `scheduled_spec_decode_tokens`; `prompt_logprobs`: the runner output's prompt
    /// logprob dicts; `has_logprobs`: it carries sampled logprobs; `cache_blocks`: the
    /// manager's, called for each resolved placeholder.
    #[pyo3(signature = (requests: "dict[str, Any]", num_scheduled_tokens: "dict[str, int]", sampled_token_ids: "list[Any]", req_id_to_index: "dict[str, int]", *, drafts: "Mapping[str, Any]", prompt_logprobs: "Iterable[Mapping[str, Any]]", has_logprobs, max_model_len: "int", is_async, cache_blocks: "Callable[[Any, int], Any] | None" = None) -> "tuple[dict[str, Any], dict[str, int]] | None")]
    #[allow(clippy::too_many_arguments)]
    fn split<'py>(
        &self,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
        num_scheduled_tokens: &Bound<'py, PyAny>,
        sampled_token_ids: &Bound<'py, PyAny>,
        req_id_to_index: &Bound<'py, PyAny>,
        drafts: &Bound<'py, PyAny>,
        prompt_logprobs: &Bound<'py, PyAny>,
        has_logprobs: bool,
        max_model_len: Int,
        is_async: bool,
        cache_blocks: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<(Bound<'py, PyDict>, Bound<'py, PyDict>)>> {
        crate::shield::catch("StepUpdate.split", || {
            let dict = |obj: &Bound<'py, PyAny>, what: &str| {
                obj.cast::<PyDict>()
                    .cloned()
                    .map_err(|_| PyTypeError::new_err(format!("{what} must be a dict")))
            };
            // The containers that hand a request to vLLM, read only when non-empty.
            let mut prompt: Vec<Bound<'py, PyAny>> = Vec::new();
            for d in prompt_logprobs.try_iter()? {
                let d = d?;
                if !d.is_empty()? {
                    prompt.push(d);
                }
            }
            let inputs = StepInputs {
                requests: dict(requests, "requests")?,
                scheduled: dict(num_scheduled_tokens, "num_scheduled_tokens")?,
                index: dict(req_id_to_index, "req_id_to_index")?,
                sampled: sampled_token_ids
                    .cast::<PyList>()
                    .cloned()
                    .map_err(|_| PyTypeError::new_err("sampled_token_ids must be a list"))?,
                drafts: (!drafts.is_empty()?).then(|| drafts.clone()),
                prompt,
                cache_blocks: cache_blocks.filter(|c| !c.is_none()).cloned(),
                step: UpdateStep {
                    is_async,
                    has_logprobs,
                    max_model_len: max_model_len.0,
                    cache_blocks_at: self.cache_blocks_at,
                    broken: armed(),
                },
            };
            // Read and plan every request; nothing is written before all are read.
            let Some((steady, rest)) = self.read_and_plan(py, &inputs)? else {
                return Ok(None);
            };
            let remaining = PyDict::new(py);
            for (req_id, n) in &rest {
                remaining.set_item(req_id, n)?;
            }
            let built = self.write(py, &steady, inputs.cache_blocks.as_ref())?;
            Ok(Some((built, remaining)))
        })
    }
}
