//! Scenario tests of the HiSparse coordinator through the manager facade (the
//! differential traces in `tests/hisparse/test_hisparse.py` hold every decision against vLLM).

use super::{cpython_set_order, HiSparseRequestState, PlainPublicationRequests};
use crate::manager::{AllocateSlots, KVCacheManager, PlainRequest};
use crate::testing::{allocate, hisparse_manager, lookup, prompt_hashes, request};
use crate::types::{BlockId, NULL_BLOCK_ID};

const BS: usize = 4;
const FINISHED: PlainPublicationRequests = PlainPublicationRequests { finished: true };
const RUNNING: PlainPublicationRequests = PlainPublicationRequests { finished: false };

fn admit(m: &mut KVCacheManager, req: &PlainRequest, new: usize) -> Option<Vec<BlockId>> {
    let (hit, hits) = lookup(m, req);
    let any = hits.iter().any(|h| !h.is_empty());
    let args = AllocateSlots {
        num_new_tokens: new,
        num_new_computed_tokens: hit,
        ..Default::default()
    };
    allocate(m, req, any.then_some(&hits[..]), args).expect("allocate")
}

/// The connector's step for `rid` with `num_tokens` computed: the planned transfer ids.
fn step(m: &mut KVCacheManager, rid: &str, num_tokens: usize) -> Vec<u64> {
    m.hisparse_call(|h, ctx| {
        h.advance_scheduled(ctx, &[(rid.into(), num_tokens)])?;
        Ok(h.build_offload_command().unwrap_or_default())
    })
    .expect("step")
    .into_iter()
    .map(|t| t.transfer_id)
    .collect()
}

fn ack(m: &mut KVCacheManager, ids: &[u64]) {
    let counts: Vec<(u64, u64)> = ids.iter().map(|&i| (i, 1)).collect();
    m.hisparse_call(|h, ctx| h.update_spills(ctx, &counts, &counts, &RUNNING))
        .expect("acks");
}

/// The HiSparse coordinator's state of `rid`.
fn hisparse_state<'m>(m: &'m KVCacheManager, rid: &str) -> &'m HiSparseRequestState {
    m.coordinator()
        .hisparse()
        .expect("hisparse")
        .request_state(rid)
        .expect("state")
}

/// A manager running request "r" (a 12-token prompt, hashes of `seed`) whose first
/// step planned its spills: the manager, the spills' ids and the host table.
fn spilling_request(seed: u64) -> (KVCacheManager, Vec<u64>, Vec<BlockId>) {
    let mut m = hisparse_manager(40, 16, BS, 64, 2, true);
    let hashes = prompt_hashes(seed, 3, 0, 0);
    let r = request("r", 0, 12, &hashes);
    admit(&mut m, &r, 12).expect("fits");
    let spills = step(&mut m, "r", 12);
    let host_table = m.get_blocks("r", 0).to_vec();
    (m, spills, host_table)
}

fn residency_row(m: &KVCacheManager, rid: &str) -> Vec<BlockId> {
    let resident = m
        .coordinator()
        .manager(2)
        .hisparse_resident()
        .expect("resident");
    let mut row = Vec::new();
    resident.residency_row(rid, m.get_blocks(rid, 2), 0, &mut row);
    row
}

#[test]
fn durable_pages_publish_and_a_later_hit_adopts_their_gpu_copies() {
    let mut m = hisparse_manager(40, 16, BS, 64, 2, true);
    let hashes = prompt_hashes(1, 4, 0, 0);
    let r0 = request("r0", 0, 16, &hashes);
    admit(&mut m, &r0, 16).expect("fits");
    let spills = step(&mut m, "r0", 16);
    assert_eq!(spills.len(), 4);
    let original = residency_row(&m, "r0");
    // Nothing is durable yet: no host hit, so no hit at all.
    let r1 = request("r1", 0, 17, &hashes);
    assert_eq!(lookup(&mut m, &r1).0, 0);
    ack(&mut m, &spills);
    assert_eq!(lookup(&mut m, &r1).0, 16);
    m.free_with("r0", &FINISHED).expect("free");
    admit(&mut m, &r1, 1).expect("fits");
    m.hisparse_call(|h, ctx| h.update_residency(ctx, "r1"))
        .expect("residency");
    // The host prefix came back GPU-resident: the surviving copies were adopted.
    assert_eq!(&residency_row(&m, "r1")[..4], &original[..]);
    m.check_invariants().expect("invariants");
}

