//! Property tests of hybrid layouts: random Scheduler-like sequences (admit with a
//! prefix lookup, chunked prefill, decode, preempt, finish now or deferred, end of
//! step with the copy-on-write releases, evict, reset) over random layouts, checked
//! after every operation against a small model written from vLLM 0.33's rules.
//!
//! Properties:
//! - `prefix_cached_layouts_keep_their_invariants` (full attention with sliding
//!   window, chunked local, Mamba "align" of 1-3x the block, all three, a ring, or a
//!   sliding window / chunked local alone):
//!   - every lookup's hit is the longest aligned length *every* group can serve, found
//!     by brute force over the prefix-cache index (full attention: all blocks before
//!     it cached; sliding window: the `cdiv(window - 1, block)` blocks before it;
//!     chunked local: the blocks of its chunk before it; Mamba: the state ending on
//!     it), and each group's hit blocks are exactly those (nulls elsewhere);
//!   - every block's ref count equals the table slots holding it, plus the deferred
//!     frees holding it, plus the pending copy-on-write endpoints; the pool's own
//!     invariants hold (free queue = ref-0 blocks, null block never queued or hashed);
//!   - full attention, sliding window and chunked local tables are `cdiv(slots,
//!     block)` long, their null blocks form a prefix exactly as long as the skipped
//!     blocks of the last allocation's processed tokens; a ring holds one block;
//!   - a block held by two table slots is a block some admission adopted as a hit;
//!   - `reset_prefix_cache` succeeds exactly when no block is in use.
//! - `uncached_layouts_keep_their_invariants` (prefix caching off: full attention with
//!   Mamba "none" (+ speculative blocks), cross attention, a sliding window or a ring):
//!   the same ref-count and table-shape rules, Mamba "none" keeping one state block
//!   (+ speculative blocks) and cross attention `cdiv(encoder tokens, block)` blocks.
//!
//! 1024 cases a property (0.3 s in a release build, 5 s in a debug one; PROPTEST_CASES
//! overrides it for soaks). Failures persist in
//! `proptest-regressions/managers_hybrid_proptest.txt`.

use std::collections::{BTreeMap, HashSet};

use hscache::manager::{
    AllocateSlots, GroupSpec, KVCacheManager, KVCacheManagerConfig, MambaCacheMode, ManagerKind,
};
use hscache::types::{BlockHash, BlockId, NULL_BLOCK_ID};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

use crate::managers::common::*;

fn config_for_proptest(cases: u32) -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/proptest-regressions/managers_hybrid_proptest.txt"
        )))),
        ..ProptestConfig::with_cases(cases)
    }
}

// ---- layouts --------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Layout {
    FaSwa {
        b: usize,
        w: usize,
    },
    /// Full attention `b` + sliding window `2b`: scheduler block `2b`, hash block `b`.
    FaSwaMixed {
        b: usize,
        w: usize,
    },
    /// `chunk = k * b`.
    FaCl {
        b: usize,
        k: usize,
    },
    /// Mamba "align" of `k * b` (k > 1: partial hash hits).
    FaMamba {
        b: usize,
        k: usize,
    },
    FaSwaMamba {
        b: usize,
        w: usize,
    },
    /// Sliding window `b` + Mamba "align" `2b`: partial hash hits with a group that
    /// cannot look them up (its block is the hash block).
    FaSwaMambaFine {
        b: usize,
        w: usize,
    },
    /// Two sliding windows (one spec group when the windows are equal).
    FaSwaSwa {
        b: usize,
        w1: usize,
        w2: usize,
    },
    FaRing {
        b: usize,
    },
    Swa {
        b: usize,
        w: usize,
    },
    Cl {
        b: usize,
        k: usize,
    },
}

