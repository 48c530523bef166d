//! `BlockPool`: block ref counts, the free queue, the prefix-cache index and events.
//!
//! Mirrors vLLM 0.33 `v1/core/block_pool.py::BlockPool` as a struct of arrays over
//! `u32` block ids. This file owns allocation (`get_new_blocks`, `touch`,
//! `free_blocks`, eviction, reset, usage); [`caching`] owns how blocks enter the
//! prefix cache (`cache_full_blocks`, `cache_partial_block`, `move_block_hashes`).
//!
//! Key properties:
//! - Block 0 is the null block: popped from the free queue at construction, never
//!   hashed, never queued, excluded from `usage`. `touch` and `free_blocks` skip it
//!   (vLLM 0.33); under vLLM 0.32's rules ([`rules::VllmRules`]) they add / drop a
//!   reference on it, kept apart in a signed counter (`null_ref_cnt`, which vLLM 0.32
//!   lets go negative), and nothing else changes.
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
//! - Reuse watchers (`watchers.rs`, vLLM's `unpin_blocks`): HiSparse releases GPU
//!   pages it keeps reading; the pool records when it hands one out again.
//!
//! Not implemented here: blocks of several pools in one call (vLLM's `free_blocks`
//! routes another pool's blocks by `block.pool`); the HiSparse coordinator, which
//! owns the second (host) pool, routes them (`src/manager/hisparse/`).

pub mod caching;
pub mod eviction_history;
pub mod retention;
mod retention_ops;
pub mod rules;
mod watchers;

use crate::alloc::zeroed_vec;
use crate::error::{Error, Result};
use crate::events::{KVCacheEvent, MetricsOp};
use crate::free_queue::FreeKVCacheBlockQueue;
use crate::hash_index::BlockHashToBlockMap;
use crate::types::{BlockHash, BlockHashWithGroupId, BlockId, NULL_BLOCK_ID};
use eviction_history::{EvictionCause, EvictionHistory};
use retention::Retention;
use rules::VllmRules;
use watchers::ReuseWatchers;

/// The block pool (see module docs).
#[derive(Clone, Debug)]
pub struct BlockPool {
    num_gpu_blocks: u32,
    enable_caching: bool,
    hash_block_size: usize,
    enable_kv_cache_events: bool,
    ref_cnt: Vec<u32>,
    /// The prefix length each block's primary key covers (valid while it has one).
    block_hash_num_tokens: Vec<u32>,
    free_block_queue: FreeKVCacheBlockQueue,
    cached_block_hash_to_block: BlockHashToBlockMap,
    events: Vec<KVCacheEvent>,
    /// Calls for the block-metrics collector, when one is attached.
    metrics: Option<Vec<MetricsOp>>,
    scratch_first: Vec<BlockId>,
    scratch_last: Vec<BlockId>,
    scratch_zeroed: Vec<bool>,
    watchers: ReuseWatchers,
    /// A non-LRU retention policy (`retention/`); None = vLLM's LRU free queue.
    retention: Option<Box<Retention>>,
    /// Explain mode's bounded eviction history (`eviction_history.rs`); None = off.
    eviction_history: Option<Box<EvictionHistory>>,
    /// The installed vLLM's rules (`rules.rs`).
    rules: VllmRules,
    /// vLLM 0.32's `null_block.ref_cnt` (always 0 under 0.33's rules).
    null_ref_cnt: i64,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (block 0 becomes the null block).
    /// `collect_metrics` records the calls of a `KVCacheMetricsCollector`.
    pub fn new(
        num_gpu_blocks: u32,
        enable_caching: bool,
        hash_block_size: usize,
        enable_kv_cache_events: bool,
        collect_metrics: bool,
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
        let mut free_block_queue = FreeKVCacheBlockQueue::try_new(num_gpu_blocks)?;
        let null = free_block_queue.popleft()?;
        debug_assert_eq!(null, NULL_BLOCK_ID);
        Ok(Self {
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            ref_cnt: zeroed_vec(n, "the pool's reference counts")?,
            block_hash_num_tokens: zeroed_vec(n, "the pool's hashed token counts")?,
            free_block_queue,
            cached_block_hash_to_block: BlockHashToBlockMap::try_new(n)?,
            events: Vec::new(),
            metrics: collect_metrics.then(Vec::new),
            scratch_first: Vec::new(),
            scratch_last: Vec::new(),
            scratch_zeroed: Vec::new(),
            watchers: ReuseWatchers::try_new(n)?,
            retention: None,
            eviction_history: None,
            rules: VllmRules::V033,
            null_ref_cnt: 0,
        })
    }

