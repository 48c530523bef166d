//! vLLM's prefix-cache stats as the manager keeps them: `log_stats`,
//! `prefix_cache_stats` (vLLM's `PrefixCacheStats`), `record_prefix_cache_stats`
//! (every admission) and `make_prefix_cache_stats` (every step).
//!
//! vLLM counts each admission into the stats object's Python ints; so did this
//! module, and reading and writing those cold attributes cost more than vLLM's own
//! bytecode. Now an admission is counted into Rust integers while no one outside
//! the manager can see the stats object, and the counts are written into it when it
//! is next handed out:
//! - the object `make_prefix_cache_stats` makes (vLLM's class, called here) is seen
//!   by no one until the `prefix_cache_stats` getter or the next
//!   `make_prefix_cache_stats` returns it, and both write the counts in first;
//! - once handed out (the getter, or an object set through the setter, as the Python
//!   constructor does), the object may be held and read at any time: every record
//!   then counts into it at once, field by field, as vLLM's `PrefixCacheStats.record`
//!   does, until `make_prefix_cache_stats` replaces it;
//! - a stats object that is not vLLM's own `PrefixCacheStats` with vLLM's `record`
//!   (a subclass, a patched `record`) gets its own `record` called for each admission.
//!
//! So whoever reads the object reads what vLLM's would hold at that point.
//! `KVCacheCore`'s `#[pymethods]` block (`manager.rs`) holds the methods'
//! signatures and docstrings and calls the bodies here.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};

use super::convert::expect_attr;
use super::convert::request::vllm_request_num_tokens;
use super::errors::InvalidArgumentError;

/// vLLM's `PrefixCacheStats` class and its own `record` function, imported once;
/// None where vLLM is not importable or `record` is not vLLM's.
static PREFIX_CACHE_STATS: PyOnceLock<Option<(Py<PyAny>, Py<PyAny>)>> = PyOnceLock::new();

fn vllm_prefix_cache_stats(py: Python<'_>) -> Option<&(Py<PyAny>, Py<PyAny>)> {
    PREFIX_CACHE_STATS
        .get_or_init(py, || {
            let cls = py
                .import("vllm.v1.metrics.stats")
                .and_then(|m| m.getattr("PrefixCacheStats"))
                .ok()?;
            let record = cls.getattr("record").ok()?;
            let name = |attr: &str| -> Option<String> { record.getattr(attr).ok()?.extract().ok() };
            // Captured when first used: a `record` patched before then is not vLLM's.
            (name("__module__").as_deref() == Some("vllm.v1.metrics.stats")
                && name("__qualname__").as_deref() == Some("PrefixCacheStats.record"))
            .then(|| (cls.unbind(), record.unbind()))
        })
        .as_ref()
}

/// Whether `stats` is an instance of vLLM's own `PrefixCacheStats` (not a
/// subclass) whose `record` is vLLM's: its fields can then be counted here.
/// Checked on every record: a `record` patched later is called from then on.
fn counts_in_place(stats: &Bound<'_, PyAny>) -> bool {
    let py = stats.py();
    let Some((cls, record)) = vllm_prefix_cache_stats(py) else {
        return false;
    };
    let ty = stats.get_type();
    ty.is(cls.bind(py))
        && ty
            .getattr(intern!(py, "record"))
            .is_ok_and(|r| r.is(record.bind(py)))
}

/// One admission's counts: `requests`, `queries`, `hits`, or their `preempted_*`
/// twins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    requests: u64,
    queries: u64,
    hits: u64,
}

impl Counts {
    fn add(&mut self, other: Counts) -> bool {
        let sum = |a: u64, b: u64| a.checked_add(b);
        match (
            sum(self.requests, other.requests),
            sum(self.queries, other.queries),
            sum(self.hits, other.hits),
        ) {
            (Some(requests), Some(queries), Some(hits)) => {
                *self = Counts {
                    requests,
                    queries,
                    hits,
                };
                true
            }
            _ => false,
        }
    }
}

