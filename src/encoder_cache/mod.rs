//! The multimodal encoder-output cache bookkeeping, vLLM 0.33's
//! `v1/core/encoder_cache_manager.py`.
//!
//! - [`manager`]: `EncoderCacheManager`, the shared, LRU-evicting cache of decoder-only
//!   multimodal models (entries keyed by the item's identifier).
//! - [`encoder_decoder`]: `EncoderDecoderCacheManager`, the scheduling-only budget of
//!   encoder-decoder models (no sharing, freed one step after allocation).
//! - [`input_ids`]: a request's cached input ids in CPython `set` iteration order,
//!   which decides vLLM's free order.
//! - `views`: read-only views of vLLM's dicts over the manager (cold paths).
//! - [`compute_mm_encoder_budget`]: the compute and cache budgets.
//!
//! The unit everywhere is one encoder **embedding**. Only bookkeeping lives here: the
//! embeddings themselves are stored by the model runner, which learns what to drop
//! from `get_freed_mm_hashes`. Identifiers and request ids live in
//! [`crate::request_table::RequestTable`]s and are released as soon as nothing refers
//! to them.

pub mod encoder_decoder;
pub mod input_ids;
pub mod manager;
mod views;

use crate::error::{Error, Result};

pub use encoder_decoder::EncoderDecoderCacheManager;
pub use input_ids::{InputIdOp, MAX_INPUT_ID};
pub use manager::{CachedEntry, EncoderCacheManager};

/// Largest accepted embedding count or cache size (keeps all counter arithmetic
/// far from `i64` overflow).
pub const MAX_EMBEDS: i64 = 1 << 40;

pub(crate) fn check_embeds(what: &str, n: i64) -> Result<()> {
    if (0..=MAX_EMBEDS).contains(&n) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what} must be in 0..={MAX_EMBEDS}, got {n}"
        )))
    }
}

/// vLLM's `compute_mm_encoder_budget`: `(encoder_compute_budget,
/// encoder_cache_size)` in embeddings, both at least the largest item; `(0, 0)`
/// when the model accepts no multimodal item (the caller logs vLLM's warning).
///
/// Why at least the largest item: `can_allocate` fails for an item larger than the
/// whole cache however much is evicted, so such an item could never be scheduled and
/// its request would wait forever (vLLM PR #11895).
///
/// Fails when chunked multimodal input is disabled and the largest item does not
/// fit one step's `max_num_batched_tokens`.
pub fn compute_mm_encoder_budget(
    max_num_encoder_input_tokens: i64,
    encoder_cache_size: i64,
    max_num_batched_tokens: i64,
    disable_chunked_mm_input: bool,
    mm_max_toks_per_item: &[i64],
) -> Result<(i64, i64)> {
    let Some(&max_item) = mm_max_toks_per_item.iter().max() else {
        return Ok((0, 0));
    };
    if disable_chunked_mm_input && max_item > max_num_batched_tokens {
        return Err(Error::InvalidArgument(format!(
            "Chunked MM input disabled but max_tokens_per_mm_item ({max_item}) is larger \
             than max_num_batched_tokens ({max_num_batched_tokens}). Please increase \
             max_num_batched_tokens."
        )));
    }
    Ok((
        max_num_encoder_input_tokens.max(max_item),
        encoder_cache_size.max(max_item),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn budget_is_at_least_the_largest_item() {
        assert_eq!(
            compute_mm_encoder_budget(100, 200, 8192, false, &[]).unwrap(),
            (0, 0)
        );
        assert_eq!(
            compute_mm_encoder_budget(100, 200, 8192, false, &[50, 300]).unwrap(),
            (300, 300)
        );
        assert_eq!(
            compute_mm_encoder_budget(1000, 2000, 8192, true, &[50, 300]).unwrap(),
            (1000, 2000)
        );
        let e = compute_mm_encoder_budget(100, 200, 256, true, &[300]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
}
