//! `OmniStepRules`: the decisions of `hscache.omni.OmniHiddenStateCache`, vllm-omni
//! 0.30's prefix-cache interface, beyond the slot mirror's: who is live, who is a
//! first hit, how a saved step's rows are laid out, who is served what, and which
//! step ids and request ids a `materialize` may ask for.
//!
//! vllm-omni's runners call, per step: `new_step_starts(scheduler_output)`, the
//! forward pass, `save_outputs(...)` -> step id, then exactly one `materialize(step
//! id, req_ids)` (possibly a step late, on another thread) or `discard_step(step id)`.
//! The Python class keeps the tensors (splits, copies, reshapes) and vllm-omni's
//! signatures; every decision is taken here:
//!
//! ```text
//!  begin_step(finished, new, scheduled)   live set, first hits (hit % block_size == 0)
//!  lay_out(batch, num_tokens)  -> SavePlan   the step's spans in the runner's batch order
//!      (the caller writes the rows through the slot mirror: served / missed hits)
//!  save(plan, Some(reads) | None) -> step id  per request: prefix / unservable / plain
//!  materialize(step id, req_ids) / discard(step id)   consume the id once
//! ```
//!
//! Key properties:
//! - **First hits.** A `scheduled_new_reqs` entry that is not live yet and has
//!   `num_computed_tokens > 0` gets `[cached prefix | this step's rows]`; one already
//!   live (vLLM resends a resumed request there) is a continuation and gets this
//!   step's rows only, as vllm-omni serves it. A first hit must be block aligned
//!   (KV-connector loads are not served).
//! - **Misses are never served short.** A first hit the slot mirror did not serve
//!   (rows not written in their blocks' current versions, or no read planned) is
//!   never handed out as if complete: serving its step rows alone would hand the
//!   next stage a truncated prompt. With recomputation on
//!   ([`OmniStepRules::set_recompute_refused`], which the runner hook that reports
//!   the blocks turns on) a miss with a failing block is *recomputed*: the step
//!   hands its rows out (the scheduler drops that output), the failing block is
//!   reported for the step ([`OmniStepRules::take_invalid_blocks`], vLLM's
//!   `KVConnectorOutput.invalid_block_ids`: the scheduler rolls the request back
//!   to that block and recomputes it; only that request), and the request's next
//!   scheduled step is its first hit again (`[cached prefix | rows]`, the mirror
//!   re-reading its rows). Otherwise (recomputation off, or no block to report)
//!   it is *unservable*: `materialize` naming it raises `UnservableHitError` with
//!   the reason, and consumes nothing.
//! - **Spans in the runner's order.** Rows are laid out in the runner's batch order,
//!   restricted to the scheduled requests; the step's unpadded token count must be
//!   the sum of their scheduled tokens and every scheduled request must be in the
//!   batch.
//! - **A step begun and never saved** is reported by the next `begin_step`: its
//!   tables count, its rows do not (the caller plans it in the mirror unsaved,
//!   before the new step).
//! - **Step ids are consumed once** ([`StepLedger`]); a plan is taken by `save` once,
//!   and only by the rules that made it, for the step it was made for.
//! - **Nothing changes on an `Err`**: every call validates completely, then applies.

use rustc_hash::{FxHashMap, FxHashSet};

use super::ledger::StepLedger;
use crate::error::Error;
use crate::types::{BlockId, NULL_BLOCK_ID};

static NEXT_RULES_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Why a first hit could not be served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnservableReason {
    /// The mirror refused the read: a row not written in its block's current version.
    NotWritten,
    /// The mirror planned no read for the request (its tables follow another group,
    /// or the hit was not one the mirror could plan).
    NotPlanned,
}

impl UnservableReason {
    /// The reason as `materialize`'s error says it.
    pub fn as_str(self) -> &'static str {
        match self {
            UnservableReason::NotWritten => "rows not written in the blocks' current versions",
            UnservableReason::NotPlanned => "no hit was planned",
        }
    }
}

/// What one request of a saved step is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// This step's rows only.
    Plain,
    /// `[cached prefix | this step's rows]`.
    Prefix,
    /// A refused first hit sent back for recomputation: this step's rows (the
    /// scheduler drops the request's output of the step, told by the reported block).
    Recompute,
    /// Refused (a first hit whose cached rows could not be validated).
    Unservable(UnservableReason),
}

