//! KV-cache events recorded by the pool, in pool-operation order.
//!
//! Mirrors vLLM 0.33 `distributed/kv_events.py` (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`) as compact records. A `BlockStored` record names the block
//! range of one `cache_full_blocks` call; the Python adapter turns it into vLLM's
//! msgspec struct right after the call, reading the token ids, hashes, LoRA and
//! extra keys from the request it has at hand (per block in Rust, with
//! `block_stored_fields` of `src/python/events.rs`), so the struct's fields are exactly
//! what vLLM would have filled.

use crate::types::BlockHashWithGroupId;

/// One KV-cache event (see module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KVCacheEvent {
    /// Blocks `start_block..end_block` of a request's table were cached under the
    /// request's hashes `block_hashes[start_block..end_block]`.
    BlockStored {
        group_id: u32,
        start_block: u32,
        end_block: u32,
        block_size: u32,
    },
    /// One key was removed from the prefix-cache index (eviction).
    BlockRemoved { key: BlockHashWithGroupId },
    /// The prefix cache was reset.
    AllBlocksCleared,
}
