//! `KVCacheCore`: the core `KVCacheManager` as a subclassable Python class.
//!
//! `hscache.vllm.KVCacheManager` subclasses it. The methods vLLM's Scheduler calls
//! every step (`allocate_slots`, `get_computed_blocks`, `free`, `get_blocks`,
//! `get_block_ids`, `cache_blocks`, ...) are implemented here with vLLM's exact
//! signatures and return types, so a call costs one FFI crossing and no Python
//! frame; the Python subclass adds the cold parts (stats, views, event structs).
//! Methods take vLLM objects where the adapter would otherwise copy fields one by
//! one (a `Request` is read for `request_id`, `num_computed_tokens`, `num_tokens`
//! and `block_hashes`), and return block handles from an identity-stable cache.
//!
//! Low-level pool operations used by the Python `BlockPool` view carry a `core_`
//! prefix so that they never shadow a vLLM method name.

use std::cell::{OnceCell, RefCell};

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use pyo3::{intern, PyTraverseError};

use super::block::PyKVCacheBlock;
use super::blocks::PyKVCacheBlocks;
use super::errors::{count, InvalidArgumentError};
use super::events::PyEventBuilder;
use super::hashes::{hash_from_bytes, PyListHashes};
use crate::events::KVCacheEvent;
use crate::manager::{AllocateSlots, KVCacheManager, KVCacheManagerConfig, RequestView};
use crate::stats::{self, Op};
use crate::types::BlockId;

#[pyclass(name = "KVCacheCore", module = "hscache._core", subclass)]
pub struct PyKVCacheCore {
    pub(crate) core: KVCacheManager,
    /// Lazily created, then reused, block handles (identity per block id).
    handles: Vec<Option<Py<PyKVCacheBlock>>>,
    scratch: Vec<BlockId>,
    /// vLLM objects the vLLM-shaped methods return or compare with; set once by
    /// `_bind_vllm`.
    vllm: Option<VllmBindings>,
}

/// vLLM objects and the empty-result singleton the drop-in methods need.
struct VllmBindings {
    /// The manager's `empty_kv_cache_blocks` (identity matters to the Scheduler).
    empty_kv_cache_blocks: Py<PyKVCacheBlocks>,
    /// `RequestStatus.WAITING` and `RequestStatus.PREEMPTED` (the watermark applies).
    watermark_statuses: [Py<PyAny>; 2],
    /// The list to which a call that recorded events appends vLLM's event structs,
    /// built by `event_builder` with the call's request (events on only); the
    /// Python `BlockPool` moves them to its event queue when that is read.
    event_sink: Option<(Py<PyList>, Py<PyEventBuilder>)>,
    /// Called with `(request, num_blocks)` for `kv_cache_report_mode == "full"` hits.
    cached_block_event_sink: Option<Py<PyAny>>,
    /// The free queue's head and tail sentinels (Python objects of the
    /// `FreeKVCacheBlockQueue` view), returned at the ends of a block's free links.
    free_list_sentinels: Option<[Py<PyAny>; 2]>,
}

/// The request fields the core reads, extracted before the core is borrowed
/// (`num_tokens`, a Python property in vLLM, and `block_hashes` are read lazily,
/// only when a block may be cached).
struct RequestFields<'py> {
    request: Bound<'py, PyAny>,
    request_id: Bound<'py, PyString>,
    num_computed_tokens: usize,
    block_hashes: OnceCell<PyListHashes<'py>>,
    /// The Python error behind a failed lazy read, re-raised by the caller.
    py_err: RefCell<Option<PyErr>>,
}

impl<'py> RequestFields<'py> {
    fn read(request: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = request.py();
        let request_id = request
            .getattr(intern!(py, "request_id"))?
            .cast_into::<PyString>()
            .map_err(|_| InvalidArgumentError::new_err("request.request_id must be a str"))?;
        let num_computed_tokens = count(
            "request.num_computed_tokens",
            request
                .getattr(intern!(py, "num_computed_tokens"))?
                .extract()?,
        )?;
        Ok(Self {
            request: request.clone(),
            request_id,
            num_computed_tokens,
            block_hashes: OnceCell::new(),
            py_err: RefCell::new(None),
        })
    }