/// Errors of the rules, each raised before anything changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OmniRuleError {
    /// Not an unconsumed step id of these rules (`StepIdError`).
    #[error(
        "step id {step} is not an unconsumed step of this cache (consumed already, never \
         saved, or another cache's); unconsumed: {outstanding:?}"
    )]
    StepId { step: String, outstanding: Vec<u64> },
    /// As many saved steps as allowed wait for their consumption (`StepIdError`).
    #[error("{} saved steps are unconsumed ({outstanding:?}); consume each step id once", outstanding.len())]
    NoRoom { outstanding: Vec<u64> },
    /// `materialize` named requests outside the step's batch (`UnknownRequestError`).
    #[error("materialize(step {step_id}): {req_ids:?} were not in the step's batch")]
    UnknownRequests { step_id: u64, req_ids: Vec<String> },
    /// `materialize` named first hits that could not be served (`UnservableHitError`).
    #[error("step {step_id}: the prefix hits of {req_ids:?} could not be served ({})", reason.as_str())]
    Unservable {
        step_id: u64,
        req_ids: Vec<String>,
        reason: UnservableReason,
    },
    /// A first hit that is not block aligned (`InvalidArgumentError`).
    #[error(
        "request {req_id:?}: a hit of {hit} tokens is not block aligned (block_size \
         {block_size}); KV-connector loads are not served"
    )]
    MisalignedHit {
        req_id: String,
        hit: usize,
        block_size: usize,
    },
    /// A save without a begun step, a batch that is not the step's, a plan of another
    /// step or of other rules, a bad argument (`InvalidArgumentError`).
    #[error("{0}")]
    Invalid(String),
}

/// At most this many request ids are named in an error.
const NAMED: usize = 8;

/// At most this many saved steps keep blocks to report (`take_invalid_blocks`).
const MAX_REPORTS: usize = 64;

/// The rows of one step, laid out (what [`OmniStepRules::save`] takes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavePlan {
    rules_id: u64,
    step_seq: u64,
    /// Positions in the batch given to `lay_out`, in layout order.
    batch_positions: Vec<u32>,
    /// Rows of each request, in layout order.
    sizes: Vec<usize>,
    /// Whether each request (layout order) is a first hit.
    first_hit: Vec<bool>,
    /// Request ids in layout order.
    req_ids: Vec<String>,
}

impl SavePlan {
    /// Positions (in the batch `lay_out` took) of the step's requests, in row order.
    pub fn batch_positions(&self) -> &[u32] {
        &self.batch_positions
    }

    /// Rows of each request, in row order.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The step's requests, in row order.
    pub fn req_ids(&self) -> &[String] {
        &self.req_ids
    }

    /// The rules that made this plan.
    pub fn rules_id(&self) -> u64 {
        self.rules_id
    }

    /// Total rows of the step.
    pub fn num_rows(&self) -> usize {
        self.sizes.iter().sum()
    }
}

/// What `save` decided for a step: its id and, in row order, what each request gets.
///
/// The caller keeps, per step, the full rows of the `prefix` requests (gathered from
/// the cache) and a snapshot of the `plain` requests' rows only: nothing else is ever
/// handed out (an unservable request's rows are refused, a prefix request's rows are
/// part of its gathered rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedStep {
    pub step_id: u64,
    /// What each request is served, in row order.
    pub served: Vec<Served>,
    /// Positions (row order) of the requests served their prefix.
    pub prefix: Vec<u32>,
    /// Rows of each plain request (in row order of the plain requests).
    pub plain_sizes: Vec<usize>,
    /// The step's row indices of the plain requests' rows; `None` when every request
    /// is plain (the snapshot is then the whole step).
    pub plain_rows: Option<Vec<i64>>,
}

/// What `materialize` hands the caller, per requested id: whether it gets its cached
/// prefix, and its index among the step's prefix requests (`SavedStep::prefix`) or
/// among its plain ones (`SavedStep::plain_sizes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Picks {
    pub index: Vec<u32>,
    pub prefix: Vec<bool>,
}

