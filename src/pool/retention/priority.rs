//! `priority`: per-request retention priority 0-100, TensorRT-LLM style.
//!
//! A freed cached block takes its request's priority (`hscache_priority`, default
//! `default_priority` = 35). Free blocks of a lower priority are evicted before any
//! of a higher one; within a priority, least recently freed first. With a duration
//! (`hscache_retention_s`) the priority holds that long after the free, then the
//! block falls back to the default priority (joining its most recent end).

use super::{Placement, RetentionConfig, RetentionHint};

/// The highest priority.
pub const MAX_PRIORITY: u8 = 100;

/// Where a freed block of a request with `hint` goes.
#[inline]
pub fn place(config: &RetentionConfig, hint: &RetentionHint, now_ms: u64) -> Placement {
    let class = hint
        .priority
        .unwrap_or(config.default_priority)
        .min(MAX_PRIORITY);
    let expires = match hint.duration_ms {
        Some(d) if class != config.default_priority => {
            Some((now_ms.saturating_add(d), config.default_priority))
        }
        _ => None,
    };
    Placement::Evictable { class, expires }
}
