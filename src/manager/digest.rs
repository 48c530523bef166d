//! `state_digest()`: one 64-bit fingerprint of a manager's observable state.
//!
//! Covers the device pool (every block's ref count, the null block's counter of
//! vLLM 0.32, hash key, hashed prefix length and secondary keys; the free queue in
//! order; each key's lookup order),
//! HiSparse's host pool the same way, the request tables of every group (blocks,
//! cached count, partial hit, and the per-request state a type keeps beside them:
//! Mamba "align"'s), queued copy-on-write pairs, the external
//! references and the poison flag. Tests take it before and after a call that must
//! fail and assert it did not move ("check before mutate"); it is not a content
//! hash for anything else (FxHash: deterministic, not collision resistant).
//! Request tables are combined order-independently, so the table's slot layout
//! does not matter.

use std::hash::{Hash, Hasher};

use rustc_hash::FxHasher;

use super::KVCacheManager;
use crate::pool::BlockPool;
use crate::types::BlockId;

fn hash_pool(pool: &BlockPool, h: &mut FxHasher) {
    let n = pool.num_gpu_blocks();
    n.hash(h);
    pool.get_num_free_blocks().hash(h);
    pool.null_ref_cnt().hash(h); // vLLM 0.32's null-block count (0 on 0.33)
    let index = pool.cached_block_hash_to_block();
    for b in 0..n as BlockId {
        pool.ref_cnt(b).hash(h);
        match pool.block_hash(b) {
            Some(key) => {
                1u8.hash(h);
                key.hash(h);
                pool.block_hash_num_tokens(b).hash(h);
                if index.get_one_block(key) == Some(b) {
                    index.get_all_blocks(key).hash(h);
                }
            }
            None => 0u8.hash(h),
        }
        for key in index.secondary_keys(b) {
            key.hash(h);
        }
    }
    index.num_entries().hash(h);
    index.len().hash(h);
    for b in pool.free_block_queue().iter() {
        b.hash(h);
    }
}

impl KVCacheManager {
    /// A 64-bit hash of the pool(s), free queue order, prefix-cache index and
    /// request tables (see module docs). Equal states give equal digests.
    pub fn state_digest(&self) -> u64 {
        let mut h = FxHasher::default();
        hash_pool(self.block_pool(), &mut h);
        if let Some(host) = self.host_pool() {
            hash_pool(host, &mut h);
        }
        let c = self.coordinator();
        let mut tables = 0u64;
        let mut num_requests = 0usize;
        for g in 0..c.num_groups() {
            for (rid, gb) in c.request_tables(g) {
                let mut r = FxHasher::default();
                g.hash(&mut r);
                rid.hash(&mut r);
                gb.blocks.hash(&mut r);
                gb.num_cached_block.hash(&mut r);
                gb.partial_hit.hash(&mut r);
                if let Some((slot, _)) = c.request_with_slot(rid) {
                    c.managers()[g].request_state_digest(slot).hash(&mut r);
                }
                tables = tables.wrapping_add(r.finish());
                num_requests += 1;
            }
        }
        tables.hash(&mut h);
        num_requests.hash(&mut h);
        for m in c.managers() {
            m.base().pending_cow_copies.hash(&mut h);
        }
        self.external_refs().hash(&mut h);
        self.poisoned().hash(&mut h);
        h.finish()
    }
}
