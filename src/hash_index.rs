//! `BlockHashToBlockMap`: the prefix-cache index from hash key to cached block(s).
//!
//! Mirrors vLLM 0.33 `v1/core/block_pool.py::BlockHashToBlockMap`, and also owns
//! what vLLM keeps on each block as `block.block_hash`: the key a cached block is
//! indexed under ([`BlockHashToBlockMap::key_of`]). A block has a key iff the index
//! holds it under that key.
//!
//! Key properties:
//! - Duplicates are kept, never de-duplicated: two requests that computed the same
//!   content concurrently each own a block, and both are indexed under the key
//!   (block tables are append-only, so a block id handed out is never swapped for
//!   an older copy).
//! - A lookup returns the first-inserted surviving block of a key.
//!
//! Layout (the index is probed once per block allocated, cached or hit, and at
//! 10^5 blocks every probe of a wide table is a cache miss): the hash table holds
//! only the 4-byte id of each key's first block; keys live once, in a dense array by
//! block id, and the table compares a probed key with `keys[id]`. Later blocks with
//! the same key form a chain in insertion order through `next_duplicate` (by block
//! id), which is read only while some key has more than one block.

use hashbrown::HashTable;
use rustc_hash::FxHasher;
use std::hash::{Hash, Hasher};

use crate::types::{BlockHashWithGroupId, BlockId};

/// End of a duplicate chain.
const NO_BLOCK: BlockId = BlockId::MAX;

#[inline]
fn hash_key(key: &BlockHashWithGroupId) -> u64 {
    let mut h = FxHasher::default();
    key.hash(&mut h);
    h.finish()
}

/// Hash key → cached block(s) (see module docs).
#[derive(Clone, Debug)]
pub struct BlockHashToBlockMap {
    /// The first-inserted surviving block of each key.
    heads: HashTable<BlockId>,
    /// The key each block is indexed under (vLLM's `block.block_hash`), by block id.
    keys: Vec<Option<BlockHashWithGroupId>>,
    /// The next block with the same key, by block id (`NO_BLOCK` at a chain's end
    /// and for every block not in a chain).
    next_duplicate: Vec<BlockId>,
    /// Number of (key, block) pairs.
    num_entries: usize,
}

