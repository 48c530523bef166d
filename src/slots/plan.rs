//! Planning a step of the slot mirror: the facts of a step in, a validated plan out
//! (pure), then the plan applied (infallible).
//!
//! `plan_step` = `plan_into` (reads the mirror, writes only a reusable [`Plan`]
//! buffer; every error is raised here) + `apply` (drops finished requests, bumps
//! versions, edits tables, records the pending spans; cannot fail).

use rustc_hash::FxHashSet;

use super::{PlannedRequest, RequestSlots, SlotMirror, StepRef};
use crate::error::{Error, Result};
use crate::prefill_skip::{plan_prefill_skip, PrefillSkip, PrefillSkipInput};
use crate::request_table::RequestHandle;
use crate::types::{BlockId, NULL_BLOCK_ID};

/// How a scheduled request's blocks arrive in a step.
#[derive(Clone, Copy, Debug)]
pub enum Assignment<'a> {
    /// The request's first schedule (new, resumed after preemption, or re-added):
    /// `block_ids` is its whole table (it replaces any table the mirror had) and
    /// `num_computed_tokens` its hit. Blocks past the aligned hit are fresh.
    Start {
        block_ids: &'a [BlockId],
        num_computed_tokens: usize,
        /// The last `num_external_tokens` of the hit were loaded by a KV connector:
        /// their blocks are distrusted (bumped) unless vouched for.
        num_external_tokens: usize,
        /// The prompt length, when known (decides whether a step samples).
        num_prompt_tokens: Option<usize>,
    },
    /// A running request: `new_block_ids` (all fresh) are appended to its table.
    /// `num_computed_tokens` is where this step's tokens start; `None` continues
    /// from where the mirror's last plan for the request ended.
    ///
    /// `reread`: the request reads its rows `[0, end)` again, its kept table
    /// unchanged (nothing bumped): a request whose first hit was refused and that
    /// the scheduler now recomputes from `num_computed_tokens` (block aligned, else
    /// `InvalidArgument`). Its computed rows start there, the rows before it are read.
    Continue {
        new_block_ids: &'a [BlockId],
        num_computed_tokens: Option<usize>,
        reread: bool,
    },
}

/// One request scheduled in a step.
#[derive(Clone, Copy, Debug)]
pub struct ScheduledRequest<'a> {
    pub req_id: &'a str,
    pub assignment: Assignment<'a>,
    pub num_scheduled_tokens: usize,
}

impl<'a> ScheduledRequest<'a> {
    /// A first schedule with a local hit of `num_computed_tokens` (no connector load).
    pub fn start(
        req_id: &'a str,
        block_ids: &'a [BlockId],
        num_computed_tokens: usize,
        num_scheduled_tokens: usize,
    ) -> Self {
        Self {
            req_id,
            assignment: Assignment::Start {
                block_ids,
                num_computed_tokens,
                num_external_tokens: 0,
                num_prompt_tokens: None,
            },
            num_scheduled_tokens,
        }
    }

    /// A running request continuing where its last plan ended.
    pub fn cont(
        req_id: &'a str,
        new_block_ids: &'a [BlockId],
        num_scheduled_tokens: usize,
    ) -> Self {
        Self {
            req_id,
            assignment: Assignment::Continue {
                new_block_ids,
                num_computed_tokens: None,
                reread: false,
            },
            num_scheduled_tokens,
        }
    }
}

/// Fast prefill: plan the KV-sharing skip layers' reduced batch with the step.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillSkipRequest<'a> {
    /// Draft tokens per scheduled request, in plan order (empty: none).
    pub num_spec_tokens: &'a [u32],
    /// Requests including CUDA-graph padding (`None`: no padding).
    pub num_reqs_padded: Option<usize>,
    /// Length to pad the logits indices to.
    pub num_logits_padded: usize,
}

