//! Reuse watchers: vLLM 0.33's `BlockPool.unpin_blocks` and `_reuse_watchers`.
//!
//! HiSparse keeps reading a GPU page after it released the page's reference: the
//! page is a write-back copy of a host page, and it stays readable until the pool
//! hands the block out again. vLLM registers a callback per unpinned block and
//! calls it when `get_new_blocks` pops the block or `reset_prefix_cache` succeeds.
//! The core cannot call back into its owner from inside a pool call, so the pool
//! keeps a *watched* flag per block and records each notification; the owner (the
//! HiSparse coordinator, `src/manager/hisparse/`) drains them right after the pool
//! call, before anything reads the state the callbacks would have changed.
//!
//! Key properties:
//! - `unpin_blocks` drops one reference per block, watches each block and appends
//!   those that reach 0 to the *tail* of the free queue, hashed or not: unpinned
//!   pages are last-resort eviction candidates.
//! - A watched block stays watched until it is reused (re-watching keeps its place
//!   in the notification order, as re-assigning a dict key does in vLLM).
//! - `get_new_blocks` notifies the popped watched blocks in pop order, before it
//!   evicts their hashes; `reset_prefix_cache` notifies every watched block in the
//!   order they were first watched.
//! - Validate first: an `unpin_blocks` with a null or unreferenced block changes
//!   nothing.

use super::BlockPool;
use crate::error::{Error, Result};
use crate::types::{BlockId, NULL_BLOCK_ID};

/// Which blocks are watched, in the order they were first watched, and the
/// notifications not yet drained.
#[derive(Clone, Debug, Default)]
pub(super) struct ReuseWatchers {
    watched: Vec<bool>,
    /// Blocks in first-watched order; entries whose flag was cleared are stale and
    /// skipped (compacted when they outnumber the live ones).
    order: Vec<BlockId>,
    num_watched: usize,
    /// Reused watched blocks, in notification order, until drained.
    reused: Vec<BlockId>,
}

impl ReuseWatchers {
    pub(super) fn try_new(num_blocks: usize) -> Result<Self> {
        Ok(Self {
            watched: crate::alloc::zeroed_vec(num_blocks, "the pool's reuse watchers")?,
            ..Self::default()
        })
    }

    #[inline]
    pub(super) fn any(&self) -> bool {
        self.num_watched > 0
    }

    fn watch(&mut self, block_id: BlockId) {
        let flag = &mut self.watched[block_id as usize];
        if !*flag {
            *flag = true;
            self.num_watched += 1;
            self.order.push(block_id);
        }
    }

    /// Records the watched blocks among `ids` as reused (pop order).
    pub(super) fn notify_popped(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let flag = &mut self.watched[id as usize];
            if *flag {
                *flag = false;
                self.num_watched -= 1;
                self.reused.push(id);
            }
        }
        if self.order.len() > 2 * self.num_watched + 16 {
            let watched = &self.watched;
            self.order.retain(|&b| watched[b as usize]);
        }
    }

    /// Records every watched block as reused, in first-watched order.
    pub(super) fn notify_all(&mut self) {
        let order = std::mem::take(&mut self.order);
        for id in order {
            let flag = &mut self.watched[id as usize];
            if *flag {
                *flag = false;
                self.reused.push(id);
            }
        }
        self.num_watched = 0;
    }
}

impl BlockPool {
    /// vLLM's `unpin_blocks`: drops one reference per block and watches each one
    /// (see module docs); blocks reaching 0 join the tail of the free queue.
    pub fn unpin_blocks(&mut self, block_ids: &[BlockId]) -> Result<()> {
        // Plan: every block valid and referenced often enough.
        for (i, &id) in block_ids.iter().enumerate() {
            self.check_block_id(i64::from(id))?;
            if id == NULL_BLOCK_ID {
                return Err(Error::InvalidArgument("cannot unpin the null block".into()));
            }
            let repeats = block_ids[..i].iter().filter(|&&b| b == id).count() as u32;
            if self.ref_cnt[id as usize] <= repeats {
                return Err(Error::DoubleFree(id));
            }
        }
        // Apply.
        let mut released = std::mem::take(&mut self.scratch_last);
        released.clear();
        for &id in block_ids {
            let rc = &mut self.ref_cnt[id as usize];
            *rc -= 1;
            self.watchers.watch(id);
            if *rc == 0 {
                released.push(id);
            }
        }
        let r = self.free_block_queue.append_n(&released);
        self.scratch_last = released;
        r
    }

