//! `CrossAttentionManager` (vLLM 0.33): encoder-decoder models size the cross-attention
//! group by the encoder's tokens, once; nothing is shared or cached. Full attention 4 +
//! cross attention 4, 16 blocks, prefix caching off (vLLM's manager raises on any
//! lookup over a cross-attention group).

use hscache::manager::cross_attention::CrossAttentionManager;
use hscache::manager::single_type::{
    CacheQuery, GroupBlocks, HitQuery, ManagerBase, SingleTypeManager,
};
use hscache::manager::AllocateSlots;
use hscache::pool::BlockPool;
use hscache::ErrorKind;

use crate::managers::common::*;
use crate::t;

fn encoder(n: usize) -> AllocateSlots<'static> {
    AllocateSlots {
        num_encoder_tokens: n,
        ..Default::default()
    }
}

#[test]
fn the_encoder_tokens_get_blocks_once_at_admission() {
    let mut m = manager_without_caching(vec![fa(4), cross(4)], 16, 4);
    let mut a = Req::new("a", toks(1..6), 4);
    let (_, _, new) = admit(&mut m, &mut a, None, encoder(10));
    assert_eq!(new, Some(t![[1, 2], [3, 4, 5]]));
    // Decode steps pass no encoder tokens: the cross-attention table stays.
    for token in [99, 98, 97] {
        assert_eq!(decode(&mut m, &mut a, token, encoder(0)), Some(t![[], []]));
    }
    assert_eq!(decode(&mut m, &mut a, 96, encoder(0)), Some(t![[6], []]));
    assert_eq!(tables(&m, "a"), t![[1, 2, 6], [3, 4, 5]]);
    m.free("a").unwrap();
    assert_eq!(
        queue(&m),
        [5, 4, 3, 6, 2, 1, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    );
    // An encoder input larger than the pool does not fit (and changes nothing).
    let mut b = Req::new("b", toks(1..6), 4);
    let before = queue(&m);
    assert_eq!(admit(&mut m, &mut b, None, encoder(60)).2, None);
    assert_eq!(queue(&m), before);
    m.check_invariants().unwrap();
}

#[test]
fn cross_attention_never_takes_part_in_prefix_caching() {
    let base = ManagerBase::new(cross(4), 1, true, 4, 4, 1, 1, false);
    let mut cross = CrossAttentionManager::new(base);
    let mut pool = BlockPool::new(8, true, 4, false, false).unwrap();
    let hashes = token_hashes(&toks(1..9), 4);
    let q = HitQuery {
        block_hashes: &hashes,
        max_length: 7,
        group_ids: &[1],
        drop_eagle_block: false,
        alignment_tokens: 4,
    };
    let err = cross
        .find_longest_cache_hit(&pool, &q, &mut [Vec::new()])
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    let mut req = GroupBlocks::default();
    let err = cross
        .add_local_computed_blocks(&mut pool, "r0", &mut req, &[1], 4, 0)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    // No hits, no external blocks: nothing happens.
    cross
        .add_local_computed_blocks(&mut pool, "r0", &mut req, &[], 0, 0)
        .unwrap();
    cross
        .allocate_external_computed_blocks(&mut pool, "r0", &mut req, 0, 8, true)
        .unwrap();
    assert!(req.blocks.is_empty());
    let q = CacheQuery {
        request_id: "a",
        block_hashes: &hashes,
        num_tokens: 8,
        retention_interval: None,
        replay_boundaries: &[],
        num_prompt_tokens: 8,
        num_computed_tokens: 0,
        shared_prefix_boundary: 0,
    };
    let err = cross.cache_blocks(&mut pool, 0, &mut req, &q).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(pool.get_num_free_blocks(), 7);
}
