//! The manager's explain-mode hooks (`crate::explain`): turning the mode on, the
//! record of each lookup and the fingerprints of the blocks each request caches.
//! Everything here is cold: the facade calls it only when `self.explain` is `Some`,
//! and a failure to read the request only leaves the explanation less precise (it
//! never fails the call it explains).

use smallvec::SmallVec;

use super::{KVCacheManager, RequestLike};
use crate::error::{Error, Result};
use crate::explain::{block_facts, Detail, Explainer, LookupRecord, Reason};
use crate::types::{BlockHash, BlockHashSource, BlockHashWithGroupId};

/// Requests whose last lookup is remembered, by default.
pub const DEFAULT_MAX_REQUESTS: usize = 8192;

fn int(n: usize) -> Detail {
    Detail::Int(n as u64)
}

fn list(items: impl IntoIterator<Item = impl ToString>) -> Detail {
    Detail::List(items.into_iter().map(|i| i.to_string()).collect())
}

impl KVCacheManager {
    /// Turns explain mode on (`true`) or off. On, the pool keeps a bounded eviction
    /// history of `history_capacity` keys (default: 4 per block, at least 4096) and
    /// the manager a fingerprint index of as many cached blocks.
    pub fn set_explain(&mut self, on: bool, history_capacity: Option<usize>) -> Result<()> {
        self.guard()?;
        if !on {
            self.explain = None;
            self.coordinator.block_pool_mut().set_eviction_history(None);
            return Ok(());
        }
        let num_blocks = self.block_pool().num_gpu_blocks() as usize;
        let capacity = history_capacity.unwrap_or_else(|| (4 * num_blocks).max(4096));
        if capacity == 0 {
            return Err(Error::InvalidArgument(
                "explain history capacity must be positive".into(),
            ));
        }
        self.explain = Some(Box::new(Explainer::new(DEFAULT_MAX_REQUESTS, capacity)));
        self.coordinator
            .block_pool_mut()
            .set_eviction_history(Some(capacity));
        Ok(())
    }

    /// Whether explain mode is on.
    #[inline]
    pub fn explain_enabled(&self) -> bool {
        self.explain.is_some()
    }

