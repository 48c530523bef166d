//! `SlotMirror` and `SlotReads`: the core `crate::slots` as Python classes.
//!
//! Conversion only. `plan_scheduler_output` reads vLLM 0.33's `SchedulerOutput`
//! attributes in place (one FFI crossing per step); `plan` takes the same facts as
//! plain ids for tests and other engines. Slot mappings and per-request spans come
//! back as `bytearray`s of native-endian int64 (see `buffers.rs`).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyList, PyString, PyTuple};
use rustc_hash::FxHashMap;

use super::buffers::i64_bytearray;
use super::errors::{count, BlockIdError, InvalidArgumentError};
use crate::slots::{Assignment, ScheduledRequest, SlotMirror, StepInput, StepReads};
use crate::types::BlockId;

/// `(step_id, req_ids, spans, write_slots)`; `spans` holds, for `n` requests,
/// `compute_start[n]`, `num_tokens[n]` and `query_start_loc[n + 1]`.
type PlanTuple<'py> = (
    u64,
    Bound<'py, PyList>,
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
);

/// One scheduled request's facts, owned until the core borrows them.
struct Spec {
    start: bool,
    block_ids: Vec<BlockId>,
    num_computed_tokens: Option<usize>,
    num_scheduled_tokens: usize,
}

fn block_id(value: i64) -> PyResult<BlockId> {
    BlockId::try_from(value)
        .map_err(|_| BlockIdError::new_err(format!("block id {value} is out of range")))
}

fn block_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    let raw: Vec<i64> = obj
        .extract()
        .map_err(|_| InvalidArgumentError::new_err("block ids must be a sequence of ints"))?;
    raw.into_iter().map(block_id).collect()
}

#[pyclass(name = "SlotMirror", module = "hscache._core")]
pub struct PySlotMirror {
    core: SlotMirror,
    kv_cache_group: usize,
}

impl PySlotMirror {
    /// The group's block ids out of vLLM's per-group tuple.
    fn group_ids(&self, per_group: &Bound<'_, PyAny>, req_id: &str) -> PyResult<Vec<BlockId>> {
        let groups = per_group.cast::<PyTuple>().map_err(|_| {
            InvalidArgumentError::new_err(format!(
                "request {req_id:?}: block ids must be a tuple with one list per KV-cache group"
            ))
        })?;
        let ids = groups.get_item(self.kv_cache_group).map_err(|_| {
            InvalidArgumentError::new_err(format!(
                "request {req_id:?} has {} KV-cache groups; this mirror follows group {}",
                groups.len(),
                self.kv_cache_group
            ))
        })?;
        block_ids(&ids)
    }

