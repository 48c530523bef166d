//! Batched scheduler calls: one crossing per step for the running set.
//!
//! vLLM's Scheduler calls `allocate_slots(request, num_new_tokens,
//! num_lookahead_tokens=L)` once per running request, in order, preempting from the
//! tail of the running queue whenever a call returns `None`, and `free(request)` once
//! per finished request. The batched forms here make exactly those decisions for a
//! whole step from arrays:
//! - requests are named by [`RequestHandle`] (from [`KVCacheManager::request_handle`]),
//!   so no string lookup happens per request;
//! - [`KVCacheManager::allocate_running_batch`] processes entries in order and stops
//!   at the first one whose blocks do not fit, leaving it untouched: the caller
//!   preempts (frees) from its tail and resumes at that entry, as the Scheduler does
//!   after a `None`;
//! - it also stops after an entry that recorded KV events when asked to, so that a
//!   binding can convert each request's events with that request.
//!
//! Entry `i` is equivalent to `allocate_slots` for a running request with
//! `num_computed_tokens[i]` computed tokens, `num_new_tokens[i]` new tokens, the
//! batch's lookahead, no hits, no external tokens, no reserved blocks and no
//! watermark (the watermark only applies to waiting and preempted requests).
//! [`KVCacheManager::check_running_batch`] (handles, counts) and
//! [`KVCacheManager::check_running_batch_caching`] (the blocks each entry would cache:
//! hash lists, cacheability) validate every entry first, so bad input changes nothing.

use super::{KVCacheManager, KVCacheManagerConfig, RequestHandle, RunningCache};
use crate::error::{Error, Result};
use crate::types::{BlockHashSource, BlockId};

/// One step's running-request allocations, in scheduling order.
#[derive(Clone, Copy, Debug)]
pub struct RunningBatch<'a> {
    pub handles: &'a [RequestHandle],
    pub num_computed_tokens: &'a [usize],
    pub num_new_tokens: &'a [usize],
    pub num_lookahead_tokens: usize,
}

impl RunningBatch<'_> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }
}

/// Why [`KVCacheManager::allocate_running_batch`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchStop {
    /// Every entry from `start` on was allocated.
    Done,
    /// Entry `next` does not fit; it was left untouched (vLLM's `None`).
    NoFit,
    /// Entry `next - 1` recorded KV events (only with `stop_after_events`).
    Events,
}

/// Where [`KVCacheManager::allocate_running_batch`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchProgress {
    /// The first entry not allocated.
    pub next: usize,
    pub stop: BatchStop,
}

