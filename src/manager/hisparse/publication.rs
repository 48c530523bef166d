//! Host publication: the source group's hashes enter the prefix cache only once
//! their host pages are durable.
//!
//! Mirrors vLLM 0.33 `HiSparseCoordinator.publish_when_ready`,
//! `_publish_host_blocks_if_ready`, `_publish_detached_blocks`, `_record_copies`,
//! `_record_copy`, `finish_host_import` and `complete_host_import`.
//!
//! Key properties:
//! - Every caching call of the source group replaces the request's publication
//!   (its computed tokens) and publishes the durable prefix of it at once: the
//!   host pages below `ready_prefix_pages`. Host writes trail a long prefill by
//!   about a chunk, so a preempted prefill resumes from the part already durable.
//! - Publishing a page records its GPU copies (one per resident group) under the
//!   host hash, so a later host prefix hit can come back GPU-resident.
//! - A finished request whose spills are still in flight keeps a *detached*
//!   publication (its host pages leased): once the last spill completes, the
//!   durable pages are cached and the leases dropped.

use smallvec::SmallVec;

use super::{HiSparseCoordinator, HiSparseCtx, StateId};
use crate::error::{Error, Result};
use crate::manager::single_type::CacheQuery;
use crate::types::{cdiv, BlockHash, BlockHashSource, BlockId, NULL_BLOCK_ID};

/// What the core asks its owner about requests it no longer has in hand.
pub trait PublicationRequests {
    /// Whether the request of publication `publication` has finished (vLLM's
    /// `publication.request.is_finished()`).
    fn is_finished(&self, publication: u64) -> Result<bool>;
    /// The interpreter's `hash(request_id)` (vLLM iterates a `set` of ids).
    fn request_hash(&self, request_id: &str) -> Result<u64>;
}

/// [`PublicationRequests`] for Rust callers: every request is `finished` as given;
/// ids hash with FxHash (a stand-in for the interpreter's string hash).
#[derive(Clone, Copy, Debug, Default)]
pub struct PlainPublicationRequests {
    pub finished: bool,
}

impl PublicationRequests for PlainPublicationRequests {
    fn is_finished(&self, _publication: u64) -> Result<bool> {
        Ok(self.finished)
    }
    fn request_hash(&self, request_id: &str) -> Result<u64> {
        use std::hash::{BuildHasher, BuildHasherDefault};
        Ok(BuildHasherDefault::<rustc_hash::FxHasher>::default().hash_one(request_id))
    }
}

/// The request hashes a publication may read: `[lo, lo + run.len())` of a list of
/// `len` hashes.
#[derive(Clone, Debug, Default)]
pub struct HashSnapshot {
    len: usize,
    lo: usize,
    run: Vec<BlockHash>,
}

impl HashSnapshot {
    /// Copies `hashes[lo..hi]` (clipped to the list).
    pub fn take(hashes: &dyn BlockHashSource, lo: usize, hi: usize) -> Result<Self> {
        let len = hashes.len();
        let hi = hi.min(len);
        let run = (lo.min(hi)..hi)
            .map(|i| hashes.get(i))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            len,
            lo: lo.min(hi),
            run,
        })
    }
}

impl BlockHashSource for HashSnapshot {
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        i.checked_sub(self.lo)
            .and_then(|k| self.run.as_slice().get(k))
            .copied()
            .ok_or_else(|| Error::Internal(format!("HiSparse publication read hash {i}")))
    }
}

/// A publication waiting for its pages (vLLM's `_PendingPublication`).
#[derive(Clone, Debug)]
pub struct Publication {
    /// Names the request the bindings build its events from.
    pub id: u64,
    pub num_computed_tokens: usize,
    pub num_pages: usize,
    pub retention_interval: Option<usize>,
    pub replay_boundaries: SmallVec<[i64; 2]>,
    pub hashes: HashSnapshot,
    /// A finished request's host pages, leased until they publish.
    pub detached_blocks: Option<Vec<BlockId>>,
    pub num_cached_blocks: usize,
}

