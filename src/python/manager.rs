//! `KVCacheCore`: the core `KVCacheManager` as a subclassable Python class.
//!
//! It owns vLLM's `KVCacheManager` interface: one method per vLLM method, each a few
//! lines of conversion around one core call.
//!
//! `hscache.vllm.KVCacheManager` subclasses it. The methods vLLM's Scheduler calls
//! every step (`allocate_slots`, `get_computed_blocks`, `free`, `get_blocks`,
//! `get_block_ids`, `cache_blocks`, ...) are here with vLLM's exact signatures and
//! return types, so a call costs one FFI crossing and no Python frame; the Python
//! subclass adds the cold parts (stats objects, views, event annotation).
//!
//! This file only converts: it reads arguments (`convert/`), calls the core, and
//! builds results; every vLLM rule is the core's. After a call that recorded KV
//! events or block-metrics calls, [`PyKVCacheCore::flush`] builds vLLM's event
//! structs with the call's request and replays the metrics calls on the user's
//! `KVCacheMetricsCollector`. The classes of the core's other concepts hold a
//! `KVCacheCore` and borrow it per call: the pools (device and host,
//! `BlockPoolCore`, `pool.rs`), the coordinator (`KVCacheCoordinatorCore`,
//! `coordinator.rs`) and HiSparse's coordinator (`HiSparseCore`, `hisparse.rs`).
//!
//! The class's one `#[pymethods]` block is here: every Python-visible name,
//! signature and docstring. The longer bodies of its concerns' methods are plain
//! `impl` blocks in their own files, which that block calls: explain mode
//! (`explain.rs`), retention (`retention.rs`), the stats and event-queue calls
//! (`manager_calls.rs`).

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use pyo3::{intern, PyTraverseError};
use smallvec::SmallVec;

use super::block::PyKVCacheBlock;
use super::blocks::PyKVCacheBlocks;
use super::convert::blocks::{grouped_ids, hit_ids};
use super::convert::request::{request_id, PyRequest, StatusObjects};
use super::convert::spec::group_spec;
use super::convert::{count, count_arg, int64, BlockIdInt, Int};
use super::errors::InvalidArgumentError;
use super::events::{clear_specs, Compactor, PyEventBuilder, SpecTable, StoredMemo};
use super::prefix_stats::PrefixStats;
use crate::events::{EventsMode, MetricsOp};
use crate::manager::{
    AllocateSlots, CoordinatorConfig, GroupedBlockIds, GroupedBlocks, KVCacheManager,
    KVCacheManagerConfig,
};
use crate::pool::rules::VllmRules;
use crate::stats::{self, Op};
use crate::types::BlockId;

/// [`PyKVCacheCore::run_allocate_slots`]'s `(result, ids, ends, flush)`.
type Allocated = (PyResult<bool>, Vec<BlockId>, SmallVec<[usize; 4]>, bool);

#[pyclass(name = "KVCacheCore", module = "hscache._core", subclass)]
pub struct PyKVCacheCore {
    pub(crate) core: KVCacheManager,
    /// Lazily created, then reused, block handles (identity per block id).
    handles: Vec<Option<Py<PyKVCacheBlock>>>,
    /// The same for HiSparse's host pool.
    host_handles: Vec<Option<Py<PyKVCacheBlock>>>,
    /// The requests of HiSparse's pending publications, by publication id: the core
    /// names a publication's request by id (it publishes later, in another call),
    /// and its KV events are built from the request object (`hisparse.rs`).
    pub(crate) publications: rustc_hash::FxHashMap<u64, Py<PyAny>>,
    pub(crate) scratch: Vec<BlockId>,
    scratch_ends: SmallVec<[usize; 4]>,
    /// vLLM objects the vLLM-shaped methods return, compare with or call; set once
    /// by `_bind_vllm`.
    vllm: Option<VllmBindings>,
    /// Compact KV events (`core_set_kv_events_mode("compact")`): the sink's last
    /// event while it may be continued. `None`: vLLM's events, event for event.
    compactor: Option<Compactor>,
    /// `log_stats` and `prefix_cache_stats`, with the counts of admissions not yet
    /// written into the stats object (`prefix_stats.rs`).
    pub(crate) prefix_stats: PrefixStats,
}

/// vLLM objects and the empty-result singleton the drop-in methods need.
struct VllmBindings {
    /// The manager's `empty_kv_cache_blocks` (identity matters to the Scheduler).
    empty_kv_cache_blocks: Py<PyKVCacheBlocks>,
    /// `RequestStatus.WAITING` and `RequestStatus.PREEMPTED`.
    statuses: [Py<PyAny>; 2],
    /// The list to which a call that recorded events appends vLLM's event structs,
    /// built by the builder with the call's request (events on only).
    event_sink: Option<(Py<PyList>, Py<PyEventBuilder>)>,
    /// The builder of HiSparse's host pool events (medium CPU).
    host_event_builder: Option<Py<PyEventBuilder>>,
    /// The spec annotation in force for the sink (`events/spec.rs`): when `Some`,
    /// every `BlockStored` in the sink was built here and annotated from it (each
    /// group's `kv_cache_spec_kind` / `kv_cache_spec_sliding_window` as vLLM's
    /// `KVCacheManager.take_events` sets them), so that `take_events` can hand the
    /// list over as it is; when `None`, the sink's events are plain (vLLM's pool
    /// state). Installed by the manager's `take_events` for the sink it leaves
    /// behind; kept by the pool-level take (whose events are un-annotated on the
    /// way out); dropped, its events un-annotated, when the live sink is handed to
    /// Python (`kv_event_queue`) or replaced.
    spec_table: Option<SpecTable>,
    /// Whether a table may be installed: the builders' `BlockStored` class declares
    /// the spec fields, and HiSparse's host builder (if any) makes the same class.
    annotates: bool,
    /// The user's `KVCacheMetricsCollector` (`--kv-cache-metrics`).
    metrics_collector: Option<Py<PyAny>>,
    /// The free queue's head and tail sentinels (Python objects of the
    /// `FreeKVCacheBlockQueue` view), returned at the ends of a block's free links.
    free_list_sentinels: Option<[Py<PyAny>; 2]>,
}

impl PyKVCacheCore {
    pub(crate) fn handle(
        slf: &Bound<'_, Self>,
        this: &mut Self,
        id: BlockId,
    ) -> PyResult<Py<PyKVCacheBlock>> {
        Self::pool_handle(slf, this, id, false)
    }

    /// The handle of block `id` of the device pool, or (`host`) of the host pool.
    pub(crate) fn pool_handle(
        slf: &Bound<'_, Self>,
        this: &mut Self,
        id: BlockId,
        host: bool,
    ) -> PyResult<Py<PyKVCacheBlock>> {
        let py = slf.py();
        let handles = if host {
            &mut this.host_handles
        } else {
            &mut this.handles
        };
        let slot = handles.get_mut(id as usize).ok_or_else(|| {
            InvalidArgumentError::new_err(format!("block id {id} is out of range"))
        })?;
        if let Some(h) = slot {
            return Ok(h.clone_ref(py));
        }
        let h = Py::new(
            py,
            PyKVCacheBlock {
                block_id: id,
                core: slf.clone().unbind(),
                host,
            },
        )?;
        *slot = Some(h.clone_ref(py));
        Ok(h)
    }