/// Calls `f(num_tokens_need_slot, cache inputs)` for entry `i`: the arguments of
/// the entry's running `allocate_slots`, with `hashes_of(i)` read at most once.
fn with_entry<S: BlockHashSource, R>(
    config: &KVCacheManagerConfig,
    batch: &RunningBatch<'_>,
    i: usize,
    hashes_of: &dyn Fn(usize) -> Result<S>,
    num_tokens_of: &dyn Fn(usize) -> Result<usize>,
    f: impl FnOnce(usize, Option<RunningCache<'_, S>>) -> R,
) -> R {
    let total = batch.num_computed_tokens[i].min(config.max_model_len);
    let upper = total + batch.num_new_tokens[i];
    let need_slot = (upper + batch.num_lookahead_tokens).min(config.max_model_len);
    let hashes = std::cell::OnceCell::new();
    let block_hashes = || -> Result<&S> {
        if let Some(h) = hashes.get() {
            return Ok(h);
        }
        let h = hashes_of(i)?;
        Ok(hashes.get_or_init(|| h))
    };
    let num_tokens = || num_tokens_of(i);
    let cache = config.enable_caching.then_some(RunningCache {
        block_hashes: &block_hashes,
        upper,
        num_tokens: &num_tokens,
        num_reprefillable_tokens: config.num_reprefillable_tokens,
    });
    f(need_slot, cache)
}

impl KVCacheManager {
    /// The handle of a request that holds blocks (None otherwise). Handles stay
    /// valid until the request is freed.
    pub fn request_handle(&self, request_id: &str) -> Option<RequestHandle> {
        self.manager.handle(request_id)
    }

    /// The request id a live handle names.
    pub fn request_id_of(&self, handle: RequestHandle) -> Option<&str> {
        self.manager.request_id_of(handle)
    }

    /// Validates a batch: equal lengths, live and distinct handles, counts within
    /// `max_model_len`, at least one new token per entry. Appends to
    /// `may_cache` the entries that may fill a block (whose `hashes_of` /
    /// `num_tokens_of` [`Self::allocate_running_batch`] may call), in order.
    pub fn check_running_batch(
        &mut self,
        batch: &RunningBatch<'_>,
        may_cache: &mut Vec<usize>,
    ) -> Result<()> {
        let n = batch.len();
        if batch.num_computed_tokens.len() != n || batch.num_new_tokens.len() != n {
            return Err(Error::InvalidArgument(format!(
                "batch arrays differ in length: {n} handles, {} num_computed_tokens, {} \
                 num_new_tokens",
                batch.num_computed_tokens.len(),
                batch.num_new_tokens.len()
            )));
        }
        self.check_tokens("num_lookahead_tokens", batch.num_lookahead_tokens)?;
        let bs = self.config.block_size;
        let max_model_len = self.config.max_model_len;
        let caching = self.config.enable_caching;
        self.manager.begin_batch();
        let start = may_cache.len();
        for i in 0..n {
            let handle = batch.handles[i];
            let Some((first, num_cached)) = self.manager.mark_for_batch(handle) else {
                may_cache.truncate(start);
                return Err(Error::UnknownRequest(format!(
                    "entry {i}: handle {handle:#x} names no live request"
                )));
            };
            let bad = if !first {
                Some(format!("entry {i}: handle {handle:#x} appears twice"))
            } else if batch.num_new_tokens[i] == 0 {
                Some(format!("entry {i}: num_new_tokens must be greater than 0"))
            } else {
                self.check_tokens("num_new_tokens", batch.num_new_tokens[i])
                    .and_then(|()| {
                        self.check_tokens("num_computed_tokens", batch.num_computed_tokens[i])
                    })
                    .err()
                    .map(|e| format!("entry {i}: {e}"))
            };
            if let Some(msg) = bad {
                may_cache.truncate(start);
                return Err(Error::InvalidArgument(msg));
            }
            let upper = batch.num_computed_tokens[i].min(max_model_len) + batch.num_new_tokens[i];
            if caching && upper / bs > num_cached {
                may_cache.push(i);
            }
        }
        Ok(())
    }

    /// Validates, for every entry listed in `may_cache`, the blocks its allocation
    /// would cache (hash list long enough and well formed, blocks cacheable), so that
    /// [`Self::allocate_running_batch`] cannot fail half-way on a bad request.
    pub fn check_running_batch_caching<S: BlockHashSource>(
        &self,
        batch: &RunningBatch<'_>,
        may_cache: &[usize],
        hashes_of: &dyn Fn(usize) -> Result<S>,
        num_tokens_of: &dyn Fn(usize) -> Result<usize>,
    ) -> Result<()> {
        for &i in may_cache {
            with_entry(
                &self.config,
                batch,
                i,
                hashes_of,
                num_tokens_of,
                |need, c| {
                    self.manager
                        .check_running_by_handle(&self.pool, batch.handles[i], need, c)
                },
            )?;
        }
        Ok(())
    }

    /// Allocates entries `start..` of a batch checked by
    /// [`Self::check_running_batch`] (see module docs). New block ids are appended to
    /// `new_block_ids`, and after each allocated entry the new length of
    /// `new_block_ids` is pushed to `offsets`. `hashes_of(i)` and `num_tokens_of(i)`
    /// read entry `i`'s `block_hashes` and `num_tokens`; they are called only for
    /// entries the check listed in `may_cache`.
    ///
    /// With both checks passed nothing input-dependent can fail here.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_running_batch<S: BlockHashSource>(
        &mut self,
        batch: &RunningBatch<'_>,
        start: usize,
        hashes_of: &dyn Fn(usize) -> Result<S>,
        num_tokens_of: &dyn Fn(usize) -> Result<usize>,
        stop_after_events: bool,
        new_block_ids: &mut Vec<BlockId>,
        offsets: &mut Vec<u32>,
    ) -> Result<BatchProgress> {
        for i in start..batch.len() {
            let budget = self.pool.get_num_free_blocks() as i64;
            let (manager, pool) = (&mut self.manager, &mut self.pool);
            let fits = with_entry(
                &self.config,
                batch,
                i,
                hashes_of,
                num_tokens_of,
                |need, c| {
                    manager.allocate_running_by_handle(
                        pool,
                        batch.handles[i],
                        need,
                        budget,
                        c,
                        new_block_ids,
                    )
                },
            )?;
            if !fits {
                return Ok(BatchProgress {
                    next: i,
                    stop: BatchStop::NoFit,
                });
            }
            offsets.push(u32::try_from(new_block_ids.len()).unwrap_or(u32::MAX));
            if stop_after_events && self.pool.has_events() {
                return Ok(BatchProgress {
                    next: i + 1,
                    stop: BatchStop::Events,
                });
            }
        }
        Ok(BatchProgress {
            next: batch.len(),
            stop: BatchStop::Done,
        })
    }

    /// Frees the requests `handles` name, in order, each tail first (vLLM's `free`
    /// per finished request). Every handle and every block reference is checked
    /// first: a stale or unknown handle, or a block already freed, frees nothing.
    pub fn free_batch(&mut self, handles: &[RequestHandle]) -> Result<()> {
        self.manager.begin_batch();
        for (i, &handle) in handles.iter().enumerate() {
            match self.manager.mark_for_batch(handle) {
                None => {
                    return Err(Error::UnknownRequest(format!(
                        "entry {i}: handle {handle:#x} names no live request"
                    )))
                }
                Some((false, _)) => {
                    return Err(Error::InvalidArgument(format!(
                        "entry {i}: handle {handle:#x} appears twice"
                    )))
                }
                Some((true, _)) => {}
            }
        }
        // Every request's references must be droppable before the first is freed
        // (blocks shared between the requests count once per holder).
        let manager = &self.manager;
        let blocks = handles.iter().flat_map(|&h| {
            manager
                .request_by_handle(h)
                .map_or(&[][..], |r| r.blocks.as_slice())
                .iter()
                .copied()
        });
        self.pool.check_free(blocks)?;
        for &handle in handles {
            self.manager.free_by_handle(&mut self.pool, handle)?;
        }
        Ok(())
    }
}
