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
//!  plan_step(facts)            forward pass            commit(step)
//!  ├ drop finished requests    rows for every          ├ written counts advance over
//!  ├ version bump of every     planned span            │ the step's write spans
//!  │ fresh / loaded block      [compute_start, end)    ├ validate each read:
//!  ├ tables extended/replaced  (index_copy_ through    │ rows [0, end) of its table
//!  └ write spans + slots       the write slots)        └ → StepReads (slots to gather)
//! ```
//!
//! Key properties:
//! - **Versions.** Every block has a version (`epoch`), bumped whenever the block is
//!   assigned to a request as a fresh (non-hit) block or loaded by a KV connector,
//!   and counts of its leading rows written in that version. A bump resets the
//!   counts: rows left by an earlier occupant are never valid again (a block evicted
//!   and reused never serves the previous owner's rows).
//! - **Two key classes.** Keys produced by every layer are written for every planned
//!   row; keys produced by KV-sharing *skip layers* (`--kv-sharing-fast-prefill`) only
//!   for the rows those layers computed (a request's last `kept` rows, see
//!   [`crate::prefill_skip`]). Each block counts its written rows per class, so a hit
//!   whose skip-layer rows were never computed is served for the other keys only and
//!   reported (`partial_reads`), never with rows that were not written.
//! - **Validated reads.** A request's first schedule (new, resumed, or re-added by
//!   the v2 model runner) with a hit reads its rows `[0, end)` from the cache; the
//!   read is served only if every block covering them is not the null block and has
//!   all the needed rows written in its current version. Otherwise it is a reported
//!   miss: its cached rows are never served (no zeros, no other request's rows).
//! - **Writes before reads.** Validation happens in `commit`, after the step's
//!   writes are counted, so a same-step hit (request B hits blocks that request A
//!   computes in this very step, which vLLM allows because it caches block hashes at
//!   allocation) is served from A's fresh rows. A step that is planned but never
//!   committed (an aborted request, a failed forward) writes nothing: its fresh blocks
//!   stay unwritten and a later hit on them is a miss.
//! - **Spans are block aligned.** The cached span of a hit ends at
//!   `floor(hit / block_size) * block_size` and the request's computed span starts
//!   at that same boundary. A non-aligned hit (an external KV connector's) therefore
//!   recomputes the gap rows instead of leaving a hole; the caller's forward pass
//!   produces rows for `[compute_start, end)`, which then may start before vLLM's
//!   `num_computed_tokens`. Local prefix-cache hits are always aligned.
//! - **Connector loads are not trusted.** The blocks a KV connector loaded for a
//!   request (its `num_external_tokens`, the tail of its hit) are bumped like fresh
//!   blocks, so reads over them are misses, unless the connector vouches for a
//!   block with the version its rows were saved under and that is still the block's
//!   version ([`StepInput::connector_versions`]). vLLM's `new_block_ids_to_zero`,
//!   when sent, also marks fresh blocks.
//! - **Delayed reads are revalidated.** `StepReads` records the version of every
//!   block it reads; `revalidate` turns an entry whose block was reassigned since into
//!   a miss, even if the new occupant has written all its rows.
//! - **Plan, then apply.** `plan_step` first computes the whole plan (pure, may fail)
//!   and then applies it (cannot fail); `commit` validates its step reference before
//!   it changes anything. An `Err` leaves the mirror exactly as it was; a failed
//!   allocation is [`Error::OutOfMemory`], never an abort.
//!
//! Layout: per block, struct-of-arrays `epoch` and `written` (the two key classes'
//! counts side by side: a commit touches one line per block); 16 bytes a block,
//! allocated zeroed, so untouched pages cost nothing. Per request, a [`RequestTable`] of
//! block tables with the last block inline, so a decode step (one row in the last
//! block) never reads the table. A decode step allocates nothing per block.
//!
//! Scope: the mirror follows one KV-cache group, chosen by the caller (the binding
//! takes it from vLLM's per-group `block_ids` tuples; `hscache.hidden_states` picks the
//! group that carries full-attention positions). Hidden states are one row per token,
//! and a full-attention group's table maps every position to a distinct block;
//! keying by every group would multiply the memory by the number of groups for no
//! extra information. Sliding-window and Mamba groups put the null block where the
//! window skipped or keep one state block, so a plan over such a group fails.