    fn run<'py>(
        &mut self,
        py: Python<'py>,
        req_ids: Vec<Bound<'py, PyString>>,
        specs: Vec<Spec>,
        finished: Vec<Bound<'py, PyString>>,
        fresh: Option<Vec<BlockId>>,
        order: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PlanTuple<'py>> {
        let ids: Vec<&str> = req_ids
            .iter()
            .map(|s| s.to_str())
            .collect::<PyResult<_>>()?;
        let mut perm: Vec<usize> = (0..ids.len()).collect();
        let mut ordered_ids = req_ids.clone();
        if let Some(order) = order {
            let pos: FxHashMap<&str, usize> =
                ids.iter().enumerate().map(|(i, s)| (*s, i)).collect();
            perm.clear();
            ordered_ids.clear();
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
                ordered_ids.push(item);
            }
            if perm.len() != ids.len() {
                return Err(InvalidArgumentError::new_err(format!(
                    "order has {} request ids; {} are scheduled",
                    perm.len(),
                    ids.len()
                )));
            }
        }
        let finished: Vec<&str> = finished
            .iter()
            .map(|s| s.to_str())
            .collect::<PyResult<_>>()?;
        let scheduled = perm
            .iter()
            .map(|&i| {
                let s = &specs[i];
                ScheduledRequest {
                    req_id: ids[i],
                    assignment: if s.start {
                        Assignment::Start {
                            block_ids: &s.block_ids,
                            num_computed_tokens: s.num_computed_tokens.unwrap_or(0),
                        }
                    } else {
                        Assignment::Continue {
                            new_block_ids: &s.block_ids,
                            num_computed_tokens: s.num_computed_tokens,
                        }
                    },
                    num_scheduled_tokens: s.num_scheduled_tokens,
                }
            })
            .collect();
        let step_id = self.core.plan_step(&StepInput {
            finished_req_ids: finished,
            scheduled,
            fresh_block_ids: fresh.as_deref(),
        })?;
        let planned = self.core.planned();
        let mut row = 0i64;
        let query_start_loc = std::iter::once(0).chain(planned.iter().map(|p| {
            row += (p.num_tokens - p.compute_start) as i64;
            row
        }));
        let spans = i64_bytearray(
            py,
            3 * planned.len() + 1,
            planned
                .iter()
                .map(|p| p.compute_start as i64)
                .chain(planned.iter().map(|p| p.num_tokens as i64))
                .chain(query_start_loc),
        )?;
        let slots = i64_bytearray(py, self.core.num_write_rows(), self.core.write_slots())?;
        Ok((step_id, PyList::new(py, ordered_ids)?, spans, slots))
    }
}

#[pymethods]
impl PySlotMirror {
    #[new]
    #[pyo3(signature = (*, num_blocks, block_size, kv_cache_group=0))]
    fn new(num_blocks: i64, block_size: i64, kv_cache_group: i64) -> PyResult<Self> {
        let num_blocks = u32::try_from(count("num_blocks", num_blocks)?)
            .map_err(|_| InvalidArgumentError::new_err("num_blocks is too large"))?;
        Ok(Self {
            core: SlotMirror::new(num_blocks, count("block_size", block_size)?)?,
            kv_cache_group: count("kv_cache_group", kv_cache_group)?,
        })
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.core.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.core.block_size()
    }

    #[getter]
    fn kv_cache_group(&self) -> usize {
        self.kv_cache_group
    }

    /// The id of the last planned step (0 before the first).
    #[getter]
    fn step_id(&self) -> u64 {
        self.core.step_id()
    }

    /// The planned step awaiting its commit, or None.
    #[getter]
    fn pending_step(&self) -> Option<u64> {
        self.core.pending_step()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.core.num_requests()
    }