/// The facts of one step, in the order the step's rows are laid out.
#[derive(Clone, Debug, Default)]
pub struct StepInput<'a> {
    /// Requests to forget before this step's assignments (unknown ids are ignored,
    /// as vLLM's model runner ignores them).
    pub finished_req_ids: Vec<&'a str>,
    /// The scheduled requests; the step's rows are laid out in this order.
    pub scheduled: Vec<ScheduledRequest<'a>>,
    /// Blocks freshly allocated from the pool this step, when the caller knows them
    /// (vLLM's `new_block_ids_to_zero`): bumped even where a hit covers them.
    pub fresh_block_ids: Option<&'a [BlockId]>,
    /// `(block, version)` pairs a KV connector vouches for: the block's rows are
    /// those written under that version. A block whose current version matches is
    /// not bumped this step (neither as loaded nor as fresh); other pairs are ignored.
    pub connector_versions: &'a [(BlockId, u64)],
    /// Plan the skip layers' reduced batch (fast prefill); `None`: every planned row
    /// is computed by every layer.
    pub prefill_skip: Option<PrefillSkipRequest<'a>>,
}

/// One scheduled request as planned.
#[derive(Clone, Copy, Debug)]
struct Planned {
    existing: Option<RequestHandle>,
    compute_start: usize,
    num_tokens: usize,
    kept: usize,
    read: bool,
    /// The block of every computed row when they lie in one block.
    single_block: Option<BlockId>,
    /// First block of the Start table to bump as connector-loaded, up to the first
    /// fresh one (`compute_start / block_size`).
    loaded_from: usize,
}

/// The plan of one step (a buffer the mirror reuses).
#[derive(Debug, Default)]
pub(super) struct Plan {
    removed: Vec<RequestHandle>,
    vouched: Vec<BlockId>,
    requests: Vec<Planned>,
    seen: Vec<RequestHandle>,
    sched: Vec<u32>,
    samples: Vec<bool>,
    skip: PrefillSkip,
    has_skip: bool,
}

impl SlotMirror {
    /// Plans a step: validates every fact, then drops finished requests, bumps the
    /// version of every fresh or distrusted block, updates the tables and records
    /// the write spans. Returns the step's reference; `planned()` and
    /// `write_slots()` describe the plan. A previous plan that was never committed
    /// is discarded (its rows count as never written).
    pub fn plan_step(&mut self, input: &StepInput<'_>) -> Result<StepRef> {
        let mut plan = std::mem::take(&mut self.plan_buf);
        let planned = self.plan_into(input, &mut plan);
        if planned.is_ok() {
            self.apply(input, &mut plan);
        }
        self.plan_buf = plan;
        planned?;
        Ok(StepRef {
            mirror_id: self.id,
            step_id: self.step_id,
        })
    }

