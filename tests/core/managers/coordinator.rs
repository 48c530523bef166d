//! `HybridKVCacheCoordinator` and `UnitaryKVCacheCoordinator` (vLLM 0.33
//! `kv_cache_coordinator.py`): the fixed-point hit over several groups, EAGLE's drop,
//! mixed block sizes, what a hybrid model caches, sparse retention and the uncached
//! common prefix. The numbers are vLLM's answers to the same calls.

use hscache::manager::{AllocateSlots, CoordinatorKind, KVCacheManager, MambaCacheMode};
use hscache::types::BlockId;
use hscache::ErrorKind;

use crate::managers::common::*;
use crate::t;

/// `get_computed_blocks` with its shared-prefix boundary.
fn lookup3(m: &mut KVCacheManager, req: &Req) -> (usize, Vec<Vec<BlockId>>, usize) {
    let mut out = vec![Vec::new(); m.num_kv_cache_groups()];
    let (hit, spb) = m
        .get_computed_blocks(&req.r, None, &|| Ok(false), &mut out)
        .expect("lookup");
    (hit, out, spb)
}

fn hashed(m: &KVCacheManager) -> Vec<(BlockId, u32)> {
    pool_state(m)
        .into_iter()
        .filter_map(|(b, _, n)| n.map(|n| (b, n)))
        .collect()
}

#[test]
fn the_hit_is_a_fixed_point_over_every_group() {
    // Full attention, a sliding window of 8 and Mamba "align", all of block 4. The
    // producer prefills 25 tokens in chunks of 8, so Mamba keeps the states at 8, 16
    // and 24 (blocks 5, 10, 15).
    let groups = vec![fa(4), swa(4, 8), mamba(4, MambaCacheMode::Align, 0)];
    let mut m = manager(groups, 40, 4);
    assert_eq!(m.coordinator().kind(), CoordinatorKind::Hybrid);
    let mut a = Req::new("a", toks(1..26), 4);
    admit(&mut m, &mut a, Some(8), AllocateSlots::default());
    m.new_step_starts();
    for n in [8, 8, 1] {
        chunk(&mut m, &mut a, n, AllocateSlots::default()).unwrap();
        m.new_step_starts();
    }
    assert_eq!(
        tables(&m, "a"),
        t![
            [1, 2, 6, 7, 11, 12, 16],
            [0, 0, 0, 0, 13, 14, 17],
            [0, 0, 0, 0, 0, 15, 18]
        ]
    );
    m.free("a").unwrap();
    let mut b = Req::new("b", toks(1..25).into_iter().chain(70..74), 4);
    assert_eq!(
        lookup3(&mut m, &b),
        (
            24,
            t![
                [1, 2, 6, 7, 11, 12],
                [0, 0, 0, 0, 13, 14],
                [0, 0, 0, 0, 0, 15]
            ],
            0
        )
    );
    // Evict the window's block 4 and Mamba's state at 16: full attention hits 24, the
    // window 16, Mamba then 8; the next round the window re-checks 8 (blocks 0 and 1)
    // and every group agrees. Full attention hit further: a shared prefix of 24.
    m.evict_blocks(&[13, 10]).unwrap();
    assert_eq!(lookup3(&mut m, &b), (8, t![[1, 2], [3, 4], [0, 5]], 24));
    let (hit, _, new) = admit(&mut m, &mut b, None, AllocateSlots::default());
    assert_eq!(hit, 8);
    assert_eq!(
        new,
        Some(t![
            [18, 17, 16, 19, 20],
            [21, 22, 23, 24, 25],
            [0, 0, 0, 0, 26]
        ])
    );
    m.check_invariants().unwrap();
}

#[test]
fn eagle_drops_the_last_matched_block() {
    let mut c = config(vec![fa(4)], 16, 4, 4);
    c.coordinator.use_eagle = true;
    let mut m = KVCacheManager::new(c).unwrap();
    let mut a = Req::new("a", toks(1..21), 4);
    admit(&mut m, &mut a, None, AllocateSlots::default());
    let b = Req::new("b", toks(1..21).into_iter().chain([5, 6]), 4);
    assert_eq!(lookup(&mut m, &b), (16, t![[1, 2, 3, 4]]));
}

