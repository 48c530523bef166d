//! Batched scheduler calls: one crossing per step for the running set.
//!
//! vLLM's Scheduler calls `allocate_slots(request, num_new_tokens,
//! num_lookahead_tokens=L)` once per running request, in order, preempting from the
//! tail of the running queue whenever a call returns `None`, and `free(request)` once
//! per finished request. The batched forms here make exactly those decisions for a
//! whole step from arrays:
//! - requests are named by [`RequestHandle`] (from [`KVCacheManager::request_handle`]);
//! - [`KVCacheManager::allocate_running_batch`] processes entries in order and stops
//!   at the first one whose blocks do not fit, leaving it untouched: the caller
//!   preempts (frees) from its tail and resumes at that entry, as the Scheduler does
//!   after a `None`;
//! - it also stops after an entry that recorded KV events when asked to, so that a
//!   binding can convert each request's events with that request.
//!
//! Entry `i` is `allocate_slots` for a running request with `num_computed_tokens[i]`
//! computed tokens, `num_new_tokens[i]` new tokens, the batch's lookahead, no hits,
//! no external tokens, no reserved blocks and no watermark (the watermark only
//! applies to waiting and preempted requests) — the same code path as the per-call
//! API, so the decisions cannot drift. Every entry is validated (handles, counts,
//! the hashes it may cache) before the first one changes anything.
//!
//! Layouts whose groups free skipped blocks or cache on every step (sliding window,
//! chunked local, Mamba, R-SWA, mixed block sizes) read per-request fields the
//! arrays do not carry: the batched calls refuse them (`Unsupported`); the per-call
//! API serves them.

use smallvec::SmallVec;

use super::request::{PlannedHashes, RequestLike, RequestStatus};
use super::{AllocateSlots, KVCacheManager, RequestHandle};
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

/// A batch entry as the request the per-call path reads: only the fields a
/// running request's allocation needs in the layouts the batch serves.
struct Entry<'a> {
    request_id: &'a str,
    num_computed_tokens: usize,
    hashes: Option<&'a PlannedHashes>,
    num_tokens: Option<usize>,
}

impl RequestLike for Entry<'_> {
    type Hashes = PlannedHashes;
    fn request_id(&self) -> &str {
        self.request_id
    }
    fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }
    fn num_tokens(&self) -> Result<usize> {
        self.num_tokens
            .ok_or_else(|| Error::Internal("a batch entry read num_tokens unplanned".into()))
    }
    fn num_prompt_tokens(&self) -> Result<usize> {
        Err(Error::Internal(
            "a batch entry read num_prompt_tokens".into(),
        ))
    }
    fn num_in_flight_tokens(&self) -> Result<usize> {
        Err(Error::Internal(
            "a batch entry read num_in_flight_tokens".into(),
        ))
    }
    fn shared_prefix_boundary(&self) -> Result<usize> {
        Err(Error::Internal(
            "a batch entry read shared_prefix_boundary".into(),
        ))
    }
    fn status(&self) -> Result<RequestStatus> {
        Ok(RequestStatus::Other)
    }
    fn skip_reading_prefix_cache(&self) -> Result<bool> {
        Ok(false)
    }
    fn block_hashes(&self) -> Result<&PlannedHashes> {
        self.hashes
            .ok_or_else(|| Error::Internal("a batch entry read block_hashes unplanned".into()))
    }
}

impl KVCacheManager {
    /// The handle of a request that holds blocks (None otherwise). Handles stay
    /// valid until the request is freed.
    pub fn request_handle(&self, request_id: &str) -> Option<RequestHandle> {
        self.coordinator.requests.handle(request_id)
    }

    /// The request id a live handle names.
    pub fn request_id_of(&self, handle: RequestHandle) -> Option<&str> {
        self.coordinator.requests.key_of(handle)
    }