/// A begun step, until saved or replaced.
#[derive(Debug)]
struct PendingStep {
    seq: u64,
    /// `req_id -> scheduled tokens` (the step's `num_scheduled_tokens`).
    scheduled: FxHashMap<String, usize>,
    /// Scheduled requests in the step's own order (the mutant's layout).
    scheduled_order: Vec<String>,
    num_scheduled_tokens: usize,
    first_hits: FxHashSet<String>,
}

/// A saved step, until consumed.
#[derive(Debug)]
struct StepRecord {
    /// `req_id -> position` (row order).
    index: FxHashMap<String, u32>,
    served: Vec<Served>,
    /// Per position: its index among the prefix or the plain requests.
    class_index: Vec<u32>,
}

/// Deliberate defects, for the differential against vllm-omni's cache (the binding's
/// `_break_rule`); only tests can set them (`cfg(test)`, the `mutants` feature), one
/// predictable branch each.
#[derive(Clone, Copy, Debug, Default)]
struct RuleFaults {
    /// A `scheduled_new_reqs` entry already live gets its prefix again.
    continuation_hit: bool,
    /// No first hit is recorded: every hit is served this step's rows only.
    no_first_hit: bool,
    /// An unservable hit is served this step's rows only instead of refused.
    unservable_as_plain: bool,
    /// Spans follow the step's `num_scheduled_tokens` order, not the runner's batch.
    spans_in_scheduled_order: bool,
    /// A recomputed request's step is served this step's rows, not its prefix.
    recompute_as_plain: bool,
}

/// The rules of one `OmniHiddenStateCache` (see module docs).
#[derive(Debug)]
pub struct OmniStepRules {
    id: u64,
    block_size: usize,
    live: FxHashSet<String>,
    pending: Option<PendingStep>,
    next_seq: u64,
    ledger: StepLedger,
    steps: FxHashMap<u64, StepRecord>,
    /// Whether a refused first hit is sent back for recomputation (see module docs).
    recompute_refused: bool,
    /// Requests whose first hit was sent back, until their next scheduled step.
    recomputing: FxHashSet<String>,
    /// Per saved step: the blocks to report for the recomputations it decided.
    invalid: FxHashMap<u64, Vec<BlockId>>,
    faults: RuleFaults,
}

impl OmniStepRules {
    /// The rule names [`Self::break_rule_for_tests`] accepts.
    #[cfg(any(test, feature = "mutants"))]
    pub const RULE_MUTANTS: [&'static str; 5] = [
        "continuation_hit",
        "no_first_hit",
        "unservable_as_plain",
        "spans_in_scheduled_order",
        "recompute_as_plain",
    ];

    /// Rules for blocks of `block_size` tokens, at most `max_unconsumed_steps` saved
    /// steps waiting for their consumption.
    pub fn new(block_size: usize, max_unconsumed_steps: usize) -> Result<Self, OmniRuleError> {
        if block_size == 0 {
            return Err(OmniRuleError::Invalid("block_size must be positive".into()));
        }
        let ledger = StepLedger::new(max_unconsumed_steps).map_err(|e| match e {
            Error::InvalidArgument(m) => OmniRuleError::Invalid(m),
            other => OmniRuleError::Invalid(other.to_string()),
        })?;
        Ok(Self {
            id: NEXT_RULES_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            block_size,
            live: FxHashSet::default(),
            pending: None,
            next_seq: 1,
            ledger,
            steps: FxHashMap::default(),
            recompute_refused: false,
            recomputing: FxHashSet::default(),
            invalid: FxHashMap::default(),
            faults: RuleFaults::default(),
        })
    }

    /// Test only: breaks one rule (a name of [`Self::RULE_MUTANTS`]), so that a
    /// differential can prove it notices; the rules must then be thrown away.
    #[cfg(any(test, feature = "mutants"))]
    pub fn break_rule_for_tests(&mut self, name: &str) -> Result<(), OmniRuleError> {
        let f = &mut self.faults;
        match name {
            "continuation_hit" => f.continuation_hit = true,
            "no_first_hit" => f.no_first_hit = true,
            "unservable_as_plain" => f.unservable_as_plain = true,
            "spans_in_scheduled_order" => f.spans_in_scheduled_order = true,
            "recompute_as_plain" => f.recompute_as_plain = true,
            _ => {
                return Err(OmniRuleError::Invalid(format!(
                    "no omni rule mutant {name:?} (known: {:?})",
                    Self::RULE_MUTANTS
                )))
            }
        }
        Ok(())
    }

