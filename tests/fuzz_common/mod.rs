//! The fuzz targets and the manager's reference model, shared by the stable cargo tests
//! (`tests/core/fuzz_targets.rs`, `tests/core/manager/statemachine.rs`) and the
//! cargo-fuzz crate (`fuzz/`, which includes this file by path).
//!
//! - [`Harness`]: a full-attention [`KVCacheManager`] driven by scheduler-like [`Op`]s
//!   (new request, lookup + allocation with the hit, prefill chunks and decode steps,
//!   free, preemption and re-admission, `reset_prefix_cache`, `evict_blocks`,
//!   `take_events`), checked after every op against a reference model: each request's
//!   table length, every block's ref count = its owners, the free count, prefix hits =
//!   the blocks the hash index maps the request's hashes to, blocks shared only between
//!   requests with the same hash chain at the same position, and `check_invariants()`.
//! - [`manager_ops`], [`value_hash`], [`request_hash`]: `arbitrary`-decoded byte inputs
//!   for the manager and for each hasher's input decoding (generic values, request
//!   blocks with LoRA / multimodal / salt keys) under every algorithm. A target returns
//!   the number of operations it executed; it panics only on a broken property.
#![allow(dead_code)] // each including crate uses a part
#![allow(clippy::unwrap_used)] // test code: a panic is a failed property

use std::collections::HashMap;

use arbitrary::{Result as AResult, Unstructured};
use hscache::extra_keys::{MmFeature, RequestExtraKeys};
use hscache::hash::request::{RequestBlockHasher, RequestHashInput};
use hscache::hash::value::{Atom, ObjId, ValueSeq};
use hscache::hash::{BlockHasher, HashAlgo};
use hscache::manager::{AllocateSlots, GroupedBlocks, KVCacheManager, PlainRequest};
use hscache::testing::{chain_hash, full_attention_manager};
use hscache::types::{BlockHash, BlockId};

/// Tokens per block of the harness's manager.
pub const BLOCK_SIZE: usize = 4;
const MAX_MODEL_LEN: usize = 64;
const MAX_REQUESTS: usize = 8;

/// One scheduler-like operation on the manager.
#[derive(Clone, Debug)]
pub enum Op {
    /// A new request: `shared` blocks of system prompt `family`, then its own tokens
    /// (`len` tokens in all).
    New { family: u8, shared: u8, len: u8 },
    /// Lookup + allocation of the `idx`-th waiting request, `budget` tokens at most.
    Admit { idx: u8, budget: u8 },
    /// The next prefill chunk or one decode token of the `idx`-th running request.
    Step { idx: u8, budget: u8 },
    /// Finish (free) the `idx`-th running request.
    Finish { idx: u8 },
    /// Preempt the `idx`-th running request (free, back to waiting, nothing computed).
    Preempt { idx: u8 },
    /// `reset_prefix_cache()`.
    Reset,
    /// `evict_blocks(ids)`.
    Evict { ids: Vec<u8> },
    /// `take_events()`.
    TakeEvents,
}

impl Op {
    /// Decodes one op (the fuzz targets' input format).
    pub fn decode(u: &mut Unstructured<'_>) -> AResult<Op> {
        Ok(match u.int_in_range(0u8..=9)? {
            0 | 1 => Op::New {
                family: u.int_in_range(0..=3)?,
                shared: u.int_in_range(0..=4)?,
                len: u.int_in_range(1..=40)?,
            },
            2 | 3 => Op::Admit {
                idx: u.arbitrary()?,
                budget: u.int_in_range(1..=40)?,
            },
            4 | 5 => Op::Step {
                idx: u.arbitrary()?,
                budget: u.int_in_range(1..=40)?,
            },
            6 => Op::Finish {
                idx: u.arbitrary()?,
            },
            7 => Op::Preempt {
                idx: u.arbitrary()?,
            },
            8 => match u.int_in_range(0u8..=2)? {
                0 => Op::Reset,
                1 => Op::TakeEvents,
                _ => Op::Evict {
                    ids: (0..u.int_in_range(0..=3)?)
                        .map(|_| u.arbitrary())
                        .collect::<AResult<_>>()?,
                },
            },
            _ => Op::Step {
                idx: u.arbitrary()?,
                budget: 1,
            },
        })
    }
}