#[test]
fn eagle_sliding_window_matches_one_more_block_and_drops_it() {
    let mut c = config(vec![fa(4), swa(4, 8)], 30, 4, 4);
    c.coordinator.use_eagle = true;
    let mut m = KVCacheManager::new(c).unwrap();
    let mut a = Req::new("a", toks(1..21), 4);
    admit(&mut m, &mut a, None, AllocateSlots::default());
    decode(&mut m, &mut a, 99, AllocateSlots::default());
    assert_eq!(
        tables(&m, "a"),
        t![[1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12]]
    );
    let b = Req::new("b", toks(1..21).into_iter().chain([5, 6]), 4);
    assert_eq!(lookup(&mut m, &b), (16, t![[1, 2, 3, 4], [0, 0, 8, 9]]));
    // The window's block 1 lies outside the matched run.
    m.evict_blocks(&[7]).unwrap();
    assert_eq!(lookup(&mut m, &b), (16, t![[1, 2, 3, 4], [0, 0, 8, 9]]));
}

#[test]
fn mixed_block_sizes_align_hits_and_caching_to_the_scheduler_block() {
    // Full attention 4 + sliding window 8 (window 16): scheduler block 8, hash block 4.
    let mut m = KVCacheManager::new(config(vec![fa(4), swa(8, 16)], 30, 8, 4)).unwrap();
    assert_eq!(m.coordinator().cache_hit_alignment_tokens(), 8);
    assert_eq!(
        [13, 16, 20].map(|n| m.coordinator().get_num_cacheable_tokens(n, 0)),
        [8, 16, 16]
    );
    let mut a = Req::new("a", toks(1..21), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1, 2, 3, 4, 5], [6, 7, 8]]));
    let b = Req::new("b", toks(1..21).into_iter().chain([5, 6]), 4);
    assert_eq!(lookup(&mut m, &b), (16, t![[1, 2, 3, 4], [6, 7]]));
}

#[test]
fn sparse_retention_reports_the_uncached_common_prefix() {
    // Retention 0: the window caches only the tails a replay (or a junction) resumes at.
    let mut c = config(vec![fa(4), swa(4, 8)], 30, 4, 4);
    c.coordinator.retention_interval = Some(0);
    let mut m = KVCacheManager::new(c).unwrap();
    let mut a = Req::new("a", toks(1..21), 4);
    admit(&mut m, &mut a, None, AllocateSlots::default());
    // Full attention: all 5 blocks; window: the tail of 19 -> 16 (blocks 2, 3 = 8, 9).
    assert_eq!(
        hashed(&m),
        [(1, 4), (2, 8), (3, 12), (4, 16), (5, 20), (8, 12), (9, 16)]
    );
    // A request sharing 12 tokens: full attention would hit them, the window cannot
    // (no tail at 12): no hit, and a common prefix of 12 the window has not cached.
    let mut c = Req::new("c", toks(1..13).into_iter().chain(90..95), 4);
    let (hit, hits, spb) = lookup3(&mut m, &c);
    assert_eq!((hit, hits, spb), (0, t![[], []], 12));
    // The Scheduler hands that junction back; the window then keeps its tail too
    // (blocks 17, 18 end at 12), besides the replay tail (18, 19 end at 16).
    c.r.shared_prefix_boundary = spb;
    let (_, _, new) = admit(&mut m, &mut c, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]));
    let window: Vec<(BlockId, u32)> = hashed(&m).into_iter().filter(|&(b, _)| b >= 16).collect();
    assert_eq!(window, [(17, 8), (18, 12), (19, 16)]);
}

#[test]
fn retention_intervals_are_validated_as_vllm_does() {
    let build = |groups, r| {
        let mut c = config(groups, 16, 4, 4);
        c.coordinator.retention_interval = r;
        KVCacheManager::new(c).map(|_| ())
    };
    // No sliding-window or Mamba group: only 0 (the engine default) is accepted.
    assert!(build(vec![fa(4)], Some(0)).is_ok());
    assert_eq!(
        build(vec![fa(4)], Some(8)).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // A multiple of the scheduler block.
    assert!(build(vec![fa(4), swa(4, 8)], Some(8)).is_ok());
    assert_eq!(
        build(vec![fa(4), swa(4, 8)], Some(6)).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}