fn layout() -> impl Strategy<Value = Layout> {
    let b = prop_oneof![Just(1usize), Just(2), Just(4)];
    prop_oneof![
        (b.clone(), 1usize..13).prop_map(|(b, w)| Layout::FaSwa { b, w }),
        (b.clone(), 1usize..13).prop_map(|(b, w)| Layout::FaSwaMixed { b, w }),
        (b.clone(), 1usize..4).prop_map(|(b, k)| Layout::FaCl { b, k }),
        (b.clone(), 1usize..4).prop_map(|(b, k)| Layout::FaMamba { b, k }),
        (b.clone(), 1usize..13).prop_map(|(b, w)| Layout::FaSwaMamba { b, w }),
        (b.clone(), 1usize..13).prop_map(|(b, w)| Layout::FaSwaMambaFine { b, w }),
        (b.clone(), 1usize..13, 1usize..13).prop_map(|(b, w1, w2)| Layout::FaSwaSwa { b, w1, w2 }),
        b.clone().prop_map(|b| Layout::FaRing { b }),
        (b.clone(), 1usize..13).prop_map(|(b, w)| Layout::Swa { b, w }),
        (b, 1usize..4).prop_map(|(b, k)| Layout::Cl { b, k }),
    ]
}

impl Layout {
    /// The groups, the scheduler block and the hash block (vLLM's resolved sizes).
    fn groups(&self) -> (Vec<GroupSpec>, usize, usize) {
        let align = |bs| mamba(bs, MambaCacheMode::Align, 0);
        match *self {
            Layout::FaSwa { b, w } => (vec![fa(b), swa(b, w)], b, b),
            Layout::FaSwaMixed { b, w } => (vec![fa(b), swa(2 * b, w)], 2 * b, b),
            Layout::FaCl { b, k } => (vec![fa(b), chunked_local(b, k * b)], b, b),
            Layout::FaMamba { b, k } => (vec![fa(b), align(k * b)], k * b, b),
            Layout::FaSwaMamba { b, w } => (vec![fa(b), swa(b, w), align(b)], b, b),
            Layout::FaSwaMambaFine { b, w } => (vec![fa(b), swa(b, w), align(2 * b)], 2 * b, b),
            Layout::FaSwaSwa { b, w1, w2 } => {
                let mut second = swa(b, w2);
                if w1 != w2 {
                    second.spec_class = 8;
                }
                (vec![fa(b), swa(b, w1), second], b, b)
            }
            Layout::FaRing { b } => (vec![fa(b), ring(b)], b, b),
            Layout::Swa { b, w } => (vec![swa(b, w)], b, b),
            Layout::Cl { b, k } => (vec![chunked_local(b, k * b)], b, b),
        }
    }

    /// The Mamba block size (its prefill chunks end on Mamba block boundaries).
    fn mamba_block(&self) -> Option<usize> {
        match *self {
            Layout::FaMamba { b, k } => Some(k * b),
            Layout::FaSwaMamba { b, .. } => Some(b),
            Layout::FaSwaMambaFine { b, .. } => Some(2 * b),
            _ => None,
        }
    }
}

// ---- operations -----------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// A new request: `shared` tokens of prefix family `family`, then `own` tokens of
    /// its own; its first chunk is at most `chunk` (in scheduler blocks) long.
    Admit {
        family: u8,
        shared: u8,
        own: u8,
        chunk: u8,
    },
    /// A new request resending an earlier prompt (`pick`) plus `extra` tokens of its
    /// own (a conversation's next turn; hits at the old prompt's boundaries).
    Resend {
        pick: u8,
        extra: u8,
        chunk: u8,
    },
    /// The running request `pick` computes its next chunk (or decodes one token).
    Step {
        pick: u8,
        chunk: u8,
    },
    /// The running request `pick` finishes: freed now, or popped for a later free.
    Finish {
        pick: u8,
        deferred: bool,
    },
    FreeDeferred {
        pick: u8,
    },
    /// The step's copies ran; the next step starts.
    EndStep,
    Evict {
        block: u8,
    },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..24, 0u8..16, 1u8..4)
            .prop_map(|(family, shared, own, chunk)| Op::Admit { family, shared, own, chunk }),
        2 => (any::<u8>(), 0u8..4, 1u8..4)
            .prop_map(|(pick, extra, chunk)| Op::Resend { pick, extra, chunk }),
        6 => (any::<u8>(), 1u8..4).prop_map(|(pick, chunk)| Op::Step { pick, chunk }),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(pick, deferred)| Op::Finish { pick, deferred }),
        1 => any::<u8>().prop_map(|pick| Op::FreeDeferred { pick }),
        3 => Just(Op::EndStep),
        1 => any::<u8>().prop_map(|block| Op::Evict { block }),
        1 => Just(Op::Reset),
    ]
}

