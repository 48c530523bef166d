//! `update_from_output()`'s decisions for a steady decode step: which requests' sampled
//! tokens need nothing but appending, and what appending them writes. See [`crate::step`].
//!
//! Mirrors the per-request part of vLLM 0.33's `Scheduler.update_from_output`
//! (`vllm/v1/core/sched/scheduler.py`) and `check_stop` (`vllm/v1/core/sched/utils.py`) for
//! a request that samples one token and goes on running; 0.32 and 0.30 differ only in
//! where the async placeholder's `cache_blocks` point is read ([`CacheBlocksAt`]).
//!
//! Key properties:
//! - [`certainly_continues`] is never `true` where `check_stop` could stop the request:
//!   it is the negation of `check_stop` for one token, and `false` where only vLLM's code
//!   can tell (repetition detection past `min_tokens`, no sampling params).
//! - [`needs_only_append`] is `true` only for a request whose `update_from_output` does
//!   nothing but append the token, count it out of flight (async: resolve its
//!   placeholder and cache its blocks) and emit one `EngineCoreOutput` without logprobs.
//! - [`StepSplit`] keeps the step-level rules: every request of a served step belongs to
//!   client 0 ([`admits_client`]), and with async scheduling only the steady requests
//!   before the first one vLLM serves are taken, so that the manager's `cache_blocks`
//!   calls come in vLLM's order.
//! - [`plan_append`] computes every write before any is made; it fails (nothing
//!   written) where a count would leave `i64`.

use super::BrokenRules;

crate::step_rules! {
    /// The rules of `update_from_output()`'s per-request decision ([`is_steady`],
    /// [`plan_append`]).
    pub enum UpdateRule at 16 {
        /// A sampled EOS stops the request: vLLM's code serves it.
        StopEos = "stop_eos",
        /// A sampled stop token id stops the request.
        StopTokenIds = "stop_token_ids",
        /// `max_tokens` / `max_model_len` stop the request.
        StopLength = "stop_length",
        /// Repetition detection is vLLM's to decide.
        Repetition = "repetition",
        /// A request asking for logprobs is vLLM's to serve.
        Logprobs = "logprobs",
        /// Async: a sampled token resolves its output placeholder.
        ResolvePlaceholder = "resolve_placeholder",
    }
}
use crate::error::{Error, Result};

/// What vLLM's `check_stop` reads for one sampled token: the request's sampling
/// parameters and token counts before the token is appended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopFacts<'a> {
    /// `sampling_params.eos_token_id` (`None`: no EOS, or `ignore_eos`).
    pub eos_token_id: Option<i64>,
    /// `sampling_params.stop_token_ids`.
    pub stop_token_ids: &'a [i64],
    /// `request.max_tokens`.
    pub max_tokens: i64,
    /// `sampling_params.min_tokens`.
    pub min_tokens: i64,
    /// `sampling_params.repetition_detection is not None`.
    pub repetition_detection: bool,
    /// `len(request._all_token_ids)`.
    pub num_tokens: i64,
    /// `len(request._output_token_ids)`.
    pub num_output_tokens: i64,
}

/// Whether vLLM's `check_stop` certainly returns `False` once `token` is appended
/// (`false` when it would stop the request, or when only vLLM's code can tell).
///
/// The order is `check_stop`'s: EOS, stop token ids, length (`max_model_len`,
/// `max_tokens`), then `min_tokens` (below it nothing else stops the request) and
/// repetition detection (vLLM's to decide).
pub fn certainly_continues(
    stop: &StopFacts<'_>,
    token: i64,
    max_model_len: i64,
    broken: BrokenRules,
) -> bool {
    if stop.eos_token_id == Some(token) && !broken.breaks(UpdateRule::StopEos) {
        return false;
    }
    if stop.stop_token_ids.contains(&token) {
        return broken.breaks(UpdateRule::StopTokenIds);
    }
    let num_tokens = stop.num_tokens.saturating_add(1);
    let num_output_tokens = stop.num_output_tokens.saturating_add(1);
    if !broken.breaks(UpdateRule::StopLength)
        && (num_tokens >= max_model_len || num_output_tokens >= stop.max_tokens)
    {
        return false;
    }
    if num_output_tokens < stop.min_tokens {
        return true;
    }
    !stop.repetition_detection || broken.breaks(UpdateRule::Repetition)
}

