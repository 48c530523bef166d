//! The facts of one slot-mirror step, read from Python: vLLM 0.33's `SchedulerOutput`
//! (its attributes read in place) or plain ids, into owned values the core borrows.
//!
//! Conversion only. Each request's block ids are appended to one flat buffer (no
//! allocation per request); vLLM's per-group `block_ids` tuples give the mirror's
//! KV-cache group's list. A KV connector (`kv_connector_metadata` set) without
//! per-request external counts makes every hit of a new request count as loaded.

use std::ops::Range;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use super::convert::{expect_attr, BlockIdInt, Int};
use super::errors::{count, BlockIdError, InvalidArgumentError};
use crate::types::BlockId;

/// One scheduled request's facts; its block ids are `arena[blocks]`.
pub(super) struct Spec {
    pub(super) start: bool,
    pub(super) blocks: Range<usize>,
    pub(super) num_computed_tokens: Option<usize>,
    pub(super) num_scheduled_tokens: usize,
    pub(super) num_external_tokens: usize,
    pub(super) num_prompt_tokens: Option<usize>,
    pub(super) num_spec_tokens: u32,
    /// A running request that reads its rows again (`Assignment::Continue::reread`).
    pub(super) reread: bool,
}

/// Everything one step's plan reads from Python.
#[derive(Default)]
pub(super) struct Facts<'py> {
    pub(super) req_ids: Vec<Bound<'py, PyString>>,
    pub(super) specs: Vec<Spec>,
    pub(super) arena: Vec<BlockId>,
    pub(super) finished: Vec<Bound<'py, PyString>>,
    pub(super) fresh: Option<Vec<BlockId>>,
    pub(super) versions: Vec<(BlockId, u64)>,
}

pub(super) fn block_id(value: i64) -> PyResult<BlockId> {
    BlockId::try_from(value)
        .map_err(|_| BlockIdError::new_err(format!("block id {value} is out of range")))
}

/// Appends a sequence of block ids to `arena`; returns their range.
pub(super) fn push_block_ids(
    arena: &mut Vec<BlockId>,
    obj: &Bound<'_, PyAny>,
) -> PyResult<Range<usize>> {
    let start = arena.len();
    let bad = || InvalidArgumentError::new_err("block ids must be a sequence of ints");
    // An int beyond 64 bits is `BlockIdError` like any other out-of-range id.
    let id_of = |item: &Bound<'_, PyAny>| -> PyResult<BlockId> {
        match item.extract::<BlockIdInt>() {
            Ok(b) => block_id(b.0),
            Err(e) if e.is_instance_of::<BlockIdError>(item.py()) => Err(e),
            Err(_) => Err(bad()),
        }
    };
    if let Ok(list) = obj.cast::<PyList>() {
        arena.reserve(list.len());
        for item in list.iter() {
            arena.push(id_of(&item)?);
        }
    } else {
        for item in obj.try_iter().map_err(|_| bad())? {
            arena.push(id_of(&item?)?);
        }
    }
    Ok(start..arena.len())
}

pub(super) fn block_id_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    let mut v = Vec::new();
    push_block_ids(&mut v, obj)?;
    Ok(v)
}

pub(super) fn as_str<'py>(obj: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    obj.cast_into::<PyString>()
        .map_err(|_| InvalidArgumentError::new_err("request ids must be str"))
}

/// `{req_id: int}` lookups (external tokens, prompt lengths, spec counts), `name`
/// naming the map in errors.
pub(super) fn lookup(
    name: &str,
    map: Option<&Bound<'_, PyDict>>,
    req_id: &Bound<'_, PyString>,
) -> PyResult<Option<usize>> {
    match map {
        Some(d) => d
            .get_item(req_id)?
            .map(|v| count(&format!("{name}[{req_id}]"), v.extract::<Int>()?.0))
            .transpose(),
        None => Ok(None),
    }
}

pub(super) fn optional_dict<'py>(
    name: &str,
    obj: Option<Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    match obj {
        Some(o) if !o.is_none() => Ok(Some(o.cast_into::<PyDict>().map_err(|_| {
            InvalidArgumentError::new_err(format!("{name} must be a dict of request id -> int"))
        })?)),
        _ => Ok(None),
    }
}

pub(super) fn read_versions(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<(BlockId, u64)>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    let bad = || {
        InvalidArgumentError::new_err(
            "connector_versions must map block id -> version (ints), or be (block, version) pairs",
        )
    };
    let pairs: Vec<(i64, u64)> = if let Ok(d) = obj.cast::<PyDict>() {
        d.iter()
            .map(|(k, v)| {
                Ok((
                    k.extract().map_err(|_| bad())?,
                    v.extract().map_err(|_| bad())?,
                ))
            })
            .collect::<PyResult<_>>()?
    } else {
        obj.extract().map_err(|_| bad())?
    };
    pairs
        .into_iter()
        .map(|(b, v)| Ok((block_id(b)?, v)))
        .collect()
}

