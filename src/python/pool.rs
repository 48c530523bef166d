//! `KVCacheCore`'s pool-level methods, for the Python `BlockPool` view
//! (`python/hscache/vllm/block_pool.py`): what vLLM's Scheduler, connectors and
//! tests call on `kv_cache_manager.block_pool`.
//!
//! Every name carries a `core_` prefix so that it never shadows a vLLM method of the
//! manager. Conversion only: ids in, pool call, handles and bytes out. Each pool call
//! runs behind the manager's panic shield (`src/shield.rs`): mutating ones through
//! `KVCacheManager::shielded` (a panic poisons the manager), reads through
//! `KVCacheManager::read` (refused on a poisoned manager; a panic poisons nothing).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::block::PyKVCacheBlock;
use super::convert::blocks::{id_of, ids_of, split_pooled_ids};
use super::convert::hashes::{hash_from_bytes, key_from_bytes, PyListHashes};
use super::convert::request::{request_id, PyRequest};
use super::convert::{count_arg, u32_arg, BlockIdInt, Int};
use super::manager::PyKVCacheCore;
use crate::manager::{KVCacheManager, RequestLike};
use crate::stats::{self, Op};
use crate::types::BlockId;

#[pymethods]
impl PyKVCacheCore {
    /// Number of blocks, null block included.
    #[getter]
    fn num_gpu_blocks(&self) -> PyResult<u32> {
        self.core
            .read("num_gpu_blocks", |c| Ok(c.block_pool().num_gpu_blocks()))
    }

    /// Number of KV-cache groups.
    #[getter]
    fn num_kv_cache_groups(&self) -> PyResult<usize> {
        self.core
            .read("num_kv_cache_groups", |c| Ok(c.num_kv_cache_groups()))
    }

    /// Free blocks (evictable cached blocks included).
    #[getter]
    fn num_free_blocks(&self) -> PyResult<usize> {
        self.core.read("num_free_blocks", |c| {
            Ok(c.block_pool().get_num_free_blocks())
        })
    }

    /// Number of keys in the prefix-cache index.
    #[getter]
    fn num_cached_keys(&self) -> PyResult<usize> {
        self.core.read("num_cached_keys", |c| {
            Ok(c.block_pool().cached_block_hash_to_block().len())
        })
    }

    /// Whether events wait to be taken.
    #[getter]
    fn has_events(&self) -> PyResult<bool> {
        self.core
            .read("has_events", |c| Ok(c.block_pool().has_events()))
    }

    /// The handle of block `block_id`.
    fn block(slf: &Bound<'_, Self>, block_id: BlockIdInt) -> PyResult<Py<PyKVCacheBlock>> {
        let mut this = slf.try_borrow_mut()?;
        let id = this
            .core
            .read("block", |c| c.block_pool().check_block_id(block_id.0))?;
        Self::handle(slf, &mut this, id)
    }

    /// Drops one reference per block, in the given order (first = evicted first).
    fn core_free_blocks(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let _timer = stats::Timer::start(Op::FreeBlocks);
        let mut ids = Vec::new();
        let has_host = slf.try_borrow()?.core.host_group().is_some();
        if !has_host {
            ids_of(slf, blocks, &mut ids)?;
            slf.try_borrow_mut()?
                .core
                .shielded("free_blocks", |c| c.free_blocks(&ids))?;
            return Ok(());
        }
        // vLLM routes another pool's blocks to that pool, after its own.
        let mut host = Vec::new();
        split_pooled_ids(slf, blocks, &mut ids, &mut host)?;
        slf.try_borrow_mut()?
            .core
            .shielded("free_blocks", |c| c.free_blocks_mixed(&ids, &host))?;
        Self::flush(slf, None)
    }

