//! Committing a step of the slot mirror: the step's writes are counted, then its
//! reads validated (writes first, so same-step hits see this step's rows); and the
//! re-check of reads gathered later (`revalidate`).

use super::{BlockSize, PlannedRequest, SlotMirror, StepRef, EVERY_LAYER, SKIP_LAYERS};
use crate::error::{Error, Result};
use crate::types::{BlockId, NULL_BLOCK_ID};

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
    /// Whether the skip-layer keys are served too (all their rows were computed);
    /// otherwise only the keys of every layer are.
    pub skip_layers: bool,
    blocks_start: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReadBlock {
    block_id: BlockId,
    epoch: u64,
}

/// The validated reads of one committed step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepReads {
    mirror_id: u64,
    /// The step the reads were planned in.
    pub step_id: u64,
    bs: BlockSize,
    generation: u64,
    entries: Vec<ReadEntry>,
    misses: Vec<usize>,
    /// Per miss (same order): the first block of its cached prefix that failed
    /// validation (not written in its current version, or reassigned since); the null
    /// block when the failure is elsewhere (a null block in the table, this step's rows).
    miss_blocks: Vec<BlockId>,
    blocks: Vec<ReadBlock>,
}

impl StepReads {
    /// The mirror the reads belong to.
    pub fn mirror_id(&self) -> u64 {
        self.mirror_id
    }

    /// The served reads, in plan order.
    pub fn entries(&self) -> &[ReadEntry] {
        &self.entries
    }

    /// Plan indices of the requests whose read is a miss (never served).
    pub fn misses(&self) -> &[usize] {
        &self.misses
    }

    /// Per miss (the order of [`Self::misses`]): the first block of the read's cached
    /// prefix that failed validation, the block to recompute from; the null block when
    /// there is none (the table maps a read position to the null block, or the failure
    /// is in this step's own rows).
    pub fn miss_blocks(&self) -> &[BlockId] {
        &self.miss_blocks
    }

    /// Total rows of the served reads.
    pub fn num_rows(&self) -> usize {
        self.entries.iter().map(|e| e.num_tokens).sum()
    }

    /// Total rows of the reads served for the skip-layer keys too.
    pub fn num_skip_layer_rows(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.skip_layers)
            .map(|e| e.num_tokens)
            .sum()
    }

    /// The slot of every served row, entry after entry (int64, as torch indexes).
    pub fn slots(&self) -> impl Iterator<Item = i64> + '_ {
        self.slots_of(false)
    }

    /// The slots of the reads served for the skip-layer keys too, entry after entry.
    pub fn skip_layer_slots(&self) -> impl Iterator<Item = i64> + '_ {
        self.slots_of(true)
    }

    fn slots_of(&self, skip_layers_only: bool) -> impl Iterator<Item = i64> + '_ {
        let bs = self.bs;
        let entries = self
            .entries
            .iter()
            .filter(move |e| e.skip_layers || !skip_layers_only);
        entries.flat_map(move |e| {
            let blocks = &self.blocks[e.blocks_start..];
            (0..e.num_tokens).map(move |pos| bs.slot(blocks[bs.div(pos)].block_id, pos))
        })
    }

    fn entry_blocks(&self, e: &ReadEntry) -> &[ReadBlock] {
        let n = e.num_tokens.div_ceil(self.bs.size);
        &self.blocks[e.blocks_start..e.blocks_start + n]
    }
}

/// Advances key class `class`'s leading-row counts of the blocks under positions
/// `from..to` of planned request `p`: a block's count grows only over rows that
/// continue it (a write past a hole does not make the hole valid).
fn advance(
    written: &mut [[u32; 2]],
    class: usize,
    p: &PlannedRequest,
    table: &[BlockId],
    bs: BlockSize,
    from: usize,
    to: usize,
) {
    let mut pos = from;
    while pos < to {
        let b = p.block_of(table, pos, bs) as usize;
        let r0 = bs.rem(pos);
        let r1 = (to - (pos - r0)).min(bs.size);
        let count = &mut written[b][class];
        if *count as usize >= r0 {
            *count = (*count).max(r1 as u32);
        }
        pos += r1 - r0;
    }
}

impl SlotMirror {
    /// Records that the rows of `step` were written, then validates and returns its
    /// reads. Only the pending (last planned) step of this mirror can be committed,
    /// once.
    pub fn commit(&mut self, step: StepRef) -> Result<StepReads> {
        if step.mirror_id != self.id {
            return Err(Error::InvalidArgument(format!(
                "step {} was planned by another SlotMirror (id {}, this one is {}): a \
                 cache commits only its own plans",
                step.step_id, step.mirror_id, self.id
            )));
        }
        if self.pending_step != Some(step.step_id) {
            return Err(Error::InvalidArgument(format!(
                "step {} cannot be committed: the pending step is {}",
                step.step_id,
                self.pending_step
                    .map_or_else(|| "none".to_string(), |s| s.to_string())
            )));
        }
        let reads = if self.faults.reads_before_writes {
            let reads = self.validate_reads(step.step_id);
            self.count_writes();
            reads
        } else {
            self.count_writes();
            self.validate_reads(step.step_id)
        };
        self.pending.clear();
        self.pending_step = None;
        self.has_prefill_skip = false;
        self.stats.committed_steps += 1;
        Ok(reads)
    }