    /// Handles of `ids` of one pool, as a list.
    pub(crate) fn pool_handles_list<'py>(
        slf: &Bound<'py, Self>,
        this: &mut Self,
        ids: &[BlockId],
        host: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(slf.py());
        for &id in ids {
            list.append(Self::pool_handle(slf, this, id, host)?)?;
        }
        Ok(list)
    }

    /// Block handles of group `g`'s `ids` as a list (for `KVCacheBlocks.blocks`).
    pub(crate) fn handles_for<'py>(
        slf: &Bound<'py, Self>,
        g: usize,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyList>> {
        let mut this = slf.try_borrow_mut()?;
        let host = this.core.host_group() == Some(g);
        Self::pool_handles_list(slf, &mut this, ids, host)
    }

    fn bindings(&self) -> PyResult<&VllmBindings> {
        self.vllm.as_ref().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err(
                "KVCacheCore: _bind_vllm() was not called (use hscache.vllm.KVCacheManager)",
            )
        })
    }

    /// `[RequestStatus.WAITING, RequestStatus.PREEMPTED]` where an `allocate_slots`
    /// call's watermark may apply (other requests scheduled, and a watermark), which
    /// is when the core reads a request's status; None otherwise. A bare core (no
    /// vLLM bindings) is refused.
    pub(crate) fn watermark_statuses<'py>(
        slf: &Bound<'py, Self>,
        has_scheduled_reqs: bool,
    ) -> PyResult<Option<[Bound<'py, PyAny>; 2]>> {
        let this = slf.try_borrow()?;
        let [w, p] = &this.bindings()?.statuses;
        Ok(
            (has_scheduled_reqs && this.core.config().watermark_blocks > 0)
                .then(|| [w.bind(slf.py()).clone(), p.bind(slf.py()).clone()]),
        )
    }

    /// The empty singleton.
    pub(crate) fn empty_blocks<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<Bound<'py, PyKVCacheBlocks>> {
        let this = slf.try_borrow()?;
        Ok(this
            .bindings()?
            .empty_kv_cache_blocks
            .bind(slf.py())
            .clone())
    }

    /// `KVCacheBlocks` of the grouped `ids`, or the empty singleton when every
    /// group is empty (vLLM's `create_kv_cache_blocks`).
    pub(crate) fn kv_cache_blocks<'py>(
        slf: &Bound<'py, Self>,
        grouped: GroupedBlocks<'_>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if grouped.ids.is_empty() {
            return Ok(Self::empty_blocks(slf)?.into_any());
        }
        let blocks = PyKVCacheBlocks::new(
            slf.clone().unbind(),
            grouped.ids.to_vec(),
            grouped.ends.into(),
        );
        Ok(Bound::new(slf.py(), blocks)?.into_any())
    }

    /// `KVCacheBlocks` of per-group lists.
    pub(crate) fn kv_cache_blocks_of<'py>(
        slf: &Bound<'py, Self>,
        groups: &[Vec<BlockId>],
    ) -> PyResult<Bound<'py, PyAny>> {
        let grouped: GroupedBlockIds = groups.iter().map(Vec::as_slice).collect();
        Self::kv_cache_blocks(slf, grouped.view())
    }

    /// Builds the events the core recorded (vLLM's structs, with `request` for
    /// stored ranges, as vLLM's `BlockPool` builds them inside the call) and
    /// replays the recorded block-metrics calls on the collector. HiSparse
    /// publications the call made belong to `request`; events of the host pool are
    /// built by the host builder, from their publication's request.
    pub(crate) fn flush(slf: &Bound<'_, Self>, request: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        // One piece: the compactor taken out in the first borrow must be put back at
        // the end with no early return between; one body keeps that pairing in view.
        let py = slf.py();
        type Record = (crate::events::KVCacheEvent, Option<Py<PyAny>>, bool);
        let (sink, host_builder, records, collector, ops, released, mut compactor, specs) = {
            let mut this = slf.try_borrow_mut()?;
            let (made, released) = this.core.take_publication_changes().unwrap_or_default();
            if let Some(req) = request {
                for id in made {
                    this.publications.insert(id, req.clone().unbind());
                }
            }
            let pool = this.core.block_pool();
            if !pool.has_events() && !pool.has_metrics_ops() {
                for id in released {
                    this.publications.remove(&id);
                }
                return Ok(());
            }
            let Some(vllm) = this.vllm.as_ref() else {
                // A bare core keeps its records for `core_take_events`.
                return Ok(());
            };
            let sink = vllm
                .event_sink
                .as_ref()
                .map(|(s, b)| (s.clone_ref(py), b.clone_ref(py)));
            let host_builder = vllm.host_event_builder.as_ref().map(|b| b.clone_ref(py));
            let specs = vllm.spec_table.as_ref().map(|t| t.bind(py));
            let collector = vllm.metrics_collector.as_ref().map(|c| c.clone_ref(py));
            let mut records: Vec<Record> = Vec::new();
            if sink.is_some() {
                for e in this.core.take_events() {
                    records.push(match e {
                        crate::events::KVCacheEvent::Host { event, publication } => {
                            let req = publication
                                .and_then(|id| this.publications.get(&id))
                                .map(|r| r.clone_ref(py));
                            (*event, req, true)
                        }
                        other => (other, None, false),
                    });
                }
            }
            let ops = if collector.is_some() {
                this.core.take_metrics_ops()
            } else {
                Vec::new()
            };
            // Compact mode: taken for the build, put back below.
            let compactor = if records.is_empty() {
                None
            } else {
                this.compactor.take()
            };
            (
                sink,
                host_builder,
                records,
                collector,
                ops,
                released,
                compactor,
                specs,
            )
        };
        // No early return until the compactor is back.
        let replayed = match collector {
            Some(collector) => Self::replay_metrics(slf, collector.bind(py), ops),
            None => Ok(()),
        };
        let mut missed_specs = false;
        let built = replayed.and_then(|()| match sink {
            Some((sink, builder)) => {
                let sink = sink.bind(py);
                let mut memo = StoredMemo::new(specs);
                let built = records.into_iter().try_for_each(|(record, req, host)| {
                    let builder = match (&host_builder, host) {
                        (Some(b), true) => b.get(),
                        _ => builder.get(),
                    };
                    let req = req.as_ref().map(|r| r.bind(py).clone());
                    let request = req.as_ref().or(request);
                    builder.push(py, sink, compactor.as_mut(), record, request, &mut memo)
                });
                missed_specs = memo.missed_specs();
                built
            }
            None => Ok(()),
        });
        if missed_specs {
            // An event outside the table: the next take runs vLLM's loop.
            let mut this = slf.try_borrow_mut()?;
            if let Some(t) = this.vllm.as_mut().and_then(|v| v.spec_table.as_mut()) {
                t.invalidate();
            }
        }
        if compactor.is_some() || !released.is_empty() {
            let mut this = slf.try_borrow_mut()?;
            if let Some(c) = compactor {
                // After a failed build the sink's tail is not known: start afresh.
                this.compactor = Some(if built.is_ok() {
                    c
                } else {
                    Compactor::default()
                });
            }
            for id in released {
                this.publications.remove(&id);
            }
        }
        built
    }

    /// Selects the KV-event stream: `"vllm"` (vLLM's events, the default) or
    /// `"compact"` (consecutive events of one batch coalesced,
    /// `crate::events::compact`).
    pub(crate) fn set_kv_events_mode(&mut self, mode: EventsMode) {
        self.compactor = match mode {
            EventsMode::Vllm => None,
            EventsMode::Compact => Some(self.compactor.take().unwrap_or_default()),
        };
    }

    /// The event sink (vLLM's `kv_event_queue`), None with events off. A reader
    /// of the list may change it, so its last event can no longer be continued
    /// (compact mode), and it sees vLLM's pool's events: un-annotated (the spec
    /// table is dropped, its events reset, until the next manager `take_events`).
    pub(crate) fn event_queue<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(vllm) = self.vllm.as_mut() else {
            return Ok(None);
        };
        let Some((sink, builder)) = vllm.event_sink.as_ref() else {
            return Ok(None);
        };
        let sink = sink.bind(py).clone();
        if let Some(c) = &mut self.compactor {
            c.release();
        }
        if vllm.spec_table.take().is_some() {
            clear_specs(&sink, &builder.get().block_stored_class(py))?;
        }
        Ok(Some(sink))
    }

    /// Makes `queue` the event sink (`kv_event_queue = queue`); false with events
    /// off (no sink). The caller's list holds plain events: no spec table.
    pub(crate) fn set_event_queue(&mut self, queue: Bound<'_, PyList>) -> bool {
        let Some(vllm) = self.vllm.as_mut() else {
            return false;
        };
        let Some((sink, _)) = vllm.event_sink.as_mut() else {
            return false;
        };
        *sink = queue.unbind();
        vllm.spec_table = None;
        if let Some(c) = &mut self.compactor {
            c.release();
        }
        true
    }

    /// vLLM's `BlockPool.take_events`: [`Self::take_event_queue`]'s list with its
    /// events un-annotated, as vLLM's pool returns them; the spec table stays in
    /// force for the fresh sink.
    pub(crate) fn take_pool_event_queue<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, PyList>> {
        let events = self.take_event_queue(py);
        if let Some(vllm) = &self.vllm {
            if let (Some(_), Some((_, builder))) = (&vllm.spec_table, &vllm.event_sink) {
                clear_specs(&events, &builder.get().block_stored_class(py))?;
            }
        }
        Ok(events)
    }

    /// The queued events (the sink itself, replaced by a fresh list), an empty
    /// list when none are queued or events are off; annotated or not as the spec
    /// table says (the manager's `take_events` reads it).
    pub(crate) fn take_event_queue<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyList> {
        let Some((sink, _)) = self.vllm.as_mut().and_then(|v| v.event_sink.as_mut()) else {
            return PyList::empty(py);
        };
        if sink.bind(py).is_empty() {
            return PyList::empty(py);
        }
        let taken = std::mem::replace(sink, PyList::empty(py).unbind());
        if let Some(c) = &mut self.compactor {
            c.release();
        }
        taken.into_bound(py)
    }

    /// The spec table in force: `None` without one (plain events), `Some(None)`
    /// when its annotation is not vLLM's for any metadata (an event fell outside
    /// it), else `Some(Some(m))`, `m` the metadata tuple it was made from.
    pub(crate) fn spec_table_state<'py>(
        &self,
        py: Python<'py>,
    ) -> Option<Option<Bound<'py, PyAny>>> {
        let table = self.vllm.as_ref()?.spec_table.as_ref()?;
        Some(table.metadata(py))
    }

    /// Makes the spec table of `metadata` the one in force for the (fresh) sink, or
    /// none where `metadata` cannot make one; nothing changes when the builders
    /// cannot annotate, or when events were queued since the take (they carry the
    /// annotation in force).
    pub(crate) fn install_spec_table(&mut self, py: Python<'_>, metadata: &Bound<'_, PyAny>) {
        let num_groups = self.core.num_kv_cache_groups();
        let Some(vllm) = self.vllm.as_mut() else {
            return;
        };
        let Some((sink, _)) = vllm.event_sink.as_ref() else {
            return;
        };
        if !vllm.annotates || !sink.bind(py).is_empty() {
            return;
        }
        vllm.spec_table = SpecTable::of(metadata, num_groups);
    }

    /// Whether KV events are on (an event sink is bound).
    pub(crate) fn has_event_sink(&self) -> bool {
        self.vllm.as_ref().is_some_and(|v| v.event_sink.is_some())
    }

    /// The event builder's `BlockStored` class (events on).
    pub(crate) fn block_stored_class<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        let (_, builder) = self.vllm.as_ref()?.event_sink.as_ref()?;
        Some(builder.get().block_stored_class(py))
    }

    pub(crate) fn kv_events_mode_of(&self) -> EventsMode {
        if self.compactor.is_some() {
            EventsMode::Compact
        } else {
            EventsMode::Vllm
        }
    }

    /// With KV events on, a request the manager does not hold yet has its
    /// `BlockStored` event over its hashed blocks checked *before* anything is
    /// allocated (`EventBuilder::dry_run`: the request's fields are read and its
    /// extra keys made, as the build would): a request the event builder cannot
    /// describe (malformed multimodal features, a LoRA request without
    /// `adapter_id`) then raises with the manager unchanged, instead of after its
    /// blocks were cached (check before mutate). Run by the core
    /// (`RequestLike::check_before_changes`) once the call may fit: an admission
    /// refused for lack of free blocks returns None without it, as vLLM's does
    /// (vLLM builds events only for blocks it caches). Each call that may fit while
    /// the request is not held yet, events on only.
    fn precheck_events(
        request: &Bound<'_, PyAny>,
        builder: &PyEventBuilder,
        hash_block_size: usize,
    ) -> PyResult<()> {
        let py = request.py();
        let hashes = request.getattr(pyo3::intern!(py, "block_hashes"))?;
        let n = hashes.len()?;
        if n == 0 {
            return Ok(());
        }
        builder.dry_run(request, n, hash_block_size).map_err(|e| {
            let typed = InvalidArgumentError::new_err(format!(
                "KV events cannot describe this request's blocks (nothing was \
                     allocated): {e}"
            ));
            typed.set_cause(py, Some(e));
            typed
        })
    }

    fn replay_metrics(
        slf: &Bound<'_, Self>,
        collector: &Bound<'_, PyAny>,
        ops: Vec<MetricsOp>,
    ) -> PyResult<()> {
        let py = slf.py();
        for op in ops {
            match op {
                MetricsOp::Allocated(b) | MetricsOp::Accessed(b) | MetricsOp::Evicted(b) => {
                    let handle = {
                        let mut this = slf.try_borrow_mut()?;
                        Self::handle(slf, &mut this, b)?
                    };
                    let name = match op {
                        MetricsOp::Allocated(_) => intern!(py, "on_block_allocated"),
                        MetricsOp::Accessed(_) => intern!(py, "on_block_accessed"),
                        _ => intern!(py, "on_block_evicted"),
                    };
                    collector.call_method1(name, (handle,))?;
                }
                MetricsOp::Reset => {
                    collector.call_method0(intern!(py, "reset"))?;
                }
            }
        }
        Ok(())
    }

    /// The event builder and hash block size when `allocate_slots` must run
    /// [`Self::precheck_events`]: KV events on, caching on, and a request the
    /// manager does not hold yet.
    fn event_precheck(&self, request_id: &str) -> Option<(&Py<PyEventBuilder>, usize)> {
        let (_, builder) = self.vllm.as_ref()?.event_sink.as_ref()?;
        (self.core.enable_caching() && self.core.coordinator().request(request_id).is_none())
            .then(|| (builder, self.core.coordinator().hash_block_size()))
    }

    /// The core's `allocate_slots` into the scratch buffers (taken out), with the
    /// request's KV-event precheck: `(result, ids, ends, flush)`, `flush` when the call
    /// recorded events, metrics calls or publications.
    fn run_allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        id: &str,
        statuses: Option<[Bound<'py, PyAny>; 2]>,
        args: &AllocateSlots<'_>,
    ) -> PyResult<Allocated> {
        let mut this = slf.try_borrow_mut()?;
        // Run by the core once the call may fit, before it changes anything (a
        // refused admission builds nothing of its events).
        let precheck = this
            .event_precheck(id)
            .map(|(b, hash_block_size)| (b.clone_ref(slf.py()), hash_block_size));
        let check = || match &precheck {
            Some((builder, hash_block_size)) => {
                Self::precheck_events(request, builder.get(), *hash_block_size)
            }
            None => Ok(()),
        };
        let req = PyRequest::read(
            request,
            id,
            statuses
                .as_ref()
                .map(|[waiting, preempted]| StatusObjects { waiting, preempted }),
        )?;
        let req = if precheck.is_some() {
            req.with_precheck(&check)
        } else {
            req
        };
        let mut ids = std::mem::take(&mut this.scratch);
        let mut ends = std::mem::take(&mut this.scratch_ends);
        ids.clear();
        ends.clear();
        let result = this
            .core
            .shielded("allocate_slots", |c| {
                c.allocate_slots(&req, args, &mut ids, &mut ends)
            })
            .map_err(|e| req.error(e));
        let pool = this.core.block_pool();
        let flush =
            pool.has_events() || pool.has_metrics_ops() || this.core.has_publication_changes();
        Ok((result, ids, ends, flush))
    }

    /// [`Self::run_allocate_slots`]'s result for Python: the new blocks as
    /// `KVCacheBlocks` (None when they do not fit), the scratch buffers put back,
    /// then the call's events flushed.
    fn allocated_blocks<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        result: PyResult<bool>,
        ids: Vec<BlockId>,
        ends: SmallVec<[usize; 4]>,
        flush: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        // New blocks become a `KVCacheBlocks` (no borrow needed); no new blocks (the
        // steady step) is the empty singleton, taken with the borrow that puts the
        // scratch buffers back.
        let fits_in_place = matches!(result, Ok(true)) && ids.is_empty();
        let out = match result {
            Ok(true) if !fits_in_place => Self::kv_cache_blocks(
                slf,
                GroupedBlocks {
                    ids: &ids,
                    ends: &ends,
                },
            )
            .map(Some),
            Ok(_) => Ok(None),
            Err(e) => Err(e),
        };
        let out = {
            let mut this = slf.try_borrow_mut()?;
            this.scratch = ids;
            this.scratch_ends = ends;
            if fits_in_place {
                let empty = this
                    .bindings()?
                    .empty_kv_cache_blocks
                    .bind(slf.py())
                    .clone();
                Ok(Some(empty.into_any()))
            } else {
                out
            }
        };
        if flush {
            Self::flush(slf, Some(request))?;
        }
        out
    }

    /// `get_computed_blocks` / `..._for_connector`: `(blocks, hit, boundary, diverged)`.
    fn lookup<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        max_cache_hit_length: Option<Int>,
        for_connector: bool,
    ) -> PyResult<(Bound<'py, PyAny>, usize, usize, bool)> {
        let max_len = max_cache_hit_length
            .map(|n| count_arg("max_cache_hit_length", n))
            .transpose()?;
        let id = request_id(request)?;
        let req = PyRequest::read(request, id.to_str()?, None)?;
        let report_full = || req.report_mode_full();
        let (result, groups) = {
            let mut this = slf.try_borrow_mut()?;
            let mut groups = vec![Vec::new(); this.core.num_kv_cache_groups()];
            let r = if for_connector {
                this.core
                    .shielded("get_computed_blocks_for_connector", |c| {
                        c.get_computed_blocks_for_connector(
                            &req,
                            max_len,
                            &report_full,
                            &mut groups,
                        )
                    })
            } else {
                this.core
                    .shielded("get_computed_blocks", |c| {
                        c.get_computed_blocks(&req, max_len, &report_full, &mut groups)
                    })
                    .map(|(hit, spb)| (hit, spb, false))
            };
            (r, groups)
        };
        let (hit, boundary, diverged) = result.map_err(|e| req.error(e))?;
        Self::flush(slf, Some(request))?;
        Ok((
            Self::kv_cache_blocks_of(slf, &groups)?,
            hit,
            boundary,
            diverged,
        ))
    }
}