    /// Keeps a Python error for the caller; the core sees a typed error.
    fn stash(&self, e: PyErr) -> crate::error::Error {
        let msg = e.to_string();
        *self.py_err.borrow_mut() = Some(e);
        crate::error::Error::InvalidArgument(msg)
    }

    /// `request.num_tokens`.
    fn num_tokens(&self) -> crate::error::Result<usize> {
        let py = self.request.py();
        let read = || -> PyResult<usize> {
            let n: i64 = self.request.getattr(intern!(py, "num_tokens"))?.extract()?;
            count("request.num_tokens", n)
        };
        read().map_err(|e| self.stash(e))
    }

    /// `request.block_hashes`, read on first use.
    fn block_hashes(&self) -> crate::error::Result<&PyListHashes<'py>> {
        if let Some(h) = self.block_hashes.get() {
            return Ok(h);
        }
        let py = self.request.py();
        let hashes = self
            .request
            .getattr(intern!(py, "block_hashes"))
            .and_then(|obj| PyListHashes::new(&obj))
            .map_err(|e| self.stash(e))?;
        Ok(self.block_hashes.get_or_init(|| hashes))
    }

    /// The error to raise for a failed core call: the stashed Python error, if any.
    fn error(&self, e: crate::error::Error) -> PyErr {
        self.py_err.borrow_mut().take().unwrap_or_else(|| e.into())
    }
}

/// The core's event records as the tuples `hscache.vllm.events.convert` reads.
pub(super) fn events_to_py(
    py: Python<'_>,
    events: Vec<KVCacheEvent>,
) -> PyResult<Bound<'_, PyList>> {
    let list = PyList::empty(py);
    for e in events {
        let item = match e {
            KVCacheEvent::BlockStored {
                group_id,
                start_block,
                end_block,
                block_size,
            } => ("stored", group_id, start_block, end_block, block_size)
                .into_pyobject(py)?
                .into_any(),
            KVCacheEvent::BlockRemoved { key } => (
                "removed",
                PyBytes::new(py, key.hash.as_bytes()),
                key.group_id,
            )
                .into_pyobject(py)?
                .into_any(),
            KVCacheEvent::AllBlocksCleared => PyTuple::new(py, ["cleared"])?.into_any(),
        };
        list.append(item)?;
    }
    Ok(list)
}

impl PyKVCacheCore {
    fn handle(slf: &Bound<'_, Self>, this: &mut Self, id: BlockId) -> PyResult<Py<PyKVCacheBlock>> {
        let py = slf.py();
        let slot = &mut this.handles[id as usize];
        if let Some(h) = slot {
            return Ok(h.clone_ref(py));
        }
        let h = Py::new(
            py,
            PyKVCacheBlock {
                block_id: id,
                core: slf.clone().unbind(),
            },
        )?;
        *slot = Some(h.clone_ref(py));
        Ok(h)
    }