    /// These rules' id: plans carry it, and other rules refuse them.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Requests live between steps (scheduled once, not finished).
    pub fn num_live(&self) -> usize {
        self.live.len()
    }

    /// Turns recomputation of refused first hits on or off (see module docs): on only
    /// where the reported blocks reach the scheduler (`take_invalid_blocks`).
    pub fn set_recompute_refused(&mut self, on: bool) {
        self.recompute_refused = on;
    }

    /// Whether refused first hits are sent back for recomputation.
    pub fn recompute_refused(&self) -> bool {
        self.recompute_refused
    }

    /// Whether a request waits for its recomputation (`begin_step` then needs the
    /// running requests' computed tokens).
    pub fn has_recomputing(&self) -> bool {
        !self.recomputing.is_empty()
    }

    /// The requests sent back for recomputation, not scheduled again yet.
    pub fn recomputing(&self) -> impl Iterator<Item = &str> {
        self.recomputing.iter().map(String::as_str)
    }

    /// The blocks to report for the recomputations saved step `step_id` decided
    /// (vLLM's `invalid_block_ids` of that step's output); taken once.
    pub fn take_invalid_blocks(&mut self, step_id: u64) -> Vec<BlockId> {
        self.invalid.remove(&step_id).unwrap_or_default()
    }

    /// Whether a step was begun and not saved yet.
    pub fn has_pending_step(&self) -> bool {
        self.pending.is_some()
    }

    /// The saved step ids not consumed yet, oldest first.
    pub fn unconsumed_steps(&self) -> &[u64] {
        self.ledger.outstanding()
    }

    /// The most saved steps that may wait for their consumption.
    pub fn max_unconsumed_steps(&self) -> usize {
        self.ledger.limit()
    }

    /// Whether another step may be saved now.
    pub fn check_room(&self) -> Result<(), OmniRuleError> {
        if self.ledger.check_room().is_err() {
            return Err(OmniRuleError::NoRoom {
                outstanding: self.ledger.outstanding().to_vec(),
            });
        }
        Ok(())
    }

