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
//! (`tests/robustness/test_panic_python.py`).

#[cfg(feature = "fault-injection")]
mod imp {
    use std::cell::RefCell;

    thread_local! {
        /// The point armed on this thread and how many passes it lets through first.
        /// Per thread, not process-wide: cargo runs tests on parallel threads, and a
        /// global armed point was consumed by whichever test passed it first (a flaky
        /// suite). Every point fires on the thread of the call that passes it, which is
        /// the thread that armed it (the Python bindings run on the caller's thread).
        static ARMED: RefCell<Option<(String, usize)>> = const { RefCell::new(None) };
    }

    /// Arms `site` on this thread: its `skip + 1`-th pass panics (once; the point
    /// disarms itself).
    pub fn arm(site: &str, skip: usize) {
        ARMED.with(|a| *a.borrow_mut() = Some((site.to_owned(), skip)));
    }

    /// Disarms this thread's point.
    pub fn disarm() {
        ARMED.with(|a| *a.borrow_mut() = None);
    }

    /// Panics if `site` is armed on this thread and its countdown is spent.
    pub fn point(site: &str) {
        let fire = ARMED.with(|a| {
            let mut armed = a.borrow_mut();
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
            }
            fire
        });
        if fire {
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
