//! `RSWAManager` (vLLM 0.33): full attention that frees, during decode, the blocks
//! between the prompt and the last `rswa_window` tokens. Block 4, window 8, a 10-token
//! prompt, 24 blocks; the tables are vLLM's after each decode step.

use hscache::manager::AllocateSlots;

use crate::managers::common::*;
use crate::t;

#[test]
fn decode_frees_the_gap_between_the_prompt_and_the_window() {
    let mut m = manager(vec![rswa(4, 8)], 24, 4);
    let mut a = Req::new("a", toks(1..11), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1, 2, 3]]));
    let mut seen = Vec::new();
    for token in 100..124 {
        decode(&mut m, &mut a, token, AllocateSlots::default()).unwrap();
        seen.push((a.r.num_computed_tokens, tables(&m, "a").remove(0)));
    }
    let at = |n: usize| seen.iter().find(|(c, _)| *c == n).unwrap().1.clone();
    // The prompt's blocks (0..=2, the last one partial) always stay; gap blocks are
    // those wholly inside [12, processed - 8).
    assert_eq!(at(24), [1, 2, 3, 4, 5, 6]);
    assert_eq!(at(25), [1, 2, 3, 0, 5, 6, 7]);
    assert_eq!(at(29), [1, 2, 3, 0, 0, 6, 7, 8]);
    assert_eq!(at(33), [1, 2, 3, 0, 0, 0, 7, 8, 9]);
    assert_eq!(at(34), [1, 2, 3, 0, 0, 0, 7, 8, 9]);
    // The gap blocks were cached: they wait at the queue's tail, oldest first.
    let tail: Vec<u32> = queue(&m).into_iter().skip(14).collect();
    assert_eq!(tail, [4, 5, 6]);
    m.check_invariants().unwrap();
}

#[test]
fn without_the_prompt_length_nothing_is_freed() {
    let mut m = manager(vec![rswa(4, 8)], 24, 4);
    let mut a = Req::new("a", toks(1..31), 4);
    admit(&mut m, &mut a, None, AllocateSlots::default());
    m.remove_skipped_blocks("a", 30, None).unwrap();
    assert_eq!(tables(&m, "a"), t![[1, 2, 3, 4, 5, 6, 7, 8]]);
    // Given an 8-token prompt: the gap is [8, 30 - 8) = blocks 2..=4.
    m.remove_skipped_blocks("a", 30, Some(8)).unwrap();
    assert_eq!(tables(&m, "a"), t![[1, 2, 0, 0, 0, 6, 7, 8]]);
}
