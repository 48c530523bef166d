//! Scenario tests of the core manager, with the exact outcomes vLLM 0.33's own
//! tests assert (`tests/v1/core/test_prefix_caching.py`): block ids, hit lengths
//! and free-queue orders.

use hscache::manager::{AllocateSlots, KVCacheManager, KVCacheManagerConfig, RequestView};
use hscache::testing::prompt_hashes;
use hscache::types::{BlockHash, BlockId};
use hscache::ErrorKind;

fn manager(num_blocks: u32, block_size: usize, caching: bool) -> KVCacheManager {
    KVCacheManager::new(KVCacheManagerConfig {
        num_blocks,
        block_size,
        max_model_len: 8192,
        enable_caching: caching,
        enable_kv_cache_events: true,
        use_eagle: false,
        watermark_blocks: 0,
        num_reprefillable_tokens: 0,
        needs_kv_cache_zeroing: false,
    })
    .unwrap()
}

/// A `RequestView` of a fresh request (a macro: the `num_tokens` closure is a
/// temporary that lives for the enclosing statement).
macro_rules! view {
    ($id:expr, $tokens:expr, $hashes:expr) => {
        RequestView {
            request_id: $id,
            num_computed_tokens: 0,
            num_tokens: &move || Ok($tokens),
            block_hashes: &|| Ok($hashes),
        }
    };
}

/// Lookup + allocation of a new request, as the Scheduler admits it.
fn admit(
    m: &mut KVCacheManager,
    id: &str,
    tokens: usize,
    hashes: &Vec<BlockHash>,
) -> (usize, Vec<BlockId>) {
    let mut hits = vec![];
    let hit = m
        .find_longest_cache_hit(hashes, tokens - 1, &mut hits)
        .unwrap();
    let args = AllocateSlots {
        num_new_tokens: tokens - hit,
        num_new_computed_tokens: hit,
        new_computed_blocks: if hits.is_empty() { None } else { Some(&hits) },
        ..Default::default()
    };
    let mut new = vec![];
    assert!(m
        .allocate_slots(&view!(id, tokens, hashes), &args, &mut new)
        .unwrap());
    (hit, m.get_blocks(id).to_vec())
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
    m.block_pool().check_invariants().unwrap();
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
    let mut hits = vec![];
    let hit = m.find_longest_cache_hit(&h, 100, &mut hits).unwrap();
    assert_eq!(hit, 12);
    let args = AllocateSlots {
        num_new_tokens: 100,
        num_new_computed_tokens: hit,
        new_computed_blocks: Some(&hits),
        ..Default::default()
    };
    let mut new = vec![];
    assert!(!m
        .allocate_slots(&view!("b", 112, &h), &args, &mut new)
        .unwrap());
    assert_eq!(queue(&m), before);
    assert!(m.get_blocks("b").is_empty());
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
    let args = AllocateSlots::default();
    let mut out = vec![];
    let err = m
        .allocate_slots(&view!("a", 9, &h), &args, &mut out)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    let args = AllocateSlots {
        num_new_tokens: 1 << 20,
        ..Default::default()
    };
    assert_eq!(
        m.allocate_slots(&view!("a", 9, &h), &args, &mut out)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let hits = [99];
    let args = AllocateSlots {
        num_new_tokens: 4,
        num_new_computed_tokens: 4,
        new_computed_blocks: Some(&hits),
        ..Default::default()
    };
    assert_eq!(
        m.allocate_slots(&view!("b", 9, &h), &args, &mut out)
            .unwrap_err()
            .kind(),
        ErrorKind::BlockIdOutOfRange
    );
    assert_eq!(
        m.block_pool_mut().free_blocks([5]).unwrap_err().kind(),
        ErrorKind::DoubleFree
    );
    assert_eq!(queue(&m), before);
    assert_eq!(m.get_blocks("a"), &[1, 2, 3]);
    m.block_pool().check_invariants().unwrap();
}

#[test]
fn duplicate_blocks_are_both_indexed_and_first_is_returned() {
    let mut m = manager(10, 4, true);
    let h = prompt_hashes(5, 2, 0, 0);
    // Both requests compute the same prompt concurrently (no hit for either).
    for id in ["a", "b"] {
        let args = AllocateSlots {
            num_new_tokens: 9,
            new_computed_blocks: None,
            ..Default::default()
        };
        let mut out = vec![];
        assert!(m
            .allocate_slots(&view!(id, 9, &h), &args, &mut out)
            .unwrap());
    }
    assert_eq!(m.get_blocks("a"), &[1, 2, 3]);
    assert_eq!(m.get_blocks("b"), &[4, 5, 6]);
    let mut hits = vec![];
    m.find_longest_cache_hit(&h, 8, &mut hits).unwrap();
    assert_eq!(hits, vec![1, 2]);
    m.free("a").unwrap();
    m.evict_blocks(&[1]).unwrap();
    hits.clear();
    m.find_longest_cache_hit(&h, 8, &mut hits).unwrap();
    assert_eq!(hits, vec![4, 2]);
    m.block_pool().check_invariants().unwrap();
}
