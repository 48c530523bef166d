//! `schedule()`'s decisions for a steady decode step: which running requests are plain
//! decodes. See [`crate::step`]; the step's allocation is the manager's own
//! `allocate_slots` per request (`src/python/step_schedule.rs` drives it), so that every
//! layout the manager serves (sliding window and hybrids included) gets vLLM's exact
//! decisions and per-group block ids.
//!
//! Mirrors the per-request conditions of vLLM 0.33's `Scheduler.schedule()` running loop
//! under which it schedules exactly one decode token (and
//! `AsyncScheduler`'s placeholder rules), as `hscache.vllm.fast_step` applies them.
//!
//! Key properties:
//! - [`plain_decode`] is a pure function of one request's [`ScheduleFacts`] and the
//!   step's [`StepFacts`]; all arithmetic is signed (vLLM's Python integers), so no
//!   count underflows.
//! - `num_prompt_tokens` and `max_tokens` matter only for a request with output
//!   placeholders ([`ScheduleFacts::reads_length`]): the binding reads them only then.

use super::BrokenRules;

crate::step_rules! {
    /// The rules of `schedule()`'s per-request decision ([`plain_decode`]).
    pub enum ScheduleRule at 0 {
        /// Every running request has exactly one known token to compute (not a prefill
        /// chunk).
        PlainDecode = "plain_decode",
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
    /// Whether [`plain_decode`] reads `num_prompt_tokens` and `max_tokens` (the async
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
}

impl StepFacts {
    /// The most computed tokens a request may have and still be scheduled: a decode
    /// must leave room for the tokens the step samples.
    #[inline]
    fn room(&self) -> i64 {
        self.max_model_len - self.num_sampled_tokens_per_step
    }
}

/// Whether the running request `r` schedules exactly its one decode token this step.
///
/// Not a plain decode: output placeholders without async scheduling, a prefill chunk,
/// drafts, encoder inputs, structured output, a request not eligible this step, other
/// than exactly one token to compute (the placeholder's, with async scheduling), no
/// room left in `max_model_len` (a defensive check: a synchronous step without drafts
/// has stopped such a request), and with async scheduling a request whose in-flight
/// output is sure to reach `max_tokens` (vLLM skips it). `broken` breaks
/// [`ScheduleRule::PlainDecode`] (any prefill chunk and token count pass) and
/// [`ScheduleRule::AsyncLastStep`] (test-only mutants).
pub fn plain_decode(r: &ScheduleFacts, step: &StepFacts, broken: BrokenRules) -> bool {
    let placeholders = r.num_output_placeholders;
    let any_len = broken.breaks(ScheduleRule::PlainDecode);
    if (placeholders != 0 && !step.is_async)
        || (r.is_prefill_chunk && !any_len)
        || r.has_drafts
        || r.has_mm_features
        || r.structured_output
        || step.step < r.next_decode_eligible_step
        || (r.num_tokens + placeholders - r.num_computed_tokens != 1 && !any_len)
        || r.num_computed_tokens >= step.room()
    {
        return false;
    }
    !(placeholders != 0
        && !broken.breaks(ScheduleRule::AsyncLastStep)
        && r.num_computed_tokens + 2 - placeholders >= r.num_prompt_tokens + r.max_tokens)
}

#[cfg(test)]
mod tests {
    use super::{plain_decode, ScheduleFacts, ScheduleRule as Rule, StepFacts};
    use crate::step::BrokenRules;

    const NONE: BrokenRules = BrokenRules::NONE;

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

    fn sync_step() -> StepFacts {
        StepFacts {
            step: 7,
            is_async: false,
            max_model_len: 1000,
            num_sampled_tokens_per_step: 1,
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

    #[test]
    fn a_steady_decode_is_plain() {
        assert!(plain_decode(&decode(), &sync_step(), NONE));
        assert!(plain_decode(&async_decode(), &async_step(), NONE));
        // An async scheduler also serves a request without placeholders.
        assert!(plain_decode(&decode(), &async_step(), NONE));
    }

    #[test]
    fn placeholders_need_async_scheduling() {
        assert!(!plain_decode(&async_decode(), &sync_step(), NONE));
        assert!(!plain_decode(
            &async_decode(),
            &sync_step(),
            NONE.with(Rule::PlainDecode)
        ));
    }

    #[test]
    fn a_prefill_chunk_is_not_plain_unless_the_rule_is_broken() {
        let r = ScheduleFacts {
            is_prefill_chunk: true,
            ..decode()
        };
        assert!(!plain_decode(&r, &sync_step(), NONE));
        assert!(plain_decode(&r, &sync_step(), NONE.with(Rule::PlainDecode)));
    }

    #[test]
    fn drafts_encoder_inputs_and_grammar_are_not_plain() {
        for r in [
            ScheduleFacts {
                has_drafts: true,
                ..decode()
            },
            ScheduleFacts {
                has_mm_features: true,
                ..decode()
            },
            ScheduleFacts {
                structured_output: true,
                ..decode()
            },
        ] {
            assert!(!plain_decode(&r, &sync_step(), NONE));
            // Breaking the token-count rule does not let them through.
            assert!(!plain_decode(
                &r,
                &sync_step(),
                NONE.with(Rule::PlainDecode)
            ));
        }
    }

    #[test]
    fn a_request_not_yet_eligible_is_not_plain() {
        let r = ScheduleFacts {
            next_decode_eligible_step: 8,
            ..decode()
        };
        assert!(!plain_decode(&r, &sync_step(), NONE));
        let r = ScheduleFacts {
            next_decode_eligible_step: 7,
            ..decode()
        };
        assert!(plain_decode(&r, &sync_step(), NONE));
    }

    #[test]
    fn exactly_one_token_to_compute() {
        for computed in [12, 13, 15, 16] {
            let r = ScheduleFacts {
                num_computed_tokens: computed,
                ..decode()
            };
            assert!(!plain_decode(&r, &sync_step(), NONE), "{computed}");
            assert!(plain_decode(&r, &sync_step(), NONE.with(Rule::PlainDecode)));
        }
        // With async scheduling the placeholder is the token to compute: one more
        // placeholder than that is two tokens.
        let r = ScheduleFacts {
            num_output_placeholders: 2,
            ..async_decode()
        };
        assert!(!plain_decode(&r, &async_step(), NONE));
    }

    #[test]
    fn max_model_len_leaves_room_for_the_sampled_token() {
        let step = StepFacts {
            max_model_len: 15,
            ..sync_step()
        };
        assert!(!plain_decode(&decode(), &step, NONE));
        assert!(!plain_decode(
            &decode(),
            &step,
            NONE.with(Rule::PlainDecode)
        ));
        let step = StepFacts {
            max_model_len: 16,
            ..sync_step()
        };
        assert!(plain_decode(&decode(), &step, NONE));
        // Each sampled token of the step needs room.
        let step = StepFacts {
            max_model_len: 16,
            num_sampled_tokens_per_step: 2,
            ..sync_step()
        };
        assert!(!plain_decode(&decode(), &step, NONE));
    }

    #[test]
    fn async_last_step_is_left_to_vllm() {
        // computed + 2 - placeholders = 16 >= prompt + max_tokens: the in-flight output
        // reaches max_tokens.
        for max_tokens in [5, 6] {
            let r = ScheduleFacts {
                max_tokens,
                ..async_decode()
            };
            assert!(!plain_decode(&r, &async_step(), NONE), "{max_tokens}");
            assert!(plain_decode(
                &r,
                &async_step(),
                NONE.with(Rule::AsyncLastStep)
            ));
        }
        let r = ScheduleFacts {
            max_tokens: 7,
            ..async_decode()
        };
        assert!(plain_decode(&r, &async_step(), NONE));
        // Without placeholders the rule does not apply (nor are the lengths read).
        let r = ScheduleFacts {
            max_tokens: 0,
            ..decode()
        };
        assert!(!r.reads_length());
        assert!(plain_decode(&r, &async_step(), NONE));
        assert!(async_decode().reads_length());
    }

    #[test]
    fn counts_never_underflow() {
        let r = ScheduleFacts {
            num_computed_tokens: 0,
            num_tokens: 0,
            ..ScheduleFacts::default()
        };
        assert!(!plain_decode(&r, &sync_step(), NONE));
        let step = StepFacts {
            max_model_len: 0,
            num_sampled_tokens_per_step: 1,
            ..sync_step()
        };
        assert!(!plain_decode(&decode(), &step, NONE));
    }
}
