//! The manager's poison flag and panic shields, and its invariant check.
//!
//! Caller mistakes are typed errors found before anything changes. What is left is
//! an internal failure in an apply stage, a broken invariant (checked after every
//! mutating call with `HSCACHE_CHECK_INVARIANTS=1` and in debug builds) or a panic:
//! each poisons the manager ([`crate::shield::Poison`], the flag every shielded
//! object uses), so that call and every later one raise, naming the first failure.
//! Mutating bindings run through [`KVCacheManager::shielded`] (a panic poisons),
//! read-only ones through [`KVCacheManager::read`] (a panic poisons nothing).
//! `crate::shield` does not name the manager back (no import circle).

use super::KVCacheManager;
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::shield::catch;

/// Whether `HSCACHE_CHECK_INVARIANTS` asks for a check after every operation
/// (any value but empty, `0`, `false`, `no`, `off`), or this is a debug build.
pub fn check_invariants_from_env() -> bool {
    cfg!(debug_assertions)
        || std::env::var("HSCACHE_CHECK_INVARIANTS").is_ok_and(|v| {
            !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "" | "0" | "false" | "no" | "off"
            )
        })
}

impl KVCacheManager {
    /// The first apply-phase failure, if the manager is poisoned.
    pub fn poisoned(&self) -> Option<&str> {
        self.poison.reason()
    }

    #[inline]
    pub(super) fn guard(&self) -> Result<()> {
        match self.poison.reason() {
            None => Ok(()),
            Some(msg) => Err(Error::Poisoned(msg.to_owned())),
        }
    }

    /// An apply-phase result: an error poisons the manager.
    #[inline(always)]
    pub(super) fn applied<T>(&mut self, r: Result<T>) -> Result<T> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => Err(self.poisoned_by(e)),
        }
    }

    /// Turns the after-every-operation invariant check on or off (tests; the
    /// default comes from [`check_invariants_from_env`]).
    pub fn set_check_invariants(&mut self, on: bool) {
        self.check_after_ops = on;
    }

    /// Whether every mutating call checks the invariants after it ran.
    pub fn checks_invariants(&self) -> bool {
        self.check_after_ops
    }

    /// The end of every mutating call: with the check on, a broken invariant
    /// poisons the manager and replaces the result with [`Error::Invariant`].
    /// Off, this is one predictable branch.
    #[inline(always)]
    pub(super) fn after<T>(&mut self, op: &'static str, r: Result<T>) -> Result<T> {
        if self.check_after_ops {
            return self.after_checked(op, r);
        }
        r
    }

    /// Runs `op` (one call on the manager); a panic inside it is caught, poisons the
    /// manager (its state may be half-updated: every later call fails with
    /// [`Error::Poisoned`]) and comes back as [`Error::Internal`]. The Python bindings run
    /// every mutating call through it, so that an internal panic surfaces as
    /// `hscache.exceptions.InternalError` (a `RuntimeError`), never as pyo3's
    /// `PanicException` with a corrupted manager left behind.
    pub fn shielded<T>(
        &mut self,
        what: &str,
        op: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        // A poisoned manager refuses every call, including those whose core method
        // has no guard of its own (the per-step drains: `new_step_starts`,
        // `take_new_block_ids`, ...).
        self.guard()?;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(self))) {
            Ok(r) => r,
            Err(payload) => Err(self.poison.set_after_panic(what, payload.as_ref())),
        }
    }

    #[cold]
    #[inline(never)]
    fn after_checked<T>(&mut self, op: &'static str, r: Result<T>) -> Result<T> {
        if self.poison.reason().is_some() {
            return r;
        }
        let checked = if self.coordinator.hisparse().is_some() {
            // Between a HiSparse step's calls its tables may name pages it
            // released (and lost to reuse) until the next step: check the pools'
            // own structures only.
            self.block_pool()
                .check_invariants()
                .and_then(|()| self.host_pool().map_or(Ok(()), BlockPool::check_invariants))
        } else {
            self.check_invariants()
        };
        match checked {
            Ok(()) => r,
            Err(msg) => Err(Error::Invariant(
                self.poison.set(format!("after {op}: {msg}")),
            )),
        }
    }

    /// An apply-phase error poisons the manager.
    #[cold]
    #[inline(never)]
    fn poisoned_by(&mut self, e: Error) -> Error {
        Error::Internal(self.poison.set(e.to_string()))
    }

    /// Every structural invariant of the pool and the request tables.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        if self.coordinator.hisparse().is_some() {
            // HiSparse pins pages outside the tables (reuse watchers, publications):
            // ref counts are checked as an upper bound there.
            return self.coordinator.check_invariants();
        }
        self.coordinator
            .check_invariants_with(Some(&self.external_refs))
    }

    /// Runs a read-only call on the manager: refused on a poisoned manager (its
    /// tables may be half-updated), and a panic inside it is [`Error::Internal`]
    /// without poisoning (nothing changed). Mutating calls use
    /// [`KVCacheManager::shielded`].
    #[inline]
    pub fn read<R, E: From<Error>>(
        &self,
        what: &str,
        op: impl FnOnce(&Self) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        if let Some(reason) = self.poisoned() {
            return Err(Error::Poisoned(reason.to_owned()).into());
        }
        catch(what, || op(self))
    }
}
