//! `schedule()`'s decisions for the running requests of a step: how many tokens each
//! schedules (a decode its one token, a request still prefilling its chunk). See
//! [`crate::step`]; the step's allocation is the manager's own `allocate_slots` per
//! request (`src/python/step_schedule.rs` drives it), so that every layout the manager
//! serves (sliding window and hybrids included) gets vLLM's exact decisions and
//! per-group block ids.
//!
//! Mirrors the per-request part of vLLM 0.33's `Scheduler.schedule()` running loop (and
//! `AsyncScheduler`'s placeholder rules), as `hscache.vllm.step.schedule` applies them:
//! `num_new_tokens = num_tokens_with_spec + num_output_placeholders -
//! num_computed_tokens`, capped by `long_prefill_token_threshold` (the step's effective
//! value, which the glue computes per version), the token budget left (the smaller of the
//! token and the input budget: without drafts both shrink alike) and the room
//! `max_model_len` leaves for the sampled token. Where vLLM's loop skips a request
//! (`continue`: async scheduling's last step, no token to schedule) the rule answers 0;
//! where it would do what the fast path does not serve, None, and the whole step is
//! vLLM's.
//!
//! Key properties:
//! - [`num_new_tokens`] is a pure function of one request's [`ScheduleFacts`], the
//!   step's [`StepFacts`] and the budget left; all arithmetic is signed (vLLM's Python
//!   integers), so no count underflows, and an answer is always in `0..=budget`, 0
//!   where vLLM's loop skips the request (`continue`) and goes on with the next.
//! - [`defers_prefills`] is the step-level rule: a step that defers prefill chunks (the
//!   DP throttle or the local cadence, with a decode running) skips them, which the
//!   fast path leaves to vLLM.
//! - `num_prompt_tokens` and `max_tokens` matter only for a request with output
//!   placeholders ([`ScheduleFacts::reads_length`]): the binding reads them only then.

use super::BrokenRules;

crate::step_rules! {
    /// The rules of `schedule()`'s per-request decision ([`num_new_tokens`]).
    pub enum ScheduleRule at 0 {
        /// A request schedules every token it has left to compute (a decode its one
        /// token, a prefill the rest of its prompt), before the caps.
        ChunkTokens = "chunk_tokens",
        /// A chunk is capped at the step's `long_prefill_token_threshold`.
        LongPrefill = "long_prefill",
        /// A request is capped at the token budget left, spent in running order.
        TokenBudget = "token_budget",
        /// Async: a request sure to reach `max_tokens` is not scheduled again.
        AsyncLastStep = "async_last_step",
    }
}

/// What the rule reads of one running request (vLLM's `Request` fields).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScheduleFacts {
    /// `num_computed_tokens`.
    pub num_computed_tokens: i64,
    /// `len(_all_token_ids)` (`num_tokens`).
    pub num_tokens: i64,
    /// `num_output_placeholders` (async scheduling's in-flight outputs).
    pub num_output_placeholders: i64,
    /// `num_prompt_tokens` (read only when [`Self::reads_length`]).
    pub num_prompt_tokens: i64,
    /// `max_tokens` (read only when [`Self::reads_length`]).
    pub max_tokens: i64,
    /// `next_decode_eligible_step`.
    pub next_decode_eligible_step: i64,
    /// `is_prefill_chunk`.
    pub is_prefill_chunk: bool,
    /// `spec_token_ids` is not empty.
    pub has_drafts: bool,
    /// `mm_features` is not empty.
    pub has_mm_features: bool,
    /// `structured_output_request is not None`.
    pub structured_output: bool,
}

impl ScheduleFacts {
    /// Whether [`num_new_tokens`] reads `num_prompt_tokens` and `max_tokens` (the async
    /// last-step rule, for a request with output placeholders).
    #[inline]
    pub fn reads_length(&self) -> bool {
        self.num_output_placeholders != 0
    }
}

/// What the rule reads of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepFacts {
    /// The step being scheduled (`current_step + 1`).
    pub step: i64,
    /// The scheduler is an `AsyncScheduler` (output placeholders are expected).
    pub is_async: bool,
    /// `max_model_len`.
    pub max_model_len: i64,
    /// `num_sampled_tokens_per_step` (1 without speculative decoding).
    pub num_sampled_tokens_per_step: i64,
    /// The step's effective `long_prefill_token_threshold` (0: none), as the version
    /// computes it at the top of `schedule()`.
    pub long_prefill_token_threshold: i64,
}

