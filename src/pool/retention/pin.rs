//! `pin`: blocks of pinned requests are not evicted until unpinned.
//!
//! A request freed with `hscache_pin` pins its cached blocks (a shared system
//! prompt stays resident); a block once pinned stays pinned across later requests
//! until `unpin_all` (or an explicit eviction / `reset_prefix_cache`). Pinned free
//! blocks are not counted free, so the scheduler never asks for them. At most
//! `max_pinned_blocks` blocks are pinned; pins past the cap are refused (counted)
//! and those blocks are ordinary LRU. Unpinned blocks: LRU (class 0).

use super::{Placement, Retention};
use crate::types::BlockId;

/// Where a freed block goes. A pinning hint has already pinned the request's
/// blocks, prefix first, as far as the cap allows (`Retention::on_free_all`).
#[inline]
pub fn place(retention: &Retention, block: BlockId) -> Placement {
    if retention.is_pinned(block) {
        return Placement::Pinned;
    }
    Placement::Evictable {
        class: 0,
        expires: None,
    }
}