mod commit;
mod ledger;
mod omni_rules;
mod plan;
#[cfg(test)]
mod tests;

use crate::alloc::zeroed_vec;
use crate::error::{Error, Result};
use crate::prefill_skip::PrefillSkip;
use crate::request_table::{RequestHandle, RequestTable};
use crate::types::BlockId;

pub use commit::{ReadEntry, StepReads};
pub use ledger::StepLedger;
pub use omni_rules::{
    OmniRuleError, OmniStepRules, Picks, SavePlan, SavedStep, Served, UnservableReason,
};
pub use plan::{Assignment, PrefillSkipRequest, ScheduledRequest, StepInput};

/// The block size, with shift / mask for the (usual) power of two: a decode step maps
/// positions to slots without a 64-bit division.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BlockSize {
    size: usize,
    /// `log2(size)` when `size` is a power of two, else `u32::MAX`.
    shift: u32,
}

impl BlockSize {
    fn new(size: usize) -> Self {
        let shift = if size.is_power_of_two() {
            size.trailing_zeros()
        } else {
            u32::MAX
        };
        Self { size, shift }
    }

    /// `pos / size`.
    #[inline]
    fn div(self, pos: usize) -> usize {
        if self.shift != u32::MAX {
            pos >> self.shift
        } else {
            pos / self.size
        }
    }

    /// `pos % size`.
    #[inline]
    fn rem(self, pos: usize) -> usize {
        if self.shift != u32::MAX {
            pos & (self.size - 1)
        } else {
            pos % self.size
        }
    }

    /// The slot of position `pos` in block `block`.
    #[inline]
    fn slot(self, block: BlockId, pos: usize) -> i64 {
        (block as usize * self.size + self.rem(pos)) as i64
    }
}

/// Names one planned step of one mirror (what `commit` takes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRef {
    pub mirror_id: u64,
    pub step_id: u64,
}

/// One request of the pending step, in plan order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedRequest {
    handle: RequestHandle,
    /// First position whose row this step computes (block aligned on a hit).
    pub compute_start: usize,
    /// One past the last position computed this step.
    pub num_tokens: usize,
    /// How many of the last rows the KV-sharing skip layers compute (all of them
    /// without fast prefill).
    pub kept: usize,
    /// Whether the request reads its rows `[0, num_tokens)` from the cache.
    pub read: bool,
    /// The block of every computed row when they all lie in one block (a decode step):
    /// writes then need not read the request's table.
    single_block: Option<BlockId>,
}

impl PlannedRequest {
    /// The block of position `pos` (one of the planned rows).
    #[inline]
    fn block_of(&self, table: &[BlockId], pos: usize, bs: BlockSize) -> BlockId {
        match self.single_block {
            Some(b) => b,
            None => table[bs.div(pos)],
        }
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
    /// Version bumps (fresh and connector-loaded block assignments).
    pub fresh_blocks: u64,
    /// Connector-loaded blocks whose rows were distrusted (bumped).
    pub untrusted_loaded_blocks: u64,
    /// Connector-loaded blocks kept because their vouched version matched.
    pub vouched_blocks: u64,
    /// Rows counted as written by commits (keys of every layer).
    pub rows_written: u64,
    /// Rows of skip-layer keys not computed (fast prefill skipped their tokens).
    pub skipped_rows: u64,
    /// Reads served by commits.
    pub reads_served: u64,
    /// Rows of those reads that came from earlier steps' writes or other requests.
    pub cached_rows_served: u64,
    /// Served reads whose skip-layer keys were refused (rows never computed).
    pub partial_reads: u64,
    /// Reads refused at commit (a row not written in its block's current version).
    pub read_misses: u64,
    /// Served reads later turned into misses by `revalidate` (block reassigned).
    pub stale_reads: u64,
}

#[derive(Clone, Debug, Default)]
struct RequestSlots {
    block_table: Vec<BlockId>,
    /// `block_table.last()` (0 when empty), kept inline: a decode step plans its row
    /// from it without reading the table.
    last_block: BlockId,
    num_computed_tokens: usize,
    /// The prompt length, when the request's first schedule said it.
    num_prompt_tokens: Option<usize>,
}

static NEXT_MIRROR_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Deliberate defects, for tests that must fail on a broken mirror: the Rust tests and
/// the differential against vllm-omni's cache (`SlotMirror::break_rule_for_tests`, the
/// binding's `_break_rule`). The way to set them is compiled only for tests (`cfg(test)`
/// and the `mutants` feature): in a release build they stay off, one predictable branch
/// per bump and commit.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Faults {
    /// Reuse does not bump the version (stale rows of the previous owner stay valid).
    pub no_bump: bool,
    /// Reads are validated before the step's writes are counted.
    pub reads_before_writes: bool,
    /// A plan replaced without a commit counts its rows as written.
    pub uncommitted_written: bool,
    /// Connector-loaded blocks are trusted.
    pub trust_connector: bool,
    /// Skip-layer keys count every planned row as written.
    pub ignore_skip: bool,
}

