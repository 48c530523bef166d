//! `EncoderDecoderCacheManager`: vLLM 0.33's encoder budget for encoder-decoder models
//! (Whisper-style cross attention), in `v1/core/encoder_cache_manager.py`.
//!
//! vLLM does not share encoder outputs between requests of encoder-decoder models
//! yet: the manager only counts capacity for scheduling. Every allocated input's
//! identifier is handed to the worker to free one scheduling step later (the worker
//! frees *before* it runs the model, so `get_freed_mm_hashes` returns the identifiers
//! allocated in the previous call's window: a two-stage buffer). Nothing is ever a
//! hit, and a request's "cached" inputs are all of its inputs.
//!
//! Key properties (all vLLM's, kept exactly):
//! - `allocate` takes capacity without checking it (the Scheduler asked
//!   `can_allocate` first) and `free_encoder_input` gives it back without checking
//!   that it was taken; `free` gives back every input of the request. vLLM's counter
//!   is an unbounded Python int; here a count that would leave `i64` (far beyond any
//!   real cache) is an [`Error::InvalidArgument`] and changes nothing.
//! - `get_freed_mm_hashes` returns the previous window's identifiers and starts a new
//!   window.

use super::check_embeds;
use crate::error::{Error, Result};

/// The encoder-decoder budget (see module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EncoderDecoderCacheManager {
    cache_size: i64,
    num_free_slots: i64,
    allocated: Vec<String>,
    to_free: Vec<String>,
}

impl EncoderDecoderCacheManager {
    /// A budget of `cache_size` embeddings.
    pub fn new(cache_size: i64) -> Result<Self> {
        check_embeds("cache_size", cache_size)?;
        Ok(Self {
            cache_size,
            num_free_slots: cache_size,
            allocated: Vec::new(),
            to_free: Vec::new(),
        })
    }

    pub fn cache_size(&self) -> i64 {
        self.cache_size
    }

    pub fn num_free_slots(&self) -> i64 {
        self.num_free_slots
    }

    /// Overwrites `cache_size` (a plain attribute in vLLM).
    pub fn set_cache_size(&mut self, n: i64) -> Result<()> {
        check_embeds("cache_size", n)?;
        self.cache_size = n;
        Ok(())
    }

    /// Overwrites `num_free_slots` (a plain attribute in vLLM).
    pub fn set_num_free_slots(&mut self, n: i64) -> Result<()> {
        check_embeds("num_free_slots", n)?;
        self.num_free_slots = n;
        Ok(())
    }

    /// Identifiers allocated in the current window, in order.
    pub fn allocated(&self) -> &[String] {
        &self.allocated
    }

    /// Identifiers the next `get_freed_mm_hashes` returns, in order.
    pub fn to_free(&self) -> &[String] {
        &self.to_free
    }

    /// vLLM's `reset`.
    pub fn reset(&mut self) {
        self.num_free_slots = self.cache_size;
        self.allocated.clear();
        self.to_free.clear();
    }

    /// vLLM's `can_allocate`: within the compute budget and, with
    /// `num_embeds_to_schedule` already promised, within the free capacity.
    pub fn can_allocate(
        &self,
        num_embeds: i64,
        encoder_compute_budget: i64,
        num_embeds_to_schedule: i64,
    ) -> Result<bool> {
        check_embeds("num_embeds", num_embeds)?;
        if num_embeds > encoder_compute_budget {
            return Ok(false);
        }
        Ok(i128::from(num_embeds) + i128::from(num_embeds_to_schedule)
            <= i128::from(self.num_free_slots))
    }

    fn plan_free_slots(&self, delta: i128) -> Result<i64> {
        i64::try_from(i128::from(self.num_free_slots) + delta).map_err(|_| {
            Error::InvalidArgument(format!(
                "encoder budget: {} free slots {delta:+} leaves the int64 range",
                self.num_free_slots
            ))
        })
    }

    /// vLLM's `allocate`: takes `num_embeds` and records the identifier.
    pub fn allocate(&mut self, identifier: &str, num_embeds: i64) -> Result<()> {
        check_embeds("num_embeds", num_embeds)?;
        let free = self.plan_free_slots(-i128::from(num_embeds))?;
        self.num_free_slots = free;
        self.allocated.push(identifier.to_owned());
        Ok(())
    }

    /// vLLM's `free_encoder_input`: gives `num_embeds` back.
    pub fn free_encoder_input(&mut self, num_embeds: i64) -> Result<()> {
        self.free(&[num_embeds])
    }

    /// vLLM's `free`: gives back the embeddings of every input of the request.
    pub fn free(&mut self, num_embeds_per_input: &[i64]) -> Result<()> {
        let mut total = 0i128;
        for &n in num_embeds_per_input {
            check_embeds("num_embeds", n)?;
            total += i128::from(n);
        }
        self.num_free_slots = self.plan_free_slots(total)?;
        Ok(())
    }

    /// vLLM's `get_freed_mm_hashes`: the previous window's identifiers; the current
    /// window's become the next answer.
    pub fn get_freed_mm_hashes(&mut self) -> Vec<String> {
        std::mem::replace(&mut self.to_free, std::mem::take(&mut self.allocated))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn freed_identifiers_lag_one_window() {
        let mut m = EncoderDecoderCacheManager::new(20).unwrap();
        assert!(m.can_allocate(5, 100, 0).unwrap());
        assert!(!m.can_allocate(5, 4, 0).unwrap());
        assert!(!m.can_allocate(5, 100, 16).unwrap());
        m.allocate("a", 5).unwrap();
        m.allocate("b", 3).unwrap();
        assert_eq!(m.num_free_slots(), 12);
        assert!(m.get_freed_mm_hashes().is_empty());
        assert_eq!(m.to_free(), ["a", "b"]);
        m.allocate("c", 1).unwrap();
        assert_eq!(m.get_freed_mm_hashes(), ["a", "b"]);
        assert_eq!(m.get_freed_mm_hashes(), ["c"]);
        m.free(&[5, 3]).unwrap();
        m.free_encoder_input(1).unwrap();
        assert_eq!(m.num_free_slots(), 20);
        m.allocate("d", 8).unwrap();
        m.reset();
        assert_eq!((m.num_free_slots(), m.allocated().len()), (20, 0));
    }

    #[test]
    fn bad_counts_change_nothing() {
        let mut m = EncoderDecoderCacheManager::new(20).unwrap();
        let before = m.clone();
        assert_eq!(
            m.allocate("a", -1).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            m.free(&[1, -3]).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(m, before);
        assert!(EncoderDecoderCacheManager::new(-1).is_err());
    }
}