    /// The pure half: validates `input` against the mirror and fills `plan`.
    fn plan_into(&self, input: &StepInput<'_>, plan: &mut Plan) -> Result<()> {
        plan.removed.clear();
        plan.removed.extend(
            input
                .finished_req_ids
                .iter()
                .filter_map(|id| self.requests.handle(id)),
        );
        plan.removed.sort_unstable();
        for &b in input.fresh_block_ids.unwrap_or_default() {
            self.check_block(b)?;
        }
        plan.vouched.clear();
        for &(b, version) in input.connector_versions {
            if self.epoch[self.check_block(b)?] == version {
                plan.vouched.push(b);
            }
        }
        plan.vouched.sort_unstable();
        plan.requests.clear();
        plan.seen.clear();
        plan.sched.clear();
        plan.samples.clear();
        let mut new_ids: FxHashSet<&str> = FxHashSet::default();
        let is_removed = |h: &RequestHandle| plan.removed.binary_search(h).is_ok();
        for r in &input.scheduled {
            let known = self.requests.handle(r.req_id).filter(|h| !is_removed(h));
            let fresh_id = match known {
                Some(h) => {
                    plan.seen.push(h);
                    false
                }
                None => !new_ids.insert(r.req_id),
            };
            if fresh_id {
                return Err(duplicate(r.req_id));
            }
            let p = self.plan_request(r, known)?;
            let prompt = match r.assignment {
                Assignment::Start {
                    num_prompt_tokens, ..
                } => num_prompt_tokens,
                Assignment::Continue { .. } => {
                    known.and_then(|h| self.requests[h].num_prompt_tokens)
                }
            };
            plan.sched
                .push(u32::try_from(p.num_tokens - p.compute_start).map_err(|_| {
                    Error::InvalidArgument(format!("request {:?}: too many tokens", r.req_id))
                })?);
            plan.samples.push(prompt.is_none_or(|n| p.num_tokens >= n));
            plan.requests.push(p);
        }
        plan.seen.sort_unstable();
        if let Some(w) = plan.seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(duplicate(self.requests.key_of(w[0]).unwrap_or_default()));
        }
        plan.has_skip = false;
        if let Some(skip) = input.prefill_skip {
            let n = input.scheduled.len();
            plan_prefill_skip(
                &PrefillSkipInput {
                    num_scheduled_tokens: &plan.sched,
                    num_spec_tokens: skip.num_spec_tokens,
                    samples: &plan.samples,
                    num_reqs_padded: skip.num_reqs_padded.unwrap_or(n),
                    num_logits_padded: skip.num_logits_padded,
                    query_start_loc: None,
                },
                &mut plan.skip,
            )?;
            for (p, &kept) in plan.requests.iter_mut().zip(&plan.skip.num_kept) {
                p.kept = kept as usize;
            }
            plan.has_skip = true;
        }
        Ok(())
    }

    /// Validates one scheduled request against the state after this step's removals.
    fn plan_request(
        &self,
        r: &ScheduledRequest<'_>,
        known: Option<RequestHandle>,
    ) -> Result<Planned> {
        // One piece: the `Start` / `Continue` match yields the six values (head, tail,
        // start, compute_start, read, loaded_from) that every later check reads.
        let bs = self.block_size;
        // The request's table after this step: `head` (kept) followed by `tail` (given);
        // the head's last block is also inline (`last`), to spare a decode step the read
        // of the table.
        let mut last = NULL_BLOCK_ID;
        let (head, tail, start, compute_start, read, loaded_from): (&[BlockId], _, _, _, _, _) =
            match r.assignment {
                Assignment::Start {
                    block_ids,
                    num_computed_tokens,
                    num_external_tokens,
                    ..
                } => {
                    if num_external_tokens > num_computed_tokens {
                        return Err(Error::InvalidArgument(format!(
                            "request {:?}: {num_external_tokens} external tokens exceed its \
                             {num_computed_tokens} computed tokens",
                            r.req_id
                        )));
                    }
                    let aligned = num_computed_tokens - self.bs.rem(num_computed_tokens);
                    let loaded_from = self.bs.div(num_computed_tokens - num_external_tokens);
                    (
                        &[][..],
                        block_ids,
                        num_computed_tokens,
                        aligned,
                        aligned > 0,
                        loaded_from,
                    )
                }
                Assignment::Continue {
                    new_block_ids,
                    num_computed_tokens,
                    reread,
                } => {
                    let h = known.ok_or_else(|| Error::UnknownRequest(r.req_id.to_string()))?;
                    let old = &self.requests[h];
                    last = old.last_block;
                    let start = num_computed_tokens.unwrap_or(old.num_computed_tokens);
                    if reread && self.bs.rem(start) != 0 {
                        return Err(Error::InvalidArgument(format!(
                            "request {:?}: a re-read from {start} tokens is not block aligned \
                             (block_size {bs})",
                            r.req_id
                        )));
                    }
                    let read = reread && start > 0;
                    (&old.block_table[..], new_block_ids, start, start, read, 0)
                }
            };
        for &b in tail {
            self.check_block(b)?;
        }
        let table_len = head.len() + tail.len();
        let end = start.checked_add(r.num_scheduled_tokens).ok_or_else(|| {
            Error::InvalidArgument(format!("request {:?}: token count overflows", r.req_id))
        })?;
        if end > table_len.saturating_mul(bs) {
            return Err(Error::InvalidArgument(format!(
                "request {:?}: positions up to {end} need {} blocks, its table has {table_len}",
                r.req_id,
                end.div_ceil(bs),
            )));
        }
        let mut single_block = None;
        if compute_start < end {
            let block = |k: usize| {
                if k + 1 == head.len() {
                    last
                } else if k < head.len() {
                    head[k]
                } else {
                    tail[k - head.len()]
                }
            };
            let first = self.bs.div(compute_start);
            let last = self.bs.div(end - 1);
            if first == last {
                single_block = Some(block(first));
            }
            if let Some(k) = (first..=last).find(|&k| block(k) == NULL_BLOCK_ID) {
                return Err(Error::InvalidArgument(format!(
                    "request {:?}: position {} maps to the null block; the hidden-state \
                     cache needs the KV-cache group that carries full-attention positions",
                    r.req_id,
                    (k * bs).max(compute_start)
                )));
            }
        }
        Ok(Planned {
            existing: known,
            compute_start,
            num_tokens: end,
            kept: end - compute_start,
            read,
            single_block,
            loaded_from,
        })
    }

    /// The infallible half: applies a plan made by `plan_into` for the same input.
    fn apply(&mut self, input: &StepInput<'_>, plan: &mut Plan) {
        // One piece: the infallible half of `plan_step`, every change of a step in one pass
        // over the scheduled requests, after `plan_into` validated them all.
        if self.pending_step.is_some() {
            self.stats.uncommitted_steps += 1;
            if self.faults.uncommitted_written {
                self.count_writes();
            }
        }
        self.step_id += 1;
        self.stats.steps += 1;
        self.pending.clear();
        for &h in &plan.removed {
            self.requests.remove_by_handle(h);
        }
        let vouched = std::mem::take(&mut plan.vouched);
        let bump = |m: &mut Self, b: BlockId| {
            if vouched.binary_search(&b).is_err() {
                m.bump(b);
            }
        };
        for &b in input.fresh_block_ids.unwrap_or_default() {
            bump(self, b);
        }
        for (r, p) in input.scheduled.iter().zip(&plan.requests) {
            let handle = match r.assignment {
                Assignment::Start {
                    block_ids,
                    num_prompt_tokens,
                    ..
                } => {
                    let h = match p.existing {
                        Some(h) => h,
                        None => self
                            .requests
                            .handle_or_insert_with(r.req_id, RequestSlots::default),
                    };
                    let slots = &mut self.requests[h];
                    slots.block_table.clear();
                    slots.block_table.extend_from_slice(block_ids);
                    slots.last_block = block_ids.last().copied().unwrap_or(NULL_BLOCK_ID);
                    slots.num_prompt_tokens = num_prompt_tokens;
                    let first_fresh = self.bs.div(p.compute_start);
                    for &b in &block_ids[p.loaded_from.min(first_fresh)..first_fresh] {
                        if self.faults.trust_connector {
                            continue;
                        }
                        if vouched.binary_search(&b).is_ok() {
                            self.stats.vouched_blocks += 1;
                        } else {
                            self.stats.untrusted_loaded_blocks += 1;
                            self.bump(b);
                        }
                    }
                    for &b in &block_ids[first_fresh.min(block_ids.len())..] {
                        bump(self, b);
                    }
                    h
                }
                Assignment::Continue { new_block_ids, .. } => {
                    // `plan_request` proved the request is known.
                    let h = p.existing.unwrap_or_default();
                    let slots = &mut self.requests[h];
                    if let Some(&b) = new_block_ids.last() {
                        slots.block_table.extend_from_slice(new_block_ids);
                        slots.last_block = b;
                    }
                    for &b in new_block_ids {
                        bump(self, b);
                    }
                    h
                }
            };
            self.requests[handle].num_computed_tokens = p.num_tokens;
            self.pending.push(PlannedRequest {
                handle,
                compute_start: p.compute_start,
                num_tokens: p.num_tokens,
                kept: p.kept,
                read: p.read,
                single_block: p.single_block,
            });
        }
        plan.vouched = vouched;
        self.has_prefill_skip = plan.has_skip;
        if plan.has_skip {
            std::mem::swap(&mut self.prefill_skip, &mut plan.skip);
        }
        self.pending_step = Some(self.step_id);
    }
}

fn duplicate(req_id: &str) -> Error {
    Error::InvalidArgument(format!("request {req_id:?} is scheduled twice in one step"))
}