    /// Begins a step from its `SchedulerOutput` facts: `finished` ids,
    /// `new` = `(req_id, num_computed_tokens)` of `scheduled_new_reqs`, `scheduled` =
    /// `num_scheduled_tokens`, `running` = `(req_id, num_computed_tokens)` of the
    /// scheduled running requests (read only while [`Self::has_recomputing`]; may be
    /// empty otherwise). Returns whether the previous step was begun and never saved
    /// (the caller then plans it in the mirror without rows, before this one), and
    /// the requests recomputed from here whose rows the mirror must read again
    /// (`Assignment::Continue::reread`).
    pub fn begin_step(
        &mut self,
        finished: &[&str],
        new: &[(&str, usize)],
        scheduled: &[(&str, usize)],
        running: &[(&str, usize)],
    ) -> Result<(bool, Vec<String>), OmniRuleError> {
        // One piece: every fact is validated before anything changes, and the apply half
        // consumes the `resumed` list and the `map` the validating half builds.
        let finished_set: FxHashSet<&str> = finished.iter().copied().collect();
        let is_live = |r: &str| self.live.contains(r) && !finished_set.contains(r);
        // Validate: every first schedule with a hit is block aligned.
        let mut seen: FxHashSet<&str> = FxHashSet::default();
        for &(req_id, hit) in new {
            let continuation = is_live(req_id) || !seen.insert(req_id);
            if !continuation && hit % self.block_size != 0 {
                return Err(OmniRuleError::MisalignedHit {
                    req_id: req_id.to_owned(),
                    hit,
                    block_size: self.block_size,
                });
            }
        }
        // A recomputed request resumes from a block boundary (vLLM rolls it back to
        // its first reported block, or to its hit).
        let mut resumed: Vec<(&str, usize)> = Vec::new();
        if !self.recomputing.is_empty() {
            for &(req_id, nc) in running {
                if !self.recomputing.contains(req_id) || !is_live(req_id) {
                    continue;
                }
                if nc % self.block_size != 0 {
                    return Err(OmniRuleError::MisalignedHit {
                        req_id: req_id.to_owned(),
                        hit: nc,
                        block_size: self.block_size,
                    });
                }
                resumed.push((req_id, nc));
            }
        }
        let mut map: FxHashMap<String, usize> = FxHashMap::default();
        map.reserve(scheduled.len());
        let mut total = 0usize;
        for &(req_id, n) in scheduled {
            if n == 0 {
                continue; // scheduled nothing: no rows, as the batch layout skips it
            }
            total = total.checked_add(n).ok_or_else(|| {
                OmniRuleError::Invalid("the step's scheduled tokens overflow".into())
            })?;
            if map.insert(req_id.to_owned(), n).is_some() {
                return Err(OmniRuleError::Invalid(format!(
                    "request {req_id:?} is scheduled twice"
                )));
            }
        }
        // Apply.
        for r in finished {
            self.live.remove(*r);
            self.recomputing.remove(*r);
        }
        let mut first_hits = FxHashSet::default();
        let mut rereads = Vec::with_capacity(resumed.len());
        for &(req_id, nc) in &resumed {
            self.recomputing.remove(req_id);
            if nc > 0 && map.contains_key(req_id) {
                rereads.push(req_id.to_owned());
                if !self.faults.recompute_as_plain {
                    first_hits.insert(req_id.to_owned());
                }
            }
        }
        for &(req_id, hit) in new {
            let fresh = self.live.insert(req_id.to_owned());
            if !fresh && !self.faults.continuation_hit {
                continue; // a continuation: vllm-omni serves no prefix again
            }
            if hit > 0 && !self.faults.no_first_hit {
                first_hits.insert(req_id.to_owned());
            }
        }
        let unsaved = self.pending.is_some();
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending = Some(PendingStep {
            seq,
            scheduled: map,
            scheduled_order: scheduled
                .iter()
                .filter(|(_, n)| *n != 0)
                .map(|(r, _)| (*r).to_owned())
                .collect(),
            num_scheduled_tokens: total,
            first_hits,
        });
        Ok((unsaved, rereads))
    }

    /// Lays out the begun step's rows in the runner's `batch` order (its scheduled
    /// requests), checking `num_tokens` (the unpadded row count) against the step.
    /// Pure: the plan is taken by [`Self::save`].
    pub fn lay_out(&self, batch: &[&str], num_tokens: usize) -> Result<SavePlan, OmniRuleError> {
        let p = self.pending.as_ref().ok_or_else(|| {
            OmniRuleError::Invalid("save_outputs without new_step_starts for this step".into())
        })?;
        let mut positions: Vec<u32> = Vec::with_capacity(p.scheduled.len());
        let mut seen: FxHashSet<&str> = FxHashSet::default();
        let mut total = 0usize;
        for (i, &r) in batch.iter().enumerate() {
            let n = p.scheduled.get(r).copied().unwrap_or(0);
            if n == 0 {
                continue;
            }
            if !seen.insert(r) {
                return Err(OmniRuleError::Invalid(format!(
                    "the runner's batch names request {r:?} twice"
                )));
            }
            let i = u32::try_from(i)
                .map_err(|_| OmniRuleError::Invalid("the batch has over 2**32 requests".into()))?;
            positions.push(i);
            total = total.checked_add(n).ok_or_else(|| {
                OmniRuleError::Invalid("the batch's scheduled tokens overflow".into())
            })?;
        }
        if total != num_tokens || positions.len() != p.scheduled.len() {
            return Err(OmniRuleError::Invalid(format!(
                "num_tokens_unpadded={num_tokens} with {} of {} scheduled requests in the \
                 batch ({} tokens scheduled)",
                positions.len(),
                p.scheduled.len(),
                p.num_scheduled_tokens
            )));
        }
        if self.faults.spans_in_scheduled_order {
            let rank: FxHashMap<&str, usize> = p
                .scheduled_order
                .iter()
                .enumerate()
                .map(|(i, r)| (r.as_str(), i))
                .collect();
            positions.sort_by_key(|&i| rank.get(batch[i as usize]).copied().unwrap_or(0));
        }
        let req_ids: Vec<String> = positions
            .iter()
            .map(|&i| batch[i as usize].to_owned())
            .collect();
        let sizes = req_ids.iter().map(|r| p.scheduled[r.as_str()]).collect();
        let first_hit = req_ids.iter().map(|r| p.first_hits.contains(r)).collect();
        Ok(SavePlan {
            rules_id: self.id,
            step_seq: p.seq,
            batch_positions: positions,
            sizes,
            first_hit,
            req_ids,
        })
    }

