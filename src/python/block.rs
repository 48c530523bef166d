//! `KVCacheBlock`: the Python handle of one block, identity-stable per block id.
//!
//! vLLM's Scheduler stores block objects (deferred frees) and hands them back;
//! connectors read `block_id`, `block_hash`, `ref_cnt`, `is_null`. The handle holds
//! only its id and its pool; every field is read from the core on access. A
//! HiSparse layout has a second pool (the host pool of its source group): its
//! blocks are other handles (`is_host`), identity-stable per host block id.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::PyTraverseError;

use super::errors::UnsupportedError;
use super::manager::PyKVCacheCore;
use crate::pool::BlockPool;
use crate::types::{BlockId, NULL_BLOCK_ID};

#[pyclass(name = "KVCacheBlock", module = "hscache._core", frozen)]
pub struct PyKVCacheBlock {
    pub(crate) block_id: BlockId,
    pub(crate) core: Py<PyKVCacheCore>,
    /// A block of HiSparse's host pool.
    pub(crate) host: bool,
}

impl PyKVCacheBlock {
    fn with_pool<T>(&self, py: Python<'_>, f: impl FnOnce(&BlockPool) -> T) -> PyResult<T> {
        let core = self.core.bind(py).try_borrow()?;
        let pool = if self.host {
            core.core.host_pool().ok_or_else(|| {
                pyo3::exceptions::PyRuntimeError::new_err("the core has no host pool")
            })?
        } else {
            core.core.block_pool()
        };
        Ok(f(pool))
    }
}

#[pymethods]
impl PyKVCacheBlock {
    /// The block id (`0..num_gpu_blocks`; 0 is the null block).
    #[getter]
    fn block_id(&self) -> BlockId {
        self.block_id
    }

    /// Whether this is the null placeholder block.
    #[getter]
    fn is_null(&self) -> bool {
        self.block_id == NULL_BLOCK_ID
    }

    /// Current reference count (0 for free blocks; the null block's is 0 on vLLM
    /// 0.33 and counts touches minus frees on 0.32, possibly negative).
    #[getter]
    fn ref_cnt(&self, py: Python<'_>) -> PyResult<i64> {
        self.with_pool(py, |p| p.vllm_ref_cnt(self.block_id))
    }

    /// Whether this block belongs to HiSparse's host pool.
    #[getter]
    fn is_host(&self) -> bool {
        self.host
    }

    /// vLLM's `BlockHashWithGroupId` bytes (hash + 4-byte big-endian group id), or
    /// None when the block is not cached.
    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let key = self.with_pool(py, |p| p.block_hash(self.block_id).copied())?;
        Ok(key.map(|k| PyBytes::new(py, &k.to_vllm_bytes())))
    }

    /// Prefix length (tokens) the block's hash covers, or None.
    #[getter]
    fn block_hash_num_tokens(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        self.with_pool(py, |p| p.block_hash_num_tokens(self.block_id))
    }

    /// The next block in the free queue (vLLM's intrusive link): a block, the
    /// queue's tail sentinel at the end, or None when this block is not free.
    #[getter]
    fn next_free_block(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        PyKVCacheCore::free_list_neighbor(self.core.bind(py), self.block_id, self.host, false)
    }

    /// The previous block in the free queue: a block, the head sentinel at the
    /// start, or None when this block is not free.
    #[getter]
    fn prev_free_block(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        PyKVCacheCore::free_list_neighbor(self.core.bind(py), self.block_id, self.host, true)
    }

    /// The core this block belongs to.
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyKVCacheCore> {
        self.core.clone_ref(py)
    }

    /// vLLM's blocks are mutable dataclasses; these handles read the core, which
    /// alone changes a block (`BlockPool.touch`, `free_blocks`, caching, eviction).
    fn __setattr__(&self, name: &str, _value: &Bound<'_, PyAny>) -> PyResult<()> {
        Err(UnsupportedError::new_err(format!(
            "KVCacheBlock.{name} is read from hscache's core and cannot be set; change \
             blocks through the block pool (touch, free_blocks) or the KVCacheManager"
        )))
    }

    /// vLLM's `reset_hash` (the pool's eviction step): the core evicts.
    fn reset_hash(&self) -> PyResult<()> {
        Err(UnsupportedError::new_err(
            "KVCacheBlock.reset_hash: hscache's core evicts blocks itself; use \
             block_pool.evict_blocks or reset_prefix_cache",
        ))
    }

    /// vLLM's `set_block_hash` (the pool's caching step): the core caches.
    #[pyo3(signature = (block_hash, num_tokens: "Any" = None))]
    fn set_block_hash(
        &self,
        block_hash: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = (block_hash, num_tokens);
        Err(UnsupportedError::new_err(
            "KVCacheBlock.set_block_hash: hscache's core caches blocks itself; use \
             block_pool.cache_full_blocks or the KVCacheManager",
        ))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let ref_cnt = self
            .with_pool(py, |p| p.vllm_ref_cnt(self.block_id))
            .unwrap_or(0);
        format!(
            "KVCacheBlock(block_id={}, ref_cnt={ref_cnt}, is_null={})",
            self.block_id,
            self.block_id == NULL_BLOCK_ID
        )
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.core)
    }
}
