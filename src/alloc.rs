//! Fallible allocation of the per-block tables (pool, free queue, index, slot mirror):
//! a table too large for the machine is [`Error::OutOfMemory`] (Python's `MemoryError`),
//! never an abort of the serving process.

use crate::error::{Error, Result};

/// Integer types whose all-zero bytes are a valid value.
pub trait ZeroIsValid: Copy {}
impl ZeroIsValid for u32 {}
impl ZeroIsValid for u64 {}
impl ZeroIsValid for [u32; 2] {}
impl ZeroIsValid for bool {}

/// A zeroed `Vec` of `n` values, or [`Error::OutOfMemory`]: the pages come from the
/// allocator's zeroed memory (`calloc`), so a large table costs nothing until used,
/// and a failed allocation is an error instead of an abort.
pub fn zeroed_vec<T: ZeroIsValid>(n: usize, what: &'static str) -> Result<Vec<T>> {
    let oom = || Error::OutOfMemory {
        bytes: n as u128 * std::mem::size_of::<T>() as u128,
        what,
    };
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| oom())?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size; `T` is an integer type (`ZeroIsValid`), so
    // the zeroed memory holds `n` initialized values, and it was allocated by the
    // global allocator with `T`'s layout for exactly `n` elements, as
    // `Vec::from_raw_parts` requires.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<T>();
        if ptr.is_null() {
            return Err(oom());
        }
        Ok(Vec::from_raw_parts(ptr, n, n))
    }
}

/// A `Vec` of `n` copies of `value`, or [`Error::OutOfMemory`] when the allocation fails.
pub fn filled_vec<T: Clone>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        bytes: n as u128 * std::mem::size_of::<T>() as u128,
        what,
    })?;
    v.resize(n, value);
    Ok(v)
}