/// [`op`] with running requests stepping (decoding) most of the time: long decodes
/// cross state and window boundaries, where the steady decode step must give way.
fn decode_heavy_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => op(),
        7 => (0u8..4, 1u8..2).prop_map(|(pick, chunk)| Op::Step { pick, chunk }),
    ]
}

// ---- the driver and its model ---------------------------------------------------------

struct Running {
    req: Req,
    /// Slots the last successful allocation asked for (tables never shrink).
    max_slots: usize,
    /// The processed tokens of the last allocation (what it freed the skipped
    /// blocks of).
    last_processed: usize,
    encoder_tokens: usize,
}

struct Driver {
    m: KVCacheManager,
    layout_groups: Vec<GroupSpec>,
    scheduler_block: usize,
    hash_block: usize,
    mamba_block: Option<usize>,
    running: Vec<Running>,
    deferred: Vec<Vec<BlockId>>,
    /// Blocks some admission adopted as prefix hits (the only ones tables may share).
    adopted: HashSet<BlockId>,
    /// Every prompt admitted so far (for resends).
    prompts: Vec<Vec<u32>>,
    next_id: u32,
    caching: bool,
    /// Encoder tokens of each admission (cross attention).
    encoder: bool,
    /// What the operations exercised (coverage of the driver itself).
    stats: BTreeMap<&'static str, usize>,
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl Driver {
    fn new(
        groups: Vec<GroupSpec>,
        sched: usize,
        hash: usize,
        num_blocks: u32,
        caching: bool,
    ) -> Self {
        let mut c: KVCacheManagerConfig = config(groups.clone(), num_blocks, sched, hash);
        c.coordinator.enable_caching = caching;
        let mamba_block = groups
            .iter()
            .find(|g| g.mamba_mode() == Some(MambaCacheMode::Align))
            .map(|g| g.block_size);
        let encoder = groups.iter().any(|g| g.kind == ManagerKind::CrossAttention);
        Self {
            m: {
                let mut m = KVCacheManager::new(c).expect("valid layout");
                // A broken invariant fails at the operation that broke it.
                m.set_check_invariants(true);
                m
            },
            layout_groups: groups,
            scheduler_block: sched,
            hash_block: hash,
            mamba_block,
            running: Vec::new(),
            deferred: Vec::new(),
            adopted: HashSet::new(),
            prompts: Vec::new(),
            next_id: 0,
            caching,
            encoder,
            stats: BTreeMap::new(),
        }
    }

    /// This driver's manager never takes the steady decode step.
    fn without_steady_decode(mut self) -> Self {
        self.m.set_steady_decode(false);
        self
    }

    fn bump(&mut self, key: &'static str) {
        *self.stats.entry(key).or_default() += 1;
    }

    /// The end of a prefill chunk of at most `budget` tokens from `start`, cut the way
    /// vLLM's Scheduler cuts chunks of Mamba "align" models (at Mamba block boundaries,
    /// at the prompt's last hash boundary inside a block); else `start + budget`.
    fn chunk_end(&self, start: usize, budget: usize, prompt: usize) -> usize {
        let mut end = (start + budget).min(prompt);
        let Some(mb) = self.mamba_block else {
            return end;
        };
        if end < prompt {
            let aligned = end / mb * mb;
            if aligned > start {
                end = aligned;
            }
        }
        let mut stops = vec![];
        if start % mb != 0 {
            stops.push((start / mb + 1) * mb);
        }
        let last_cache = (prompt - 1) / mb * mb;
        stops.push(last_cache);
        if self.hash_block < mb {
            let tail = (prompt - 1) / self.hash_block * self.hash_block;
            if last_cache < tail && tail < prompt {
                stops.push(tail);
            }
        }
        for s in stops {
            if start < s && s < end {
                end = s;
            }
        }
        end
    }

    /// A prompt of `shared` tokens of prefix family `family` and `own` of its own.
    fn family_prompt(&mut self, family: u8, shared: u8, own: u8) -> Vec<u32> {
        let id = self.next_id;
        let mut prompt: Vec<u32> = (0..u32::from(shared))
            .map(|i| (u32::from(family) + 1) * 10_000 + i)
            .collect();
        let own = u32::from(own).max(u32::from(prompt.is_empty()));
        prompt.extend((0..own).map(|j| 500_000 + id * 1000 + j));
        prompt
    }

    /// An earlier prompt (`pick`) plus `extra` tokens of the new request's own.
    fn resend_prompt(&mut self, pick: u8, extra: u8) -> Option<Vec<u32>> {
        if self.prompts.is_empty() {
            return None;
        }
        let id = self.next_id;
        let mut prompt = self.prompts[usize::from(pick) % self.prompts.len()].clone();
        prompt.extend((0..u32::from(extra)).map(|j| 700_000 + id * 1000 + j));
        Some(prompt)
    }

    fn admit(&mut self, prompt: Vec<u32>, own: u8, chunk: u8) -> Result<(), TestCaseError> {
        let id = self.next_id;
        self.next_id += 1;
        self.prompts.push(prompt.clone());
        let rid = format!("r{id}");
        let mut req = Req::new(&rid, prompt, self.hash_block);
        let (hit, hits) = lookup(&mut self.m, &req);
        if self.caching {
            self.check_hit(&req, hit, &hits)?;
        } else {
            prop_assert_eq!(hit, 0);
        }
        let tokens = req.r.num_tokens;
        let budget = usize::from(chunk) * self.scheduler_block;
        let n = self.chunk_end(hit, budget, tokens) - hit;
        let encoder_tokens = if self.encoder {
            usize::from(own) + 3
        } else {
            0
        };
        let args = AllocateSlots {
            num_encoder_tokens: encoder_tokens,
            ..Default::default()
        };
        if hit > 0 {
            self.bump("hit");
            if hits.iter().flatten().any(|&b| b == NULL_BLOCK_ID) {
                self.bump("hit_with_nulls");
            }
            if self.mamba_block.is_some_and(|mb| hit % mb != 0) {
                self.bump("partial_hit");
            }
        }
        let found = hits
            .iter()
            .any(|g| !g.is_empty())
            .then_some((hit, &hits[..]));
        match allocate(&mut self.m, &req, n, found, args) {
            Some(_) => {
                self.bump("admitted");
                for &b in hits.iter().flatten() {
                    if b != NULL_BLOCK_ID {
                        self.adopted.insert(b);
                    }
                }
                req.r.num_computed_tokens = hit + n;
                req.r.waiting = false;
                self.running.push(Running {
                    req,
                    max_slots: hit + n,
                    last_processed: hit,
                    encoder_tokens,
                });
            }
            // Not admitted: the Scheduler would retry; this one gives up (abort).
            None => {
                self.bump("not_admitted");
                self.m.free(&rid).expect("free");
            }
        }
        Ok(())
    }

    fn step(&mut self, pick: u8, chunk: u8) {
        if self.running.is_empty() {
            return;
        }
        let i = usize::from(pick) % self.running.len();
        let budget = usize::from(chunk) * self.scheduler_block;
        let (start, prompt) = {
            let r = &self.running[i].req.r;
            (r.num_computed_tokens, r.num_prompt_tokens)
        };
        let n = if start < prompt {
            self.chunk_end(start, budget, prompt) - start
        } else {
            let token = 900_000 + self.next_id * 7 + start as u32;
            self.next_id += 1;
            self.running[i].req.append(&[token]);
            1
        };
        self.bump(if start < prompt {
            "prefill_chunk"
        } else {
            "decode"
        });
        let steady_before = self.m.num_steady_steps();
        let r = &mut self.running[i];
        if allocate(&mut self.m, &r.req, n, None, AllocateSlots::default()).is_some() {
            r.req.r.num_computed_tokens += n;
            r.max_slots = r.max_slots.max(start + n);
            r.last_processed = start;
            if self.m.num_steady_steps() > steady_before {
                self.bump(if self.mamba_block.is_some() {
                    "steady_with_mamba"
                } else {
                    "steady"
                });
            }
        } else {
            // Preempted (freed; this driver does not re-admit it).
            let r = self.running.remove(i);
            self.m.free(r.req.id()).expect("free");
            self.bump("preempted");
        }
    }

    fn finish(&mut self, pick: u8, deferred: bool) {
        if self.running.is_empty() {
            return;
        }
        let r = self.running.remove(usize::from(pick) % self.running.len());
        self.bump(if deferred {
            "finish_deferred"
        } else {
            "finish"
        });
        if deferred {
            let mut blocks = Vec::new();
            self.m
                .pop_blocks_for_free(r.req.id(), &mut blocks)
                .expect("pop_blocks_for_free");
            self.deferred.push(blocks);
        } else {
            self.m.free(r.req.id()).expect("free");
        }
    }

    fn free_deferred(&mut self, pick: u8) {
        if self.deferred.is_empty() {
            return;
        }
        self.bump("free_deferred");
        let mut blocks = self
            .deferred
            .remove(usize::from(pick) % self.deferred.len());
        blocks.reverse();
        self.m.free_blocks(&blocks).expect("free_blocks");
    }

    fn run(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Admit {
                family,
                shared,
                own,
                chunk,
            } => {
                let prompt = self.family_prompt(family, shared, own);
                self.admit(prompt, own, chunk)?;
            }
            Op::Resend { pick, extra, chunk } => {
                if let Some(prompt) = self.resend_prompt(pick, extra) {
                    self.admit(prompt, extra, chunk)?;
                }
            }
            Op::Step { pick, chunk } => self.step(pick, chunk),
            Op::Finish { pick, deferred } => self.finish(pick, deferred),
            Op::FreeDeferred { pick } => self.free_deferred(pick),
            Op::EndStep => {
                if !end_step(&mut self.m).is_empty() {
                    self.bump("copy_on_write");
                }
            }
            Op::Evict { block } => {
                let n = self.m.block_pool().num_gpu_blocks();
                let b = 1 + u32::from(block) % (n - 1);
                if self.m.block_pool().block_hash(b).is_some() {
                    self.bump(if self.m.block_pool().ref_cnt(b) > 0 {
                        "evict_in_use"
                    } else {
                        "evict"
                    });
                }
                self.m.evict_blocks(&[i64::from(b)]).expect("evict_blocks");
            }
            Op::Reset => {
                let idle = (1..self.m.block_pool().num_gpu_blocks())
                    .all(|b| self.m.block_pool().ref_cnt(b) == 0);
                self.bump(if idle { "reset" } else { "reset_refused" });
                prop_assert_eq!(self.m.reset_prefix_cache().expect("reset"), idle);
            }
        }
        self.check_state()
    }

