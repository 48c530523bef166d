//! Hit-path explanations (issue 17, item 2): why a request's last prefix-cache lookup
//! stopped where it did. This file owns the opt-in state and the classification;
//! the manager's hooks live in `src/manager/explain.rs`, the pool's eviction history
//! in `src/pool/eviction_history.rs`, the Python bindings in `src/python/explain.rs`.
//!
//! Key properties:
//! - Opt-in: the manager holds an `Option<Box<Explainer>>` that is `None` unless
//!   explain mode is on; the hot paths test it once and do nothing else.
//! - Bounded: every map here ([`BoundedMap`]) keeps its newest `capacity` entries
//!   and drops the oldest, so a long-running server's memory stays flat.
//! - The reason names the *first missing block* (the block after the hit, in hash
//!   blocks): `lookup_skipped`, `hit_capped`, `block_alignment`, `evicted`,
//!   `extra_keys_differ` or `never_cached` (see [`Reason`]).
//! - `extra_keys_differ` compares *token-only fingerprints*: a chain hash of the
//!   block's token ids and its parent's fingerprint, ignoring every extra key. Blocks
//!   with equal fingerprints hold the same tokens after the same tokens; when their
//!   block hashes differ, their extra-key summaries ([`ExtrasSummary`]) say which of
//!   salt, LoRA, multimodal features or prompt embeddings made the difference.
//!   Fingerprints are 128-bit BLAKE3 digests: a collision is as unlikely as one of
//!   the block hashes themselves.

use std::collections::VecDeque;
use std::hash::Hash;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::types::BlockHash;

/// A token-only fingerprint (see module docs); the root's parent is 0.
pub type Fingerprint = u128;

/// A map that keeps only its newest `capacity` insertions (oldest dropped first).
/// Re-inserting a key refreshes it.
#[derive(Clone, Debug)]
pub struct BoundedMap<K, V> {
    capacity: usize,
    map: FxHashMap<K, (V, u64)>,
    /// Insertion order: `(key, generation)`; an entry whose generation no longer
    /// matches the map's was refreshed later and is skipped.
    order: VecDeque<(K, u64)>,
    next_gen: u64,
}

impl<K: Copy + Eq + Hash, V> BoundedMap<K, V> {
    /// An empty map that holds at most `capacity` (at least 1) entries.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            map: FxHashMap::default(),
            order: VecDeque::new(),
            next_gen: 0,
        }
    }

    /// The most entries kept.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of entries.
    #[inline]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there is no entry.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The entry of `key`.
    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        self.map.get(key).map(|(v, _)| v)
    }

    /// The entry of `key`, mutable (not refreshed).
    #[inline]
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.map.get_mut(key).map(|(v, _)| v)
    }

    /// Inserts (or refreshes) `key`, dropping the oldest entries beyond capacity.
    pub fn insert(&mut self, key: K, value: V) {
        let generation = self.next_gen;
        self.next_gen += 1;
        self.map.insert(key, (value, generation));
        self.order.push_back((key, generation));
        while self.map.len() > self.capacity {
            let Some((old, g)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&old).is_some_and(|(_, cur)| *cur == g) {
                self.map.remove(&old);
            }
        }
        if self.order.len() > 2 * self.capacity {
            // Refreshed keys leave stale order entries behind: drop them.
            let map = &self.map;
            self.order
                .retain(|(k, g)| map.get(k).is_some_and(|(_, cur)| cur == g));
        }
    }

    /// Removes `key`'s entry.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.map.remove(key).map(|(v, _)| v)
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }

    /// Length of the insertion-order queue (tests: it stays bounded too).
    pub fn order_len(&self) -> usize {
        self.order.len()
    }
}

/// What the request's extra keys hold for one block (what the block hash sees
/// besides the tokens), summarized for comparison.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtrasSummary {
    /// A digest of `cache_salt` (first block only, as in vLLM).
    pub salt: Option<u64>,
    /// The LoRA adapter's name (`lora_request.lora_name`).
    pub lora: Option<String>,
    /// Identifiers of the multimodal items overlapping the block, with their offset
    /// relative to the block start.
    pub mm: SmallVec<[(String, i64); 1]>,
    /// Whether the block's tokens come with prompt embeddings.
    pub prompt_embeds: bool,
}

