//! `SlotMirror`: the core `crate::slots::SlotMirror` as a Python class; a committed
//! step's validated reads are `SlotReads` (`slot_reads.rs`).
//!
//! Conversion only. `plan_scheduler_output` reads vLLM 0.33's `SchedulerOutput` in
//! place (one FFI crossing per step; `slot_facts.rs` reads it); `plan` takes the same
//! facts as plain ids for tests and other engines. Slot mappings and per-request spans
//! come back as `bytearray`s of native-endian int64 (see `convert/buffers.rs`), the fast
//! prefill result as `prefill_skip.rs` encodes it.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyList, PyString, PyTuple};
use rustc_hash::FxHashMap;

use super::buffers::i64_bytearray;
use super::convert::{count, count_arg, int64, u64_arg, BlockIdInt, Int};
use super::errors::InvalidArgumentError;
use super::prefill_skip::{skip_tuple, SkipTuple};
use super::slot_facts::{
    as_str, block_id, block_id_vec, lookup, optional_dict, push_block_ids, read_scheduler_output,
    read_versions, Facts, Spec,
};
use super::slot_reads::PySlotReads;
use crate::shield::Shielded;
use crate::slots::{
    Assignment, PrefillSkipRequest, ScheduledRequest, SlotMirror, StepInput, StepRef,
};

/// `(mirror_id, step_id, req_ids, spans, write_slots, kept_slots, prefill_skip)`;
/// `spans` holds, for `n` requests, `compute_start[n]`, `num_tokens[n]`,
/// `query_start_loc[n + 1]` and `kept[n]`; `kept_slots` (the slots of the rows the
/// skip layers computed) is `None` when every row was kept.
type PlanTuple<'py> = (
    u64,
    u64,
    Bound<'py, PyList>,
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
    Option<Bound<'py, PyByteArray>>,
    Option<SkipTuple<'py>>,
);

/// Fast-prefill options of a plan call.
struct SkipOptions {
    enabled: bool,
    num_reqs_padded: Option<usize>,
    num_logits_padded: usize,
}

/// Every call runs behind the core's panic shield (`src/shield.rs`): a panic is
/// `InternalError`, and one inside a mutating call poisons this mirror.
#[pyclass(name = "SlotMirror", module = "hscache._core")]
pub struct PySlotMirror {
    core: Shielded<SlotMirror>,
    kv_cache_group: usize,
}

/// One planned step over `core` (inside the shield).
fn run<'py>(
    core: &mut SlotMirror,
    py: Python<'py>,
    facts: Facts<'py>,
    order: Option<Bound<'py, PyAny>>,
    skip: SkipOptions,
) -> PyResult<PlanTuple<'py>> {
    let Facts {
        req_ids,
        specs,
        arena,
        finished,
        fresh,
        versions,
    } = facts;
    let ids: Vec<&str> = req_ids
        .iter()
        .map(|s| s.to_str())
        .collect::<PyResult<_>>()?;
    // Rows are laid out in `order` when given, else new requests first.
    let (perm, req_list) = row_order(py, &ids, &req_ids, order)?;
    let finished: Vec<&str> = finished
        .iter()
        .map(|s| s.to_str())
        .collect::<PyResult<_>>()?;
    let scheduled = perm
        .iter()
        .map(|&i| {
            let s = &specs[i];
            let blocks = &arena[s.blocks.clone()];
            ScheduledRequest {
                req_id: ids[i],
                assignment: if s.start {
                    Assignment::Start {
                        block_ids: blocks,
                        num_computed_tokens: s.num_computed_tokens.unwrap_or(0),
                        num_external_tokens: s.num_external_tokens,
                        num_prompt_tokens: s.num_prompt_tokens,
                    }
                } else {
                    Assignment::Continue {
                        new_block_ids: blocks,
                        num_computed_tokens: s.num_computed_tokens,
                        reread: s.reread,
                    }
                },
                num_scheduled_tokens: s.num_scheduled_tokens,
            }
        })
        .collect();
    let spec_tokens: Vec<u32> = if skip.enabled && specs.iter().any(|s| s.num_spec_tokens > 0) {
        perm.iter().map(|&i| specs[i].num_spec_tokens).collect()
    } else {
        Vec::new()
    };
    let step = core.plan_step(&StepInput {
        finished_req_ids: finished,
        scheduled,
        fresh_block_ids: fresh.as_deref(),
        connector_versions: &versions,
        prefill_skip: skip.enabled.then_some(PrefillSkipRequest {
            num_spec_tokens: &spec_tokens,
            num_reqs_padded: skip.num_reqs_padded,
            num_logits_padded: skip.num_logits_padded,
        }),
    })?;
    plan_tuple(core, py, step.mirror_id, step.step_id, req_list)
}