    // ---- the hit model ----------------------------------------------------------------

    /// The key of block `i` of a group of `bs` tokens: the hash at its last hash block.
    fn key(&self, hashes: &[BlockHash], bs: usize, i: usize) -> Option<BlockHash> {
        hashes.get((i + 1) * (bs / self.hash_block) - 1).copied()
    }

    fn cached(&self, hashes: &[BlockHash], g: usize, bs: usize, i: usize) -> Option<BlockId> {
        let key = self.key(hashes, bs, i)?;
        self.m.block_pool().get_cached_block(&key, g as u32)
    }

    /// Group `g`'s hit blocks for a hit of `len` tokens, if it can serve that hit.
    fn group_hit(&self, hashes: &[BlockHash], g: usize, len: usize) -> Option<Vec<BlockId>> {
        let spec = &self.layout_groups[g];
        let bs = spec.block_size;
        let run = |from: usize, to: usize| -> Option<Vec<BlockId>> {
            let mut out = vec![NULL_BLOCK_ID; from];
            for i in from..to {
                out.push(self.cached(hashes, g, bs, i)?);
            }
            Some(out)
        };
        match &spec.kind {
            ManagerKind::FullAttention => run(0, len / bs),
            ManagerKind::SlidingWindow { sliding_window, .. } => {
                // vLLM's search ends a hit on a cached block even when the window
                // needs none (window 1), so a hit always needs one.
                let need = cdiv(sliding_window.saturating_sub(1), bs).max(1);
                run((len / bs).saturating_sub(need), len / bs)
            }
            ManagerKind::ChunkedLocal {
                attention_chunk_size,
            } => run(
                len / attention_chunk_size * attention_chunk_size / bs,
                len / bs,
            ),
            ManagerKind::Mamba(_) => {
                if len == 0 {
                    return Some(vec![]);
                }
                let align = self.m.coordinator().cache_hit_alignment_tokens();
                let (idx, key) = if align < bs {
                    let unit = len / align - 1;
                    (unit / (bs / align), hashes.get(unit).copied()?)
                } else {
                    (len / bs - 1, self.key(hashes, bs, len / bs - 1)?)
                };
                let block = self.m.block_pool().get_cached_block(&key, g as u32)?;
                let mut out = vec![NULL_BLOCK_ID; idx];
                out.push(block);
                Some(out)
            }
            ManagerKind::CircularBuffer => Some(vec![]),
            other => panic!("no hit model for {other:?}"),
        }
    }