impl ExtrasSummary {
    /// The names of the extra keys that differ between `self` and `other`
    /// (`cache_salt`, `lora`, `mm`, `prompt_embeds`).
    pub fn differences(&self, other: &Self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.salt != other.salt {
            out.push("cache_salt");
        }
        if self.lora != other.lora {
            out.push("lora");
        }
        if self.mm != other.mm {
            out.push("mm");
        }
        if self.prompt_embeds != other.prompt_embeds {
            out.push("prompt_embeds");
        }
        out
    }
}

/// The raw fields of a request that explanations read (its token ids from a given
/// block on and the extra-key fields), as the bindings found them.
#[derive(Clone, Debug, Default)]
pub struct RequestFacts {
    /// Token ids of blocks `[start, end)`, `(end - start) * block_size` of them (fewer
    /// if the request has fewer).
    pub tokens: Vec<i64>,
    /// `request.cache_salt`.
    pub cache_salt: Option<String>,
    /// `request.lora_request.lora_name`.
    pub lora: Option<String>,
    /// `(offset, length, identifier)` of each multimodal feature.
    pub mm: Vec<(usize, usize, String)>,
    /// Number of prompt embeddings (0: the request has none).
    pub num_prompt_embeds: usize,
    /// Why the request skips reading the prefix cache, if it does and the bindings
    /// can tell (`prompt_logprobs`, `pooling`).
    pub skip_cause: Option<String>,
}

/// One block as explanations see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockFacts {
    pub fingerprint: Fingerprint,
    pub extras: ExtrasSummary,
}

/// The fingerprint of a block of `tokens` after a parent with fingerprint `parent`.
pub fn fingerprint(parent: Fingerprint, tokens: &[i64]) -> Fingerprint {
    let mut h = blake3::Hasher::new();
    h.update(&parent.to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    let digest = h.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest.as_bytes()[..16]);
    u128::from_le_bytes(bytes)
}

/// A short digest of a salt string (compared, never shown).
fn salt_digest(salt: &str) -> u64 {
    let digest = blake3::hash(salt.as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(bytes)
}

/// The facts of blocks `[start, end)` of `block_size` tokens, `facts.tokens` holding
/// their tokens and `parent` the fingerprint of block `start - 1` (0 for the root).
/// Stops early at a block the tokens do not fill.
pub fn block_facts(
    facts: &RequestFacts,
    block_size: usize,
    start: usize,
    end: usize,
    mut parent: Fingerprint,
) -> Vec<BlockFacts> {
    let mut out = Vec::with_capacity(end.saturating_sub(start));
    if block_size == 0 {
        return out;
    }
    for (k, chunk) in facts.tokens.chunks_exact(block_size).enumerate() {
        let i = start + k;
        if i >= end {
            break;
        }
        let (lo, hi) = (i * block_size, (i + 1) * block_size);
        let fp = fingerprint(parent, chunk);
        parent = fp;
        let extras = ExtrasSummary {
            salt: if i == 0 {
                facts.cache_salt.as_deref().map(salt_digest)
            } else {
                None
            },
            lora: facts.lora.clone(),
            mm: facts
                .mm
                .iter()
                .filter(|(off, len, _)| *off < hi && off + len > lo)
                .map(|(off, _, id)| (id.clone(), *off as i64 - lo as i64))
                .collect(),
            prompt_embeds: lo < facts.num_prompt_embeds,
        };
        out.push(BlockFacts {
            fingerprint: fp,
            extras,
        });
    }
    out
}

/// Why the last lookup stopped where it did (see `docs/explain.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// No lookup: caching is off, or the request skips reading the prefix cache.
    LookupSkipped,
    /// Every full block up to the cap was cached; the cap (`num_tokens - 1` or
    /// `max_cache_hit_length`) cut the hit.
    HitCapped,
    /// No full block to look up beyond the hit (a partial block is never cached), or
    /// a hybrid layout's alignment cut the hit.
    BlockAlignment,
    /// The first missing block was cached and has been evicted.
    Evicted,
    /// A block with the same tokens after the same tokens is (or was) cached under
    /// another hash: the extra keys differ.
    ExtraKeysDiffer,
    /// None of the above: the block was never stored (as far as the bounded
    /// histories remember).
    NeverCached,
}