impl HiSparseCoordinator {
    /// vLLM's `publish_when_ready`: the source group's `cache_blocks` with the
    /// request's cacheable tokens; `hashes` holds the ones caching may read.
    pub fn publish_when_ready(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        hashes: &dyn BlockHashSource,
        num_computed_tokens: usize,
        retention_interval: Option<usize>,
        replay_boundaries: &[i64],
    ) -> Result<()> {
        let host = self.layout.host_group;
        let bs = self.layout.block_size;
        let num_pages = num_computed_tokens / bs;
        let cached = ctx
            .requests
            .get(request_id)
            .and_then(|s| s.groups[host].num_cached_block)
            .unwrap_or(0);
        let snapshot = HashSnapshot::take(hashes, cached, num_pages)?;
        let publication = Publication {
            id: self.new_publication_id(),
            num_computed_tokens,
            num_pages,
            retention_interval,
            replay_boundaries: SmallVec::from_slice(replay_boundaries),
            hashes: snapshot,
            detached_blocks: None,
            num_cached_blocks: 0,
        };
        let id = self.get_request_state(request_id);
        self.set_publication(id, Some(publication))?;
        self.publish_if_ready(ctx, request_id)
    }

    /// vLLM's `_publish_host_blocks_if_ready`: publishes the durable prefix of the
    /// request's pending publication.
    pub(crate) fn publish_if_ready(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
    ) -> Result<()> {
        let Some(&id) = self.request_states.get(request_id) else {
            return Ok(());
        };
        let host = self.layout.host_group;
        let bs = self.layout.block_size;
        let (num_tokens, done) = {
            let Some(state) = self.state(id) else {
                return Ok(());
            };
            let Some(p) = &state.publication else {
                return Ok(());
            };
            let num_tokens = p.num_computed_tokens.min(state.ready_prefix_pages * bs);
            let q = CacheQuery {
                request_id,
                block_hashes: &p.hashes,
                num_tokens,
                retention_interval: p.retention_interval,
                replay_boundaries: &p.replay_boundaries,
                // Read only by the partial tail and by masks, which a source group
                // (full attention, block size = hash block size) has neither of.
                num_prompt_tokens: 0,
                num_computed_tokens: 0,
                shared_prefix_boundary: 0,
            };
            let HiSparseCtx {
                pool,
                managers,
                requests,
            } = &mut *ctx;
            if let Some(req_state) = requests.get_mut(request_id) {
                let src = managers[host]
                    .hisparse_source_mut()
                    .ok_or_else(|| Error::Internal("no HiSparse source group".into()))?;
                let r = src.publish_blocks(&mut req_state.groups[host], &q);
                pool.absorb_host_events(src.host_pool_mut(), Some(p.id));
                r?;
            }
            (num_tokens, state.ready_prefix_pages >= p.num_pages)
        };
        self.record_copies(ctx, request_id, num_tokens)?;
        if done {
            self.set_publication(id, None)?;
        }
        Ok(())
    }

    /// vLLM's `_publish_detached_blocks`: a finished request's durable pages, once
    /// no spill of it is in flight.
    pub(crate) fn publish_detached(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        id: StateId,
    ) -> Result<()> {
        let host = self.layout.host_group;
        let bs = self.layout.block_size;
        let state = self.state_mut(id)?;
        if !state.pending_pages.is_empty() {
            return Ok(());
        }
        let Some(p) = &state.publication else {
            return Ok(());
        };
        if p.detached_blocks.is_none() {
            return Ok(());
        }
        while state.valid_pages.contains(&state.ready_prefix_pages) {
            state.ready_prefix_pages += 1;
        }
        let ready = state.ready_prefix_pages;
        let Some(p) = &state.publication else {
            return Ok(());
        };
        let blocks = p.detached_blocks.as_deref().unwrap_or(&[]);
        let num_full = ready.min(p.num_pages);
        // The host group keeps full-attention retention: only sealed pages with
        // completed copies outlive the request.
        let (pub_id, num_cached) = (p.id, p.num_cached_blocks);
        let hashes = &p.hashes;
        ctx.with_host(host, Some(pub_id), |pool| {
            pool.cache_full_blocks(hashes, blocks, num_cached, num_full, bs, host as u32, None)?;
            let reversed: Vec<BlockId> = blocks.iter().rev().copied().collect();
            pool.free_blocks(&reversed)
        })?;
        self.set_publication(id, None)
    }