#[derive(Clone, Debug)]
struct Req {
    id: String,
    num_tokens: usize,
    computed: usize,
    /// Seed of the request's own chain (after its shared prefix).
    own_seed: u64,
    family: u64,
    shared: usize,
    hashes: Vec<BlockHash>,
    /// The model's expectation of the table length (running requests).
    table_len: usize,
}

impl Req {
    fn hash_at(&self, i: usize) -> BlockHash {
        if i < self.shared {
            chain_hash(self.family, i as u64)
        } else {
            chain_hash(self.own_seed, i as u64)
        }
    }

    fn extend_hashes(&mut self) {
        while self.hashes.len() < self.num_tokens / BLOCK_SIZE {
            let i = self.hashes.len();
            let h = self.hash_at(i);
            self.hashes.push(h);
        }
    }

    fn plain(&self) -> PlainRequest {
        PlainRequest {
            request_id: self.id.clone(),
            num_computed_tokens: self.computed,
            num_tokens: self.num_tokens,
            num_prompt_tokens: self.num_tokens,
            block_hashes: self.hashes.clone(),
            ..PlainRequest::default()
        }
    }
}

/// The manager under test and its reference model.
pub struct Harness {
    pub m: KVCacheManager,
    num_blocks: u32,
    next_id: u64,
    waiting: Vec<Req>,
    running: Vec<Req>,
    /// Operations executed (manager calls).
    pub ops: usize,
    /// Tokens served from the prefix cache (coverage: hits happen).
    pub hit_tokens: usize,
}

impl Harness {
    pub fn new(num_blocks: u32) -> Self {
        Self {
            m: full_attention_manager(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, true, true, false),
            num_blocks,
            next_id: 0,
            waiting: Vec::new(),
            running: Vec::new(),
            ops: 0,
            hit_tokens: 0,
        }
    }

    /// Executes one op, then checks the model.
    pub fn apply(&mut self, op: &Op) {
        match *op {
            Op::New {
                family,
                shared,
                len,
            } => self.new_request(family, shared, len),
            Op::Admit { idx, budget } => self.admit(idx, budget),
            Op::Step { idx, budget } => self.step(idx, budget),
            Op::Finish { idx } => {
                if let Some(r) = self.take_running(idx) {
                    self.m.free(&r.id).unwrap();
                    self.ops += 1;
                }
            }
            Op::Preempt { idx } => {
                if let Some(r) = self.take_running(idx) {
                    self.preempt(r);
                }
            }
            Op::Reset => {
                let ok = self.m.reset_prefix_cache().unwrap();
                // vLLM refuses while any block is in use
                assert_eq!(ok, self.running.is_empty(), "reset_prefix_cache");
                self.ops += 1;
            }
            Op::Evict { ref ids } => {
                let ids: Vec<i64> = ids
                    .iter()
                    .map(|&i| i64::from(i) % i64::from(self.num_blocks))
                    .filter(|&i| i > 0)
                    .collect();
                self.m.evict_blocks(&ids).unwrap();
                self.ops += 1;
            }
            Op::TakeEvents => {
                let _ = self.m.take_events();
                self.ops += 1;
            }
        }
        self.check();
    }

    fn new_request(&mut self, family: u8, shared: u8, len: u8) {
        if self.waiting.len() + self.running.len() >= MAX_REQUESTS {
            return;
        }
        let num_tokens = usize::from(len).clamp(1, MAX_MODEL_LEN - 1);
        self.next_id += 1;
        let mut r = Req {
            id: format!("r{}", self.next_id),
            num_tokens,
            computed: 0,
            own_seed: 1000 + self.next_id,
            family: u64::from(family),
            shared: usize::from(shared),
            hashes: Vec::new(),
            table_len: 0,
        };
        r.extend_hashes();
        self.waiting.push(r);
    }

    /// One `allocate_slots` call (counted): whether it fit.
    fn allocate_slots(&mut self, req: &PlainRequest, args: &AllocateSlots<'_>) -> bool {
        let (mut out, mut group_ends) = (Vec::new(), smallvec::SmallVec::new());
        self.ops += 1;
        self.m
            .allocate_slots(req, args, &mut out, &mut group_ends)
            .unwrap()
    }

