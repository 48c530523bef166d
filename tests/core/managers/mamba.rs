//! `MambaManager` (vLLM 0.33) in its three situations: "none" mode (one live state
//! block, no caching), "align" mode with the Mamba block equal to the attention block,
//! and "align" mode with a Mamba block twice the hash block (partial sub-block hits,
//! copy-on-write). The numbers are vLLM's answers to the same calls.

use hscache::manager::{AllocateSlots, KVCacheManager, MambaCacheMode};

use crate::managers::common::*;
use crate::t;

fn fa_mamba_none(num_speculative_blocks: usize) -> KVCacheManager {
    let groups = vec![
        fa(4),
        mamba(4, MambaCacheMode::None, num_speculative_blocks),
    ];
    manager_without_caching(groups, 16, 4)
}

fn fa_mamba_align(num_speculative_blocks: usize) -> KVCacheManager {
    manager(
        vec![
            fa(4),
            mamba(4, MambaCacheMode::Align, num_speculative_blocks),
        ],
        20,
        4,
    )
}

/// Full attention 4 + Mamba "align" 8: scheduler block 8, hash block 4, partial hash
/// hits on.
fn fa4_mamba8_align() -> KVCacheManager {
    let groups = vec![fa(4), mamba(8, MambaCacheMode::Align, 0)];
    KVCacheManager::new(config(groups, 20, 8, 4)).expect("valid layout")
}

fn no_args() -> AllocateSlots<'static> {
    AllocateSlots::default()
}

#[test]
fn only_the_last_computed_tokens_state_is_needed() {
    let m = fa_mamba_none(0);
    let mamba = m.coordinator().manager(1);
    let skipped: Vec<usize> = [0, 1, 10].map(|n| mamba.get_num_skipped_tokens(n)).into();
    assert_eq!(skipped, [0, 0, 9]);
}

