//! `BlockPoolCore`: one block pool of a `KVCacheCore` (the device pool, or
//! HiSparse's host pool), for the Python `BlockPool` views
//! (`python/hscache/vllm/block_pool.py`, `HostBlockPool` in
//! `python/hscache/vllm/hisparse.py`): what vLLM's Scheduler, connectors and tests
//! call on `kv_cache_manager.block_pool` and on HiSparse's host pool.
//!
//! One class for both pools: a view is built with the pool it addresses
//! (`BlockPoolCore(manager, host=False)`), so a pool method is written once and the
//! host pool has no twins. The view holds its owner (`Py<KVCacheCore>`) and
//! borrows it per call, like `KVCacheBlock`: the one circle of the bindings (the
//! concept map's *Import circles*).
//!
//! Conversion only: ids in, pool call, handles and bytes out; every rule (vLLM's
//! `is_block_writable` included) is the core pool's. Each call runs behind the
//! manager's panic shield (`src/shield.rs`): mutating ones through
//! `KVCacheManager::shielded` (the device pool) or `KVCacheManager::host_pool_call`
//! (the host pool; a panic poisons the manager), reads through
//! `KVCacheManager::read` (refused on a poisoned manager; a panic poisons nothing).
//! Where the device pool's call is the manager's own (`touch`, `get_new_blocks`,
//! `free_blocks`, `evict_blocks`, `reset_prefix_cache`: they also run the manager's
//! watchers and route another pool's blocks), the device view calls the manager.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use pyo3::PyTraverseError;

use super::block::PyKVCacheBlock;
use super::convert::blocks::{id_in, ids_in, ids_of, split_pooled_ids};
use super::convert::hashes::{hash_from_bytes, key_from_bytes, PyListHashes};
use super::convert::request::{request_id, PyRequest};
use super::convert::{count_arg, u32_arg, BlockIdInt, Int};
use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;
use crate::manager::{KVCacheManager, RequestLike};
use crate::pool::BlockPool;
use crate::stats::{self, Op};
use crate::types::BlockId;

#[pyclass(name = "BlockPoolCore", module = "hscache._core", frozen)]
pub struct PyBlockPoolCore {
    /// The manager whose pool this is (borrowed per call).
    owner: Py<PyKVCacheCore>,
    /// HiSparse's host pool rather than the device pool.
    host: bool,
}

/// The pool a view addresses.
fn pool_of(core: &KVCacheManager, host: bool) -> PyResult<&BlockPool> {
    if host {
        core.host_pool()
            .ok_or_else(|| InvalidArgumentError::new_err("this KV-cache layout has no host pool"))
    } else {
        Ok(core.block_pool())
    }
}

impl PyBlockPoolCore {
    /// Reads the pool behind the manager's read shield.
    fn read<T>(&self, py: Python<'_>, what: &str, f: impl FnOnce(&BlockPool) -> T) -> PyResult<T> {
        let this = self.owner.bind(py).try_borrow()?;
        let host = self.host;
        this.core.read(what, |c| pool_of(c, host).map(f))
    }

    /// Runs a pool-level mutation behind the manager's shield.
    fn mutate<T>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mut BlockPool) -> crate::error::Result<T>,
    ) -> PyResult<T> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        if self.host {
            Ok(this.core.host_pool_call(f)?)
        } else {
            Ok(this.core.shielded(what, |c| f(c.block_pool_mut()?))?)
        }
    }

    /// The handle of block `id` of this pool.
    fn handle(&self, py: Python<'_>, id: BlockId) -> PyResult<Py<PyKVCacheBlock>> {
        let owner = self.owner.bind(py);
        let mut this = owner.try_borrow_mut()?;
        PyKVCacheCore::pool_handle(owner, &mut this, id, self.host)
    }

    /// The id of a handle of this pool.
    fn id(&self, py: Python<'_>, block: &Bound<'_, PyAny>) -> PyResult<BlockId> {
        id_in(self.owner.bind(py), block, self.host)
    }

    /// The ids of an iterable of handles of this pool.
    fn ids(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
        let mut ids = Vec::new();
        if self.host {
            ids_in(self.owner.bind(py), blocks, true, &mut ids)?;
        } else {
            ids_of(self.owner.bind(py), blocks, &mut ids)?;
        }
        Ok(ids)
    }

    /// Builds and queues the events the call recorded.
    fn flush(&self, py: Python<'_>, request: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        PyKVCacheCore::flush(self.owner.bind(py), request)
    }
}