    /// Sets the installed vLLM's rules (at construction, before any block is used).
    pub fn set_vllm_rules(&mut self, rules: VllmRules) {
        self.rules = rules;
    }

    /// The installed vLLM's rules.
    #[inline]
    pub fn vllm_rules(&self) -> VllmRules {
        self.rules
    }

    /// vLLM's `null_block.ref_cnt`: 0 under 0.33's rules; under 0.32's, touches of
    /// the null block minus its frees (may be negative).
    #[inline]
    pub fn null_ref_cnt(&self) -> i64 {
        self.null_ref_cnt
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
        if block_id >= 0 && block_id < i64::from(self.num_gpu_blocks) {
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

    /// The reference count vLLM reports for a block (`block.ref_cnt`): the null
    /// block's is [`Self::null_ref_cnt`].
    #[inline]
    pub fn vllm_ref_cnt(&self, block_id: BlockId) -> i64 {
        if block_id == NULL_BLOCK_ID {
            self.null_ref_cnt
        } else {
            i64::from(self.ref_cnt[block_id as usize])
        }
    }

    /// The primary hash key of a block, if it is cached.
    #[inline]
    pub fn block_hash(&self, block_id: BlockId) -> Option<&BlockHashWithGroupId> {
        self.cached_block_hash_to_block.key_of(block_id)
    }

    /// The prefix length (tokens) the block's primary key covers, if it is cached.
    #[inline]
    pub fn block_hash_num_tokens(&self, block_id: BlockId) -> Option<u32> {
        self.block_hash(block_id)
            .map(|_| self.block_hash_num_tokens[block_id as usize])
    }

    /// vLLM's `is_block_writable`: not null, one owner, no hash.
    #[inline]
    pub fn is_block_writable(&self, block_id: BlockId) -> bool {
        block_id != NULL_BLOCK_ID
            && self.ref_cnt[block_id as usize] == 1
            && self.block_hash(block_id).is_none()
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

    /// Number of free blocks (evictable cached blocks included; blocks a
    /// retention policy pins are not).
    #[inline]
    pub fn get_num_free_blocks(&self) -> usize {
        match &self.retention {
            None => self.free_block_queue.num_free_blocks(),
            Some(r) => self.free_block_queue.num_free_blocks() - r.num_reserved_free(),
        }
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

    /// vLLM's `get_cached_block(hash, group_ids)`: the cached block of every group
    /// (appended to `out`), or false (and `out` unchanged) if any group misses.
    #[inline]
    pub fn get_cached_blocks(
        &self,
        hash: &BlockHash,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> bool {
        if let [g] = group_ids {
            return match self.get_cached_block(hash, *g) {
                Some(b) => {
                    out[0].push(b);
                    true
                }
                None => false,
            };
        }
        let mut found = smallvec::SmallVec::<[BlockId; 4]>::new();
        for &g in group_ids {
            match self.get_cached_block(hash, g) {
                Some(b) => found.push(b),
                None => return false,
            }
        }
        for (o, b) in out.iter_mut().zip(found) {
            o.push(b);
        }
        true
    }

    /// Hands out `n` blocks from the head of the free queue (appended to `out`),
    /// evicting the cached ones among them.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        let start = out.len();
        if self.retention.is_some() {
            self.pop_with_retention(n, out)?;
        } else {
            self.free_block_queue.popleft_n(n, out)?;
        }
        if self.watchers.any() {
            self.watchers.notify_popped(&out[start..]);
        }
        for &id in &out[start..] {
            if self.enable_caching {
                Self::evict_cached(
                    &mut self.cached_block_hash_to_block,
                    self.enable_kv_cache_events.then_some(&mut self.events),
                    self.metrics.as_mut(),
                    self.eviction_history.as_deref_mut().map(|h| {
                        let policy = self.retention.as_ref().map_or("lru", |r| r.kind().name());
                        (h, policy, EvictionCause::Reuse)
                    }),
                    id,
                );
            }
            self.ref_cnt[id as usize] = 1;
            if let Some(m) = self.metrics.as_mut() {
                m.push(MetricsOp::Allocated(id));
            }
        }
        Ok(())
    }

    /// vLLM's `_maybe_evict_cached_block` over split borrows: drops every key of the
    /// block (one `BlockRemoved` each); returns whether any was removed.
    fn evict_cached(
        index: &mut BlockHashToBlockMap,
        events: Option<&mut Vec<KVCacheEvent>>,
        metrics: Option<&mut Vec<MetricsOp>>,
        history: Option<(&mut EvictionHistory, &'static str, EvictionCause)>,
        block_id: BlockId,
    ) -> bool {
        if let Some(m) = metrics {
            m.push(MetricsOp::Evicted(block_id));
        }
        let removed = index.remove_block_hashes(block_id);
        if removed.is_empty() {
            return false;
        }
        if let Some((history, policy, cause)) = history {
            for key in &removed {
                history.record(*key, policy, cause);
            }
        }
        if let Some(events) = events {
            events.extend(
                removed
                    .into_iter()
                    .map(|key| KVCacheEvent::BlockRemoved { key }),
            );
        }
        true
    }

    /// Drops the block's keys from the index (vLLM's `_maybe_evict_cached_block`).
    pub(crate) fn maybe_evict_cached_block(&mut self, block_id: BlockId) -> bool {
        if self.retention.is_some() {
            self.retention_uncache(block_id);
        }
        Self::evict_cached(
            &mut self.cached_block_hash_to_block,
            self.enable_kv_cache_events.then_some(&mut self.events),
            self.metrics.as_mut(),
            self.eviction_history.as_deref_mut().map(|h| {
                let policy = self.retention.as_ref().map_or("lru", |r| r.kind().name());
                (h, policy, EvictionCause::Explicit)
            }),
            block_id,
        )
    }

    /// Checks that `touch(block_ids)` would succeed (ids in range, every ref-0
    /// block in the free queue); nothing changes.
    pub fn validate_touch(&self, block_ids: &[BlockId]) -> Result<()> {
        for &id in block_ids {
            self.check_block_id(i64::from(id))?;
            if id != NULL_BLOCK_ID
                && self.ref_cnt[id as usize] == 0
                && !self.free_block_queue.contains(id)
            {
                return Err(Error::NotInFreeQueue(id));
            }
        }
        Ok(())
    }

    /// Takes a reference on each block, removing ref-0 ones from the free queue
    /// (a prefix hit on an evictable cached block protects it from eviction).
    pub fn touch(&mut self, block_ids: &[BlockId]) -> Result<()> {
        self.validate_touch(block_ids)?;
        for &id in block_ids {
            if id == NULL_BLOCK_ID {
                // vLLM 0.32 counts it (never queued, so the queue is untouched) and
                // reports the access to the metrics collector.
                if self.rules.null_block_ref_counted {
                    self.null_ref_cnt += 1;
                    if let Some(m) = self.metrics.as_mut() {
                        m.push(MetricsOp::Accessed(id));
                    }
                }
                continue;
            }
            if self.ref_cnt[id as usize] == 0 {
                self.free_block_queue.remove(id)?;
                if let Some(r) = self.retention.as_mut() {
                    r.on_take(id, self.cached_block_hash_to_block.key_of(id).is_some());
                }
            } else if let Some(r) = self.retention.as_mut() {
                r.on_shared_hit(id);
            }
            self.ref_cnt[id as usize] += 1;
            if let Some(m) = self.metrics.as_mut() {
                m.push(MetricsOp::Accessed(id));
            }
        }
        Ok(())
    }

    /// Takes one more reference on a block that already has one (vLLM's
    /// `block.ref_cnt += 1` of copy-on-write retention).
    pub(crate) fn retain(&mut self, block_id: BlockId) {
        if block_id != NULL_BLOCK_ID {
            self.ref_cnt[block_id as usize] += 1;
        }
    }

    /// Drops one reference per listed block, first = evicted first (see module
    /// docs): vLLM's `free_blocks(ordered_blocks)`.
    pub fn free_blocks(&mut self, ordered_blocks: &[BlockId]) -> Result<()> {
        self.free_block_segments(ordered_blocks, &[ordered_blocks.len()])
    }

    /// Several `free_blocks` calls in a row, checked as one: `ids[..ends[0]]`, then
    /// `ids[ends[0]..ends[1]]`, ... (a multi-group request's per-group frees). Either
    /// every reference is dropped or, on error, none.
    pub fn free_block_segments(&mut self, ids: &[BlockId], ends: &[usize]) -> Result<()> {
        // Plan: drop the references in order, remembering where a block reached 0;
        // on the first bad id or double free, restore what was dropped.
        let mut zeroed = std::mem::take(&mut self.scratch_zeroed);
        zeroed.clear();
        let mut failure = None;
        let mut nulls = 0i64;
        for &id in ids {
            if let Err(e) = self.check_block_id(i64::from(id)) {
                failure = Some(e);
                break;
            }
            if id == NULL_BLOCK_ID {
                zeroed.push(false);
                nulls += 1;
                continue;
            }
            let rc = &mut self.ref_cnt[id as usize];
            if *rc == 0 {
                failure = Some(Error::DoubleFree(id));
                break;
            }
            *rc -= 1;
            zeroed.push(*rc == 0);
        }
        if let Some(e) = failure {
            for &id in &ids[..zeroed.len()] {
                if id != NULL_BLOCK_ID {
                    self.ref_cnt[id as usize] += 1;
                }
            }
            self.scratch_zeroed = zeroed;
            return Err(e);
        }
        if self.rules.null_block_ref_counted {
            self.null_ref_cnt -= nulls;
        }
        // Apply: per segment, unhashed blocks to the head, hashed ones to the tail.
        let mut first = std::mem::take(&mut self.scratch_first);
        let mut last = std::mem::take(&mut self.scratch_last);
        let mut start = 0;
        let mut result = Ok(());
        for &end in ends {
            let end = end.min(ids.len());
            first.clear();
            last.clear();
            for (i, &id) in ids.iter().enumerate().take(end).skip(start) {
                if !zeroed[i] {
                    continue;
                }
                if self.block_hash(id).is_none() || !self.enable_caching {
                    first.push(id);
                } else {
                    last.push(id);
                }
            }
            result = result
                .and_then(|()| self.free_block_queue.prepend_n(&first))
                .and_then(|()| self.free_block_queue.append_n(&last));
            if let Some(r) = self.retention.as_mut() {
                let now = r.now_ms();
                r.on_free_all(&last, now);
            }
            start = end;
        }
        self.scratch_first = first;
        self.scratch_last = last;
        self.scratch_zeroed = zeroed;
        result
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
        let num_used = self.num_gpu_blocks as usize - self.free_block_queue.num_free_blocks();
        if num_used != 1 {
            return false;
        }
        if let Some(r) = self.retention.as_mut() {
            r.clear();
        }
        if self.watchers.any() {
            self.watchers.notify_all();
        }
        self.cached_block_hash_to_block.clear();
        if let Some(h) = self.eviction_history.as_mut() {
            h.note_reset();
        }
        if let Some(m) = self.metrics.as_mut() {
            m.push(MetricsOp::Reset);
        }
        if self.enable_kv_cache_events {
            self.events.push(KVCacheEvent::AllBlocksCleared);
        }
        true
    }

    /// Records an event (events on only).
    #[inline]
    pub(crate) fn push_event(&mut self, event: KVCacheEvent) {
        if self.enable_kv_cache_events {
            self.events.push(event);
        }
    }

    /// Moves `host`'s recorded events to the end of this pool's queue, each wrapped
    /// as a host event (HiSparse's host pool shares the device pool's queue);
    /// stored ranges cover `publication`'s request (None: the call's request).
    pub fn absorb_host_events(&mut self, host: &mut BlockPool, publication: Option<u64>) {
        if host.events.is_empty() {
            return;
        }
        let events = std::mem::take(&mut host.events);
        if !self.enable_kv_cache_events {
            return;
        }
        self.events
            .extend(events.into_iter().map(|event| KVCacheEvent::Host {
                event: Box::new(event),
                publication,
            }));
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

    /// Drains the recorded block-metrics calls.
    pub fn take_metrics_ops(&mut self) -> Vec<MetricsOp> {
        self.metrics
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether block-metrics calls are waiting to be replayed.
    #[inline]
    pub fn has_metrics_ops(&self) -> bool {
        self.metrics.as_ref().is_some_and(|m| !m.is_empty())
    }

    /// Checks every structural invariant (tests and debugging); `Err` names the
    /// first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.free_block_queue.check_links()?;
        if self.ref_cnt[NULL_BLOCK_ID as usize] != 0 {
            return Err(format!(
                "the null block has ref_cnt {}",
                self.ref_cnt[NULL_BLOCK_ID as usize]
            ));
        }
        let mut free = 0usize;
        for id in 1..self.num_gpu_blocks {
            let queued = self.free_block_queue.contains(id);
            let rc = self.ref_cnt[id as usize];
            if (rc == 0) != queued {
                return Err(format!("block {id}: ref_cnt {rc} but queued={queued}"));
            }
            free += usize::from(queued);
        }
        if self.free_block_queue.contains(NULL_BLOCK_ID) {
            return Err("the null block is in the free queue".into());
        }
        if !self.rules.null_block_ref_counted && self.null_ref_cnt != 0 {
            return Err(format!(
                "the null block counts {} references under vLLM 0.33's rules",
                self.null_ref_cnt
            ));
        }
        if free != self.free_block_queue.num_free_blocks() {
            return Err(format!(
                "free count {} != queued blocks {free}",
                self.free_block_queue.num_free_blocks()
            ));
        }
        if self.block_hash(NULL_BLOCK_ID).is_some() {
            return Err("the null block has a hash".into());
        }
        self.check_retention_invariants()?;
        self.cached_block_hash_to_block.check_invariants()
    }

    /// Test-only corruption for the invariant mutants (`src/manager/mutants.rs`).
    #[doc(hidden)]
    #[cfg(any(test, feature = "testing", feature = "mutants"))]
    pub fn corrupt_for_tests(&mut self) -> CorruptPool<'_> {
        CorruptPool(self)
    }
}

/// Raw, unchecked access to a pool's structures (invariant mutants only).
#[doc(hidden)]
#[cfg(any(test, feature = "testing", feature = "mutants"))]
pub struct CorruptPool<'a>(&'a mut BlockPool);

#[cfg(any(test, feature = "testing", feature = "mutants"))]
impl CorruptPool<'_> {
    /// Sets a block's ref count without touching the free queue.
    pub fn set_ref_cnt(&mut self, block_id: BlockId, rc: u32) {
        if let Some(slot) = self.0.ref_cnt.get_mut(block_id as usize) {
            *slot = rc;
        }
    }

    /// The free queue, mutable, without the pool's bookkeeping.
    pub fn free_queue(&mut self) -> &mut FreeKVCacheBlockQueue {
        &mut self.0.free_block_queue
    }

    /// The prefix-cache index, mutable, without the pool's bookkeeping.
    pub fn index(&mut self) -> &mut BlockHashToBlockMap {
        &mut self.0.cached_block_hash_to_block
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
        let pool = BlockPool::new(4, true, 16, false, false).unwrap();
        assert_eq!(pool.free_block_queue().get_all_free_blocks(), vec![1, 2, 3]);
        assert_eq!(pool.get_usage(), 0.0);
    }

    #[test]
    fn free_puts_unhashed_at_head_and_hashed_at_tail() {
        let mut pool = BlockPool::new(8, true, 1, false, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(4, &mut ids).unwrap();
        assert_eq!(ids, vec![1, 2, 3, 4]);
        let hashes = vec![h(1), h(2), h(3)];
        pool.cache_full_blocks(&hashes, &ids, 0, 3, 1, 0, None)
            .unwrap();
        let rev: Vec<_> = ids.iter().rev().copied().collect();
        pool.free_blocks(&rev).unwrap();
        assert_eq!(
            pool.free_block_queue().get_all_free_blocks(),
            vec![4, 5, 6, 7, 3, 2, 1]
        );
        pool.check_invariants().unwrap();
    }

    #[test]
    fn segments_are_queued_one_after_the_other() {
        // Two groups' tables freed in one call: the second group's unhashed block
        // ends up at the head, as two separate `free_blocks` calls would leave it.
        let mut pool = BlockPool::new(6, true, 1, false, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(2, &mut ids).unwrap();
        pool.free_block_segments(&[1, 2], &[1, 2]).unwrap();
        assert_eq!(
            pool.free_block_queue().get_all_free_blocks(),
            vec![2, 1, 3, 4, 5]
        );
    }

    #[test]
    fn double_free_is_an_error_and_changes_nothing() {
        let mut pool = BlockPool::new(4, true, 1, false, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(2, &mut ids).unwrap();
        let before = pool.free_block_queue().get_all_free_blocks();
        assert_eq!(pool.free_blocks(&[1, 2, 1]), Err(Error::DoubleFree(1)));
        assert_eq!(pool.ref_cnt(1), 1);
        assert_eq!(pool.ref_cnt(2), 1);
        assert_eq!(pool.free_block_queue().get_all_free_blocks(), before);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn evictable_block_is_evicted_lazily_on_reuse() {
        let mut pool = BlockPool::new(3, true, 1, true, true).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(1, &mut ids).unwrap();
        pool.cache_full_blocks(&vec![h(9)], &ids, 0, 1, 1, 0, None)
            .unwrap();
        pool.free_blocks(&[1]).unwrap();
        assert_eq!(pool.get_cached_block(&h(9), 0), Some(1));
        let mut more = vec![];
        pool.get_new_blocks(2, &mut more).unwrap();
        assert_eq!(more, vec![2, 1]);
        assert_eq!(pool.get_cached_block(&h(9), 0), None);
        let events = pool.take_events();
        assert_eq!(events.len(), 2);
        assert!(matches!(events[1], KVCacheEvent::BlockRemoved { .. }));
        use MetricsOp::*;
        assert_eq!(
            pool.take_metrics_ops(),
            vec![
                Evicted(1),
                Allocated(1),
                Evicted(2),
                Allocated(2),
                Evicted(1),
                Allocated(1)
            ]
        );
    }

    #[test]
    fn reset_fails_while_blocks_are_in_use() {
        let mut pool = BlockPool::new(3, true, 1, false, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(1, &mut ids).unwrap();
        assert!(!pool.reset_prefix_cache());
        pool.free_blocks(&[1]).unwrap();
        assert!(pool.reset_prefix_cache());
    }
}
