//! `CircularBufferManager` (vLLM 0.33): one ring block per request, claimed at its
//! first allocation, never hit, cached or skipped. Full attention 4 + a ring of
//! 4-token blocks, 16 blocks; the numbers are vLLM's.

use hscache::manager::{AllocateSlots, GroupedBlocks};

use crate::managers::common::*;
use crate::t;

#[test]
fn a_request_claims_one_ring_block_for_its_lifetime() {
    let mut m = manager(vec![fa(4), ring(4)], 16, 4);
    let mut a = Req::new("a", toks(1..11), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1, 2, 3], [4]]));
    for token in [99, 98] {
        assert_eq!(
            decode(&mut m, &mut a, token, AllocateSlots::default()),
            Some(t![[], []])
        );
    }
    assert_eq!(
        decode(&mut m, &mut a, 97, AllocateSlots::default()),
        Some(t![[5], []])
    );
    assert_eq!(tables(&m, "a"), t![[1, 2, 3, 5], [4]]);
    // The ring takes no part in hits: full attention alone decides.
    let mut b = Req::new("b", toks(1..11).into_iter().chain([5]), 4);
    let (hit, hits, new) = admit(&mut m, &mut b, None, AllocateSlots::default());
    assert_eq!((hit, hits, new), (8, t![[1, 2], []], Some(t![[6], [7]])));
    assert_eq!(queue(&m), [8, 9, 10, 11, 12, 13, 14, 15]);
    // The ring block is never hashed: freed, it goes to the queue's head.
    m.free("a").unwrap();
    assert_eq!(queue(&m), [4, 5, 8, 9, 10, 11, 12, 13, 14, 15, 3]);
    m.check_invariants().unwrap();
}

#[test]
fn the_ring_needs_one_block_until_it_has_one() {
    let mut m = manager(vec![ring(4)], 8, 4);
    let none = GroupedBlocks {
        ids: &[],
        ends: &[],
    };
    let need = |m: &mut hscache::manager::KVCacheManager| {
        m.coordinator_num_blocks_to_allocate(&hscache::manager::NumBlocksToAllocate {
            request_id: "a",
            num_tokens: 100,
            hits: none,
            num_encoder_tokens: 0,
            total_computed_tokens: 0,
            num_local_computed_tokens: 0,
            num_tokens_main_model: 100,
            apply_admission_cap: false,
            prefill_end: 0,
        })
        .unwrap()
    };
    assert_eq!(need(&mut m), 1);
    let mut a = Req::new("a", toks(1..30), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1]]));
    assert_eq!(need(&mut m), 0);
    assert!(m.block_pool().block_hash(1).is_none());
}