    /// The record of the request's last lookup: `Err(Unsupported)` with explain
    /// mode off, `Err(UnknownRequest)` for a request without an explained lookup.
    pub fn explain(&self, request_id: &str) -> Result<&LookupRecord> {
        let Some(e) = self.explain.as_deref() else {
            return Err(Error::Unsupported(
                "explain mode is off: build the manager with explain=True or set HSCACHE_EXPLAIN=1"
                    .into(),
            ));
        };
        e.request(request_id)
            .and_then(|r| r.last_lookup.as_ref())
            .ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))
    }

    /// The explainer, when explain mode is on (tests, stats).
    pub fn explainer(&self) -> Option<&Explainer> {
        self.explain.as_deref()
    }

    /// Groups that key hash index `i` (a group of `k` hash blocks per block keys its
    /// blocks by the hash at each block's last hash boundary).
    fn explain_groups_at(&self, i: usize) -> SmallVec<[u32; 4]> {
        let hbs = self.coordinator.hash_block_size().max(1);
        self.coordinator
            .managers()
            .iter()
            .enumerate()
            .filter(|(_, m)| {
                let k = (m.base().block_size / hbs).max(1);
                (i + 1) % k == 0
            })
            .map(|(g, _)| g as u32)
            .collect()
    }

    /// Records a skipped lookup (caching off, or the request skips reading).
    #[cold]
    #[inline(never)]
    pub(super) fn explain_skipped<R: RequestLike>(&mut self, request: &R) {
        let caching = self.enable_caching();
        let mut detail = Vec::new();
        if caching {
            detail.push(("cause", Detail::Str("skip_reading_prefix_cache".into())));
            let why = request
                .explain_facts(self.coordinator.hash_block_size(), 0, 0)
                .ok()
                .flatten()
                .and_then(|f| f.skip_cause);
            if let Some(why) = why {
                detail.push(("skip_reason", Detail::Str(why)));
            }
        } else {
            detail.push(("cause", Detail::Str("caching_disabled".into())));
        }
        let record = LookupRecord {
            hit_blocks: 0,
            hit_tokens: 0,
            num_full_blocks: request.block_hashes().map_or(0, BlockHashSource::len),
            num_tokens: request.num_tokens().unwrap_or(0),
            reason: Reason::LookupSkipped,
            detail,
            lookup_seq: 0,
        };
        self.explain_store(request.request_id(), record);
    }

    fn explain_store(&mut self, request_id: &str, mut record: LookupRecord) {
        if let Some(e) = self.explain.as_deref_mut() {
            record.lookup_seq = e.next_lookup();
            e.set_lookup(request_id, record);
        }
    }

    /// Records a lookup that ran: `hit` tokens under the cap `max_len`;
    /// `group_hits`: each group's own hit (hybrid Mamba connector lookups).
    #[cold]
    #[inline(never)]
    pub(super) fn explain_lookup<R: RequestLike>(
        &mut self,
        request: &R,
        max_len: usize,
        hit: usize,
        group_hits: Option<&[usize]>,
    ) {
        let hbs = self.coordinator.hash_block_size().max(1);
        let Ok(hashes) = request.block_hashes() else {
            return;
        };
        let n = hashes.len();
        let num_tokens = request.num_tokens().unwrap_or(0);
        let i = hit / hbs;
        let mut detail: Vec<(&'static str, Detail)> = vec![("max_hit_tokens", int(max_len))];
        if let Some(hits) = group_hits {
            detail.push(("group_hit_tokens", list(hits)));
            if let Some((g, _)) = hits.iter().enumerate().min_by_key(|(_, h)| **h) {
                detail.push(("limited_by_group", int(g)));
            }
        }
        let align = self.coordinator.cache_hit_alignment_tokens().max(hbs);
        let k = (align / hbs).max(1);
        let reason = if i >= n {
            detail.push(("hash_block_size", int(hbs)));
            detail.push(("partial_tokens", int(num_tokens.saturating_sub(n * hbs))));
            Reason::BlockAlignment
        } else if i + k > n {
            // The full blocks left do not fill one aligned unit of the layout.
            detail.push(("first_missing_block", int(i)));
            detail.push(("cause", Detail::Str(self.alignment_cause().into())));
            detail.push(("alignment_tokens", int(align)));
            detail.push(("partial_tokens", int(num_tokens.saturating_sub(i * hbs))));
            Reason::BlockAlignment
        } else {
            self.explain_unit(request, i, k, max_len, &mut detail)
        };
        let record = LookupRecord {
            hit_blocks: hit / hbs,
            hit_tokens: hit,
            num_full_blocks: n,
            num_tokens,
            reason,
            detail,
            lookup_seq: 0,
        };
        self.explain_store(request.request_id(), record);
    }

    /// `hybrid_alignment` (several groups) or `scheduler_block_alignment`.
    fn alignment_cause(&self) -> &'static str {
        if self.coordinator.num_groups() > 1 {
            "hybrid_alignment"
        } else {
            "scheduler_block_alignment"
        }
    }

    /// The reason the aligned unit of hash blocks `[i, i + k)` after the hit was
    /// not hit.
    fn explain_unit<R: RequestLike>(
        &self,
        request: &R,
        i: usize,
        k: usize,
        max_len: usize,
        detail: &mut Vec<(&'static str, Detail)>,
    ) -> Reason {
        // One piece: one early `return` per reason, in the order they are told apart
        // (capped, alignment, evicted, extra keys, never cached), each pushing its detail.
        let hbs = self.coordinator.hash_block_size().max(1);
        let pool = self.block_pool();
        let Ok(hashes) = request.block_hashes() else {
            return Reason::NeverCached;
        };
        // The first block of the unit some group does not hold.
        let mut first = None;
        for j in i..i + k {
            let Ok(h) = hashes.get(j) else {
                break;
            };
            let (cached, missing): (SmallVec<[u32; 4]>, SmallVec<[u32; 4]>) = self
                .explain_groups_at(j)
                .iter()
                .copied()
                .partition(|&g| pool.get_cached_block(&h, g).is_some());
            if !missing.is_empty() {
                first = Some((j, h, cached, missing));
                break;
            }
        }
        if (i + k) * hbs > max_len {
            detail.push(("first_missing_block", int(i)));
            detail.push(("block_cached", Detail::Bool(first.is_none())));
            return Reason::HitCapped;
        }
        let alignment = |detail: &mut Vec<(&'static str, Detail)>| {
            detail.push(("cause", Detail::Str(self.alignment_cause().into())));
            detail.push((
                "alignment_tokens",
                int(self.coordinator.cache_hit_alignment_tokens()),
            ));
            detail.push((
                "group_block_sizes",
                list(
                    self.coordinator
                        .managers()
                        .iter()
                        .map(|m| m.base().block_size),
                ),
            ));
        };
        let Some((j, h, cached, missing)) = first else {
            // Every group holds the unit: a group's own rule (sliding window, Mamba
            // state) cut the hit.
            detail.push(("first_missing_block", int(i)));
            alignment(detail);
            return Reason::BlockAlignment;
        };
        detail.push(("first_missing_block", int(j)));
        if !cached.is_empty() {
            // Some groups hold the block, others do not: the hit needs all of them.
            alignment(detail);
            detail.push(("cached_in_groups", list(cached.iter())));
            detail.push(("missing_in_groups", list(missing.iter())));
            return Reason::BlockAlignment;
        }
        let groups = self.explain_groups_at(j);
        if let Some(history) = pool.eviction_history() {
            let last = groups
                .iter()
                .filter_map(|&group_id| history.get(&BlockHashWithGroupId { hash: h, group_id }))
                .max_by_key(|r| r.seq);
            if let Some(r) = last {
                detail.push(("eviction_seq", Detail::Int(r.seq)));
                detail.push((
                    "evictions_since",
                    Detail::Int(history.evictions().saturating_sub(r.seq)),
                ));
                detail.push(("policy", Detail::Str(r.policy.into())));
                detail.push(("eviction_cause", Detail::Str(r.cause.name().into())));
                return Reason::Evicted;
            }
            if history.resets() > 0 {
                detail.push(("prefix_cache_resets", Detail::Int(history.resets())));
            }
        }
        if let Some(reason) = self.explain_extra_keys(request, j, &h, detail) {
            return reason;
        }
        Reason::NeverCached
    }

    /// `extra_keys_differ` if a block with the same tokens after the same tokens was
    /// cached under another hash (one still cached preferred).
    fn explain_extra_keys<R: RequestLike>(
        &self,
        request: &R,
        i: usize,
        h: &BlockHash,
        detail: &mut Vec<(&'static str, Detail)>,
    ) -> Option<Reason> {
        let e = self.explain.as_deref()?;
        let hbs = self.coordinator.hash_block_size().max(1);
        let facts = request.explain_facts(hbs, 0, i + 1).ok().flatten();
        let Some(facts) = facts else {
            detail.push(("fingerprints_compared", Detail::Bool(false)));
            return None;
        };
        let blocks = block_facts(&facts, hbs, 0, i + 1, 0);
        let mine = blocks.get(i)?;
        let pool = self.block_pool();
        let groups = self.explain_groups_at(i);
        let is_cached = |hash: &BlockHash| {
            groups
                .iter()
                .any(|&g| pool.get_cached_block(hash, g).is_some())
        };
        let variant = e.variants(mine, h).max_by_key(|v| is_cached(&v.hash))?;
        let mut differs = mine.extras.differences(&variant.extras);
        if differs.is_empty() {
            // The summaries agree; only the embedding values (not summarized) can
            // differ.
            differs.push(if mine.extras.prompt_embeds {
                "prompt_embeds"
            } else {
                "unknown"
            });
        }
        detail.push(("differs", list(differs)));
        detail.push(("variant_cached", Detail::Bool(is_cached(&variant.hash))));
        Some(Reason::ExtraKeysDiffer)
    }

    /// Records the fingerprints of the request's blocks cached since the last call
    /// (after `allocate_slots` or `cache_blocks` with explain mode on).
    #[cold]
    #[inline(never)]
    pub(super) fn explain_cached<R: RequestLike>(&mut self, request: &R) {
        let Some(e) = self.explain.as_deref() else {
            return;
        };
        let rid = request.request_id();
        let (start, parent) = e.request(rid).map_or((0, 0), |r| (r.recorded, r.parent));
        let Ok(hashes) = request.block_hashes() else {
            return;
        };
        let n = hashes.len();
        if n <= start {
            return;
        }
        let pool = self.block_pool();
        let mut end = start;
        let mut keyed: SmallVec<[BlockHash; 8]> = SmallVec::new();
        while end < n {
            let Ok(h) = hashes.get(end) else {
                break;
            };
            let groups = self.explain_groups_at(end);
            if !groups.is_empty()
                && !groups
                    .iter()
                    .any(|&g| pool.get_cached_block(&h, g).is_some())
            {
                break;
            }
            keyed.push(h);
            end += 1;
        }
        if end == start {
            return;
        }
        let hbs = self.coordinator.hash_block_size().max(1);
        let facts = request.explain_facts(hbs, start, end);
        let Some(e) = self.explain.as_deref_mut() else {
            return;
        };
        let Ok(Some(facts)) = facts else {
            // The request cannot tell its tokens: do not look at these blocks again.
            e.request_mut(rid).recorded = end;
            return;
        };
        let blocks = block_facts(&facts, hbs, start, end, parent);
        for (h, f) in keyed.iter().zip(&blocks) {
            e.record_cached(*h, f);
        }
        if let Some(last) = blocks.last() {
            let r = e.request_mut(rid);
            r.recorded = start + blocks.len();
            r.parent = last.fingerprint;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::explain::{Detail, Reason};
    use crate::testing::{admit, full_attention_manager, lookup, prompt_hashes, request};

    fn detail<'a>(r: &'a crate::explain::LookupRecord, key: &str) -> Option<&'a Detail> {
        r.detail.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    #[test]
    fn reasons_from_the_core_alone() {
        // 4 usable blocks of 16 tokens.
        let mut m = full_attention_manager(5, 16, 1 << 16, true, false, false);
        m.set_explain(true, Some(16))
            .unwrap_or_else(|e| panic!("{e}"));
        let a = request("a", 0, 3 * 16 + 1, &prompt_hashes(1, 3, 0, 0));
        lookup(&mut m, &a);
        assert_eq!(
            m.explain("a").map(|r| r.reason).ok(),
            Some(Reason::NeverCached)
        );
        admit(&mut m, &a);
        m.free("a").unwrap_or_else(|e| panic!("{e}"));
        // The same prompt, a multiple of the block size: capped at num_tokens - 1.
        let capped = request("c", 0, 3 * 16, &prompt_hashes(1, 3, 0, 0));
        lookup(&mut m, &capped);
        let r = m.explain("c").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.reason, r.hit_blocks), (Reason::HitCapped, 2));
        // Another 4-block prompt evicts a's blocks under LRU.
        let b = request("b", 0, 3 * 16 + 1, &prompt_hashes(2, 3, 0, 0));
        admit(&mut m, &b);
        m.free("b").unwrap_or_else(|e| panic!("{e}"));
        let again = request("a2", 0, 3 * 16 + 1, &prompt_hashes(1, 3, 0, 0));
        lookup(&mut m, &again);
        let r = m.explain("a2").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.reason, Reason::Evicted);
        assert_eq!(detail(r, "policy"), Some(&Detail::Str("lru".into())));
        // The history stays within its capacity.
        let h = m
            .block_pool()
            .eviction_history()
            .map(|h| (h.len(), h.capacity()));
        assert!(h.is_some_and(|(len, cap)| len <= cap && cap == 16));
        assert!(m.explain("unknown").is_err());
    }

    #[test]
    fn off_is_an_error_and_records_nothing() {
        let mut m = full_attention_manager(8, 16, 1 << 16, true, false, false);
        let a = request("a", 0, 20, &prompt_hashes(1, 1, 0, 0));
        lookup(&mut m, &a);
        assert!(matches!(
            m.explain("a"),
            Err(crate::error::Error::Unsupported(_))
        ));
        assert!(m.explainer().is_none() && m.block_pool().eviction_history().is_none());
    }
}