    fn handles_list<'py>(
        slf: &Bound<'py, Self>,
        this: &mut Self,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let list = PyList::empty(py);
        for &id in ids {
            list.append(Self::handle(slf, this, id)?)?;
        }
        Ok(list)
    }

    /// Block ids of an iterable of `KVCacheBlock` handles of this core.
    fn ids_of(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        out: &mut Vec<BlockId>,
    ) -> PyResult<()> {
        if let Ok(list) = blocks.cast::<PyList>() {
            for item in list.iter() {
                out.push(Self::id_of(slf, &item)?);
            }
            return Ok(());
        }
        for item in blocks.try_iter()? {
            out.push(Self::id_of(slf, &item?)?);
        }
        Ok(())
    }

    #[inline]
    fn id_of(slf: &Bound<'_, Self>, item: &Bound<'_, PyAny>) -> PyResult<BlockId> {
        let block = item
            .cast::<PyKVCacheBlock>()
            .map_err(|_| InvalidArgumentError::new_err("expected hscache KVCacheBlock objects"))?
            .get();
        if !block.core.bind(slf.py()).is(slf) {
            return Err(InvalidArgumentError::new_err(format!(
                "block {} belongs to another KV-cache pool",
                block.block_id
            )));
        }
        Ok(block.block_id)
    }

    fn bindings(&self) -> PyResult<&VllmBindings> {
        self.vllm.as_ref().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err(
                "KVCacheCore: _bind_vllm() was not called (use hscache.vllm.KVCacheManager)",
            )
        })
    }

    /// `KVCacheBlocks` of `ids`, or the empty singleton when `ids` is empty.
    fn kv_cache_blocks<'py>(
        slf: &Bound<'py, Self>,
        this: &Self,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let vllm = this.bindings()?;
        if ids.is_empty() {
            return Ok(vllm.empty_kv_cache_blocks.bind(py).clone().into_any());
        }
        Ok(Bound::new(py, PyKVCacheBlocks::new(slf.clone().unbind(), ids.to_vec()))?.into_any())
    }

    /// Block handles of `ids` as a list (for `KVCacheBlocks.blocks`).
    pub(crate) fn handles_for<'py>(
        slf: &Bound<'py, Self>,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyList>> {
        let mut this = slf.try_borrow_mut()?;
        Self::handles_list(slf, &mut this, ids)
    }

    /// The block ids of a lookup result handed back by the Scheduler: `None` for
    /// the empty singleton (vLLM's identity check), else the ids (any
    /// `KVCacheBlocks`-shaped object of this pool).
    fn hit_ids(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        out: &mut Vec<BlockId>,
    ) -> PyResult<bool> {
        let py = slf.py();
        if let Ok(ours) = blocks.cast::<PyKVCacheBlocks>() {
            let this = slf.try_borrow()?;
            if ours.is(this.bindings()?.empty_kv_cache_blocks.bind(py)) {
                return Ok(false);
            }
            let ours = ours.get();
            if !ours.core.bind(py).is(slf) {
                return Err(InvalidArgumentError::new_err(
                    "new_computed_blocks belong to another KV-cache pool",
                ));
            }
            out.extend_from_slice(&ours.ids);
            return Ok(true);
        }
        let groups = blocks.getattr(intern!(py, "blocks"))?;
        Self::ids_of(slf, &groups.get_item(0)?, out)?;
        Ok(true)
    }

    /// Builds the events of the call's records with its request (vLLM's structs,
    /// as vLLM's `BlockPool` builds them inside the call) and appends them to the
    /// sink (events on only). A record whose event cannot be built raises; the
    /// events before it are kept.
    pub(super) fn flush_events(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        Self::flush_events_of(slf, Some(request))
    }

    /// [`Self::flush_events`] for a call with or without a request (pool-level
    /// calls such as eviction record no `BlockStored`).
    fn flush_events_of(slf: &Bound<'_, Self>, request: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let py = slf.py();
        let (sink, builder, records) = {
            let mut this = slf.try_borrow_mut()?;
            if !this.core.block_pool().has_events() {
                return Ok(());
            }
            // Without a sink (a bare core) the records stay for `core_take_events`.
            let sink = this.vllm.as_ref().and_then(|v| v.event_sink.as_ref());
            let Some((sink, builder)) = sink.map(|(s, b)| (s.clone_ref(py), b.clone_ref(py)))
            else {
                return Ok(());
            };
            (sink, builder, this.core.take_events())
        };
        let (sink, builder) = (sink.bind(py), builder.get());
        for record in records {
            sink.append(builder.build(py, record, request)?)?;
        }
        Ok(())
    }

    /// A block's neighbor in the free queue (see `KVCacheBlock.next_free_block`).
    pub(crate) fn free_list_neighbor(
        slf: &Bound<'_, Self>,
        block_id: BlockId,
        prev: bool,
    ) -> PyResult<Option<Py<PyAny>>> {
        let neighbors = slf
            .try_borrow()?
            .core
            .block_pool()
            .free_block_queue()
            .neighbors(block_id);
        match neighbors {
            None => Ok(None),
            Some((p, n)) => Self::link_target(slf, if prev { p } else { n }, !prev),
        }
    }

    /// A block handle, or the tail (`to_tail`) / head sentinel for `None`.
    fn link_target(
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

    fn request_id<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
        request
            .getattr(intern!(request.py(), "request_id"))?
            .cast_into::<PyString>()
            .map_err(|_| InvalidArgumentError::new_err("request.request_id must be a str"))
    }
}