    /// Whether `block_id` is watched (unpinned and not reused since).
    #[inline]
    pub fn is_watched(&self, block_id: BlockId) -> bool {
        self.watchers
            .watched
            .get(block_id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Whether reuse notifications wait to be drained.
    #[inline]
    pub fn has_reused_watched(&self) -> bool {
        !self.watchers.reused.is_empty()
    }

    /// Drains the reuse notifications (watched blocks handed out again, or every
    /// watched block at a reset), in notification order.
    pub fn take_reused_watched(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.watchers.reused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: u32) -> BlockPool {
        BlockPool::new(n, true, 1, false, false).unwrap()
    }

    #[test]
    fn unpinned_blocks_join_the_tail_and_count_as_free() {
        let mut p = pool(6);
        let mut ids = vec![];
        p.get_new_blocks(3, &mut ids).unwrap();
        p.unpin_blocks(&[2, 1]).unwrap();
        assert_eq!(p.free_block_queue().get_all_free_blocks(), vec![4, 5, 2, 1]);
        assert_eq!(p.get_num_free_blocks(), 4);
        assert!(p.is_watched(1) && p.is_watched(2) && !p.is_watched(3));
        p.check_invariants().unwrap();
    }

    #[test]
    fn reuse_notifies_in_pop_order_once() {
        let mut p = pool(4);
        let mut ids = vec![];
        p.get_new_blocks(3, &mut ids).unwrap();
        p.unpin_blocks(&[3, 1]).unwrap();
        let mut more = vec![];
        p.get_new_blocks(2, &mut more).unwrap();
        assert_eq!(more, vec![3, 1]);
        assert_eq!(p.take_reused_watched(), vec![3, 1]);
        assert!(!p.has_reused_watched());
        p.free_blocks(&[1]).unwrap();
        let mut again = vec![];
        p.get_new_blocks(1, &mut again).unwrap();
        assert!(p.take_reused_watched().is_empty());
    }

    #[test]
    fn a_block_unpinned_while_referenced_twice_stays_in_use() {
        let mut p = pool(4);
        let mut ids = vec![];
        p.get_new_blocks(1, &mut ids).unwrap();
        p.touch(&[1]).unwrap();
        p.unpin_blocks(&[1]).unwrap();
        assert_eq!(p.ref_cnt(1), 1);
        assert!(p.is_watched(1));
        assert_eq!(p.get_num_free_blocks(), 2);
    }

    #[test]
    fn reset_notifies_every_watched_block_in_watch_order() {
        let mut p = pool(5);
        let mut ids = vec![];
        p.get_new_blocks(3, &mut ids).unwrap();
        p.unpin_blocks(&[2]).unwrap();
        p.unpin_blocks(&[3, 1]).unwrap();
        // Re-watching keeps the first place.
        p.touch(&[2]).unwrap();
        p.unpin_blocks(&[2]).unwrap();
        assert!(p.reset_prefix_cache());
        assert_eq!(p.take_reused_watched(), vec![2, 3, 1]);
        assert!(!p.is_watched(2));
    }

    #[test]
    fn bad_unpin_changes_nothing() {
        let mut p = pool(4);
        let mut ids = vec![];
        p.get_new_blocks(1, &mut ids).unwrap();
        assert!(p.unpin_blocks(&[1, 0]).is_err());
        assert!(p.unpin_blocks(&[1, 1]).is_err());
        assert!(p.unpin_blocks(&[2]).is_err());
        assert_eq!(p.ref_cnt(1), 1);
        assert!(!p.is_watched(1));
        p.check_invariants().unwrap();
    }
}