    /// vLLM's `_record_copies`: indexes the GPU copies of just-published host pages.
    pub(crate) fn record_copies(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        num_computed_tokens: usize,
    ) -> Result<()> {
        if !self.has_resident() {
            return Ok(());
        }
        let host = self.layout.host_group;
        let host_blocks: Vec<BlockId> = match ctx.table(request_id, host) {
            Some(t) if !t.is_empty() => t.to_vec(),
            _ => return Ok(()),
        };
        let id = self.get_request_state(request_id);
        let num_host_blocks = (num_computed_tokens / self.layout.block_size).min(host_blocks.len());
        let (start, pending) = {
            let s = self.state_mut(id)?;
            (s.copies_recorded_blocks, s.pending_pages.clone())
        };
        for (page, &host_block) in host_blocks
            .iter()
            .enumerate()
            .take(num_host_blocks)
            .skip(start)
        {
            if pending.contains_key(&page) {
                continue;
            }
            self.record_copy(ctx, request_id, page, host_block)?;
        }
        let s = self.state_mut(id)?;
        s.copies_recorded_blocks = s.copies_recorded_blocks.max(num_host_blocks);
        Ok(())
    }

    /// vLLM's `_record_copy`: page `page`'s GPU copies under its host block's hash.
    pub(crate) fn record_copy(
        &mut self,
        ctx: &HiSparseCtx<'_>,
        request_id: &str,
        page: usize,
        host_block: BlockId,
    ) -> Result<()> {
        if host_block == NULL_BLOCK_ID {
            return Ok(());
        }
        let Some(key) = ctx
            .host_pool(self.layout.host_group)?
            .block_hash(host_block)
            .copied()
        else {
            return Ok(());
        };
        let mut blocks: SmallVec<[BlockId; 4]> = SmallVec::new();
        for &g in &self.layout.resident_groups {
            match ctx.resident_page(g, request_id, page)? {
                Some(b) => blocks.push(b),
                None => return Ok(()),
            }
        }
        self.drop_copy(&key);
        for &b in &blocks {
            self.copy_by_block.insert(b, key);
        }
        self.copies.insert(key, blocks);
        Ok(())
    }

    /// vLLM's `finish_host_import`: the connector reports an external load done.
    pub fn finish_host_import(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        failed: bool,
    ) -> Result<()> {
        if let Some(n) = self.pending_imports.remove(request_id) {
            if !failed {
                self.complete_host_import(ctx, request_id, n)?;
            }
        }
        Ok(())
    }

    /// vLLM's `complete_host_import`: externally populated host pages become valid;
    /// the last one is restored to its GPU page, and the durable prefix publishes.
    pub fn complete_host_import(
        &mut self,
        ctx: &mut HiSparseCtx<'_>,
        request_id: &str,
        num_computed_tokens: usize,
    ) -> Result<()> {
        if !self.has_resident() {
            return Ok(());
        }
        let bs = self.layout.block_size;
        let num_pages = num_computed_tokens / bs;
        let id = self.get_request_state(request_id);
        let state = self.state_mut(id)?;
        state.valid_pages = (0..num_pages).collect();
        state.ready_prefix_pages = num_pages;
        if num_computed_tokens > 0 {
            self.plan_page_transfer(
                ctx,
                request_id,
                cdiv(num_computed_tokens, bs) - 1,
                false,
                true,
            )?;
        }
        self.publish_if_ready(ctx, request_id)
    }
}