#[pymethods]
impl PyKVCacheCore {
    #[new]
    #[pyo3(signature = (*, num_blocks, block_size, max_model_len, enable_caching=true,
        enable_kv_cache_events=false, use_eagle=false, watermark_blocks=0,
        num_reprefillable_tokens=0, needs_kv_cache_zeroing=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        block_size: i64,
        max_model_len: i64,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        use_eagle: bool,
        watermark_blocks: i64,
        num_reprefillable_tokens: i64,
        needs_kv_cache_zeroing: bool,
    ) -> PyResult<Self> {
        let num_blocks = u32::try_from(count("num_blocks", num_blocks)?)
            .map_err(|_| InvalidArgumentError::new_err("num_blocks is too large"))?;
        let core = KVCacheManager::new(KVCacheManagerConfig {
            num_blocks,
            block_size: count("block_size", block_size)?,
            max_model_len: count("max_model_len", max_model_len)?,
            enable_caching,
            enable_kv_cache_events,
            use_eagle,
            watermark_blocks: count("watermark_blocks", watermark_blocks)?,
            num_reprefillable_tokens: count("num_reprefillable_tokens", num_reprefillable_tokens)?,
            needs_kv_cache_zeroing,
        })?;
        Ok(Self {
            core,
            handles: (0..num_blocks).map(|_| None).collect(),
            scratch: Vec::new(),
            vllm: None,
        })
    }

    /// Hands the core the vLLM objects its drop-in methods compare with and call.
    /// `event_sink`: `(list, EventBuilder)` with events on: each call's events are
    /// built and appended to the list before it returns.
    #[pyo3(signature = (waiting, preempted, event_sink=None, cached_block_event_sink=None))]
    fn _bind_vllm(
        slf: &Bound<'_, Self>,
        waiting: Bound<'_, PyAny>,
        preempted: Bound<'_, PyAny>,
        event_sink: Option<(Bound<'_, PyList>, Bound<'_, PyEventBuilder>)>,
        cached_block_event_sink: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let empty = Py::new(
            slf.py(),
            PyKVCacheBlocks::new(slf.clone().unbind(), Vec::new()),
        )?;
        slf.try_borrow_mut()?.vllm = Some(VllmBindings {
            empty_kv_cache_blocks: empty,
            watermark_statuses: [waiting.unbind(), preempted.unbind()],
            event_sink: event_sink.map(|(s, b)| (s.unbind(), b.unbind())),
            cached_block_event_sink: cached_block_event_sink.map(Bound::unbind),
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

    /// The first (or, with `last`, the last) free block, or the opposite sentinel
    /// when the queue is empty (vLLM's `fake_free_list_head.next_free_block`).
    #[pyo3(signature = (last=false))]
    fn core_free_list_end(slf: &Bound<'_, Self>, last: bool) -> PyResult<Option<Py<PyAny>>> {
        let end = {
            let this = slf.try_borrow()?;
            let q = this.core.block_pool().free_block_queue();
            if last {
                q.last()
            } else {
                q.first()
            }
        };
        Self::link_target(slf, end, !last)
    }

    // ---- vLLM's KVCacheManager interface (hot paths) -------------------------------

    /// The empty `KVCacheBlocks` singleton (the Scheduler hands it back as "no hit").
    #[getter]
    fn empty_kv_cache_blocks(&self, py: Python<'_>) -> PyResult<Py<PyKVCacheBlocks>> {
        Ok(self.bindings()?.empty_kv_cache_blocks.clone_ref(py))
    }

    /// KV-cache usage in [0, 1], null block excluded.
    #[getter]
    fn usage(&self) -> f64 {
        self.core.usage()
    }

    /// vLLM's `get_computed_blocks`: `(KVCacheBlocks, num_hit_tokens, 0)`.
    #[pyo3(signature = (request, max_cache_hit_length=None))]
    fn get_computed_blocks<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        max_cache_hit_length: Option<i64>,
    ) -> PyResult<(Bound<'py, PyAny>, usize, usize)> {
        let _timer = stats::Timer::start(Op::GetComputedBlocks);
        let py = slf.py();
        let empty = {
            let this = slf.try_borrow()?;
            let vllm = this.bindings()?;
            (!this.core.config().enable_caching)
                .then(|| vllm.empty_kv_cache_blocks.bind(py).clone().into_any())
        };
        if let Some(empty) = empty {
            return Ok((empty, 0, 0));
        }
        if request
            .getattr(intern!(py, "skip_reading_prefix_cache"))?
            .is_truthy()?
        {
            let this = slf.try_borrow()?;
            return Ok((
                this.bindings()?
                    .empty_kv_cache_blocks
                    .bind(py)
                    .clone()
                    .into_any(),
                0,
                0,
            ));
        }
        let max_len = match max_cache_hit_length {
            Some(n) => count("max_cache_hit_length", n)?,
            None => {
                let n: i64 = request.getattr(intern!(py, "num_tokens"))?.extract()?;
                count("request.num_tokens - 1", n.saturating_sub(1))?
            }
        };
        let hashes_obj = request.getattr(intern!(py, "block_hashes"))?;
        let hashes = PyListHashes::new(&hashes_obj)?;
        let mut this = slf.try_borrow_mut()?;
        let mut ids = std::mem::take(&mut this.scratch);
        ids.clear();
        let result = this
            .core
            .find_longest_cache_hit(&hashes, max_len, &mut ids)
            .map_err(PyErr::from)
            .and_then(|hit| Ok((Self::kv_cache_blocks(slf, &this, &ids)?, hit)));
        let num_blocks = ids.len();
        this.scratch = ids;
        let (blocks, hit) = result?;
        let sink = match &this.bindings()?.cached_block_event_sink {
            Some(sink) if hit > 0 && this.core.config().enable_kv_cache_events => {
                Some(sink.clone_ref(py))
            }
            _ => None,
        };
        drop(this);
        if let Some(sink) = sink {
            let mode = request.getattr("kv_cache_report_mode").ok();
            let full = match mode {
                Some(m) => m.eq("full")?,
                None => false,
            };
            if full {
                sink.bind(py).call1((request, num_blocks))?;
            }
        }
        Ok((blocks, hit, 0))
    }

    /// vLLM's `allocate_slots`: the newly allocated blocks as `KVCacheBlocks`, or
    /// None when they do not fit (hit blocks are then left untouched).
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=0,
        new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0,
        delay_cache_blocks=false, num_encoder_tokens=0, full_sequence_must_fit=false,
        reserved_blocks=0, has_scheduled_reqs=true, skip_zeroing_group_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let _timer = stats::Timer::start(Op::AllocateSlots);
        let py = slf.py();
        // One shared borrow for what the call needs from the bindings; the result
        // needs them too, so a core without them fails before anything changes.
        let watermark_statuses = {
            let this = slf.try_borrow()?;
            let bindings = this.bindings()?;
            (has_scheduled_reqs && this.core.config().watermark_blocks > 0).then(|| {
                let [waiting, preempted] = &bindings.watermark_statuses;
                [waiting.clone_ref(py), preempted.clone_ref(py)]
            })
        };
        let _ = count("num_encoder_tokens", num_encoder_tokens)?;
        let fields = RequestFields::read(request)?;
        let mut hits = Vec::new();
        let adopt_hits = match new_computed_blocks {
            Some(blocks) => Self::hit_ids(slf, blocks, &mut hits)?,
            None => false,
        };
        let apply_watermark = match &watermark_statuses {
            Some([waiting, preempted]) => {
                let status = request.getattr(intern!(py, "status"))?;
                status.is(waiting.bind(py)) || status.is(preempted.bind(py))
            }
            None => false,
        };
        let skip_zeroing = match skip_zeroing_group_ids {
            Some(ids) => ids.contains(0)?,
            None => false,
        };
        let args = AllocateSlots {
            num_new_tokens: count("num_new_tokens", num_new_tokens)?,
            num_new_computed_tokens: count("num_new_computed_tokens", num_new_computed_tokens)?,
            new_computed_blocks: adopt_hits.then_some(hits.as_slice()),
            num_lookahead_tokens: count("num_lookahead_tokens", num_lookahead_tokens)?,
            num_external_computed_tokens: count(
                "num_external_computed_tokens",
                num_external_computed_tokens,
            )?,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks: count("reserved_blocks", reserved_blocks)?,
            apply_watermark,
            skip_zeroing,
        };
        let num_tokens = || fields.num_tokens();
        let block_hashes = || fields.block_hashes();
        let view = RequestView {
            request_id: fields.request_id.to_str()?,
            num_computed_tokens: fields.num_computed_tokens,
            num_tokens: &num_tokens,
            block_hashes: &block_hashes,
        };
        let (result, has_events) = {
            let mut this = slf.try_borrow_mut()?;
            let mut out = std::mem::take(&mut this.scratch);
            out.clear();
            let result = match this.core.allocate_slots(&view, &args, &mut out) {
                Ok(true) => Self::kv_cache_blocks(slf, &this, &out).map(Some),
                Ok(false) => Ok(None),
                Err(e) => Err(fields.error(e)),
            };
            this.scratch = out;
            (result, this.core.block_pool().has_events())
        };
        if has_events {
            Self::flush_events(slf, request)?;
        }
        result
    }

    /// vLLM's `cache_blocks`: caches the request's full blocks up to
    /// `num_computed_tokens`.
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let _timer = stats::Timer::start(Op::CacheBlocks);
        let fields = RequestFields::read(request)?;
        let n = count("num_computed_tokens", num_computed_tokens)?;
        let num_tokens = || fields.num_tokens();
        let block_hashes = || fields.block_hashes();
        let view = RequestView {
            request_id: fields.request_id.to_str()?,
            num_computed_tokens: fields.num_computed_tokens,
            num_tokens: &num_tokens,
            block_hashes: &block_hashes,
        };
        let result = slf.try_borrow_mut()?.core.cache_blocks(&view, n);
        result.map_err(|e| fields.error(e))?;
        Self::flush_events(slf, request)
    }

    /// vLLM's `free`: frees the request's blocks, tail first (no-op for a request
    /// without blocks).
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let _timer = stats::Timer::start(Op::Free);
        let rid = Self::request_id(request)?;
        Ok(slf.try_borrow_mut()?.core.free(rid.to_str()?)?)
    }

    /// vLLM's `pop_blocks_for_free`: the request's blocks in allocation order, not
    /// yet freed (the caller frees them, reversed, through the block pool).
    fn pop_blocks_for_free<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let _timer = stats::Timer::start(Op::PopBlocksForFree);
        let rid = Self::request_id(request)?;
        let mut this = slf.try_borrow_mut()?;
        let mut ids = std::mem::take(&mut this.scratch);
        ids.clear();
        this.core.pop_blocks_for_free(rid.to_str()?, &mut ids);
        let result = Self::handles_list(slf, &mut this, &ids);
        this.scratch = ids;
        result
    }

    /// vLLM's `get_blocks`: the request's blocks as `KVCacheBlocks`.
    fn get_blocks<'py>(slf: &Bound<'py, Self>, request_id: &str) -> PyResult<Bound<'py, PyAny>> {
        let _timer = stats::Timer::start(Op::GetBlocks);
        let mut this = slf.try_borrow_mut()?;
        let mut ids = std::mem::take(&mut this.scratch);
        ids.clear();
        ids.extend_from_slice(this.core.get_blocks(request_id));
        let result = Self::kv_cache_blocks(slf, &this, &ids);
        this.scratch = ids;
        result
    }

    /// vLLM's `get_block_ids`: `([block ids],)`.
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let ids = PyList::new(py, self.core.get_blocks(request_id))?;
        PyTuple::new(py, [ids])
    }

    /// The handle of a request that holds blocks (None otherwise), for the batched
    /// calls; valid until the request is freed.
    fn request_handle(&self, request_id: &str) -> Option<u64> {
        self.core.request_handle(request_id)
    }

    /// One step's `allocate_slots` for running requests (see `batch.rs`):
    /// `(num_allocated, new_block_ids, offsets)` as int32 bytearrays; entry
    /// `num_allocated`, if any, did not fit and was left untouched.
    #[pyo3(signature = (requests, handles, num_computed_tokens, num_new_tokens,
        num_lookahead_tokens=0))]
    fn core_allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyList>,
        handles: &Bound<'py, PyAny>,
        num_computed_tokens: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_lookahead_tokens: i64,
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
    fn core_free_batch(slf: &Bound<'_, Self>, handles: &Bound<'_, PyAny>) -> PyResult<()> {
        super::batch::free_batch(slf, handles)
    }

    /// vLLM's `estimate_cached_tokens`.
    fn estimate_cached_tokens(&self, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        let rid = Self::request_id(request)?;
        Ok(self.core.estimate_cached_tokens(rid.to_str()?))
    }

    /// vLLM's `new_step_starts`: full attention keeps no per-step state.
    fn new_step_starts(&self) {}

    /// vLLM's `take_new_block_ids`: block ids recorded for worker-side zeroing.
    fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        self.core.take_new_block_ids()
    }

    /// vLLM's `record_blocks_for_zeroing`.
    fn record_blocks_for_zeroing(&mut self, request_id: &str, start_token: i64) -> PyResult<()> {
        let start = count("start_token", start_token)?;
        Ok(self.core.record_blocks_for_zeroing(request_id, start)?)
    }

    // ---- pool-level operations (the Python BlockPool view) -------------------------

    /// Number of blocks, null block included.
    #[getter]
    fn num_gpu_blocks(&self) -> u32 {
        self.core.block_pool().num_gpu_blocks()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.core.config().block_size
    }

    /// Free blocks (evictable cached blocks included).
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.core.block_pool().get_num_free_blocks()
    }

    /// Number of keys in the prefix-cache index.
    #[getter]
    fn num_cached_keys(&self) -> usize {
        self.core.block_pool().cached_block_hash_to_block().len()
    }

    /// Whether events wait to be taken.
    #[getter]
    fn has_events(&self) -> bool {
        self.core.block_pool().has_events()
    }

    /// The handle of block `block_id`.
    fn block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<Py<PyKVCacheBlock>> {
        let mut this = slf.try_borrow_mut()?;
        let id = this.core.block_pool().check_block_id(block_id)?;
        Self::handle(slf, &mut this, id)
    }

    /// Blocks an allocation of `num_tokens` slots would take from the free queue
    /// (vLLM's `coordinator.get_num_blocks_to_allocate` for one group).
    #[pyo3(signature = (request_id, num_tokens, new_computed_blocks=None))]
    fn core_num_blocks_to_allocate(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_tokens: i64,
        new_computed_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let mut hits = Vec::new();
        if let Some(blocks) = new_computed_blocks {
            Self::ids_of(slf, blocks, &mut hits)?;
        }
        let n = count("num_tokens", num_tokens)?;
        let this = slf.try_borrow()?;
        Ok(this.core.single_type_manager().get_num_blocks_to_allocate(
            this.core.block_pool(),
            request_id,
            n,
            &hits,
        )?)
    }

    /// Longest prefix hit as `(blocks, hit tokens)`; ref counts unchanged.
    fn core_find_longest_cache_hit<'py>(
        slf: &Bound<'py, Self>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: i64,
    ) -> PyResult<(Bound<'py, PyList>, usize)> {
        let max_len = count("max_cache_hit_length", max_cache_hit_length)?;
        let hashes = PyListHashes::new(block_hashes)?;
        let mut this = slf.try_borrow_mut()?;
        let mut ids = Vec::new();
        let hit = this
            .core
            .find_longest_cache_hit(&hashes, max_len, &mut ids)?;
        Ok((Self::handles_list(slf, &mut this, &ids)?, hit))
    }

    /// The request's `num_cached_block` (None if it has none).
    fn core_num_cached_block(&self, request_id: &str) -> Option<usize> {
        self.core
            .single_type_manager()
            .request(request_id)
            .and_then(|r| r.num_cached_block)
    }

    /// Frees a request's blocks by id, tail first (vLLM's `coordinator.free`).
    fn core_free(&mut self, request_id: &str) -> PyResult<()> {
        Ok(self.core.free(request_id)?)
    }

    /// Ids of the requests that hold bookkeeping.
    fn core_request_ids(&self) -> Vec<String> {
        self.core
            .single_type_manager()
            .requests()
            .map(|(k, _)| k.to_owned())
            .collect()
    }

    /// The request's blocks as a plain list (empty if unknown).
    fn core_blocks<'py>(slf: &Bound<'py, Self>, request_id: &str) -> PyResult<Bound<'py, PyList>> {
        let mut this = slf.try_borrow_mut()?;
        let ids = this.core.get_blocks(request_id).to_vec();
        Self::handles_list(slf, &mut this, &ids)
    }

    /// Drops one reference per block, in the given order (first = evicted first).
    fn core_free_blocks(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let _timer = stats::Timer::start(Op::FreeBlocks);
        let mut ids = Vec::new();
        Self::ids_of(slf, blocks, &mut ids)?;
        Ok(slf
            .try_borrow_mut()?
            .core
            .block_pool_mut()
            .free_blocks(ids)?)
    }

    /// Takes a reference on each block (removing free ones from the free queue).
    fn core_touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        Self::ids_of(slf, blocks, &mut ids)?;
        Ok(slf.try_borrow_mut()?.core.block_pool_mut().touch(&ids)?)
    }

    /// Hands out `num_blocks` blocks from the head of the free queue.
    fn core_get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = count("num_blocks", num_blocks)?;
        let mut this = slf.try_borrow_mut()?;
        // No capacity up front: `n` is checked against the free blocks by the pool.
        let mut ids = Vec::new();
        this.core.block_pool_mut().get_new_blocks(n, &mut ids)?;
        Self::handles_list(slf, &mut this, &ids)
    }

    /// The first-inserted cached block of `(block_hash, group_id)`, or None.
    fn core_get_cached_block(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        group_id: u32,
    ) -> PyResult<Option<Py<PyKVCacheBlock>>> {
        let hash = hash_from_bytes(block_hash)?;
        let mut this = slf.try_borrow_mut()?;
        match this.core.block_pool().get_cached_block(&hash, group_id) {
            Some(id) => Ok(Some(Self::handle(slf, &mut this, id)?)),
            None => Ok(None),
        }
    }

    /// Drops the blocks from the prefix cache, in the given order.
    fn core_evict_blocks(&mut self, block_ids: Vec<i64>) -> PyResult<()> {
        Ok(self.core.evict_blocks(&block_ids)?)
    }

    /// Forgets every cached hash; False while any block is in use.
    fn core_reset_prefix_cache(&mut self) -> bool {
        self.core.reset_prefix_cache()
    }

    /// Free block ids from head (next to reuse) to tail.
    fn core_free_block_ids(&self) -> Vec<BlockId> {
        self.core
            .block_pool()
            .free_block_queue()
            .get_all_free_blocks()
    }

    /// Builds and queues the events recorded so far (see `flush_events`): pool-level
    /// calls pass no request.
    #[pyo3(signature = (request=None))]
    fn core_flush_events(slf: &Bound<'_, Self>, request: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        Self::flush_events_of(slf, request.as_ref())
    }

    /// Drains event records as tuples: `("stored", group, start_block, end_block,
    /// block_size)`, `("removed", hash_bytes, group)`, `("cleared",)`.
    fn core_take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        events_to_py(py, self.core.take_events())
    }

    /// Raises RuntimeError if a structural invariant is broken (tests).
    fn check_invariants(&self) -> PyResult<()> {
        self.core
            .block_pool()
            .check_invariants()
            .map_err(pyo3::exceptions::PyRuntimeError::new_err)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for h in self.handles.iter().flatten() {
            visit.call(h)?;
        }
        if let Some(v) = &self.vllm {
            visit.call(&v.empty_kv_cache_blocks)?;
            for s in &v.watermark_statuses {
                visit.call(s)?;
            }
            if let Some((sink, builder)) = &v.event_sink {
                visit.call(sink)?;
                visit.call(builder)?;
            }
            visit.call(&v.cached_block_event_sink)?;
            if let Some(s) = &v.free_list_sentinels {
                visit.call(&s[0])?;
                visit.call(&s[1])?;
            }
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.handles.iter_mut().for_each(|h| *h = None);
        self.vllm = None;
    }
}