/// What `update_from_output` reads of one scheduled request, besides its stop facts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpdateFacts {
    /// The request's entry in `SchedulerOutput.num_scheduled_tokens`.
    pub num_scheduled_tokens: i64,
    /// How many tokens it sampled (`len(sampled_token_ids[i])`).
    pub num_sampled_tokens: usize,
    /// `request.status == RequestStatus.RUNNING`.
    pub running: bool,
    /// `request.num_stale_output_tokens != 0`.
    pub stale_output: bool,
    /// `request.num_output_placeholders`.
    pub num_output_placeholders: i64,
    /// `request.mm_features` is non-empty (encoder inputs).
    pub mm_features: bool,
    /// `request.structured_output_request is not None` (a grammar to advance).
    pub structured_output: bool,
    /// `request.pooling_params is not None`.
    pub pooling: bool,
    /// `request.prefill_stats is not None`.
    pub prefill_stats: bool,
    /// The step scheduled draft tokens for it.
    pub drafts: bool,
    /// `sampling_params.num_logprobs is not None` (it asks for sampled logprobs).
    pub num_logprobs: bool,
    /// The step has prompt logprobs for it (either dict of the runner output).
    pub prompt_logprobs: bool,
}

/// What is the same for every request of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpdateStep {
    /// An `AsyncScheduler` (output placeholders, the prefix-only rule).
    pub is_async: bool,
    /// The runner output carries sampled logprobs (`output.logprobs is not None`).
    pub has_logprobs: bool,
    /// `scheduler.max_model_len`.
    pub max_model_len: i64,
    /// Where the async `cache_blocks` point is read.
    pub cache_blocks_at: CacheBlocksAt,
    /// Test-only mutants.
    pub broken: BrokenRules,
}

/// Whether the request's `update_from_output` needs nothing but the token appended:
/// one scheduled and one sampled token, running, and none of what vLLM's loop serves
/// (stale output, synchronous placeholders, encoder inputs, a grammar, pooling,
/// prefill stats, drafts, logprobs, prompt logprobs). The stop check is apart:
/// [`certainly_continues`].
pub fn needs_only_append(facts: &UpdateFacts, step: &UpdateStep) -> bool {
    facts.num_scheduled_tokens == 1
        && facts.num_sampled_tokens == 1
        && facts.running
        && !facts.stale_output
        && (step.is_async || facts.num_output_placeholders == 0)
        && !facts.mm_features
        && !facts.structured_output
        && !facts.pooling
        && !facts.prefill_stats
        && !facts.drafts
        && !(step.has_logprobs && facts.num_logprobs && !step.broken.breaks(UpdateRule::Logprobs))
        && !facts.prompt_logprobs
}

/// Whether the request is steady: its token needs nothing but appending and
/// certainly does not stop it. `stop` reads its stop facts (`None` without sampling
/// params), only for a request that needs nothing but the append.
pub fn is_steady<'s, E>(
    facts: &UpdateFacts,
    token: i64,
    step: &UpdateStep,
    stop: impl FnOnce() -> std::result::Result<Option<StopFacts<'s>>, E>,
) -> std::result::Result<bool, E> {
    if !needs_only_append(facts, step) {
        return Ok(false);
    }
    Ok(stop()?.is_some_and(|s| certainly_continues(&s, token, step.max_model_len, step.broken)))
}

/// The client rule: vLLM attaches the step's stats and finished ids to the clients in
/// the order they first appear, so only a step whose requests all belong to client 0
/// keeps vLLM's output when some of them are taken out.
pub fn admits_client(client_index: i64) -> bool {
    client_index == 0
}

/// Where a resolved placeholder's `cache_blocks` call caches up to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheBlocksAt {
    /// `num_computed_tokens - num_in_flight_tokens` (vLLM 0.33's `update_from_output`).
    InFlight,
    /// `num_computed_tokens - num_output_placeholders` (0.32 / 0.30's
    /// `AsyncScheduler._update_request_with_output`).
    Placeholders,
}

/// How one request of the step is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// The fast path appends its token.
    Steady,
    /// vLLM's `update_from_output` serves it.
    Rest,
    /// The step is not served at all (nothing may change).
    NotServed,
}

/// The step-level split of `update_from_output`, fed the requests in
/// `num_scheduled_tokens` order.
#[derive(Clone, Copy, Debug)]
pub struct StepSplit {
    prefix_only: bool,
    ended: bool,
    steady: usize,
}

impl StepSplit {
    /// A new split; `is_async` takes only the steady prefix.
    pub fn new(is_async: bool) -> Self {
        Self {
            prefix_only: is_async,
            ended: false,
            steady: 0,
        }
    }

    /// Whether the next known request can still be steady (else only its client
    /// matters: it is vLLM's).
    pub fn open(&self) -> bool {
        !self.ended
    }