/// Appends the mirror's group's block ids out of vLLM's per-group tuple.
fn push_group_ids(
    group: usize,
    arena: &mut Vec<BlockId>,
    per_group: &Bound<'_, PyAny>,
    req_id: &Bound<'_, PyString>,
) -> PyResult<Range<usize>> {
    let groups = per_group.cast::<PyTuple>().map_err(|_| {
        InvalidArgumentError::new_err(format!(
            "request {req_id}: block ids must be a tuple with one list per KV-cache group"
        ))
    })?;
    let ids = groups.get_item(group).map_err(|_| {
        InvalidArgumentError::new_err(format!(
            "request {req_id} has {} KV-cache groups; this mirror follows group {}",
            groups.len(),
            group
        ))
    })?;
    push_block_ids(arena, &ids)
}

/// The per-request counts of `SchedulerOutput`: `num_scheduled_tokens`, and the
/// spec decode drafts when fast prefill reads them.
struct Counts<'py> {
    num_scheduled: Bound<'py, PyDict>,
    spec_map: Option<Bound<'py, PyDict>>,
}

impl<'py> Counts<'py> {
    fn scheduled(&self, req_id: &Bound<'py, PyString>) -> PyResult<usize> {
        let n = self.num_scheduled.get_item(req_id)?.ok_or_else(|| {
            InvalidArgumentError::new_err(format!(
                "request {req_id} is scheduled but has no num_scheduled_tokens"
            ))
        })?;
        count("num_scheduled_tokens", n.extract()?)
    }

    fn spec(&self, req_id: &Bound<'py, PyString>) -> PyResult<u32> {
        match &self.spec_map {
            Some(d) => match d.get_item(req_id)? {
                Some(drafts) => u32::try_from(drafts.len()?)
                    .map_err(|_| InvalidArgumentError::new_err("too many spec decode tokens")),
                None => Ok(0),
            },
            None => Ok(0),
        }
    }
}

/// The facts of vLLM's `SchedulerOutput` for a mirror of KV-cache group `group`.
pub(super) fn read_scheduler_output<'py>(
    so: &Bound<'py, PyAny>,
    group: usize,
    external: Option<Bound<'py, PyDict>>,
    fast_prefill: bool,
    rereads: Option<&Bound<'py, PyAny>>,
) -> PyResult<Facts<'py>> {
    let py = so.py();
    // Missing attributes mean the caller passed something else: `TypeError`.
    let num_scheduled = expect_attr(
        so,
        intern!(py, "num_scheduled_tokens"),
        "vLLM's SchedulerOutput",
    )?;
    let num_scheduled = num_scheduled
        .cast_into::<PyDict>()
        .map_err(|_| InvalidArgumentError::new_err("num_scheduled_tokens must be a dict"))?;
    // A connector may have loaded any hit: without per-request external counts,
    // every hit of a new request is treated as loaded (distrusted).
    let connector = so
        .getattr_opt(intern!(py, "kv_connector_metadata"))?
        .is_some_and(|m| !m.is_none());
    let spec_map = if fast_prefill {
        so.getattr_opt(intern!(py, "scheduled_spec_decode_tokens"))?
            .and_then(|d| d.cast_into::<PyDict>().ok())
            .filter(|d| !d.is_empty())
    } else {
        None
    };
    let counts = Counts {
        num_scheduled,
        spec_map,
    };
    let mut facts = Facts::default();
    let new = NewReqs {
        group,
        external: external.as_ref(),
        connector,
        fast_prefill,
    };
    read_new_reqs(so, &new, &counts, &mut facts)?;
    read_cached_reqs(so, group, rereads, &counts, &mut facts)?;
    read_finished_and_fresh(so, &mut facts)?;
    Ok(facts)
}

/// How [`read_new_reqs`] reads a new request's counts.
struct NewReqs<'a, 'py> {
    group: usize,
    external: Option<&'a Bound<'py, PyDict>>,
    connector: bool,
    fast_prefill: bool,
}

