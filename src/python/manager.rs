//! `KVCacheCore`: the core `KVCacheManager` as a Python class.
//!
//! Methods take vLLM objects where the adapter would otherwise copy fields one by
//! one (a `Request` is read for `request_id`, `num_computed_tokens`, `num_tokens`
//! and `block_hashes`), and return block handles from an identity-stable cache.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use pyo3::{intern, PyTraverseError};

use super::block::PyKVCacheBlock;
use super::errors::{count, InvalidArgumentError};
use super::hashes::{hash_from_bytes, PyListHashes};
use crate::events::KVCacheEvent;
use crate::manager::{AllocateSlots, KVCacheManager, KVCacheManagerConfig, RequestView};
use crate::types::BlockId;

#[pyclass(name = "KVCacheCore", module = "hscache._core")]
pub struct PyKVCacheCore {
    pub(crate) core: KVCacheManager,
    /// Lazily created, then reused, block handles (identity per block id).
    handles: Vec<Option<Py<PyKVCacheBlock>>>,
    scratch: Vec<BlockId>,
}

/// The request fields the core reads, extracted before the core is borrowed.
struct RequestFields<'py> {
    request_id: Bound<'py, PyString>,
    num_computed_tokens: usize,
    num_tokens: usize,
    block_hashes: Bound<'py, PyAny>,
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
        let num_tokens = count(
            "request.num_tokens",
            request.getattr(intern!(py, "num_tokens"))?.extract()?,
        )?;
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        Ok(Self {
            request_id,
            num_computed_tokens,
            num_tokens,
            block_hashes,
        })
    }
}

impl PyKVCacheCore {
    fn handle(slf: &Bound<'_, Self>, this: &mut Self, id: BlockId) -> Py<PyKVCacheBlock> {
        let py = slf.py();
        let slot = &mut this.handles[id as usize];
        if let Some(h) = slot {
            return h.clone_ref(py);
        }
        let h = Py::new(
            py,
            PyKVCacheBlock {
                block_id: id,
                core: slf.clone().unbind(),
            },
        )
        .expect("allocating a block handle");
        *slot = Some(h.clone_ref(py));
        h
    }