    /// A request of the step known to the scheduler, of client `client_index`;
    /// `steady` is its verdict ([`is_steady`]), unused once the split is closed.
    pub fn take(&mut self, client_index: i64, steady: bool) -> Take {
        if !admits_client(client_index) {
            return Take::NotServed;
        }
        if self.ended {
            return Take::Rest;
        }
        if steady {
            self.steady += 1;
            return Take::Steady;
        }
        if self.prefix_only {
            // Async: after the first request vLLM serves, every request is vLLM's,
            // so that the manager's cache_blocks calls come in vLLM's order. (Not a
            // mutant rule: the next schedule()'s allocate_slots has already cached what
            // those calls could, so no differential sees their order.)
            if self.steady == 0 {
                return Take::NotServed;
            }
            self.ended = true;
        }
        Take::Rest
    }

    /// Whether the step is served: at least one request is steady.
    pub fn served(&self) -> bool {
        self.steady > 0
    }
}

/// The writes of a steady request's `update_from_output`, in vLLM's order: the token
/// out of flight, the token appended (the binding extends the block hashes), then with
/// a placeholder, the placeholder resolved and the request's blocks cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendPlan {
    /// The new `num_in_flight_tokens`.
    pub num_in_flight_tokens: i64,
    /// With an output placeholder: the new `num_output_placeholders` and the
    /// `num_computed_tokens` argument of the `cache_blocks` call that follows.
    pub resolve: Option<(i64, i64)>,
}

/// The counts a steady request's writes start from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendCounts {
    /// `request.num_in_flight_tokens`.
    pub num_in_flight_tokens: i64,
    /// `request.num_output_placeholders`.
    pub num_output_placeholders: i64,
    /// `request.num_computed_tokens`.
    pub num_computed_tokens: i64,
}

/// The writes of a steady request (see [`AppendPlan`]); an error (nothing written)
/// where a count would leave `i64`.
pub fn plan_append(counts: &AppendCounts, step: &UpdateStep) -> Result<AppendPlan> {
    let overflow = |what: &str| Error::InvalidArgument(format!("{what} is out of range"));
    let in_flight = counts
        .num_in_flight_tokens
        .checked_sub(1)
        .ok_or_else(|| overflow("num_in_flight_tokens"))?;
    let resolve = if counts.num_output_placeholders != 0 {
        let by = i64::from(!step.broken.breaks(UpdateRule::ResolvePlaceholder));
        let placeholders = counts
            .num_output_placeholders
            .checked_sub(by)
            .ok_or_else(|| overflow("num_output_placeholders"))?;
        let pending = match step.cache_blocks_at {
            CacheBlocksAt::InFlight => in_flight,
            CacheBlocksAt::Placeholders => placeholders,
        };
        let upto = counts
            .num_computed_tokens
            .checked_sub(pending)
            .ok_or_else(|| overflow("num_computed_tokens"))?;
        Some((placeholders, upto))
    } else {
        None
    };
    Ok(AppendPlan {
        num_in_flight_tokens: in_flight,
        resolve,
    })
}

