//! `FreeKVCacheBlockQueue`: the intrusive doubly linked list of free blocks.
//!
//! Mirrors vLLM 0.33 `v1/core/kv_cache_utils.py::FreeKVCacheBlockQueue`, as a
//! struct of arrays over block ids instead of linked Python objects.
//!
//! Key properties:
//! - The head is the next block to reuse. Callers keep vLLM's order: freed blocks
//!   without a hash at the head (LIFO reuse), never-used blocks next in id order,
//!   hashed (evictable cached) blocks at the tail in LRU order.
//! - Every operation is O(1) per block and allocates nothing: `prev`/`next` are
//!   preallocated arrays of `num_blocks + 2` entries; the two extra slots are the
//!   head and tail sentinels (vLLM's `fake_free_list_head` / `fake_free_list_tail`).
//! - A block is in the queue iff its `prev` link is set; operations on blocks in
//!   the wrong state return an error and change nothing.

use crate::alloc::filled_vec;
use crate::error::{Error, Result};
use crate::types::BlockId;

const UNLINKED: u32 = u32::MAX;

/// The free-block queue (see module docs).
#[derive(Clone, Debug)]
pub struct FreeKVCacheBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free_blocks: usize,
}

impl FreeKVCacheBlockQueue {
    /// A queue holding blocks `0..num_blocks` in id order ([`Error::OutOfMemory`] if
    /// its links cannot be allocated).
    pub fn try_new(num_blocks: u32) -> Result<Self> {
        let n = num_blocks as usize;
        let head = num_blocks;
        let tail = num_blocks + 1;
        let mut prev = filled_vec(n + 2, UNLINKED, "the free queue's links")?;
        let mut next = filled_vec(n + 2, UNLINKED, "the free queue's links")?;
        // head -> 0 -> 1 -> ... -> n-1 -> tail
        let mut last = head;
        for id in 0..num_blocks {
            next[last as usize] = id;
            prev[id as usize] = last;
            last = id;
        }
        next[last as usize] = tail;
        prev[tail as usize] = last;
        Ok(Self {
            prev,
            next,
            head,
            tail,
            num_free_blocks: n,
        })
    }

    /// Number of blocks in the queue.
    #[inline]
    pub fn num_free_blocks(&self) -> usize {
        self.num_free_blocks
    }