#[test]
fn a_reused_unpinned_page_is_lost_and_needs_the_hot_region() {
    let mut m = hisparse_manager(40, 16, BS, 64, 2, true);
    let hashes = prompt_hashes(2, 6, 0, 0);
    let r = request("r", 0, 24, &hashes);
    admit(&mut m, &r, 24).expect("fits");
    let spills = step(&mut m, "r", 24);
    m.hisparse_call(|_, ctx| {
        ctx.managers[3]
            .hisparse_hot_mut()
            .expect("hot")
            .require_hot("r");
        Ok(())
    })
    .expect("require");
    // The next decode step allocates the hot region.
    let running = request("r", 24, 25, &hashes);
    let args = AllocateSlots {
        num_new_tokens: 1,
        ..Default::default()
    };
    allocate(&mut m, &running, None, args)
        .expect("allocate")
        .expect("fits");
    assert_eq!(m.get_blocks("r", 3).len(), 2);
    ack(&mut m, &spills);
    // Clean sealed pages behind the active tail (the table has 7 pages) were unpinned
    // on completion.
    let state = hisparse_state(&m, "r");
    assert_eq!(
        state.unpinned_pages.iter().copied().collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    let free = m.block_pool().get_num_free_blocks();
    let mut taken = Vec::new();
    m.get_new_blocks(free, &mut taken).expect("pressure");
    let row = residency_row(&m, "r");
    assert_eq!(&row[..5], &[NULL_BLOCK_ID; 5]);
    assert!(row[5] != NULL_BLOCK_ID);
    let state = hisparse_state(&m, "r");
    assert!(state.unpinned_pages.is_empty());
    m.check_invariants().expect("invariants");
}

#[test]
fn a_finished_request_publishes_its_durable_pages_after_its_last_spill() {
    let (mut m, spills, host_table) = spilling_request(3);
    m.free_with("r", &FINISHED).expect("free");
    let host = m.host_pool().expect("host pool");
    // Leased by the detached publication and by the spills.
    assert!(host_table.iter().all(|&b| host.ref_cnt(b) == 2));
    assert!(host_table.iter().all(|&b| host.block_hash(b).is_none()));
    ack(&mut m, &spills);
    let host = m.host_pool().expect("host pool");
    assert!(host_table.iter().all(|&b| host.ref_cnt(b) == 0));
    assert!(host_table.iter().all(|&b| host.block_hash(b).is_some()));
    assert!(!m
        .coordinator()
        .hisparse()
        .expect("hisparse")
        .has_pending_work());
    m.check_invariants().expect("invariants");
}

#[test]
fn a_preempted_request_drops_its_publication() {
    let (mut m, spills, host_table) = spilling_request(4);
    m.free_with("r", &RUNNING).expect("free");
    ack(&mut m, &spills);
    let host = m.host_pool().expect("host pool");
    assert!(host_table.iter().all(|&b| host.block_hash(b).is_none()));
    assert!(host_table.iter().all(|&b| host.ref_cnt(b) == 0));
}

#[test]
fn host_exhaustion_is_the_admission_sentinel() {
    // Three usable host blocks cannot back a four-page prompt.
    let mut m = hisparse_manager(40, 4, BS, 64, 2, false);
    let r = request("r", 0, 16, &prompt_hashes(5, 4, 0, 0));
    assert!(admit(&mut m, &r, 16).is_none());
    assert_eq!(m.block_pool().get_num_free_blocks(), 39);
    let small = request("s", 0, 12, &prompt_hashes(6, 3, 0, 0));
    assert!(admit(&mut m, &small, 12).is_some());
}

#[test]
fn set_order_is_cpythons() {
    // `list(s)` after `s.add(k)` for each key, keys hashing to themselves.
    assert_eq!(cpython_set_order(&[5, 1, 3]), vec![1, 2, 0]);
    assert_eq!(cpython_set_order(&[40, 8, 3, 17, 2]), vec![4, 2, 0, 1, 3]);
    assert_eq!(
        cpython_set_order(&[100, 36, 4, 68, 12, 200, 1000, 7, 15, 23]),
        vec![0, 2, 1, 3, 5, 6, 7, 4, 8, 9]
    );
}
