//! The pool's side of an attached retention policy (`retention/`): selecting it,
//! handing out blocks in its eviction order, and keeping it in step when a block
//! loses its cached contents. None of this runs with the default `lru`.

use super::retention::{Retention, RetentionConfig, RetentionHint, RetentionKind};
use super::BlockPool;
use crate::error::{Error, Result};
use crate::types::{BlockId, NULL_BLOCK_ID};

impl BlockPool {
    /// Selects a retention policy. Only on a pool with no cached block and no block
    /// in use (right after construction); `Lru` detaches any policy.
    pub fn set_retention(&mut self, kind: RetentionKind, config: RetentionConfig) -> Result<()> {
        let fresh = self.cached_block_hash_to_block.is_empty()
            && self.free_block_queue.num_free_blocks() + 1 == self.num_gpu_blocks as usize;
        if !fresh {
            return Err(Error::InvalidArgument(
                "a retention policy can only be selected before any block is used".into(),
            ));
        }
        self.retention = match kind {
            RetentionKind::Lru => None,
            _ => Some(Box::new(Retention::new(kind, config, self.num_gpu_blocks)?)),
        };
        Ok(())
    }

    /// The attached policy (None: `lru`).
    #[inline]
    pub fn retention(&self) -> Option<&Retention> {
        self.retention.as_deref()
    }

    /// The attached policy, mutable (hints, pins, the clock).
    #[inline]
    pub fn retention_mut(&mut self) -> Option<&mut Retention> {
        self.retention.as_deref_mut()
    }

    /// The active policy's kind.
    pub fn retention_kind(&self) -> RetentionKind {
        self.retention
            .as_ref()
            .map_or(RetentionKind::Lru, |r| r.kind())
    }

    /// Sets the hint for the next frees (no-op under `lru`).
    #[inline]
    pub fn set_retention_hint(&mut self, hint: RetentionHint) {
        if let Some(r) = self.retention.as_mut() {
            r.set_hint(hint);
        }
    }

    /// Clears the hint (no-op under `lru`).
    #[inline]
    pub fn clear_retention_hint(&mut self) {
        if let Some(r) = self.retention.as_mut() {
            r.clear_hint();
        }
    }

    /// Unpins every block (no-op unless the policy pins).
    pub fn unpin_all(&mut self) {
        let queue = &self.free_block_queue;
        if let Some(r) = self.retention.as_mut() {
            r.unpin_all(|b| queue.contains(b));
        }
    }

    /// Pins the listed cached blocks (a registered prefix) under `pin`; returns
    /// how many are pinned now. Uncached or null blocks are skipped.
    pub fn pin_blocks(&mut self, block_ids: &[i64]) -> Result<usize> {
        for &id in block_ids {
            self.check_block_id(id)?;
        }
        let Some(r) = self.retention.as_mut() else {
            return Ok(0);
        };
        if r.kind() != RetentionKind::Pin {
            return Ok(0);
        }
        let mut pinned = 0;
        for &id in block_ids {
            let id = id as BlockId;
            if id == NULL_BLOCK_ID || self.cached_block_hash_to_block.key_of(id).is_none() {
                continue;
            }
            pinned += usize::from(r.pin_block(id, self.free_block_queue.contains(id)));
        }
        Ok(pinned)
    }

    /// `get_new_blocks` under an attached policy: free blocks without a hash first
    /// (the queue's head, vLLM's order), then cached ones in the policy's order.
    pub(super) fn pop_with_retention(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        let available = self.get_num_free_blocks();
        if n > available {
            return Err(Error::NotEnoughFreeBlocks {
                requested: n,
                available,
            });
        }
        let Some(r) = self.retention.as_deref_mut() else {
            return self.free_block_queue.popleft_n(n, out);
        };
        let now = r.now_ms();
        r.expire(now);
        for _ in 0..n {
            let id = match self.free_block_queue.first() {
                Some(h) if !r.is_indexed(h) && !r.is_pinned(h) => h,
                _ => r.pop_victim().ok_or(Error::NoFreeBlocks)?,
            };
            self.free_block_queue.remove(id)?;
            out.push(id);
        }
        Ok(())
    }

    /// Before a block's cached keys are dropped outside `get_new_blocks`
    /// (`evict_blocks`, Mamba): the policy forgets it; a free one moves to the
    /// queue's head, with the other blocks that have no hash.
    pub(super) fn retention_uncache(&mut self, block_id: BlockId) {
        if self.cached_block_hash_to_block.key_of(block_id).is_none() {
            return;
        }
        let free = self.free_block_queue.contains(block_id);
        if let Some(r) = self.retention.as_mut() {
            r.on_uncached(block_id, free);
        }
        if free
            && self.free_block_queue.remove(block_id).is_ok()
            && self.free_block_queue.prepend_n(&[block_id]).is_err()
        {
            debug_assert!(false, "block {block_id} left the queue");
        }
    }

    /// The policy's structures agree with the pool (no-op under `lru`).
    pub(super) fn check_retention_invariants(&self) -> std::result::Result<(), String> {
        let Some(r) = self.retention.as_ref() else {
            return Ok(());
        };
        r.check_invariants(
            |b| b != NULL_BLOCK_ID && self.free_block_queue.contains(b),
            |b| self.cached_block_hash_to_block.key_of(b).is_some(),
        )?;
        // Free blocks without a hash come before every cached free block.
        let mut seen_cached = false;
        for id in self.free_block_queue.iter() {
            let cached = self.cached_block_hash_to_block.key_of(id).is_some();
            if seen_cached && !cached {
                return Err(format!("uncached free block {id} behind a cached one"));
            }
            seen_cached |= cached;
        }
        Ok(())
    }
}
