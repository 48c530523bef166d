//! Test-only fault injection: a named point inside an internal operation that panics when
//! armed (cargo feature `fault-injection`), to prove that an internal panic poisons the
//! manager instead of leaving it silently corrupted (see
//! [`crate::manager::KVCacheManager::shielded`], the wrapper the Python bindings put
//! around every mutating call). Without the feature [`point`] compiles to nothing.
//!
//! Points: `allocate_slots.adopted` (after the hits are adopted, before the new blocks:
//! a half-applied allocation), `allocate_slots.cached` (before caching), `free` (after
//! the tables are released); in the Python bindings (`src/shield.rs` shields them):
//! `encoder_cache.allocate`, `hasher.hash_new_blocks`, `slot_mirror.plan`. Python arms a
//! point through `hscache._core._arm_fault` in a `fault-injection` build
//! (`tests/test_panic_python.py`).

#[cfg(feature = "fault-injection")]
mod imp {
    use std::sync::{Mutex, PoisonError};

    /// The armed point and how many passes it lets through first.
    static ARMED: Mutex<Option<(String, usize)>> = Mutex::new(None);

    /// Arms `site`: its `skip + 1`-th pass panics (once; the point disarms itself).
    pub fn arm(site: &str, skip: usize) {
        *ARMED.lock().unwrap_or_else(PoisonError::into_inner) = Some((site.to_owned(), skip));
    }

    /// Disarms every point.
    pub fn disarm() {
        *ARMED.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// Panics if `site` is armed and its countdown is spent.
    pub fn point(site: &str) {
        let mut armed = ARMED.lock().unwrap_or_else(PoisonError::into_inner);
        let fire = match armed.as_mut() {
            Some((s, n)) if s == site => {
                if *n == 0 {
                    true
                } else {
                    *n -= 1;
                    false
                }
            }
            _ => false,
        };
        if fire {
            *armed = None;
            drop(armed);
            panic!("hscache fault injection: injected panic at {site}");
        }
    }
}

#[cfg(feature = "fault-injection")]
pub use imp::{arm, disarm, point};

/// A fault point (disabled: the `fault-injection` feature is off).
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn point(_site: &str) {}