    /// Takes a reference on each block (removing free ones from the free queue).
    fn core_touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        ids_of(slf, blocks, &mut ids)?;
        slf.try_borrow_mut()?
            .core
            .shielded("touch", |c| c.touch(&ids))?;
        Self::flush(slf, None)
    }

    /// Hands out `num_blocks` blocks from the head of the free queue.
    fn core_get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: Int,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = count_arg("num_blocks", num_blocks)?;
        let list = {
            let mut this = slf.try_borrow_mut()?;
            // No capacity up front: `n` is checked against the free blocks by the pool.
            let mut ids = Vec::new();
            this.core
                .shielded("get_new_blocks", |c| c.get_new_blocks(n, &mut ids))?;
            Self::handles_list(slf, &mut this, &ids)?
        };
        Self::flush(slf, None)?;
        Ok(list)
    }

    /// The first-inserted cached block of `(block_hash, group_id)`, or None.
    fn core_get_cached_block(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        group_id: Int,
    ) -> PyResult<Option<Py<PyKVCacheBlock>>> {
        let group_id = u32_arg("kv_cache_group_id", group_id)?;
        let hash = hash_from_bytes(block_hash)?;
        let mut this = slf.try_borrow_mut()?;
        let found = this.core.read("get_cached_block", |c| {
            Ok::<_, PyErr>(c.block_pool().get_cached_block(&hash, group_id))
        })?;
        match found {
            Some(id) => Ok(Some(Self::handle(slf, &mut this, id)?)),
            None => Ok(None),
        }
    }

    /// Drops the blocks from the prefix cache, in the given order.
    fn core_evict_blocks(slf: &Bound<'_, Self>, block_ids: Vec<BlockIdInt>) -> PyResult<()> {
        let block_ids: Vec<i64> = block_ids.into_iter().map(|b| b.0).collect();
        slf.try_borrow_mut()?
            .core
            .shielded("evict_blocks", |c| c.evict_blocks(&block_ids))?;
        Self::flush(slf, None)
    }

    /// Forgets every cached hash of the device pool; False while any block is in
    /// use (the pool's own `reset_prefix_cache`).
    fn core_reset_prefix_cache(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let ok = slf.try_borrow_mut()?.core.shielded(
            "reset_prefix_cache",
            KVCacheManager::reset_device_prefix_cache,
        )?;
        Self::flush(slf, None)?;
        Ok(ok)
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

    /// Free block ids from head (next to reuse) to tail.
    fn core_free_block_ids(&self) -> PyResult<Vec<BlockId>> {
        self.core.read("free_block_ids", |c| {
            Ok(c.block_pool().free_block_queue().get_all_free_blocks())
        })
    }

    /// The first (or, with `last`, the last) free block, or the opposite sentinel
    /// when the queue is empty (vLLM's `fake_free_list_head.next_free_block`).
    #[pyo3(signature = (last=false))]
    fn core_free_list_end(slf: &Bound<'_, Self>, last: bool) -> PyResult<Option<Py<PyAny>>> {
        let end = {
            let this = slf.try_borrow()?;
            this.core.read("free_list_end", |c| {
                let q = c.block_pool().free_block_queue();
                Ok::<_, PyErr>(if last { q.last() } else { q.first() })
            })?
        };
        Self::link_target(slf, end, !last)
    }

    /// Whether a block can be written by its sole owner (vLLM's `is_block_writable`).
    fn core_is_block_writable(slf: &Bound<'_, Self>, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = id_of(slf, block)?;
        slf.try_borrow()?.core.read("is_block_writable", |c| {
            Ok(c.block_pool().is_block_writable(id))
        })
    }

    /// The secondary keys of a block (vLLM's `cached_block_hashes_by_block[id]`), as
    /// `BlockHashWithGroupId` bytes.
    fn core_secondary_keys<'py>(
        &self,
        py: Python<'py>,
        block_id: BlockId,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        self.core.read("secondary_keys", |c| {
            Ok(c.block_pool()
                .cached_block_hash_to_block()
                .secondary_keys(block_id)
                .map(|k| PyBytes::new(py, &k.to_vllm_bytes()))
                .collect())
        })
    }

    /// Blocks that have secondary keys.
    fn core_blocks_with_secondary_keys(&self) -> PyResult<Vec<BlockId>> {
        self.core.read("blocks_with_secondary_keys", |c| {
            let mut ids: Vec<BlockId> = c
                .block_pool()
                .cached_block_hash_to_block()
                .blocks_with_secondary_keys()
                .collect();
            ids.sort_unstable();
            Ok(ids)
        })
    }

    /// Every `(key bytes, [block ids in insertion order])` of the index (vLLM's
    /// `BlockHashToBlockMap._cache`).
    #[allow(clippy::type_complexity)]
    fn core_index_items<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Bound<'py, PyBytes>, Vec<BlockId>)>> {
        self.core.read("index_items", |c| {
            Ok(c.block_pool()
                .cached_block_hash_to_block()
                .iter()
                .map(|(k, blocks)| (PyBytes::new(py, &k.to_vllm_bytes()), blocks))
                .collect())
        })
    }

    /// vLLM's `BlockHashToBlockMap.pop(key, block_id)`: the map forgets the pair but
    /// the block keeps its hash (a detached entry); whether the pair was there.
    fn core_index_pop(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyAny>,
        block_id: BlockId,
    ) -> PyResult<bool> {
        let key = key_from_bytes(key)?;
        Ok(slf.try_borrow_mut()?.core.shielded("index_pop", |c| {
            Ok(c.block_pool_mut()?.detach_entry(&key, block_id))
        })?)
    }

    /// vLLM's `_cache.pop(key)`: every block of `key` detached; their ids.
    fn core_index_detach_key(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<BlockId>> {
        let key = key_from_bytes(key)?;
        Ok(slf
            .try_borrow_mut()?
            .core
            .shielded("index_detach_key", |c| {
                let pool = c.block_pool_mut()?;
                let blocks = pool.cached_block_hash_to_block().get_all_blocks(&key);
                for &b in &blocks {
                    pool.detach_entry(&key, b);
                }
                Ok(blocks)
            })?)
    }

    /// vLLM's `_cache[key] = ...` restoring detached entries of `key`, in order.
    fn core_index_reattach(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyAny>,
        block_ids: Vec<BlockId>,
    ) -> PyResult<()> {
        let key = key_from_bytes(key)?;
        let refused = slf.try_borrow_mut()?.core.shielded("index_reattach", |c| {
            let pool = c.block_pool_mut()?;
            Ok(block_ids
                .into_iter()
                .find(|&b| !pool.reattach_entry(&key, b)))
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
    #[pyo3(signature = (request, blocks, num_cached_blocks, num_full_blocks, block_size,
        kv_cache_group_id, block_mask=None))]
    #[allow(clippy::too_many_arguments)]
    fn core_cache_full_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        num_cached_blocks: Int,
        num_full_blocks: Int,
        block_size: Int,
        kv_cache_group_id: Int,
        block_mask: Option<Vec<bool>>,
    ) -> PyResult<()> {
        let mut ids = Vec::new();
        ids_of(slf, blocks, &mut ids)?;
        let id = request_id(request)?;
        let req = PyRequest::read(request, id.to_str()?, None)?;
        let hashes = req.block_hashes().map_err(|e| req.error(e))?;
        let cached = count_arg("num_cached_blocks", num_cached_blocks)?;
        let full = count_arg("num_full_blocks", num_full_blocks)?;
        let block_size = count_arg("block_size", block_size)?;
        let kv_cache_group_id = u32_arg("kv_cache_group_id", kv_cache_group_id)?;
        slf.try_borrow_mut()?
            .core
            .shielded("cache_full_blocks", |c| {
                c.block_pool_mut()?.cache_full_blocks(
                    hashes,
                    &ids,
                    cached,
                    full,
                    block_size,
                    kv_cache_group_id,
                    block_mask.as_deref(),
                )
            })?;
        Self::flush(slf, Some(request))
    }

    /// vLLM's `cache_partial_block`: the key registered (bytes), or None for the
    /// null block.
    #[pyo3(signature = (request, block, num_tokens, kv_cache_group_id, block_size,
        replace_existing_hashes=false))]
    #[allow(clippy::too_many_arguments)]
    fn core_cache_partial_block<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        block: &Bound<'py, PyAny>,
        num_tokens: Int,
        kv_cache_group_id: Int,
        block_size: Int,
        replace_existing_hashes: bool,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let id = id_of(slf, block)?;
        let rid = request_id(request)?;
        let req = PyRequest::read(request, rid.to_str()?, None)?;
        let hashes = PyListHashes::new(&request.getattr("block_hashes")?)?;
        let num_tokens = count_arg("num_tokens", num_tokens)?;
        let block_size = count_arg("block_size", block_size)?;
        let kv_cache_group_id = u32_arg("kv_cache_group_id", kv_cache_group_id)?;
        let key = slf
            .try_borrow_mut()?
            .core
            .shielded("cache_partial_block", |c| {
                c.block_pool_mut()?.cache_partial_block(
                    &hashes,
                    id,
                    num_tokens,
                    kv_cache_group_id,
                    block_size,
                    replace_existing_hashes,
                )
            })
            .map_err(|e| req.error(e))?;
        Self::flush(slf, Some(request))?;
        Ok(key.map(|k| PyBytes::new(slf.py(), &k.to_vllm_bytes())))
    }

    /// vLLM's `_insert_block_hash(key, block, num_tokens)`.
    #[pyo3(signature = (key, block, num_tokens=None))]
    fn core_insert_block_hash(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
        num_tokens: Option<Int>,
    ) -> PyResult<()> {
        let key = key_from_bytes(key)?;
        let id = id_of(slf, block)?;
        let n = num_tokens.map(|n| count_arg("num_tokens", n)).transpose()?;
        Ok(slf
            .try_borrow_mut()?
            .core
            .shielded("insert_block_hash", |c| {
                c.block_pool_mut()?
                    .insert_block_hash_checked(key, id, n.unwrap_or(0))
            })?)
    }

    /// vLLM's `move_block_hashes(src, dst)`.
    fn core_move_block_hashes(
        slf: &Bound<'_, Self>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (s, d) = (id_of(slf, src)?, id_of(slf, dst)?);
        Ok(slf
            .try_borrow_mut()?
            .core
            .shielded("move_block_hashes", |c| {
                c.block_pool_mut()?.move_block_hashes(s, d)
            })?)
    }

    /// Builds and queues the events recorded so far (pool-level calls pass no
    /// request).
    #[pyo3(signature = (request=None))]
    fn core_flush_events(slf: &Bound<'_, Self>, request: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        Self::flush(slf, request.as_ref())
    }

    /// Drains event records as tuples (a bare core without an event sink).
    fn core_take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let records = self.core.shielded("take_events", |c| Ok(c.take_events()))?;
        super::events::records_to_py(py, records)
    }
}
