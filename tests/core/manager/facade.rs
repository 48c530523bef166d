//! Scenario tests of the core manager, with the exact outcomes vLLM 0.33's own
//! tests assert (`tests/v1/core/test_prefix_caching.py`): block ids, hit lengths
//! and free-queue orders.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use hscache::manager::{AllocateSlots, KVCacheManager};
use hscache::testing::{allocate, full_attention_manager, lookup, prompt_hashes, request};
use hscache::types::{BlockHash, BlockId};
use hscache::ErrorKind;

fn manager(num_blocks: u32, block_size: usize, caching: bool) -> KVCacheManager {
    full_attention_manager(num_blocks, block_size, 8192, caching, true, false)
}

/// Lookup + allocation of a new request, as the Scheduler admits it.
fn admit(
    m: &mut KVCacheManager,
    id: &str,
    tokens: usize,
    hashes: &[BlockHash],
) -> (usize, Vec<BlockId>) {
    hscache::testing::admit(m, &request(id, 0, tokens, hashes))
}

fn queue(m: &KVCacheManager) -> Vec<BlockId> {
    m.block_pool().free_block_queue().get_all_free_blocks()
}

#[test]
fn prefill_hits_shared_prefix_and_frees_in_vllm_order() {
    let mut m = manager(11, 16, true);
    let h0 = prompt_hashes(1, 3, 10, 0); // 55 tokens: 3 full blocks
    let (hit, blocks) = admit(&mut m, "0", 55, &h0);
    assert_eq!((hit, blocks.clone()), (0, vec![1, 2, 3, 4]));
    let h1 = prompt_hashes(1, 3, 11, 0); // 53 tokens sharing 48
    let (hit, blocks) = admit(&mut m, "1", 53, &h1);
    assert_eq!((hit, blocks), (48, vec![1, 2, 3, 5]));
    m.free("0").unwrap();
    assert_eq!(queue(&m), vec![4, 6, 7, 8, 9, 10]);
    m.free("1").unwrap();
    assert_eq!(queue(&m), vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
    m.check_invariants().unwrap();
}

#[test]
fn evict_order_is_lru_with_chain_tail_first() {
    let mut m = manager(11, 16, true);
    let h0 = prompt_hashes(1, 5, 0, 0); // 5*16+7 tokens -> 6 blocks
    admit(&mut m, "0", 87, &h0);
    let h1 = prompt_hashes(2, 3, 0, 0); // 48 tokens -> 3 blocks... 49 to need a 4th
    let (_, b1) = admit(&mut m, "1", 48, &h1);
    assert_eq!(b1, vec![7, 8, 9]);
    m.free("0").unwrap();
    assert_eq!(queue(&m), vec![6, 10, 5, 4, 3, 2, 1]);
    m.free("1").unwrap();
    assert_eq!(queue(&m), vec![6, 10, 5, 4, 3, 2, 1, 9, 8, 7]);
    // A miss reuses the head first and evicts cached blocks lazily.
    let h2 = prompt_hashes(3, 2, 0, 0);
    let (_, b2) = admit(&mut m, "2", 33, &h2);
    assert_eq!(b2, vec![6, 10, 5]);
    let removed = m
        .take_events()
        .into_iter()
        .filter(|e| matches!(e, hscache::events::KVCacheEvent::BlockRemoved { .. }))
        .count();
    assert_eq!(
        removed, 1,
        "only block 5 was cached among the reused blocks"
    );
}

#[test]
fn failed_allocation_leaves_hits_untouched() {
    let mut m = manager(6, 4, true);
    let h = prompt_hashes(7, 3, 0, 0);
    admit(&mut m, "a", 13, &h);
    m.free("a").unwrap();
    let before = queue(&m);
    let req = request("b", 0, 112, &h);
    let (hit, hits) = lookup(&mut m, &req);
    assert_eq!(hit, 12);
    let args = AllocateSlots {
        num_new_tokens: 100,
        num_new_computed_tokens: hit,
        ..Default::default()
    };
    assert_eq!(allocate(&mut m, &req, Some(&hits), args).unwrap(), None);
    assert_eq!(queue(&m), before);
    assert!(m.get_blocks("b", 0).is_empty());
}

#[test]
fn caching_disabled_reuses_freed_blocks_lifo() {
    let mut m = manager(6, 4, false);
    let h = prompt_hashes(7, 2, 0, 0);
    admit(&mut m, "a", 9, &h);
    m.free("a").unwrap();
    assert_eq!(queue(&m), vec![3, 2, 1, 4, 5]);
}

#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let mut m = manager(8, 4, true);
    let h = prompt_hashes(1, 2, 0, 0);
    admit(&mut m, "a", 9, &h);
    let before = queue(&m);
    let a = request("a", 9, 9, &h);
    let err = allocate(&mut m, &a, None, AllocateSlots::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    let args = AllocateSlots {
        num_new_tokens: 1 << 20,
        ..Default::default()
    };
    assert_eq!(
        allocate(&mut m, &a, None, args).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let args = AllocateSlots {
        num_new_tokens: 4,
        num_new_computed_tokens: 4,
        ..Default::default()
    };
    assert_eq!(
        allocate(&mut m, &request("b", 0, 9, &h), Some(&[vec![99]]), args)
            .unwrap_err()
            .kind(),
        ErrorKind::BlockIdOutOfRange
    );
    assert_eq!(
        m.free_blocks(&[5]).unwrap_err().kind(),
        ErrorKind::DoubleFree
    );
    assert_eq!(queue(&m), before);
    assert_eq!(m.get_blocks("a", 0), &[1, 2, 3]);
    m.check_invariants().unwrap();
}

/// Caller mistakes that once poisoned the manager (a typed error was found only
/// half-way through the apply phase) are typed errors found before anything changes;
/// the manager keeps serving.
#[test]
fn caller_mistakes_are_typed_errors_that_change_nothing() {
    let mut m = manager(12, 4, true);
    let h = prompt_hashes(1, 4, 0, 0);
    admit(&mut m, "a", 17, &h);
    m.free("a").unwrap();
    let (hit, hits) = lookup(&mut m, &request("b", 0, 17, &h));
    assert_eq!((hit, hits[0].len()), (16, 4));
    let digest = m.state_digest();

    // num_new_computed_tokens beyond the hit handed back: 2 blocks, 16 tokens claimed
    let args = AllocateSlots {
        num_new_tokens: 1,
        num_new_computed_tokens: 16,
        ..Default::default()
    };
    let short = [hits[0][..2].to_vec()];
    let e = allocate(&mut m, &request("b", 0, 17, &h), Some(&short), args).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(m.state_digest(), digest);

    // a negative reservation lets the fit check pass; the pool cannot serve it
    let big = prompt_hashes(9, 12, 0, 0);
    let args = AllocateSlots {
        num_new_tokens: 48,
        reserved_blocks: -5,
        ..Default::default()
    };
    let e = allocate(&mut m, &request("c", 0, 48, &big), None, args).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotEnoughFreeBlocks, "{e}");
    assert_eq!(m.state_digest(), digest);

    // cache_blocks past the blocks a delayed-caching request holds
    let args = AllocateSlots {
        num_new_tokens: 9,
        delay_cache_blocks: true,
        ..Default::default()
    };
    let d = request("d", 0, 17, &prompt_hashes(5, 4, 0, 0));
    allocate(&mut m, &d, None, args).unwrap().unwrap();
    let digest = m.state_digest();
    let e = m.cache_blocks(&d, 16).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(m.state_digest(), digest);
    m.cache_blocks(&d, 8).unwrap();

    // checked mode: a block of a live table is not freed behind the request's back
    m.set_check_invariants(true);
    let digest = m.state_digest();
    let held = m.get_blocks("d", 0)[2];
    let e = m.free_blocks(&[held]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(m.state_digest(), digest);

    assert!(m.poisoned().is_none());
    admit(&mut m, "b", 17, &h);
    m.free("b").unwrap();
    m.free("d").unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn duplicate_blocks_are_both_indexed_and_first_is_returned() {
    let mut m = manager(10, 4, true);
    let h = prompt_hashes(5, 2, 0, 0);
    // Both requests compute the same prompt concurrently (no hit for either).
    for id in ["a", "b"] {
        let args = AllocateSlots {
            num_new_tokens: 9,
            ..Default::default()
        };
        assert!(allocate(&mut m, &request(id, 0, 9, &h), None, args)
            .unwrap()
            .is_some());
    }
    assert_eq!(m.get_blocks("a", 0), &[1, 2, 3]);
    assert_eq!(m.get_blocks("b", 0), &[4, 5, 6]);
    let probe = request("c", 0, 9, &h);
    assert_eq!(lookup(&mut m, &probe).1, vec![vec![1, 2]]);
    m.free("a").unwrap();
    m.evict_blocks(&[1]).unwrap();
    assert_eq!(lookup(&mut m, &probe).1, vec![vec![4, 2]]);
    m.check_invariants().unwrap();
}
