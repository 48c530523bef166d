//! `SlotMirror`: the worker-side mirror of KV-cache block assignments that indexes
//! and validates the hidden-state cache (`hscache.hidden_states`).
//!
//! The hidden-state cache keeps one row per KV slot (`slot = block_id * block_size
//! + offset`) in a preallocated tensor per key. The worker (where the tensors live)
//! learns each step's block assignments from vLLM 0.33's `SchedulerOutput` alone:
//! `NewRequestData.block_ids` and `num_computed_tokens` (the prefix hit) for new
//! requests, `CachedRequestData.new_block_ids` for running ones (`resumed_req_ids`
//! replace the table), `num_scheduled_tokens`, `finished_req_ids`. This module turns
//! those facts into slot mappings and decides which cached rows may be served.
//! vLLM's scheduler side has no counterpart: the prior art (vllm-omni's
//! `OmniTensorPrefixCache`) trusted the slot mapping and read whatever was there.
//!
//! A step is two calls:
//!
//! ```text
//!  plan_step(facts)            forward pass            commit(step_id)
//!  ├ drop finished requests    rows for every          ├ written counts advance over
//!  ├ epoch bump of every       planned span            │ the step's write spans
//!  │ fresh block               [compute_start, end)    ├ validate each read:
//!  ├ tables extended/replaced  (index_copy_ through    │ rows [0, end) of its table
//!  └ write spans + slots       the write slots)        └ → StepReads (slots to gather)
//! ```
//!
//! Key properties:
//! - **Epochs.** Every block has an epoch, bumped whenever the block is assigned to a
//!   request as a fresh (non-hit) block, and a count of its leading rows written in
//!   that epoch. A bump resets the count: rows left by an earlier occupant are never
//!   valid again.
//! - **Validated reads.** A request's first schedule (new, resumed, or re-added by
//!   the v2 model runner) with a hit reads its rows `[0, end)` from the cache; the
//!   read is served only if every block covering them is not the null block and has
//!   all the needed rows written in its current epoch. Otherwise it is a reported
//!   miss: its cached rows are never served (no zeros, no other request's rows).
//! - **Writes before reads.** Validation happens in `commit`, after the step's
//!   writes are counted, so a same-step hit (request B hits blocks that request A
//!   computes in this very step, which vLLM allows because it caches block hashes at
//!   allocation) is served from A's fresh rows.
//! - **Spans are block aligned.** The cached span of a hit ends at
//!   `floor(hit / block_size) * block_size` and the request's computed span starts
//!   at that same boundary. A non-aligned hit (an external KV connector's) therefore
//!   recomputes the gap rows instead of leaving a hole; the caller's forward pass
//!   produces rows for `[compute_start, end)`, which then may start before vLLM's
//!   `num_computed_tokens`. Local prefix-cache hits are always aligned.
//! - **Delayed reads are revalidated.** `StepReads` records the epoch of every block
//!   it reads; `revalidate` turns an entry whose block was reassigned since into a
//!   miss, even if the new occupant has written all its rows (vllm-omni's delayed
//!   reader returned the new occupant's rows in that case).
//! - Every method validates its whole input before it mutates anything: an `Err`
//!   leaves the mirror exactly as it was.
//!
//! Scope: the mirror follows one KV-cache group (the caller picks it, group 0 by
//! default). Hidden states are one row per token, and any full-attention group's
//! table maps every position to a distinct block; keying by every group would
//! multiply the memory by the number of groups for no extra information. The group
//! must be a full-attention one: sliding-window groups put the null block where the
//! window skipped, and reads over the null block are misses. Blocks of an external
//! KV load look like hit blocks to the worker; `StepInput::fresh_block_ids` (vLLM's
//! `new_block_ids_to_zero`, sent when the model needs zeroed blocks) marks them fresh
//! so that their reads are misses; without it the mirror trusts the scheduler's hits.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::error::{Error, Result};
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
    },
    /// A running request: `new_block_ids` (all fresh) are appended to its table.
    /// `num_computed_tokens` is where this step's tokens start; `None` continues
    /// from where the mirror's last plan for the request ended.
    Continue {
        new_block_ids: &'a [BlockId],
        num_computed_tokens: Option<usize>,
    },
}

