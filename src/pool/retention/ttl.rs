//! `ttl`: freed cached blocks are protected for a time-to-live.
//!
//! A freed cached block is protected (class 1) for `ttl` milliseconds
//! (`HSCACHE_RETENTION_TTL_S`, or the request's `hscache_retention_s`; 0 = no
//! protection); protected blocks are evicted only when no unprotected cached block
//! is free. When the TTL passes the block becomes an ordinary LRU candidate
//! (class 0), joining that class's most recent end in expiry order. Expired blocks are not dropped eagerly:
//! a cached block costs nothing until its memory is needed.

use super::{Placement, RetentionConfig, RetentionHint};

/// Where a freed block of a request with `hint` goes.
#[inline]
pub fn place(config: &RetentionConfig, hint: &RetentionHint, now_ms: u64) -> Placement {
    let ttl = hint.duration_ms.unwrap_or(config.ttl_ms);
    if ttl == 0 {
        return Placement::Evictable {
            class: 0,
            expires: None,
        };
    }
    Placement::Evictable {
        class: 1,
        expires: Some((now_ms.saturating_add(ttl), 0)),
    }
}
