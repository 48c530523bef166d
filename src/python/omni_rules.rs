//! `OmniStepRules`: the core `crate::slots::OmniStepRules` (the
//! decisions of `hscache.omni.OmniHiddenStateCache`) as a Python class; the step it
//! lays out is `OmniSavePlan` (`omni_save_plan.rs`).
//!
//! Conversion only: `begin_step` reads vLLM's `SchedulerOutput` in place
//! (`finished_req_ids`, each `scheduled_new_reqs` entry's `req_id` and
//! `num_computed_tokens`, `num_scheduled_tokens`); the other calls take and return
//! ids, counts and int64 row indices (`bytearray`, see `convert/buffers.rs`).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyDict, PyInt, PyString};

use super::buffers::i64_bytearray;
use super::convert::{count_arg, expect_attr, Int};
use super::omni_save_plan::PyOmniSavePlan;
use super::slot_facts::as_str;
use crate::shield::Shielded;
use crate::slots::OmniStepRules;

/// `(step_id, prefix positions, plain_rows or None, plain_sizes)`.
type SavedTuple<'py> = (u64, Vec<u32>, Option<Bound<'py, PyByteArray>>, Vec<usize>);

/// Every call runs behind the core's panic shield (`src/shield.rs`).
#[pyclass(name = "OmniStepRules", module = "hscache._core")]
pub struct PyOmniStepRules {
    core: Shielded<OmniStepRules>,
}

/// A step id as Python gave it: any object; only a non-negative `int` (not a `bool`)
/// can be one, anything else is refused as not an unconsumed step (`Err`: how the
/// object shows, for the error). Read before the rules are borrowed: `repr` may run
/// Python code.
fn step_id_arg(step_id: &Bound<'_, PyAny>) -> Result<u64, String> {
    if step_id.is_instance_of::<PyInt>() && !step_id.is_instance_of::<PyBool>() {
        if let Ok(id) = step_id.extract::<u64>() {
            return Ok(id);
        }
    }
    Err(step_id
        .repr()
        .map_or_else(|_| "?".to_owned(), |s| s.to_string()))
}

/// `req_ids` as `&str`s (a `TypeError` for a non-`str` item).
fn str_items<'py>(items: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyString>>> {
    items.try_iter()?.map(|r| as_str(r?)).collect()
}

/// `scheduled_new_reqs`: each new request's id and hit (`num_computed_tokens`,
/// None read as 0).
fn new_req_hits<'py>(
    new_reqs: &Bound<'py, PyAny>,
) -> PyResult<(Vec<Bound<'py, PyString>>, Vec<usize>)> {
    let py = new_reqs.py();
    let mut new_ids = Vec::new();
    let mut hits = Vec::new();
    for nr in new_reqs.try_iter()? {
        let nr = nr?;
        let req_id = as_str(expect_attr(
            &nr,
            intern!(py, "req_id"),
            "vLLM's NewRequestData",
        )?)?;
        let nc = expect_attr(
            &nr,
            intern!(py, "num_computed_tokens"),
            "vLLM's NewRequestData",
        )?;
        let hit = if nc.is_none() {
            0
        } else {
            count_arg("num_computed_tokens", nc.extract()?)?
        };
        new_ids.push(req_id);
        hits.push(hit);
    }
    Ok((new_ids, hits))
}

/// `num_scheduled_tokens`: the scheduled ids and their counts, in the dict's order.
fn scheduled_counts<'py>(
    sched: &Bound<'py, PyAny>,
) -> PyResult<(Vec<Bound<'py, PyString>>, Vec<usize>)> {
    let sched = sched.cast::<PyDict>().map_err(|_| {
        super::errors::InvalidArgumentError::new_err("num_scheduled_tokens must be a dict")
    })?;
    let mut sched_ids = Vec::with_capacity(sched.len());
    let mut counts = Vec::with_capacity(sched.len());
    for (k, v) in sched.iter() {
        sched_ids.push(as_str(k)?);
        counts.push(count_arg("num_scheduled_tokens", v.extract()?)?);
    }
    Ok((sched_ids, counts))
}

