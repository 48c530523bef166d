//! Opt-in retention policies: which free cached block the pool evicts first.
//!
//! The default policy, `lru`, is the pool's own free queue (vLLM's order, see
//! [`lru`]); no [`Retention`] exists then and the pool's hot path is unchanged.
//! Selecting another policy attaches a [`Retention`] to the pool: an eviction index
//! over the free *cached* blocks, one LRU list per class (lower class evicted
//! first, LRU within a class), deadlines for classes that expire, and the pin
//! bookkeeping. Free blocks without a hash are still reused first, from the head of
//! the free queue, as in vLLM.
//!
//! Each policy lives in its own file and only decides a block's [`Placement`] when
//! it is freed (and, for SLRU, how hits promote and the protected segment demotes):
//! [`priority`], [`pin`], [`ttl`], [`slru`]. Free, hit and evict are O(1); a deadline costs O(log n).
//!
//! Per-request hints ([`RetentionHint`]) are set by the caller just before it frees
//! a request's blocks (the Python glue reads `sampling_params.extra_args`).

pub mod index;
pub mod lru;
pub mod pin;
pub mod priority;
pub mod slru;
pub mod ttl;

use std::time::Instant;

use crate::error::{Error, Result};
use crate::types::BlockId;
use index::EvictionIndex;

/// The retention policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetentionKind {
    /// vLLM's LRU (the default; no [`Retention`] attached).
    Lru,
    /// Per-request priority 0-100 with an optional duration (TensorRT-LLM style).
    Priority,
    /// Pinned requests' blocks are never evicted while pinned (capped).
    Pin,
    /// Freed blocks are protected for a time-to-live, then ordinary LRU.
    Ttl,
    /// Segmented LRU: blocks hit again move to a capped protected segment.
    Slru,
}

impl RetentionKind {
    /// Parses `lru|priority|pin|ttl|slru`.
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "" | "lru" => Self::Lru,
            "priority" => Self::Priority,
            "pin" => Self::Pin,
            "ttl" => Self::Ttl,
            "slru" => Self::Slru,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown retention policy {other:?}: expected lru, priority, pin, ttl or slru"
                )))
            }
        })
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Priority => "priority",
            Self::Pin => "pin",
            Self::Ttl => "ttl",
            Self::Slru => "slru",
        }
    }
}

/// Policy settings (defaults in [`RetentionConfig::default`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RetentionConfig {
    /// `priority`: the priority of requests without a hint, and of blocks whose
    /// duration ran out (TensorRT-LLM's default is 35).
    pub default_priority: u8,
    /// `ttl`: protection of freed blocks without a hint, in milliseconds.
    pub ttl_ms: u64,
    /// `pin`: at most this many blocks pinned at once (pins past it are ignored).
    pub max_pinned_blocks: usize,
    /// `slru`: at most this many free blocks in the protected segment.
    pub slru_protected_blocks: usize,
    /// The clock moves only by [`Retention::advance_clock`] (simulated traces).
    pub manual_clock: bool,
}

impl RetentionConfig {
    /// Defaults for a pool of `num_blocks` blocks: priority 35, TTL 60 s, half the
    /// pool pinnable, 80 % of it protected under SLRU.
    pub fn for_pool(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        Self {
            default_priority: 35,
            ttl_ms: 60_000,
            max_pinned_blocks: n / 2,
            slru_protected_blocks: n * 4 / 5,
            manual_clock: false,
        }
    }
}

/// What the caller says about the request whose blocks it is about to free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetentionHint {
    /// `priority`: 0-100 (None: the default priority).
    pub priority: Option<u8>,
    /// `priority` / `ttl`: how long the hint holds, in milliseconds.
    pub duration_ms: Option<u64>,
    /// `pin`: pin the request's cached blocks.
    pub pin: bool,
}

/// Where a freed cached block goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In the eviction index under `class`; at `expires.0` (ms) it moves to class
    /// `expires.1`.
    Evictable {
        /// Lower classes are evicted first.
        class: u8,
        /// `(deadline_ms, class_after)`.
        expires: Option<(u64, u8)>,
    },
    /// Not evictable (and not counted free) until unpinned.
    Pinned,
}

/// Counters for `stats()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionStats {
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Of those, how many came from class 0 (the lowest).
    pub evictions_lowest_class: u64,
    /// Class changes because a deadline passed.
    pub expirations: u64,
    /// SLRU demotions from the protected segment.
    pub demotions: u64,
    /// Pin requests refused because of the cap.
    pub pins_refused: u64,
}