    /// Whether `plan` is the begun step's plan of these rules (what `save` needs).
    pub fn check_plan(&self, plan: &SavePlan) -> Result<(), OmniRuleError> {
        if plan.rules_id != self.id {
            return Err(OmniRuleError::Invalid(
                "the plan was laid out by another cache's rules".into(),
            ));
        }
        match &self.pending {
            Some(p) if p.seq == plan.step_seq => Ok(()),
            _ => Err(OmniRuleError::Invalid(
                "the plan is not of the begun step (saved already, or replaced by a later \
                 step)"
                    .into(),
            )),
        }
    }

    /// How [`Self::save`] serves each request of the plan, from the mirror's reads,
    /// and the blocks of the refused hits to recompute (nothing changes here).
    fn classify_reads(
        &self,
        plan: &SavePlan,
        reads: Option<(&[usize], &[usize], &[BlockId])>,
    ) -> Result<(Vec<Served>, Vec<BlockId>), OmniRuleError> {
        let n = plan.req_ids.len();
        let mut served = vec![Served::Plain; n];
        let mut invalid: Vec<BlockId> = Vec::new();
        if let Some((hits, misses, miss_blocks)) = reads {
            if let Some(&bad) = hits.iter().chain(misses).find(|&&i| i >= n) {
                return Err(OmniRuleError::Invalid(format!(
                    "read position {bad} is past the step's {n} requests"
                )));
            }
            if miss_blocks.len() != misses.len() {
                return Err(OmniRuleError::Invalid(format!(
                    "{} miss blocks for {} misses",
                    miss_blocks.len(),
                    misses.len()
                )));
            }
            for (i, s) in served.iter_mut().enumerate() {
                if !plan.first_hit[i] {
                    continue;
                }
                *s = if hits.contains(&i) {
                    Served::Prefix
                } else if let Some(j) = misses.iter().position(|&m| m == i) {
                    let block = miss_blocks[j];
                    if self.recompute_refused && block != NULL_BLOCK_ID {
                        if !invalid.contains(&block) {
                            invalid.push(block);
                        }
                        Served::Recompute
                    } else {
                        Served::Unservable(UnservableReason::NotWritten)
                    }
                } else {
                    Served::Unservable(UnservableReason::NotPlanned)
                };
                if self.faults.unservable_as_plain && matches!(s, Served::Unservable(_)) {
                    *s = Served::Plain;
                }
            }
        }
        Ok((served, invalid))
    }

