//! The pool's bounded eviction history, kept only in explain mode (`crate::explain`):
//! which block hashes left the prefix cache, when (a monotonic eviction counter) and
//! under which policy. Absent (`None` in the pool) unless explain mode is on; then
//! every eviction records one entry per removed key, and the oldest entries are
//! dropped beyond the capacity.

use super::BlockPool;
use crate::explain::BoundedMap;
use crate::types::BlockHashWithGroupId;

/// How a block left the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionCause {
    /// Its block was handed out again by `get_new_blocks` (the retention policy, or
    /// LRU, chose it).
    Reuse,
    /// `evict_blocks` (a KV connector) or a manager dropped it explicitly.
    Explicit,
}

impl EvictionCause {
    /// The cause's name in explanations.
    pub fn name(self) -> &'static str {
        match self {
            EvictionCause::Reuse => "reuse",
            EvictionCause::Explicit => "explicit",
        }
    }
}

/// One eviction of a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionRecord {
    /// The pool's eviction counter at this eviction (1 = the first one recorded).
    pub seq: u64,
    /// The retention policy in force (`lru`, `priority`, ...).
    pub policy: &'static str,
    pub cause: EvictionCause,
}

/// The bounded history (see module docs).
#[derive(Clone, Debug)]
pub struct EvictionHistory {
    records: BoundedMap<BlockHashWithGroupId, EvictionRecord>,
    evictions: u64,
    resets: u64,
}

impl EvictionHistory {
    /// A history of at most `capacity` keys.
    pub fn new(capacity: usize) -> Self {
        Self {
            records: BoundedMap::new(capacity),
            evictions: 0,
            resets: 0,
        }
    }

    /// Records the eviction of `key`.
    #[inline]
    pub fn record(
        &mut self,
        key: BlockHashWithGroupId,
        policy: &'static str,
        cause: EvictionCause,
    ) {
        self.evictions += 1;
        self.records.insert(
            key,
            EvictionRecord {
                seq: self.evictions,
                policy,
                cause,
            },
        );
    }

    /// The last eviction of `key`, if still remembered.
    pub fn get(&self, key: &BlockHashWithGroupId) -> Option<&EvictionRecord> {
        self.records.get(key)
    }

    /// Evictions recorded so far (the counter [`EvictionRecord::seq`] counts).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// `reset_prefix_cache` calls that cleared the cache while recording.
    pub fn resets(&self) -> u64 {
        self.resets
    }

    /// Notes a prefix-cache reset.
    pub fn note_reset(&mut self) {
        self.resets += 1;
    }

    /// Keys remembered.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The most keys remembered.
    pub fn capacity(&self) -> usize {
        self.records.capacity()
    }
}

impl BlockPool {
    /// Starts (`Some(capacity)`) or stops (`None`) recording evictions.
    pub fn set_eviction_history(&mut self, capacity: Option<usize>) {
        self.eviction_history = capacity.map(|c| Box::new(EvictionHistory::new(c)));
    }

    /// The eviction history, when explain mode records one.
    #[inline]
    pub fn eviction_history(&self) -> Option<&EvictionHistory> {
        self.eviction_history.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::BlockHash;

    fn key(i: u32) -> BlockHashWithGroupId {
        BlockHashWithGroupId {
            hash: BlockHash::new(&i.to_le_bytes()).unwrap_or_else(|_| unreachable!()),
            group_id: 0,
        }
    }

    #[test]
    fn history_is_bounded_and_keeps_the_newest() {
        let mut h = EvictionHistory::new(8);
        for i in 0..100 {
            h.record(key(i), "lru", EvictionCause::Reuse);
        }
        assert_eq!(h.len(), 8);
        assert_eq!(h.evictions(), 100);
        assert!(h.get(&key(91)).is_none());
        let last = h.get(&key(99)).copied();
        assert_eq!(
            last,
            Some(EvictionRecord {
                seq: 100,
                policy: "lru",
                cause: EvictionCause::Reuse
            })
        );
        // Evicting the same key again refreshes its record.
        h.record(key(92), "ttl", EvictionCause::Explicit);
        assert_eq!(
            h.get(&key(92)).map(|r| (r.seq, r.policy)),
            Some((101, "ttl"))
        );
        assert_eq!(h.len(), 8);
    }

    #[test]
    fn pool_records_evictions_only_when_asked() {
        let mut pool = match BlockPool::new(4, true, 1, false, false) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        };
        assert!(pool.eviction_history().is_none());
        pool.set_eviction_history(Some(2));
        assert_eq!(
            pool.eviction_history().map(EvictionHistory::capacity),
            Some(2)
        );
        pool.set_eviction_history(None);
        assert!(pool.eviction_history().is_none());
    }
}
