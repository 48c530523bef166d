//! Caching over the groups: how many tokens a group may cache (hybrid layouts cache
//! up to the scheduler block or a hash boundary), the replay boundaries,
//! `cache_reads` / `cache_blocks`, and the check that refuses a `cache_blocks` past
//! a group's table before anything changes.

use smallvec::SmallVec;

use super::{state_of, CoordinatorKind, KVCacheCoordinator};
use crate::error::{Error, Result};
use crate::manager::request::PlannedHashes;
use crate::manager::single_type::{cache_range, CacheQuery, RequestState};
use crate::request_table::RequestTable;

impl KVCacheCoordinator {
    /// vLLM's `get_num_cacheable_tokens`: the prefix group `g` may cache.
    pub fn get_num_cacheable_tokens(&self, num_computed_tokens: usize, g: usize) -> usize {
        let finalized = num_computed_tokens.saturating_sub(self.num_reprefillable_tokens);
        if self.kind != CoordinatorKind::Hybrid {
            return finalized;
        }
        let align = |n: usize| {
            if self.enable_partial_hash_hits {
                n
            } else {
                n / self.scheduler_block_size * self.scheduler_block_size
            }
        };
        let cached = align(num_computed_tokens);
        let m = self.managers[g].base();
        if m.use_eagle && cached > 0 {
            // EAGLE matches one block past the aligned boundary, then drops it.
            return finalized.min(align(finalized) + m.block_size);
        }
        cached
    }

    /// vLLM's `replay_boundaries`: where a request replaying this prompt resumes.
    pub fn replay_boundaries(&self, num_prompt_tokens: usize) -> SmallVec<[i64; 2]> {
        let p = num_prompt_tokens as i64;
        if self.drop_eagle_group_ids.is_empty() {
            return SmallVec::from_slice(&[p - 1]);
        }
        let b = self.scheduler_block_size as i64;
        let resend = (p - 1).div_euclid(b) * b;
        let extension = p.div_euclid(b) * b;
        let mut out: SmallVec<[i64; 2]> = SmallVec::new();
        for v in [(resend - b).max(0), (extension - b).max(0)] {
            if !out.contains(&v) {
                out.push(v);
            }
        }
        out.sort_unstable();
        out
    }

    /// The raw hash indices caching `num_computed_tokens` of `request_id` may read:
    /// the run `[lo, hi)` and `points` (see [`PlannedHashes`]). `hits_lower_bound`
    /// gives, for a request that adopts hits in this call, the cached blocks it will
    /// have (else its current count is used).
    pub fn cache_reads(
        &self,
        request_id: &str,
        num_computed_tokens: usize,
        num_prompt_tokens: usize,
        num_hashes: usize,
        adopting_tokens: Option<usize>,
        points: &mut SmallVec<[usize; 4]>,
    ) -> (usize, usize) {
        let hbs = self.hash_block_size;
        let state = self.requests.get(request_id);
        let (slot, _) = self
            .requests
            .handle(request_id)
            .map_or((u32::MAX, ()), |h| {
                (RequestTable::<RequestState>::slot_of_handle(h), ())
            });
        let mut lo = usize::MAX;
        let mut hi = 0usize;
        for (g, m) in self.managers.iter().enumerate() {
            let b = m.base();
            if !b.enable_caching {
                continue;
            }
            let scale = (b.block_size / hbs).max(1);
            let cached = match adopting_tokens {
                Some(local) => local / b.block_size,
                None => state
                    .and_then(|s| s.groups.get(g))
                    .and_then(|gb| gb.num_cached_block)
                    .unwrap_or(0),
            };
            lo = lo.min(cached * scale);
            let n = self.get_num_cacheable_tokens(num_computed_tokens, g);
            hi = hi.max(n / hbs);
            m.extra_hash_reads(
                slot,
                num_prompt_tokens,
                num_hashes,
                n,
                num_computed_tokens,
                points,
            );
        }
        (lo.min(hi), hi.min(num_hashes))
    }

    /// vLLM's `cache_blocks` over the groups, with the hashes the call planned.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_blocks(
        &mut self,
        request_id: &str,
        block_hashes: &PlannedHashes,
        num_computed_tokens: usize,
        num_prompt_tokens: usize,
        request_num_computed_tokens: usize,
        shared_prefix_boundary: usize,
    ) -> Result<()> {
        let boundaries = self.replay_boundaries(num_prompt_tokens);
        let Some(handle) = self.requests.handle(request_id) else {
            return Err(Error::UnknownRequest(request_id.to_owned()));
        };
        let slot = RequestTable::<RequestState>::slot_of_handle(handle);
        for g in 0..self.managers.len() {
            if !self.managers[g].base().enable_caching {
                continue;
            }
            let q = CacheQuery {
                request_id,
                block_hashes,
                num_tokens: self.get_num_cacheable_tokens(num_computed_tokens, g),
                retention_interval: self.retention_interval,
                replay_boundaries: &boundaries,
                num_prompt_tokens,
                num_computed_tokens: request_num_computed_tokens,
                shared_prefix_boundary,
            };
            if let Some((h, mut ctx)) = self.hisparse_split() {
                if h.cache_group(&mut ctx, g, &q)? {
                    continue;
                }
            }
            let state = state_of(&mut self.requests, handle, request_id)?;
            self.managers[g].cache_blocks(&mut self.pool, slot, &mut state.groups[g], &q)?;
        }
        Ok(())
    }

    /// Refuses, before anything changes, a `cache_blocks` call that would cache past
    /// a group's table (a request whose caching was delayed, asked to cache more
    /// tokens than it holds blocks for): vLLM slices the table short and records a
    /// cached count past it; the pool's own check would find it only half-way
    /// through the groups.
    pub fn check_cache_fits(
        &self,
        request_id: &str,
        num_computed_tokens: usize,
        num_hashes: usize,
    ) -> Result<()> {
        if self.hisparse.is_some() {
            return Ok(());
        }
        let Some(state) = self.requests.get(request_id) else {
            return Err(Error::UnknownRequest(request_id.to_owned()));
        };
        for (g, m) in self.managers.iter().enumerate() {
            let base = m.base();
            if !base.enable_caching || !base.spec.prefix_cacheable {
                continue;
            }
            let cacheable = self.get_num_cacheable_tokens(num_computed_tokens, g);
            let req = &state.groups[g];
            let (num_cached, num_full) = cache_range(base, &self.pool, req, num_hashes, cacheable);
            if num_full > num_cached && num_full > req.blocks.len() {
                return Err(Error::InvalidArgument(format!(
                    "cannot cache {num_computed_tokens} tokens of request {request_id:?}: \
                     group {g} would cache {num_full} blocks and the request holds {}",
                    req.blocks.len()
                )));
            }
        }
        Ok(())
    }
}
