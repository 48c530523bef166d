//! `BlockPool`: block ref counts, the free queue, the prefix-cache index and events.
//!
//! Mirrors vLLM 0.33 `v1/core/block_pool.py::BlockPool` as a struct of arrays over
//! `u32` block ids.
//!
//! Key properties:
//! - Block 0 is the null block: popped from the free queue at construction, never
//!   hashed, never ref-counted, skipped by `touch` and `free_blocks`, excluded from
//!   `usage`.
//! - A non-null block is in the free queue iff its ref count is 0.
//! - Eviction is lazy: a freed hashed block stays indexed while it waits in the free
//!   queue and is evicted only when `get_new_blocks` hands it out again, by
//!   `evict_blocks`, or by `reset_prefix_cache`.
//! - `free_blocks` puts blocks that reach ref count 0 at the head if they have no
//!   hash (or caching is off): LIFO reuse; hashed ones at the tail in the given
//!   order: LRU, and a request's chain tail is evicted before its prefix because
//!   callers free tables in reverse.
//! - Every method validates first and mutates after: an `Err` changes nothing.
//!
//! Not implemented here (the adapter falls back to vLLM for the configurations
//! that need them): partial (sub-block) cache entries and their secondary keys,
//! `move_block_hashes` (Mamba copy-on-write), reuse watchers (`unpin_blocks`),
//! block-residency metrics.

use crate::error::{Error, Result};
use crate::events::KVCacheEvent;
use crate::free_queue::FreeKVCacheBlockQueue;
use crate::hash_index::BlockHashToBlockMap;
use crate::types::{BlockHash, BlockHashSource, BlockHashWithGroupId, BlockId, NULL_BLOCK_ID};

/// The block pool (see module docs).
#[derive(Clone, Debug)]
pub struct BlockPool {
    num_gpu_blocks: u32,
    enable_caching: bool,
    hash_block_size: usize,
    enable_kv_cache_events: bool,
    ref_cnt: Vec<u32>,
    block_hash_num_tokens: Vec<u32>,
    free_block_queue: FreeKVCacheBlockQueue,
    cached_block_hash_to_block: BlockHashToBlockMap,
    events: Vec<KVCacheEvent>,
    scratch_first: Vec<BlockId>,
    scratch_last: Vec<BlockId>,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (block 0 becomes the null block).
    pub fn new(
        num_gpu_blocks: u32,
        enable_caching: bool,
        hash_block_size: usize,
        enable_kv_cache_events: bool,
    ) -> Result<Self> {
        if num_gpu_blocks == 0 || num_gpu_blocks >= u32::MAX - 2 {
            return Err(Error::InvalidArgument(format!(
                "num_gpu_blocks must be in 1..{}, got {num_gpu_blocks}",
                u32::MAX - 2
            )));
        }
        if hash_block_size == 0 {
            return Err(Error::InvalidArgument("hash_block_size must be > 0".into()));
        }
        let n = num_gpu_blocks as usize;
        let mut free_block_queue = FreeKVCacheBlockQueue::new(num_gpu_blocks);
        let null = free_block_queue.popleft()?;
        debug_assert_eq!(null, NULL_BLOCK_ID);
        Ok(Self {
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            ref_cnt: vec![0; n],
            block_hash_num_tokens: vec![0; n],
            free_block_queue,
            cached_block_hash_to_block: BlockHashToBlockMap::new(n),
            events: Vec::new(),
            scratch_first: Vec::new(),
            scratch_last: Vec::new(),
        })
    }

    /// Number of blocks, null block included.
    #[inline]
    pub fn num_gpu_blocks(&self) -> u32 {
        self.num_gpu_blocks
    }

    /// Whether prefix caching is on.
    #[inline]
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// Tokens per hash block.
    #[inline]
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// Whether events are recorded.
    #[inline]
    pub fn enable_kv_cache_events(&self) -> bool {
        self.enable_kv_cache_events
    }

    /// `Err` unless `block_id` names a block of this pool.
    #[inline]
    pub fn check_block_id(&self, block_id: i64) -> Result<BlockId> {
        if block_id >= 0 && block_id < self.num_gpu_blocks as i64 {
            Ok(block_id as BlockId)
        } else {
            Err(Error::BlockIdOutOfRange {
                block_id,
                num_blocks: self.num_gpu_blocks,
            })
        }
    }

    /// Reference count of a block (the null block's is not maintained: 0).
    #[inline]
    pub fn ref_cnt(&self, block_id: BlockId) -> u32 {
        self.ref_cnt[block_id as usize]
    }