#[pymethods]
impl PyBlockPoolCore {
    /// The pool of `owner`: its device pool, or (`host`) HiSparse's host pool.
    #[new]
    #[pyo3(signature = (owner, host=false))]
    fn new(owner: &Bound<'_, PyKVCacheCore>, host: bool) -> PyResult<Self> {
        pool_of(&owner.try_borrow()?.core, host)?;
        Ok(Self {
            owner: owner.clone().unbind(),
            host,
        })
    }

    /// Whether this is HiSparse's host pool.
    #[getter]
    fn is_host(&self) -> bool {
        self.host
    }

    /// Number of blocks, null block included.
    #[getter]
    fn num_gpu_blocks(&self, py: Python<'_>) -> PyResult<u32> {
        self.read(py, "num_gpu_blocks", BlockPool::num_gpu_blocks)
    }

    /// Free blocks (evictable cached blocks included).
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, "num_free_blocks", BlockPool::get_num_free_blocks)
    }

    /// The fraction of blocks in use (the null block excluded).
    #[getter]
    fn usage(&self, py: Python<'_>) -> PyResult<f64> {
        self.read(py, "usage", BlockPool::get_usage)
    }

    /// Number of keys in the prefix-cache index.
    #[getter]
    fn num_cached_keys(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, "num_cached_keys", |p| {
            p.cached_block_hash_to_block().len()
        })
    }

    /// Whether events wait to be taken.
    #[getter]
    fn has_events(&self, py: Python<'_>) -> PyResult<bool> {
        self.read(py, "has_events", BlockPool::has_events)
    }

    /// The handle of block `block_id`.
    #[pyo3(signature = (block_id: "int"))]
    fn block(&self, py: Python<'_>, block_id: BlockIdInt) -> PyResult<Py<PyKVCacheBlock>> {
        let id = self.read(py, "block", |p| p.check_block_id(block_id.0))??;
        self.handle(py, id)
    }

    /// Drops one reference per block, in the given order (first = evicted first).
    /// The device pool routes the host pool's blocks to that pool, after its own,
    /// as vLLM does.
    #[pyo3(signature = (blocks: "Iterable[KVCacheBlock]"))]
    fn free_blocks(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let _timer = stats::Timer::start(Op::FreeBlocks);
        let owner = self.owner.bind(py);
        if self.host {
            let ids = self.ids(py, blocks)?;
            self.mutate(py, "free_blocks", |p| p.free_blocks(&ids))?;
            return self.flush(py, None);
        }
        let mut ids = Vec::new();
        if owner.try_borrow()?.core.host_group().is_none() {
            ids_of(owner, blocks, &mut ids)?;
            owner
                .try_borrow_mut()?
                .core
                .shielded("free_blocks", |c| c.free_blocks(&ids))?;
            return Ok(());
        }
        let mut host = Vec::new();
        split_pooled_ids(owner, blocks, &mut ids, &mut host)?;
        owner
            .try_borrow_mut()?
            .core
            .shielded("free_blocks", |c| c.free_blocks_mixed(&ids, &host))?;
        self.flush(py, None)
    }

    /// Takes a reference on each block (removing free ones from the free queue).
    #[pyo3(signature = (blocks: "Iterable[KVCacheBlock]"))]
    fn touch(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self.ids(py, blocks)?;
        if self.host {
            self.mutate(py, "touch", |p| p.touch(&ids))?;
        } else {
            self.owner
                .bind(py)
                .try_borrow_mut()?
                .core
                .shielded("touch", |c| c.touch(&ids))?;
        }
        self.flush(py, None)
    }

    /// Hands out `num_blocks` blocks from the head of the free queue.
    #[pyo3(signature = (num_blocks: "int") -> "list[KVCacheBlock]")]
    fn get_new_blocks<'py>(
        &self,
        py: Python<'py>,
        num_blocks: Int,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = count_arg("num_blocks", num_blocks)?;
        // No capacity up front: `n` is checked against the free blocks by the pool.
        let mut ids = Vec::new();
        if self.host {
            self.mutate(py, "get_new_blocks", |p| p.get_new_blocks(n, &mut ids))?;
        } else {
            self.owner
                .bind(py)
                .try_borrow_mut()?
                .core
                .shielded("get_new_blocks", |c| c.get_new_blocks(n, &mut ids))?;
        }
        let list = {
            let owner = self.owner.bind(py);
            let mut this = owner.try_borrow_mut()?;
            PyKVCacheCore::pool_handles_list(owner, &mut this, &ids, self.host)?
        };
        self.flush(py, None)?;
        Ok(list)
    }

    /// The first-inserted cached block of `(block_hash, group_id)`, or None.
    #[pyo3(signature = (block_hash: "bytes", group_id: "int"))]
    fn get_cached_block(
        &self,
        py: Python<'_>,
        block_hash: &Bound<'_, PyAny>,
        group_id: Int,
    ) -> PyResult<Option<Py<PyKVCacheBlock>>> {
        let group_id = u32_arg("kv_cache_group_id", group_id)?;
        let hash = hash_from_bytes(block_hash)?;
        let found = self.read(py, "get_cached_block", |p| {
            p.get_cached_block(&hash, group_id)
        })?;
        found.map(|id| self.handle(py, id)).transpose()
    }

    /// Drops the blocks from the prefix cache, in the given order.
    #[pyo3(signature = (block_ids: "list[int]"))]
    fn evict_blocks(&self, py: Python<'_>, block_ids: Vec<BlockIdInt>) -> PyResult<()> {
        let block_ids: Vec<i64> = block_ids.into_iter().map(|b| b.0).collect();
        if self.host {
            self.mutate(py, "evict_blocks", |p| p.evict_blocks(&block_ids))?;
        } else {
            self.owner
                .bind(py)
                .try_borrow_mut()?
                .core
                .shielded("evict_blocks", |c| c.evict_blocks(&block_ids))?;
        }
        self.flush(py, None)
    }

    /// Forgets every cached hash of this pool; False while any block is in use
    /// (the pool's own `reset_prefix_cache`; the manager's resets every pool).
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        let ok = if self.host {
            self.mutate(py, "reset_prefix_cache", |p| Ok(p.reset_prefix_cache()))?
        } else {
            self.owner.bind(py).try_borrow_mut()?.core.shielded(
                "reset_prefix_cache",
                KVCacheManager::reset_device_prefix_cache,
            )?
        };
        self.flush(py, None)?;
        Ok(ok)
    }

    /// Free block ids from head (next to reuse) to tail.
    fn free_block_ids(&self, py: Python<'_>) -> PyResult<Vec<BlockId>> {
        self.read(py, "free_block_ids", |p| {
            p.free_block_queue().get_all_free_blocks()
        })
    }

    /// The first (or, with `last`, the last) free block. When the queue is empty:
    /// the device pool's opposite sentinel (vLLM's
    /// `fake_free_list_head.next_free_block`); None for the host pool, whose queue
    /// ends have no sentinel objects.
    #[pyo3(signature = (last=false) -> "Any")]
    fn free_list_end(&self, py: Python<'_>, last: bool) -> PyResult<Option<Py<PyAny>>> {
        let end = self.read(py, "free_list_end", |p| {
            let q = p.free_block_queue();
            if last {
                q.last()
            } else {
                q.first()
            }
        })?;
        if self.host {
            return end
                .map(|id| Ok(self.handle(py, id)?.into_any()))
                .transpose();
        }
        PyKVCacheCore::link_target(self.owner.bind(py), end, !last)
    }

    /// Whether a block can be written by its sole owner (vLLM's `is_block_writable`).
    #[pyo3(signature = (block: "KVCacheBlock"))]
    fn is_block_writable(&self, py: Python<'_>, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = self.id(py, block)?;
        self.read(py, "is_block_writable", |p| p.is_block_writable(id))
    }

    /// The secondary keys of a block (vLLM's `cached_block_hashes_by_block[id]`), as
    /// `BlockHashWithGroupId` bytes.
    #[pyo3(signature = (block_id: "int"))]
    fn secondary_keys<'py>(
        &self,
        py: Python<'py>,
        block_id: BlockId,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        self.read(py, "secondary_keys", |p| {
            p.cached_block_hash_to_block()
                .secondary_keys(block_id)
                .map(|k| PyBytes::new(py, &k.to_vllm_bytes()))
                .collect()
        })
    }

    /// Blocks that have secondary keys, in id order.
    fn blocks_with_secondary_keys(&self, py: Python<'_>) -> PyResult<Vec<BlockId>> {
        self.read(py, "blocks_with_secondary_keys", |p| {
            let mut ids: Vec<BlockId> = p
                .cached_block_hash_to_block()
                .blocks_with_secondary_keys()
                .collect();
            ids.sort_unstable();
            ids
        })
    }

    /// Every `(key bytes, [block ids in insertion order])` of the index (vLLM's
    /// `BlockHashToBlockMap._cache`).
    #[allow(clippy::type_complexity)]
    fn index_items<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Bound<'py, PyBytes>, Vec<BlockId>)>> {
        self.read(py, "index_items", |p| {
            p.cached_block_hash_to_block()
                .iter()
                .map(|(k, blocks)| (PyBytes::new(py, &k.to_vllm_bytes()), blocks))
                .collect()
        })
    }

    /// vLLM's `BlockHashToBlockMap.pop(key, block_id)`: the map forgets the pair but
    /// the block keeps its hash (a detached entry); whether the pair was there.
    #[pyo3(signature = (key: "bytes", block_id: "int"))]
    fn index_pop(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        block_id: BlockId,
    ) -> PyResult<bool> {
        let key = key_from_bytes(key)?;
        self.mutate(py, "index_pop", |p| Ok(p.detach_entry(&key, block_id)))
    }

    /// vLLM's `_cache.pop(key)`: every block of `key` detached; their ids.
    #[pyo3(signature = (key: "bytes"))]
    fn index_detach_key(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
        let key = key_from_bytes(key)?;
        self.mutate(py, "index_detach_key", |p| {
            let blocks = p.cached_block_hash_to_block().get_all_blocks(&key);
            for &b in &blocks {
                p.detach_entry(&key, b);
            }
            Ok(blocks)
        })
    }

    /// vLLM's `_cache[key] = ...` restoring detached entries of `key`, in order.
    #[pyo3(signature = (key: "bytes", block_ids: "list[int]"))]
    fn index_reattach(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        block_ids: Vec<BlockId>,
    ) -> PyResult<()> {
        let key = key_from_bytes(key)?;
        let refused = self.mutate(py, "index_reattach", |p| {
            Ok(block_ids.into_iter().find(|&b| !p.reattach_entry(&key, b)))
        })?;
        match refused {
            None => Ok(()),
            Some(b) => Err(super::errors::UnsupportedError::new_err(format!(
                "_cache[key] = ... only restores entries popped from the map (block {b})"
            ))),
        }
    }

    /// vLLM's `cache_full_blocks(request, blocks, num_cached_blocks,
    /// num_full_blocks, block_size, kv_cache_group_id, block_mask)`.
    #[pyo3(signature = (request, blocks: "Iterable[KVCacheBlock]", num_cached_blocks: "int", num_full_blocks: "int", block_size: "int", kv_cache_group_id: "int", block_mask: "list[bool] | None"=None))]
    #[allow(clippy::too_many_arguments)]
    fn cache_full_blocks(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        num_cached_blocks: Int,
        num_full_blocks: Int,
        block_size: Int,
        kv_cache_group_id: Int,
        block_mask: Option<Vec<bool>>,
    ) -> PyResult<()> {
        let ids = self.ids(py, blocks)?;
        let id = request_id(request)?;
        let req = PyRequest::read(request, id.to_str()?, None)?;
        let hashes = req.block_hashes().map_err(|e| req.error(e))?;
        let cached = count_arg("num_cached_blocks", num_cached_blocks)?;
        let full = count_arg("num_full_blocks", num_full_blocks)?;
        let block_size = count_arg("block_size", block_size)?;
        let kv_cache_group_id = u32_arg("kv_cache_group_id", kv_cache_group_id)?;
        self.mutate(py, "cache_full_blocks", |p| {
            p.cache_full_blocks(
                hashes,
                &ids,
                cached,
                full,
                block_size,
                kv_cache_group_id,
                block_mask.as_deref(),
            )
        })?;
        self.flush(py, Some(request))
    }

    /// vLLM's `cache_partial_block`: the key registered (bytes), or None for the
    /// null block.
    #[pyo3(signature = (request, block: "KVCacheBlock", num_tokens: "int", kv_cache_group_id: "int", block_size: "int", replace_existing_hashes=false))]
    #[allow(clippy::too_many_arguments)]
    fn cache_partial_block<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        block: &Bound<'py, PyAny>,
        num_tokens: Int,
        kv_cache_group_id: Int,
        block_size: Int,
        replace_existing_hashes: bool,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let id = self.id(py, block)?;
        let rid = request_id(request)?;
        let req = PyRequest::read(request, rid.to_str()?, None)?;
        let hashes = PyListHashes::new(&request.getattr("block_hashes")?)?;
        let num_tokens = count_arg("num_tokens", num_tokens)?;
        let block_size = count_arg("block_size", block_size)?;
        let kv_cache_group_id = u32_arg("kv_cache_group_id", kv_cache_group_id)?;
        let key = {
            let mut this = self.owner.bind(py).try_borrow_mut()?;
            let op = |p: &mut BlockPool| {
                p.cache_partial_block(
                    &hashes,
                    id,
                    num_tokens,
                    kv_cache_group_id,
                    block_size,
                    replace_existing_hashes,
                )
            };
            if self.host {
                this.core.host_pool_call(op)
            } else {
                this.core
                    .shielded("cache_partial_block", |c| op(c.block_pool_mut()?))
            }
            .map_err(|e| req.error(e))?
        };
        self.flush(py, Some(request))?;
        Ok(key.map(|k| PyBytes::new(py, &k.to_vllm_bytes())))
    }

    /// vLLM's `_insert_block_hash(key, block, num_tokens)`.
    #[pyo3(signature = (key: "bytes", block: "KVCacheBlock", num_tokens: "int | None"=None))]
    fn insert_block_hash(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
        num_tokens: Option<Int>,
    ) -> PyResult<()> {
        let key = key_from_bytes(key)?;
        let id = self.id(py, block)?;
        let n = num_tokens.map(|n| count_arg("num_tokens", n)).transpose()?;
        self.mutate(py, "insert_block_hash", |p| {
            p.insert_block_hash_checked(key, id, n.unwrap_or(0))
        })
    }

    /// vLLM's `move_block_hashes(src, dst)`.
    #[pyo3(signature = (src: "KVCacheBlock", dst: "KVCacheBlock"))]
    fn move_block_hashes(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (s, d) = (self.id(py, src)?, self.id(py, dst)?);
        self.mutate(py, "move_block_hashes", |p| p.move_block_hashes(s, d))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.owner)
    }
}