impl Reason {
    /// Every reason, in [`Reason::index`] order.
    pub const ALL: [Reason; 6] = [
        Reason::LookupSkipped,
        Reason::HitCapped,
        Reason::BlockAlignment,
        Reason::Evicted,
        Reason::ExtraKeysDiffer,
        Reason::NeverCached,
    ];

    /// The reason's position in [`Reason::ALL`] (the counters of [`Explainer`]).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The reason's name in the Python API.
    pub fn name(self) -> &'static str {
        match self {
            Reason::LookupSkipped => "lookup_skipped",
            Reason::HitCapped => "hit_capped",
            Reason::BlockAlignment => "block_alignment",
            Reason::Evicted => "evicted",
            Reason::ExtraKeysDiffer => "extra_keys_differ",
            Reason::NeverCached => "never_cached",
        }
    }
}

/// One value of a record's detail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Detail {
    Int(u64),
    Bool(bool),
    Str(String),
    List(Vec<String>),
}

/// The record of one request's last lookup.
#[derive(Clone, Debug)]
pub struct LookupRecord {
    /// Hit length in hash blocks (`hit_tokens / hash_block_size`).
    pub hit_blocks: usize,
    pub hit_tokens: usize,
    /// Full hash blocks the request had hashes for.
    pub num_full_blocks: usize,
    /// `request.num_tokens` at the lookup (0 when the lookup was skipped early).
    pub num_tokens: usize,
    pub reason: Reason,
    /// Reason-specific facts (names as in `docs/explain.md`).
    pub detail: Vec<(&'static str, Detail)>,
    /// The manager's lookup counter at this lookup (1 = its first explained lookup).
    pub lookup_seq: u64,
}

/// What a cached block looked like when it was cached (the fingerprint index).
#[derive(Clone, Debug)]
pub struct CachedVariant {
    pub hash: BlockHash,
    pub extras: ExtrasSummary,
}

/// Per-request state: the last lookup and how far its cached blocks were recorded.
#[derive(Clone, Debug, Default)]
pub struct RequestExplain {
    pub last_lookup: Option<LookupRecord>,
    /// Blocks `[0, recorded)` are in the fingerprint index.
    pub recorded: usize,
    /// Fingerprint of block `recorded - 1` (0 if none).
    pub parent: Fingerprint,
}

/// At most this many variants (different hashes) per fingerprint are remembered.
const MAX_VARIANTS: usize = 4;

/// The manager's explain state (see module docs).
#[derive(Debug)]
pub struct Explainer {
    requests: BoundedMap<u64, (String, RequestExplain)>,
    fingerprints: BoundedMap<Fingerprint, SmallVec<[CachedVariant; 1]>>,
    lookups: u64,
    /// Explained lookups by reason since explain mode was turned on (never bounded:
    /// one counter per reason), for `hscache.stats()`.
    reason_counts: [u64; Reason::ALL.len()],
}

/// Key of a request id in the per-request map (a collision only shares a slot:
/// the stored id is compared).
fn request_key(request_id: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = rustc_hash::FxHasher::default();
    h.write(request_id.as_bytes());
    h.finish()
}

impl Explainer {
    /// Remembers the last `max_requests` requests and `max_fingerprints` cached
    /// blocks' fingerprints.
    pub fn new(max_requests: usize, max_fingerprints: usize) -> Self {
        Self {
            requests: BoundedMap::new(max_requests),
            fingerprints: BoundedMap::new(max_fingerprints),
            lookups: 0,
            reason_counts: [0; Reason::ALL.len()],
        }
    }

    /// Explained lookups so far, by reason (in [`Reason::ALL`] order).
    pub fn reason_counts(&self) -> [u64; Reason::ALL.len()] {
        self.reason_counts
    }

    /// Requests whose last lookup is remembered (at most the map's capacity).
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Counts a lookup; returns its sequence number.
    pub fn next_lookup(&mut self) -> u64 {
        self.lookups += 1;
        self.lookups
    }

    /// The request's state, if remembered.
    pub fn request(&self, request_id: &str) -> Option<&RequestExplain> {
        self.requests
            .get(&request_key(request_id))
            .filter(|(id, _)| id == request_id)
            .map(|(_, r)| r)
    }