    /// The primary hash key of a block, if it is cached.
    #[inline]
    pub fn block_hash(&self, block_id: BlockId) -> Option<&BlockHashWithGroupId> {
        self.cached_block_hash_to_block.key_of(block_id)
    }

    /// The prefix length (tokens) the block's hash covers, if it is cached.
    #[inline]
    pub fn block_hash_num_tokens(&self, block_id: BlockId) -> Option<u32> {
        self.block_hash(block_id)
            .map(|_| self.block_hash_num_tokens[block_id as usize])
    }

    /// The free queue (read only).
    #[inline]
    pub fn free_block_queue(&self) -> &FreeKVCacheBlockQueue {
        &self.free_block_queue
    }

    /// The prefix-cache index (read only).
    #[inline]
    pub fn cached_block_hash_to_block(&self) -> &BlockHashToBlockMap {
        &self.cached_block_hash_to_block
    }

    /// Number of free blocks (evictable cached blocks included).
    #[inline]
    pub fn get_num_free_blocks(&self) -> usize {
        self.free_block_queue.num_free_blocks()
    }

    /// KV-cache usage in `[0, 1]`, the null block excluded.
    pub fn get_usage(&self) -> f64 {
        let total = self.num_gpu_blocks as usize - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - (self.get_num_free_blocks() as f64 / total as f64)
    }

    /// The first-inserted block cached under `(hash, group_id)`.
    #[inline]
    pub fn get_cached_block(&self, hash: &BlockHash, group_id: u32) -> Option<BlockId> {
        self.cached_block_hash_to_block
            .get_one_block(&BlockHashWithGroupId {
                hash: *hash,
                group_id,
            })
    }

