//! `SlidingWindowManager` (vLLM 0.33 `single_type_kv_cache_manager.py`): the numbers
//! below are vLLM's answers to the same calls (block size 4, 12 blocks, tokens 1..=20
//! unless said otherwise).

use hscache::manager::single_type::MaskQuery;
use hscache::manager::sliding_window::SlidingWindowManager;
use hscache::manager::{AllocateSlots, GroupSpec, GroupedBlocks, ManagerKind};

use crate::managers::common::*;
use crate::t;

fn swa_with_extra(block_size: usize, window: usize, extra: usize) -> GroupSpec {
    GroupSpec {
        kind: ManagerKind::SlidingWindow {
            sliding_window: window,
            extra_retained_tokens: extra,
        },
        ..swa(block_size, window)
    }
}

#[test]
fn skipped_tokens_are_those_before_the_next_tokens_window() {
    // vLLM's docstring: window 4, 7 computed -> tokens 0..=3 are skipped.
    let m = manager(vec![swa(4, 4)], 8, 4);
    let swa = m.coordinator().manager(0);
    let skipped: Vec<usize> = [7, 3, 4, 0].map(|n| swa.get_num_skipped_tokens(n)).into();
    assert_eq!(skipped, [4, 0, 1, 0]);
    // Multi-module MTP keeps `extra_retained_tokens` more below the window.
    let m = manager(vec![swa_with_extra(4, 4, 2)], 8, 4);
    assert_eq!(m.coordinator().manager(0).get_num_skipped_tokens(7), 2);
    assert_eq!(m.coordinator().manager(0).get_num_skipped_tokens(2), 0);
}

#[test]
fn a_hit_needs_the_blocks_covering_window_minus_one_tokens() {
    let need = |w, eagle| SlidingWindowManager::contiguous_blocks_for_hit(w, 4, eagle);
    assert_eq!(
        [
            need(8, false),
            need(8, true),
            need(5, false),
            need(1, false),
            need(9, false)
        ],
        [2, 3, 1, 0, 2]
    );
}

#[test]
fn decode_frees_the_blocks_before_the_window_into_the_null_block() {
    let mut m = manager(vec![swa(4, 8)], 12, 4);
    let mut a = Req::new("a", toks(1..21), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1, 2, 3, 4, 5]]));
    // 20 processed tokens: the next token's window starts at token 13, so blocks
    // 0..=2 are skipped; they are freed tail first and, being cached, go to the
    // queue's tail (evicted last, after the older free blocks).
    assert_eq!(
        decode(&mut m, &mut a, 99, AllocateSlots::default()),
        Some(t![[6]])
    );
    assert_eq!(tables(&m, "a"), t![[0, 0, 0, 4, 5, 6]]);
    assert_eq!(queue(&m), [7, 8, 9, 10, 11, 3, 2, 1]);
    m.check_invariants().unwrap();
}

#[test]
fn blocks_an_in_flight_step_still_reads_are_kept() {
    let mut m = manager(vec![swa(4, 8)], 12, 4);
    let mut a = Req::new("a", toks(1..21), 4);
    admit(&mut m, &mut a, None, AllocateSlots::default());
    // The prefill's 20 tokens are still in flight: nothing is processed yet.
    a.r.num_in_flight_tokens = 20;
    decode(&mut m, &mut a, 99, AllocateSlots::default()).unwrap();
    assert_eq!(tables(&m, "a"), t![[1, 2, 3, 4, 5, 6]]);
    // One decode token in flight: 20 processed, blocks 0..=2 go.
    a.r.num_in_flight_tokens = 1;
    assert_eq!(
        decode(&mut m, &mut a, 98, AllocateSlots::default()),
        Some(t![[]])
    );
    assert_eq!(tables(&m, "a"), t![[0, 0, 0, 4, 5, 6]]);
    assert_eq!(queue(&m), [7, 8, 9, 10, 11, 3, 2, 1]);
}

#[test]
fn the_hit_is_searched_from_the_right_and_nulls_the_skipped_prefix() {
    let mut m = manager(vec![swa(4, 8)], 12, 4);
    let mut a = Req::new("a", toks(1..21), 4);
    admit(&mut m, &mut a, None, AllocateSlots::default());
    decode(&mut m, &mut a, 99, AllocateSlots::default());
    let b = Req::new("b", toks(1..21).into_iter().chain(50..54), 4);
    // Max hit 23 tokens = 5 blocks; blocks 3 and 4 (two = cdiv(8 - 1, 4) contiguous
    // blocks) end the hit; blocks 0..=2 are outside the window.
    assert_eq!(lookup(&mut m, &b), (20, t![[0, 0, 0, 4, 5]]));
    // Evicting blocks the window does not need changes nothing.
    m.evict_blocks(&[1, 2]).unwrap();
    assert_eq!(lookup(&mut m, &b), (20, t![[0, 0, 0, 4, 5]]));
    // Without block 3 no two contiguous cached blocks are left (block 2 alone, and
    // the run from block 0 is broken): no hit.
    m.evict_blocks(&[4]).unwrap();
    assert_eq!(lookup(&mut m, &b), (0, t![[]]));
    let mut b = b;
    let (_, _, new) = admit(&mut m, &mut b, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[7, 8, 9, 10, 11, 3]]));
    assert_eq!(queue(&m), [2, 1]);
    m.check_invariants().unwrap();
}