/// `scheduled_new_reqs` into `facts`: each a started request.
fn read_new_reqs<'py>(
    so: &Bound<'py, PyAny>,
    new: &NewReqs<'_, 'py>,
    counts: &Counts<'py>,
    facts: &mut Facts<'py>,
) -> PyResult<()> {
    let py = so.py();
    let new_attr = |nr: &Bound<'py, PyAny>, name: &Bound<'py, PyString>| {
        expect_attr(nr, name, "vLLM's NewRequestData")
    };
    let new_reqs = expect_attr(
        so,
        intern!(py, "scheduled_new_reqs"),
        "vLLM's SchedulerOutput",
    )?;
    for nr in new_reqs.try_iter()? {
        let nr = nr?;
        let req_id = as_str(new_attr(&nr, intern!(py, "req_id"))?)?;
        let blocks = push_group_ids(
            new.group,
            &mut facts.arena,
            &new_attr(&nr, intern!(py, "block_ids"))?,
            &req_id,
        )?;
        let nc = count(
            "num_computed_tokens",
            new_attr(&nr, intern!(py, "num_computed_tokens"))?.extract()?,
        )?;
        let num_external_tokens = match lookup("external_tokens", new.external, &req_id)? {
            Some(n) => n,
            None if new.connector && new.external.is_none() => nc,
            None => 0,
        };
        let num_prompt_tokens = if new.fast_prefill {
            match nr.getattr_opt(intern!(py, "prompt_len"))? {
                Some(n) => Some(count("prompt_len", n.extract()?)?),
                None => None,
            }
        } else {
            None
        };
        facts.specs.push(Spec {
            start: true,
            blocks,
            num_computed_tokens: Some(nc),
            num_scheduled_tokens: counts.scheduled(&req_id)?,
            num_external_tokens,
            num_prompt_tokens,
            num_spec_tokens: counts.spec(&req_id)?,
            reread: false,
        });
        facts.req_ids.push(req_id);
    }
    Ok(())
}

/// `scheduled_cached_reqs` into `facts`: running requests, and resumed ones
/// (started again).
fn read_cached_reqs<'py>(
    so: &Bound<'py, PyAny>,
    group: usize,
    rereads: Option<&Bound<'py, PyAny>>,
    counts: &Counts<'py>,
    facts: &mut Facts<'py>,
) -> PyResult<()> {
    let py = so.py();
    let cached = expect_attr(
        so,
        intern!(py, "scheduled_cached_reqs"),
        "vLLM's SchedulerOutput",
    )?;
    let cached_attr =
        |name: &Bound<'py, PyString>| expect_attr(&cached, name, "vLLM's CachedRequestData");
    let resumed = cached_attr(intern!(py, "resumed_req_ids"))?;
    let any_resumed = resumed.len()? > 0;
    let list = |name: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyList>> {
        cached_attr(name)?.cast_into::<PyList>().map_err(|_| {
            InvalidArgumentError::new_err(format!("scheduled_cached_reqs.{name} must be a list"))
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
    facts.req_ids.reserve(cached_ids.len());
    facts.specs.reserve(cached_ids.len());
    // Index-based: one list access per field, no iterator length checks.
    for i in 0..cached_ids.len() {
        let req_id = cached_ids.get_item(i)?;
        let per_group = new_block_ids.get_item(i)?;
        let nc = computed.get_item(i)?;
        let req_id = as_str(req_id)?;
        let start = any_resumed && resumed.contains(&req_id)?;
        let blocks = if per_group.is_none() {
            facts.arena.len()..facts.arena.len()
        } else {
            push_group_ids(group, &mut facts.arena, &per_group, &req_id)?
        };
        let nc = count("num_computed_tokens", nc.extract()?)?;
        let reread = match rereads {
            Some(set) if !start => set.contains(&req_id)?,
            _ => false,
        };
        facts.specs.push(Spec {
            start,
            blocks,
            num_computed_tokens: Some(nc),
            num_scheduled_tokens: counts.scheduled(&req_id)?,
            num_external_tokens: 0,
            num_prompt_tokens: None,
            num_spec_tokens: counts.spec(&req_id)?,
            reread,
        });
        facts.req_ids.push(req_id);
    }
    Ok(())
}

/// The finished and preempted request ids, and `new_block_ids_to_zero`, into `facts`.
fn read_finished_and_fresh<'py>(so: &Bound<'py, PyAny>, facts: &mut Facts<'py>) -> PyResult<()> {
    let py = so.py();
    let attr = |name: &Bound<'py, PyString>| expect_attr(so, name, "vLLM's SchedulerOutput");
    for key in [
        intern!(py, "finished_req_ids"),
        intern!(py, "preempted_req_ids"),
    ] {
        let set = attr(key)?;
        if set.is_none() {
            continue;
        }
        for id in set.try_iter()? {
            facts.finished.push(as_str(id?)?);
        }
    }
    let fresh = attr(intern!(py, "new_block_ids_to_zero"))?;
    if !fresh.is_none() {
        facts.fresh = Some(block_id_vec(&fresh)?);
    }
    Ok(())
}
