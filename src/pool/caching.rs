//! How blocks enter (and move within) the prefix cache: vLLM 0.33's
//! `BlockPool.cache_full_blocks`, `cache_partial_block`, `move_block_hashes`,
//! `emit_cached_block_events` and `_insert_block_hash`.
//!
//! Key properties:
//! - Hashes are read through a [`HashView`] at the group's block size: a group whose
//!   blocks span several hash blocks keys each block by the hash at its last hash
//!   boundary.
//! - A full block that already has a hash can only be a partial entry being
//!   promoted (its hash covers fewer tokens): all its keys go first, each with a
//!   `BlockRemoved`, then the full key is inserted. Anything else is refused before
//!   anything changes.
//! - A partial entry becomes the block's primary key if it has none, else a
//!   secondary key (`cached_block_hashes_by_block`).
//! - `move_block_hashes` re-points every key of a block to a private copy (Mamba
//!   copy-on-write) without events: the entries stay live.

use super::BlockPool;
use crate::error::{Error, Result};
use crate::events::KVCacheEvent;
use crate::types::{BlockHashSource, BlockHashWithGroupId, BlockId, HashView, NULL_BLOCK_ID};

impl BlockPool {
    /// The scale of `block_size` over the hash block size (`Err` unless a multiple).
    pub fn hash_scale(&self, block_size: usize) -> Result<usize> {
        let hbs = self.hash_block_size();
        if block_size == 0 || block_size % hbs != 0 {
            return Err(Error::InvalidArgument(format!(
                "block size {block_size} is not a multiple of the hash block size {hbs}"
            )));
        }
        Ok(block_size / hbs)
    }

    /// vLLM's `_insert_block_hash`: indexes `block_id` under `key`, as its primary
    /// key (covering `num_tokens`) if it has none, else as a secondary key; no-op if
    /// the block already holds the key.
    pub(crate) fn insert_block_hash(
        &mut self,
        key: BlockHashWithGroupId,
        block_id: BlockId,
        num_tokens: usize,
    ) {
        let had_primary = self.block_hash(block_id).is_some();
        if self.cached_block_hash_to_block.insert(key, block_id) && !had_primary {
            self.block_hash_num_tokens[block_id as usize] = num_tokens as u32;
        }
    }

    /// vLLM's `_insert_block_hash` called from outside the pool (connectors, tests):
    /// [`Self::insert_block_hash`] after checking the block id. The null block is
    /// refused: it is a placeholder that never holds a hash (vLLM would index it and
    /// hand it out as a prefix hit).
    pub fn insert_block_hash_checked(
        &mut self,
        key: BlockHashWithGroupId,
        block_id: BlockId,
        num_tokens: usize,
    ) -> Result<()> {
        self.check_block_id(i64::from(block_id))?;
        if block_id == NULL_BLOCK_ID {
            return Err(Error::InvalidArgument(
                "the null block cannot hold a block hash".into(),
            ));
        }
        self.insert_block_hash(key, block_id, num_tokens);
        Ok(())
    }

    /// vLLM's `_remove_cached_block_hashes` + `_emit_block_removed_events`.
    fn remove_block_hashes_with_events(&mut self, block_id: BlockId) {
        let removed = self
            .cached_block_hash_to_block
            .remove_block_hashes(block_id);
        if self.enable_kv_cache_events() {
            for key in removed {
                self.events.push(KVCacheEvent::BlockRemoved { key });
            }
        }
    }