    fn take_running(&mut self, idx: u8) -> Option<Req> {
        if self.running.is_empty() {
            return None;
        }
        let i = usize::from(idx) % self.running.len();
        Some(self.running.remove(i))
    }

    fn preempt(&mut self, mut r: Req) {
        self.m.free(&r.id).unwrap();
        self.ops += 1;
        r.computed = 0;
        r.table_len = 0;
        self.waiting.insert(0, r);
    }

    fn admit(&mut self, idx: u8, budget: u8) {
        if self.waiting.is_empty() {
            return;
        }
        let i = usize::from(idx) % self.waiting.len();
        let mut r = self.waiting[i].clone();
        let req = r.plain();
        let mut hits = vec![Vec::new()];
        let (hit, _) = self
            .m
            .get_computed_blocks(&req, None, &|| Ok(false), &mut hits)
            .unwrap();
        self.ops += 1;
        self.hit_tokens += hit;
        // a hit is whole blocks, leaves at least one token to compute, and is exactly
        // what the index maps the request's leading hashes to
        assert_eq!(hit % BLOCK_SIZE, 0, "hit {hit} is not block aligned");
        assert!(hit < r.num_tokens, "hit {hit} of {} tokens", r.num_tokens);
        assert_eq!(hits[0].len(), hit / BLOCK_SIZE);
        for (j, &b) in hits[0].iter().enumerate() {
            let pool = self.m.block_pool();
            assert_eq!(
                pool.block_hash(b).map(|k| &k.hash),
                Some(&r.hashes[j]),
                "hit block {b} at {j} carries another hash"
            );
        }
        let n = (r.num_tokens - hit).min(usize::from(budget).max(1));
        let ends = [hits[0].len()];
        let args = AllocateSlots {
            num_new_tokens: n,
            num_new_computed_tokens: hit,
            new_computed_blocks: Some(GroupedBlocks {
                ids: &hits[0],
                ends: &ends,
            }),
            has_scheduled_reqs: !self.running.is_empty(),
            ..AllocateSlots::default()
        };
        let ok = self.allocate_slots(&req, &args);
        if !ok {
            return;
        }
        self.waiting.remove(i);
        r.computed = hit + n;
        r.table_len = (hit + n).div_ceil(BLOCK_SIZE);
        self.finish_step(r);
    }

    fn step(&mut self, idx: u8, budget: u8) {
        let Some(mut r) = self.take_running(idx) else {
            return;
        };
        let n = (r.num_tokens - r.computed).min(usize::from(budget).max(1));
        let req = r.plain();
        let args = AllocateSlots {
            num_new_tokens: n,
            has_scheduled_reqs: !self.running.is_empty(),
            ..AllocateSlots::default()
        };
        let ok = self.allocate_slots(&req, &args);
        if !ok {
            self.preempt(r);
            return;
        }
        r.computed += n;
        r.table_len = r.table_len.max(r.computed.div_ceil(BLOCK_SIZE));
        self.finish_step(r);
    }

    /// After the model ran: a finished prefill / decode samples one token; stop checks.
    fn finish_step(&mut self, mut r: Req) {
        if r.computed == r.num_tokens {
            r.num_tokens += 1;
            r.extend_hashes();
            if r.num_tokens >= MAX_MODEL_LEN - 1 {
                self.m.free(&r.id).unwrap();
                self.ops += 1;
                return;
            }
        }
        self.running.push(r);
    }

