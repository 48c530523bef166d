//! The batched running-set API against the per-call API it replaces.
//!
//! Two managers replay the same randomized scheduler trace (chunked prefill under
//! a token budget, decode, shared prefixes, preemption from the tail when blocks
//! run out, finishes): one with an `allocate_slots` call per running request and a
//! `free` per finished one, the other with one `allocate_running_batch` /
//! `free_batch` per step. After every step the new block ids, preemptions, block
//! tables, free-queue order, KV events and pool invariants must be identical.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use hscache::manager::{AllocateSlots, BatchStop, KVCacheManager, RunningBatch};
use hscache::testing::{allocate, full_attention_manager, lookup, prompt_hashes, request};
use hscache::types::{BlockHash, BlockId};
use hscache::ErrorKind;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone)]
struct Req {
    id: String,
    prompt: usize,
    max_output: usize,
    /// Hashes of every full block the request will ever have.
    all_hashes: Vec<BlockHash>,
    num_computed: usize,
    num_tokens: usize,
}

impl Req {
    fn hashes(&self, bs: usize) -> &[BlockHash] {
        &self.all_hashes[..self.num_tokens / bs]
    }
}

fn manager(num_blocks: u32, block_size: usize, caching: bool, zeroing: bool) -> KVCacheManager {
    full_attention_manager(num_blocks, block_size, 4096, caching, true, zeroing)
}

/// One side's scheduler state (both sides hold identical copies).
struct Side {
    m: KVCacheManager,
    running: Vec<Req>,
    waiting: std::collections::VecDeque<Req>,
}

/// Admits waiting requests (general path, identical on both sides).
fn admit(
    side: &mut Side,
    bs: usize,
    budget: &mut usize,
    max_running: usize,
    log: &mut Vec<String>,
) {
    while *budget > 0 && side.running.len() < max_running {
        let Some(req) = side.waiting.front() else {
            break;
        };
        let view = request(&req.id, 0, req.num_tokens, req.hashes(bs));
        let (hit, hits) = lookup(&mut side.m, &view);
        let n = (req.num_tokens - hit).min(*budget);
        let args = AllocateSlots {
            num_new_tokens: n,
            num_new_computed_tokens: hit,
            ..Default::default()
        };
        let Some(new) = allocate(&mut side.m, &view, Some(&hits), args).unwrap() else {
            log.push(format!("admit-fail {}", req.id));
            break;
        };
        let mut req = side.waiting.pop_front().unwrap();
        log.push(format!("admit {} hit={hit} n={n} {new:?}", req.id));
        *budget -= n;
        // The model computes the scheduled tokens by the end of the step.
        req.num_computed = hit + n;
        side.running.push(req);
    }
}

/// Per-request token counts to schedule, as vLLM's running loop computes them.
fn plan(running: &[Req], budget: &mut usize) -> Vec<usize> {
    let mut ns = vec![];
    for r in running {
        if *budget == 0 {
            break;
        }
        let n = (r.num_tokens - r.num_computed).min(*budget);
        ns.push(n);
        *budget -= n;
    }
    ns
}

fn preempt(side: &mut Side, log: &mut Vec<String>, by_handle: bool) -> Req {
    let mut victim = side.running.pop().unwrap();
    if by_handle {
        let h = side.m.request_handle(&victim.id).unwrap();
        side.m.free_batch(&[h]).unwrap();
    } else {
        side.m.free(&victim.id).unwrap();
    }
    log.push(format!("preempt {}", victim.id));
    victim.num_computed = 0;
    victim
}

/// The running loop with one `allocate_slots` per request.
fn step_per_call(side: &mut Side, bs: usize, ns: &[usize], log: &mut Vec<String>) -> usize {
    let mut i = 0;
    let mut preempted = vec![];
    while i < ns.len().min(side.running.len()) {
        let r = &side.running[i];
        let view = request(&r.id, r.num_computed, r.num_tokens, r.hashes(bs));
        let args = AllocateSlots {
            num_new_tokens: ns[i],
            ..Default::default()
        };
        if let Some(new) = allocate(&mut side.m, &view, None, args).unwrap() {
            log.push(format!("sched {} {} {new:?}", side.running[i].id, ns[i]));
            i += 1;
            continue;
        }
        let victim_is_req = side.running.len() - 1 == i;
        preempted.push(preempt(side, log, false));
        if victim_is_req {
            break;
        }
    }
    for v in preempted {
        side.waiting.push_front(v);
    }
    i
}

