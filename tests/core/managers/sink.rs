//! `SinkFullAttentionManager` (vLLM 0.33) is full attention whose constructor checks
//! that the sink spans whole blocks. (vLLM 0.33's own `KVCacheManager` cannot build it:
//! the coordinator passes `needs_kv_cache_zeroing`, which its `__init__` rejects; so
//! these tests compare it with hscache's full attention instead of with vLLM.)

use hscache::manager::{AllocateSlots, GroupSpec, KVCacheManager};
use hscache::ErrorKind;

use crate::managers::common::*;

fn build(spec: GroupSpec) -> hscache::Result<KVCacheManager> {
    KVCacheManager::new(config(vec![spec], 12, 4, 4))
}

#[test]
fn the_sink_must_be_a_positive_number_of_whole_blocks() {
    for bad in [0, 6] {
        assert_eq!(
            build(sink(4, bad)).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
    assert!(build(sink(4, 8)).is_ok());
}

/// One scripted trace: shared prefixes, a decode, an eviction, frees.
fn trace(m: &mut KVCacheManager) -> Vec<String> {
    let mut log = Vec::new();
    let mut a = Req::new("a", toks(1..21), 4);
    log.push(format!(
        "{:?}",
        admit(m, &mut a, None, AllocateSlots::default())
    ));
    log.push(format!(
        "{:?}",
        decode(m, &mut a, 99, AllocateSlots::default())
    ));
    let mut b = Req::new("b", toks(1..13).into_iter().chain(40..47), 4);
    log.push(format!(
        "{:?}",
        admit(m, &mut b, None, AllocateSlots::default())
    ));
    m.free("a").expect("free");
    log.push(format!("{:?}", queue(m)));
    m.evict_blocks(&[3]).expect("evict_blocks");
    let c = Req::new("c", toks(1..21), 4);
    log.push(format!("{:?}", lookup(m, &c)));
    m.free("b").expect("free");
    log.push(format!("{:?} {:?}", queue(m), m.take_events().len()));
    m.check_invariants().expect("invariants");
    log
}

#[test]
fn a_sink_group_keeps_full_attentions_books() {
    let sink_log = trace(&mut build(sink(4, 8)).unwrap());
    let fa_log = trace(&mut build(fa(4)).unwrap());
    assert_eq!(sink_log, fa_log);
    // ... which are not trivial: b hits a's first 3 blocks, c only 2 after eviction.
    assert!(
        sink_log[2].starts_with("(12, [[1, 2, 3]]"),
        "{}",
        sink_log[2]
    );
    assert!(sink_log[4].starts_with("(8, [[1, 2]]"), "{}", sink_log[4]);
}