/// One request scheduled in a step.
#[derive(Clone, Copy, Debug)]
pub struct ScheduledRequest<'a> {
    pub req_id: &'a str,
    pub assignment: Assignment<'a>,
    pub num_scheduled_tokens: usize,
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
}

/// One request of the pending step, in plan order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedRequest {
    slab: usize,
    /// First position whose row this step computes (block aligned on a hit).
    pub compute_start: usize,
    /// One past the last position computed this step.
    pub num_tokens: usize,
    /// Whether the request reads its rows `[0, num_tokens)` from the cache.
    pub read: bool,
}

/// One served read: rows `[0, num_tokens)` of a planned request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadEntry {
    /// Index of the request in its step's plan.
    pub plan_index: usize,
    /// Rows read (positions `0..num_tokens`).
    pub num_tokens: usize,
    /// How many of them come from the cache (positions `0..num_cached_tokens`);
    /// the rest were computed in the same step.
    pub num_cached_tokens: usize,
    blocks_start: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReadBlock {
    block_id: BlockId,
    epoch: u64,
    rows: u32,
}

/// The validated reads of one committed step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepReads {
    mirror_id: u64,
    /// The step the reads were planned in.
    pub step_id: u64,
    block_size: usize,
    generation: u64,
    entries: Vec<ReadEntry>,
    misses: Vec<usize>,
    blocks: Vec<ReadBlock>,
}

impl StepReads {
    /// The served reads, in plan order.
    pub fn entries(&self) -> &[ReadEntry] {
        &self.entries
    }

    /// Plan indices of the requests whose read is a miss (never served).
    pub fn misses(&self) -> &[usize] {
        &self.misses
    }

    /// Total rows of the served reads.
    pub fn num_rows(&self) -> usize {
        self.entries.iter().map(|e| e.num_tokens).sum()
    }

    /// The slot of every served row, entry after entry (int64, as torch indexes).
    pub fn slots(&self) -> impl Iterator<Item = i64> + '_ {
        let bs = self.block_size;
        self.entries.iter().flat_map(move |e| {
            let blocks = &self.blocks[e.blocks_start..];
            (0..e.num_tokens)
                .map(move |pos| (blocks[pos / bs].block_id as usize * bs + pos % bs) as i64)
        })
    }

    fn entry_blocks(&self, i: usize) -> &[ReadBlock] {
        let e = &self.entries[i];
        let n = e.num_tokens.div_ceil(self.block_size);
        &self.blocks[e.blocks_start..e.blocks_start + n]
    }
}

/// Counters of a mirror's life (never reset).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotStats {
    /// Steps planned.
    pub steps: u64,
    /// Steps committed.
    pub committed_steps: u64,
    /// Steps planned but replaced by the next plan before a commit (their rows
    /// count as never written).
    pub uncommitted_steps: u64,
    /// Epoch bumps (fresh block assignments).
    pub fresh_blocks: u64,
    /// Rows counted as written by commits.
    pub rows_written: u64,
    /// Reads served by commits.
    pub reads_served: u64,
    /// Rows of those reads that came from earlier steps' writes or other requests.
    pub cached_rows_served: u64,
    /// Reads refused at commit (a row not written in its block's current epoch).
    pub read_misses: u64,
    /// Served reads later turned into misses by `revalidate` (block reassigned).
    pub stale_reads: u64,
}

#[derive(Clone, Debug, Default)]
struct RequestSlots {
    block_table: Vec<BlockId>,
    num_computed_tokens: usize,
}

static NEXT_MIRROR_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The worker-side slot mirror (see module docs).
#[derive(Debug)]
pub struct SlotMirror {
    id: u64,
    block_size: usize,
    num_blocks: u32,
    epoch: Vec<u64>,
    written: Vec<u32>,
    index: FxHashMap<Box<str>, usize>,
    slab: Vec<RequestSlots>,
    free_slab: Vec<usize>,
    step_id: u64,
    /// Bumped with any epoch: reads taken at an unchanged generation are still valid.
    generation: u64,
    pending: Vec<PlannedRequest>,
    pending_step: Option<u64>,
    stats: SlotStats,
}

/// What validation found for one scheduled request (no state touched yet).
#[derive(Clone, Copy)]
struct Checked {
    slab: Option<usize>,
    compute_start: usize,
    num_tokens: usize,
    read: bool,
}