    /// Plans a step from vLLM's `SchedulerOutput` (see `crate::slots`).
    #[pyo3(signature = (scheduler_output, order=None))]
    fn plan_scheduler_output<'py>(
        &mut self,
        scheduler_output: &Bound<'py, PyAny>,
        order: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PlanTuple<'py>> {
        let py = scheduler_output.py();
        let so = scheduler_output;
        let num_scheduled = so.getattr(intern!(py, "num_scheduled_tokens"))?;
        let num_scheduled = num_scheduled
            .cast::<PyDict>()
            .map_err(|_| InvalidArgumentError::new_err("num_scheduled_tokens must be a dict"))?;
        let scheduled_of = |req_id: &Bound<'py, PyString>| -> PyResult<usize> {
            let n = num_scheduled.get_item(req_id)?.ok_or_else(|| {
                InvalidArgumentError::new_err(format!(
                    "request {req_id} is scheduled but has no num_scheduled_tokens"
                ))
            })?;
            count("num_scheduled_tokens", n.extract()?)
        };
        let as_str = |obj: Bound<'py, PyAny>| -> PyResult<Bound<'py, PyString>> {
            obj.cast_into::<PyString>()
                .map_err(|_| InvalidArgumentError::new_err("request ids must be str"))
        };

        let mut req_ids = Vec::new();
        let mut specs = Vec::new();
        for nr in so.getattr(intern!(py, "scheduled_new_reqs"))?.try_iter()? {
            let nr = nr?;
            let req_id = as_str(nr.getattr(intern!(py, "req_id"))?)?;
            let ids = self.group_ids(&nr.getattr(intern!(py, "block_ids"))?, req_id.to_str()?)?;
            let nc = count(
                "num_computed_tokens",
                nr.getattr(intern!(py, "num_computed_tokens"))?.extract()?,
            )?;
            specs.push(Spec {
                start: true,
                block_ids: ids,
                num_computed_tokens: Some(nc),
                num_scheduled_tokens: scheduled_of(&req_id)?,
            });
            req_ids.push(req_id);
        }
        let cached = so.getattr(intern!(py, "scheduled_cached_reqs"))?;
        let resumed = cached.getattr(intern!(py, "resumed_req_ids"))?;
        let any_resumed = resumed.len()? > 0;
        let list = |name: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyList>> {
            cached.getattr(name)?.cast_into::<PyList>().map_err(|_| {
                InvalidArgumentError::new_err(format!(
                    "scheduled_cached_reqs.{name} must be a list"
                ))
            })
        };
        let cached_ids = list(intern!(py, "req_ids"))?;
        let new_block_ids = list(intern!(py, "new_block_ids"))?;
        let computed = list(intern!(py, "num_computed_tokens"))?;
        if new_block_ids.len() != cached_ids.len() || computed.len() != cached_ids.len() {
            return Err(InvalidArgumentError::new_err(
                "scheduled_cached_reqs lists have different lengths",
            ));
        }
        for ((req_id, per_group), nc) in cached_ids
            .iter()
            .zip(new_block_ids.iter())
            .zip(computed.iter())
        {
            let req_id = as_str(req_id)?;
            let start = any_resumed && resumed.contains(&req_id)?;
            let ids = if per_group.is_none() {
                Vec::new()
            } else {
                self.group_ids(&per_group, req_id.to_str()?)?
            };
            let nc = count("num_computed_tokens", nc.extract()?)?;
            specs.push(Spec {
                start,
                block_ids: ids,
                num_computed_tokens: Some(nc),
                num_scheduled_tokens: scheduled_of(&req_id)?,
            });
            req_ids.push(req_id);
        }
        let mut finished = Vec::new();
        for key in ["finished_req_ids", "preempted_req_ids"] {
            let set = so.getattr(key)?;
            if set.is_none() {
                continue;
            }
            for id in set.try_iter()? {
                finished.push(as_str(id?)?);
            }
        }
        let fresh = so.getattr(intern!(py, "new_block_ids_to_zero"))?;
        let fresh = if fresh.is_none() {
            None
        } else {
            Some(block_ids(&fresh)?)
        };
        self.run(py, req_ids, specs, finished, fresh, order)
    }

    /// Plans a step from plain ids: `new` (first schedules, resumed requests too) as
    /// `(req_id, block_ids, num_computed_tokens, num_scheduled_tokens)`, `running` as
    /// `(req_id, new_block_ids, num_scheduled_tokens)`; rows are laid out new first,
    /// then running, unless `order` lists the request ids.
    #[pyo3(signature = (*, new=None, running=None, finished=None, fresh_block_ids=None,
        order=None))]
    #[allow(clippy::type_complexity)]
    fn plan<'py>(
        &mut self,
        py: Python<'py>,
        new: Option<Vec<(Bound<'py, PyString>, Bound<'py, PyAny>, i64, i64)>>,
        running: Option<Vec<(Bound<'py, PyString>, Bound<'py, PyAny>, i64)>>,
        finished: Option<Vec<Bound<'py, PyString>>>,
        fresh_block_ids: Option<Bound<'py, PyAny>>,
        order: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PlanTuple<'py>> {
        let mut req_ids = Vec::new();
        let mut specs = Vec::new();
        for (req_id, ids, nc, n) in new.unwrap_or_default() {
            specs.push(Spec {
                start: true,
                block_ids: block_ids(&ids)?,
                num_computed_tokens: Some(count("num_computed_tokens", nc)?),
                num_scheduled_tokens: count("num_scheduled_tokens", n)?,
            });
            req_ids.push(req_id);
        }
        for (req_id, ids, n) in running.unwrap_or_default() {
            specs.push(Spec {
                start: false,
                block_ids: block_ids(&ids)?,
                num_computed_tokens: None,
                num_scheduled_tokens: count("num_scheduled_tokens", n)?,
            });
            req_ids.push(req_id);
        }
        let fresh = fresh_block_ids.map(|f| block_ids(&f)).transpose()?;
        self.run(
            py,
            req_ids,
            specs,
            finished.unwrap_or_default(),
            fresh,
            order,
        )
    }

    /// Counts the pending step's rows as written, then validates its reads.
    fn commit(&mut self, step_id: u64) -> PyResult<PySlotReads> {
        Ok(PySlotReads {
            reads: self.core.commit(step_id)?,
        })
    }

    /// Re-checks earlier reads; entries whose blocks were reassigned become misses.
    /// Returns how many did.
    fn revalidate(&mut self, mut reads: PyRefMut<'_, PySlotReads>) -> PyResult<usize> {
        Ok(self.core.revalidate(&mut reads.reads)?)
    }

    /// `(epoch, leading rows written in it)` of a block.
    fn block_state(&self, block_id: i64) -> PyResult<(u64, usize)> {
        Ok(self.core.block_state(self::block_id(block_id)?)?)
    }

    fn block_table<'py>(&self, py: Python<'py>, req_id: &str) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core.block_table(req_id)?)
    }

    fn num_computed_tokens(&self, req_id: &str) -> PyResult<usize> {
        Ok(self.core.num_computed_tokens(req_id)?)
    }

    /// The mirror's counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("steps", s.steps),
            ("committed_steps", s.committed_steps),
            ("uncommitted_steps", s.uncommitted_steps),
            ("fresh_blocks", s.fresh_blocks),
            ("rows_written", s.rows_written),
            ("reads_served", s.reads_served),
            ("cached_rows_served", s.cached_rows_served),
            ("read_misses", s.read_misses),
            ("stale_reads", s.stale_reads),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}