/// Whether appending one token to a request with `num_hashed_blocks` hashes and
/// `num_tokens` tokens (after the append) completes no block for a hasher of
/// `hash_block_size` tokens whose hashes also cover `lookahead` tokens: then the
/// hasher would return nothing, and need not be called.
pub fn completes_no_block(
    num_hashed_blocks: usize,
    num_tokens: usize,
    hash_block_size: usize,
    lookahead: usize,
) -> bool {
    num_hashed_blocks
        .checked_mul(hash_block_size)
        .and_then(|start| start.checked_add(hash_block_size))
        .and_then(|end| end.checked_add(lookahead))
        .is_none_or(|end| end > num_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use UpdateRule as Rule;

    fn stop(ids: &[i64]) -> StopFacts<'_> {
        StopFacts {
            eos_token_id: Some(2),
            stop_token_ids: ids,
            max_tokens: 100,
            min_tokens: 0,
            repetition_detection: false,
            num_tokens: 20,
            num_output_tokens: 10,
        }
    }

    fn facts() -> UpdateFacts {
        UpdateFacts {
            num_scheduled_tokens: 1,
            num_sampled_tokens: 1,
            running: true,
            stale_output: false,
            num_output_placeholders: 0,
            mm_features: false,
            structured_output: false,
            pooling: false,
            prefill_stats: false,
            drafts: false,
            num_logprobs: false,
            prompt_logprobs: false,
        }
    }

    const STEP: UpdateStep = UpdateStep {
        is_async: false,
        has_logprobs: true,
        max_model_len: 512,
        cache_blocks_at: CacheBlocksAt::InFlight,
        broken: BrokenRules::NONE,
    };
    const NONE: BrokenRules = BrokenRules::NONE;

    #[test]
    fn an_ordinary_token_continues() {
        assert!(certainly_continues(&stop(&[5]), 7, 512, NONE));
    }

    #[test]
    fn eos_stops_unless_the_rule_is_broken() {
        assert!(!certainly_continues(&stop(&[]), 2, 512, NONE));
        assert!(certainly_continues(
            &stop(&[]),
            2,
            512,
            NONE.with(Rule::StopEos)
        ));
        let no_eos = StopFacts {
            eos_token_id: None,
            ..stop(&[])
        };
        assert!(certainly_continues(&no_eos, 2, 512, NONE));
    }

    #[test]
    fn a_stop_token_id_stops_and_a_broken_rule_skips_the_length_check() {
        assert!(!certainly_continues(&stop(&[5, 7]), 7, 512, NONE));
        let broken = NONE.with(Rule::StopTokenIds);
        assert!(certainly_continues(&stop(&[7]), 7, 512, broken));
        // As the Python rule did: the broken stop-id branch answers at once.
        let at_length = StopFacts {
            max_tokens: 11,
            ..stop(&[7])
        };
        assert!(certainly_continues(&at_length, 7, 512, broken));
    }

    #[test]
    fn max_tokens_and_max_model_len_stop_at_the_token_that_reaches_them() {
        let s = StopFacts {
            max_tokens: 12,
            ..stop(&[])
        };
        assert!(certainly_continues(&s, 7, 512, NONE)); // 11 < 12
        let s = StopFacts {
            max_tokens: 11,
            ..stop(&[])
        };
        assert!(!certainly_continues(&s, 7, 512, NONE)); // 11 >= 11
        assert!(certainly_continues(&s, 7, 512, NONE.with(Rule::StopLength)));
        assert!(certainly_continues(&stop(&[]), 7, 22, NONE)); // 21 < 22
        assert!(!certainly_continues(&stop(&[]), 7, 21, NONE)); // 21 >= 21
    }

    #[test]
    fn repetition_detection_is_vllms_past_min_tokens() {
        let s = StopFacts {
            repetition_detection: true,
            ..stop(&[])
        };
        assert!(!certainly_continues(&s, 7, 512, NONE));
        assert!(certainly_continues(&s, 7, 512, NONE.with(Rule::Repetition)));
        let below_min = StopFacts {
            min_tokens: 12,
            ..s
        };
        assert!(certainly_continues(&below_min, 7, 512, NONE)); // 11 < 12
        let at_min = StopFacts {
            min_tokens: 11,
            ..s
        };
        assert!(!certainly_continues(&at_min, 7, 512, NONE));
    }

    #[test]
    fn min_tokens_does_not_outrank_eos_or_length() {
        // check_stop's own order: below min_tokens EOS is vLLM's (it ignores it there,
        // or not, per version): the fast path leaves it to vLLM either way.
        let s = StopFacts {
            min_tokens: 50,
            ..stop(&[])
        };
        assert!(!certainly_continues(&s, 2, 512, NONE));
        let s = StopFacts {
            min_tokens: 50,
            max_tokens: 11,
            ..stop(&[])
        };
        assert!(!certainly_continues(&s, 7, 512, NONE));
    }

    #[test]
    fn only_a_plain_one_token_output_needs_only_append() {
        assert!(needs_only_append(&facts(), &STEP));
        let cases: [fn(&mut UpdateFacts); 12] = [
            |f| f.num_scheduled_tokens = 2,
            |f| f.num_sampled_tokens = 0,
            |f| f.running = false,
            |f| f.stale_output = true,
            |f| f.num_output_placeholders = 1,
            |f| f.mm_features = true,
            |f| f.structured_output = true,
            |f| f.pooling = true,
            |f| f.prefill_stats = true,
            |f| f.drafts = true,
            |f| f.num_logprobs = true,
            |f| f.prompt_logprobs = true,
        ];
        for (i, case) in cases.iter().enumerate() {
            let mut f = facts();
            case(&mut f);
            assert!(!needs_only_append(&f, &STEP), "case {i}");
        }
    }

    #[test]
    fn async_takes_placeholders_and_logprobs_count_only_when_sampled() {
        let f = UpdateFacts {
            num_output_placeholders: 1,
            ..facts()
        };
        let step = UpdateStep {
            is_async: true,
            ..STEP
        };
        assert!(needs_only_append(&f, &step));
        let f = UpdateFacts {
            num_logprobs: true,
            ..facts()
        };
        let step = UpdateStep {
            has_logprobs: false,
            ..STEP
        };
        assert!(needs_only_append(&f, &step));
        let step = UpdateStep {
            broken: NONE.with(Rule::Logprobs),
            ..STEP
        };
        assert!(needs_only_append(&f, &step));
    }

    #[test]
    fn steady_needs_sampling_params_and_a_continuing_token() {
        let ids = [];
        let read = || Ok::<_, ()>(Some(stop(&ids)));
        assert_eq!(is_steady(&facts(), 7, &STEP, read), Ok(true));
        assert_eq!(is_steady(&facts(), 2, &STEP, read), Ok(false));
        assert_eq!(
            is_steady(&facts(), 7, &STEP, || Ok::<_, ()>(None)),
            Ok(false)
        );
        // Stop facts are read only for a request that needs nothing but the append.
        let f = UpdateFacts {
            running: false,
            ..facts()
        };
        assert_eq!(is_steady(&f, 7, &STEP, || Err(())), Ok(false));
        assert_eq!(is_steady(&facts(), 7, &STEP, || Err(())), Err(()));
    }

    #[test]
    fn sync_split_takes_every_steady_request() {
        let mut split = StepSplit::new(false);
        assert_eq!(split.take(0, false), Take::Rest);
        assert!(!split.served());
        assert_eq!(split.take(0, true), Take::Steady);
        assert_eq!(split.take(0, false), Take::Rest);
        assert_eq!(split.take(0, true), Take::Steady);
        assert!(split.open() && split.served());
        assert_eq!(split.take(1, true), Take::NotServed);
    }

    #[test]
    fn async_split_takes_the_steady_prefix_only() {
        let mut split = StepSplit::new(true);
        assert_eq!(split.take(0, true), Take::Steady);
        assert_eq!(split.take(0, false), Take::Rest);
        assert!(!split.open());
        assert_eq!(split.take(0, true), Take::Rest);
        assert_eq!(split.take(1, false), Take::NotServed);
        let mut split = StepSplit::new(true);
        assert_eq!(split.take(0, false), Take::NotServed);
    }

    #[test]
    fn plan_counts_out_of_flight_and_resolves_placeholders() {
        let counts = AppendCounts {
            num_in_flight_tokens: 2,
            num_output_placeholders: 0,
            num_computed_tokens: 40,
        };
        let plan = plan_append(&counts, &STEP).unwrap();
        assert_eq!(plan.num_in_flight_tokens, 1);
        assert_eq!(plan.resolve, None);
        let counts = AppendCounts {
            num_output_placeholders: 2,
            ..counts
        };
        let plan = plan_append(&counts, &STEP).unwrap();
        assert_eq!(plan.resolve, Some((1, 39)));
        let step = UpdateStep {
            cache_blocks_at: CacheBlocksAt::Placeholders,
            ..STEP
        };
        assert_eq!(plan_append(&counts, &step).unwrap().resolve, Some((1, 39)));
        let counts = AppendCounts {
            num_in_flight_tokens: 3,
            ..counts
        };
        assert_eq!(plan_append(&counts, &step).unwrap().resolve, Some((1, 39)));
        assert_eq!(plan_append(&counts, &STEP).unwrap().resolve, Some((1, 38)));
        let step = UpdateStep {
            broken: NONE.with(Rule::ResolvePlaceholder),
            ..step
        };
        assert_eq!(plan_append(&counts, &step).unwrap().resolve, Some((2, 38)));
    }

    #[test]
    fn plan_refuses_counts_out_of_range() {
        let counts = AppendCounts {
            num_in_flight_tokens: i64::MIN,
            num_output_placeholders: 0,
            num_computed_tokens: 0,
        };
        assert!(plan_append(&counts, &STEP).is_err());
        let counts = AppendCounts {
            num_in_flight_tokens: 3,
            num_output_placeholders: 1,
            num_computed_tokens: i64::MIN,
        };
        assert!(plan_append(&counts, &STEP).is_err());
    }

    #[test]
    fn a_block_completes_when_its_last_token_arrives() {
        // Two blocks of 16 hashed; the third completes at 48 tokens.
        assert!(completes_no_block(2, 47, 16, 0));
        assert!(!completes_no_block(2, 48, 16, 0));
        assert!(completes_no_block(2, 48, 16, 1));
        assert!(!completes_no_block(2, 49, 16, 1));
        assert!(completes_no_block(usize::MAX, 10, 16, 0));
    }
}
