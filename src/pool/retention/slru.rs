//! `slru`: segmented LRU, a frequency-aware policy with aging.
//!
//! A cached block that was hit again (a prefix hit, shared or from the free queue)
//! since it was cached goes, when freed, to the protected segment (class 1);
//! one never hit again to probation (class 0), evicted first. The protected
//! segment holds at most `slru_protected_blocks` free blocks: past it, its least
//! recently freed block is demoted to probation's most recent end and its hit
//! count reset (aging), so a once-popular prefix cannot hold memory forever.

use super::{Placement, Retention};

/// Where a freed block with `hits` prefix hits goes.
#[inline]
pub fn place(hits: u8) -> Placement {
    Placement::Evictable {
        class: u8::from(hits > 0),
        expires: None,
    }
}

/// Demotes protected blocks past the cap, oldest first.
pub fn enforce_cap(retention: &mut Retention) {
    while retention.index.count_of_class(1) > retention.config.slru_protected_blocks {
        let Some(block) = retention.index.oldest_of_class(1) else {
            return;
        };
        retention.index.remove(block);
        retention.index.insert(block, 0, None);
        retention.hits[block as usize] = 0;
        retention.stats.demotions += 1;
    }
}