    /// Caches `table[num_cached_blocks..num_full_blocks]` (blocks of `block_size`
    /// tokens) under the request's hashes viewed at `block_size`, skipping null
    /// blocks and those `mask` (aligned with the range) leaves out; duplicates of
    /// existing keys are indexed too. Records one `BlockStored` when events are on.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_full_blocks<H: BlockHashSource + ?Sized>(
        &mut self,
        block_hashes: &H,
        table: &[BlockId],
        num_cached_blocks: usize,
        num_full_blocks: usize,
        block_size: usize,
        group_id: u32,
        mask: Option<&[bool]>,
    ) -> Result<()> {
        if num_cached_blocks >= num_full_blocks {
            return Ok(());
        }
        let scale = self.hash_scale(block_size)?;
        let view = HashView::new(block_hashes, scale);
        // Plan: every key, and every refusal, before the first change.
        if num_full_blocks > table.len() || num_full_blocks > view.len() {
            return Err(Error::InvalidArgument(format!(
                "cannot cache {num_full_blocks} blocks: the request has {} blocks and {} \
                 block hashes at block size {block_size}",
                table.len(),
                view.len()
            )));
        }
        if mask.is_some_and(|m| m.len() != num_full_blocks - num_cached_blocks) {
            return Err(Error::InvalidArgument(
                "block mask does not match the range to cache".into(),
            ));
        }
        let included =
            |i: usize| table[i] != NULL_BLOCK_ID && mask.is_none_or(|m| m[i - num_cached_blocks]);
        let range = num_cached_blocks..num_full_blocks;
        for (i, &id) in table.iter().enumerate().take(range.end).skip(range.start) {
            if !included(i) {
                continue;
            }
            self.check_block_id(i64::from(id))?;
            view.get(i)?;
            let num_hash_tokens = (i + 1) * block_size;
            if let Some(n) = self.block_hash_num_tokens(id) {
                if n as usize >= num_hash_tokens {
                    return Err(Error::InvalidArgument(format!(
                        "block {id} is already cached under a hash of {n} tokens; caching \
                         it as a full block of {num_hash_tokens} tokens is not a promotion"
                    )));
                }
            }
        }
        // Apply.
        let mut skipped: Vec<u32> = Vec::new();
        for (i, &id) in table.iter().enumerate().take(range.end).skip(range.start) {
            if !included(i) {
                if self.enable_kv_cache_events() {
                    skipped.push(i as u32);
                }
                continue;
            }
            // Checked above: cannot fail.
            let hash = view.get(i)?;
            if self.block_hash(id).is_some() {
                self.remove_block_hashes_with_events(id);
            }
            let key = BlockHashWithGroupId { hash, group_id };
            self.insert_block_hash(key, id, (i + 1) * block_size);
        }
        self.push_event(KVCacheEvent::BlockStored {
            group_id,
            start_block: num_cached_blocks as u32,
            end_block: num_full_blocks as u32,
            block_size: block_size as u32,
            hash_scale: scale as u32,
            skipped: (!skipped.is_empty()).then(|| skipped.into_boxed_slice()),
        });
        Ok(())
    }

    /// vLLM's `cache_partial_block`: makes `block_id` reachable from the prefix of
    /// `num_tokens` tokens (a positive multiple of the hash block size). Returns the
    /// key, or None for the null block. `replace_existing_hashes`: the block's
    /// contents were replaced, so all its keys go first.
    pub fn cache_partial_block<H: BlockHashSource + ?Sized>(
        &mut self,
        block_hashes: &H,
        block_id: BlockId,
        num_tokens: usize,
        group_id: u32,
        block_size: usize,
        replace_existing_hashes: bool,
    ) -> Result<Option<BlockHashWithGroupId>> {
        let hash = self.partial_block_key_hash(block_hashes, block_id, num_tokens, block_size)?;
        let Some(hash) = hash else {
            return Ok(None);
        };
        let key = BlockHashWithGroupId { hash, group_id };
        let hbs = self.hash_block_size();
        let num_hash_tokens = num_tokens / hbs * hbs;
        let mut already_cached = self.cached_block_hash_to_block.contain(&key, block_id);
        if replace_existing_hashes {
            self.remove_block_hashes_with_events(block_id);
            already_cached = false;
        } else if !already_cached
            && self
                .block_hash_num_tokens(block_id)
                .is_some_and(|n| (n as usize) < num_hash_tokens)
        {
            self.remove_block_hashes_with_events(block_id);
        }
        self.insert_block_hash(key, block_id, num_hash_tokens);
        if !already_cached {
            self.push_event(KVCacheEvent::PartialBlockStored {
                group_id,
                num_tokens: num_hash_tokens as u32,
                hash_block_size: hbs as u32,
            });
        }
        Ok(Some(key))
    }

    /// The hash a partial entry at `num_tokens` is keyed by (validation of
    /// [`Self::cache_partial_block`]; None for the null block).
    pub fn partial_block_key_hash<H: BlockHashSource + ?Sized>(
        &self,
        block_hashes: &H,
        block_id: BlockId,
        num_tokens: usize,
        block_size: usize,
    ) -> Result<Option<crate::types::BlockHash>> {
        self.check_block_id(i64::from(block_id))?;
        if block_id == NULL_BLOCK_ID {
            return Ok(None);
        }
        self.hash_scale(block_size)?;
        let hbs = self.hash_block_size();
        let n = num_tokens / hbs;
        if num_tokens % hbs != 0 || n == 0 || n > block_hashes.len() {
            return Err(Error::InvalidArgument(format!(
                "a partial prefix entry needs a positive multiple of {hbs} tokens within \
                 the request's {} hashes, got {num_tokens}",
                block_hashes.len()
            )));
        }
        block_hashes.get(n - 1).map(Some)
    }

    /// vLLM's `move_block_hashes`: every key of `src` now points at `dst` (which
    /// must be uncached); no events.
    pub fn move_block_hashes(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        self.check_block_id(i64::from(src))?;
        self.check_block_id(i64::from(dst))?;
        if self.block_hash(dst).is_some() || src == dst {
            return Err(Error::InvalidArgument(format!(
                "cannot move the keys of block {src} onto cached block {dst}"
            )));
        }
        if dst == NULL_BLOCK_ID {
            // vLLM asserts only that the target has no hash; the null block never
            // has one, and must never get one (it would be served as a hit).
            return Err(Error::InvalidArgument(format!(
                "cannot move the keys of block {src} onto the null block"
            )));
        }
        let num_tokens = self.block_hash_num_tokens(src).unwrap_or(0) as usize;
        let keys = self.cached_block_hash_to_block.remove_block_hashes(src);
        for key in keys {
            // The token count applies to the first (primary) insertion only.
            self.insert_block_hash(key, dst, num_tokens);
        }
        Ok(())
    }

    /// Takes `(key, block_id)` out of the index while the block keeps its hash
    /// (vLLM code popping the map directly); see `BlockHashToBlockMap::detach`.
    pub fn detach_entry(&mut self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        self.cached_block_hash_to_block.detach(key, block_id)
    }

    /// Restores a detached `(key, block_id)` at the end of its key's chain.
    pub fn reattach_entry(&mut self, key: &BlockHashWithGroupId, block_id: BlockId) -> bool {
        self.cached_block_hash_to_block.reattach(key, block_id)
    }

    /// vLLM's `emit_cached_block_events`: a `BlockStored` for the first
    /// `num_blocks` blocks of a prefix hit (`kv_cache_report_mode == "full"`).
    pub fn emit_cached_block_events(
        &mut self,
        num_blocks: usize,
        block_size: usize,
        group_id: u32,
    ) -> Result<()> {
        if !self.enable_kv_cache_events() || num_blocks == 0 {
            return Ok(());
        }
        let scale = self.hash_scale(block_size)?;
        self.push_event(KVCacheEvent::BlockStored {
            group_id,
            start_block: 0,
            end_block: num_blocks as u32,
            block_size: block_size as u32,
            hash_scale: scale as u32,
            skipped: None,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::BlockHash;

    fn hashes(n: u8) -> Vec<BlockHash> {
        (1..=n).map(|b| BlockHash::new(&[b; 32]).unwrap()).collect()
    }

    #[test]
    fn coarse_blocks_are_keyed_by_their_last_hash_boundary() {
        // Hash block 2, cache block 4: block i is keyed by hash 2i+1.
        let mut pool = BlockPool::new(6, true, 2, false, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(2, &mut ids).unwrap();
        let hs = hashes(4);
        pool.cache_full_blocks(&hs, &ids, 0, 2, 4, 0, None).unwrap();
        assert_eq!(pool.get_cached_block(&hs[1], 0), Some(1));
        assert_eq!(pool.get_cached_block(&hs[3], 0), Some(2));
        assert_eq!(pool.get_cached_block(&hs[0], 0), None);
        assert_eq!(pool.block_hash_num_tokens(2), Some(8));
    }

    #[test]
    fn partial_entry_is_promoted_when_the_block_fills() {
        let mut pool = BlockPool::new(4, true, 2, true, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(1, &mut ids).unwrap();
        let hs = hashes(2);
        let key = pool.cache_partial_block(&hs, 1, 2, 0, 4, false).unwrap();
        assert_eq!(key.unwrap().hash, hs[0]);
        assert_eq!(pool.block_hash_num_tokens(1), Some(2));
        pool.cache_full_blocks(&hs, &ids, 0, 1, 4, 0, None).unwrap();
        assert_eq!(pool.get_cached_block(&hs[0], 0), None);
        assert_eq!(pool.get_cached_block(&hs[1], 0), Some(1));
        let events = pool.take_events();
        assert!(matches!(
            events[0],
            KVCacheEvent::PartialBlockStored { num_tokens: 2, .. }
        ));
        assert!(matches!(events[1], KVCacheEvent::BlockRemoved { .. }));
        assert!(matches!(events[2], KVCacheEvent::BlockStored { .. }));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn caching_a_full_block_twice_is_refused_before_any_change() {
        let mut pool = BlockPool::new(4, true, 1, false, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(2, &mut ids).unwrap();
        let hs = hashes(2);
        pool.cache_full_blocks(&hs, &ids, 0, 1, 1, 0, None).unwrap();
        let err = pool.cache_full_blocks(&hs, &ids, 0, 2, 1, 0, None);
        assert!(matches!(err, Err(Error::InvalidArgument(_))));
        assert_eq!(pool.block_hash(2), None);
    }

    #[test]
    fn moved_keys_follow_the_copy() {
        let mut pool = BlockPool::new(4, true, 1, false, false).unwrap();
        let mut ids = vec![];
        pool.get_new_blocks(2, &mut ids).unwrap();
        let hs = hashes(1);
        pool.cache_full_blocks(&hs, &ids, 0, 1, 1, 0, None).unwrap();
        pool.move_block_hashes(1, 2).unwrap();
        assert_eq!(pool.get_cached_block(&hs[0], 0), Some(2));
        assert_eq!(pool.block_hash(1), None);
        assert_eq!(pool.block_hash_num_tokens(2), Some(1));
    }
}
