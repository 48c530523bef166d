//! KV-cache event records and block-metrics calls, in pool-operation order.
//!
//! Mirrors vLLM 0.33 `distributed/kv_events.py` (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`) as compact records. A stored record names what one
//! `BlockPool.cache_full_blocks`, `cache_partial_block` or `emit_cached_block_events`
//! call covered; the Python bindings turn it into vLLM's msgspec struct inside the
//! call that recorded it, reading the token ids, hashes, LoRA and extra keys from the
//! request at hand (`src/python/events.rs`), so the struct's fields are exactly what
//! vLLM would have filled.
//!
//! HiSparse's host pool (vLLM's `SharedEventQueueBlockPool`, medium CPU) publishes
//! into the device pool's queue: its records are moved there, in operation order,
//! wrapped in [`KVCacheEvent::Host`].
//!
//! [`MetricsOp`] records the calls vLLM's `BlockPool` makes on a
//! `KVCacheMetricsCollector` (`--kv-cache-metrics`), in order, so the bindings can
//! replay them on the user's collector: same calls, same random samples.
//!
//! [`compact`]: the opt-in compact stream (consecutive events of one batch
//! coalesced) and the mode that selects it.

pub mod compact;

pub use compact::EventsMode;

use crate::types::{BlockHashWithGroupId, BlockId};

/// One KV-cache event (see module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KVCacheEvent {
    /// Blocks `start_block..end_block` of a request's table (blocks of `block_size`
    /// tokens, whose hashes are the request's hashes viewed `hash_scale` hash blocks
    /// per block) were cached; `skipped` lists the block indices in the range that
    /// got no hash (null or masked-out blocks: their hashes and extra keys are left
    /// out of the event, their tokens are not).
    BlockStored {
        group_id: u32,
        start_block: u32,
        end_block: u32,
        block_size: u32,
        hash_scale: u32,
        skipped: Option<Box<[u32]>>,
    },
    /// A partial (sub-block) prefix entry was registered at `num_tokens`, a multiple
    /// of the hash block size (vLLM's `cache_partial_block` event: one hash, the
    /// tokens of the last hash block, `block_size` = hash block size).
    PartialBlockStored {
        group_id: u32,
        num_tokens: u32,
        hash_block_size: u32,
    },
    /// One key was removed from the prefix-cache index (eviction, promotion).
    BlockRemoved { key: BlockHashWithGroupId },
    /// The prefix cache was reset.
    AllBlocksCleared,
    /// An event of the HiSparse host pool (medium CPU). A `BlockStored` inside
    /// covers the request of HiSparse publication `publication` (a token the
    /// coordinator hands out, see `src/manager/hisparse/`), or the recording call's
    /// request when `None`.
    Host {
        event: Box<KVCacheEvent>,
        publication: Option<u64>,
    },
}

/// One call of vLLM's `BlockPool` on its `KVCacheMetricsCollector`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricsOp {
    /// `on_block_allocated(block)` (`get_new_blocks`).
    Allocated(BlockId),
    /// `on_block_accessed(block)` (`touch`).
    Accessed(BlockId),
    /// `on_block_evicted(block)` (every block `_maybe_evict_cached_block` visits).
    Evicted(BlockId),
    /// `reset()` (a successful `reset_prefix_cache`).
    Reset,
}
