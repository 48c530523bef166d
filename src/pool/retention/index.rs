//! `EvictionIndex`: the free cached blocks of an attached policy, as one intrusive
//! LRU list per class (lowest class evicted first), with optional class deadlines.
//!
//! Like the free queue, the lists are `prev`/`next` arrays over block ids
//! (preallocated, no allocation per block); a 256-bit mask of non-empty classes
//! finds the lowest class in O(1). Within a class the head is the least recently
//! inserted block (LRU). A deadline moves a block to another class when it passes:
//! the block joins that class's most recent end, in deadline order. Deadlines sit in
//! a binary heap with lazy deletion (a per-block generation), O(log n) each.
//! Insert, remove and pop are O(1).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::types::BlockId;

const NIL: u32 = u32::MAX;
const CLASSES: usize = 256;

/// See module docs.
#[derive(Clone, Debug)]
pub struct EvictionIndex {
    prev: Vec<u32>,
    next: Vec<u32>,
    class: Vec<u8>,
    indexed: Vec<bool>,
    /// `(deadline_ms, class_after)` of an indexed block's live deadline.
    deadline: Vec<Option<(u64, u8)>>,
    generation: Vec<u32>,
    heads: [u32; CLASSES],
    tails: [u32; CLASSES],
    counts: [usize; CLASSES],
    nonempty: [u64; CLASSES / 64],
    heap: BinaryHeap<Reverse<(u64, BlockId, u32)>>,
    len: usize,
}