#[test]
fn a_cached_run_from_block_zero_is_a_hit_even_if_shorter_than_the_window() {
    // Window 16 needs 4 contiguous blocks; a cached 3-block prefix still hits.
    let mut m = manager(vec![swa(4, 16)], 12, 4);
    let mut a = Req::new("a", toks(1..14), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1, 2, 3, 4]]));
    m.free("a").unwrap();
    let b = Req::new("b", toks(1..14).into_iter().chain(60..70), 4);
    assert_eq!(lookup(&mut m, &b), (12, t![[1, 2, 3]]));
}

#[test]
fn admission_caps_the_full_sequence_reservation() {
    // vLLM's `max_admission_blocks_per_request` for window 8, block 4, 4 in-flight
    // tokens: cdiv(min(7 + 4, 256), 4) + 1 = 4.
    let mut spec = swa(4, 8);
    spec.max_admission_blocks_per_request = Some(4);
    let mut c = config(vec![spec], 8, 4, 4);
    c.max_model_len = 256;
    let mut m = hscache::manager::KVCacheManager::new(c).unwrap();
    let no_hits = GroupedBlocks {
        ids: &[],
        ends: &[],
    };
    let n = |m: &mut hscache::manager::KVCacheManager, cap| {
        m.coordinator_num_blocks_to_allocate(&hscache::manager::NumBlocksToAllocate {
            request_id: "a",
            num_tokens: 100,
            hits: no_hits,
            num_encoder_tokens: 0,
            total_computed_tokens: 0,
            num_local_computed_tokens: 0,
            num_tokens_main_model: 100,
            apply_admission_cap: cap,
            prefill_end: 0,
        })
        .unwrap()
    };
    assert_eq!((n(&mut m, true), n(&mut m, false)), (4, 25));
    // So a 100-token request fits a 7-block pool when the full sequence must fit
    // (full attention would not).
    let a = Req::new("a", toks(1..101), 4);
    let args = AllocateSlots {
        full_sequence_must_fit: true,
        ..Default::default()
    };
    assert!(allocate(&mut m, &a, 8, None, args).is_some());
    let mut fa = manager(vec![fa(4)], 8, 4);
    assert!(allocate(&mut fa, &a, 8, None, args).is_none());
}

#[test]
fn sparse_retention_keeps_only_the_tails_a_hit_can_end_on() {
    // vLLM's `SlidingWindowManager.reachable_block_mask` for window 8, block 4
    // (a hit needs 2 blocks), alignment 8, over blocks [start, end).
    let m = manager(vec![swa(4, 8)], 8, 4);
    let swa = m.coordinator().manager(0);
    let mask = |start, end, eagle, retention, boundaries: &[i64]| {
        swa.reachable_block_mask(&MaskQuery {
            start_block: start,
            end_block: end,
            alignment_tokens: 8,
            use_eagle: eagle,
            retention_interval: retention,
            reachable_boundaries: boundaries,
        })
    };
    let bits = |s: &str| Some(s.chars().map(|c| c == '1').collect::<Vec<bool>>());
    // Dense retention with two blocks per segment: every block can end a hit.
    assert_eq!(mask(0, 8, false, None, &[]), None);
    // Retention 0: only the replay boundary's tail (token 19 -> aligned 16 -> blocks 2, 3).
    assert_eq!(mask(0, 8, false, Some(0), &[19]), bits("00110000"));
    // One tail per 16-token segment; EAGLE peeks one block further.
    assert_eq!(mask(0, 12, false, Some(16), &[]), bits("001100110011"));
    assert_eq!(mask(0, 12, true, Some(16), &[]), bits("001110111011"));
    // Boundaries outside [start, end) are clipped.
    assert_eq!(mask(2, 10, false, Some(0), &[23, 12]), bits("11000000"));
}

#[test]
fn hybrid_hit_ends_where_both_groups_hit() {
    // Full attention + sliding window (window 8): full attention hits all 5 cached
    // blocks, and the window's two blocks before token 20 are cached too.
    let mut m = manager(vec![fa(4), swa(4, 8)], 24, 4);
    let mut a = Req::new("a", toks(1..21), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]));
    decode(&mut m, &mut a, 99, AllocateSlots::default());
    assert_eq!(
        tables(&m, "a"),
        t![[1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12]]
    );
    let b = Req::new("b", toks(1..21).into_iter().chain(50..54), 4);
    assert_eq!(
        lookup(&mut m, &b),
        (20, t![[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]])
    );
    // Without the window's block 3, the longest window hit ends at token 12 on blocks
    // 1 and 2 (freed by the decode, still cached); full attention is cut to match.
    m.evict_blocks(&[9]).unwrap();
    assert_eq!(lookup(&mut m, &b), (12, t![[1, 2, 3], [0, 7, 8]]));
    m.check_invariants().unwrap();
}