/// The rows' order: `order` when given, else new requests first; the permutation
/// of `ids` and the request ids in row order.
fn row_order<'py>(
    py: Python<'py>,
    ids: &[&str],
    req_ids: &[Bound<'py, PyString>],
    order: Option<Bound<'py, PyAny>>,
) -> PyResult<(Vec<usize>, Bound<'py, PyList>)> {
    match order.filter(|o| !o.is_none()) {
        None => Ok((
            (0..ids.len()).collect::<Vec<_>>(),
            PyList::new(py, req_ids)?,
        )),
        Some(order) => {
            let pos: FxHashMap<&str, usize> =
                ids.iter().enumerate().map(|(i, s)| (*s, i)).collect();
            let mut perm = Vec::with_capacity(ids.len());
            let list = PyList::empty(py);
            for item in order.try_iter()? {
                let item = item?.cast_into::<PyString>().map_err(|_| {
                    InvalidArgumentError::new_err("order must be an iterable of request ids")
                })?;
                let i = *pos.get(item.to_str()?).ok_or_else(|| {
                    InvalidArgumentError::new_err(format!(
                        "order names {item} which is not scheduled in this step"
                    ))
                })?;
                perm.push(i);
                list.append(item)?;
            }
            if perm.len() != ids.len() {
                return Err(InvalidArgumentError::new_err(format!(
                    "order has {} request ids; {} are scheduled",
                    perm.len(),
                    ids.len()
                )));
            }
            Ok((perm, list))
        }
    }
}

/// The plan call's result: the planned step's spans, slots and fast-prefill skip.
fn plan_tuple<'py>(
    core: &SlotMirror,
    py: Python<'py>,
    mirror_id: u64,
    step_id: u64,
    req_list: Bound<'py, PyList>,
) -> PyResult<PlanTuple<'py>> {
    let planned = core.planned();
    let mut row = 0i64;
    let query_start_loc = std::iter::once(0).chain(planned.iter().map(|p| {
        row += (p.num_tokens - p.compute_start) as i64;
        row
    }));
    let spans = i64_bytearray(
        py,
        4 * planned.len() + 1,
        planned
            .iter()
            .map(|p| p.compute_start as i64)
            .chain(planned.iter().map(|p| p.num_tokens as i64))
            .chain(query_start_loc)
            .chain(planned.iter().map(|p| p.kept as i64)),
    )?;
    let num_rows = core.num_write_rows();
    let slots = i64_bytearray(py, num_rows, core.write_slots())?;
    let num_kept = core.num_kept_rows();
    let kept_slots = if num_kept == num_rows {
        None
    } else {
        Some(i64_bytearray(py, num_kept, core.kept_write_slots())?)
    };
    let skip = core
        .pending_prefill_skip()
        .map(|s| skip_tuple(py, s))
        .transpose()?;
    Ok((mirror_id, step_id, req_list, spans, slots, kept_slots, skip))
}

/// The fast-prefill options of a plan call, checked.
fn skip_options(
    enabled: bool,
    num_reqs_padded: Option<Int>,
    num_logits_padded: i64,
) -> PyResult<SkipOptions> {
    Ok(SkipOptions {
        enabled,
        num_reqs_padded: num_reqs_padded
            .map(|n| count_arg("num_reqs_padded", n))
            .transpose()?,
        num_logits_padded: count("num_logits_padded", num_logits_padded)?,
    })
}

/// The entries of `plan`'s `new` / `running` (None: none): an iterable of tuples of
/// `n` fields each; anything else is `InvalidArgumentError` naming the shape.
fn entries<'py>(
    name: &str,
    fields: &str,
    n: usize,
    obj: Option<Bound<'py, PyAny>>,
) -> PyResult<Vec<Bound<'py, PyTuple>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        let item = item?;
        match item.cast::<PyTuple>() {
            Ok(t) if t.len() == n => out.push(t.clone()),
            _ => {
                let got = item
                    .repr()
                    .map_or_else(|_| "?".to_owned(), |r| r.to_string());
                return Err(InvalidArgumentError::new_err(format!(
                    "{name} holds {fields} tuples; got {got}"
                )));
            }
        }
    }
    Ok(out)
}