/// The same running loop with `allocate_running_batch`.
fn step_batched(side: &mut Side, bs: usize, ns: &[usize], log: &mut Vec<String>) -> usize {
    let mut start = 0;
    let mut preempted = vec![];
    loop {
        let k = ns.len().min(side.running.len());
        let handles: Vec<u64> = side.running[..k]
            .iter()
            .map(|r| side.m.request_handle(&r.id).unwrap())
            .collect();
        let computed: Vec<usize> = side.running[..k].iter().map(|r| r.num_computed).collect();
        let batch = RunningBatch {
            handles: &handles,
            num_computed_tokens: &computed,
            num_new_tokens: &ns[..k],
            num_lookahead_tokens: 0,
        };
        let mut may_cache = vec![];
        side.m.check_running_batch(&batch, &mut may_cache).unwrap();
        let running = &side.running;
        // Only the entries the check listed may be read.
        let hashes_of = |i: usize| {
            assert!(may_cache.contains(&i), "entry {i} read but not listed");
            Ok(running[i].hashes(bs).to_vec())
        };
        let num_tokens_of = |i: usize| {
            assert!(may_cache.contains(&i), "entry {i} read but not listed");
            Ok(running[i].num_tokens)
        };
        let planned = side
            .m
            .plan_running_batch(&batch, &may_cache, &hashes_of, &num_tokens_of)
            .unwrap();
        let mut ids = vec![];
        let mut offsets = vec![0u32];
        let progress = side
            .m
            .allocate_running_batch(
                &batch,
                start,
                &may_cache,
                &planned,
                false,
                &mut ids,
                &mut offsets,
            )
            .unwrap();
        for (j, w) in offsets.windows(2).enumerate() {
            let e = start + j;
            let new: Vec<BlockId> = ids[w[0] as usize..w[1] as usize].to_vec();
            log.push(format!("sched {} {} {new:?}", side.running[e].id, ns[e]));
        }
        start = progress.next;
        if progress.stop != BatchStop::NoFit {
            break;
        }
        let victim_is_req = side.running.len() - 1 == start;
        preempted.push(preempt(side, log, true));
        if victim_is_req {
            break;
        }
    }
    for v in preempted {
        side.waiting.push_front(v);
    }
    start
}

/// What a trace exercised: (scheduled entries, preemptions, admissions, events).
fn run_trace(seed: u64) -> [usize; 4] {
    let mut seen = [0usize; 4];
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let bs = [4usize, 16][rng.below(2) as usize];
    let num_blocks = 40 + rng.below(400) as u32;
    let caching = rng.below(5) != 0;
    let zeroing = rng.below(2) == 0;
    let token_budget = 64 + rng.below(512) as usize;
    let max_running = 4 + rng.below(24) as usize;
    let mut reqs = vec![];
    for k in 0..60u64 {
        let prompt = 1 + rng.below(240) as usize;
        let max_output = 1 + rng.below(60) as usize;
        let total_blocks = (prompt + max_output) / bs + 1;
        let prefix = rng.below(3);
        let shared = rng.below(total_blocks as u64 + 1);
        reqs.push(Req {
            id: format!("req-{seed}-{k}"),
            prompt,
            max_output,
            all_hashes: prompt_hashes(prefix, shared, 1000 + k, total_blocks as u64 - shared),
            num_computed: 0,
            num_tokens: prompt,
        });
    }
    let mut a = Side {
        m: manager(num_blocks, bs, caching, zeroing),
        running: vec![],
        waiting: reqs.clone().into(),
    };
    let mut b = Side {
        m: manager(num_blocks, bs, caching, zeroing),
        running: vec![],
        waiting: reqs.into(),
    };
    for step in 0..400 {
        let (mut la, mut lb) = (vec![], vec![]);
        let mut budget_a = token_budget;
        let ns = plan(&a.running, &mut budget_a);
        let mut budget_b = token_budget;
        assert_eq!(ns, plan(&b.running, &mut budget_b));
        let done_a = step_per_call(&mut a, bs, &ns, &mut la);
        let done_b = step_batched(&mut b, bs, &ns, &mut lb);
        assert_eq!(done_a, done_b);
        for (side, done) in [(&mut a, done_a), (&mut b, done_b)] {
            for (r, n) in side.running.iter_mut().zip(&ns[..done]) {
                r.num_computed += n;
            }
        }
        let mut budget_left: usize = token_budget - ns[..done_a].iter().sum::<usize>();
        if a.waiting.len() == b.waiting.len() && done_a == ns.len() {
            let mut bl = budget_left;
            admit(&mut a, bs, &mut budget_left, max_running, &mut la);
            admit(&mut b, bs, &mut bl, max_running, &mut lb);
        }
        // The model: finished prompts sample one token; finished requests leave.
        for (side, by_handle) in [(&mut a, false), (&mut b, true)] {
            let mut finished = vec![];
            for r in side.running.iter_mut() {
                if r.num_computed >= r.num_tokens {
                    if r.num_tokens - r.prompt >= r.max_output {
                        finished.push(r.id.clone());
                    } else {
                        r.num_tokens += 1;
                    }
                }
            }
            if by_handle {
                let handles: Vec<u64> = finished
                    .iter()
                    .map(|id| side.m.request_handle(id).unwrap())
                    .collect();
                side.m.free_batch(&handles).unwrap();
            } else {
                for id in &finished {
                    side.m.free(id).unwrap();
                }
            }
            side.running.retain(|r| !finished.contains(&r.id));
        }
        assert_eq!(la, lb, "seed {seed} step {step}: decisions");
        for line in &la {
            let kind = line.split(' ').next().unwrap_or("");
            let slot = ["sched", "preempt", "admit"]
                .iter()
                .position(|k| *k == kind);
            if let Some(j) = slot {
                seen[j] += 1;
            }
        }
        assert_eq!(
            a.m.block_pool().free_block_queue().get_all_free_blocks(),
            b.m.block_pool().free_block_queue().get_all_free_blocks(),
            "seed {seed} step {step}: free queue"
        );
        for r in &a.running {
            assert_eq!(a.m.get_blocks(&r.id, 0), b.m.get_blocks(&r.id, 0));
        }
        let events = a.m.take_events();
        seen[3] += events.len();
        assert_eq!(events, b.m.take_events(), "seed {seed} step {step}");
        assert_eq!(a.m.take_new_block_ids(), b.m.take_new_block_ids());
        a.m.check_invariants().unwrap();
        b.m.check_invariants().unwrap();
        if a.running.is_empty() && a.waiting.is_empty() {
            break;
        }
    }
    seen
}