    /// The reference model's checks.
    pub fn check(&self) {
        self.m.check_invariants().unwrap();
        let pool = self.m.block_pool();
        let mut owners: HashMap<BlockId, Vec<(usize, usize)>> = HashMap::new();
        for (ri, r) in self.running.iter().enumerate() {
            let table = self.m.get_blocks(&r.id, 0);
            assert_eq!(table.len(), r.table_len, "{}'s table length", r.id);
            for (j, &b) in table.iter().enumerate() {
                assert_ne!(b, 0, "the null block in a full-attention table");
                owners.entry(b).or_default().push((ri, j));
            }
        }
        for r in &self.waiting {
            assert!(
                self.m.get_blocks(&r.id, 0).is_empty(),
                "{} waits with blocks",
                r.id
            );
        }
        for b in 1..self.num_blocks {
            let own = owners.get(&b).map_or(0, Vec::len);
            assert_eq!(pool.ref_cnt(b) as usize, own, "ref count of block {b}");
        }
        // shared blocks: only at the same position of the same hash chain (a prefix hit)
        for (b, os) in &owners {
            if os.len() < 2 {
                continue;
            }
            let (r0, j0) = os[0];
            for &(ri, j) in &os[1..] {
                assert_eq!(j, j0, "block {b} at two positions");
                let (a, c) = (&self.running[r0], &self.running[ri]);
                assert!(
                    j < a.hashes.len() && j < c.hashes.len() && a.hashes[j] == c.hashes[j],
                    "block {b} shared by {} and {} without a common prefix",
                    a.id,
                    c.id
                );
            }
        }
        let used = owners.len();
        assert_eq!(
            pool.get_num_free_blocks(),
            self.num_blocks as usize - 1 - used,
            "free-block count"
        );
    }

    /// Frees everything: the pool must be whole again.
    pub fn drain(&mut self) {
        for r in std::mem::take(&mut self.running) {
            self.m.free(&r.id).unwrap();
            self.ops += 1;
        }
        self.waiting.clear();
        self.check();
        assert_eq!(
            self.m.block_pool().get_num_free_blocks(),
            self.num_blocks as usize - 1
        );
    }
}

/// Fuzz target: a manager op sequence (the first byte picks the pool size).
pub fn manager_ops(data: &[u8]) -> usize {
    let mut u = Unstructured::new(data);
    let num_blocks = u.int_in_range(4u32..=40).unwrap_or(16);
    let mut h = Harness::new(num_blocks);
    while !u.is_empty() {
        let Ok(op) = Op::decode(&mut u) else {
            break;
        };
        h.apply(&op);
    }
    h.drain();
    h.ops
}

fn algo(u: &mut Unstructured<'_>) -> AResult<HashAlgo> {
    Ok(*u.choose(&HashAlgo::ALL)?)
}

fn atom<'a>(u: &mut Unstructured<'a>) -> AResult<Atom<'a>> {
    Ok(match u.int_in_range(0u8..=3)? {
        0 => Atom::None,
        1 => Atom::Int(u.arbitrary()?),
        2 => Atom::Str(u.arbitrary()?, ObjId::new(u.int_in_range(0..=3)?)),
        _ => Atom::Bytes(u.arbitrary()?, ObjId::new(u.int_in_range(0..=3)?)),
    })
}

/// Builds a value the way the bindings decode a Python object, except that a tuple's
/// declared length may disagree with the items pushed (a malformed sequence, which
/// `validate` must reject without panicking).
fn value<'a>(u: &mut Unstructured<'a>, seq: &mut ValueSeq<'a>, depth: u32) -> AResult<()> {
    if depth < 4 && u.ratio(1u8, 3u8)? {
        let n = u.int_in_range(0usize..=4)?;
        let declared = if u.ratio(1u8, 16u8)? { n + 1 } else { n };
        let h = seq.open_tuple(declared, ObjId::new(u.int_in_range(4..=8)?));
        for _ in 0..n {
            value(u, seq, depth + 1)?;
        }
        seq.close_tuple(h);
    } else {
        seq.push_atom(atom(u)?);
    }
    Ok(())
}

/// Fuzz target: generic value hashing (`hash_fn(obj)`) under every algorithm: a valid
/// value hashes deterministically to a digest of the algorithm's length; a malformed
/// one is a typed error.
pub fn value_hash(data: &[u8]) -> usize {
    let mut u = Unstructured::new(data);
    let mut seq = ValueSeq::new();
    if value(&mut u, &mut seq, 0).is_err() {
        return 0;
    }
    if u.ratio(1u8, 32u8).unwrap_or(false) {
        seq.push_atom(Atom::None); // a second root
    }
    let valid = seq.validate().is_ok();
    let mut n = 0;
    for a in HashAlgo::ALL {
        let mut h = BlockHasher::new(a);
        let r1 = h.hash_value(&seq);
        let r2 = h.hash_value(&seq);
        assert_eq!(r1.is_ok(), valid, "{a:?}: validate and hash disagree");
        if let (Ok(x), Ok(y)) = (&r1, &r2) {
            assert_eq!(x, y, "{a:?} is not deterministic");
            assert_eq!(x.as_bytes().len(), a.digest_len());
        }
        n += 2;
    }
    n
}