/// The worker-side slot mirror (see module docs).
#[derive(Debug)]
pub struct SlotMirror {
    id: u64,
    block_size: usize,
    bs: BlockSize,
    num_blocks: u32,
    epoch: Vec<u64>,
    /// Leading rows written in the current version, per key class
    /// (`[EVERY_LAYER, SKIP_LAYERS]`): one cache line access per block in a commit.
    written: Vec<[u32; 2]>,
    requests: RequestTable<RequestSlots>,
    step_id: u64,
    /// Bumped with any version: reads taken at an unchanged generation are still valid.
    generation: u64,
    pending: Vec<PlannedRequest>,
    pending_step: Option<u64>,
    /// The pending step's reduced batch, when it was planned with fast prefill.
    prefill_skip: PrefillSkip,
    has_prefill_skip: bool,
    plan_buf: plan::Plan,
    stats: SlotStats,
    faults: Faults,
}

/// Index into [`SlotMirror`]'s per-block written counts: keys of every layer.
const EVERY_LAYER: usize = 0;
/// Index into [`SlotMirror`]'s per-block written counts: keys of the skip layers.
const SKIP_LAYERS: usize = 1;

impl SlotMirror {
    /// A mirror of `num_blocks` blocks of `block_size` slots (block 0 is the null block).
    pub fn new(num_blocks: u32, block_size: usize) -> Result<Self> {
        if num_blocks == 0 || block_size == 0 || block_size > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "num_blocks and block_size must be positive (block_size < 2^32), \
                 got {num_blocks} and {block_size}"
            )));
        }
        if u128::from(num_blocks) * (block_size as u128) > i64::MAX as u128 {
            return Err(Error::InvalidArgument(
                "num_blocks * block_size overflows an int64 slot id".into(),
            ));
        }
        let n = num_blocks as usize;
        Ok(Self {
            id: NEXT_MIRROR_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            block_size,
            bs: BlockSize::new(block_size),
            num_blocks,
            epoch: zeroed_vec(n, "slot mirror block versions")?,
            written: zeroed_vec(n, "slot mirror written rows")?,
            requests: RequestTable::default(),
            step_id: 0,
            generation: 0,
            pending: Vec::new(),
            pending_step: None,
            prefill_skip: PrefillSkip::default(),
            has_prefill_skip: false,
            plan_buf: plan::Plan::default(),
            stats: SlotStats::default(),
            faults: Faults::default(),
        })
    }

    #[cfg(test)]
    pub(crate) fn with_faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// The rule names [`Self::break_rule_for_tests`] accepts.
    #[cfg(any(test, feature = "mutants"))]
    pub const RULE_MUTANTS: [&'static str; 5] = [
        "no_bump",
        "reads_before_writes",
        "uncommitted_written",
        "trust_connector",
        "ignore_skip",
    ];

    /// Test only: breaks one of the mirror's rules (a name of [`Self::RULE_MUTANTS`]),
    /// so that a differential can prove it notices; the mirror must then be thrown away.
    #[cfg(any(test, feature = "mutants"))]
    pub fn break_rule_for_tests(&mut self, name: &str) -> Result<()> {
        let f = &mut self.faults;
        match name {
            "no_bump" => f.no_bump = true,
            "reads_before_writes" => f.reads_before_writes = true,
            "uncommitted_written" => f.uncommitted_written = true,
            "trust_connector" => f.trust_connector = true,
            "ignore_skip" => f.ignore_skip = true,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "no slot-mirror rule mutant {name:?} (known: {:?})",
                    Self::RULE_MUTANTS
                )))
            }
        }
        Ok(())
    }

    /// This mirror's id: plans and reads carry it, and other mirrors refuse them.
    pub fn id(&self) -> u64 {
        self.id
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

    /// The planned step awaiting its commit, if any.
    pub fn pending_step(&self) -> Option<StepRef> {
        self.pending_step.map(|step_id| StepRef {
            mirror_id: self.id,
            step_id,
        })
    }

    pub fn stats(&self) -> SlotStats {
        self.stats
    }

    /// Requests the mirror holds a table for.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// `(version, leading rows written in it)` of a block (keys of every layer).
    pub fn block_state(&self, block_id: BlockId) -> Result<(u64, usize)> {
        let b = self.check_block(block_id)?;
        Ok((self.epoch[b], self.written[b][EVERY_LAYER] as usize))
    }

    /// Leading rows of the skip-layer keys written in the block's current version.
    pub fn block_skip_rows(&self, block_id: BlockId) -> Result<usize> {
        let b = self.check_block(block_id)?;
        Ok(self.written[b][SKIP_LAYERS] as usize)
    }

    /// The block table the mirror holds for a request.
    pub fn block_table(&self, req_id: &str) -> Result<&[BlockId]> {
        Ok(&self.request(req_id)?.block_table)
    }

    /// Where the mirror's last plan for a request ended.
    pub fn num_computed_tokens(&self, req_id: &str) -> Result<usize> {
        Ok(self.request(req_id)?.num_computed_tokens)
    }

    /// The requests of the pending plan, in plan order (empty once committed).
    pub fn planned(&self) -> &[PlannedRequest] {
        &self.pending
    }

    /// The pending step's reduced batch of the KV-sharing layers, when it was
    /// planned with [`StepInput::prefill_skip`].
    pub fn pending_prefill_skip(&self) -> Option<&PrefillSkip> {
        (self.pending_step.is_some() && self.has_prefill_skip).then_some(&self.prefill_skip)
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
        self.slots_of(|p| p.compute_start)
    }

    /// Rows the skip layers compute in the pending step (`kept_write_slots()`'s length).
    pub fn num_kept_rows(&self) -> usize {
        self.pending.iter().map(|p| p.kept).sum()
    }

    /// The slot of every row the skip layers compute: the last `kept` rows of each
    /// planned request, in plan order.
    pub fn kept_write_slots(&self) -> impl Iterator<Item = i64> + '_ {
        self.slots_of(|p| p.num_tokens - p.kept)
    }

    fn slots_of(
        &self,
        start: impl Fn(&PlannedRequest) -> usize + 'static,
    ) -> impl Iterator<Item = i64> + '_ {
        let bs = self.bs;
        self.pending.iter().flat_map(move |p| {
            let table: &[BlockId] = match p.single_block {
                Some(_) => &[],
                None => &self.requests[p.handle].block_table,
            };
            (start(p)..p.num_tokens).map(move |pos| bs.slot(p.block_of(table, pos, bs), pos))
        })
    }

    fn request(&self, req_id: &str) -> Result<&RequestSlots> {
        self.requests
            .get(req_id)
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
        if self.faults.no_bump {
            return;
        }
        let b = block_id as usize;
        self.epoch[b] += 1;
        self.written[b] = [0, 0];
        self.generation += 1;
        self.stats.fresh_blocks += 1;
    }
}