    /// The lookup's answer must be the longest aligned length every group serves.
    fn check_hit(&self, req: &Req, hit: usize, hits: &[Vec<BlockId>]) -> Result<(), TestCaseError> {
        let hashes = &req.r.block_hashes;
        let align = self.m.coordinator().cache_hit_alignment_tokens();
        let max = req.r.num_tokens - 1;
        let mut len = max / align * align;
        loop {
            let per_group: Option<Vec<Vec<BlockId>>> = (0..self.layout_groups.len())
                .map(|g| self.group_hit(hashes, g, len))
                .collect();
            if let Some(expected) = per_group {
                prop_assert_eq!(hit, len, "hit length (alignment {})", align);
                prop_assert_eq!(hits, &expected[..], "hit blocks of a {}-token hit", len);
                return Ok(());
            }
            prop_assert!(len > 0, "the empty hit is always served");
            len -= align;
        }
    }

    // ---- state invariants -------------------------------------------------------------

    fn check_state(&self) -> Result<(), TestCaseError> {
        let m = &self.m;
        prop_assert_eq!(m.check_invariants(), Ok(()));
        let pool = m.block_pool();
        let n = pool.num_gpu_blocks() as usize;
        let mut expected = vec![0u32; n];
        let mut slots = vec![0u32; n];
        for r in &self.running {
            for (g, spec) in self.layout_groups.iter().enumerate() {
                let table = m.get_blocks(r.req.id(), g);
                for &b in table {
                    if b != NULL_BLOCK_ID {
                        expected[b as usize] += 1;
                        slots[b as usize] += 1;
                    }
                }
                self.check_table(r, spec, table)?;
            }
        }
        for &b in self.deferred.iter().flatten() {
            expected[b as usize] += 1;
        }
        for mgr in m.coordinator().managers() {
            for &(src, dst) in &mgr.base().pending_cow_copies {
                expected[src as usize] += 1;
                expected[dst as usize] += 1;
            }
        }
        for b in 1..n {
            prop_assert_eq!(
                pool.ref_cnt(b as u32),
                expected[b],
                "ref_cnt of block {}",
                b
            );
            prop_assert!(
                slots[b] <= 1 || self.adopted.contains(&(b as u32)),
                "block {} is in {} table slots but was never a hit",
                b,
                slots[b]
            );
        }
        Ok(())
    }