impl StepFacts {
    /// The most tokens a request with `computed` computed tokens may schedule: the
    /// step must leave room in `max_model_len` for the tokens it samples.
    #[inline]
    fn room(&self, computed: i64) -> i64 {
        self.max_model_len - computed - self.num_sampled_tokens_per_step
    }
}

/// The tokens vLLM's running loop schedules for the running request `r` with `budget`
/// tokens left (`budget > 0`: vLLM's loop stops before a request otherwise): `Some(0)`
/// where the loop skips it (`continue`), or None where the fast path does not serve
/// the step.
///
/// Skipped (`Some(0)`), as vLLM's loop skips them: with async scheduling a request
/// whose in-flight output is sure to reach `max_tokens` (checked first, as vLLM does),
/// and a request left with no token to schedule (nothing left to compute, or no room
/// left in `max_model_len`).
///
/// None: output placeholders without async scheduling, drafts, encoder inputs,
/// structured output, a request not eligible this step, a prefill chunk with output
/// placeholders (a resumed async request), and a count vLLM would compute as negative.
/// Otherwise the tokens left to compute, capped by the threshold, the budget and the
/// room, in vLLM's order. `broken` breaks the [`ScheduleRule`]s (test-only mutants).
pub fn num_new_tokens(
    r: &ScheduleFacts,
    step: &StepFacts,
    budget: i64,
    broken: BrokenRules,
) -> Option<i64> {
    let placeholders = r.num_output_placeholders;
    if (placeholders != 0 && !step.is_async)
        || r.has_drafts
        || r.has_mm_features
        || r.structured_output
        || step.step < r.next_decode_eligible_step
        || budget <= 0
    {
        return None;
    }
    if placeholders != 0
        && !broken.breaks(ScheduleRule::AsyncLastStep)
        && r.num_computed_tokens + 2 - placeholders >= r.num_prompt_tokens + r.max_tokens
    {
        return Some(0);
    }
    let left = r.num_tokens + placeholders - r.num_computed_tokens;
    if left > 1 && placeholders != 0 {
        return None;
    }
    let mut n = if broken.breaks(ScheduleRule::ChunkTokens) {
        1
    } else {
        left
    };
    let threshold = step.long_prefill_token_threshold;
    if 0 < threshold && threshold < n && !broken.breaks(ScheduleRule::LongPrefill) {
        n = threshold;
    }
    if !broken.breaks(ScheduleRule::TokenBudget) {
        n = n.min(budget);
    }
    n = n.min(step.room(r.num_computed_tokens));
    (n >= 0).then_some(n)
}

/// Whether the step defers prefill chunks, which vLLM's loop then skips (left to vLLM):
/// `throttle` (the DP throttle without a capacity bound, or the local prefill cadence's
/// hold) with any running request that is not a prefill chunk (`any_decode`).
#[inline]
pub fn defers_prefills(throttle: bool, any_decode: bool) -> bool {
    throttle && any_decode
}

#[cfg(test)]
mod tests {
    use super::{defers_prefills, num_new_tokens, ScheduleFacts, ScheduleRule as Rule, StepFacts};
    use crate::step::BrokenRules;

    const NONE: BrokenRules = BrokenRules::NONE;
    const BUDGET: i64 = 256;

    /// A synchronous decode: 10 prompt + 5 output tokens, 14 computed.
    fn decode() -> ScheduleFacts {
        ScheduleFacts {
            num_computed_tokens: 14,
            num_tokens: 15,
            num_prompt_tokens: 10,
            max_tokens: 100,
            ..ScheduleFacts::default()
        }
    }

    /// A prompt of 100 tokens, 20 computed.
    fn chunk() -> ScheduleFacts {
        ScheduleFacts {
            num_computed_tokens: 20,
            num_tokens: 100,
            num_prompt_tokens: 100,
            max_tokens: 50,
            is_prefill_chunk: true,
            ..ScheduleFacts::default()
        }
    }