/// The validated reads of one committed step (`SlotMirror.commit`).
#[pyclass(name = "SlotReads", module = "hscache._core")]
pub struct PySlotReads {
    reads: StepReads,
}

#[pymethods]
impl PySlotReads {
    #[getter]
    fn step_id(&self) -> u64 {
        self.reads.step_id
    }

    /// Plan index of every served read, in plan order.
    #[getter]
    fn plan_indices(&self) -> Vec<usize> {
        self.reads.entries().iter().map(|e| e.plan_index).collect()
    }

    /// Rows of every served read (positions `0..num_tokens`).
    #[getter]
    fn num_tokens(&self) -> Vec<usize> {
        self.reads.entries().iter().map(|e| e.num_tokens).collect()
    }

    /// How many rows of every served read come from the cache.
    #[getter]
    fn num_cached_tokens(&self) -> Vec<usize> {
        self.reads
            .entries()
            .iter()
            .map(|e| e.num_cached_tokens)
            .collect()
    }

    /// Plan indices of the reads refused (never served), in plan order.
    #[getter]
    fn misses(&self) -> Vec<usize> {
        self.reads.misses().to_vec()
    }

    #[getter]
    fn num_rows(&self) -> usize {
        self.reads.num_rows()
    }

    /// The slot of every served row (int64 bytearray), entry after entry.
    fn slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyByteArray>> {
        i64_bytearray(py, self.reads.num_rows(), self.reads.slots())
    }

    fn __len__(&self) -> usize {
        self.reads.entries().len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SlotReads(step_id={}, served={}, misses={}, rows={})",
            self.reads.step_id,
            self.reads.entries().len(),
            self.reads.misses().len(),
            self.reads.num_rows()
        )
    }
}