    /// Hands out `n` blocks from the head of the free queue (appended to `out`),
    /// evicting the cached ones among them.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        let start = out.len();
        self.free_block_queue.popleft_n(n, out)?;
        for &id in &out[start..] {
            if self.enable_caching {
                Self::evict_cached(
                    &mut self.cached_block_hash_to_block,
                    self.enable_kv_cache_events.then_some(&mut self.events),
                    id,
                );
            }
            self.ref_cnt[id as usize] = 1;
        }
        Ok(())
    }

    /// Drops the block's hash from the index (emitting `BlockRemoved`); returns
    /// whether a key was removed.
    fn maybe_evict_cached_block(&mut self, block_id: BlockId) -> bool {
        Self::evict_cached(
            &mut self.cached_block_hash_to_block,
            self.enable_kv_cache_events.then_some(&mut self.events),
            block_id,
        )
    }

    /// `maybe_evict_cached_block` over split borrows, so that callers iterating
    /// another field of the pool can use it.
    fn evict_cached(
        index: &mut BlockHashToBlockMap,
        events: Option<&mut Vec<KVCacheEvent>>,
        block_id: BlockId,
    ) -> bool {
        let Some(key) = index.remove_block(block_id) else {
            return false;
        };
        if let Some(events) = events {
            events.push(KVCacheEvent::BlockRemoved { key });
        }
        true
    }

    /// Takes a reference on each block, removing ref-0 ones from the free queue
    /// (a prefix hit on an evictable cached block protects it from eviction).
    pub fn touch(&mut self, block_ids: &[BlockId]) -> Result<()> {
        for &id in block_ids {
            self.check_block_id(id as i64)?;
            if id != NULL_BLOCK_ID
                && self.ref_cnt[id as usize] == 0
                && !self.free_block_queue.contains(id)
            {
                return Err(Error::NotInFreeQueue(id));
            }
        }
        for &id in block_ids {
            if id == NULL_BLOCK_ID {
                continue;
            }
            if self.ref_cnt[id as usize] == 0 {
                self.free_block_queue.remove(id)?;
            }
            self.ref_cnt[id as usize] += 1;
        }
        Ok(())
    }

    /// Checks that dropping one reference per listed block (in any number of
    /// `free_blocks` calls) would succeed: ids in range, no reference dropped twice
    /// more than held. Nothing changes.
    pub fn check_free(&mut self, ids: impl Iterator<Item = BlockId> + Clone) -> Result<()> {
        let mut failure = None;
        let mut taken = 0usize;
        for id in ids.clone() {
            if let Err(e) = self.check_block_id(id as i64) {
                failure = Some(e);
                break;
            }
            if id != NULL_BLOCK_ID {
                let rc = &mut self.ref_cnt[id as usize];
                if *rc == 0 {
                    failure = Some(Error::DoubleFree(id));
                    break;
                }
                *rc -= 1;
            }
            taken += 1;
        }
        // Restore every reference taken above.
        for id in ids.take(taken) {
            if id != NULL_BLOCK_ID {
                self.ref_cnt[id as usize] += 1;
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Drops one reference per listed block, first = evicted first (see module docs).
    pub fn free_blocks<I>(&mut self, ordered_blocks: I) -> Result<()>
    where
        I: IntoIterator<Item = BlockId>,
        I::IntoIter: Clone,
    {
        let iter = ordered_blocks.into_iter();
        let mut first = std::mem::take(&mut self.scratch_first);
        let mut last = std::mem::take(&mut self.scratch_last);
        first.clear();
        last.clear();
        let mut failure = None;
        let mut processed = 0usize;
        for id in iter.clone() {
            if let Err(e) = self.check_block_id(id as i64) {
                failure = Some(e);
                break;
            }
            if id == NULL_BLOCK_ID {
                processed += 1;
                continue;
            }
            let rc = &mut self.ref_cnt[id as usize];
            if *rc == 0 {
                failure = Some(Error::DoubleFree(id));
                break;
            }
            *rc -= 1;
            if *rc == 0 {
                if self.block_hash(id).is_none() || !self.enable_caching {
                    first.push(id);
                } else {
                    last.push(id);
                }
            }
            processed += 1;
        }
        if let Some(e) = failure {
            // Undo the decrements of this call: the state is as before.
            for id in iter.take(processed) {
                if id != NULL_BLOCK_ID {
                    self.ref_cnt[id as usize] += 1;
                }
            }
            self.scratch_first = first;
            self.scratch_last = last;
            return Err(e);
        }
        let result = self
            .free_block_queue
            .prepend_n(&first)
            .and_then(|()| self.free_block_queue.append_n(&last));
        self.scratch_first = first;
        self.scratch_last = last;
        result
    }

    /// Caches `table[num_cached_blocks..num_full_blocks]` under the request's
    /// hashes (vLLM's `cache_full_blocks`); duplicates of existing keys are indexed
    /// too. Records one `BlockStored` event when events are on.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_full_blocks<H: BlockHashSource + ?Sized>(
        &mut self,
        block_hashes: &H,
        table: &[BlockId],
        num_cached_blocks: usize,
        num_full_blocks: usize,
        block_size: usize,
        group_id: u32,
    ) -> Result<()> {
        if num_cached_blocks >= num_full_blocks {
            return Ok(());
        }
        Self::check_cacheable(
            self,
            block_hashes,
            table,
            num_cached_blocks,
            num_full_blocks,
        )?;
        for (i, &id) in table
            .iter()
            .enumerate()
            .take(num_full_blocks)
            .skip(num_cached_blocks)
        {
            if id == NULL_BLOCK_ID {
                continue;
            }
            let key = BlockHashWithGroupId {
                hash: block_hashes.get(i)?,
                group_id,
            };
            let num_tokens = ((i + 1) * block_size) as u32;
            // The index maps a key to a block iff it is the block's hash (no
            // secondary keys here), so this one check stands for vLLM's `contain`.
            if self.block_hash(id) == Some(&key) {
                continue;
            }
            self.block_hash_num_tokens[id as usize] = num_tokens;
            self.cached_block_hash_to_block.insert(key, id);
        }
        if self.enable_kv_cache_events {
            self.events.push(KVCacheEvent::BlockStored {
                group_id,
                start_block: num_cached_blocks as u32,
                end_block: num_full_blocks as u32,
                block_size: block_size as u32,
            });
        }
        Ok(())
    }

    /// Validation of `cache_full_blocks`' arguments, without side effects.
    pub fn check_cacheable<H: BlockHashSource + ?Sized>(
        &self,
        block_hashes: &H,
        table: &[BlockId],
        num_cached_blocks: usize,
        num_full_blocks: usize,
    ) -> Result<()> {
        if num_full_blocks > table.len() || num_full_blocks > block_hashes.len() {
            return Err(Error::InvalidArgument(format!(
                "cannot cache {num_full_blocks} blocks: the request has {} blocks and {} block \
                 hashes",
                table.len(),
                block_hashes.len()
            )));
        }
        for (i, &id) in table
            .iter()
            .enumerate()
            .take(num_full_blocks)
            .skip(num_cached_blocks)
        {
            if id == NULL_BLOCK_ID {
                continue;
            }
            let hash = block_hashes.get(i)?;
            if let Some(existing) = self.block_hash(id) {
                if existing.hash != hash {
                    return Err(Error::Unsupported(format!(
                        "block {id} is already cached under another hash (partial-block \
                         promotion)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Drops the listed blocks from the prefix cache (ref counts untouched).
    pub fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<()> {
        for &id in block_ids {
            self.check_block_id(id)?;
        }
        for &id in block_ids {
            self.maybe_evict_cached_block(id as BlockId);
        }
        Ok(())
    }

    /// Forgets every cached hash; fails (returns false) while any non-null block
    /// is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let num_used = self.num_gpu_blocks as usize - self.get_num_free_blocks();
        if num_used != 1 {
            return false;
        }
        self.cached_block_hash_to_block.clear();
        if self.enable_kv_cache_events {
            self.events.push(KVCacheEvent::AllBlocksCleared);
        }
        true
    }

    /// Drains the recorded events.
    pub fn take_events(&mut self) -> Vec<KVCacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Whether events are waiting to be taken.
    #[inline]
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Checks every structural invariant (tests and debugging); `Err` names the
    /// first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut free = 0usize;
        for id in 1..self.num_gpu_blocks {
            let queued = self.free_block_queue.contains(id);
            let rc = self.ref_cnt[id as usize];
            if (rc == 0) != queued {
                return Err(format!("block {id}: ref_cnt {rc} but queued={queued}"));
            }
            free += queued as usize;
        }
        if self.free_block_queue.contains(NULL_BLOCK_ID) {
            return Err("the null block is in the free queue".into());
        }
        if free != self.get_num_free_blocks() {
            return Err(format!(
                "free count {} != queued blocks {free}",
                self.get_num_free_blocks()
            ));
        }
        if self.block_hash(NULL_BLOCK_ID).is_some() {
            return Err("the null block has a hash".into());
        }
        self.cached_block_hash_to_block.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> BlockHash {
        BlockHash::new(&[b; 32]).unwrap()
    }

    #[test]
    fn null_block_is_popped_at_construction() {
        let pool = BlockPool::new(4, true, 16, false).unwrap();
        assert_eq!(pool.free_block_queue().get_all_free_blocks(), vec![1, 2, 3]);
        assert_eq!(pool.get_usage(), 0.0);
    }

    #[test]
    fn free_puts_unhashed_at_head_and_hashed_at_tail() {
        let mut pool = BlockPool::new(8, true, 1, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(4, &mut ids).unwrap();
        assert_eq!(ids, vec![1, 2, 3, 4]);
        let hashes = vec![h(1), h(2), h(3)];
        pool.cache_full_blocks(&hashes, &ids, 0, 3, 1, 0).unwrap();
        pool.free_blocks(ids.iter().rev().copied()).unwrap();
        assert_eq!(
            pool.free_block_queue().get_all_free_blocks(),
            vec![4, 5, 6, 7, 3, 2, 1]
        );
        pool.check_invariants().unwrap();
    }

    #[test]
    fn double_free_is_an_error_and_changes_nothing() {
        let mut pool = BlockPool::new(4, true, 1, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(2, &mut ids).unwrap();
        let before = pool.free_block_queue().get_all_free_blocks();
        assert_eq!(pool.free_blocks([1, 2, 1]), Err(Error::DoubleFree(1)));
        assert_eq!(pool.ref_cnt(1), 1);
        assert_eq!(pool.ref_cnt(2), 1);
        assert_eq!(pool.free_block_queue().get_all_free_blocks(), before);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn evictable_block_is_evicted_lazily_on_reuse() {
        let mut pool = BlockPool::new(3, true, 1, true).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(1, &mut ids).unwrap();
        pool.cache_full_blocks(&vec![h(9)], &ids, 0, 1, 1, 0)
            .unwrap();
        pool.free_blocks([1]).unwrap();
        assert_eq!(pool.get_cached_block(&h(9), 0), Some(1));
        let mut more = vec![];
        pool.get_new_blocks(2, &mut more).unwrap();
        assert_eq!(more, vec![2, 1]);
        assert_eq!(pool.get_cached_block(&h(9), 0), None);
        let events = pool.take_events();
        assert_eq!(events.len(), 2);
        assert!(matches!(events[1], KVCacheEvent::BlockRemoved { .. }));
    }

    #[test]
    fn reset_fails_while_blocks_are_in_use() {
        let mut pool = BlockPool::new(3, true, 1, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(1, &mut ids).unwrap();
        assert!(!pool.reset_prefix_cache());
        pool.free_blocks([1]).unwrap();
        assert!(pool.reset_prefix_cache());
    }
}