impl PyKVCacheCore {
    /// A block's neighbor in the free queue (see `KVCacheBlock.next_free_block`).
    pub(crate) fn free_list_neighbor(
        slf: &Bound<'_, Self>,
        block_id: BlockId,
        host: bool,
        prev: bool,
    ) -> PyResult<Option<Py<PyAny>>> {
        let neighbors = {
            let this = slf.try_borrow()?;
            let pool = if host {
                this.core.host_pool()
            } else {
                Some(this.core.block_pool())
            };
            pool.and_then(|p| p.free_block_queue().neighbors(block_id))
        };
        match neighbors {
            None => Ok(None),
            Some((p, n)) if host => {
                // The host pool's queue ends have no sentinel objects.
                let Some(id) = (if prev { p } else { n }) else {
                    return Ok(None);
                };
                let mut this = slf.try_borrow_mut()?;
                Ok(Some(
                    Self::pool_handle(slf, &mut this, id, true)?.into_any(),
                ))
            }
            Some((p, n)) => Self::link_target(slf, if prev { p } else { n }, !prev),
        }
    }

    /// A block handle, or the tail (`to_tail`) / head sentinel for `None`.
    pub(crate) fn link_target(
        slf: &Bound<'_, Self>,
        id: Option<BlockId>,
        to_tail: bool,
    ) -> PyResult<Option<Py<PyAny>>> {
        let py = slf.py();
        match id {
            Some(id) => {
                let mut this = slf.try_borrow_mut()?;
                Ok(Some(Self::handle(slf, &mut this, id)?.into_any()))
            }
            None => {
                let this = slf.try_borrow()?;
                Ok(this
                    .bindings()?
                    .free_list_sentinels
                    .as_ref()
                    .map(|s| s[usize::from(to_tail)].clone_ref(py)))
            }
        }
    }
}