#[pymethods]
impl PyOmniStepRules {
    #[new]
    #[pyo3(signature = (*, block_size: "int", max_unconsumed_steps: "int"))]
    fn new(block_size: Int, max_unconsumed_steps: Int) -> PyResult<Self> {
        let core = OmniStepRules::new(
            count_arg("block_size", block_size)?,
            count_arg("max_unconsumed_steps", max_unconsumed_steps)?,
        )?;
        Ok(Self {
            core: Shielded::new(core, "omni step rules"),
        })
    }

    #[getter]
    fn rules_id(&self) -> PyResult<u64> {
        self.core.read("rules_id", |c| Ok(c.id()))
    }

    #[getter]
    fn block_size(&self) -> PyResult<usize> {
        self.core.read("block_size", |c| Ok(c.block_size()))
    }

    /// The most saved steps that may wait for `materialize` / `discard`.
    #[getter]
    fn max_unconsumed_steps(&self) -> PyResult<usize> {
        self.core
            .read("max_unconsumed_steps", |c| Ok(c.max_unconsumed_steps()))
    }

    /// Requests live between steps (scheduled once, not finished).
    #[getter]
    fn num_live(&self) -> PyResult<usize> {
        self.core.read("num_live", |c| Ok(c.num_live()))
    }

    /// Whether a step was begun and not saved yet.
    #[getter]
    fn has_pending_step(&self) -> PyResult<bool> {
        self.core
            .read("has_pending_step", |c| Ok(c.has_pending_step()))
    }

    /// The saved step ids not consumed yet, oldest first.
    fn unconsumed_steps(&self) -> PyResult<Vec<u64>> {
        self.core
            .read("unconsumed_steps", |c| Ok(c.unconsumed_steps().to_vec()))
    }

    /// Raises `StepIdError` when `max_unconsumed_steps` steps wait.
    fn check_room(&self) -> PyResult<()> {
        self.core
            .read("check_room", |c| Ok::<_, PyErr>(c.check_room()?))
    }

    /// Begins a step from vLLM's `SchedulerOutput`; returns whether the previous step
    /// was begun and never saved (plan it without rows first).
    /// Begins a step; returns whether the previous step was never saved, and the
    /// recomputed requests whose rows the mirror reads again.
    fn begin_step(
        slf: &Bound<'_, Self>,
        scheduler_output: &Bound<'_, PyAny>,
    ) -> PyResult<(bool, Vec<String>)> {
        let py = scheduler_output.py();
        let so = scheduler_output;
        let attr = |name| expect_attr(so, name, "vLLM's SchedulerOutput");
        let mut finished: Vec<Bound<'_, PyString>> = Vec::new();
        let fin = attr(intern!(py, "finished_req_ids"))?;
        if !fin.is_none() {
            finished = str_items(&fin)?;
        }
        let (new_ids, hits) = new_req_hits(&attr(intern!(py, "scheduled_new_reqs"))?)?;
        let (sched_ids, counts) = scheduled_counts(&attr(intern!(py, "num_scheduled_tokens"))?)?;
        // The running requests' computed tokens: only while a request waits for its
        // recomputation (a decode step reads nothing more otherwise).
        let mut running_ids = Vec::new();
        let mut running_nc = Vec::new();
        if slf
            .borrow()
            .core
            .read("has_recomputing", |c| Ok::<_, PyErr>(c.has_recomputing()))?
        {
            let cached = attr(intern!(py, "scheduled_cached_reqs"))?;
            let ids = expect_attr(&cached, intern!(py, "req_ids"), "vLLM's CachedRequestData")?;
            let ncs = expect_attr(
                &cached,
                intern!(py, "num_computed_tokens"),
                "vLLM's CachedRequestData",
            )?;
            for (id, nc) in ids.try_iter()?.zip(ncs.try_iter()?) {
                running_ids.push(as_str(id?)?);
                running_nc.push(count_arg("num_computed_tokens", nc?.extract()?)?);
            }
        }
        let finished: Vec<&str> = finished
            .iter()
            .map(|s| s.to_str())
            .collect::<PyResult<_>>()?;
        let running: Vec<(&str, usize)> = running_ids
            .iter()
            .zip(running_nc)
            .map(|(s, n)| Ok((s.to_str()?, n)))
            .collect::<PyResult<_>>()?;
        let new: Vec<(&str, usize)> = new_ids
            .iter()
            .zip(hits)
            .map(|(s, h)| Ok((s.to_str()?, h)))
            .collect::<PyResult<_>>()?;
        let scheduled: Vec<(&str, usize)> = sched_ids
            .iter()
            .zip(counts)
            .map(|(s, n)| Ok((s.to_str()?, n)))
            .collect::<PyResult<_>>()?;
        // Borrowed only now: reading the output above may run Python code, and so let
        // the output thread in (its `materialize` borrows these rules too).
        slf.try_borrow_mut()?.core.write("begin_step", |c| {
            Ok::<_, PyErr>(c.begin_step(&finished, &new, &scheduled, &running)?)
        })
    }