/// A non-LRU policy attached to a pool (see module docs).
#[derive(Clone, Debug)]
pub struct Retention {
    kind: RetentionKind,
    config: RetentionConfig,
    index: EvictionIndex,
    pinned: Vec<bool>,
    num_pinned: usize,
    num_pinned_free: usize,
    /// SLRU: prefix hits since the block was cached (saturating).
    hits: Vec<u8>,
    hint: RetentionHint,
    epoch: Instant,
    clock_offset_ms: u64,
    stats: RetentionStats,
}

impl Retention {
    /// A policy for a pool of `num_blocks` blocks; `Lru` is refused (the pool's
    /// own queue implements it).
    pub fn new(kind: RetentionKind, config: RetentionConfig, num_blocks: u32) -> Result<Self> {
        if kind == RetentionKind::Lru {
            return Err(Error::InvalidArgument(
                "lru is the pool's own queue, not an attached policy".into(),
            ));
        }
        let n = num_blocks as usize;
        Ok(Self {
            kind,
            config,
            index: EvictionIndex::new(n),
            pinned: vec![false; n],
            num_pinned: 0,
            num_pinned_free: 0,
            hits: vec![0; n],
            hint: RetentionHint::default(),
            epoch: Instant::now(),
            clock_offset_ms: 0,
            stats: RetentionStats::default(),
        })
    }

    /// The policy.
    #[inline]
    pub fn kind(&self) -> RetentionKind {
        self.kind
    }

    /// The settings.
    #[inline]
    pub fn config(&self) -> &RetentionConfig {
        &self.config
    }

    /// Counters.
    #[inline]
    pub fn stats(&self) -> &RetentionStats {
        &self.stats
    }

    /// Milliseconds since the policy was attached, plus any test offset (only the
    /// offset with `manual_clock`).
    pub fn now_ms(&self) -> u64 {
        if self.config.manual_clock {
            return self.clock_offset_ms;
        }
        let elapsed = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        elapsed.saturating_add(self.clock_offset_ms)
    }

    /// Moves the clock forward (tests and simulated traces).
    pub fn advance_clock(&mut self, ms: u64) {
        self.clock_offset_ms = self.clock_offset_ms.saturating_add(ms);
    }

    /// Sets the hint applied to the next frees (until [`Self::clear_hint`]).
    #[inline]
    pub fn set_hint(&mut self, hint: RetentionHint) {
        self.hint = hint;
    }

    /// Back to no hint.
    #[inline]
    pub fn clear_hint(&mut self) {
        self.hint = RetentionHint::default();
    }

    /// Free blocks that may not be handed out (pinned ones).
    #[inline]
    pub fn num_reserved_free(&self) -> usize {
        self.num_pinned_free
    }

    /// Pinned blocks (free or in use).
    #[inline]
    pub fn num_pinned(&self) -> usize {
        self.num_pinned
    }

    /// Whether `block` is pinned.
    #[inline]
    pub fn is_pinned(&self, block: BlockId) -> bool {
        self.pinned[block as usize]
    }

    /// Whether `block` is in the eviction index (free, cached, not pinned).
    #[inline]
    pub fn is_indexed(&self, block: BlockId) -> bool {
        self.index.contains(block)
    }

    /// The eviction index (read only).
    #[inline]
    pub fn index(&self) -> &EvictionIndex {
        &self.index
    }

    /// Freed cached blocks enter the policy, in free order (a request's chain tail
    /// first). A pinning hint pins prefix first, so the cap keeps the prefix.
    pub fn on_free_all(&mut self, blocks: &[BlockId], now_ms: u64) {
        if self.kind == RetentionKind::Pin && self.hint.pin {
            for &b in blocks.iter().rev() {
                self.pin_block(b, false);
            }
        }
        for &b in blocks {
            self.on_free(b, now_ms);
        }
    }

    /// A freed cached block enters the policy.
    fn on_free(&mut self, block: BlockId, now_ms: u64) {
        let hint = self.hint;
        let placement = match self.kind {
            RetentionKind::Lru => lru::place(),
            RetentionKind::Priority => priority::place(&self.config, &hint, now_ms),
            RetentionKind::Ttl => ttl::place(&self.config, &hint, now_ms),
            RetentionKind::Slru => slru::place(self.hits[block as usize]),
            RetentionKind::Pin => pin::place(self, block),
        };
        match placement {
            Placement::Pinned => {
                self.num_pinned_free += 1;
            }
            Placement::Evictable { class, expires } => {
                self.index.insert(block, class, expires);
                if self.kind == RetentionKind::Slru {
                    slru::enforce_cap(self);
                }
            }
        }
    }

