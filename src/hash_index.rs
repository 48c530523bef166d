//! `BlockHashToBlockMap`: the prefix-cache index from hash key to cached block(s).
//!
//! Mirrors vLLM 0.33 `v1/core/block_pool.py::BlockHashToBlockMap`.
//!
//! Key properties:
//! - Duplicates are kept, never de-duplicated: two requests that computed the same
//!   content concurrently each own a block, and both are indexed under the key
//!   (block tables are append-only, so a block id handed out is never swapped for
//!   an older copy).
//! - A lookup returns the first-inserted surviving block of a key.
//! - The common case (one block per key) stores the id inline; only duplicate keys
//!   pay for a small vector.

use rustc_hash::FxHashMap;

use crate::types::{BlockHashWithGroupId, BlockId};

#[derive(Clone, Debug)]
enum Entry {
    One(BlockId),
    /// Insertion order; never empty.
    Many(Vec<BlockId>),
}

/// Hash key → cached block(s) (see module docs).
#[derive(Clone, Debug, Default)]
pub struct BlockHashToBlockMap {
    map: FxHashMap<BlockHashWithGroupId, Entry>,
}

impl BlockHashToBlockMap {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys (not blocks).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no key is indexed.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The first-inserted block cached under `key`.
    #[inline]
    pub fn get_one_block(&self, key: &BlockHashWithGroupId) -> Option<BlockId> {
        match self.map.get(key)? {
            Entry::One(id) => Some(*id),
            Entry::Many(ids) => ids.first().copied(),
        }
    }

    /// All blocks cached under `key`, in insertion order.
    pub fn get_all_blocks(&self, key: &BlockHashWithGroupId) -> Vec<BlockId> {
        match self.map.get(key) {
            None => vec![],
            Some(Entry::One(id)) => vec![*id],
            Some(Entry::Many(ids)) => ids.clone(),
        }
    }

    /// Whether `key` maps to `block_id`.
    pub fn contain(&self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        match self.map.get(key) {
            None => false,
            Some(Entry::One(id)) => *id == block_id,
            Some(Entry::Many(ids)) => ids.contains(&block_id),
        }
    }

    /// Indexes `block_id` under `key` (after any block already there). One table
    /// probe: the index is large and every probe is a likely cache miss.
    #[inline]
    pub fn insert(&mut self, key: BlockHashWithGroupId, block_id: BlockId) {
        match self.map.entry(key) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry::One(block_id));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let entry = o.get_mut();
                match entry {
                    Entry::One(old) => *entry = Entry::Many(vec![*old, block_id]),
                    Entry::Many(ids) => ids.push(block_id),
                }
            }
        }
    }

    /// Removes `block_id` from `key`; returns whether it was there. The key goes
    /// away with its last block. The common case (the key holds only this block)
    /// costs one table probe.
    #[inline]
    pub fn pop(&mut self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        let Some(entry) = self.map.remove(key) else {
            return false;
        };
        match entry {
            Entry::One(id) if id == block_id => true,
            Entry::One(_) => {
                self.map.insert(*key, entry);
                false
            }
            Entry::Many(mut ids) => {
                let found = match ids.iter().position(|&b| b == block_id) {
                    Some(pos) => {
                        ids.remove(pos);
                        true
                    }
                    None => false,
                };
                if !ids.is_empty() {
                    self.map.insert(*key, Entry::Many(ids));
                }
                found
            }
        }
    }

    /// Drops every key.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Total number of (key, block) pairs (diagnostics and invariant checks).
    pub fn num_entries(&self) -> usize {
        self.map
            .values()
            .map(|e| match e {
                Entry::One(_) => 1,
                Entry::Many(ids) => ids.len(),
            })
            .sum()
    }

    /// Iterates `(key, blocks in insertion order)`.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHashWithGroupId, &[BlockId])> {
        self.map.iter().map(|(k, e)| {
            let ids: &[BlockId] = match e {
                Entry::One(id) => std::slice::from_ref(id),
                Entry::Many(ids) => ids,
            };
            (k, ids)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::BlockHash;

    fn key(b: u8) -> BlockHashWithGroupId {
        BlockHashWithGroupId {
            hash: BlockHash::new(&[b; 32]).unwrap(),
            group_id: 0,
        }
    }

    #[test]
    fn duplicates_are_kept_and_first_inserted_wins() {
        let mut m = BlockHashToBlockMap::new();
        m.insert(key(1), 7);
        m.insert(key(1), 3);
        assert_eq!(m.len(), 1);
        assert_eq!(m.get_one_block(&key(1)), Some(7));
        assert!(m.contain(&key(1), 3));
        assert!(m.pop(&key(1), 7));
        assert_eq!(m.get_one_block(&key(1)), Some(3));
        assert!(!m.pop(&key(1), 7));
        assert!(m.pop(&key(1), 3));
        assert!(m.is_empty());
    }

    #[test]
    fn pop_of_other_block_keeps_the_entry() {
        let mut m = BlockHashToBlockMap::new();
        m.insert(key(2), 5);
        assert!(!m.pop(&key(2), 6));
        assert_eq!(m.get_one_block(&key(2)), Some(5));
    }
}