#[test]
fn batched_running_set_matches_per_call_allocation() {
    let mut total = [0usize; 4];
    for seed in 1..=120 {
        let seen = run_trace(seed);
        for (t, s) in total.iter_mut().zip(seen) {
            *t += s;
        }
    }
    // The traces must exercise what the batch replaces: many scheduled entries,
    // preemptions on full pools, admissions with hits, and cached-block events.
    eprintln!("batch traces: {total:?}");
    let [sched, preempt, admit, events] = total;
    assert!(sched > 20_000, "{total:?}");
    assert!(preempt > 200, "{total:?}");
    assert!(admit > 3_000, "{total:?}");
    assert!(events > 3_000, "{total:?}");
}

#[test]
fn bad_batches_change_nothing() {
    let mut m = manager(64, 16, true, false);
    let hashes = prompt_hashes(1, 0, 2, 4);
    let view = request("a", 0, 40, &hashes[..2]);
    let args = AllocateSlots {
        num_new_tokens: 40,
        ..Default::default()
    };
    assert!(allocate(&mut m, &view, None, args).unwrap().is_some());
    let h = m.request_handle("a").unwrap();
    assert_eq!(m.request_id_of(h), Some("a"));
    let free_before = m.block_pool().get_num_free_blocks();
    let check = |m: &mut KVCacheManager, handles: &[u64], computed: &[usize], new: &[usize]| {
        let mut may_cache = vec![];
        let err = m
            .check_running_batch(
                &RunningBatch {
                    handles,
                    num_computed_tokens: computed,
                    num_new_tokens: new,
                    num_lookahead_tokens: 0,
                },
                &mut may_cache,
            )
            .unwrap_err();
        assert!(may_cache.is_empty());
        err.kind()
    };
    assert_eq!(check(&mut m, &[h], &[40], &[]), ErrorKind::InvalidArgument);
    assert_eq!(check(&mut m, &[h], &[40], &[0]), ErrorKind::InvalidArgument);
    assert_eq!(
        check(&mut m, &[h], &[40], &[5000]),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        check(&mut m, &[h + (1 << 32)], &[40], &[1]),
        ErrorKind::UnknownRequest
    );
    assert_eq!(
        check(&mut m, &[h + 1], &[40], &[1]),
        ErrorKind::UnknownRequest
    );
    assert_eq!(
        check(&mut m, &[h, h], &[40, 40], &[1, 1]),
        ErrorKind::InvalidArgument
    );
    // free_batch checks every handle before freeing any.
    let err = m.free_batch(&[h, h + 7]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnknownRequest);
    let err = m.free_batch(&[h, h]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(m.block_pool().get_num_free_blocks(), free_before);
    assert_eq!(m.get_blocks("a", 0).len(), 3);
    // A block of the request already freed behind its back: free_batch refuses
    // before freeing anything (the pool-level free is undone by a touch).
    // (The after-every-call invariant check would flag that free: off meanwhile.)
    let table = m.get_blocks("a", 0).to_vec();
    let checking = m.checks_invariants();
    m.set_check_invariants(false);
    m.free_blocks(&[table[0]]).unwrap();
    assert_eq!(
        m.free_batch(&[h]).unwrap_err().kind(),
        ErrorKind::DoubleFree
    );
    assert_eq!(m.get_blocks("a", 0), table.as_slice());
    m.block_pool_mut().unwrap().touch(&[table[0]]).unwrap();
    m.set_check_invariants(checking);
    // A freed request's handle goes stale, also once its slot is reused.
    m.free_batch(&[h]).unwrap();
    assert_eq!(m.request_id_of(h), None);
    assert!(allocate(&mut m, &view, None, args).unwrap().is_some());
    let h2 = m.request_handle("a").unwrap();
    assert_ne!(h, h2);
    assert_eq!(
        m.free_batch(&[h]).unwrap_err().kind(),
        ErrorKind::UnknownRequest
    );
    m.check_invariants().unwrap();
}