#[pymethods]
impl PyKVCacheCore {
    #[new]
    #[pyo3(signature = (*, num_blocks: "int", groups: "list[dict[str, Any]]", max_model_len: "int", scheduler_block_size: "int", hash_block_size: "int", enable_caching=true, enable_kv_cache_events=false, use_eagle=false, watermark_blocks: "int"=0, num_hash_lookahead_tokens: "int"=0, num_prefill_lookahead: "int"=0, dcp_world_size: "int"=1, pcp_world_size: "int"=1, needs_kv_cache_zeroing=false, retention_interval: "int | None"=None, collect_metrics=false, enable_mamba_shared_prefix_checkpoint=false, vllm_series="0.33"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: Int,
        groups: &Bound<'_, PyList>,
        max_model_len: Int,
        scheduler_block_size: Int,
        hash_block_size: Int,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        use_eagle: bool,
        #[pyo3(from_py_with = int64)] watermark_blocks: i64,
        #[pyo3(from_py_with = int64)] num_hash_lookahead_tokens: i64,
        #[pyo3(from_py_with = int64)] num_prefill_lookahead: i64,
        #[pyo3(from_py_with = int64)] dcp_world_size: i64,
        #[pyo3(from_py_with = int64)] pcp_world_size: i64,
        needs_kv_cache_zeroing: bool,
        retention_interval: Option<Int>,
        collect_metrics: bool,
        enable_mamba_shared_prefix_checkpoint: bool,
        vllm_series: &str,
    ) -> PyResult<Self> {
        let num_blocks = u32::try_from(count_arg("num_blocks", num_blocks)?)
            .map_err(|_| InvalidArgumentError::new_err("num_blocks is too large"))?;
        let groups = groups
            .iter()
            .map(|g| group_spec(g.cast::<PyDict>()?))
            .collect::<PyResult<Vec<_>>>()?;
        let rules = VllmRules::for_series(vllm_series)?;
        let mut core = KVCacheManager::new(KVCacheManagerConfig {
            coordinator: CoordinatorConfig {
                num_blocks,
                groups,
                use_eagle,
                enable_caching,
                enable_kv_cache_events,
                dcp_world_size: count("dcp_world_size", dcp_world_size)?,
                pcp_world_size: count("pcp_world_size", pcp_world_size)?,
                scheduler_block_size: count_arg("scheduler_block_size", scheduler_block_size)?,
                hash_block_size: count_arg("hash_block_size", hash_block_size)?,
                collect_metrics,
                num_hash_lookahead_tokens: count(
                    "num_hash_lookahead_tokens",
                    num_hash_lookahead_tokens,
                )?,
                num_prefill_lookahead: count("num_prefill_lookahead", num_prefill_lookahead)?,
                retention_interval: retention_interval
                    .map(|r| count_arg("prefix_cache_retention_interval", r))
                    .transpose()?,
                needs_kv_cache_zeroing,
                allow_partial_hash_hits: true,
            },
            max_model_len: count_arg("max_model_len", max_model_len)?,
            watermark_blocks: count("watermark_blocks", watermark_blocks)?,
            enable_mamba_shared_prefix_checkpoint,
        })?;
        core.set_vllm_rules(rules)?;
        let num_host_blocks = core
            .host_pool()
            .map_or(0, super::super::pool::BlockPool::num_gpu_blocks);
        Ok(Self {
            core,
            handles: (0..num_blocks).map(|_| None).collect(),
            host_handles: (0..num_host_blocks).map(|_| None).collect(),
            publications: rustc_hash::FxHashMap::default(),
            scratch: Vec::new(),
            scratch_ends: SmallVec::new(),
            vllm: None,
            compactor: None,
            prefix_stats: PrefixStats::default(),
        })
    }

    /// Hands the core the vLLM objects its drop-in methods compare with and call.
    /// `event_sink`: `(list, EventBuilder)` with events on: each call's events are
    /// built and appended to the list before it returns; `host_event_builder`
    /// builds the events of HiSparse's host pool.
    #[pyo3(signature = (waiting, preempted, event_sink: "tuple[list[Any], EventBuilder] | None"=None, metrics_collector=None, host_event_builder=None))]
    fn _bind_vllm(
        slf: &Bound<'_, Self>,
        waiting: Bound<'_, PyAny>,
        preempted: Bound<'_, PyAny>,
        event_sink: Option<(Bound<'_, PyList>, Bound<'_, PyEventBuilder>)>,
        metrics_collector: Option<Bound<'_, PyAny>>,
        host_event_builder: Option<Bound<'_, PyEventBuilder>>,
    ) -> PyResult<()> {
        let n = slf.try_borrow()?.core.num_kv_cache_groups();
        let empty = Py::new(
            slf.py(),
            PyKVCacheBlocks::empty_singleton(slf.clone().unbind(), n),
        )?;
        slf.try_borrow_mut()?.vllm = Some(VllmBindings {
            empty_kv_cache_blocks: empty,
            statuses: [waiting.unbind(), preempted.unbind()],
            spec_table: None,
            annotates: event_sink.as_ref().is_some_and(|(_, b)| {
                let b = b.get();
                b.annotates()
                    && host_event_builder.as_ref().is_none_or(|h| {
                        let py = h.py();
                        h.get().block_stored_class(py).is(b.block_stored_class(py))
                    })
            }),
            event_sink: event_sink.map(|(s, b)| (s.unbind(), b.unbind())),
            host_event_builder: host_event_builder.map(Bound::unbind),
            metrics_collector: metrics_collector.map(Bound::unbind),
            free_list_sentinels: None,
        });
        Ok(())
    }

    /// Hands the core the free queue's head and tail sentinel objects.
    fn _bind_free_list_sentinels(&mut self, head: Py<PyAny>, tail: Py<PyAny>) -> PyResult<()> {
        let vllm = self.vllm.as_mut().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("_bind_vllm() must come first")
        })?;
        vllm.free_list_sentinels = Some([head, tail]);
        Ok(())
    }

    // ---- vLLM's KVCacheManager interface (hot paths) -------------------------------

    /// The empty `KVCacheBlocks` singleton (the Scheduler hands it back as "no hit").
    #[getter]
    fn empty_kv_cache_blocks(&self, py: Python<'_>) -> PyResult<Py<PyKVCacheBlocks>> {
        Ok(self.bindings()?.empty_kv_cache_blocks.clone_ref(py))
    }

    /// KV-cache usage in [0, 1], null block excluded.
    #[getter]
    fn usage(&self) -> PyResult<f64> {
        self.core.read("usage", |c| Ok(c.usage()))
    }

    /// How many `allocate_slots` calls the steady decode step decided (one table
    /// lookup instead of vLLM's stages).
    #[getter]
    fn num_steady_steps(&self) -> u64 {
        self.core.num_steady_steps()
    }

    /// Why the manager refuses every call, if an internal error poisoned it.
    #[getter]
    fn poisoned(&self) -> Option<String> {
        self.core.poisoned().map(str::to_owned)
    }

    /// vLLM's `prefix_cache_lookup_enabled`.
    fn prefix_cache_lookup_enabled(&self, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = request_id(request)?;
        let req = PyRequest::read(request, id.to_str()?, None)?;
        self.core.read("prefix_cache_lookup_enabled", |c| {
            c.prefix_cache_lookup_enabled(&req)
                .map_err(|e| req.error(e))
        })
    }

    /// vLLM's `get_computed_blocks`: `(KVCacheBlocks, num_hit_tokens,
    /// shared_prefix_boundary)`.
    #[pyo3(signature = (request, max_cache_hit_length: "int | None"=None))]
    fn get_computed_blocks<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        max_cache_hit_length: Option<Int>,
    ) -> PyResult<(Bound<'py, PyAny>, usize, usize)> {
        let _timer = stats::Timer::start(Op::GetComputedBlocks);
        let (blocks, hit, boundary, _) = Self::lookup(slf, request, max_cache_hit_length, false)?;
        Ok((blocks, hit, boundary))
    }

    /// vLLM's `get_computed_blocks_for_connector`: the lookup plus `hit_diverged`.
    #[pyo3(signature = (request, max_cache_hit_length: "int | None"=None))]
    fn get_computed_blocks_for_connector<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        max_cache_hit_length: Option<Int>,
    ) -> PyResult<(Bound<'py, PyAny>, usize, usize, bool)> {
        Self::lookup(slf, request, max_cache_hit_length, true)
    }

    /// vLLM's `allocate_slots`: the newly allocated blocks as `KVCacheBlocks`, or
    /// None when they do not fit (hit blocks are then left untouched).
    #[pyo3(signature = (request, num_new_tokens: "int", num_new_computed_tokens: "int"=0, new_computed_blocks=None, num_lookahead_tokens: "int"=0, num_external_computed_tokens: "int"=0, delay_cache_blocks=false, num_encoder_tokens: "int"=0, full_sequence_must_fit=false, reserved_blocks: "int"=0, has_scheduled_reqs=true, skip_zeroing_group_ids: "Iterable[int] | None"=None))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: Int,
        #[pyo3(from_py_with = int64)] num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = int64)] num_lookahead_tokens: i64,
        #[pyo3(from_py_with = int64)] num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        #[pyo3(from_py_with = int64)] num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        #[pyo3(from_py_with = int64)] reserved_blocks: i64,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let _timer = stats::Timer::start(Op::AllocateSlots);
        // The status is read only for the watermark, which applies only when there is
        // one and other requests are scheduled. A bare core (no vLLM bindings) cannot
        // build the result: it is refused here, before anything changes.
        let statuses = Self::watermark_statuses(slf, has_scheduled_reqs)?;
        let mut hits = GroupedBlockIds::new();
        let adopt_hits = match new_computed_blocks {
            Some(blocks) => {
                let empty = Self::empty_blocks(slf)?;
                hit_ids(slf, &empty, blocks, &mut hits)?
            }
            None => false,
        };
        // Group ids to skip: vLLM tests membership in a set, so an id that names no
        // group (a negative one too) matches nothing; only non-ints are refused.
        let mut skip_zeroing: SmallVec<[u32; 4]> = SmallVec::new();
        if let Some(ids) = skip_zeroing_group_ids {
            for g in ids.try_iter()? {
                if let Ok(g) = u32::try_from(g?.extract::<Int>()?.0) {
                    skip_zeroing.push(g);
                }
            }
        }
        let args = AllocateSlots {
            num_new_tokens: count_arg("num_new_tokens", num_new_tokens)?,
            num_new_computed_tokens: count("num_new_computed_tokens", num_new_computed_tokens)?,
            new_computed_blocks: adopt_hits.then_some(hits.view()),
            num_lookahead_tokens: count("num_lookahead_tokens", num_lookahead_tokens)?,
            num_external_computed_tokens: count(
                "num_external_computed_tokens",
                num_external_computed_tokens,
            )?,
            delay_cache_blocks,
            num_encoder_tokens: count("num_encoder_tokens", num_encoder_tokens)?,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids: &skip_zeroing,
        };
        let id = request_id(request)?;
        let id = id.to_str()?;
        let (result, ids, ends, flush) =
            Self::run_allocate_slots(slf, request, id, statuses, &args)?;
        Self::allocated_blocks(slf, request, result, ids, ends, flush)
    }

    /// vLLM's `cache_blocks`: caches the request's full blocks up to
    /// `num_computed_tokens`.
    #[pyo3(signature = (request, num_computed_tokens: "int"))]
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: Int,
    ) -> PyResult<()> {
        let _timer = stats::Timer::start(Op::CacheBlocks);
        let n = count_arg("num_computed_tokens", num_computed_tokens)?;
        let result = {
            let mut this = slf.try_borrow_mut()?;
            let id = request_id(request)?;
            let req = PyRequest::read(request, id.to_str()?, None)?;
            this.core
                .shielded("cache_blocks", |c| c.cache_blocks(&req, n))
                .map_err(|e| req.error(e))
        };
        result?;
        Self::flush(slf, Some(request))
    }

    /// vLLM's `free`: frees the request's blocks, tail first (no-op for a request
    /// without blocks).
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let _timer = stats::Timer::start(Op::Free);
        let rid = request_id(request)?;
        Self::core_free(slf, rid.to_str()?)
    }

    /// vLLM's `coordinator.free(request_id)`.
    fn core_free(slf: &Bound<'_, Self>, request_id: &str) -> PyResult<()> {
        {
            let mut this = slf.try_borrow_mut()?;
            let this = &mut *this;
            let oracle =
                super::convert::publications::Publications::new(slf.py(), &this.publications);
            this.core
                .shielded("free", |c| c.free_with(request_id, &oracle))
                .map_err(|e| oracle.error(e))?;
        }
        Self::flush(slf, None)
    }

    /// vLLM's `pop_blocks_for_free`: the request's blocks in allocation order, not
    /// yet freed (the caller frees them, reversed, through the block pool).
    #[pyo3(signature = (request) -> "list[KVCacheBlock]")]
    fn pop_blocks_for_free<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let _timer = stats::Timer::start(Op::PopBlocksForFree);
        let rid = request_id(request)?;
        let list = {
            let mut this = slf.try_borrow_mut()?;
            let mut ids = std::mem::take(&mut this.scratch);
            ids.clear();
            let r = {
                let this = &mut *this;
                let oracle =
                    super::convert::publications::Publications::new(slf.py(), &this.publications);
                let rid = rid.to_str()?;
                this.core
                    .shielded("pop_blocks_for_free", |c| {
                        c.pop_blocks_for_free_with(rid, &mut ids, &oracle)
                    })
                    .map_err(|e| oracle.error(e))
            };
            let result = r.and_then(|host| {
                let host = host.unwrap_or(0..0);
                let list = PyList::empty(slf.py());
                for (i, &id) in ids.iter().enumerate() {
                    list.append(Self::pool_handle(slf, &mut this, id, host.contains(&i))?)?;
                }
                Ok(list)
            });
            this.scratch = ids;
            result?
        };
        Self::flush(slf, None)?;
        Ok(list)
    }

    /// vLLM's `get_blocks`: the request's tables as `KVCacheBlocks`.
    fn get_blocks<'py>(slf: &Bound<'py, Self>, request_id: &str) -> PyResult<Bound<'py, PyAny>> {
        let _timer = stats::Timer::start(Op::GetBlocks);
        let grouped = {
            let this = slf.try_borrow()?;
            this.core.read("get_blocks", |c| {
                let grouped: GroupedBlockIds = (0..c.num_kv_cache_groups())
                    .map(|g| c.get_blocks(request_id, g))
                    .collect();
                Ok::<_, PyErr>(grouped)
            })?
        };
        Self::kv_cache_blocks(slf, grouped.view())
    }

    /// vLLM's `get_block_ids`: one id list per group.
    #[pyo3(signature = (request_id) -> "tuple[list[int], ...]")]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyTuple>> {
        self.core.read("get_block_ids", |c| {
            let lists = (0..c.num_kv_cache_groups())
                .map(|g| PyList::new(py, c.get_blocks(request_id, g)))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, lists)
        })
    }

    /// vLLM's `get_block_ids_for_computed_tokens`.
    #[pyo3(signature = (request_id, num_computed_tokens: "int") -> "tuple[list[int], ...]")]
    fn get_block_ids_for_computed_tokens<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        num_computed_tokens: Int,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let n = count_arg("num_computed_tokens", num_computed_tokens)?;
        self.core.read("get_block_ids_for_computed_tokens", |c| {
            let lists = (0..c.num_kv_cache_groups())
                .map(|g| PyList::new(py, c.block_ids_for_computed_tokens(request_id, g, n)))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, lists)
        })
    }

    /// vLLM's `estimate_cached_tokens`.
    fn estimate_cached_tokens(&self, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        let rid = request_id(request)?;
        let rid = rid.to_str()?;
        self.core.read("estimate_cached_tokens", |c| {
            Ok(c.estimate_cached_tokens(rid))
        })
    }

    /// vLLM 0.30 / 0.31's `get_num_common_prefix_blocks`: per group, the leading blocks
    /// of the request's table that every request holding a table shares (the glue
    /// answers `[0]` per group for the releases that deprecated it).
    fn num_common_prefix_blocks(
        slf: &Bound<'_, Self>,
        running_request_id: &str,
    ) -> PyResult<Vec<usize>> {
        let mut out = Vec::new();
        slf.try_borrow_mut()?
            .core
            .shielded("get_num_common_prefix_blocks", |c| {
                c.num_common_prefix_blocks(running_request_id, &mut out);
                Ok(())
            })?;
        Ok(out)
    }

    /// vLLM's `remove_skipped_blocks`.
    #[pyo3(signature = (request_id, processed_computed_tokens: "int", num_prompt_tokens: "int | None"=None))]
    fn remove_skipped_blocks(
        slf: &Bound<'_, Self>,
        request_id: &str,
        processed_computed_tokens: Int,
        num_prompt_tokens: Option<Int>,
    ) -> PyResult<()> {
        let processed = count_arg("processed_computed_tokens", processed_computed_tokens)?;
        let prompt = num_prompt_tokens
            .map(|n| count_arg("num_prompt_tokens", n))
            .transpose()?;
        slf.try_borrow_mut()?
            .core
            .shielded("remove_skipped_blocks", |c| {
                c.remove_skipped_blocks(request_id, processed, prompt)
            })?;
        Self::flush(slf, None)
    }

    /// vLLM's `truncate_computed_blocks`: the lookup result cut at an aligned
    /// endpoint (pure).
    #[pyo3(signature = (blocks, num_computed_tokens: "int"))]
    fn truncate_computed_blocks<'py>(
        slf: &Bound<'py, Self>,
        blocks: &Bound<'py, PyAny>,
        num_computed_tokens: Int,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = count_arg("num_computed_tokens", num_computed_tokens)?;
        let mut given = GroupedBlockIds::new();
        grouped_ids(slf, blocks, &mut given)?;
        let mut out = Vec::new();
        let given = given.view();
        slf.try_borrow()?
            .core
            .read("truncate_computed_blocks", |c| {
                c.truncate_computed_blocks(given, n, &mut out)
            })?;
        Self::kv_cache_blocks_of(slf, &out)
    }

    /// vLLM's `new_step_starts`.
    fn new_step_starts(&mut self) -> PyResult<()> {
        Ok(self.core.shielded("new_step_starts", |c| {
            c.new_step_starts();
            Ok(())
        })?)
    }

    /// vLLM's `take_new_block_ids`: block ids recorded for worker-side zeroing.
    fn take_new_block_ids(&mut self) -> PyResult<Vec<BlockId>> {
        Ok(self
            .core
            .shielded("take_new_block_ids", |c| Ok(c.take_new_block_ids()))?)
    }

    /// vLLM's `record_blocks_for_zeroing`.
    #[pyo3(signature = (request_id, start_token: "int"))]
    fn record_blocks_for_zeroing(&mut self, request_id: &str, start_token: Int) -> PyResult<()> {
        let start = count_arg("start_token", start_token)?;
        Ok(self.core.shielded("record_blocks_for_zeroing", |c| {
            c.record_blocks_for_zeroing(request_id, start)
        })?)
    }

    /// The queued copy-on-write pairs as `(source, copy)` block handles, drained
    /// (`hscache.vllm.KVCacheManager.take_kv_cache_block_copies` wraps them).
    fn core_take_kv_cache_block_copies<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<Vec<(Py<PyKVCacheBlock>, Py<PyKVCacheBlock>)>> {
        let mut this = slf.try_borrow_mut()?;
        let pairs = this.core.shielded("take_kv_cache_block_copies", |c| {
            Ok(c.take_kv_cache_block_copies())
        })?;
        pairs
            .into_iter()
            .map(|(s, d)| {
                Ok((
                    Self::handle(slf, &mut this, s)?,
                    Self::handle(slf, &mut this, d)?,
                ))
            })
            .collect()
    }

    /// vLLM's `take_boundary_state_offloads`: `{request_id: [(group_id, block_id,
    /// boundary_tokens), ...]}`.
    #[pyo3(signature = () -> "dict[str, list[tuple[int, int, int]]]")]
    fn take_boundary_state_offloads<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let offloads = self.core.shielded("take_boundary_state_offloads", |c| {
            Ok(c.take_boundary_state_offloads())
        })?;
        for o in offloads {
            let entry = (o.group_id, o.block, o.num_tokens);
            match out.get_item(&*o.request_id)? {
                Some(list) => list.cast::<PyList>()?.append(entry)?,
                None => out.set_item(&*o.request_id, PyList::new(py, [entry])?)?,
            }
        }
        Ok(out)
    }

    /// vLLM's `finalize_partial_tail_offloads`.
    fn finalize_partial_tail_offloads(
        &mut self,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u32, BlockId, usize)>> {
        let id = request_id(request)?;
        let req = PyRequest::read(request, id.to_str()?, None)?;
        let mut out = Vec::new();
        self.core
            .shielded("finalize_partial_tail_offloads", |c| {
                c.finalize_partial_tail_offloads(&req, &mut out)
            })
            .map_err(|e| req.error(e))?;
        Ok(out)
    }

    // ---- batched calls ---------------------------------------------------------------

    /// The handle of a request that holds blocks (None otherwise), for the batched
    /// calls; valid until the request is freed.
    fn request_handle(&self, request_id: &str) -> PyResult<Option<u64>> {
        self.core
            .read("request_handle", |c| Ok(c.request_handle(request_id)))
    }

    /// One step's `allocate_slots` for running requests (see `batch.rs`):
    /// `(num_allocated, new_block_ids, offsets)` as int32 bytearrays; entry
    /// `num_allocated`, if any, did not fit and was left untouched.
    #[pyo3(signature = (requests: "list[Any]", handles: "list[int] | bytes", num_computed_tokens: "list[int] | bytes", num_new_tokens: "list[int] | bytes", num_lookahead_tokens: "int"=0))]
    fn core_allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyList>,
        handles: &Bound<'py, PyAny>,
        num_computed_tokens: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = int64)] num_lookahead_tokens: i64,
    ) -> PyResult<super::batch::BatchResult<'py>> {
        super::batch::allocate_slots_batch(
            slf,
            requests,
            handles,
            num_computed_tokens,
            num_new_tokens,
            num_lookahead_tokens,
        )
    }

    /// Frees the requests `handles` name, in order, tail first each.
    #[pyo3(signature = (handles: "list[int] | bytes"))]
    fn core_free_batch(slf: &Bound<'_, Self>, handles: &Bound<'_, PyAny>) -> PyResult<()> {
        super::batch::free_batch(slf, handles)?;
        Self::flush(slf, None)
    }

    /// Raises `InvariantError` (a RuntimeError and AssertionError) naming the first
    /// broken structural invariant.
    fn check_invariants(&self) -> PyResult<()> {
        self.core
            .check_invariants()
            .map_err(|msg| crate::error::Error::Invariant(msg).into())
    }

    /// A 64-bit hash of the pool(s), free queue order, prefix-cache index and
    /// request tables: equal before and after a call that raised.
    fn state_digest(&self) -> u64 {
        self.core.state_digest()
    }

    /// Whether every mutating call checks the invariants after it ran
    /// (`HSCACHE_CHECK_INVARIANTS=1`, or a debug build); settable.
    #[getter]
    fn get_check_invariants_after_ops(&self) -> bool {
        self.core.checks_invariants()
    }

    #[setter]
    fn set_check_invariants_after_ops(&mut self, on: bool) {
        self.core.set_check_invariants(on);
    }

    /// Test only (the `mutants` build): breaks one invariant (`hscache_tools.testing` names
    /// them); the manager must then be thrown away.
    #[cfg(feature = "mutants")]
    fn _break_invariant(&mut self, name: &str) -> PyResult<()> {
        let mutant = crate::manager::mutants::Mutant::from_name(name).ok_or_else(|| {
            InvalidArgumentError::new_err(format!("no invariant mutant {name:?}"))
        })?;
        self.core
            .break_invariant_for_tests(mutant)
            .map_err(InvalidArgumentError::new_err)
    }

    /// The names `_break_invariant` accepts.
    #[cfg(feature = "mutants")]
    #[staticmethod]
    fn _invariant_mutants() -> Vec<&'static str> {
        crate::manager::mutants::Mutant::ALL
            .iter()
            .map(|m| m.name())
            .collect()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for h in self.handles.iter().chain(&self.host_handles).flatten() {
            visit.call(h)?;
        }
        for r in self.publications.values() {
            visit.call(r)?;
        }
        if let Some(v) = &self.vllm {
            visit.call(&v.empty_kv_cache_blocks)?;
            for s in &v.statuses {
                visit.call(s)?;
            }
            if let Some((sink, builder)) = &v.event_sink {
                visit.call(sink)?;
                visit.call(builder)?;
            }
            visit.call(&v.metrics_collector)?;
            visit.call(&v.host_event_builder)?;
            if let Some(t) = &v.spec_table {
                t.traverse(&visit)?;
            }
            if let Some(s) = &v.free_list_sentinels {
                visit.call(&s[0])?;
                visit.call(&s[1])?;
            }
        }
        if let Some(c) = &self.compactor {
            c.traverse(&visit)?;
        }
        self.prefix_stats.traverse(&visit)
    }

    fn __clear__(&mut self) {
        self.handles.iter_mut().for_each(|h| *h = None);
        self.host_handles.iter_mut().for_each(|h| *h = None);
        self.publications.clear();
        self.vllm = None;
        if let Some(c) = &mut self.compactor {
            c.release();
        }
        self.prefix_stats.clear();
    }

    /// Selects the KV-event stream by name: `"vllm"` (vLLM's events, event for
    /// event; the default) or `"compact"` (consecutive events of one
    /// `take_events()` batch coalesced). Anything else is `InvalidArgumentError`,
    /// with the mode unchanged.
    fn core_set_kv_events_mode(&mut self, mode: &str) -> PyResult<()> {
        let mode = EventsMode::parse(mode)?;
        self.set_kv_events_mode(mode);
        Ok(())
    }

    /// Compact mode: the event sink was drained (`take_events`), so its last event
    /// can no longer be continued; its objects are released now rather than when
    /// the next event is recorded. A no-op in vLLM's mode.
    fn core_kv_events_drained(&mut self) {
        if let Some(c) = &mut self.compactor {
            c.release();
        }
    }

    /// Number of KV-cache groups (vLLM's `num_kv_cache_groups`).
    #[getter]
    fn num_kv_cache_groups(&self) -> PyResult<usize> {
        self.core
            .read("num_kv_cache_groups", |c| Ok(c.num_kv_cache_groups()))
    }

    /// The manager's `reset_prefix_cache`: every pool of the layout (HiSparse's host
    /// pool too), each once.
    fn core_reset_all_prefix_caches(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let ok = slf
            .try_borrow_mut()?
            .core
            .shielded("reset_prefix_cache", KVCacheManager::reset_prefix_cache)?;
        Self::flush(slf, None)?;
        Ok(ok)
    }

    /// Builds and queues the events recorded so far (pool-level calls pass no
    /// request).
    #[pyo3(signature = (request=None))]
    fn core_flush_events(slf: &Bound<'_, Self>, request: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        Self::flush(slf, request.as_ref())
    }

    /// Drains event records as tuples (a bare core without an event sink).
    #[pyo3(signature = () -> "list[tuple[Any, ...]]")]
    fn core_take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let records = self.core.shielded("take_events", |c| Ok(c.take_events()))?;
        super::events::records_to_py(py, records)
    }

    /// The KV-event stream's mode: `"vllm"` or `"compact"`.
    #[getter]
    fn kv_events_mode(&self) -> &'static str {
        PyKVCacheCore::kv_events_mode_of(self).name()
    }

    /// Turns explain mode on or off (`history_capacity`: evicted keys and cached
    /// fingerprints remembered; default 4 per block, at least 4096).
    #[pyo3(signature = (on=true, history_capacity: "int | None"=None))]
    fn core_set_explain(&mut self, on: bool, history_capacity: Option<i64>) -> PyResult<()> {
        self.core_set_explain_impl(on, history_capacity)
    }

    /// Whether explain mode is on.
    #[getter]
    fn explain_enabled(&self) -> bool {
        self.core.explain_enabled()
    }

    /// Explain mode's summary: `{"lookups": {reason: count}, "requests": n}`: every
    /// explained lookup since explain mode was turned on by reason, and how many
    /// requests' last lookups are remembered. `UnsupportedError` with explain mode off.
    #[pyo3(signature = () -> "dict[str, Any]")]
    fn core_explain_summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.core_explain_summary_impl(py)
    }

    /// The record of the request's last lookup as a dict (`hit_blocks`,
    /// `hit_tokens`, `num_full_blocks`, `num_tokens`, `reason`, `detail`,
    /// `lookup_seq`). `UnsupportedError` (a `NotImplementedError`, so a `RuntimeError`)
    /// with explain mode off, `UnknownRequestError` (a `KeyError`) for a request without
    /// an explained lookup.
    #[pyo3(signature = (request_id) -> "dict[str, Any]")]
    fn core_explain<'py>(&self, py: Python<'py>, request_id: &str) -> PyResult<Bound<'py, PyDict>> {
        self.core_explain_impl(py, request_id)
    }

    /// vLLM's `log_stats`: whether prefix-cache stats are kept.
    #[getter]
    fn get_log_stats(&self) -> bool {
        self.prefix_stats.log_stats()
    }

    #[setter]
    fn set_log_stats(&mut self, on: bool) {
        self.prefix_stats.set_log_stats(on);
    }

    /// vLLM's `prefix_cache_stats` (a `PrefixCacheStats`, or None), the counts of
    /// every admission recorded so far written in.
    #[getter]
    fn get_prefix_cache_stats(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.prefix_stats.get(py)
    }

    #[setter]
    fn set_prefix_cache_stats(&mut self, py: Python<'_>, stats: Option<Py<PyAny>>) -> PyResult<()> {
        self.prefix_stats.set(py, stats)
    }

    /// vLLM's `make_prefix_cache_stats`: None with `log_stats` off, else the stats
    /// so far, replaced by a new `PrefixCacheStats`.
    #[pyo3(signature = () -> "Any")]
    fn make_prefix_cache_stats(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.prefix_stats.make(py)
    }

    /// vLLM's `record_prefix_cache_stats`: counts an admitted request's query and
    /// hits into `prefix_cache_stats` unless stats are off or the request skipped
    /// the lookup. `num_hits` must be a non-negative int (`TypeError` /
    /// `InvalidArgumentError` otherwise, with the stats unchanged); a stats object
    /// replaced by None is `InvalidArgumentError` (vLLM asserts).
    #[pyo3(signature = (request, num_hits: "int"))]
    fn record_prefix_cache_stats(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_hits: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let pending = {
            let mut this = slf.try_borrow_mut()?;
            let enable_caching = this.core.enable_caching();
            this.prefix_stats
                .record(enable_caching, request, num_hits)?
        };
        pending.finish()
    }

    /// vLLM's `take_events`: the queued KV events (the queue is then empty), each
    /// `BlockStored` annotated with its group's `kv_cache_spec_kind` and
    /// `kv_cache_spec_sliding_window` from `kv_cache_event_metadata` (when it is
    /// still the tuple the queued events were annotated from as they were built,
    /// the list is handed over as it is).
    #[pyo3(signature = () -> "list[Any]")]
    fn take_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        Self::take_events_impl(slf)
    }

    /// The pool's event queue (vLLM's `BlockPool.kv_event_queue`), the list the
    /// core appends each call's events to, its events un-annotated as vLLM's pool
    /// queues them; None with events off.
    #[pyo3(signature = () -> "list[Any] | None")]
    fn core_kv_event_queue<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        self.event_queue(py)
    }

    /// `BlockPool.kv_event_queue = queue`: the list later events are appended to.
    /// False (nothing changed) with events off.
    #[pyo3(signature = (queue: "list[Any]"))]
    fn core_set_kv_event_queue(&mut self, queue: Bound<'_, PyList>) -> bool {
        self.set_event_queue(queue)
    }

    /// vLLM's `BlockPool.take_events`: the queued events, not annotated; the queue
    /// is then empty. An empty list with events off.
    #[pyo3(signature = () -> "list[Any]")]
    fn core_take_pool_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.take_pool_event_queue(py)
    }

    /// Selects the retention policy (`lru|priority|pin|ttl|slru`) before any block
    /// is used; unset settings keep their defaults. `manual_clock`: time moves only
    /// by `retention_advance_clock` (simulated traces, tests).
    #[pyo3(signature = (policy, *, default_priority: "int | None"=None, ttl_s: "float | None"=None, max_pinned_blocks: "int | None"=None, slru_protected_blocks: "int | None"=None, manual_clock=false))]
    fn core_set_retention(
        &mut self,
        policy: &str,
        default_priority: Option<i64>,
        ttl_s: Option<f64>,
        max_pinned_blocks: Option<i64>,
        slru_protected_blocks: Option<i64>,
        manual_clock: bool,
    ) -> PyResult<()> {
        self.core_set_retention_impl(
            policy,
            default_priority,
            ttl_s,
            max_pinned_blocks,
            slru_protected_blocks,
            manual_clock,
        )
    }

    /// The active retention policy's name.
    #[getter]
    fn retention_policy(&self) -> &'static str {
        self.core.block_pool().retention_kind().name()
    }

    /// Sets the hint the next frees apply (the glue clears it after the free).
    #[pyo3(signature = (priority: "int | None"=None, duration_s: "float | None"=None, pin=false))]
    fn core_retention_hint(
        &mut self,
        priority: Option<i64>,
        duration_s: Option<f64>,
        pin: bool,
    ) -> PyResult<()> {
        self.core_retention_hint_impl(priority, duration_s, pin)
    }

    /// `free` under a retention policy: reads the request's hints
    /// (`sampling_params.extra_args`: `hscache_priority`, `hscache_retention_s`,
    /// `hscache_pin`), frees with them, and clears them, in one call.
    fn core_free_retained(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        Self::core_free_retained_impl(slf, request)
    }

    /// Clears the free hint.
    fn core_clear_retention_hint(&mut self) -> PyResult<()> {
        self.core.block_pool_mut()?.clear_retention_hint();
        Ok(())
    }

    /// Pins the listed cached blocks (policy `pin`); returns how many are pinned.
    #[pyo3(signature = (block_ids: "list[int]"))]
    fn retention_pin_blocks(&mut self, block_ids: Vec<BlockIdInt>) -> PyResult<usize> {
        let block_ids: Vec<i64> = block_ids.into_iter().map(|b| b.0).collect();
        Ok(self.core.block_pool_mut()?.pin_blocks(&block_ids)?)
    }

    /// Unpins every block (policy `pin`).
    fn retention_unpin_all(&mut self) -> PyResult<()> {
        self.core.block_pool_mut()?.unpin_all();
        Ok(())
    }

    /// Moves the policy's clock forward (simulated traces and tests).
    #[pyo3(signature = (seconds: "float"))]
    fn retention_advance_clock(&mut self, seconds: f64) -> PyResult<()> {
        self.retention_advance_clock_impl(seconds)
    }

    /// The policy's counters (`policy` only under `lru`).
    #[pyo3(signature = () -> "dict[str, Any]")]
    fn retention_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.retention_stats_impl(py)
    }
}
