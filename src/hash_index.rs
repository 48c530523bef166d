//! `BlockHashToBlockMap`: the prefix-cache index from hash key to cached block(s).
//!
//! Mirrors vLLM 0.33 `v1/core/block_pool.py::BlockHashToBlockMap` together with what
//! vLLM keeps beside it: each block's primary key (`block.block_hash`) and its
//! secondary keys (`BlockPool.cached_block_hashes_by_block`, the partial prefix
//! entries of hybrid Mamba "align" models and of full attention with a block larger
//! than the hash block).
//!
//! The tests at the end (duplicates, detached entries, secondary keys) pin the
//! properties below on the index itself.
//!
//! Key properties:
//! - Duplicates are kept, never de-duplicated: two requests that computed the same
//!   content concurrently each own a block, and both are indexed under the key
//!   (block tables are append-only, so a block id handed out is never swapped for
//!   an older copy).
//! - A lookup returns the first-inserted surviving block of a key, whether the key
//!   is that block's primary or a secondary key.
//! - A block has a primary key iff it is indexed at all; a secondary key exists only
//!   beside a primary one (vLLM's `_insert_block_hash`).
//!
//! Detached entries: vLLM's tests (and connectors) manipulate the map directly —
//! `cached_block_hash_to_block.pop(key, block_id)`, `_cache.pop(key)` — leaving
//! blocks that keep their hash while the map no longer holds it. The index models
//! that state exactly: [`BlockHashToBlockMap::detach`] takes an entry out of its
//! chain but keeps the block's key; lookups miss it, eviction removes it without a
//! `BlockRemoved` (vLLM's `pop` finds nothing), [`BlockHashToBlockMap::reattach`]
//! puts it back at the chain's end.
//!
//! Layout (the index is probed once per block allocated, cached or hit, and at
//! 10^5 blocks every probe of a wide table is a cache miss): the hash table holds
//! only the 4-byte id of each key's first *entry*. An entry is a (key, block) pair:
//! entry `b < num_blocks` is block `b`'s primary key, stored once in a dense array by
//! block id; entries from `num_blocks` on are secondary keys, in a side arena that
//! stays empty for models without partial entries. Later entries with the same key
//! form a chain in insertion order, which is read only while some key has more than
//! one entry.

use hashbrown::HashTable;
use rustc_hash::{FxHashMap, FxHasher};
use smallvec::SmallVec;
use std::hash::{Hash, Hasher};

use crate::alloc::filled_vec;
use crate::error::Result;
use crate::types::{BlockHashWithGroupId, BlockId};

/// An index entry: a block id for a primary key, `num_blocks + i` for secondary `i`.
type EntryId = u32;

/// End of a duplicate chain.
const NO_ENTRY: EntryId = EntryId::MAX;

/// The keys [`BlockHashToBlockMap::remove_block_hashes`] removed, primary first.
pub type RemovedKeys = SmallVec<[BlockHashWithGroupId; 1]>;

#[inline]
fn hash_key(key: &BlockHashWithGroupId) -> u64 {
    let mut h = FxHasher::default();
    key.hash(&mut h);
    h.finish()
}

/// The key of entry `e` (over split borrows, so the table can rehash while it reads).
#[inline]
fn key_in<'a>(
    keys: &'a [Option<BlockHashWithGroupId>],
    secondary: &'a [SecondaryEntry],
    e: EntryId,
) -> Option<&'a BlockHashWithGroupId> {
    match keys.get(e as usize) {
        Some(k) => k.as_ref(),
        None => secondary.get(e as usize - keys.len())?.key.as_ref(),
    }
}

/// A secondary (partial prefix) key of a block that already has a primary key.
#[derive(Clone, Debug)]
struct SecondaryEntry {
    key: Option<BlockHashWithGroupId>,
    block: BlockId,
    next: EntryId,
}