/// The manager's prefix-cache stats (see the module doc).
#[derive(Default)]
pub(crate) struct PrefixStats {
    /// vLLM's `log_stats`.
    log_stats: bool,
    /// vLLM's `prefix_cache_stats`.
    stats: Option<Py<PyAny>>,
    /// Whether `stats` was handed to Python since it was made (or came from it):
    /// records then count into it at once.
    exposed: bool,
    /// Counts not yet written into `stats` (zero while `exposed`): new requests,
    /// then preempted ones.
    pending: [Counts; 2],
}

impl PrefixStats {
    pub(crate) fn traverse(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.stats)
    }

    pub(crate) fn clear(&mut self) {
        self.stats = None;
        self.pending = [Counts::default(); 2];
    }

    pub(crate) fn log_stats(&self) -> bool {
        self.log_stats
    }

    pub(crate) fn set_log_stats(&mut self, on: bool) {
        self.log_stats = on;
    }

    /// The stats object, its counts written in; from now on it may be held.
    pub(crate) fn get(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.flush(py)?;
        self.exposed = true;
        Ok(self.stats.as_ref().map(|s| s.clone_ref(py)))
    }

    /// `prefix_cache_stats = stats`, the old object's counts written in first.
    pub(crate) fn set(&mut self, py: Python<'_>, stats: Option<Py<PyAny>>) -> PyResult<()> {
        let flushed = self.flush(py);
        self.stats = stats.filter(|s| !s.is_none(py));
        self.exposed = true;
        flushed
    }

    /// vLLM's `make_prefix_cache_stats`: None with stats off, else the stats object
    /// (its counts written in), replaced by a new vLLM `PrefixCacheStats`.
    pub(crate) fn make(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if !self.log_stats {
            return Ok(None);
        }
        self.flush(py)?;
        let cls = match vllm_prefix_cache_stats(py) {
            Some((cls, _)) => cls.bind(py).clone(),
            None => py
                .import(intern!(py, "vllm.v1.metrics.stats"))?
                .getattr(intern!(py, "PrefixCacheStats"))?,
        };
        let fresh = cls.call0()?.unbind();
        self.exposed = false;
        Ok(self.stats.replace(fresh))
    }

    /// Writes the pending counts into the stats object (which is then up to date).
    fn flush(&mut self, py: Python<'_>) -> PyResult<()> {
        let pending = std::mem::take(&mut self.pending);
        if pending == [Counts::default(); 2] {
            return Ok(());
        }
        let Some(stats) = &self.stats else {
            return Ok(());
        };
        let stats = stats.bind(py);
        for (counts, preempted) in pending.into_iter().zip([false, true]) {
            for (name, by) in field_names(py, preempted).into_iter().zip([
                counts.requests,
                counts.queries,
                counts.hits,
            ]) {
                if by != 0 {
                    bump(stats, name, &by.into_pyobject(py)?.into_any())?;
                }
            }
        }
        Ok(())
    }
}

/// `PrefixCacheStats.record`'s three fields for a new or a preempted request.
fn field_names(py: Python<'_>, preempted: bool) -> [&Bound<'_, PyString>; 3] {
    if preempted {
        [
            intern!(py, "preempted_requests"),
            intern!(py, "preempted_queries"),
            intern!(py, "preempted_hits"),
        ]
    } else {
        [
            intern!(py, "requests"),
            intern!(py, "queries"),
            intern!(py, "hits"),
        ]
    }
}

/// `stats.<name> += by`.
fn bump(
    stats: &Bound<'_, PyAny>,
    name: &Bound<'_, PyString>,
    by: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let value = stats.getattr(name)?.add(by)?;
    stats.setattr(name, value)
}

/// `num_hits` as vLLM's `record` would add it: an int (`TypeError` otherwise), not
/// negative (`InvalidArgumentError`); `Ok(None)` for an int too large for a `u64`.
fn hit_count(num_hits: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    if !num_hits.is_instance_of::<PyInt>() || num_hits.is_instance_of::<PyBool>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "num_hits must be an int, got {}",
            num_hits.get_type().name()?
        )));
    }
    if let Ok(n) = num_hits.extract::<u64>() {
        return Ok(Some(n));
    }
    if num_hits.lt(0)? {
        return Err(InvalidArgumentError::new_err(format!(
            "num_hits must be non-negative, got {num_hits}"
        )));
    }
    Ok(None)
}