    /// Capacity in blocks (the pool size).
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.prev.len() - 2
    }

    /// Whether `block_id` is currently in the queue.
    #[inline]
    pub fn contains(&self, block_id: BlockId) -> bool {
        (block_id as usize) < self.num_blocks() && self.prev[block_id as usize] != UNLINKED
    }

    #[inline]
    fn check_id(&self, block_id: BlockId) -> Result<()> {
        if (block_id as usize) < self.num_blocks() {
            Ok(())
        } else {
            Err(Error::BlockIdOutOfRange {
                block_id: i64::from(block_id),
                num_blocks: self.num_blocks() as u32,
            })
        }
    }

    #[inline]
    fn unlink(&mut self, id: u32) {
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[id as usize] = UNLINKED;
        self.next[id as usize] = UNLINKED;
    }

    #[inline]
    fn link_before(&mut self, id: u32, at: u32) {
        let p = self.prev[at as usize];
        self.next[p as usize] = id;
        self.prev[id as usize] = p;
        self.next[id as usize] = at;
        self.prev[at as usize] = id;
    }

    /// Pops the head block.
    pub fn popleft(&mut self) -> Result<BlockId> {
        let first = self.next[self.head as usize];
        if first == self.tail {
            return Err(Error::NoFreeBlocks);
        }
        self.unlink(first);
        self.num_free_blocks -= 1;
        Ok(first)
    }

    /// Pops the first `n` blocks into `out` (appended in queue order).
    pub fn popleft_n(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        if n > self.num_free_blocks {
            return Err(Error::NotEnoughFreeBlocks {
                requested: n,
                available: self.num_free_blocks,
            });
        }
        out.reserve(n);
        let mut cur = self.next[self.head as usize];
        for _ in 0..n {
            let nxt = self.next[cur as usize];
            self.prev[cur as usize] = UNLINKED;
            self.next[cur as usize] = UNLINKED;
            out.push(cur);
            cur = nxt;
        }
        self.next[self.head as usize] = cur;
        self.prev[cur as usize] = self.head;
        self.num_free_blocks -= n;
        Ok(())
    }

    /// Removes `block_id` from anywhere in the queue.
    pub fn remove(&mut self, block_id: BlockId) -> Result<()> {
        self.check_id(block_id)?;
        if self.prev[block_id as usize] == UNLINKED {
            return Err(Error::NotInFreeQueue(block_id));
        }
        self.unlink(block_id);
        self.num_free_blocks -= 1;
        Ok(())
    }

    fn check_not_queued(&self, ids: &[BlockId]) -> Result<()> {
        for &id in ids {
            self.check_id(id)?;
            if self.prev[id as usize] != UNLINKED {
                return Err(Error::AlreadyInFreeQueue(id));
            }
        }
        Ok(())
    }

    /// Links `ids` one by one before `at` (a fixed successor, so order is kept).
    /// All ids were checked to be unlinked; an id that is linked by the time we
    /// reach it was repeated in `ids`: undo this call's links and report it.
    fn link_all_before(&mut self, ids: &[BlockId], at: u32) -> Result<()> {
        self.check_not_queued(ids)?;
        for (i, &id) in ids.iter().enumerate() {
            if self.prev[id as usize] != UNLINKED {
                for &done in &ids[..i] {
                    self.unlink(done);
                }
                return Err(Error::InvalidArgument(format!(
                    "block {id} appears twice in one free-queue insertion"
                )));
            }
            self.link_before(id, at);
        }
        self.num_free_blocks += ids.len();
        Ok(())
    }

    /// Appends `block_id` at the tail.
    pub fn append(&mut self, block_id: BlockId) -> Result<()> {
        self.append_n(&[block_id])
    }

    /// Appends `ids` at the tail, in order (`ids[last]` becomes the tail).
    ///
    /// `ids` must be distinct and not queued; on error nothing changes.
    pub fn append_n(&mut self, ids: &[BlockId]) -> Result<()> {
        self.link_all_before(ids, self.tail)
    }

    /// Inserts `ids` at the head, in order (`ids[0]` becomes the new head).
    pub fn prepend_n(&mut self, ids: &[BlockId]) -> Result<()> {
        let first = self.next[self.head as usize];
        self.link_all_before(ids, first)
    }

    /// Iterates the queue from head to tail.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.next[self.head as usize];
        std::iter::from_fn(move || {
            if cur == self.tail {
                None
            } else {
                let id = cur;
                cur = self.next[cur as usize];
                Some(id)
            }
        })
    }

    /// All free blocks from head to tail (tests and diagnostics).
    pub fn get_all_free_blocks(&self) -> Vec<BlockId> {
        self.iter().collect()
    }

    /// `(previous, next)` free blocks of a queued block (`None` at either end), or
    /// `None` if the block is not in the queue.
    pub fn neighbors(&self, block_id: BlockId) -> Option<(Option<BlockId>, Option<BlockId>)> {
        if !self.contains(block_id) {
            return None;
        }
        let (p, n) = (self.prev[block_id as usize], self.next[block_id as usize]);
        Some(((p != self.head).then_some(p), (n != self.tail).then_some(n)))
    }

    /// The head block without popping it.
    pub fn first(&self) -> Option<BlockId> {
        let first = self.next[self.head as usize];
        (first != self.tail).then_some(first)
    }

    /// The tail block.
    pub fn last(&self) -> Option<BlockId> {
        let last = self.prev[self.tail as usize];
        (last != self.head).then_some(last)
    }

    /// Checks the links (tests, debugging and `HSCACHE_CHECK_INVARIANTS`): a walk
    /// from the head reaches the tail through `num_free_blocks` blocks with
    /// symmetric `prev`/`next` links and no cycle, and exactly the walked blocks
    /// are linked. `Err` names the first inconsistency.
    pub fn check_links(&self) -> std::result::Result<(), String> {
        let n = self.num_blocks();
        let (head, tail) = (self.head as usize, self.tail as usize);
        if self.prev[head] != UNLINKED || self.next[tail] != UNLINKED {
            return Err("free queue: a sentinel has an outer link".into());
        }
        let mut cur = self.head;
        let mut walked = 0usize;
        loop {
            let nxt = self.next[cur as usize];
            if nxt == UNLINKED || nxt as usize > n + 1 || nxt == self.head {
                return Err(format!(
                    "free queue: block {cur} has a broken next link ({nxt})"
                ));
            }
            if self.prev[nxt as usize] != cur {
                return Err(format!(
                    "free queue: next({cur}) = {nxt} but prev({nxt}) = {}",
                    self.prev[nxt as usize]
                ));
            }
            if nxt == self.tail {
                break;
            }
            walked += 1;
            if walked > n {
                return Err("free queue: the links form a cycle".into());
            }
            cur = nxt;
        }
        if walked != self.num_free_blocks {
            return Err(format!(
                "free queue: {walked} blocks linked from head to tail but \
                 num_free_blocks = {}",
                self.num_free_blocks
            ));
        }
        let linked = self.prev[..n].iter().filter(|&&p| p != UNLINKED).count();
        if linked != walked {
            return Err(format!(
                "free queue: {linked} blocks have a prev link but {walked} are reachable"
            ));
        }
        if let Some(id) = (0..n).find(|&i| (self.prev[i] == UNLINKED) != (self.next[i] == UNLINKED))
        {
            return Err(format!("free queue: block {id} is half linked"));
        }
        Ok(())
    }

    /// Test-only corruption (invariant mutants, `src/manager/mutants.rs`): overwrites the
    /// `next` link of `block_id` (the head sentinel for `None`) and the free count.
    #[doc(hidden)]
    #[cfg(any(test, feature = "testing", feature = "mutants"))]
    pub fn corrupt_for_tests(
        &mut self,
        block_id: Option<BlockId>,
        next: Option<u32>,
        count_delta: isize,
    ) {
        let at = block_id.map_or(self.head as usize, |b| b as usize);
        if let (Some(v), Some(slot)) = (next, self.next.get_mut(at)) {
            *slot = v;
        }
        self.num_free_blocks = self.num_free_blocks.saturating_add_signed(count_delta);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_queue_is_in_id_order() {
        let q = FreeKVCacheBlockQueue::try_new(5).unwrap();
        assert_eq!(q.get_all_free_blocks(), vec![0, 1, 2, 3, 4]);
        assert_eq!(q.num_free_blocks(), 5);
    }

    #[test]
    fn popleft_n_then_prepend_and_append_keep_order() {
        let mut q = FreeKVCacheBlockQueue::try_new(6).unwrap();
        let mut out = vec![];
        q.popleft_n(3, &mut out).unwrap();
        assert_eq!(out, vec![0, 1, 2]);
        q.prepend_n(&[2, 0]).unwrap();
        q.append_n(&[1]).unwrap();
        assert_eq!(q.get_all_free_blocks(), vec![2, 0, 3, 4, 5, 1]);
        assert_eq!(q.first(), Some(2));
        assert_eq!(q.last(), Some(1));
        assert_eq!(q.neighbors(2), Some((None, Some(0))));
        assert_eq!(q.neighbors(1), Some((Some(5), None)));
        assert_eq!(q.neighbors(3), Some((Some(0), Some(4))));
    }

    #[test]
    fn remove_from_middle_and_errors_leave_queue_unchanged() {
        let mut q = FreeKVCacheBlockQueue::try_new(4).unwrap();
        q.remove(2).unwrap();
        assert_eq!(q.get_all_free_blocks(), vec![0, 1, 3]);
        assert_eq!(q.remove(2), Err(Error::NotInFreeQueue(2)));
        assert_eq!(q.append_n(&[0]), Err(Error::AlreadyInFreeQueue(0)));
        assert!(matches!(q.remove(9), Err(Error::BlockIdOutOfRange { .. })));
        assert_eq!(q.get_all_free_blocks(), vec![0, 1, 3]);
        assert!(q.append_n(&[2, 2]).is_err());
        assert_eq!(q.get_all_free_blocks(), vec![0, 1, 3]);
        let mut out = vec![];
        assert!(q.popleft_n(4, &mut out).is_err());
        assert!(out.is_empty());
        assert_eq!(q.num_free_blocks(), 3);
    }

    #[test]
    fn popleft_on_empty_queue_errors() {
        let mut q = FreeKVCacheBlockQueue::try_new(1).unwrap();
        assert_eq!(q.popleft(), Ok(0));
        assert_eq!(q.popleft(), Err(Error::NoFreeBlocks));
        assert_eq!(q.first(), None);
    }
}