/// Hash key → cached block(s) (see module docs).
#[derive(Clone, Debug)]
pub struct BlockHashToBlockMap {
    /// The first-inserted surviving entry of each key.
    heads: HashTable<EntryId>,
    /// The primary key of each block (vLLM's `block.block_hash`), by block id.
    keys: Vec<Option<BlockHashWithGroupId>>,
    /// The next entry with the same key after each primary entry, by block id.
    next_primary: Vec<EntryId>,
    /// Secondary entries, `num_blocks` ids on; `None` keys are free slots.
    secondary: Vec<SecondaryEntry>,
    free_secondary: Vec<u32>,
    /// Each block's secondary entries in insertion order (only blocks that have some).
    secondary_by_block: FxHashMap<BlockId, SmallVec<[EntryId; 2]>>,
    /// Number of (key, block) pairs in chains.
    num_entries: usize,
    /// Entries taken out of their chains whose blocks keep the key (see module docs).
    detached: rustc_hash::FxHashSet<EntryId>,
}

impl BlockHashToBlockMap {
    /// An empty index for blocks `0..num_blocks` ([`crate::error::Error::OutOfMemory`] if its
    /// per-block arrays cannot be allocated).
    pub fn try_new(num_blocks: usize) -> Result<Self> {
        Ok(Self {
            heads: HashTable::new(),
            keys: filled_vec(num_blocks, None, "the prefix-cache index's keys")?,
            next_primary: filled_vec(num_blocks, NO_ENTRY, "the prefix-cache index's chains")?,
            secondary: Vec::new(),
            free_secondary: Vec::new(),
            secondary_by_block: FxHashMap::default(),
            num_entries: 0,
            detached: rustc_hash::FxHashSet::default(),
        })
    }

    /// Number of keys (not blocks).
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// Whether no key is indexed.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    #[inline]
    fn num_blocks(&self) -> u32 {
        // The pool caps block counts below u32::MAX.
        self.keys.len() as u32
    }

    #[inline]
    fn entry_key(&self, e: EntryId) -> Option<&BlockHashWithGroupId> {
        key_in(&self.keys, &self.secondary, e)
    }

    #[inline]
    fn entry_block(&self, e: EntryId) -> BlockId {
        if e < self.num_blocks() {
            e
        } else {
            self.secondary[(e - self.num_blocks()) as usize].block
        }
    }

    #[inline]
    fn next_of(&self, e: EntryId) -> EntryId {
        if e < self.num_blocks() {
            self.next_primary[e as usize]
        } else {
            self.secondary[(e - self.num_blocks()) as usize].next
        }
    }

    #[inline]
    fn set_next(&mut self, e: EntryId, next: EntryId) {
        if e < self.num_blocks() {
            self.next_primary[e as usize] = next;
        } else {
            let i = (e - self.num_blocks()) as usize;
            self.secondary[i].next = next;
        }
    }

    /// Whether some key holds more than one entry (chains must then be followed).
    #[inline]
    fn has_duplicates(&self) -> bool {
        self.num_entries > self.heads.len()
    }

    /// The primary key of `block_id` (vLLM's `block.block_hash`); None for an
    /// uncached block or an id out of range.
    #[inline]
    pub fn key_of(&self, block_id: BlockId) -> Option<&BlockHashWithGroupId> {
        self.keys.get(block_id as usize)?.as_ref()
    }