    /// Counts the pending step's rows as written (both key classes).
    pub(super) fn count_writes(&mut self) {
        let bs = self.bs;
        let ignore_skip = self.faults.ignore_skip;
        for p in &self.pending {
            let table: &[BlockId] = match p.single_block {
                Some(_) => &[],
                None => &self.requests[p.handle].block_table,
            };
            let (from, to) = (p.compute_start, p.num_tokens);
            advance(&mut self.written, EVERY_LAYER, p, table, bs, from, to);
            let skip_from = if ignore_skip { from } else { to - p.kept };
            advance(&mut self.written, SKIP_LAYERS, p, table, bs, skip_from, to);
            let span = (p.num_tokens - p.compute_start) as u64;
            self.stats.rows_written += span;
            self.stats.skipped_rows += span - p.kept as u64;
        }
    }

    /// Validates the pending step's reads against the current counts.
    fn validate_reads(&mut self, step_id: u64) -> StepReads {
        let bs = self.block_size;
        let mut reads = StepReads {
            mirror_id: self.id,
            step_id,
            bs: self.bs,
            generation: self.generation,
            entries: Vec::new(),
            misses: Vec::new(),
            miss_blocks: Vec::new(),
            blocks: Vec::new(),
        };
        for (i, p) in self.pending.iter().enumerate().filter(|(_, p)| p.read) {
            let table = &self.requests[p.handle].block_table;
            let blocks_start = reads.blocks.len();
            let mut failed = None;
            let mut skip_layers = true;
            for (k, &b) in table[..p.num_tokens.div_ceil(bs)].iter().enumerate() {
                let rows = (p.num_tokens - k * bs).min(bs) as u32;
                let [every, skip] = self.written[b as usize];
                if b == NULL_BLOCK_ID || every < rows {
                    // Only a block of the cached prefix can be reported for recomputation;
                    // this step's own rows are counted before (never, but for a mutant).
                    failed = Some(if k * bs < p.compute_start {
                        b
                    } else {
                        NULL_BLOCK_ID
                    });
                    break;
                }
                skip_layers &= skip >= rows;
                reads.blocks.push(ReadBlock {
                    block_id: b,
                    epoch: self.epoch[b as usize],
                });
            }
            if let Some(b) = failed {
                reads.blocks.truncate(blocks_start);
                reads.misses.push(i);
                reads.miss_blocks.push(b);
                self.stats.read_misses += 1;
            } else {
                reads.entries.push(ReadEntry {
                    plan_index: i,
                    num_tokens: p.num_tokens,
                    num_cached_tokens: p.compute_start,
                    skip_layers,
                    blocks_start,
                });
                self.stats.reads_served += 1;
                self.stats.cached_rows_served += p.compute_start as u64;
                self.stats.partial_reads += u64::from(!skip_layers);
            }
        }
        reads
    }

    /// Re-checks reads taken earlier (a delayed gather): an entry any of whose blocks
    /// was reassigned since (its version moved on) becomes a miss, even when the new
    /// occupant has written every row. Counts only grow within a version, so an
    /// unchanged version means every row the read needs is still there. Returns how
    /// many entries became misses.
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
        for e in &reads.entries {
            let bs = self.block_size;
            let moved = reads
                .entry_blocks(e)
                .iter()
                .enumerate()
                .find(|(_, rb)| self.epoch[rb.block_id as usize] != rb.epoch);
            match moved {
                None => keep.push(*e),
                Some((k, rb)) => {
                    let b = if k * bs < e.num_cached_tokens {
                        rb.block_id
                    } else {
                        NULL_BLOCK_ID
                    };
                    stale.push((e.plan_index, b));
                }
            }
        }
        let n = stale.len();
        reads.entries = keep;
        let mut misses: Vec<(usize, BlockId)> = reads
            .misses
            .iter()
            .copied()
            .zip(reads.miss_blocks.iter().copied())
            .chain(stale)
            .collect();
        misses.sort_unstable();
        reads.misses = misses.iter().map(|m| m.0).collect();
        reads.miss_blocks = misses.iter().map(|m| m.1).collect();
        reads.generation = self.generation;
        self.stats.stale_reads += n as u64;
        Ok(n)
    }
}