    /// Saves the planned step and issues its step id. `reads`: the positions (row
    /// order) of the requests whose full rows the mirror served, of those whose hit
    /// it refused, and per refused one the first block that failed (the null block
    /// when none can be reported); `None` when no rows were written (nothing is
    /// served a prefix).
    pub fn save(
        &mut self,
        plan: &SavePlan,
        reads: Option<(&[usize], &[usize], &[BlockId])>,
    ) -> Result<SavedStep, OmniRuleError> {
        self.check_plan(plan)?;
        self.check_room()?;
        let n = plan.req_ids.len();
        let (served, invalid) = self.classify_reads(plan, reads)?;
        let mut prefix = Vec::new();
        let mut plain_sizes = Vec::with_capacity(n);
        let mut class_index = Vec::with_capacity(n);
        for (i, s) in served.iter().enumerate() {
            match s {
                Served::Prefix => {
                    class_index.push(prefix.len() as u32);
                    prefix.push(i as u32);
                }
                Served::Plain | Served::Recompute => {
                    class_index.push(plain_sizes.len() as u32);
                    plain_sizes.push(plan.sizes[i]);
                }
                Served::Unservable(_) => class_index.push(u32::MAX),
            }
        }
        let plain_rows = (plain_sizes.len() != n).then(|| {
            let mut rows = Vec::with_capacity(plain_sizes.iter().sum());
            let mut start = 0i64;
            for (s, &size) in served.iter().zip(&plan.sizes) {
                let end = start + size as i64;
                if matches!(s, Served::Plain | Served::Recompute) {
                    rows.extend(start..end);
                }
                start = end;
            }
            rows
        });
        // Apply (room was checked: cannot fail).
        let step_id = self.ledger.issue().map_err(|e| {
            OmniRuleError::Invalid(format!("internal: room checked, issue refused: {e}"))
        })?;
        self.pending = None;
        for (r, s) in plan.req_ids.iter().zip(&served) {
            if *s == Served::Recompute {
                self.recomputing.insert(r.clone());
            }
        }
        if !invalid.is_empty() {
            // Taken by the runner hook with the step's output; a bound for a caller
            // that never takes them (the oldest reports go first).
            if self.invalid.len() >= MAX_REPORTS {
                if let Some(&oldest) = self.invalid.keys().min() {
                    self.invalid.remove(&oldest);
                }
            }
            self.invalid.insert(step_id, invalid);
        }
        let index = plan
            .req_ids
            .iter()
            .enumerate()
            .map(|(i, r)| (r.clone(), i as u32))
            .collect();
        self.steps.insert(
            step_id,
            StepRecord {
                index,
                served: served.clone(),
                class_index,
            },
        );
        Ok(SavedStep {
            step_id,
            served,
            prefix,
            plain_sizes,
            plain_rows,
        })
    }

    fn record(&self, step_id: u64) -> Result<&StepRecord, OmniRuleError> {
        match self.steps.get(&step_id) {
            Some(rec) if self.ledger.contains(step_id) => Ok(rec),
            _ => Err(self.step_id_error(step_id.to_string())),
        }
    }

    /// The error for a step id that is not an unconsumed step here (`step` as given).
    pub fn step_id_error(&self, step: String) -> OmniRuleError {
        OmniRuleError::StepId {
            step,
            outstanding: self.ledger.outstanding().to_vec(),
        }
    }

    /// Consumes `step_id` for `req_ids`: each must be in the step's rows and not an
    /// unservable hit. Returns, per requested id, its position (row order) and
    /// whether it gets its cached prefix.
    pub fn materialize(&mut self, step_id: u64, req_ids: &[&str]) -> Result<Picks, OmniRuleError> {
        let rec = self.record(step_id)?;
        let mut picks = Picks {
            index: Vec::with_capacity(req_ids.len()),
            prefix: Vec::with_capacity(req_ids.len()),
        };
        let mut unknown = Vec::new();
        let mut refused: Option<(Vec<String>, UnservableReason)> = None;
        for &r in req_ids {
            let Some(&i) = rec.index.get(r) else {
                if unknown.len() < NAMED {
                    unknown.push(r.to_owned());
                }
                continue;
            };
            match rec.served[i as usize] {
                Served::Unservable(why) => {
                    let (ids, _) = refused.get_or_insert_with(|| (Vec::new(), why));
                    if ids.len() < NAMED {
                        ids.push(r.to_owned());
                    }
                }
                s => {
                    picks.index.push(rec.class_index[i as usize]);
                    picks.prefix.push(s == Served::Prefix);
                }
            }
        }
        if !unknown.is_empty() {
            return Err(OmniRuleError::UnknownRequests {
                step_id,
                req_ids: unknown,
            });
        }
        if let Some((req_ids, reason)) = refused {
            return Err(OmniRuleError::Unservable {
                step_id,
                req_ids,
                reason,
            });
        }
        self.consume(step_id);
        Ok(picks)
    }

    /// Consumes `step_id` without reading it.
    pub fn discard(&mut self, step_id: u64) -> Result<(), OmniRuleError> {
        self.record(step_id)?;
        self.consume(step_id);
        Ok(())
    }

    /// `step_id` is known outstanding: cannot fail.
    fn consume(&mut self, step_id: u64) {
        let _ = self.ledger.consume(step_id);
        self.steps.remove(&step_id);
    }
}

#[cfg(test)]
#[path = "omni_rules_tests.rs"]
mod tests;