impl BlockHashToBlockMap {
    /// An empty index for blocks `0..num_blocks`.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            heads: HashTable::new(),
            keys: vec![None; num_blocks],
            next_duplicate: vec![NO_BLOCK; num_blocks],
            num_entries: 0,
        }
    }

    /// Number of keys (not blocks).
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// Whether no key is indexed.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Whether some key holds more than one block (chains must then be followed).
    #[inline]
    fn has_duplicates(&self) -> bool {
        self.num_entries > self.heads.len()
    }

    /// The key `block_id` is indexed under (vLLM's `block.block_hash`); None for an
    /// uncached block or an id out of range.
    #[inline]
    pub fn key_of(&self, block_id: BlockId) -> Option<&BlockHashWithGroupId> {
        self.keys.get(block_id as usize)?.as_ref()
    }

    /// The first block of `key`'s chain.
    #[inline]
    fn head(&self, key: &BlockHashWithGroupId) -> Option<BlockId> {
        let keys = &self.keys;
        self.heads
            .find(hash_key(key), |&b| keys[b as usize].as_ref() == Some(key))
            .copied()
    }

    /// The first-inserted block cached under `key`.
    #[inline]
    pub fn get_one_block(&self, key: &BlockHashWithGroupId) -> Option<BlockId> {
        self.head(key)
    }

    /// The blocks of the chain starting at `head`, in insertion order.
    fn chain(&self, head: Option<BlockId>) -> impl Iterator<Item = BlockId> + '_ {
        std::iter::successors(head, |&b| {
            let next = self.next_duplicate[b as usize];
            (next != NO_BLOCK).then_some(next)
        })
    }

    /// All blocks cached under `key`, in insertion order.
    pub fn get_all_blocks(&self, key: &BlockHashWithGroupId) -> Vec<BlockId> {
        self.chain(self.head(key)).collect()
    }

    /// Whether `key` maps to `block_id`.
    #[inline]
    pub fn contain(&self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        self.key_of(block_id) == Some(key)
    }

    /// Indexes `block_id` under `key`, after any block already there. A block has at
    /// most one key: one already indexed under another key is moved. Ids beyond
    /// the index's blocks are ignored (the pool checks ids first).
    #[inline]
    pub fn insert(&mut self, key: BlockHashWithGroupId, block_id: BlockId) {
        let b = block_id as usize;
        match self.keys.get(b) {
            None => return,
            Some(Some(existing)) if *existing == key => return,
            Some(Some(existing)) => {
                let old = *existing;
                self.pop(&old, block_id);
            }
            Some(None) => {}
        }
        match self.head(&key) {
            Some(head) => {
                let tail = self.chain(Some(head)).last().unwrap_or(head);
                self.next_duplicate[tail as usize] = block_id;
            }
            None => {
                let keys = &self.keys;
                self.heads.insert_unique(hash_key(&key), block_id, |&h| {
                    keys[h as usize].as_ref().map_or(0, hash_key)
                });
            }
        }
        self.keys[b] = Some(key);
        self.num_entries += 1;
    }

    /// Removes `block_id` from `key`; returns whether it was there. The key goes
    /// away with its last block. The common case (the key holds only this block)
    /// costs one table probe, which compares block ids, not keys.
    #[inline]
    pub fn pop(&mut self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        if !self.contain(key, block_id) {
            return false;
        }
        let b = block_id as usize;
        let next = if self.has_duplicates() {
            std::mem::replace(&mut self.next_duplicate[b], NO_BLOCK)
        } else {
            NO_BLOCK
        };
        let hash = hash_key(key);
        match self.heads.find_entry(hash, |&h| h == block_id) {
            Ok(entry) if next == NO_BLOCK => {
                entry.remove();
            }
            Ok(mut entry) => *entry.get_mut() = next,
            Err(_) => {
                // Not the head: unlink it from the middle or the end of its chain.
                let prev = self
                    .chain(self.head(key))
                    .find(|&p| self.next_duplicate[p as usize] == block_id);
                if let Some(prev) = prev {
                    self.next_duplicate[prev as usize] = next;
                }
            }
        }
        self.keys[b] = None;
        self.num_entries -= 1;
        true
    }

    /// Removes whatever key `block_id` is indexed under and returns it (vLLM's
    /// eviction of a cached block).
    #[inline]
    pub fn remove_block(&mut self, block_id: BlockId) -> Option<BlockHashWithGroupId> {
        let key = *self.key_of(block_id)?;
        self.pop(&key, block_id);
        Some(key)
    }

    /// Drops every key.
    pub fn clear(&mut self) {
        self.heads.clear();
        self.keys.iter_mut().for_each(|k| *k = None);
        self.next_duplicate.iter_mut().for_each(|n| *n = NO_BLOCK);
        self.num_entries = 0;
    }

    /// Total number of (key, block) pairs (diagnostics and invariant checks).
    pub fn num_entries(&self) -> usize {
        self.num_entries
    }

    /// Checks that every block with a key is in its key's chain exactly once and
    /// that the counts agree (tests and debugging); `Err` names the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut seen = vec![false; self.keys.len()];
        let mut entries = 0usize;
        for &head in self.heads.iter() {
            let Some(key) = self.key_of(head) else {
                return Err(format!("index head block {head} has no key"));
            };
            if self.head(key) != Some(head) {
                return Err(format!("key of block {head} does not find it"));
            }
            for b in self.chain(Some(head)) {
                let slot = seen
                    .get_mut(b as usize)
                    .ok_or_else(|| format!("chain holds block {b}, out of range"))?;
                if std::mem::replace(slot, true) {
                    return Err(format!("block {b} is chained twice (or a chain loops)"));
                }
                if self.key_of(b) != Some(key) {
                    return Err(format!("index maps a key to block {b} with another hash"));
                }
                entries += 1;
            }
        }
        for (b, key) in self.keys.iter().enumerate() {
            if key.is_some() != seen[b] {
                return Err(format!("block {b} has a hash that is not indexed"));
            }
            if !seen[b] && self.next_duplicate[b] != NO_BLOCK {
                return Err(format!("uncached block {b} has a duplicate link"));
            }
        }
        if entries != self.num_entries {
            return Err(format!(
                "{} entries counted, {entries} chained",
                self.num_entries
            ));
        }
        Ok(())
    }

    /// Iterates `(key, blocks in insertion order)`.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHashWithGroupId, Vec<BlockId>)> + '_ {
        self.heads.iter().filter_map(|&head| {
            let key = self.key_of(head)?;
            Some((key, self.chain(Some(head)).collect()))
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
        let mut m = BlockHashToBlockMap::new(16);
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
        let mut m = BlockHashToBlockMap::new(16);
        m.insert(key(2), 5);
        assert!(!m.pop(&key(2), 6));
        assert_eq!(m.get_one_block(&key(2)), Some(5));
    }

    /// Random inserts, pops and evictions on 3 keys and 12 blocks against a list of
    /// `(key, block)` pairs in insertion order; chains stay consistent throughout.
    #[test]
    fn matches_an_insertion_ordered_model() {
        let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for _ in 0..200 {
            let mut m = BlockHashToBlockMap::new(12);
            let mut model: Vec<(u8, BlockId)> = Vec::new();
            for _ in 0..60 {
                let k = next(3) as u8;
                let b = next(12) as BlockId;
                match next(3) {
                    0 => {
                        m.insert(key(k), b);
                        if !model.contains(&(k, b)) {
                            model.retain(|&(_, x)| x != b);
                            model.push((k, b));
                        }
                    }
                    1 => {
                        let had = model.contains(&(k, b));
                        assert_eq!(m.pop(&key(k), b), had);
                        model.retain(|&p| p != (k, b));
                    }
                    _ => {
                        let want = model.iter().find(|&&(_, x)| x == b).map(|&(k, _)| key(k));
                        assert_eq!(m.remove_block(b), want);
                        model.retain(|&(_, x)| x != b);
                    }
                }
                m.check_invariants().unwrap();
                assert_eq!(m.num_entries(), model.len());
                for k in 0..3u8 {
                    let want: Vec<BlockId> =
                        model.iter().filter(|p| p.0 == k).map(|p| p.1).collect();
                    assert_eq!(m.get_all_blocks(&key(k)), want);
                    assert_eq!(m.get_one_block(&key(k)), want.first().copied());
                }
            }
        }
    }
}