impl SlotMirror {
    /// A mirror of `num_blocks` blocks of `block_size` slots (block 0 is the null block).
    pub fn new(num_blocks: u32, block_size: usize) -> Result<Self> {
        if num_blocks == 0 || block_size == 0 || block_size > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "num_blocks and block_size must be positive (block_size < 2^32), \
                 got {num_blocks} and {block_size}"
            )));
        }
        if (num_blocks as u128) * (block_size as u128) > i64::MAX as u128 {
            return Err(Error::InvalidArgument(
                "num_blocks * block_size overflows an int64 slot id".into(),
            ));
        }
        Ok(Self {
            id: NEXT_MIRROR_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            block_size,
            num_blocks,
            epoch: vec![0; num_blocks as usize],
            written: vec![0; num_blocks as usize],
            index: FxHashMap::default(),
            slab: Vec::new(),
            free_slab: Vec::new(),
            step_id: 0,
            generation: 0,
            pending: Vec::new(),
            pending_step: None,
            stats: SlotStats::default(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The id of the last planned step (0 before the first).
    pub fn step_id(&self) -> u64 {
        self.step_id
    }

    /// The id of the planned step awaiting its commit, if any.
    pub fn pending_step(&self) -> Option<u64> {
        self.pending_step
    }

    pub fn stats(&self) -> SlotStats {
        self.stats
    }

    /// Requests the mirror holds a table for.
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }

    /// `(epoch, leading rows written in it)` of a block.
    pub fn block_state(&self, block_id: BlockId) -> Result<(u64, usize)> {
        let b = self.check_block(block_id)?;
        Ok((self.epoch[b], self.written[b] as usize))
    }

    /// The block table the mirror holds for a request.
    pub fn block_table(&self, req_id: &str) -> Result<&[BlockId]> {
        Ok(&self.request(req_id)?.block_table)
    }

    /// Where the mirror's last plan for a request ended.
    pub fn num_computed_tokens(&self, req_id: &str) -> Result<usize> {
        Ok(self.request(req_id)?.num_computed_tokens)
    }

    fn request(&self, req_id: &str) -> Result<&RequestSlots> {
        self.index
            .get(req_id)
            .map(|&i| &self.slab[i])
            .ok_or_else(|| Error::UnknownRequest(req_id.to_string()))
    }

    fn check_block(&self, block_id: BlockId) -> Result<usize> {
        if block_id >= self.num_blocks {
            return Err(Error::BlockIdOutOfRange {
                block_id: block_id.into(),
                num_blocks: self.num_blocks,
            });
        }
        Ok(block_id as usize)
    }

    fn bump(&mut self, block_id: BlockId) {
        let b = block_id as usize;
        self.epoch[b] += 1;
        self.written[b] = 0;
        self.generation += 1;
        self.stats.fresh_blocks += 1;
    }

    /// Validates one scheduled request against the state after `removed` are dropped.
    fn check(&self, r: &ScheduledRequest<'_>, removed: &FxHashSet<usize>) -> Result<Checked> {
        let bs = self.block_size;
        let known = self
            .index
            .get(r.req_id)
            .copied()
            .filter(|i| !removed.contains(i));
        // The request's table after this step: `head` (kept) followed by `tail` (given).
        let (head, tail, start, compute_start, read, slab): (&[BlockId], _, _, _, _, _) =
            match r.assignment {
                Assignment::Start {
                    block_ids,
                    num_computed_tokens,
                } => {
                    let aligned = num_computed_tokens / bs * bs;
                    (
                        &[],
                        block_ids,
                        num_computed_tokens,
                        aligned,
                        aligned > 0,
                        known,
                    )
                }
                Assignment::Continue {
                    new_block_ids,
                    num_computed_tokens,
                } => {
                    let i = known.ok_or_else(|| Error::UnknownRequest(r.req_id.to_string()))?;
                    let old = &self.slab[i];
                    let start = num_computed_tokens.unwrap_or(old.num_computed_tokens);
                    (
                        &old.block_table,
                        new_block_ids,
                        start,
                        start,
                        false,
                        Some(i),
                    )
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
        if compute_start < end {
            let block = |k: usize| match head.get(k) {
                Some(&b) => b,
                None => tail[k - head.len()],
            };
            let first = compute_start / bs;
            let last = (end - 1) / bs;
            if let Some(k) = (first..=last).find(|&k| block(k) == NULL_BLOCK_ID) {
                return Err(Error::InvalidArgument(format!(
                    "request {:?}: position {} maps to the null block; the hidden-state \
                     cache needs a full-attention KV-cache group",
                    r.req_id,
                    (k * bs).max(compute_start)
                )));
            }
        }
        Ok(Checked {
            slab,
            compute_start,
            num_tokens: end,
            read,
        })
    }

    /// Plans a step: validates every fact, then drops finished requests, bumps the
    /// epoch of every fresh block, updates the tables and records the write spans.
    /// Returns the new step id; `planned()` and `write_slots()` describe the plan.
    /// A previous plan that was never committed is discarded (its rows count as
    /// never written).
    pub fn plan_step(&mut self, input: &StepInput<'_>) -> Result<u64> {
        // ---- validate
        let removed: FxHashSet<usize> = input
            .finished_req_ids
            .iter()
            .filter_map(|id| self.index.get(*id).copied())
            .collect();
        if let Some(fresh) = input.fresh_block_ids {
            for &b in fresh {
                self.check_block(b)?;
            }
        }
        let mut seen: FxHashSet<&str> = FxHashSet::default();
        seen.reserve(input.scheduled.len());
        let mut checked = Vec::with_capacity(input.scheduled.len());
        for r in &input.scheduled {
            if !seen.insert(r.req_id) {
                return Err(Error::InvalidArgument(format!(
                    "request {:?} is scheduled twice in one step",
                    r.req_id
                )));
            }
            checked.push(self.check(r, &removed)?);
        }

        // ---- mutate
        if self.pending_step.is_some() {
            self.stats.uncommitted_steps += 1;
        }
        self.step_id += 1;
        self.stats.steps += 1;
        self.pending.clear();
        for id in &input.finished_req_ids {
            if let Some(i) = self.index.remove(*id) {
                self.slab[i] = RequestSlots::default();
                self.free_slab.push(i);
            }
        }
        if let Some(fresh) = input.fresh_block_ids {
            for &b in fresh {
                self.bump(b);
            }
        }
        let bs = self.block_size;
        for (r, c) in input.scheduled.iter().zip(checked) {
            let slab = match r.assignment {
                Assignment::Start { block_ids, .. } => {
                    let i = match c.slab {
                        Some(i) => i,
                        None => self.insert(r.req_id),
                    };
                    let table = &mut self.slab[i].block_table;
                    table.clear();
                    table.extend_from_slice(block_ids);
                    for &b in &block_ids[c.compute_start / bs..] {
                        self.bump(b);
                    }
                    i
                }
                Assignment::Continue { new_block_ids, .. } => {
                    // `check` proved the request is known.
                    let i = c.slab.unwrap_or_default();
                    self.slab[i].block_table.extend_from_slice(new_block_ids);
                    for &b in new_block_ids {
                        self.bump(b);
                    }
                    i
                }
            };
            self.slab[slab].num_computed_tokens = c.num_tokens;
            self.pending.push(PlannedRequest {
                slab,
                compute_start: c.compute_start,
                num_tokens: c.num_tokens,
                read: c.read,
            });
        }
        self.pending_step = Some(self.step_id);
        Ok(self.step_id)
    }

    fn insert(&mut self, req_id: &str) -> usize {
        let i = match self.free_slab.pop() {
            Some(i) => i,
            None => {
                self.slab.push(RequestSlots::default());
                self.slab.len() - 1
            }
        };
        self.index.insert(req_id.into(), i);
        i
    }

    /// The requests of the last plan, in plan order (empty once committed).
    pub fn planned(&self) -> &[PlannedRequest] {
        &self.pending
    }

    /// Rows the pending step writes (the length of `write_slots()`).
    pub fn num_write_rows(&self) -> usize {
        self.pending
            .iter()
            .map(|p| p.num_tokens - p.compute_start)
            .sum()
    }

    /// The slot of every row the pending step writes, request after request in plan
    /// order, positions `compute_start..num_tokens` of each.
    pub fn write_slots(&self) -> impl Iterator<Item = i64> + '_ {
        let bs = self.block_size;
        self.pending.iter().flat_map(move |p| {
            let table = &self.slab[p.slab].block_table;
            (p.compute_start..p.num_tokens)
                .map(move |pos| (table[pos / bs] as usize * bs + pos % bs) as i64)
        })
    }

    /// Records that the rows of step `step_id` were written, then validates and
    /// returns its reads. Only the pending (last planned) step can be committed,
    /// once.
    pub fn commit(&mut self, step_id: u64) -> Result<StepReads> {
        if self.pending_step != Some(step_id) {
            return Err(Error::InvalidArgument(format!(
                "step {step_id} cannot be committed: the pending step is {}",
                self.pending_step
                    .map_or_else(|| "none".to_string(), |s| s.to_string())
            )));
        }
        let bs = self.block_size;
        // Writes first: a same-step hit reads rows its step wrote.
        for p in &self.pending {
            let table = &self.slab[p.slab].block_table;
            let mut pos = p.compute_start;
            while pos < p.num_tokens {
                let b = table[pos / bs] as usize;
                let r0 = pos % bs;
                let r1 = (p.num_tokens - (pos - r0)).min(bs);
                // Leading rows only: a write past a hole does not extend the count.
                if self.written[b] as usize >= r0 {
                    self.written[b] = self.written[b].max(r1 as u32);
                }
                pos += r1 - r0;
            }
            self.stats.rows_written += (p.num_tokens - p.compute_start) as u64;
        }
        let mut reads = StepReads {
            mirror_id: self.id,
            step_id,
            block_size: bs,
            generation: self.generation,
            entries: Vec::new(),
            misses: Vec::new(),
            blocks: Vec::new(),
        };
        for (i, p) in self.pending.iter().enumerate().filter(|(_, p)| p.read) {
            let table = &self.slab[p.slab].block_table;
            let blocks_start = reads.blocks.len();
            let mut valid = true;
            for (k, &b) in table[..p.num_tokens.div_ceil(bs)].iter().enumerate() {
                let rows = (p.num_tokens - k * bs).min(bs);
                if b == NULL_BLOCK_ID || (self.written[b as usize] as usize) < rows {
                    valid = false;
                    break;
                }
                reads.blocks.push(ReadBlock {
                    block_id: b,
                    epoch: self.epoch[b as usize],
                    rows: rows as u32,
                });
            }
            if valid {
                reads.entries.push(ReadEntry {
                    plan_index: i,
                    num_tokens: p.num_tokens,
                    num_cached_tokens: p.compute_start,
                    blocks_start,
                });
                self.stats.reads_served += 1;
                self.stats.cached_rows_served += p.compute_start as u64;
            } else {
                reads.blocks.truncate(blocks_start);
                reads.misses.push(i);
                self.stats.read_misses += 1;
            }
        }
        self.pending.clear();
        self.pending_step = None;
        self.stats.committed_steps += 1;
        Ok(reads)
    }

    /// Re-checks reads taken earlier (a delayed gather): an entry any of whose blocks
    /// was reassigned since (its epoch moved on) becomes a miss, even when the new
    /// occupant has written every row. Returns how many entries became misses.
    pub fn revalidate(&mut self, reads: &mut StepReads) -> Result<usize> {
        if reads.mirror_id != self.id {
            return Err(Error::InvalidArgument(
                "these reads were taken from another SlotMirror".into(),
            ));
        }
        if reads.generation == self.generation {
            return Ok(0);
        }
        let mut keep = Vec::with_capacity(reads.entries.len());
        let mut stale = Vec::new();
        for (i, e) in reads.entries.iter().enumerate() {
            let ok = reads.entry_blocks(i).iter().all(|rb| {
                let b = rb.block_id as usize;
                self.epoch[b] == rb.epoch && self.written[b] >= rb.rows
            });
            if ok {
                keep.push(*e);
            } else {
                stale.push(e.plan_index);
            }
        }
        let n = stale.len();
        reads.entries = keep;
        reads.misses.extend(stale);
        reads.misses.sort_unstable();
        reads.generation = self.generation;
        self.stats.stale_reads += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start<'a>(
        req_id: &'a str,
        block_ids: &'a [BlockId],
        hit: usize,
        n: usize,
    ) -> ScheduledRequest<'a> {
        ScheduledRequest {
            req_id,
            assignment: Assignment::Start {
                block_ids,
                num_computed_tokens: hit,
            },
            num_scheduled_tokens: n,
        }
    }

    fn cont<'a>(req_id: &'a str, new_block_ids: &'a [BlockId], n: usize) -> ScheduledRequest<'a> {
        ScheduledRequest {
            req_id,
            assignment: Assignment::Continue {
                new_block_ids,
                num_computed_tokens: None,
            },
            num_scheduled_tokens: n,
        }
    }

    fn step(m: &mut SlotMirror, scheduled: Vec<ScheduledRequest<'_>>) -> (Vec<i64>, StepReads) {
        let id = m
            .plan_step(&StepInput {
                scheduled,
                ..Default::default()
            })
            .unwrap();
        let slots = m.write_slots().collect();
        (slots, m.commit(id).unwrap())
    }

    #[test]
    fn write_slots_follow_the_block_table() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        let (slots, reads) = step(&mut m, vec![start("a", &[3, 7], 0, 6)]);
        assert_eq!(slots, vec![12, 13, 14, 15, 28, 29]);
        assert!(reads.entries().is_empty() && reads.misses().is_empty());
        let (slots, _) = step(&mut m, vec![cont("a", &[], 2)]);
        assert_eq!(slots, vec![30, 31]);
        let (slots, _) = step(&mut m, vec![cont("a", &[2], 1)]);
        assert_eq!(slots, vec![8]);
        assert_eq!(m.block_table("a").unwrap(), &[3, 7, 2]);
        assert_eq!(m.num_computed_tokens("a").unwrap(), 9);
    }

    #[test]
    fn hit_after_write_reads_cached_and_new_rows() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3, 7, 2], 0, 10)]);
        let (slots, reads) = step(&mut m, vec![start("b", &[3, 7, 5], 8, 3)]);
        assert_eq!(slots, vec![20, 21, 22]);
        assert_eq!(reads.entries().len(), 1);
        let e = reads.entries()[0];
        assert_eq!(
            (e.plan_index, e.num_tokens, e.num_cached_tokens),
            (0, 11, 8)
        );
        let read: Vec<i64> = reads.slots().collect();
        assert_eq!(read, vec![12, 13, 14, 15, 28, 29, 30, 31, 20, 21, 22]);
        assert_eq!(m.stats().cached_rows_served, 8);
    }

    #[test]
    fn same_step_hit_is_served_because_writes_land_first() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        // b is planned before a, yet a's writes of this step validate b's read.
        let (_, reads) = step(
            &mut m,
            vec![start("b", &[3, 6], 4, 1), start("a", &[3, 7], 0, 8)],
        );
        assert_eq!(reads.entries().len(), 1);
        assert_eq!(reads.entries()[0].plan_index, 0);
        assert_eq!(reads.slots().collect::<Vec<_>>(), vec![12, 13, 14, 15, 24]);
    }

    #[test]
    fn hit_on_rows_never_written_is_a_miss() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        // a's chunk covers only 2 rows of block 3; b claims the full block.
        let (_, reads) = step(
            &mut m,
            vec![start("a", &[3, 7], 0, 2), start("b", &[3, 6], 4, 1)],
        );
        assert!(reads.entries().is_empty());
        assert_eq!(reads.misses(), &[1]);
        assert_eq!(m.stats().read_misses, 1);
    }

    #[test]
    fn uncommitted_step_rows_count_as_unwritten() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        m.plan_step(&StepInput {
            scheduled: vec![start("a", &[3], 0, 4)],
            ..Default::default()
        })
        .unwrap();
        // Never committed: the next plan discards it.
        let (_, reads) = step(&mut m, vec![start("b", &[3, 6], 4, 1)]);
        assert_eq!(reads.misses(), &[0]);
        assert_eq!(m.stats().uncommitted_steps, 1);
    }

    #[test]
    fn reassigned_block_invalidates_old_rows() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3], 0, 4)]);
        assert_eq!(m.block_state(3).unwrap(), (1, 4));
        // a finishes; block 3 goes to c as a fresh block, c writes 2 rows.
        let id = m
            .plan_step(&StepInput {
                finished_req_ids: vec!["a"],
                scheduled: vec![start("c", &[3], 0, 2)],
                ..Default::default()
            })
            .unwrap();
        m.commit(id).unwrap();
        assert_eq!(m.block_state(3).unwrap(), (2, 2));
        let (_, reads) = step(&mut m, vec![start("b", &[3, 6], 4, 1)]);
        assert_eq!(reads.misses(), &[0]);
    }

    #[test]
    fn delayed_read_after_reuse_is_detected_even_when_fully_rewritten() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3], 0, 4)]);
        let (_, mut reads) = step(&mut m, vec![start("b", &[3, 6], 4, 1)]);
        assert_eq!(reads.entries().len(), 1);
        let mut unchanged = reads.clone();
        assert_eq!(m.revalidate(&mut unchanged).unwrap(), 0);
        // Both finish; block 3 is reused by c, which rewrites all of it.
        let id = m
            .plan_step(&StepInput {
                finished_req_ids: vec!["a", "b"],
                scheduled: vec![start("c", &[3], 0, 4)],
                ..Default::default()
            })
            .unwrap();
        m.commit(id).unwrap();
        assert_eq!(m.block_state(3).unwrap(), (2, 4));
        assert_eq!(m.revalidate(&mut reads).unwrap(), 1);
        assert!(reads.entries().is_empty());
        assert_eq!(reads.misses(), &[0]);
        assert_eq!(m.stats().stale_reads, 1);
    }

    #[test]
    fn non_aligned_hit_recomputes_the_gap() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3, 7], 0, 8)]);
        // An external hit of 6 tokens: the cached span ends at 4, rows 4.. are computed.
        let id = m
            .plan_step(&StepInput {
                scheduled: vec![start("b", &[3, 5, 6], 6, 3)],
                ..Default::default()
            })
            .unwrap();
        let p = m.planned()[0];
        assert_eq!((p.compute_start, p.num_tokens, p.read), (4, 9, true));
        assert_eq!(
            m.write_slots().collect::<Vec<_>>(),
            vec![20, 21, 22, 23, 24]
        );
        let reads = m.commit(id).unwrap();
        assert_eq!(reads.entries()[0].num_cached_tokens, 4);
        assert_eq!(reads.num_rows(), 9);
        // A hit shorter than a block reads nothing and recomputes everything.
        let id = m
            .plan_step(&StepInput {
                scheduled: vec![start("c", &[8], 3, 1)],
                ..Default::default()
            })
            .unwrap();
        let p = m.planned()[0];
        assert_eq!((p.compute_start, p.num_tokens, p.read), (0, 4, false));
        m.commit(id).unwrap();
    }

    #[test]
    fn fresh_block_ids_turn_hit_blocks_into_misses() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3], 0, 4)]);
        // An external load reuses block 3 for b: vLLM reports it in new_block_ids_to_zero.
        let id = m
            .plan_step(&StepInput {
                finished_req_ids: vec!["a"],
                scheduled: vec![start("b", &[3, 6], 4, 1)],
                fresh_block_ids: Some(&[3, 6]),
            })
            .unwrap();
        assert_eq!(m.commit(id).unwrap().misses(), &[0]);
    }

    #[test]
    fn resumed_request_replaces_its_table() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3, 7], 0, 6)]);
        let (slots, reads) = step(&mut m, vec![start("a", &[3, 2], 4, 3)]);
        assert_eq!(slots, vec![8, 9, 10]);
        assert_eq!(m.block_table("a").unwrap(), &[3, 2]);
        assert_eq!(reads.entries()[0].num_tokens, 7);
    }

    #[test]
    fn bad_input_leaves_the_mirror_unchanged() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3], 0, 4)]);
        let before = (m.step_id(), m.block_state(3).unwrap(), m.num_requests());
        let bad: Vec<StepInput<'_>> = vec![
            StepInput {
                scheduled: vec![cont("x", &[], 1)],
                ..Default::default()
            },
            StepInput {
                scheduled: vec![start("b", &[3, 10], 0, 5)],
                ..Default::default()
            },
            StepInput {
                scheduled: vec![start("b", &[4], 0, 5)],
                ..Default::default()
            },
            StepInput {
                scheduled: vec![start("b", &[0], 0, 1)],
                ..Default::default()
            },
            StepInput {
                scheduled: vec![start("b", &[4], 0, 1), start("b", &[5], 0, 1)],
                ..Default::default()
            },
            StepInput {
                finished_req_ids: vec!["a"],
                scheduled: vec![start("b", &[3, 4], 0, 5), cont("a", &[], 1)],
                ..Default::default()
            },
            StepInput {
                scheduled: vec![cont("a", &[5], usize::MAX)],
                fresh_block_ids: Some(&[3]),
                ..Default::default()
            },
        ];
        let kinds: Vec<_> = bad
            .iter()
            .map(|input| m.plan_step(input).unwrap_err().kind())
            .collect();
        use crate::error::ErrorKind as K;
        assert_eq!(
            kinds,
            vec![
                K::UnknownRequest,
                K::BlockIdOutOfRange,
                K::InvalidArgument,
                K::InvalidArgument,
                K::InvalidArgument,
                K::UnknownRequest,
                K::InvalidArgument,
            ]
        );
        assert_eq!(
            (m.step_id(), m.block_state(3).unwrap(), m.num_requests()),
            before
        );
        assert_eq!(m.block_table("a").unwrap(), &[3]);
        assert_eq!(m.commit(7).unwrap_err().kind(), K::InvalidArgument);
    }

    #[test]
    fn reads_of_another_mirror_are_rejected() {
        let mut m = SlotMirror::new(10, 4).unwrap();
        let mut other = SlotMirror::new(10, 4).unwrap();
        step(&mut m, vec![start("a", &[3], 0, 4)]);
        let (_, mut reads) = step(&mut m, vec![start("b", &[3, 6], 4, 1)]);
        assert_eq!(
            other.revalidate(&mut reads).unwrap_err().kind(),
            crate::error::ErrorKind::InvalidArgument
        );
    }

    /// Random traces against a naive model: every served read covers rows written
    /// after the last fresh assignment of their block, and reads are refused only
    /// when some row was not.
    #[test]
    fn random_traces_match_a_naive_model() {
        let mut rng: u64 = 0x1234_5678;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let bs = 4;
        let mut m = SlotMirror::new(16, bs).unwrap();
        // Naive model: per slot, the "generation" of its current occupant and
        // whether it was written in it.
        let mut gen = [0u64; 16];
        let mut ok = vec![false; 16 * bs];
        let mut tables: FxHashMap<String, Vec<BlockId>> = FxHashMap::default();
        for s in 0..400 {
            let rid = format!("r{s}");
            let nblocks = 1 + next(3);
            let donor = tables.values().next().cloned();
            let mut table: Vec<BlockId> = Vec::new();
            let mut hit = 0;
            if let Some(d) = donor.filter(|_| next(2) == 0) {
                let k = next(d.len() + 1);
                table.extend_from_slice(&d[..k]);
                hit = k * bs;
            }
            let target = nblocks.max(table.len() + 1);
            while table.len() < target {
                table.push(1 + next(15) as BlockId);
            }
            let fresh: Vec<BlockId> = table[hit / bs..].to_vec();
            if fresh.iter().any(|b| table[..hit / bs].contains(b))
                || fresh
                    .iter()
                    .enumerate()
                    .any(|(i, b)| fresh[..i].contains(b))
            {
                continue;
            }
            let n = 1 + next(table.len() * bs - hit);
            let commit = next(5) != 0;
            let id = m
                .plan_step(&StepInput {
                    finished_req_ids: tables.keys().map(|k| k.as_str()).collect(),
                    scheduled: vec![start(&rid, &table, hit, n)],
                    ..Default::default()
                })
                .unwrap();
            for &b in &fresh {
                gen[b as usize] += 1;
                for r in 0..bs {
                    ok[b as usize * bs + r] = false;
                }
            }
            tables.clear();
            if !commit {
                continue;
            }
            for pos in hit..hit + n {
                let b = table[pos / bs] as usize;
                // leading rows only
                if pos % bs == 0 || ok[b * bs + pos % bs - 1] {
                    ok[b * bs + pos % bs] = true;
                }
            }
            let reads = m.commit(id).unwrap();
            let want_read = hit > 0;
            let valid = (0..hit + n).all(|pos| ok[table[pos / bs] as usize * bs + pos % bs]);
            if want_read {
                assert_eq!(reads.entries().len() == 1, valid, "step {s}");
                assert_eq!(reads.misses().len() == 1, !valid, "step {s}");
            } else {
                assert!(reads.entries().is_empty() && reads.misses().is_empty());
            }
            for &b in &table {
                assert_eq!(m.block_state(b).unwrap().0, gen[b as usize]);
            }
            tables.insert(rid, table);
        }
        let st = m.stats();
        assert!(st.reads_served > 20 && st.read_misses > 20, "{st:?}");
        assert!(st.uncommitted_steps > 20, "{st:?}");
    }
}
