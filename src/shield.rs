//! Panic shields: the one place an internal panic becomes a typed error and, where
//! state may be half-updated, poisons the object that panicked.
//!
//! [`Shielded<T>`] wraps the core object behind a Python class (encoder cache, hasher,
//! block pool view, hidden-state mirror, ...) with its own poison flag:
//! - [`Shielded::write`] runs a call that may change `T`: a panic inside it poisons the
//!   object (its state may be half-updated) and comes back as [`Error::Internal`];
//! - [`Shielded::read`] runs a call that changes nothing: a panic is
//!   [`Error::Internal`] and poisons nothing;
//! - both refuse to run on a poisoned object ([`Error::ObjectPoisoned`], naming the
//!   first failure), so a caller never reads or extends state a panic left behind.
//!
//! [`Poison`] is the one poison flag: `Shielded<T>` holds one, and so does the
//! `KVCacheManager`, whose apply-phase errors and invariant checks poison it too
//! ([`crate::manager::KVCacheManager::shielded`]); both word a poisoning and a
//! caught panic alike. The manager's read-only
//! bindings go through [`catch`] after checking that flag
//! ([`crate::manager::KVCacheManager::read`], written in `src/manager/poison.rs`
//! so that this module, which the manager uses, does not name the manager back).
//! `catch_unwind` costs nothing on the path that does not panic: the wrappers add
//! one branch on the flag.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::Error;

/// A panic payload as text (panics carry a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".to_owned())
}

/// Runs `op`; a panic inside it comes back as [`Error::Internal`] naming `what`.
/// For calls that change no state (nothing to poison).
#[inline]
pub fn catch<T, E: From<Error>>(
    what: &str,
    op: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    match catch_unwind(AssertUnwindSafe(op)) {
        Ok(r) => r,
        Err(payload) => Err(Error::Internal(panicked(what, payload.as_ref())).into()),
    }
}

/// "internal panic in `what`: `payload`".
#[cold]
#[inline(never)]
fn panicked(what: &str, payload: &(dyn std::any::Any + Send)) -> String {
    format!("internal panic in {what}: {}", panic_message(payload))
}

/// A poison flag: the first failure that may have left an object half-updated.
/// Every later call on the object refuses to run, naming it.
#[derive(Debug)]
pub struct Poison {
    /// What the object is, for messages ("KV-cache manager", "encoder cache", ...).
    object: &'static str,
    reason: Option<String>,
}

impl Poison {
    pub const fn new(object: &'static str) -> Self {
        Self {
            object,
            reason: None,
        }
    }

    /// What the flag guards.
    pub fn object(&self) -> &'static str {
        self.object
    }

    /// Why the object refuses every call, if it is poisoned.
    #[inline(always)]
    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// Poisons the object with `reason`; returns the text of the error the failing
    /// call raises ("`reason` (the `object` is now poisoned)").
    #[cold]
    #[inline(never)]
    pub fn set(&mut self, reason: String) -> String {
        let text = format!("{reason} (the {} is now poisoned)", self.object);
        self.reason = Some(reason);
        text
    }

    /// A panic caught in `what` poisons the object: the [`Error::Internal`] the
    /// call raises instead.
    #[cold]
    #[inline(never)]
    pub fn set_after_panic(&mut self, what: &str, payload: &(dyn std::any::Any + Send)) -> Error {
        Error::Internal(self.set(panicked(what, payload)))
    }
}

/// A core object with a poison flag (see module docs).
#[derive(Debug)]
pub struct Shielded<T> {
    inner: T,
    poison: Poison,
}

impl<T> Shielded<T> {
    pub fn new(inner: T, object: &'static str) -> Self {
        Self {
            inner,
            poison: Poison::new(object),
        }
    }

    /// Why the object refuses every call, if a panic poisoned it.
    pub fn poisoned(&self) -> Option<&str> {
        self.poison.reason()
    }

    #[inline(always)]
    fn guard(&self) -> Result<(), Error> {
        match self.poison.reason() {
            None => Ok(()),
            Some(reason) => Err(self.refusal(reason)),
        }
    }

    #[cold]
    #[inline(never)]
    fn refusal(&self, reason: &str) -> Error {
        Error::ObjectPoisoned {
            object: self.poison.object(),
            reason: reason.to_owned(),
        }
    }

    /// Runs a call that changes nothing (see module docs).
    #[inline]
    pub fn read<R, E: From<Error>>(
        &self,
        what: &str,
        op: impl FnOnce(&T) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        self.guard()?;
        catch(what, || op(&self.inner))
    }

    /// Runs a call that may change the object; a panic poisons it (see module docs).
    #[inline]
    pub fn write<R, E: From<Error>>(
        &mut self,
        what: &str,
        op: impl FnOnce(&mut T) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        self.guard()?;
        match catch_unwind(AssertUnwindSafe(|| op(&mut self.inner))) {
            Ok(r) => r,
            Err(payload) => Err(self.poison.set_after_panic(what, payload.as_ref()).into()),
        }
    }

    /// The object, past the shield: for code that cannot panic (plain field reads,
    /// Python-side bookkeeping), and for tests.
    pub fn unshielded(&self) -> &T {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_write_poisons_and_a_panicking_read_does_not() {
        let mut s = Shielded::new(0_u32, "counter");
        assert_eq!(
            s.write("add", |n| -> Result<u32, Error> {
                *n += 1;
                Ok(*n)
            }),
            Ok(1)
        );
        let r: Result<(), Error> = s.read("peek", |_| panic!("boom"));
        assert!(matches!(r, Err(Error::Internal(m)) if m.contains("boom")));
        assert_eq!(s.read("peek", |n| Ok::<_, Error>(*n)), Ok(1));
        let r: Result<(), Error> = s.write("add", |_| panic!("half-updated"));
        assert!(matches!(r, Err(Error::Internal(m)) if m.contains("now poisoned")));
        let r = s.read("peek", |n| Ok::<_, Error>(*n));
        assert!(matches!(
            r,
            Err(Error::ObjectPoisoned {
                object: "counter",
                ..
            })
        ));
        assert!(s.poisoned().is_some_and(|m| m.contains("half-updated")));
    }
}