impl EvictionIndex {
    /// An empty index over blocks `0..num_blocks`.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            class: vec![0; num_blocks],
            indexed: vec![false; num_blocks],
            deadline: vec![None; num_blocks],
            generation: vec![0; num_blocks],
            heads: [NIL; CLASSES],
            tails: [NIL; CLASSES],
            counts: [0; CLASSES],
            nonempty: [0; CLASSES / 64],
            heap: BinaryHeap::new(),
            len: 0,
        }
    }

    /// Number of indexed blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no block is indexed.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `block` is indexed.
    #[inline]
    pub fn contains(&self, block: BlockId) -> bool {
        self.indexed.get(block as usize).copied().unwrap_or(false)
    }

    /// The class of an indexed block.
    #[inline]
    pub fn class_of(&self, block: BlockId) -> Option<u8> {
        self.contains(block).then(|| self.class[block as usize])
    }

    /// Indexed blocks of `class`.
    #[inline]
    pub fn count_of_class(&self, class: u8) -> usize {
        self.counts[class as usize]
    }

    /// The lowest class with an indexed block.
    pub fn min_class(&self) -> Option<u8> {
        self.nonempty
            .iter()
            .enumerate()
            .find(|(_, &w)| w != 0)
            .map(|(i, &w)| (i * 64 + w.trailing_zeros() as usize) as u8)
    }

    /// The least recently inserted block of `class`.
    #[inline]
    pub fn oldest_of_class(&self, class: u8) -> Option<BlockId> {
        let h = self.heads[class as usize];
        (h != NIL).then_some(h)
    }

    fn link_tail(&mut self, block: BlockId, class: u8) {
        let (b, c) = (block as usize, class as usize);
        let t = self.tails[c];
        self.prev[b] = t;
        self.next[b] = NIL;
        if t == NIL {
            self.heads[c] = block;
        } else {
            self.next[t as usize] = block;
        }
        self.tails[c] = block;
        self.class[b] = class;
        self.counts[c] += 1;
        self.nonempty[c / 64] |= 1 << (c % 64);
    }

    fn unlink(&mut self, block: BlockId) {
        let b = block as usize;
        let c = self.class[b] as usize;
        let (p, n) = (self.prev[b], self.next[b]);
        if p == NIL {
            self.heads[c] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tails[c] = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b] = NIL;
        self.next[b] = NIL;
        self.counts[c] -= 1;
        if self.counts[c] == 0 {
            self.nonempty[c / 64] &= !(1 << (c % 64));
        }
    }

    /// Indexes `block` (replacing any entry) as the most recent of `class`; at
    /// `deadline.0` it moves to class `deadline.1`.
    pub fn insert(&mut self, block: BlockId, class: u8, deadline: Option<(u64, u8)>) {
        self.remove(block);
        let b = block as usize;
        self.link_tail(block, class);
        self.indexed[b] = true;
        self.len += 1;
        self.deadline[b] = deadline;
        if let Some((at, _)) = deadline {
            self.heap.push(Reverse((at, block, self.generation[b])));
        }
    }

    /// Drops `block`'s entry, if any.
    pub fn remove(&mut self, block: BlockId) {
        let b = block as usize;
        if !self.contains(block) {
            return;
        }
        self.unlink(block);
        self.indexed[b] = false;
        self.len -= 1;
        if self.deadline[b].take().is_some() {
            // Its heap entry goes stale.
            self.generation[b] = self.generation[b].wrapping_add(1);
        }
    }

    /// Removes and returns the first block to evict and its class.
    pub fn pop_min(&mut self) -> Option<(BlockId, u8)> {
        let class = self.min_class()?;
        let block = self.heads[class as usize];
        self.remove(block);
        Some((block, class))
    }

    /// Moves every block whose deadline is `<= now_ms` to its after-class (most
    /// recent end, in deadline order); returns how many moved.
    pub fn expire(&mut self, now_ms: u64) -> u64 {
        let mut moved = 0;
        while let Some(&Reverse((at, block, generation))) = self.heap.peek() {
            if at > now_ms {
                break;
            }
            self.heap.pop();
            let b = block as usize;
            if generation != self.generation[b] || !self.indexed[b] {
                continue;
            }
            let Some((_, after)) = self.deadline[b].take() else {
                continue;
            };
            self.generation[b] = self.generation[b].wrapping_add(1);
            self.unlink(block);
            self.link_tail(block, after);
            moved += 1;
        }
        if self.heap.len() > 2 * self.len + 64 {
            self.compact_heap();
        }
        moved
    }

    /// Drops stale heap entries (amortized: only when they outnumber live ones).
    fn compact_heap(&mut self) {
        let live: Vec<_> = self
            .heap
            .drain()
            .filter(|Reverse((_, b, g))| {
                *g == self.generation[*b as usize] && self.deadline[*b as usize].is_some()
            })
            .collect();
        self.heap = live.into();
    }

    /// Forgets every block.
    pub fn clear(&mut self) {
        let n = self.prev.len();
        *self = Self::new(n);
    }

    /// The indexed blocks in eviction order.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        (0..CLASSES).flat_map(move |c| {
            let mut cur = self.heads[c];
            std::iter::from_fn(move || {
                (cur != NIL).then(|| {
                    let b = cur;
                    cur = self.next[b as usize];
                    b
                })
            })
        })
    }

    /// Structural consistency of the lists, counts, mask and deadlines.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut total = 0;
        for c in 0..CLASSES {
            let mut n = 0;
            let mut prev = NIL;
            let mut cur = self.heads[c];
            while cur != NIL {
                let b = cur as usize;
                if !self.indexed[b] || self.class[b] as usize != c || self.prev[b] != prev {
                    return Err(format!("class {c}: block {cur} is mislinked"));
                }
                n += 1;
                if n > self.prev.len() {
                    return Err(format!("class {c}: the list has a cycle"));
                }
                prev = cur;
                cur = self.next[b];
            }
            if self.tails[c] != prev || self.counts[c] != n {
                return Err(format!("class {c}: tail or count is stale"));
            }
            if ((self.nonempty[c / 64] >> (c % 64)) & 1 == 1) != (n > 0) {
                return Err(format!("class {c}: non-empty mask is stale"));
            }
            total += n;
        }
        let indexed = self.indexed.iter().filter(|&&i| i).count();
        if total != self.len || indexed != self.len {
            return Err(format!(
                "{total} listed, {indexed} flagged, len {}",
                self.len
            ));
        }
        for (b, d) in self.deadline.iter().enumerate() {
            if d.is_some() && !self.indexed[b] {
                return Err(format!("block {b} has a deadline but is not indexed"));
            }
            if let Some((at, _)) = d {
                let live = Reverse((*at, b as BlockId, self.generation[b]));
                if !self.heap.iter().any(|e| *e == live) {
                    return Err(format!("block {b}'s deadline is not in the heap"));
                }
            }
        }
        Ok(())
    }
}