    fn sync_step() -> StepFacts {
        StepFacts {
            step: 7,
            is_async: false,
            max_model_len: 1000,
            num_sampled_tokens_per_step: 1,
            long_prefill_token_threshold: 0,
        }
    }

    fn async_step() -> StepFacts {
        StepFacts {
            is_async: true,
            ..sync_step()
        }
    }

    /// An async decode: 15 tokens known, 15 computed, one output in flight.
    fn async_decode() -> ScheduleFacts {
        ScheduleFacts {
            num_computed_tokens: 15,
            num_output_placeholders: 1,
            ..decode()
        }
    }

    fn n(r: &ScheduleFacts, step: &StepFacts) -> Option<i64> {
        num_new_tokens(r, step, BUDGET, NONE)
    }

    #[test]
    fn a_steady_decode_schedules_one_token() {
        assert_eq!(n(&decode(), &sync_step()), Some(1));
        assert_eq!(n(&async_decode(), &async_step()), Some(1));
        // An async scheduler also serves a request without placeholders.
        assert_eq!(n(&decode(), &async_step()), Some(1));
    }

    #[test]
    fn placeholders_need_async_scheduling() {
        assert_eq!(n(&async_decode(), &sync_step()), None);
    }

    #[test]
    fn a_chunk_schedules_the_rest_of_its_prompt_under_the_caps() {
        assert_eq!(n(&chunk(), &sync_step()), Some(80));
        assert_eq!(n(&chunk(), &async_step()), Some(80));
        // The threshold, then the budget, then the room.
        let thr = StepFacts {
            long_prefill_token_threshold: 32,
            ..sync_step()
        };
        assert_eq!(n(&chunk(), &thr), Some(32));
        assert_eq!(num_new_tokens(&chunk(), &thr, 10, NONE), Some(10));
        assert_eq!(num_new_tokens(&chunk(), &sync_step(), 50, NONE), Some(50));
        let thr_above = StepFacts {
            long_prefill_token_threshold: 80,
            ..sync_step()
        };
        assert_eq!(n(&chunk(), &thr_above), Some(80));
        let room = StepFacts {
            max_model_len: 61,
            ..sync_step()
        };
        assert_eq!(n(&chunk(), &room), Some(40));
        // A decode is never capped by a threshold of 1 or more.
        let one = StepFacts {
            long_prefill_token_threshold: 1,
            ..sync_step()
        };
        assert_eq!(n(&decode(), &one), Some(1));
        assert_eq!(n(&chunk(), &one), Some(1));
        // The last prompt token of a chunked prompt is one token.
        let last = ScheduleFacts {
            num_computed_tokens: 99,
            ..chunk()
        };
        assert_eq!(n(&last, &sync_step()), Some(1));
    }

    #[test]
    fn each_mutant_changes_its_answer() {
        let thr = StepFacts {
            long_prefill_token_threshold: 32,
            ..sync_step()
        };
        assert_eq!(
            num_new_tokens(&chunk(), &thr, BUDGET, NONE.with(Rule::ChunkTokens)),
            Some(1)
        );
        assert_eq!(
            num_new_tokens(&chunk(), &thr, BUDGET, NONE.with(Rule::LongPrefill)),
            Some(80)
        );
        assert_eq!(
            num_new_tokens(&chunk(), &thr, 10, NONE.with(Rule::TokenBudget)),
            Some(32)
        );
    }

    #[test]
    fn a_chunk_with_placeholders_is_left_to_vllm() {
        let r = ScheduleFacts {
            num_output_placeholders: 1,
            ..chunk()
        };
        assert_eq!(n(&r, &async_step()), None);
    }

    #[test]
    fn drafts_encoder_inputs_and_grammar_are_left_to_vllm() {
        for base in [decode(), chunk()] {
            for r in [
                ScheduleFacts {
                    has_drafts: true,
                    ..base
                },
                ScheduleFacts {
                    has_mm_features: true,
                    ..base
                },
                ScheduleFacts {
                    structured_output: true,
                    ..base
                },
            ] {
                assert_eq!(n(&r, &sync_step()), None);
                assert_eq!(
                    num_new_tokens(&r, &sync_step(), BUDGET, NONE.with(Rule::ChunkTokens)),
                    None
                );
            }
        }
    }

