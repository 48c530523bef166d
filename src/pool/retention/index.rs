//! `EvictionIndex`: the free cached blocks of an attached policy, ordered by
//! `(class, seq)` (lowest first), with optional class deadlines.
//!
//! `seq` grows with every insert, so within a class the least recently freed block
//! is first (LRU). A deadline moves a block to another class keeping its `seq`.
//! Insert, remove, pop and each expiry are O(log n); nothing is scanned.

use std::collections::BTreeSet;

use crate::types::BlockId;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    class: u8,
    seq: u64,
    deadline: Option<(u64, u8)>,
}

/// See module docs.
#[derive(Clone, Debug)]
pub struct EvictionIndex {
    order: BTreeSet<(u8, u64, BlockId)>,
    deadlines: BTreeSet<(u64, BlockId)>,
    entry: Vec<Option<Entry>>,
    class_counts: [usize; 256],
    next_seq: u64,
}

impl EvictionIndex {
    /// An empty index over blocks `0..num_blocks`.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            order: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            entry: vec![None; num_blocks],
            class_counts: [0; 256],
            next_seq: 0,
        }
    }

    /// Number of indexed blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether no block is indexed.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether `block` is indexed.
    #[inline]
    pub fn contains(&self, block: BlockId) -> bool {
        self.entry.get(block as usize).is_some_and(Option::is_some)
    }

    /// The class of an indexed block.
    #[inline]
    pub fn class_of(&self, block: BlockId) -> Option<u8> {
        self.entry.get(block as usize)?.map(|e| e.class)
    }

    /// Indexed blocks of `class`.
    #[inline]
    pub fn count_of_class(&self, class: u8) -> usize {
        self.class_counts[class as usize]
    }

    /// The lowest class with an indexed block.
    pub fn min_class(&self) -> Option<u8> {
        self.order.first().map(|&(c, _, _)| c)
    }

    /// The least recently inserted block of `class`.
    pub fn oldest_of_class(&self, class: u8) -> Option<BlockId> {
        self.order
            .range((class, 0, 0)..=(class, u64::MAX, BlockId::MAX))
            .next()
            .map(|&(_, _, b)| b)
    }

    /// Indexes `block` (replacing any entry) as the most recent of `class`.
    pub fn insert(&mut self, block: BlockId, class: u8, deadline: Option<(u64, u8)>) {
        self.remove(block);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert((class, seq, block));
        if let Some((at, _)) = deadline {
            self.deadlines.insert((at, block));
        }
        self.class_counts[class as usize] += 1;
        self.entry[block as usize] = Some(Entry {
            class,
            seq,
            deadline,
        });
    }

    /// Drops `block`'s entry, if any.
    pub fn remove(&mut self, block: BlockId) {
        let Some(e) = self.entry.get_mut(block as usize).and_then(Option::take) else {
            return;
        };
        self.order.remove(&(e.class, e.seq, block));
        if let Some((at, _)) = e.deadline {
            self.deadlines.remove(&(at, block));
        }
        self.class_counts[e.class as usize] -= 1;
    }

    /// Removes and returns the first block to evict and its class.
    pub fn pop_min(&mut self) -> Option<(BlockId, u8)> {
        let &(class, _, block) = self.order.first()?;
        self.remove(block);
        Some((block, class))
    }

    /// Moves every block whose deadline is `<= now_ms` to its after-class, keeping
    /// its LRU position; returns how many moved.
    pub fn expire(&mut self, now_ms: u64) -> u64 {
        let mut moved = 0;
        while let Some(&(at, block)) = self.deadlines.first() {
            if at > now_ms {
                break;
            }
            self.deadlines.pop_first();
            let Some(e) = self.entry.get_mut(block as usize).and_then(Option::as_mut) else {
                continue;
            };
            let Some((_, after)) = e.deadline.take() else {
                continue;
            };
            let old = (e.class, e.seq, block);
            e.class = after;
            let new = (after, e.seq, block);
            self.class_counts[old.0 as usize] -= 1;
            self.class_counts[after as usize] += 1;
            self.order.remove(&old);
            self.order.insert(new);
            moved += 1;
        }
        moved
    }

    /// Forgets every block.
    pub fn clear(&mut self) {
        self.order.clear();
        self.deadlines.clear();
        self.entry.iter_mut().for_each(|e| *e = None);
        self.class_counts = [0; 256];
    }

    /// The indexed blocks in eviction order.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.order.iter().map(|&(_, _, b)| b)
    }

    /// Structural consistency of the three views.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let indexed = self.entry.iter().filter(|e| e.is_some()).count();
        if indexed != self.order.len() {
            return Err(format!(
                "{indexed} entries but {} ordered",
                self.order.len()
            ));
        }
        let mut counts = [0usize; 256];
        for &(class, seq, block) in &self.order {
            let e =
                self.entry[block as usize].ok_or(format!("ordered block {block} has no entry"))?;
            if e.class != class || e.seq != seq {
                return Err(format!("block {block}: entry and order disagree"));
            }
            counts[class as usize] += 1;
        }
        if counts != self.class_counts {
            return Err("class counts are stale".into());
        }
        let with_deadline = self
            .entry
            .iter()
            .flatten()
            .filter(|e| e.deadline.is_some())
            .count();
        if with_deadline != self.deadlines.len() {
            return Err("deadline set is stale".into());
        }
        Ok(())
    }
}
