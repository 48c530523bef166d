//! Property tests: the intrusive free queue and the block pool against naive
//! `Vec`-based models written from vLLM 0.33's semantics.
//!
//! Properties:
//! - any sequence of free-queue operations yields the same order as a `Vec` model,
//!   and rejected operations change nothing;
//! - any sequence of pool operations (allocate, free in arbitrary order, touch,
//!   cache under a small key space so duplicates are common, evict, reset) keeps
//!   ref counts, the free-queue order and every hash lookup equal to the model's,
//!   and keeps the pool's structural invariants.
//!
//! A failing case is saved (as its seed) in `proptest-regressions/test_pool_proptest.txt`,
//! which is committed: every later run replays those cases before the random ones.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use std::collections::HashMap;

use hscache::free_queue::FreeKVCacheBlockQueue;
use hscache::pool::BlockPool;
use hscache::types::{BlockHash, BlockId};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// 256 cases a property; failures persist in the committed regression file (the default,
/// a file beside this one, would be `tests/test_pool_proptest.proptest-regressions`).
fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/proptest-regressions/test_pool_proptest.txt"
        )))),
        ..ProptestConfig::with_cases(256)
    }
}

#[derive(Clone, Debug)]
enum QueueOp {
    Popleft,
    PopleftN(usize),
    Remove(u32),
    AppendN(Vec<u32>),
    PrependN(Vec<u32>),
}

fn queue_op(n: u32) -> impl Strategy<Value = QueueOp> {
    prop_oneof![
        Just(QueueOp::Popleft),
        (0usize..4).prop_map(QueueOp::PopleftN),
        (0..n).prop_map(QueueOp::Remove),
        proptest::collection::vec(0..n, 0..4).prop_map(QueueOp::AppendN),
        proptest::collection::vec(0..n, 0..4).prop_map(QueueOp::PrependN),
    ]
}

/// Ids an append/prepend must refuse: a duplicate, or one already in the queue.
fn invalid_ids(ids: &[u32], queued: &[u32]) -> bool {
    let mut s = ids.to_vec();
    s.sort_unstable();
    s.dedup();
    s.len() != ids.len() || ids.iter().any(|i| queued.contains(i))
}

proptest! {
    #![proptest_config(config())]

    /// The intrusive queue matches a Vec model, op for op.
    #[test]
    fn free_queue_matches_vec_model(ops in proptest::collection::vec(queue_op(12), 1..80)) {
        let mut q = FreeKVCacheBlockQueue::try_new(12).unwrap();
        let mut model: Vec<u32> = (0..12).collect();
        for op in ops {
            match op {
                QueueOp::Popleft => {
                    let r = q.popleft();
                    if model.is_empty() { prop_assert!(r.is_err()); }
                    else { prop_assert_eq!(r.unwrap(), model.remove(0)); }
                }
                QueueOp::PopleftN(k) => {
                    let mut out = vec![];
                    let r = q.popleft_n(k, &mut out);
                    if k > model.len() { prop_assert!(r.is_err()); prop_assert!(out.is_empty()); }
                    else { prop_assert_eq!(out, model.drain(..k).collect::<Vec<_>>()); }
                }
                QueueOp::Remove(id) => {
                    let r = q.remove(id);
                    match model.iter().position(|&b| b == id) {
                        Some(p) => { prop_assert!(r.is_ok()); model.remove(p); }
                        None => prop_assert!(r.is_err()),
                    }
                }
                // Duplicates, or ids already queued: an error that changes nothing.
                QueueOp::AppendN(ids) if invalid_ids(&ids, &model) => {
                    prop_assert!(q.append_n(&ids).is_err());
                }
                QueueOp::PrependN(ids) if invalid_ids(&ids, &model) => {
                    prop_assert!(q.prepend_n(&ids).is_err());
                }
                QueueOp::AppendN(ids) => { q.append_n(&ids).unwrap(); model.extend(ids); }
                QueueOp::PrependN(ids) => {
                    q.prepend_n(&ids).unwrap();
                    let mut m = ids; m.extend(model); model = m;
                }
            }
            prop_assert_eq!(q.get_all_free_blocks(), model.clone());
            prop_assert_eq!(q.num_free_blocks(), model.len());
        }
    }
}

/// A naive pool with vLLM's semantics.
struct ModelPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u8>>,
    queue: Vec<BlockId>,
    index: HashMap<u8, Vec<BlockId>>,
}