    /// A free block leaves the free queue without being evicted (a prefix hit).
    pub fn on_take(&mut self, block: BlockId, cached: bool) {
        if self.pinned[block as usize] {
            self.num_pinned_free = self.num_pinned_free.saturating_sub(1);
        } else {
            self.index.remove(block);
        }
        if cached {
            let h = &mut self.hits[block as usize];
            *h = h.saturating_add(1);
        }
    }

    /// A prefix hit on a block already in use (SLRU counts it).
    #[inline]
    pub fn on_shared_hit(&mut self, block: BlockId) {
        let h = &mut self.hits[block as usize];
        *h = h.saturating_add(1);
    }

    /// The block's cached contents are dropped (evicted, explicitly or not): it
    /// leaves the index and loses its pin and hit count. `free` says whether it
    /// sits in the free queue.
    pub fn on_uncached(&mut self, block: BlockId, free: bool) {
        let b = block as usize;
        if self.pinned[b] {
            self.pinned[b] = false;
            self.num_pinned -= 1;
            if free {
                self.num_pinned_free = self.num_pinned_free.saturating_sub(1);
            }
        }
        self.index.remove(block);
        self.hits[b] = 0;
    }

    /// Applies passed deadlines (class changes), O(log n) each.
    pub fn expire(&mut self, now_ms: u64) {
        self.stats.expirations += self.index.expire(now_ms);
    }

    /// The next cached block to evict (removed from the index), if any.
    pub fn pop_victim(&mut self) -> Option<BlockId> {
        let (block, class) = self.index.pop_min()?;
        self.stats.evictions += 1;
        if class == 0 {
            self.stats.evictions_lowest_class += 1;
        }
        let b = block as usize;
        self.hits[b] = 0;
        Some(block)
    }

    /// Unpins every pinned block; free ones become evictable (lowest class, MRU).
    pub fn unpin_all(&mut self, free: impl Fn(BlockId) -> bool) {
        let mut ids = Vec::new();
        for (b, p) in self.pinned.iter_mut().enumerate() {
            if *p {
                *p = false;
                ids.push(b as BlockId);
            }
        }
        self.num_pinned = 0;
        self.num_pinned_free = 0;
        for id in ids {
            if free(id) {
                self.index.insert(id, 0, None);
            }
        }
    }

    /// Pins `block` (cap permitting); returns whether it is pinned now. A free
    /// block leaves the eviction index.
    pub fn pin_block(&mut self, block: BlockId, free: bool) -> bool {
        let b = block as usize;
        if self.pinned[b] {
            return true;
        }
        if self.num_pinned >= self.config.max_pinned_blocks {
            self.stats.pins_refused += 1;
            return false;
        }
        self.pinned[b] = true;
        self.num_pinned += 1;
        if free {
            self.index.remove(block);
            self.num_pinned_free += 1;
        }
        true
    }

    /// Forgets everything (`reset_prefix_cache`).
    pub fn clear(&mut self) {
        self.index.clear();
        self.pinned.iter_mut().for_each(|p| *p = false);
        self.hits.iter_mut().for_each(|h| *h = 0);
        self.num_pinned = 0;
        self.num_pinned_free = 0;
    }

    /// Consistency of the policy's own structures with `is_free` / `is_cached`.
    pub fn check_invariants(
        &self,
        is_free: impl Fn(BlockId) -> bool,
        is_cached: impl Fn(BlockId) -> bool,
    ) -> std::result::Result<(), String> {
        let mut pinned = 0;
        let mut pinned_free = 0;
        for (b, &p) in self.pinned.iter().enumerate() {
            let id = b as BlockId;
            if p {
                pinned += 1;
                if !is_cached(id) {
                    return Err(format!("pinned block {id} is not cached"));
                }
                if is_free(id) {
                    pinned_free += 1;
                }
                if self.index.contains(id) {
                    return Err(format!("pinned block {id} is in the eviction index"));
                }
            } else if is_free(id) && is_cached(id) && !self.index.contains(id) {
                return Err(format!(
                    "free cached block {id} is not in the eviction index"
                ));
            }
            if self.index.contains(id) && !(is_free(id) && is_cached(id)) {
                return Err(format!("indexed block {id} is not free and cached"));
            }
        }
        if pinned != self.num_pinned || pinned_free != self.num_pinned_free {
            return Err(format!(
                "pin counts {}/{} != {pinned}/{pinned_free}",
                self.num_pinned, self.num_pinned_free
            ));
        }
        if pinned > self.config.max_pinned_blocks {
            return Err(format!("{pinned} pinned blocks exceed the cap"));
        }
        self.index.check_invariants()
    }
}
