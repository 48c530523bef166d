//! The spec annotation of `BlockStored` events, made when an event is built rather
//! than when it is taken.
//!
//! vLLM's `KVCacheManager.take_events` sets each taken `BlockStored`'s
//! `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` from the manager's
//! `kv_cache_event_metadata[group_idx]`: a loop over every event, every step. A
//! manager here keeps a [`SpecTable`], the per-group `(kind, window)` objects of the
//! metadata tuple it was made from, and while one is in force every `BlockStored`
//! its builders append to the event sink is annotated from it as it is built
//! ([`GroupSpecs`], carried in the batch's `StoredMemo`). A manager's `take_events`
//! whose metadata is still that tuple (identity) then hands the list over as it
//! is; anything else (no table, other metadata) runs vLLM's loop
//! (`src/python/manager_calls.rs`). The pool-level take and a reader of the live
//! queue get vLLM's pool's events, un-annotated ([`clear_specs`]).
//!
//! A table is only made from an exact tuple of exact 2-tuples covering every group
//! id the core emits: a tuple and its entries cannot change, so the identity of
//! the tuple stands for its contents.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// The annotation in force for a manager's event sink: while it is, every
/// `BlockStored` in the sink was built here and annotated from it.
pub(crate) struct SpecTable {
    /// The `kv_cache_event_metadata` tuple the table was made from; `None` once an
    /// event could not be annotated as vLLM's take would (the next take then runs
    /// vLLM's loop over the sink).
    metadata: Option<Py<PyAny>>,
    /// Per group id: `(kv_cache_spec_kind, kv_cache_spec_sliding_window)`.
    groups: Vec<[Py<PyAny>; 2]>,
}

impl SpecTable {
    /// The table of `metadata` when it is an exact tuple whose first `num_groups`
    /// entries are exact 2-tuples; else `None` (vLLM's loop at each take).
    pub(crate) fn of(metadata: &Bound<'_, PyAny>, num_groups: usize) -> Option<Self> {
        let tuple = metadata.cast_exact::<PyTuple>().ok()?;
        if tuple.len() < num_groups {
            return None;
        }
        let groups = tuple
            .iter()
            .take(num_groups)
            .map(|entry| {
                let pair = entry
                    .cast_exact::<PyTuple>()
                    .ok()
                    .filter(|p| p.len() == 2)?;
                Some([
                    pair.get_item(0).ok()?.unbind(),
                    pair.get_item(1).ok()?.unbind(),
                ])
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            metadata: Some(metadata.clone().unbind()),
            groups,
        })
    }

    /// The metadata tuple the table was made from (`None` once invalidated).
    pub(crate) fn metadata<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        self.metadata.as_ref().map(|m| m.bind(py).clone())
    }

    /// Marks the sink's annotations as not vLLM's (an event outside the table).
    pub(crate) fn invalidate(&mut self) {
        self.metadata = None;
    }

    /// The table for one batch of builds.
    pub(crate) fn bind<'py>(&self, py: Python<'py>) -> GroupSpecs<'py> {
        GroupSpecs {
            groups: self
                .groups
                .iter()
                .map(|[k, w]| [k.bind(py).clone(), w.bind(py).clone()])
                .collect(),
            missed: false,
        }
    }

    /// The Python objects held (for the garbage collector).
    pub(crate) fn traverse(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.metadata)?;
        for [k, w] in &self.groups {
            visit.call(k)?;
            visit.call(w)?;
        }
        Ok(())
    }
}

/// A [`SpecTable`] bound for one batch of builds: what each group's `BlockStored`
/// carries, and whether an event fell outside it.
pub(crate) struct GroupSpecs<'py> {
    groups: Vec<[Bound<'py, PyAny>; 2]>,
    missed: bool,
}

impl<'py> GroupSpecs<'py> {
    /// Group `group`'s `(kind, window)`; `None` (the event left un-annotated, the
    /// table marked) for a group outside the table.
    pub(crate) fn get(&mut self, group: u32) -> Option<[Bound<'py, PyAny>; 2]> {
        let spec = self.groups.get(group as usize).cloned();
        self.missed |= spec.is_none();
        spec
    }

    /// Annotates an event the pure-Python fallback built, as vLLM's take would: a
    /// `BlockStored` (`stored`) whose `group_idx` is not None, from its entry.
    pub(crate) fn annotate_built(
        &mut self,
        event: &Bound<'py, PyAny>,
        stored: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let py = event.py();
        if !event.is_instance(stored)? {
            return Ok(());
        }
        let group = event.getattr(intern!(py, "group_idx"))?;
        if group.is_none() {
            return Ok(());
        }
        let spec = match group.extract::<u32>() {
            Ok(g) => self.get(g),
            Err(_) => {
                self.missed = true;
                None
            }
        };
        if let Some([kind, window]) = spec {
            event.setattr(intern!(py, "kv_cache_spec_kind"), kind)?;
            event.setattr(intern!(py, "kv_cache_spec_sliding_window"), window)?;
        }
        Ok(())
    }

    /// Whether an event of the batch could not be annotated from the table.
    pub(crate) fn missed(&self) -> bool {
        self.missed
    }
}

/// Resets the spec fields of every `BlockStored` (`stored`) of `events` to None:
/// the events as vLLM's pool queues them, before its manager annotates them.
pub(crate) fn clear_specs(events: &Bound<'_, PyList>, stored: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = events.py();
    let none = py.None().into_bound(py);
    for event in events.iter() {
        if event.is_instance(stored)? {
            event.setattr(intern!(py, "kv_cache_spec_kind"), &none)?;
            event.setattr(intern!(py, "kv_cache_spec_sliding_window"), &none)?;
        }
    }
    Ok(())
}