    /// The request's state, created (or taken over from a colliding id) if needed.
    pub fn request_mut(&mut self, request_id: &str) -> &mut RequestExplain {
        let key = request_key(request_id);
        let fresh = self
            .requests
            .get(&key)
            .is_none_or(|(id, _)| id != request_id);
        if fresh {
            self.requests
                .insert(key, (request_id.to_owned(), RequestExplain::default()));
        }
        match self.requests.get_mut(&key) {
            Some((_, r)) => r,
            None => unreachable!("inserted above"),
        }
    }

    /// Records the request's last lookup.
    pub fn set_lookup(&mut self, request_id: &str, record: LookupRecord) {
        self.reason_counts[record.reason.index()] += 1;
        self.request_mut(request_id).last_lookup = Some(record);
    }

    /// Records that a block with `hash` and these facts was cached.
    pub fn record_cached(&mut self, hash: BlockHash, facts: &BlockFacts) {
        let variant = CachedVariant {
            hash,
            extras: facts.extras.clone(),
        };
        if let Some(vs) = self.fingerprints.get_mut(&facts.fingerprint) {
            if vs.iter().any(|v| v.hash == hash) {
                return;
            }
            if vs.len() >= MAX_VARIANTS {
                vs.remove(0);
            }
            vs.push(variant);
            return;
        }
        let mut vs = SmallVec::new();
        vs.push(variant);
        self.fingerprints.insert(facts.fingerprint, vs);
    }

    /// The cached variants with the same tokens as `facts` but another hash than
    /// `hash`.
    pub fn variants<'s>(
        &'s self,
        facts: &BlockFacts,
        hash: &'s BlockHash,
    ) -> impl Iterator<Item = &'s CachedVariant> + 's {
        self.fingerprints
            .get(&facts.fingerprint)
            .into_iter()
            .flatten()
            .filter(move |v| v.hash != *hash)
    }

    /// Number of fingerprints remembered.
    pub fn num_fingerprints(&self) -> usize {
        self.fingerprints.len()
    }

    /// Forgets every fingerprint (the prefix cache was reset).
    pub fn clear_fingerprints(&mut self) {
        self.fingerprints.clear();
        for key in self.requests.map.keys().copied().collect::<Vec<_>>() {
            if let Some((_, r)) = self.requests.get_mut(&key) {
                r.recorded = 0;
                r.parent = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_map_keeps_the_newest_entries() {
        let mut m = BoundedMap::new(3);
        for k in 0..10u32 {
            m.insert(k, k * 10);
        }
        assert_eq!(m.len(), 3);
        assert!(m.get(&6).is_none());
        assert_eq!(m.get(&9), Some(&90));
        // Refreshing one key many times keeps both the map and the queue bounded.
        for _ in 0..100 {
            m.insert(7, 1);
        }
        assert_eq!(m.len(), 3);
        assert!(m.order_len() <= 2 * m.capacity() + 1);
        m.insert(10, 0);
        m.insert(11, 0);
        assert_eq!(m.get(&7), Some(&1), "refreshed key is the newest");
    }

    #[test]
    fn fingerprints_ignore_extra_keys_and_chain_parents() {
        let a = RequestFacts {
            tokens: (0..8).collect(),
            cache_salt: Some("a".into()),
            ..RequestFacts::default()
        };
        let b = RequestFacts {
            cache_salt: Some("b".into()),
            ..a.clone()
        };
        let fa = block_facts(&a, 4, 0, 2, 0);
        let fb = block_facts(&b, 4, 0, 2, 0);
        assert_eq!(fa.len(), 2);
        assert_eq!(fa[0].fingerprint, fb[0].fingerprint);
        assert_eq!(fa[1].fingerprint, fb[1].fingerprint);
        assert_eq!(fa[0].extras.differences(&fb[0].extras), vec!["cache_salt"]);
        assert!(fa[1].extras.differences(&fb[1].extras).is_empty());
        // Same tokens after another parent: another fingerprint.
        assert_ne!(fingerprint(1, &[4, 5, 6, 7]), fa[1].fingerprint);
        // Resuming from the parent gives the same chain.
        let tail = RequestFacts {
            tokens: (4..8).collect(),
            ..a.clone()
        };
        assert_eq!(block_facts(&tail, 4, 1, 2, fa[0].fingerprint)[0], fa[1]);
    }
}