    #[test]
    fn a_request_not_yet_eligible_is_left_to_vllm() {
        let r = ScheduleFacts {
            next_decode_eligible_step: 8,
            ..decode()
        };
        assert_eq!(n(&r, &sync_step()), None);
        let r = ScheduleFacts {
            next_decode_eligible_step: 7,
            ..decode()
        };
        assert_eq!(n(&r, &sync_step()), Some(1));
    }

    #[test]
    fn nothing_left_is_skipped_and_no_budget_left_to_vllm() {
        // Nothing left: vLLM's loop skips the request; more computed than known is a
        // count vLLM would compute as negative.
        for (computed, answer) in [(15, Some(0)), (16, None)] {
            let r = ScheduleFacts {
                num_computed_tokens: computed,
                ..decode()
            };
            assert_eq!(n(&r, &sync_step()), answer, "{computed}");
        }
        assert_eq!(num_new_tokens(&decode(), &sync_step(), 0, NONE), None);
        assert_eq!(num_new_tokens(&decode(), &sync_step(), -1, NONE), None);
        // Two tokens left (not a prompt): scheduled as vLLM does.
        let r = ScheduleFacts {
            num_computed_tokens: 13,
            ..decode()
        };
        assert_eq!(n(&r, &sync_step()), Some(2));
        // With async scheduling one more placeholder than that is two tokens in flight.
        let r = ScheduleFacts {
            num_output_placeholders: 2,
            ..async_decode()
        };
        assert_eq!(n(&r, &async_step()), None);
    }

    #[test]
    fn max_model_len_leaves_room_for_the_sampled_token() {
        // No room: vLLM's loop skips the request; less than none: left to vLLM.
        let step = StepFacts {
            max_model_len: 15,
            ..sync_step()
        };
        assert_eq!(n(&decode(), &step), Some(0));
        let step = StepFacts {
            max_model_len: 14,
            ..sync_step()
        };
        assert_eq!(n(&decode(), &step), None);
        let step = StepFacts {
            max_model_len: 16,
            ..sync_step()
        };
        assert_eq!(n(&decode(), &step), Some(1));
        // Each sampled token of the step needs room.
        let step = StepFacts {
            max_model_len: 16,
            num_sampled_tokens_per_step: 2,
            ..sync_step()
        };
        assert_eq!(n(&decode(), &step), Some(0));
    }

    #[test]
    fn async_last_step_is_skipped() {
        // computed + 2 - placeholders = 16 >= prompt + max_tokens: the in-flight output
        // reaches max_tokens.
        for max_tokens in [5, 6] {
            let r = ScheduleFacts {
                max_tokens,
                ..async_decode()
            };
            assert_eq!(n(&r, &async_step()), Some(0), "{max_tokens}");
            assert_eq!(
                num_new_tokens(&r, &async_step(), BUDGET, NONE.with(Rule::AsyncLastStep)),
                Some(1)
            );
        }
        let r = ScheduleFacts {
            max_tokens: 7,
            ..async_decode()
        };
        assert_eq!(n(&r, &async_step()), Some(1));
        // Without placeholders the rule does not apply (nor are the lengths read).
        let r = ScheduleFacts {
            max_tokens: 0,
            ..decode()
        };
        assert!(!r.reads_length());
        assert_eq!(n(&r, &async_step()), Some(1));
        assert!(async_decode().reads_length());
    }

    #[test]
    fn prefills_are_deferred_only_beside_a_decode() {
        assert!(defers_prefills(true, true));
        assert!(!defers_prefills(true, false));
        assert!(!defers_prefills(false, true));
    }

    #[test]
    fn counts_never_underflow() {
        let r = ScheduleFacts {
            num_computed_tokens: 0,
            num_tokens: 0,
            ..ScheduleFacts::default()
        };
        // Nothing to compute: skipped, as vLLM's loop does.
        assert_eq!(n(&r, &sync_step()), Some(0));
        let step = StepFacts {
            max_model_len: 0,
            ..sync_step()
        };
        assert_eq!(n(&decode(), &step), None);
        let huge = ScheduleFacts {
            num_tokens: i64::MAX / 2,
            ..chunk()
        };
        assert_eq!(
            num_new_tokens(&huge, &sync_step(), BUDGET, NONE),
            Some(BUDGET)
        );
    }
}