impl PySlotMirror {
    /// Plans one step from its facts, behind the shield (both `plan` entry points).
    fn plan_step<'py>(
        &mut self,
        py: Python<'py>,
        facts: Facts<'py>,
        order: Option<Bound<'py, PyAny>>,
        skip: SkipOptions,
    ) -> PyResult<PlanTuple<'py>> {
        self.core.write("plan", |core| {
            crate::fault::point("slot_mirror.plan");
            run(core, py, facts, order, skip)
        })
    }
}

#[pymethods]
impl PySlotMirror {
    #[new]
    #[pyo3(signature = (*, num_blocks: "int", block_size: "int", kv_cache_group: "int"=0))]
    fn new(
        num_blocks: Int,
        block_size: Int,
        #[pyo3(from_py_with = int64)] kv_cache_group: i64,
    ) -> PyResult<Self> {
        let num_blocks = u32::try_from(count_arg("num_blocks", num_blocks)?)
            .map_err(|_| InvalidArgumentError::new_err("num_blocks must be below 2^32"))?;
        Ok(Self {
            core: Shielded::new(
                SlotMirror::new(num_blocks, count_arg("block_size", block_size)?)?,
                "hidden-state slot mirror",
            ),
            kv_cache_group: count("kv_cache_group", kv_cache_group)?,
        })
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        self.core.read("num_blocks", |c| Ok(c.num_blocks()))
    }

    #[getter]
    fn block_size(&self) -> PyResult<usize> {
        self.core.read("block_size", |c| Ok(c.block_size()))
    }

    #[getter]
    fn kv_cache_group(&self) -> usize {
        self.kv_cache_group
    }

    /// This mirror's id (plans carry it; other mirrors refuse them).
    #[getter]
    fn mirror_id(&self) -> PyResult<u64> {
        self.core.read("mirror_id", |c| Ok(c.id()))
    }

    /// The id of the last planned step (0 before the first).
    #[getter]
    fn step_id(&self) -> PyResult<u64> {
        self.core.read("step_id", |c| Ok(c.step_id()))
    }

    /// The planned step awaiting its commit, or None.
    #[getter]
    fn pending_step(&self) -> PyResult<Option<u64>> {
        self.core
            .read("pending_step", |c| Ok(c.pending_step().map(|s| s.step_id)))
    }

    /// Why the mirror refuses every call, if a panic poisoned it.
    #[getter]
    fn poisoned(&self) -> Option<String> {
        self.core.poisoned().map(str::to_owned)
    }

    #[getter]
    fn num_requests(&self) -> PyResult<usize> {
        self.core.read("num_requests", |c| Ok(c.num_requests()))
    }

