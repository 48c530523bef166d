//! The steady decode step: an `allocate_slots` call that vLLM's stages would turn
//! into nothing (free none, count 0 blocks, allocate none, cache none), decided
//! from the request's tables with one lookup so that the common decode step skips
//! the stages. The property tests run a manager with it and one without it side
//! by side ([`KVCacheManager::set_steady_decode`]) to show that both decide alike.

use super::{AllocateSlots, KVCacheManager, RequestLike, SteadyQuery};

impl KVCacheManager {
    /// Turns the steady decode step off (every `allocate_slots` call then runs vLLM's
    /// stages) or on (the default). Both decide alike; the property tests run a
    /// manager of each kind side by side to show it.
    pub fn set_steady_decode(&mut self, on: bool) {
        self.steady_decode = on;
    }

    /// How many `allocate_slots` calls the steady decode step decided.
    pub fn num_steady_steps(&self) -> u64 {
        self.num_steady_steps
    }

    /// The steady decode step, decided from the request's tables with one lookup: a
    /// request that adopts nothing, whose new and lookahead tokens fit in the
    /// blocks it holds, with no skipped block left to free and no block to cache,
    /// on groups whose calls have no other effect (full attention, sliding window,
    /// chunked local). vLLM's stages would free none, count 0 blocks, allocate none
    /// and cache none, so nothing changes and the call fits (unless the reservation
    /// exceeds the free blocks, or the watermark may apply: the general path decides
    /// those). `None`: take the general path.
    #[inline]
    pub(super) fn allocate_slots_in_place<R: RequestLike>(
        &self,
        request: &R,
        args: &AllocateSlots<'_>,
    ) -> Option<()> {
        let needs = self.coordinator.needs();
        let plain = needs.steady_decode
            && self.steady_decode
            && args.new_computed_blocks.is_none()
            && args.num_new_computed_tokens == 0
            && args.num_external_computed_tokens == 0
            && !args.full_sequence_must_fit
            && !(args.has_scheduled_reqs && self.config.watermark_blocks > 0)
            && args.reserved_blocks <= self.block_pool().get_num_free_blocks() as i64;
        if !plain {
            return None;
        }
        let max_len = self.config.max_model_len;
        let computed = request.num_computed_tokens();
        let total = computed.min(max_len);
        let main = total + args.num_new_tokens;
        let need_slot = (main + args.num_lookahead_tokens).min(max_len);
        let caching = !args.delay_cache_blocks && self.enable_caching();
        // What the groups that cache beyond full blocks need to know (the general
        // path caps the cached tokens at `num_tokens`).
        let (cache_tokens, num_prompt_tokens) = if caching && needs.steady_reads_prompt {
            (
                Some(main.min(request.num_tokens().ok()?)),
                request.num_prompt_tokens().ok()?,
            )
        } else {
            (caching.then_some(main), 0)
        };
        let (slot, state) = self.coordinator.request_with_slot(request.request_id())?;
        // Every group's skip rule frees more the more tokens were processed, so a call
        // that frees nothing with all `total` tokens processed frees nothing with fewer:
        // `num_in_flight_tokens` is read only when that first check fails.
        let mut q = SteadyQuery {
            num_tokens: need_slot,
            num_tokens_main_model: main,
            num_computed_tokens: computed,
            processed_computed_tokens: if needs.in_flight_for_skip { total } else { 0 },
            cacheable_tokens: None,
            num_prompt_tokens,
        };
        if !self.coordinator.is_steady(slot, state, &q, cache_tokens) {
            if !needs.in_flight_for_skip {
                return None;
            }
            let in_flight = request.num_in_flight_tokens().ok()?;
            if in_flight == 0 {
                return None;
            }
            q.processed_computed_tokens = total.saturating_sub(in_flight);
            if !self.coordinator.is_steady(slot, state, &q, cache_tokens) {
                return None;
            }
        }
        if caching && self.may_cache_full_block(Some(state), main, None) {
            return None;
        }
        Some(())
    }
}
