//! The steady decode step's decisions (`hscache.vllm.fast_step`, `docs/fast_step.md`).
//!
//! vLLM's `Scheduler.schedule()` and `update_from_output()` spend most of a steady decode
//! step deciding nothing. The fast path serves those steps; this module holds its rules as
//! pure functions over per-request facts, so that the binding (`src/python/step_*.rs`)
//! only reads a `Request`'s fields, calls them and writes back what vLLM's code would:
//!
//! - [`schedule`]: whether a running request is a plain decode this step (the step's
//!   allocation is the manager's `allocate_slots` per request, driven by the binding).
//! - [`update`]: whether a sampled token certainly does not stop a request (the negation
//!   of vLLM's `check_stop` for one token), and which requests need nothing but the token
//!   appended.
//!
//! [`BrokenRules`] is the test-only set of mutants (`hscache.vllm.fast_step.BROKEN_RULES`)
//! that the differential must catch; production passes the empty set.

pub mod schedule;
pub mod update;

/// A fast-path rule, named as in `hscache.vllm.fast_step.RULES` (same order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Rule {
    /// A step with waiting requests is not served.
    Waiting,
    /// Every running request has exactly one known token to compute.
    PlainDecode,
    /// The token budget does not bind.
    Budget,
    /// Pool pressure preempts from the tail (vLLM's FCFS rule).
    Preempt,
    /// Requests not scheduled last step carry their tokens (MRV1).
    AllTokenIds,
    /// The step records whether admissions were capacity-bound.
    CapacityBound,
    /// Scheduling counts the token in flight.
    InFlight,
    /// A sampled EOS stops the request: vLLM's code serves it.
    StopEos,
    /// A sampled stop token id stops the request.
    StopTokenIds,
    /// `max_tokens` / `max_model_len` stop the request.
    StopLength,
    /// Repetition detection is vLLM's to decide.
    Repetition,
    /// A request asking for logprobs is vLLM's to serve.
    Logprobs,
    /// Async: scheduling adds the token's output placeholder.
    OutputPlaceholders,
    /// Async: a request sure to reach `max_tokens` is not scheduled again.
    AsyncLastStep,
    /// Async: a sampled token resolves its output placeholder.
    ResolvePlaceholder,
}

impl Rule {
    /// Every rule, in `fast_step.RULES` order.
    pub const ALL: [Rule; 15] = [
        Rule::Waiting,
        Rule::PlainDecode,
        Rule::Budget,
        Rule::Preempt,
        Rule::AllTokenIds,
        Rule::CapacityBound,
        Rule::InFlight,
        Rule::StopEos,
        Rule::StopTokenIds,
        Rule::StopLength,
        Rule::Repetition,
        Rule::Logprobs,
        Rule::OutputPlaceholders,
        Rule::AsyncLastStep,
        Rule::ResolvePlaceholder,
    ];

    /// The rule's name in `fast_step.RULES`.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Waiting => "waiting",
            Rule::PlainDecode => "plain_decode",
            Rule::Budget => "budget",
            Rule::Preempt => "preempt",
            Rule::AllTokenIds => "all_token_ids",
            Rule::CapacityBound => "capacity_bound",
            Rule::InFlight => "in_flight",
            Rule::StopEos => "stop_eos",
            Rule::StopTokenIds => "stop_token_ids",
            Rule::StopLength => "stop_length",
            Rule::Repetition => "repetition",
            Rule::Logprobs => "logprobs",
            Rule::OutputPlaceholders => "output_placeholders",
            Rule::AsyncLastStep => "async_last_step",
            Rule::ResolvePlaceholder => "resolve_placeholder",
        }
    }

    /// The rule named `name`, if any.
    pub fn from_name(name: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|r| r.name() == name)
    }
}

/// The rules a test-only mutant breaks (empty in production).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BrokenRules(u32);

impl BrokenRules {
    /// No rule broken.
    pub const NONE: BrokenRules = BrokenRules(0);

    /// The set with `rule` added.
    #[must_use]
    pub fn with(self, rule: Rule) -> BrokenRules {
        BrokenRules(self.0 | (1 << rule as u8))
    }

    /// Whether `rule` is broken.
    #[inline]
    pub fn breaks(self, rule: Rule) -> bool {
        self.0 & (1 << rule as u8) != 0
    }

    /// Whether every rule holds.
    #[inline]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::{BrokenRules, Rule};

    #[test]
    fn names_round_trip_and_masks_are_per_rule() {
        for rule in Rule::ALL {
            assert_eq!(Rule::from_name(rule.name()), Some(rule));
            let broken = BrokenRules::NONE.with(rule);
            for other in Rule::ALL {
                assert_eq!(broken.breaks(other), other == rule);
            }
        }
        assert_eq!(Rule::from_name("nope"), None);
    }
}
