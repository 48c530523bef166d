//! `lru`: vLLM's policy, the default.
//!
//! LRU is not an attached policy: it *is* the pool's free queue
//! (`crate::free_queue`): freed hashed blocks go to the tail in the order the
//! caller frees them, eviction pops the head. With `lru` the pool holds no
//! `Retention` at all, so its decisions are vLLM's bit for bit and the hot path
//! pays nothing. Inside an attached policy, "LRU within a class" is one intrusive
//! list per class in the eviction index (`index.rs`).

use super::Placement;

/// The placement LRU would give (one class, no expiry); only reachable if a
/// `Retention` were built for `lru`, which `Retention::new` refuses.
#[inline]
pub fn place() -> Placement {
    Placement::Evictable {
        class: 0,
        expires: None,
    }
}