impl ModelPool {
    fn new(n: u32) -> Self {
        Self {
            ref_cnt: vec![0; n as usize],
            hash: vec![None; n as usize],
            queue: (1..n).collect(),
            index: HashMap::new(),
        }
    }
    fn evict(&mut self, id: BlockId) {
        if let Some(k) = self.hash[id as usize].take() {
            let v = self.index.get_mut(&k).unwrap();
            v.retain(|&b| b != id);
            if v.is_empty() {
                self.index.remove(&k);
            }
        }
    }
    fn get_new(&mut self, n: usize) -> Vec<BlockId> {
        let out: Vec<BlockId> = self.queue.drain(..n).collect();
        for &id in &out {
            self.evict(id);
            self.ref_cnt[id as usize] = 1;
        }
        out
    }
    fn free(&mut self, ids: &[BlockId]) {
        let (mut first, mut last) = (vec![], vec![]);
        for &id in ids {
            self.ref_cnt[id as usize] -= 1;
            if self.ref_cnt[id as usize] == 0 {
                if self.hash[id as usize].is_none() {
                    first.push(id);
                } else {
                    last.push(id);
                }
            }
        }
        first.append(&mut self.queue);
        first.extend(last);
        self.queue = first;
    }
    fn touch(&mut self, id: BlockId) {
        if self.ref_cnt[id as usize] == 0 {
            self.queue.retain(|&b| b != id);
        }
        self.ref_cnt[id as usize] += 1;
    }
    fn cache(&mut self, id: BlockId, k: u8) {
        if self.hash[id as usize].is_some() {
            return;
        }
        self.hash[id as usize] = Some(k);
        self.index.entry(k).or_default().push(id);
    }
}

#[derive(Clone, Debug)]
enum PoolOp {
    Alloc(usize),
    /// Free every block of allocation `i` (mod live count), in a rotated order.
    Free(usize, usize),
    /// Touch the block cached under key `k`, if any (a prefix hit).
    Hit(u8),
    /// Cache block `j` of allocation `i` under key `k`.
    Cache(usize, usize, u8),
    Evict(u32),
    Reset,
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        3 => (1usize..4).prop_map(PoolOp::Alloc),
        3 => (0usize..8, 0usize..4).prop_map(|(i, r)| PoolOp::Free(i, r)),
        2 => (0u8..6).prop_map(PoolOp::Hit),
        3 => (0usize..8, 0usize..4, 0u8..6).prop_map(|(i, j, k)| PoolOp::Cache(i, j, k)),
        1 => (0u32..16).prop_map(PoolOp::Evict),
        1 => Just(PoolOp::Reset),
    ]
}

fn key(k: u8) -> BlockHash {
    BlockHash::new(&[k; 32]).unwrap()
}

proptest! {
    #![proptest_config(config())]

    /// The pool matches the model after every operation and keeps its invariants.
    #[test]
    fn pool_matches_model(ops in proptest::collection::vec(pool_op(), 1..120)) {
        const N: u32 = 16;
        let mut pool = BlockPool::new(N, true, 1, true, false).unwrap();
        let mut model = ModelPool::new(N);
        let mut live: Vec<Vec<BlockId>> = vec![];
        for op in ops {
            match op {
                PoolOp::Alloc(n) => {
                    let mut out = vec![];
                    let r = pool.get_new_blocks(n, &mut out);
                    if n > model.queue.len() { prop_assert!(r.is_err()); }
                    else { prop_assert_eq!(&out, &model.get_new(n)); live.push(out); }
                }
                PoolOp::Free(i, rot) if !live.is_empty() => {
                    let mut ids = live.remove(i % live.len());
                    let len = ids.len();
                    ids.rotate_left(rot % len);
                    pool.free_blocks(&ids).unwrap();
                    model.free(&ids);
                    // A second free of the same blocks is a double free, rejected whole.
                    if ids.iter().any(|&b| model.ref_cnt[b as usize] == 0) {
                        prop_assert!(pool.free_blocks(&ids).is_err());
                    }
                }
                PoolOp::Hit(k) => {
                    let got = pool.get_cached_block(&key(k), 0);
                    let want = model.index.get(&k).map(|v| v[0]);
                    prop_assert_eq!(got, want);
                    if let Some(id) = got {
                        pool.touch(&[id]).unwrap();
                        model.touch(id);
                        live.push(vec![id]);
                    }
                }
                PoolOp::Cache(i, j, k) if !live.is_empty() => {
                    let table = &live[i % live.len()];
                    let j = j % table.len();
                    let id = table[j];
                    // cache_full_blocks over a one-block table slice.
                    if pool.block_hash(id).is_none() {
                        pool.cache_full_blocks(&vec![key(k)], &[id], 0, 1, 1, 0, None).unwrap();
                        model.cache(id, k);
                    }
                }
                PoolOp::Evict(id) => {
                    pool.evict_blocks(&[i64::from(id)]).unwrap();
                    model.evict(id);
                }
                PoolOp::Reset => {
                    let ok = pool.reset_prefix_cache();
                    prop_assert_eq!(ok, live.is_empty());
                    if ok {
                        model.index.clear();
                        model.hash.iter_mut().for_each(|h| *h = None);
                    }
                }
                _ => {}
            }
            prop_assert_eq!(pool.free_block_queue().get_all_free_blocks(), model.queue.clone());
            for id in 1..N {
                prop_assert_eq!(pool.ref_cnt(id), model.ref_cnt[id as usize]);
            }
            for k in 0u8..6 {
                prop_assert_eq!(pool.get_cached_block(&key(k), 0), model.index.get(&k).map(|v| v[0]));
            }
            prop_assert_eq!(pool.check_invariants(), Ok(()));
        }
    }
}