    /// Lays out the begun step's rows in the runner's `batch` order; `num_tokens` is
    /// the step's unpadded row count.
    #[pyo3(signature = (batch: "Iterable[str]", num_tokens: "int"))]
    fn lay_out(
        slf: &Bound<'_, Self>,
        batch: &Bound<'_, PyAny>,
        num_tokens: Int,
    ) -> PyResult<PyOmniSavePlan> {
        let batch = str_items(batch)?;
        let ids: Vec<&str> = batch.iter().map(|s| s.to_str()).collect::<PyResult<_>>()?;
        let n = count_arg("num_tokens", num_tokens)?;
        let plan = slf
            .borrow()
            .core
            .read("lay_out", |c| Ok::<_, PyErr>(c.lay_out(&ids, n)?))?;
        Ok(PyOmniSavePlan { plan })
    }

    /// Saves `plan`'s step and issues its id. `hits` / `misses`: positions (row order)
    /// of the requests whose full rows the mirror served / refused; both `None` when
    /// no rows were written. Returns `(step_id, prefix, plain_rows, plain_sizes)`:
    /// the positions served their prefix, the int64 row indices of the plain
    /// requests' rows (`None`: every request is plain) and their row counts.
    #[pyo3(signature = (plan: "OmniSavePlan", hits: "Sequence[int] | None"=None, misses: "Sequence[int] | None"=None, miss_blocks: "Sequence[int] | None"=None))]
    fn save<'py>(
        &mut self,
        py: Python<'py>,
        plan: &Bound<'py, PyAny>,
        hits: Option<Vec<Int>>,
        misses: Option<Vec<Int>>,
        miss_blocks: Option<Vec<Int>>,
    ) -> PyResult<SavedTuple<'py>> {
        let positions = |v: Option<Vec<Int>>| -> PyResult<Option<Vec<usize>>> {
            v.map(|v| v.into_iter().map(|i| count_arg("position", i)).collect())
                .transpose()
        };
        let (hits, misses) = (positions(hits)?, positions(misses)?);
        // Without blocks every miss names the null block: nothing to report.
        let miss_blocks: Vec<u32> = match miss_blocks {
            Some(v) => v
                .into_iter()
                .map(|b| {
                    u32::try_from(count_arg("miss block", b)?).map_err(|_| {
                        super::errors::InvalidArgumentError::new_err("a miss block past 2**32")
                    })
                })
                .collect::<PyResult<_>>()?,
            None => vec![0; misses.as_ref().map_or(0, Vec::len)],
        };
        let plan = plan.cast::<PyOmniSavePlan>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err("plan must be an OmniSavePlan (lay_out's)")
        })?;
        let plan = &plan.get().plan;
        let saved = self.core.write("save", |c| {
            let reads = match (&hits, &misses) {
                (None, None) => None,
                (h, m) => Some((
                    h.as_deref().unwrap_or(&[]),
                    m.as_deref().unwrap_or(&[]),
                    &miss_blocks[..],
                )),
            };
            Ok::<_, PyErr>(c.save(plan, reads)?)
        })?;
        let rows = match &saved.plain_rows {
            None => None,
            Some(r) => Some(i64_bytearray(py, r.len(), r.iter().copied())?),
        };
        Ok((saved.step_id, saved.prefix, rows, saved.plain_sizes))
    }

    /// Consumes `step_id` for `req_ids`; returns `(index, prefix)` per requested id:
    /// whether it gets its cached prefix, and its index among the step's prefix
    /// requests or among its plain ones (`save`'s order).
    /// Turns recomputation of refused first hits on or off (the runner hook that
    /// reports `take_invalid_blocks` turns it on).
    fn set_recompute_refused(&mut self, on: bool) -> PyResult<()> {
        self.core.write("set_recompute_refused", |c| {
            c.set_recompute_refused(on);
            Ok(())
        })
    }

    #[getter]
    fn recompute_refused(&self) -> PyResult<bool> {
        self.core
            .read("recompute_refused", |c| Ok(c.recompute_refused()))
    }

    /// The requests sent back for recomputation, not scheduled again yet (sorted).
    fn recomputing(&self) -> PyResult<Vec<String>> {
        self.core.read("recomputing", |c| {
            let mut ids: Vec<String> = c.recomputing().map(str::to_owned).collect();
            ids.sort_unstable();
            Ok(ids)
        })
    }

    /// The blocks to report with saved step `step_id`'s output (vLLM's
    /// `invalid_block_ids`), taken once; empty for any other id.
    #[pyo3(signature = (step_id: "object"))]
    fn take_invalid_blocks(&mut self, step_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let Ok(id) = step_id_arg(step_id) else {
            return Ok(Vec::new());
        };
        self.core
            .write("take_invalid_blocks", |c| Ok(c.take_invalid_blocks(id)))
    }

    #[pyo3(signature = (step_id: "object", req_ids: "Iterable[str]"))]
    fn materialize(
        slf: &Bound<'_, Self>,
        step_id: &Bound<'_, PyAny>,
        req_ids: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<u32>, Vec<bool>)> {
        let items = str_items(req_ids)?;
        let ids: Vec<&str> = items.iter().map(|s| s.to_str()).collect::<PyResult<_>>()?;
        let step_id = step_id_arg(step_id);
        slf.try_borrow_mut()?.core.write("materialize", |c| {
            let id = step_id.map_err(|shown| c.step_id_error(shown))?;
            let picks = c.materialize(id, &ids)?;
            Ok::<_, PyErr>((picks.index, picks.prefix))
        })
    }

    /// Consumes `step_id` without reading it.
    #[pyo3(signature = (step_id: "object"))]
    fn discard(slf: &Bound<'_, Self>, step_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let step_id = step_id_arg(step_id);
        slf.try_borrow_mut()?.core.write("discard", |c| {
            let id = step_id.map_err(|shown| c.step_id_error(shown))?;
            Ok::<_, PyErr>(c.discard(id)?)
        })
    }

    /// Test only (the `mutants` build): breaks one of the rules (a name of
    /// `_rule_mutants()`), so that the differential against vllm-omni's cache can prove
    /// it notices.
    #[cfg(feature = "mutants")]
    fn _break_rule(&mut self, name: &str) -> PyResult<()> {
        self.core.write("_break_rule", |c| {
            Ok::<_, PyErr>(c.break_rule_for_tests(name)?)
        })
    }

    /// The names `_break_rule` accepts.
    #[cfg(feature = "mutants")]
    #[staticmethod]
    fn _rule_mutants() -> Vec<&'static str> {
        OmniStepRules::RULE_MUTANTS.to_vec()
    }
}