    fn handles_list<'py>(
        slf: &Bound<'py, Self>,
        this: &mut Self,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let list = PyList::empty(py);
        for &id in ids {
            list.append(Self::handle(slf, this, id))?;
        }
        Ok(list)
    }

    /// Block ids of an iterable of `KVCacheBlock` handles of this core.
    fn ids_of(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        out: &mut Vec<BlockId>,
    ) -> PyResult<()> {
        for item in blocks.try_iter()? {
            let item = item?;
            let block = item.cast::<PyKVCacheBlock>().map_err(|_| {
                InvalidArgumentError::new_err("expected hscache KVCacheBlock objects")
            })?;
            let block = block.get();
            if !block.core.bind(slf.py()).is(slf) {
                return Err(InvalidArgumentError::new_err(format!(
                    "block {} belongs to another KV-cache pool",
                    block.block_id
                )));
            }
            out.push(block.block_id);
        }
        Ok(())
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
        })
    }

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

    /// KV-cache usage in [0, 1], null block excluded.
    #[getter]
    fn usage(&self) -> f64 {
        self.core.usage()
    }

    /// Number of keys in the prefix-cache index.
    #[getter]
    fn num_cached_keys(&self) -> usize {
        self.core.block_pool().cached_block_hash_to_block().len()
    }

    /// The handle of block `block_id`.
    fn block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<Py<PyKVCacheBlock>> {
        let mut this = slf.borrow_mut();
        let id = this.core.block_pool().check_block_id(block_id)?;
        Ok(Self::handle(slf, &mut this, id))
    }

    /// Longest prefix hit: `(hit blocks, hit tokens)`; ref counts unchanged.
    fn find_longest_cache_hit<'py>(
        slf: &Bound<'py, Self>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: i64,
    ) -> PyResult<(Bound<'py, PyList>, usize)> {
        let max_len = count("max_cache_hit_length", max_cache_hit_length)?;
        let hashes = PyListHashes::new(block_hashes)?;
        let mut this = slf.borrow_mut();
        let mut ids = std::mem::take(&mut this.scratch);
        ids.clear();
        let hit = this.core.find_longest_cache_hit(&hashes, max_len, &mut ids);
        let result = hit
            .map_err(PyErr::from)
            .and_then(|hit| Ok((Self::handles_list(slf, &mut this, &ids)?, hit)));
        this.scratch = ids;
        result
    }

    /// vLLM's `allocate_slots` for `request`: the new blocks, or None if they do
    /// not fit.
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=0,
        new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0,
        delay_cache_blocks=false, full_sequence_must_fit=false, reserved_blocks=0,
        apply_watermark=false, skip_zeroing=false))]
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
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        apply_watermark: bool,
        skip_zeroing: bool,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let fields = RequestFields::read(request)?;
        let hashes = PyListHashes::new(&fields.block_hashes)?;
        let mut hits = Vec::new();
        if let Some(blocks) = new_computed_blocks {
            Self::ids_of(slf, blocks, &mut hits)?;
        }
        let args = AllocateSlots {
            num_new_tokens: count("num_new_tokens", num_new_tokens)?,
            num_new_computed_tokens: count("num_new_computed_tokens", num_new_computed_tokens)?,
            new_computed_blocks: new_computed_blocks.map(|_| hits.as_slice()),
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
        let request_id = fields.request_id.to_str()?;
        let view = RequestView {
            request_id,
            num_computed_tokens: fields.num_computed_tokens,
            num_tokens: fields.num_tokens,
            block_hashes: &hashes,
        };
        let mut this = slf.borrow_mut();
        let mut out = std::mem::take(&mut this.scratch);
        out.clear();
        let result = match this.core.allocate_slots(&view, &args, &mut out) {
            Ok(true) => Self::handles_list(slf, &mut this, &out).map(Some),
            Ok(false) => Ok(None),
            Err(e) => Err(e.into()),
        };
        this.scratch = out;
        result
    }

    /// Blocks an allocation of `num_tokens` slots would take from the free queue
    /// (vLLM's `coordinator.get_num_blocks_to_allocate` for one group).
    #[pyo3(signature = (request_id, num_tokens, new_computed_blocks=None))]
    fn get_num_blocks_to_allocate(
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
        let this = slf.borrow();
        Ok(this.core.single_type_manager().get_num_blocks_to_allocate(
            this.core.block_pool(),
            request_id,
            n,
            &hits,
        )?)
    }

    /// Caches the request's full blocks up to `num_computed_tokens`.
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let fields = RequestFields::read(request)?;
        let hashes = PyListHashes::new(&fields.block_hashes)?;
        let n = count("num_computed_tokens", num_computed_tokens)?;
        let view = RequestView {
            request_id: fields.request_id.to_str()?,
            num_computed_tokens: fields.num_computed_tokens,
            num_tokens: fields.num_tokens,
            block_hashes: &hashes,
        };
        Ok(slf.borrow_mut().core.cache_blocks(&view, n)?)
    }

    /// Frees the request's blocks, tail first (no-op for an unknown request).
    fn free(&mut self, request_id: &str) -> PyResult<()> {
        Ok(self.core.free(request_id)?)
    }

    /// Pops the request's bookkeeping; returns its blocks in allocation order.
    fn pop_blocks_for_free<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut this = slf.borrow_mut();
        let mut ids = std::mem::take(&mut this.scratch);
        ids.clear();
        this.core.pop_blocks_for_free(request_id, &mut ids);
        let result = Self::handles_list(slf, &mut this, &ids);
        this.scratch = ids;
        result
    }

    /// The request's blocks (empty list if unknown).
    fn get_blocks<'py>(slf: &Bound<'py, Self>, request_id: &str) -> PyResult<Bound<'py, PyList>> {
        let mut this = slf.borrow_mut();
        let ids = std::mem::take(&mut this.scratch);
        let mut ids = ids;
        ids.clear();
        ids.extend_from_slice(this.core.get_blocks(request_id));
        let result = Self::handles_list(slf, &mut this, &ids);
        this.scratch = ids;
        result
    }

    /// The request's block ids (empty list if unknown).
    fn get_block_ids(&self, request_id: &str) -> Vec<BlockId> {
        self.core.get_blocks(request_id).to_vec()
    }

    /// The request's `num_cached_block` (None if it has none).
    fn num_cached_block(&self, request_id: &str) -> Option<usize> {
        self.core
            .single_type_manager()
            .request(request_id)
            .and_then(|r| r.num_cached_block)
    }

    /// Ids of the requests that hold bookkeeping.
    fn request_ids(&self) -> Vec<String> {
        self.core
            .single_type_manager()
            .requests()
            .map(|(k, _)| k.to_owned())
            .collect()
    }

    /// Largest prefix length covered by a cached block of the request.
    fn estimate_cached_tokens(&self, request_id: &str) -> usize {
        self.core.estimate_cached_tokens(request_id)
    }

    /// Drops one reference per block, in the given order (first = evicted first).
    fn free_blocks(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        Self::ids_of(slf, blocks, &mut ids)?;
        Ok(slf.borrow_mut().core.block_pool_mut().free_blocks(ids)?)
    }

    /// Takes a reference on each block (removing free ones from the free queue).
    fn touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        Self::ids_of(slf, blocks, &mut ids)?;
        Ok(slf.borrow_mut().core.block_pool_mut().touch(&ids)?)
    }

    /// Hands out `num_blocks` blocks from the head of the free queue.
    fn get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = count("num_blocks", num_blocks)?;
        let mut this = slf.borrow_mut();
        let mut ids = Vec::with_capacity(n);
        this.core.block_pool_mut().get_new_blocks(n, &mut ids)?;
        Self::handles_list(slf, &mut this, &ids)
    }

    /// The first-inserted cached block of `(block_hash, group_id)`, or None.
    fn get_cached_block(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        group_id: u32,
    ) -> PyResult<Option<Py<PyKVCacheBlock>>> {
        let hash = hash_from_bytes(block_hash)?;
        let mut this = slf.borrow_mut();
        let id = this.core.block_pool().get_cached_block(&hash, group_id);
        Ok(id.map(|id| Self::handle(slf, &mut this, id)))
    }

    /// Drops the blocks from the prefix cache, in the given order.
    fn evict_blocks(&mut self, block_ids: Vec<i64>) -> PyResult<()> {
        Ok(self.core.evict_blocks(&block_ids)?)
    }

    /// Forgets every cached hash; False while any block is in use.
    fn reset_prefix_cache(&mut self) -> bool {
        self.core.reset_prefix_cache()
    }

    /// Free block ids from head (next to reuse) to tail.
    fn free_block_ids(&self) -> Vec<BlockId> {
        self.core
            .block_pool()
            .free_block_queue()
            .get_all_free_blocks()
    }

    /// Whether events wait to be taken.
    #[getter]
    fn has_events(&self) -> bool {
        self.core.block_pool().has_events()
    }

    /// Drains events as tuples: `("stored", group, start_block, end_block,
    /// block_size)`, `("removed", hash_bytes, group)`, `("cleared",)`.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for e in self.core.take_events() {
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

    /// Drains block ids recorded for worker-side zeroing.
    fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        self.core.take_new_block_ids()
    }

    /// Re-records the request's blocks from `start_token` on for zeroing.
    fn record_blocks_for_zeroing(&mut self, request_id: &str, start_token: i64) -> PyResult<()> {
        let start = count("start_token", start_token)?;
        Ok(self.core.record_blocks_for_zeroing(request_id, start)?)
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
        Ok(())
    }

    fn __clear__(&mut self) {
        self.handles.iter_mut().for_each(|h| *h = None);
    }
}