    /// Plans a step from vLLM's `SchedulerOutput` (see `crate::slots`).
    /// `rereads`: running requests that read their rows again (a refused first hit
    /// recomputed from its `num_computed_tokens`, `Assignment::Continue::reread`).
    #[pyo3(signature = (scheduler_output, order: "Iterable[str] | None"=None, *, external_tokens: "Mapping[str, int] | None"=None, connector_versions: "Mapping[int, int] | Iterable[tuple[int, int]] | None"=None, fast_prefill=false, num_reqs_padded: "int | None"=None, num_logits_padded: "int"=0, rereads: "Collection[str] | None"=None) -> "SlotPlan")]
    #[allow(clippy::too_many_arguments)]
    fn plan_scheduler_output<'py>(
        &mut self,
        scheduler_output: &Bound<'py, PyAny>,
        order: Option<Bound<'py, PyAny>>,
        external_tokens: Option<Bound<'py, PyAny>>,
        connector_versions: Option<Bound<'py, PyAny>>,
        fast_prefill: bool,
        num_reqs_padded: Option<Int>,
        #[pyo3(from_py_with = int64)] num_logits_padded: i64,
        rereads: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PlanTuple<'py>> {
        let py = scheduler_output.py();
        let skip = skip_options(fast_prefill, num_reqs_padded, num_logits_padded)?;
        let external = optional_dict("external_tokens", external_tokens)?;
        let rereads = rereads.filter(|r| !r.is_none());
        let mut facts = read_scheduler_output(
            scheduler_output,
            self.kv_cache_group,
            external,
            fast_prefill,
            rereads.as_ref(),
        )?;
        facts.versions = read_versions(connector_versions.as_ref())?;
        self.plan_step(py, facts, order, skip)
    }

    /// Plans a step from plain ids: `new` (first schedules, resumed requests too) as
    /// `(req_id, block_ids, num_computed_tokens, num_scheduled_tokens)`, `running` as
    /// `(req_id, new_block_ids, num_scheduled_tokens)`; rows are laid out new first,
    /// then running, unless `order` lists the request ids.
    #[pyo3(signature = (*, new: "Iterable[tuple[str, Iterable[int], int, int]] | None"=None, running: "Iterable[tuple[str, Iterable[int], int]] | None"=None, finished: "Iterable[str] | None"=None, fresh_block_ids: "Iterable[int] | None"=None, order: "Iterable[str] | None"=None, external_tokens: "Mapping[str, int] | None"=None, connector_versions: "Mapping[int, int] | Iterable[tuple[int, int]] | None"=None, num_prompt_tokens: "Mapping[str, int] | None"=None, spec_tokens: "Mapping[str, int] | None"=None, fast_prefill=false, num_reqs_padded: "int | None"=None, num_logits_padded: "int"=0) -> "SlotPlan")]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn plan<'py>(
        &mut self,
        py: Python<'py>,
        new: Option<Bound<'py, PyAny>>,
        running: Option<Bound<'py, PyAny>>,
        finished: Option<Vec<Bound<'py, PyString>>>,
        fresh_block_ids: Option<Bound<'py, PyAny>>,
        order: Option<Bound<'py, PyAny>>,
        external_tokens: Option<Bound<'py, PyAny>>,
        connector_versions: Option<Bound<'py, PyAny>>,
        num_prompt_tokens: Option<Bound<'py, PyAny>>,
        spec_tokens: Option<Bound<'py, PyAny>>,
        fast_prefill: bool,
        num_reqs_padded: Option<Int>,
        #[pyo3(from_py_with = int64)] num_logits_padded: i64,
    ) -> PyResult<PlanTuple<'py>> {
        let skip = skip_options(fast_prefill, num_reqs_padded, num_logits_padded)?;
        let new = entries(
            "new",
            "(req_id, block_ids, num_computed_tokens, num_scheduled_tokens)",
            4,
            new,
        )?;
        let running = entries(
            "running",
            "(req_id, new_block_ids, num_scheduled_tokens)",
            3,
            running,
        )?;
        let external = optional_dict("external_tokens", external_tokens)?;
        let prompts = optional_dict("num_prompt_tokens", num_prompt_tokens)?;
        let specs_map = optional_dict("spec_tokens", spec_tokens)?;
        let spec_of = |req_id: &Bound<'py, PyString>| -> PyResult<u32> {
            let n = lookup("spec_tokens", specs_map.as_ref(), req_id)?.unwrap_or(0);
            u32::try_from(n).map_err(|_| InvalidArgumentError::new_err("too many spec tokens"))
        };
        let mut facts = Facts::default();
        for t in new {
            let req_id = as_str(t.get_item(0)?)?;
            let blocks = push_block_ids(&mut facts.arena, &t.get_item(1)?)?;
            let nc: Int = t.get_item(2)?.extract()?;
            let n: Int = t.get_item(3)?.extract()?;
            facts.specs.push(Spec {
                start: true,
                blocks,
                num_computed_tokens: Some(count_arg("num_computed_tokens", nc)?),
                num_scheduled_tokens: count_arg("num_scheduled_tokens", n)?,
                num_external_tokens: lookup("external_tokens", external.as_ref(), &req_id)?
                    .unwrap_or(0),
                num_prompt_tokens: lookup("num_prompt_tokens", prompts.as_ref(), &req_id)?,
                num_spec_tokens: spec_of(&req_id)?,
                reread: false,
            });
            facts.req_ids.push(req_id);
        }
        for t in running {
            let req_id = as_str(t.get_item(0)?)?;
            let blocks = push_block_ids(&mut facts.arena, &t.get_item(1)?)?;
            let n: Int = t.get_item(2)?.extract()?;
            facts.specs.push(Spec {
                start: false,
                blocks,
                num_computed_tokens: None,
                num_scheduled_tokens: count_arg("num_scheduled_tokens", n)?,
                num_external_tokens: 0,
                num_prompt_tokens: None,
                num_spec_tokens: spec_of(&req_id)?,
                reread: false,
            });
            facts.req_ids.push(req_id);
        }
        facts.finished = finished.unwrap_or_default();
        facts.fresh = fresh_block_ids.map(|f| block_id_vec(&f)).transpose()?;
        facts.versions = read_versions(connector_versions.as_ref())?;
        self.plan_step(py, facts, order, skip)
    }

    /// Counts the pending step's rows as written, then validates its reads. The step
    /// must be this mirror's (`mirror_id`) pending one.
    #[pyo3(signature = (step_id: "int", mirror_id: "int"))]
    fn commit(&mut self, step_id: Int, mirror_id: Int) -> PyResult<PySlotReads> {
        let (step_id, mirror_id) = (
            u64_arg("step_id", step_id)?,
            u64_arg("mirror_id", mirror_id)?,
        );
        self.core.write("commit", |c| {
            Ok(PySlotReads {
                reads: c.commit(StepRef { mirror_id, step_id })?,
            })
        })
    }

    /// Re-checks earlier reads; entries whose blocks were reassigned become misses.
    /// Returns how many did.
    fn revalidate(&mut self, mut reads: PyRefMut<'_, PySlotReads>) -> PyResult<usize> {
        self.core
            .write("revalidate", |c| Ok(c.revalidate(&mut reads.reads)?))
    }

    /// Test only (the `mutants` build): breaks one of the mirror's rules (a name of
    /// `_rule_mutants()`), so that a differential proves it notices; the mirror must
    /// then be thrown away.
    #[cfg(feature = "mutants")]
    fn _break_rule(&mut self, name: &str) -> PyResult<()> {
        self.core
            .write("_break_rule", |c| Ok(c.break_rule_for_tests(name)?))
    }

    /// The names `_break_rule` accepts.
    #[cfg(feature = "mutants")]
    #[staticmethod]
    fn _rule_mutants() -> Vec<&'static str> {
        SlotMirror::RULE_MUTANTS.to_vec()
    }

    /// `(version, leading rows written in it)` of a block (keys of every layer).
    #[pyo3(signature = (block_id: "int"))]
    fn block_state(&self, block_id: BlockIdInt) -> PyResult<(u64, usize)> {
        let b = self::block_id(block_id.0)?;
        self.core.read("block_state", |c| Ok(c.block_state(b)?))
    }

    /// Leading rows of the skip-layer keys written in the block's current version.
    #[pyo3(signature = (block_id: "int"))]
    fn block_skip_rows(&self, block_id: BlockIdInt) -> PyResult<usize> {
        let b = self::block_id(block_id.0)?;
        self.core
            .read("block_skip_rows", |c| Ok(c.block_skip_rows(b)?))
    }

    #[pyo3(signature = (req_id) -> "list[int]")]
    fn block_table<'py>(&self, py: Python<'py>, req_id: &str) -> PyResult<Bound<'py, PyList>> {
        self.core
            .read("block_table", |c| PyList::new(py, c.block_table(req_id)?))
    }

    fn num_computed_tokens(&self, req_id: &str) -> PyResult<usize> {
        self.core.read(
            "num_computed_tokens",
            |c| Ok(c.num_computed_tokens(req_id)?),
        )
    }

    /// The mirror's counters as a dict.
    #[pyo3(signature = () -> "dict[str, int]")]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.read("stats", |c| Ok::<_, PyErr>(c.stats()))?;
        let d = PyDict::new(py);
        for (k, v) in [
            ("steps", s.steps),
            ("committed_steps", s.committed_steps),
            ("uncommitted_steps", s.uncommitted_steps),
            ("fresh_blocks", s.fresh_blocks),
            ("untrusted_loaded_blocks", s.untrusted_loaded_blocks),
            ("vouched_blocks", s.vouched_blocks),
            ("rows_written", s.rows_written),
            ("skipped_rows", s.skipped_rows),
            ("reads_served", s.reads_served),
            ("cached_rows_served", s.cached_rows_served),
            ("partial_reads", s.partial_reads),
            ("read_misses", s.read_misses),
            ("stale_reads", s.stale_reads),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}