    /// The secondary keys of `block_id` in insertion order (vLLM's
    /// `cached_block_hashes_by_block[block_id]`).
    pub fn secondary_keys(
        &self,
        block_id: BlockId,
    ) -> impl Iterator<Item = &BlockHashWithGroupId> + '_ {
        self.secondary_by_block
            .get(&block_id)
            .into_iter()
            .flatten()
            .filter_map(|&e| self.entry_key(e))
    }

    /// Blocks that have secondary keys (diagnostics and the Python view).
    pub fn blocks_with_secondary_keys(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.secondary_by_block.keys().copied()
    }

    /// The first entry of `key`'s chain.
    #[inline]
    fn head(&self, key: &BlockHashWithGroupId) -> Option<EntryId> {
        self.heads
            .find(hash_key(key), |&e| self.entry_key(e) == Some(key))
            .copied()
    }

    /// The first-inserted block cached under `key`.
    #[inline]
    pub fn get_one_block(&self, key: &BlockHashWithGroupId) -> Option<BlockId> {
        self.head(key).map(|e| self.entry_block(e))
    }

    /// The entries of the chain starting at `head`, in insertion order.
    fn chain(&self, head: Option<EntryId>) -> impl Iterator<Item = EntryId> + '_ {
        std::iter::successors(head, |&e| {
            let next = self.next_of(e);
            (next != NO_ENTRY).then_some(next)
        })
    }

    /// All blocks cached under `key`, in insertion order.
    pub fn get_all_blocks(&self, key: &BlockHashWithGroupId) -> Vec<BlockId> {
        self.chain(self.head(key))
            .map(|e| self.entry_block(e))
            .collect()
    }

    /// The entry of `(key, block_id)`, chained or detached.
    #[inline]
    fn any_entry_of(&self, key: &BlockHashWithGroupId, block_id: BlockId) -> Option<EntryId> {
        if self.key_of(block_id) == Some(key) {
            return Some(block_id);
        }
        self.secondary_by_block
            .get(&block_id)?
            .iter()
            .copied()
            .find(|&e| self.entry_key(e) == Some(key))
    }

    /// The entry of `(key, block_id)`, if the index holds that pair in its chain.
    #[inline]
    fn entry_of(&self, key: &BlockHashWithGroupId, block_id: BlockId) -> Option<EntryId> {
        self.any_entry_of(key, block_id)
            .filter(|e| self.detached.is_empty() || !self.detached.contains(e))
    }

    /// Whether `key` maps to `block_id` (as its primary or a secondary key).
    #[inline]
    pub fn contain(&self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        self.entry_of(key, block_id).is_some()
    }

    /// vLLM's `_insert_block_hash` (without the token count, which the pool keeps):
    /// indexes `block_id` under `key` after any entry already there — as its primary
    /// key if it has none, else as a secondary key. Returns whether a pair was added
    /// (false if the block already holds the key, or the id is out of range).
    pub fn insert(&mut self, key: BlockHashWithGroupId, block_id: BlockId) -> bool {
        if block_id >= self.num_blocks() || self.contain(&key, block_id) {
            return false;
        }
        if let Some(e) = self.any_entry_of(&key, block_id) {
            // A detached pair: vLLM leaves a block's own hash alone (`block_hash ==
            // key`) and re-adds a secondary key to the map.
            return e != block_id && self.reattach(&key, block_id);
        }
        let entry = if self.keys[block_id as usize].is_none() {
            self.keys[block_id as usize] = Some(key);
            block_id
        } else {
            let slot = SecondaryEntry {
                key: Some(key),
                block: block_id,
                next: NO_ENTRY,
            };
            let index = match self.free_secondary.pop() {
                Some(i) => {
                    self.secondary[i as usize] = slot;
                    i
                }
                None => {
                    self.secondary.push(slot);
                    (self.secondary.len() - 1) as u32
                }
            };
            let e = self.num_blocks() + index;
            self.secondary_by_block.entry(block_id).or_default().push(e);
            e
        };
        self.link(&key, entry);
        true
    }

    /// Appends entry `e` (whose key is `key`) to the end of `key`'s chain.
    fn link(&mut self, key: &BlockHashWithGroupId, e: EntryId) {
        match self.head(key) {
            Some(head) => {
                let tail = self.chain(Some(head)).last().unwrap_or(head);
                self.set_next(tail, e);
            }
            None => {
                let (keys, secondary) = (&self.keys, &self.secondary);
                self.heads.insert_unique(hash_key(key), e, |&x| {
                    key_in(keys, secondary, x).map_or(0, hash_key)
                });
            }
        }
        self.num_entries += 1;
    }

    /// Takes `(key, block_id)` out of its chain; the block keeps the key (see module
    /// docs). Returns whether the pair was chained.
    pub fn detach(&mut self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        let Some(e) = self.entry_of(key, block_id) else {
            return false;
        };
        self.unchain(key, e);
        self.detached.insert(e);
        true
    }

    /// Puts a detached `(key, block_id)` back at the end of its key's chain.
    pub fn reattach(&mut self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        let Some(e) = self.any_entry_of(key, block_id) else {
            return false;
        };
        if !self.detached.remove(&e) {
            return false;
        }
        self.link(key, e);
        true
    }

    /// The blocks of `key`'s detached entries.
    pub fn detached_blocks(&self, key: &BlockHashWithGroupId) -> Vec<BlockId> {
        let mut out: Vec<BlockId> = self
            .detached
            .iter()
            .filter(|&&e| self.entry_key(e) == Some(key))
            .map(|&e| self.entry_block(e))
            .collect();
        out.sort_unstable();
        out
    }

    /// Unlinks entry `e` of `key` from its chain and frees it (a detached entry is
    /// only freed).
    fn unlink(&mut self, key: &BlockHashWithGroupId, e: EntryId) {
        if !self.detached.remove(&e) {
            self.unchain(key, e);
        }
        self.free_entry(e);
    }

    /// Takes entry `e` of `key` out of its chain (its key storage stays).
    fn unchain(&mut self, key: &BlockHashWithGroupId, e: EntryId) {
        let next = if self.has_duplicates() {
            let n = self.next_of(e);
            self.set_next(e, NO_ENTRY);
            n
        } else {
            NO_ENTRY
        };
        let hash = hash_key(key);
        match self.heads.find_entry(hash, |&h| h == e) {
            Ok(entry) if next == NO_ENTRY => {
                entry.remove();
            }
            Ok(mut entry) => *entry.get_mut() = next,
            Err(_) => {
                // Not the head: unlink it from the middle or the end of its chain.
                let prev = self.chain(self.head(key)).find(|&p| self.next_of(p) == e);
                if let Some(prev) = prev {
                    self.set_next(prev, next);
                }
            }
        }
        self.num_entries -= 1;
    }

    /// Frees entry `e`'s key storage.
    fn free_entry(&mut self, e: EntryId) {
        if e < self.num_blocks() {
            self.keys[e as usize] = None;
        } else {
            let i = e - self.num_blocks();
            let block = self.secondary[i as usize].block;
            self.secondary[i as usize].key = None;
            self.free_secondary.push(i);
            if let Some(list) = self.secondary_by_block.get_mut(&block) {
                list.retain(|x| *x != e);
                if list.is_empty() {
                    self.secondary_by_block.remove(&block);
                }
            }
        }
    }

    /// Removes the pair `(key, block_id)`; returns whether it was there. The key
    /// goes away with its last block. Removing a block's primary key while it has
    /// secondary keys is refused (vLLM always removes all of a block's keys at once,
    /// [`Self::remove_block_hashes`]); it returns false.
    #[inline]
    pub fn pop(&mut self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        let Some(e) = self.entry_of(key, block_id) else {
            return false;
        };
        if e == block_id && self.secondary_by_block.contains_key(&block_id) {
            return false;
        }
        self.unlink(key, e);
        true
    }

    /// Removes every key of `block_id`, primary first then secondary keys in
    /// insertion order, and returns them (vLLM's `_remove_cached_block_hashes`).
    /// Detached entries are dropped without being reported (vLLM's map no longer
    /// holds them, so its `pop` returns nothing for them).
    pub fn remove_block_hashes(&mut self, block_id: BlockId) -> RemovedKeys {
        let mut removed = RemovedKeys::new();
        let Some(primary) = self.key_of(block_id).copied() else {
            return removed;
        };
        if !self.detached.contains(&block_id) {
            removed.push(primary);
        }
        if let Some(list) = self.secondary_by_block.get(&block_id) {
            let entries: SmallVec<[EntryId; 2]> = list.clone();
            for e in entries {
                if let Some(k) = self.entry_key(e).copied() {
                    if !self.detached.contains(&e) {
                        removed.push(k);
                    }
                    self.unlink(&k, e);
                }
            }
        }
        self.unlink(&primary, block_id);
        removed
    }

    /// Drops every key.
    pub fn clear(&mut self) {
        self.heads.clear();
        self.keys.iter_mut().for_each(|k| *k = None);
        self.next_primary.iter_mut().for_each(|n| *n = NO_ENTRY);
        self.secondary.clear();
        self.free_secondary.clear();
        self.secondary_by_block.clear();
        self.num_entries = 0;
        self.detached.clear();
    }

    /// Test-only corruption (invariant mutants): overwrites block `block_id`'s
    /// primary key in place, leaving its chain where it was (a stale entry).
    #[doc(hidden)]
    #[cfg(any(test, feature = "testing", feature = "mutants"))]
    pub fn corrupt_key_for_tests(&mut self, block_id: BlockId, key: BlockHashWithGroupId) {
        if let Some(slot) = self.keys.get_mut(block_id as usize) {
            *slot = Some(key);
        }
    }

    /// Total number of (key, block) pairs (diagnostics and invariant checks).
    pub fn num_entries(&self) -> usize {
        self.num_entries
    }

    /// Checks that every entry is in its key's chain exactly once, that secondary
    /// keys only exist beside a primary one and that the counts agree (tests and
    /// debugging); `Err` names the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let n = self.num_blocks() as usize;
        let mut seen = vec![false; n + self.secondary.len()];
        let mut entries = 0usize;
        for &head in self.heads.iter() {
            let Some(key) = self.entry_key(head) else {
                return Err(format!("index head entry {head} has no key"));
            };
            if self.head(key) != Some(head) {
                return Err(format!("the key of entry {head} does not find it"));
            }
            for e in self.chain(Some(head)) {
                let slot = seen
                    .get_mut(e as usize)
                    .ok_or_else(|| format!("chain holds entry {e}, out of range"))?;
                if std::mem::replace(slot, true) {
                    return Err(format!("entry {e} is chained twice (or a chain loops)"));
                }
                if self.entry_key(e) != Some(key) {
                    let b = self.entry_block(e);
                    return Err(format!("index maps a key to block {b} with another hash"));
                }
                entries += 1;
            }
        }
        for &e in &self.detached {
            if seen.get(e as usize).copied().unwrap_or(true) || self.entry_key(e).is_none() {
                return Err(format!("detached entry {e} is chained or has no key"));
            }
            seen[e as usize] = true;
        }
        for (b, key) in self.keys.iter().enumerate() {
            if key.is_some() != seen[b] {
                return Err(format!("block {b} has a hash that is not indexed"));
            }
            if !seen[b] && self.next_primary[b] != NO_ENTRY {
                return Err(format!("uncached block {b} has a duplicate link"));
            }
        }
        for (i, s) in self.secondary.iter().enumerate() {
            if s.key.is_some() != seen[n + i] {
                return Err(format!("secondary entry {i} is not indexed"));
            }
            if s.key.is_some() && self.keys[s.block as usize].is_none() {
                return Err(format!(
                    "block {} has a secondary key but no primary key",
                    s.block
                ));
            }
        }
        for (&b, list) in &self.secondary_by_block {
            if list.is_empty() || list.iter().any(|&e| self.entry_block(e) != b) {
                return Err(format!("secondary key list of block {b} is inconsistent"));
            }
        }
        if entries != self.num_entries {
            // (detached entries are not counted)
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
            let key = self.entry_key(head)?;
            Some((
                key,
                self.chain(Some(head))
                    .map(|e| self.entry_block(e))
                    .collect(),
            ))
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
        let mut m = BlockHashToBlockMap::try_new(16).unwrap();
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
        let mut m = BlockHashToBlockMap::try_new(16).unwrap();
        m.insert(key(2), 5);
        assert!(!m.pop(&key(2), 6));
        assert_eq!(m.get_one_block(&key(2)), Some(5));
    }

    #[test]
    fn secondary_keys_are_found_and_removed_with_the_block() {
        let mut m = BlockHashToBlockMap::try_new(8).unwrap();
        assert!(m.insert(key(1), 2));
        assert!(m.insert(key(9), 2)); // partial entry beside the primary
        assert!(!m.insert(key(9), 2));
        assert!(m.insert(key(9), 4)); // a second block under the partial key
        assert_eq!(m.key_of(2), Some(&key(1)));
        assert_eq!(m.key_of(4), Some(&key(9)));
        assert_eq!(m.get_one_block(&key(9)), Some(2));
        assert_eq!(m.secondary_keys(2).copied().collect::<Vec<_>>(), [key(9)]);
        assert!(!m.pop(&key(1), 2), "a primary key goes only with its block");
        m.check_invariants().unwrap();
        assert_eq!(m.remove_block_hashes(2).as_slice(), [key(1), key(9)]);
        assert_eq!(m.get_one_block(&key(9)), Some(4));
        assert_eq!(m.get_one_block(&key(1)), None);
        m.check_invariants().unwrap();
        assert_eq!(m.num_entries(), 1);
    }

    #[test]
    fn detached_entries_keep_their_key_but_miss_and_are_evicted_silently() {
        let mut m = BlockHashToBlockMap::try_new(8).unwrap();
        m.insert(key(1), 2);
        m.insert(key(1), 3);
        assert!(m.detach(&key(1), 2));
        assert_eq!(m.key_of(2), Some(&key(1)), "the block keeps its hash");
        assert_eq!(m.get_one_block(&key(1)), Some(3));
        assert!(!m.contain(&key(1), 2));
        assert!(!m.insert(key(1), 2), "vLLM leaves a block's own hash alone");
        m.check_invariants().unwrap();
        assert!(m.reattach(&key(1), 2));
        assert_eq!(m.get_all_blocks(&key(1)), vec![3, 2]);
        assert!(m.detach(&key(1), 3));
        assert!(
            m.remove_block_hashes(3).is_empty(),
            "a detached key is not reported"
        );
        assert_eq!(m.key_of(3), None);
        m.check_invariants().unwrap();
    }

    /// Random inserts, pops and evictions on 3 keys and 12 blocks against a list of
    /// `(key, block)` pairs in insertion order (a block's first pair is its primary
    /// key); chains stay consistent throughout.
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
            let mut m = BlockHashToBlockMap::try_new(12).unwrap();
            let mut model: Vec<(u8, BlockId)> = Vec::new();
            for _ in 0..60 {
                let k = next(3) as u8;
                let b = next(12) as BlockId;
                match next(3) {
                    0 => {
                        let added = m.insert(key(k), b);
                        assert_eq!(added, !model.contains(&(k, b)));
                        if added {
                            model.push((k, b));
                        }
                    }
                    1 => {
                        let pairs: Vec<u8> =
                            model.iter().filter(|p| p.1 == b).map(|p| p.0).collect();
                        let is_primary_with_secondary =
                            pairs.first() == Some(&k) && pairs.len() > 1;
                        let want = pairs.contains(&k) && !is_primary_with_secondary;
                        assert_eq!(m.pop(&key(k), b), want);
                        if want {
                            model.retain(|&p| p != (k, b));
                        }
                    }
                    _ => {
                        let want: Vec<_> = model
                            .iter()
                            .filter(|&&(_, x)| x == b)
                            .map(|&(k, _)| key(k))
                            .collect();
                        assert_eq!(m.remove_block_hashes(b).to_vec(), want);
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