/// Fuzz target: a request's block hashes (`RequestBlockHasher`) from arbitrary tokens,
/// parent, LoRA, multimodal items and salt; without multimodal items, hashing the blocks
/// in two calls must chain to the same hashes as one call; any error is typed.
pub fn request_hash(data: &[u8]) -> usize {
    let mut u = Unstructured::new(data);
    let Ok(parts) = request_parts(&mut u) else {
        return 0;
    };
    let (a, bs, tokens, mm, lora, salt) = parts;
    let Ok(mut hasher) = RequestBlockHasher::new(a, bs, 0) else {
        assert_eq!(bs, 0);
        return 1;
    };
    let features: Vec<MmFeature<'_>> = mm
        .iter()
        .filter_map(|&(o, l, id)| MmFeature::new(o, l, id).ok())
        .collect();
    let mut sorted = features.clone();
    sorted.sort_by_key(MmFeature::offset);
    let keys = RequestExtraKeys {
        lora,
        mm_features: &sorted,
        cache_salt: salt,
    };
    let none = vec![7u8; a.digest_len()];
    let input = RequestHashInput {
        num_hashed_blocks: 0,
        parent: None,
        none_hash: &none,
        tokens: &tokens,
        keys,
        prompt_embeds_digests: None,
    };
    let mut all = Vec::new();
    let r = hasher.hash_new_blocks(&input, &mut all);
    let mut n = 1;
    if r.is_err() {
        return n;
    }
    assert_eq!(all.len(), tokens.len() / bs);
    if !sorted.is_empty() {
        // after the first call vLLM's hasher scans only the last multimodal item (its
        // `curr_mm_idx = -1`), so a split inside earlier items may differ, as in vLLM
        return n;
    }
    // the same blocks hashed in two calls chain to the same hashes
    let split = all.len() / 2;
    let mut two = Vec::new();
    let first = RequestHashInput {
        tokens: &tokens[..split * bs],
        ..input
    };
    hasher.hash_new_blocks(&first, &mut two).unwrap();
    let parent = two.last().map(|h| h.as_bytes().to_vec());
    let second = RequestHashInput {
        num_hashed_blocks: split,
        parent: parent.as_deref(),
        tokens: &tokens[split * bs..],
        ..input
    };
    hasher.hash_new_blocks(&second, &mut two).unwrap();
    assert_eq!(all, two, "{a:?}: incremental hashing differs");
    n += 2;
    n
}

type Parts<'a> = (
    HashAlgo,
    usize,
    Vec<u32>,
    Vec<(usize, usize, Atom<'a>)>,
    Option<(Atom<'a>, Atom<'a>)>,
    Option<Atom<'a>>,
);

fn request_parts<'a>(u: &mut Unstructured<'a>) -> AResult<Parts<'a>> {
    let a = algo(u)?;
    let bs = u.int_in_range(0usize..=8)?;
    let tokens: Vec<u32> = (0..u.int_in_range(0usize..=48)?)
        .map(|_| u.arbitrary())
        .collect::<AResult<_>>()?;
    let mm = (0..u.int_in_range(0usize..=3)?)
        .map(|_| {
            let offset = if u.ratio(1u8, 32u8)? {
                usize::MAX - 1
            } else {
                u.int_in_range(0usize..=48)?
            };
            Ok((offset, u.int_in_range(0usize..=16)?, atom(u)?))
        })
        .collect::<AResult<_>>()?;
    let lora = if u.arbitrary()? {
        Some((atom(u)?, atom(u)?))
    } else {
        None
    };
    let salt = if u.arbitrary()? { Some(atom(u)?) } else { None };
    Ok((a, bs, tokens, mm, lora, salt))
}

/// A deterministic byte stream for the stable drivers (SplitMix64).
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}