    fn check_table(
        &self,
        r: &Running,
        spec: &GroupSpec,
        table: &[BlockId],
    ) -> Result<(), TestCaseError> {
        let bs = spec.block_size;
        let nulls = table.iter().take_while(|&&b| b == NULL_BLOCK_ID).count();
        let holes = table[nulls..].contains(&NULL_BLOCK_ID);
        let skipped = match &spec.kind {
            ManagerKind::FullAttention => Some(0),
            ManagerKind::SlidingWindow { sliding_window, .. } => {
                Some((r.last_processed + 1).saturating_sub(*sliding_window))
            }
            ManagerKind::ChunkedLocal {
                attention_chunk_size,
            } => Some(r.last_processed / attention_chunk_size * attention_chunk_size),
            ManagerKind::Mamba(p) if p.mode == MambaCacheMode::None => {
                prop_assert_eq!(
                    table.len(),
                    cdiv(r.max_slots + p.num_speculative_blocks * bs, bs),
                    "Mamba none table"
                );
                prop_assert_eq!(
                    nulls,
                    (r.last_processed.saturating_sub(1) / bs).min(table.len())
                );
                prop_assert!(!holes);
                None
            }
            ManagerKind::CircularBuffer => {
                prop_assert_eq!(table.len(), 1, "ring table");
                None
            }
            ManagerKind::CrossAttention => {
                prop_assert_eq!(table.len(), cdiv(r.encoder_tokens, bs), "cross table");
                prop_assert_eq!(nulls, 0);
                None
            }
            _ => None,
        };
        if let Some(skipped) = skipped {
            prop_assert_eq!(
                table.len(),
                cdiv(r.max_slots, bs),
                "table of {:?}",
                spec.kind
            );
            prop_assert_eq!(
                nulls,
                (skipped / bs).min(table.len()),
                "null prefix of {:?}",
                spec.kind
            );
            prop_assert!(!holes, "a null block after the skipped prefix: {:?}", table);
        }
        Ok(())
    }
}