#[test]
fn none_mode_keeps_one_state_block() {
    let mut m = fa_mamba_none(0);
    let mut a = Req::new("a", toks(1..11), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, no_args());
    assert_eq!(new, Some(t![[1, 2, 3], [4, 5, 6]]));
    // 10 processed tokens: the states of tokens 0..9 are dropped (blocks 0, 1).
    assert_eq!(decode(&mut m, &mut a, 99, no_args()), Some(t![[], []]));
    assert_eq!(tables(&m, "a"), t![[1, 2, 3], [0, 0, 6]]);
    assert_eq!(queue(&m), [5, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
    decode(&mut m, &mut a, 98, no_args());
    assert_eq!(tables(&m, "a"), t![[1, 2, 3], [0, 0, 6]]);
    // Groups are freed in order, each tail first; unhashed blocks go to the head.
    m.free("a").unwrap();
    assert_eq!(
        queue(&m),
        [6, 3, 2, 1, 5, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    );
}

#[test]
fn none_mode_allocates_speculative_blocks_past_the_tokens() {
    let mut m = fa_mamba_none(2);
    let mut a = Req::new("a", toks(1..11), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, no_args());
    assert_eq!(new, Some(t![[1, 2, 3], [4, 5, 6, 7, 8]]));
    decode(&mut m, &mut a, 99, no_args());
    assert_eq!(tables(&m, "a"), t![[1, 2, 3], [0, 0, 6, 7, 8]]);
    assert_eq!(queue(&m), [5, 4, 9, 10, 11, 12, 13, 14, 15]);
}

#[test]
fn align_mode_places_the_state_in_the_last_block_and_retires_the_previous_one() {
    let mut m = fa_mamba_align(0);
    let mut a = Req::new("a", toks(1..11), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, no_args());
    // One state block, at the position of the last computed token; nulls before it.
    assert_eq!(new, Some(t![[1, 2, 3], [0, 0, 4]]));
    let mut steps = Vec::new();
    for token in 90..97 {
        steps.push((
            decode(&mut m, &mut a, token, no_args()).unwrap(),
            tables(&m, "a"),
        ));
        m.new_step_starts();
    }
    assert_eq!(
        steps,
        [
            (t![[], []], t![[1, 2, 3], [0, 0, 4]]),
            (t![[], []], t![[1, 2, 3], [0, 0, 4]]),
            (t![[5], [6]], t![[1, 2, 3, 5], [0, 0, 4, 6]]),
            // The previous state block fed the copy into the new one; it goes now.
            (t![[], []], t![[1, 2, 3, 5], [0, 0, 0, 6]]),
            (t![[], []], t![[1, 2, 3, 5], [0, 0, 0, 6]]),
            (t![[], []], t![[1, 2, 3, 5], [0, 0, 0, 6]]),
            (t![[7], [8]], t![[1, 2, 3, 5, 7], [0, 0, 0, 6, 8]]),
        ]
    );
    assert_eq!(queue(&m), [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 4]);
    // A request sharing 16 tokens hits the state cached at token 16: nulls, then it.
    let mut b = Req::new(
        "b",
        toks(1..11).into_iter().chain(90..96).chain([50, 51]),
        4,
    );
    let (hit, hits, new) = admit(&mut m, &mut b, None, no_args());
    assert_eq!((hit, hits), (16, t![[1, 2, 3, 5], [0, 0, 0, 6]]));
    assert_eq!(new, Some(t![[9], [10]]));
    assert_eq!(tables(&m, "b"), t![[1, 2, 3, 5, 9], [0, 0, 0, 6, 10]]);
    m.check_invariants().unwrap();
}

#[test]
fn align_mode_relocates_speculative_blocks_to_the_tables_end() {
    let mut m = fa_mamba_align(1);
    let la = || AllocateSlots {
        num_lookahead_tokens: 1,
        ..Default::default()
    };
    let mut a = Req::new("a", toks(1..11), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, la());
    assert_eq!(new, Some(t![[1, 2, 3], [0, 0, 4, 5]]));
    let mut steps = Vec::new();
    for token in 90..96 {
        steps.push((
            decode(&mut m, &mut a, token, la()).unwrap(),
            tables(&m, "a"),
        ));
        m.new_step_starts();
    }
    assert_eq!(
        steps,
        [
            (t![[], []], t![[1, 2, 3], [0, 0, 4, 5]]),
            (t![[6], []], t![[1, 2, 3, 6], [0, 0, 4, 5]]),
            (t![[], [7]], t![[1, 2, 3, 6], [0, 0, 4, 5, 7]]),
            (t![[], []], t![[1, 2, 3, 6], [0, 0, 0, 5, 7]]),
            (t![[], []], t![[1, 2, 3, 6], [0, 0, 0, 5, 7]]),
            (t![[8], []], t![[1, 2, 3, 6, 8], [0, 0, 0, 5, 7]]),
        ]
    );
    m.check_invariants().unwrap();
}

#[test]
fn a_state_cached_in_this_step_is_hit_only_from_the_next_step() {
    let mut m = fa_mamba_align(0);
    let mut a = Req::new("a", toks(1..10), 4);
    let (_, _, new) = admit(&mut m, &mut a, Some(8), no_args());
    assert_eq!(new, Some(t![[1, 2], [0, 3]]));
    let mut b = Req::new("b", toks(1..9).into_iter().chain(60..63), 4);
    let (hit, hits) = lookup(&mut m, &b);
    assert_eq!((hit, hits.clone()), (8, t![[1, 2], [0, 3]]));
    // vLLM reports "does not fit" (num_gpu_blocks + 1 blocks) so that b waits.
    assert_eq!(allocate(&mut m, &b, 3, Some((hit, &hits)), no_args()), None);
    m.new_step_starts();
    let (_, _, new) = admit(&mut m, &mut b, None, no_args());
    assert_eq!(new, Some(t![[4], [5]]));
    assert_eq!(tables(&m, "b"), t![[1, 2, 4], [0, 3, 5]]);
    assert_eq!(queue(&m), (6..20).collect::<Vec<_>>());
}

#[test]
fn a_partial_hit_inside_a_mamba_block_is_copied_on_write() {
    let mut m = fa4_mamba8_align();
    assert!(m.coordinator().enable_partial_hash_hits());
    // The producer prefills its 13-token prompt in the chunks vLLM's Scheduler cuts
    // (Mamba block boundary 8, then the prompt's last hash boundary 12).
    let mut a = Req::new("a", toks(1..14), 4);
    let (_, _, new) = admit(&mut m, &mut a, Some(8), no_args());
    assert_eq!(new, Some(t![[1, 2], [3]]));
    assert_eq!(end_step(&mut m), []);
    assert_eq!(chunk(&mut m, &mut a, 4, no_args()), Some(t![[4], [5]]));
    assert_eq!(tables(&m, "a"), t![[1, 2, 4], [3, 5]]);
    assert_eq!(end_step(&mut m), []);
    // Block 5 holds the state at 12 (a partial entry); the producer keeps running on
    // it, so the entry moves to a copy (7) that this step's copy fills.
    assert_eq!(chunk(&mut m, &mut a, 1, no_args()), Some(t![[6], []]));
    assert_eq!(tables(&m, "a"), t![[1, 2, 4, 6], [0, 5]]);
    assert_eq!(end_step(&mut m), [(5, 7)]);
    assert_eq!(
        queue(&m),
        [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3, 7]
    );
    assert_eq!(
        pool_state(&m),
        [
            (1, 1, Some(4)),
            (2, 1, Some(8)),
            (3, 0, Some(8)),
            (4, 1, Some(12)),
            (5, 1, None),
            (6, 1, None),
            (7, 0, Some(12)),
        ]
    );
    // A consumer sharing 12 tokens hits inside Mamba block 1: its copy-on-write
    // block 9 replaces the shared block 7 in its table, both retained until the copy.
    let mut b = Req::new("b", toks(1..13).into_iter().chain(70..75), 4);
    let (hit, hits, new) = admit(&mut m, &mut b, Some(4), no_args());
    assert_eq!((hit, hits), (12, t![[1, 2, 4], [0, 7]]));
    assert_eq!(new, Some(t![[8], [9]]));
    assert_eq!(tables(&m, "b"), t![[1, 2, 4, 8], [0, 9]]);
    assert_eq!(
        pool_state(&m),
        [
            (1, 2, Some(4)),
            (2, 2, Some(8)),
            (3, 0, Some(8)),
            (4, 2, Some(12)),
            (5, 1, None),
            (6, 1, None),
            (7, 1, Some(12)),
            (8, 1, Some(16)),
            (9, 2, Some(16)),
        ]
    );
    assert_eq!(end_step(&mut m), [(7, 9)]);
    assert_eq!(queue(&m), [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3, 7]);
    m.free("a").unwrap();
    m.free("b").unwrap();
    assert_eq!(
        queue(&m),
        [5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3, 7, 8, 4, 2, 1, 9]
    );
    m.check_invariants().unwrap();
}

#[test]
fn an_evicted_prompt_boundary_state_is_cached_again() {
    // A connector's `evict_blocks` drops the key of a running request's state block
    // (the state at the prompt's last full block); the next allocation registers it
    // again, as vLLM does. hscache's hash-read plan used to miss that read (found by
    // `hybrid_proptest`): InternalError "block hash 2 was read but not planned", and
    // a poisoned manager. Fixed by c8898f7.
    let mut m = fa_mamba_align(0);
    let mut a = Req::new("a", toks(1..14), 4);
    let (_, _, new) = admit(&mut m, &mut a, Some(12), no_args());
    assert_eq!(new, Some(t![[1, 2, 3], [0, 0, 4]]));
    m.new_step_starts();
    m.evict_blocks(&[4]).unwrap();
    assert_eq!(m.block_pool().block_hash_num_tokens(4), None);
    assert_eq!(chunk(&mut m, &mut a, 1, no_args()), Some(t![[5], [6]]));
    assert_eq!(tables(&m, "a"), t![[1, 2, 3, 5], [0, 0, 4, 6]]);
    assert_eq!(m.block_pool().block_hash_num_tokens(4), Some(12));
    m.check_invariants().unwrap();
}
