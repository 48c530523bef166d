//! `ChunkedLocalAttentionManager` (vLLM 0.33): chunk 8, block 4; the numbers are
//! vLLM's answers to the same calls.

use hscache::manager::single_type::HitQuery;
use hscache::manager::{AllocateSlots, KVCacheManager};
use hscache::ErrorKind;

use crate::managers::common::*;
use crate::t;

#[test]
fn skipped_tokens_are_the_chunks_before_the_current_one() {
    // vLLM's docstring examples: 13 -> 8, 8 -> 8, 7 -> 0.
    let m = manager(vec![chunked_local(4, 8)], 8, 4);
    let cl = m.coordinator().manager(0);
    let skipped: Vec<usize> = [13, 8, 7, 0, 16, 17]
        .map(|n| cl.get_num_skipped_tokens(n))
        .into();
    assert_eq!(skipped, [8, 8, 0, 0, 16, 16]);
}

#[test]
fn earlier_chunks_count_as_hit_even_with_nothing_cached() {
    let mut m = manager(vec![chunked_local(4, 8)], 12, 4);
    // 16 tokens (max hit 15): tokens 0..8 are outside the last token's chunk; block 2
    // (tokens 8..12) would need a cached block.
    assert_eq!(
        lookup(&mut m, &Req::new("x", toks(1..17), 4)),
        (8, t![[0, 0]])
    );
    // 17 tokens (max hit 16): all of the first two chunks are outside.
    let mut y = Req::new("y", toks(1..18), 4);
    assert_eq!(lookup(&mut m, &y), (16, t![[0, 0, 0, 0]]));
    let (_, _, new) = admit(&mut m, &mut y, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1]]));
    assert_eq!(tables(&m, "y"), t![[0, 0, 0, 0, 1]]);
    m.check_invariants().unwrap();
}

#[test]
fn decode_at_a_chunk_boundary_frees_the_previous_chunk() {
    let mut m = manager(vec![fa(4), chunked_local(4, 8)], 20, 4);
    let mut a = Req::new("a", toks(1..21), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, AllocateSlots::default());
    assert_eq!(new, Some(t![[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]));
    // 20 processed: chunks [0, 8) and [8, 16) are skipped (4 blocks, cached: tail).
    assert_eq!(
        decode(&mut m, &mut a, 99, AllocateSlots::default()),
        Some(t![[11], [12]])
    );
    assert_eq!(
        tables(&m, "a"),
        t![[1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12]]
    );
    assert_eq!(queue(&m), [13, 14, 15, 16, 17, 18, 19, 9, 8, 7, 6]);
}

#[test]
fn hybrid_hit_looks_up_only_the_current_chunk() {
    let mut m = manager(vec![fa(4), chunked_local(4, 8)], 20, 4);
    let mut a = Req::new("a", toks(1..21), 4);
    admit(&mut m, &mut a, None, AllocateSlots::default());
    decode(&mut m, &mut a, 99, AllocateSlots::default());
    let mut b = Req::new("b", toks(1..21).into_iter().chain([77; 3]), 4);
    assert_eq!(
        lookup(&mut m, &b),
        (20, t![[1, 2, 3, 4, 5], [0, 0, 0, 0, 10]])
    );
    // Full attention loses block 3: the hit drops to 12, inside the second chunk,
    // whose block 2 (freed by the decode, still cached) the local group then needs.
    m.evict_blocks(&[4]).unwrap();
    assert_eq!(lookup(&mut m, &b), (12, t![[1, 2, 3], [0, 0, 8]]));
    let (hit, _, new) = admit(&mut m, &mut b, None, AllocateSlots::default());
    assert_eq!((hit, new), (12, Some(t![[13, 14, 15], [16, 17, 18]])));
    assert_eq!(
        tables(&m, "b"),
        t![[1, 2, 3, 13, 14, 15], [0, 0, 8, 16, 17, 18]]
    );
    assert_eq!(queue(&m), [19, 9, 7, 6]);
    m.check_invariants().unwrap();
}

#[test]
fn eagle_and_other_block_sizes_are_refused_as_vllm_asserts() {
    let m: KVCacheManager = manager(vec![chunked_local(4, 8)], 8, 4);
    let hashes = token_hashes(&toks(1..17), 4);
    let hit = |drop_eagle_block, alignment_tokens| {
        let q = HitQuery {
            block_hashes: &hashes,
            max_length: 15,
            group_ids: &[0],
            drop_eagle_block,
            alignment_tokens,
        };
        let mut out = vec![Vec::new()];
        m.coordinator()
            .manager(0)
            .find_longest_cache_hit(m.block_pool(), &q, &mut out)
            .map(|h| (h, out))
    };
    assert_eq!(hit(false, 4).unwrap(), (8, t![[0, 0]]));
    assert_eq!(hit(true, 4).unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(hit(false, 8).unwrap_err().kind(), ErrorKind::Unsupported);
}