// ---- uncached layouts -----------------------------------------------------------------

#[derive(Clone, Debug)]
/// Full attention `b` beside one other group.
enum UncachedLayout {
    MambaNone { b: usize, spec_blocks: usize },
    Cross { b: usize },
    Swa { b: usize, w: usize },
    Ring { b: usize },
}

fn uncached_layout() -> impl Strategy<Value = UncachedLayout> {
    let b = prop_oneof![Just(1usize), Just(2), Just(4)];
    prop_oneof![
        (b.clone(), 0usize..3)
            .prop_map(|(b, spec_blocks)| UncachedLayout::MambaNone { b, spec_blocks }),
        b.clone().prop_map(|b| UncachedLayout::Cross { b }),
        (b.clone(), 1usize..13).prop_map(|(b, w)| UncachedLayout::Swa { b, w }),
        b.prop_map(|b| UncachedLayout::Ring { b }),
    ]
}

impl UncachedLayout {
    fn groups(&self) -> Vec<GroupSpec> {
        match *self {
            UncachedLayout::MambaNone { b, spec_blocks } => {
                vec![fa(b), mamba(b, MambaCacheMode::None, spec_blocks)]
            }
            UncachedLayout::Cross { b } => vec![fa(b), cross(b)],
            UncachedLayout::Swa { b, w } => vec![fa(b), swa(b, w)],
            UncachedLayout::Ring { b } => vec![fa(b), ring(b)],
        }
    }
}

