//! Property tests of the retention policies (`src/pool/retention/`): random
//! allocate / cache / free-with-hints / prefix-hit / clock / evict / unpin
//! sequences, checking after every step the pool's invariants (`check_invariants`,
//! which includes the policy's own) and each policy's ordering guarantee against an
//! independent model of the hints:
//! - `priority`: no evicted cached block has a higher effective priority (its hint,
//!   or the default once its duration ran out) than a free cached block left behind;
//! - `ttl`: no protected block is evicted while an expired one is free;
//! - `pin`: a block pinned before a call is never evicted by it;
//! - `slru`: no protected block is evicted while a probation block is free;
//! - all: free blocks without a hash are handed out before any cached block.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use std::collections::HashMap;

use hscache::pool::retention::{RetentionConfig, RetentionHint, RetentionKind};
use hscache::pool::BlockPool;
use hscache::types::{BlockHash, BlockId};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

const STEP_MS: u64 = 10_000;

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free {
        req: usize,
        prio: u8,
        dur: u8,
        pin: bool,
    },
    Hit(usize),
    Advance(u8),
    Evict(usize),
    UnpinAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..5).prop_map(Op::Alloc),
        4 => (0usize..8, 0u8..=100, 0u8..4, any::<bool>())
            .prop_map(|(req, prio, dur, pin)| Op::Free { req, prio, dur, pin }),
        3 => (0usize..64).prop_map(Op::Hit),
        1 => (1u8..4).prop_map(Op::Advance),
        1 => (0usize..64).prop_map(Op::Evict),
        1 => Just(Op::UnpinAll),
    ]
}

fn kind() -> impl Strategy<Value = RetentionKind> {
    prop_oneof![
        Just(RetentionKind::Priority),
        Just(RetentionKind::Pin),
        Just(RetentionKind::Ttl),
        Just(RetentionKind::Slru),
    ]
}

fn hash(n: u64) -> BlockHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&n.to_le_bytes());
    BlockHash::new(&b).unwrap()
}

/// What the test remembers of a block's last free: `(priority, deadline_ms)`.
type Freed = HashMap<BlockId, (u8, Option<u64>)>;

fn model_class(pool: &BlockPool, kind: RetentionKind, freed: &Freed, b: BlockId, now: u64) -> u8 {
    let r = pool.retention().unwrap();
    let (prio, deadline) = freed.get(&b).copied().unwrap_or((35, None));
    let live = deadline.is_some_and(|d| d > now);
    match kind {
        RetentionKind::Priority => {
            if deadline.is_some() && !live {
                r.config().default_priority
            } else {
                prio
            }
        }
        RetentionKind::Ttl => u8::from(live),
        RetentionKind::Slru => r.index().class_of(b).unwrap_or(0),
        _ => 0,
    }
}

fn run(kind: RetentionKind, num_blocks: u32, ops: &[Op]) {
    let mut pool = BlockPool::new(num_blocks, true, 1, true, false).unwrap();
    let mut config = RetentionConfig::for_pool(num_blocks);
    config.ttl_ms = 2 * STEP_MS;
    config.slru_protected_blocks = 3;
    config.max_pinned_blocks = 4;
    pool.set_retention(kind, config).unwrap();
    let mut requests: Vec<Vec<BlockId>> = Vec::new();
    let mut freed: Freed = HashMap::new();
    let mut next_hash = 0u64;
    for op in ops {
        match *op {
            Op::Alloc(n) => {
                if n > pool.get_num_free_blocks() {
                    assert!(pool.get_new_blocks(n, &mut Vec::new()).is_err());
                    continue;
                }
                let now = pool.retention().unwrap().now_ms();
                let free: Vec<BlockId> = pool.free_block_queue().iter().collect();
                let cached_free: Vec<BlockId> = free
                    .iter()
                    .copied()
                    .filter(|&b| pool.block_hash(b).is_some())
                    .collect();
                let uncached_free = free.len() - cached_free.len();
                let pinned: Vec<bool> = (0..num_blocks)
                    .map(|b| pool.retention().unwrap().is_pinned(b))
                    .collect();
                let classes: HashMap<BlockId, u8> = cached_free
                    .iter()
                    .map(|&b| (b, model_class(&pool, kind, &freed, b, now)))
                    .collect();
                let mut out = Vec::new();
                pool.get_new_blocks(n, &mut out).unwrap();
                let evicted: Vec<BlockId> = out
                    .iter()
                    .copied()
                    .filter(|b| classes.contains_key(b))
                    .collect();
                if !evicted.is_empty() {
                    assert!(
                        out.len() - evicted.len() == uncached_free.min(n),
                        "a cached block was evicted while a block without a hash was free"
                    );
                }
                for &b in &evicted {
                    assert!(!pinned[b as usize], "pinned block {b} evicted");
                }
                let worst = evicted.iter().map(|b| classes[b]).max();
                let best_left = cached_free
                    .iter()
                    .filter(|b| !out.contains(b) && !pinned[**b as usize])
                    .map(|b| classes[b])
                    .min();
                if let (Some(w), Some(l)) = (worst, best_left) {
                    assert!(
                        w <= l,
                        "{kind:?}: evicted class {w} while class {l} was free"
                    );
                }
                let hashes: Vec<BlockHash> = out
                    .iter()
                    .map(|_| {
                        next_hash += 1;
                        hash(next_hash)
                    })
                    .collect();
                pool.cache_full_blocks(&hashes, &out, 0, out.len(), 1, 0, None)
                    .unwrap();
                requests.push(out);
            }
            Op::Free {
                req,
                prio,
                dur,
                pin,
            } => {
                if requests.is_empty() {
                    continue;
                }
                let blocks = requests.swap_remove(req % requests.len());
                let duration_ms = (dur > 0).then(|| u64::from(dur) * STEP_MS);
                let hint = RetentionHint {
                    priority: Some(prio),
                    duration_ms,
                    pin,
                };
                let now = pool.retention().unwrap().now_ms();
                let deadline = match kind {
                    RetentionKind::Priority if prio != 35 => duration_ms.map(|d| now + d),
                    RetentionKind::Ttl => Some(now + duration_ms.unwrap_or(2 * STEP_MS)),
                    _ => None,
                };
                for &b in &blocks {
                    freed.insert(b, (prio, deadline));
                }
                pool.set_retention_hint(hint);
                let rev: Vec<BlockId> = blocks.iter().rev().copied().collect();
                pool.free_blocks(&rev).unwrap();
                pool.clear_retention_hint();
            }
            Op::Hit(i) => {
                let cached: Vec<BlockId> = (1..num_blocks)
                    .filter(|&b| pool.block_hash(b).is_some())
                    .collect();
                if cached.is_empty() {
                    continue;
                }
                let b = cached[i % cached.len()];
                pool.touch(&[b]).unwrap();
                requests.push(vec![b]);
            }
            Op::Advance(k) => pool
                .retention_mut()
                .unwrap()
                .advance_clock(u64::from(k) * STEP_MS),
            Op::Evict(i) => {
                let b = 1 + (i as u32 % (num_blocks - 1));
                pool.evict_blocks(&[i64::from(b)]).unwrap();
            }
            Op::UnpinAll => pool.unpin_all(),
        }
        pool.check_invariants().unwrap();
    }
}