/// What a record leaves to do once the manager's borrow is released: Python code
/// (a patched `record`, a subclass's attributes) may call back into the manager.
pub(super) enum PendingRecord<'py> {
    /// Nothing: stats off, the lookup skipped, or the counts kept here.
    Done,
    /// Call `stats.record(**kwargs)` (a stats object that is not vLLM's own).
    Call {
        stats: Bound<'py, PyAny>,
        kwargs: Bound<'py, PyDict>,
    },
    /// Add one request, its queries and its hits to the object's fields.
    Bump {
        stats: Bound<'py, PyAny>,
        preempted: bool,
        num_tokens: Bound<'py, PyAny>,
        num_hits: Bound<'py, PyAny>,
    },
}

impl PendingRecord<'_> {
    /// Runs what is left (call it with the manager not borrowed).
    pub(super) fn finish(self) -> PyResult<()> {
        match self {
            PendingRecord::Done => Ok(()),
            PendingRecord::Call { stats, kwargs } => {
                stats.call_method(intern!(stats.py(), "record"), (), Some(&kwargs))?;
                Ok(())
            }
            PendingRecord::Bump {
                stats,
                preempted,
                num_tokens,
                num_hits,
            } => {
                let py = stats.py();
                let [requests, queries_name, hits_name] = field_names(py, preempted);
                bump(&stats, requests, &1i32.into_pyobject(py)?.into_any())?;
                bump(&stats, queries_name, &num_tokens)?;
                bump(&stats, hits_name, &num_hits)
            }
        }
    }
}

impl PrefixStats {
    /// `KVCacheCore.record_prefix_cache_stats`'s body (the method: `manager.rs`):
    /// counts here while the stats are hidden, else returns what to write.
    pub(super) fn record<'py>(
        &mut self,
        enable_caching: bool,
        request: &Bound<'py, PyAny>,
        num_hits: &Bound<'py, PyAny>,
    ) -> PyResult<PendingRecord<'py>> {
        let py = request.py();
        if !self.log_stats || !enable_caching {
            return Ok(PendingRecord::Done);
        }
        if expect_attr(
            request,
            intern!(py, "skip_reading_prefix_cache"),
            "a vLLM Request",
        )?
        .is_truthy()?
        {
            return Ok(PendingRecord::Done);
        }
        let Some(stats) = self.stats.as_ref().map(|s| s.bind(py).clone()) else {
            return Err(InvalidArgumentError::new_err(
                "prefix_cache_stats was replaced by None",
            ));
        };
        // vLLM's `record` counts the request before it adds the hits: a hit count
        // that is not an int would leave the stats half-updated.
        let hits = hit_count(num_hits)?;
        let queries = vllm_request_num_tokens(request).map(|n| n as u64);
        let queries_read = match queries {
            Some(_) => None,
            None => Some(request.getattr(intern!(py, "num_tokens"))?),
        };
        let preempted = request.getattr(intern!(py, "num_preemptions"))?;
        let preempted = match preempted.extract::<i64>() {
            Ok(n) => n > 0,
            Err(_) => preempted.gt(0)?,
        };
        // Built only when the count is written into the object, not kept here.
        let num_tokens = move || match queries_read {
            Some(obj) => Ok(obj),
            None => queries.into_pyobject(py).map(Bound::into_any),
        };
        if !counts_in_place(&stats) {
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "num_tokens"), num_tokens()?)?;
            kwargs.set_item(intern!(py, "num_hits"), num_hits)?;
            kwargs.set_item(intern!(py, "preempted"), preempted)?;
            return Ok(PendingRecord::Call { stats, kwargs });
        }
        // `PrefixCacheStats.record`'s body (the same in vLLM 0.30, 0.32 and 0.33
        // without `hits_by_source`, which the manager never passes): counted here
        // while no one else can see the object, else into it at once.
        if let (false, Some(queries), Some(hits)) = (self.exposed, queries, hits) {
            let counts = Counts {
                requests: 1,
                queries,
                hits,
            };
            if self.pending[usize::from(preempted)].add(counts) {
                return Ok(PendingRecord::Done);
            }
        }
        self.flush(py)?;
        Ok(PendingRecord::Bump {
            stats,
            preempted,
            num_tokens: num_tokens()?,
            num_hits: num_hits.clone(),
        })
    }
}