proptest! {
    #![proptest_config(config_for_proptest(1024))]

    /// Prefix-cached hybrid layouts: hits match the brute-force model, ref counts and
    /// tables match the model after every operation (see module docs).
    #[test]
    fn prefix_cached_layouts_keep_their_invariants(
        layout in layout(),
        num_blocks in 6u32..48,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let (groups, sched, hash) = layout.groups();
        let mut d = Driver::new(groups, sched, hash, num_blocks, true);
        prop_assert_eq!(d.mamba_block, layout.mamba_block());
        for op in ops {
            d.run(op)?;
        }
        // Everything freed, the pool is whole again.
        while !d.running.is_empty() {
            d.finish(0, false);
        }
        while !d.deferred.is_empty() {
            d.free_deferred(0);
        }
        end_step(&mut d.m);
        d.check_state()?;
        prop_assert_eq!(d.m.block_pool().get_num_free_blocks(), num_blocks as usize - 1);
    }

    /// The steady decode step decides as vLLM's stages do: a manager that takes it
    /// and one that never does, driven alike over prefix-cached or uncached layouts,
    /// hold the same state after every operation (pool, free queue, index, tables and
    /// Mamba "align"'s per-request bookkeeping: `state_digest`).
    #[test]
    fn the_steady_step_decides_as_vllms_stages(
        layout in layout(),
        uncached in uncached_layout(),
        caching in any::<bool>(),
        num_blocks in 6u32..48,
        ops in proptest::collection::vec(decode_heavy_op(), 1..200),
    ) {
        let (groups, sched, hash) = if caching {
            layout.groups()
        } else {
            let groups = uncached.groups();
            let b = groups[0].block_size;
            (groups, b, b)
        };
        let mut steady = Driver::new(groups.clone(), sched, hash, num_blocks, caching);
        let mut general =
            Driver::new(groups, sched, hash, num_blocks, caching).without_steady_decode();
        for op in ops {
            steady.run(op.clone())?;
            general.run(op)?;
            prop_assert_eq!(steady.m.state_digest(), general.m.state_digest());
        }
        prop_assert_eq!(general.m.num_steady_steps(), 0);
    }

    /// Layouts without prefix caching (Mamba "none", cross attention, ...): ref counts
    /// and table shapes match the model after every operation.
    #[test]
    fn uncached_layouts_keep_their_invariants(
        layout in uncached_layout(),
        num_blocks in 6u32..48,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let groups = layout.groups();
        let b = groups[0].block_size;
        let mut d = Driver::new(groups, b, b, num_blocks, false);
        for op in ops {
            d.run(op)?;
        }
        while !d.running.is_empty() {
            d.finish(0, false);
        }
        while !d.deferred.is_empty() {
            d.free_deferred(0);
        }
        d.check_state()?;
        prop_assert_eq!(d.m.block_pool().get_num_free_blocks(), num_blocks as usize - 1);
    }
}

/// The model's own sanity: the prefix families do share hits (else the properties
/// would prove little).
#[test]
fn the_driver_produces_hits() {
    let (groups, sched, hash) = Layout::FaSwa { b: 2, w: 4 }.groups();
    let mut d = Driver::new(groups, sched, hash, 40, true);
    let prompt = d.family_prompt(0, 20, 2);
    d.admit(prompt, 2, 3).unwrap();
    while d.running[0].req.r.num_computed_tokens < d.running[0].req.r.num_prompt_tokens {
        d.step(0, 3);
    }
    let mut req = Req::new("probe", (0..20).map(|i| 10_000 + i).chain([1, 2]), 2);
    req.r.num_computed_tokens = 0;
    let (hit, _) = lookup(&mut d.m, &req);
    assert_eq!(hit, 20);
}

/// The random operations exercise what the properties claim to check (guards against a
/// driver change that silently stops admitting, hitting or copying).
#[test]
fn the_random_operations_cover_the_features() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        ProptestConfig::default(),
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let strategy = (layout(), 6u32..48, proptest::collection::vec(op(), 1..80));
    let mut total: BTreeMap<&'static str, usize> = BTreeMap::new();
    for _ in 0..256 {
        let (layout, num_blocks, ops) = strategy.new_tree(&mut runner).unwrap().current();
        let (groups, sched, hash) = layout.groups();
        let mut d = Driver::new(groups, sched, hash, num_blocks, true);
        for op in ops {
            d.run(op).unwrap();
        }
        for (k, v) in d.stats {
            *total.entry(k).or_default() += v;
        }
    }
    eprintln!("coverage over 256 cases: {total:?}");
    for key in [
        "admitted",
        "not_admitted",
        "hit",
        "hit_with_nulls",
        "partial_hit",
        "copy_on_write",
        "prefill_chunk",
        "decode",
        "steady",
        "steady_with_mamba",
        "preempted",
        "finish",
        "finish_deferred",
        "free_deferred",
        "evict",
        "evict_in_use",
        "reset",
        "reset_refused",
    ] {
        assert!(
            total.get(key).copied().unwrap_or(0) > 0,
            "no case exercised {key}: {total:?}"
        );
    }
}