/// 200 cases; failures persist in the committed `proptest-regressions/` file, as in
/// `test_pool_proptest.rs`.
fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/proptest-regressions/test_retention_proptest.txt"
        )))),
        ..ProptestConfig::with_cases(200)
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_policy_keeps_its_order_and_the_pool_invariants(
        kind in kind(),
        num_blocks in 4u32..24,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(kind, num_blocks, &ops);
    }
}

#[test]
fn lru_cannot_be_attached_and_is_the_default() {
    let mut pool = BlockPool::new(8, true, 1, false, false).unwrap();
    assert_eq!(pool.retention_kind(), RetentionKind::Lru);
    pool.set_retention(RetentionKind::Lru, RetentionConfig::for_pool(8))
        .unwrap();
    assert!(pool.retention().is_none());
}

#[test]
fn priority_evicts_low_priority_first_then_lru() {
    let mut pool = BlockPool::new(7, true, 1, false, false).unwrap();
    pool.set_retention(RetentionKind::Priority, RetentionConfig::for_pool(7))
        .unwrap();
    let mut ids = Vec::new();
    pool.get_new_blocks(6, &mut ids).unwrap();
    let hashes: Vec<BlockHash> = (1..=6).map(hash).collect();
    pool.cache_full_blocks(&hashes, &ids, 0, 6, 1, 0, None)
        .unwrap();
    for (pair, prio) in ids.chunks(2).zip([80u8, 20, 50]) {
        pool.set_retention_hint(RetentionHint {
            priority: Some(prio),
            ..RetentionHint::default()
        });
        pool.free_blocks(pair).unwrap();
    }
    pool.clear_retention_hint();
    let mut out = Vec::new();
    pool.get_new_blocks(6, &mut out).unwrap();
    assert_eq!(out, vec![3, 4, 5, 6, 1, 2]);
    pool.check_invariants().unwrap();
}

#[test]
fn a_pinned_block_is_not_free_until_unpinned() {
    let mut pool = BlockPool::new(4, true, 1, false, false).unwrap();
    pool.set_retention(RetentionKind::Pin, RetentionConfig::for_pool(4))
        .unwrap();
    let mut ids = Vec::new();
    pool.get_new_blocks(1, &mut ids).unwrap();
    pool.cache_full_blocks(&vec![hash(1)], &ids, 0, 1, 1, 0, None)
        .unwrap();
    pool.set_retention_hint(RetentionHint {
        pin: true,
        ..RetentionHint::default()
    });
    pool.free_blocks(&ids).unwrap();
    pool.clear_retention_hint();
    assert_eq!(pool.get_num_free_blocks(), 2);
    assert!(pool.get_new_blocks(3, &mut Vec::new()).is_err());
    pool.check_invariants().unwrap();
    pool.unpin_all();
    assert_eq!(pool.get_num_free_blocks(), 3);
    let mut out = Vec::new();
    pool.get_new_blocks(3, &mut out).unwrap();
    assert_eq!(out, vec![2, 3, 1]);
    assert!(pool.reset_prefix_cache() || pool.get_num_free_blocks() == 0);
}