    fn check_batch_layout(&self) -> Result<()> {
        let needs = self.coordinator.needs();
        if needs.in_flight_for_skip
            || needs.cache_every_call
            || needs.prompt_for_cache
            || self.coordinator.hisparse().is_some()
        {
            return Err(Error::Unsupported(
                "the batched calls serve layouts without skipped blocks or partial caching \
                 (full attention); use allocate_slots per request"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Validates a batch: a layout the batch serves, equal lengths, live and
    /// distinct handles, counts within `max_model_len`, at least one new token per
    /// entry. Appends to `may_cache` the entries that may fill a block (whose
    /// hashes and `num_tokens` [`Self::allocate_running_batch`] reads), in order.
    pub fn check_running_batch(
        &mut self,
        batch: &RunningBatch<'_>,
        may_cache: &mut Vec<usize>,
    ) -> Result<()> {
        self.guard()?;
        self.check_batch_layout()?;
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
        let max_model_len = self.config.max_model_len;
        let caching = self.enable_caching();
        let start = may_cache.len();
        let epoch = self.next_batch_epoch();
        for i in 0..n {
            let handle = batch.handles[i];
            let Some(state) = self.coordinator.requests.get_mut_by_handle(handle) else {
                may_cache.truncate(start);
                return Err(Error::UnknownRequest(format!(
                    "entry {i}: handle {handle:#x} names no live request"
                )));
            };
            let first = state.batch_epoch != epoch;
            state.batch_epoch = epoch;
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
            let state = self.coordinator.requests.get_by_handle(handle);
            let may = caching && self.may_cache(state, upper, None);
            if may {
                may_cache.push(i);
            }
        }
        Ok(())
    }

    fn next_batch_epoch(&mut self) -> u64 {
        self.batch_epoch += 1;
        self.batch_epoch
    }

    /// Reads, for every entry listed in `may_cache`, the hashes its allocation may
    /// cache (from `hashes_of(i)`) and its `num_tokens`, so that
    /// [`Self::allocate_running_batch`] cannot fail half-way on a bad request.
    pub fn plan_running_batch<S: BlockHashSource>(
        &self,
        batch: &RunningBatch<'_>,
        may_cache: &[usize],
        hashes_of: &dyn Fn(usize) -> Result<S>,
        num_tokens_of: &dyn Fn(usize) -> Result<usize>,
    ) -> Result<Vec<(PlannedHashes, usize)>> {
        let mut planned = Vec::with_capacity(may_cache.len());
        for &i in may_cache {
            let handle = batch.handles[i];
            let rid = self
                .request_id_of(handle)
                .ok_or_else(|| Error::UnknownRequest(format!("handle {handle:#x}")))?;
            let hashes = hashes_of(i)?;
            let n = num_tokens_of(i)?;
            let upper = batch.num_computed_tokens[i].min(self.config.max_model_len)
                + batch.num_new_tokens[i];
            let mut points = SmallVec::new();
            let (lo, hi) =
                self.coordinator
                    .cache_reads(rid, upper.min(n), 0, hashes.len(), None, &mut points);
            planned.push((PlannedHashes::read(&hashes, lo, hi, points, Vec::new())?, n));
        }
        Ok(planned)
    }

    /// Allocates entries `start..` of a batch checked by
    /// [`Self::check_running_batch`] and planned by [`Self::plan_running_batch`] (see
    /// module docs). New block ids are appended to `new_block_ids`, and after each
    /// allocated entry the new length of `new_block_ids` is pushed to `offsets`.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_running_batch(
        &mut self,
        batch: &RunningBatch<'_>,
        start: usize,
        may_cache: &[usize],
        planned: &[(PlannedHashes, usize)],
        stop_after_events: bool,
        new_block_ids: &mut Vec<BlockId>,
        offsets: &mut Vec<u32>,
    ) -> Result<BatchProgress> {
        let mut ends: SmallVec<[usize; 4]> = SmallVec::new();
        for i in start..batch.len() {
            let handle = batch.handles[i];
            let rid: Box<str> = self
                .request_id_of(handle)
                .ok_or_else(|| Error::UnknownRequest(format!("handle {handle:#x}")))?
                .into();
            let plan = may_cache.binary_search(&i).ok().map(|k| &planned[k]);
            let entry = Entry {
                request_id: &rid,
                num_computed_tokens: batch.num_computed_tokens[i],
                hashes: plan.map(|p| &p.0),
                num_tokens: plan.map(|p| p.1),
            };
            let args = AllocateSlots {
                num_new_tokens: batch.num_new_tokens[i],
                num_lookahead_tokens: batch.num_lookahead_tokens,
                ..AllocateSlots::default()
            };
            ends.clear();
            if !self.allocate_slots(&entry, &args, new_block_ids, &mut ends)? {
                return Ok(BatchProgress {
                    next: i,
                    stop: BatchStop::NoFit,
                });
            }
            offsets.push(u32::try_from(new_block_ids.len()).unwrap_or(u32::MAX));
            if stop_after_events && self.block_pool().has_events() {
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
        self.guard()?;
        if self.coordinator.hisparse().is_some() {
            return Err(Error::Unsupported(
                "the batched calls do not serve HiSparse layouts; use free per request".into(),
            ));
        }
        let epoch = self.next_batch_epoch();
        for (i, &handle) in handles.iter().enumerate() {
            let Some(state) = self.coordinator.requests.get_mut_by_handle(handle) else {
                return Err(Error::UnknownRequest(format!(
                    "entry {i}: handle {handle:#x} names no live request"
                )));
            };
            if state.batch_epoch == epoch {
                return Err(Error::InvalidArgument(format!(
                    "entry {i}: handle {handle:#x} appears twice"
                )));
            }
            state.batch_epoch = epoch;
        }
        // One checked free of every request: a stale handle or a block already freed
        // frees nothing (blocks shared between the requests count once per holder).
        let mut scratch = std::mem::take(&mut self.free_scratch);
        let r = self.coordinator.free_handles(
            handles,
            &mut scratch,
            &crate::manager::hisparse::PlainPublicationRequests::default(),
        );
        self.free_scratch = scratch;
        r?;
        Ok(())
    }
}
