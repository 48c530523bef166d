//! Unit tests of `EncoderCacheManager` (vLLM 0.33's expected outcomes).

use super::*;
use crate::error::ErrorKind;

const BIG: i64 = 1_000_000_000;

fn freeable(m: &EncoderCacheManager) -> Vec<(String, i64)> {
    m.freeable().map(|(k, n)| (k.to_owned(), n)).collect()
}

/// `can_allocate` then `allocate`, as the Scheduler does.
fn admit(m: &mut EncoderCacheManager, req: &str, input: u32, id: &str, n: i64) {
    assert!(m.can_allocate(n, BIG, 0).unwrap());
    m.allocate(req, input, id, n).unwrap();
}

#[test]
fn allocate_then_hit_shares_one_entry() {
    let mut m = EncoderCacheManager::new(10).unwrap();
    assert!(!m.check_and_update_cache("r1", 0, "a").unwrap());
    admit(&mut m, "r1", 0, "a", 4);
    assert!(m.check_and_update_cache("r2", 0, "a").unwrap());
    assert_eq!(m.num_free_slots(), 6);
    assert_eq!(m.num_freeable_slots(), 6);
    let mut refs = m.cached_request_ids("a").unwrap();
    refs.sort_unstable();
    assert_eq!(refs, ["r1", "r2"]);
    assert_eq!(m.get_cached_num_encoder_embeds("a"), Some(4));
}

#[test]
fn last_reference_makes_entry_freeable_not_free() {
    let mut m = EncoderCacheManager::new(10).unwrap();
    admit(&mut m, "r1", 0, "a", 4);
    m.free_encoder_input("r1", 0, "a").unwrap();
    assert_eq!(freeable(&m), [("a".to_owned(), 4)]);
    assert_eq!(m.num_free_slots(), 6);
    assert_eq!(m.num_freeable_slots(), 10);
    assert_eq!(m.cached_request_ids("a"), Some(vec![]));
    assert_eq!(m.request_ids().count(), 0);
    // A hit restores it.
    assert!(m.check_and_update_cache("r2", 0, "a").unwrap());
    assert!(freeable(&m).is_empty());
    assert_eq!(m.num_freeable_slots(), 6);
}

#[test]
fn eviction_is_oldest_first_and_only_as_much_as_needed() {
    let mut m = EncoderCacheManager::new(10).unwrap();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        admit(&mut m, "r", i as u32, id, 3);
    }
    m.free_encoder_input("r", 1, "b").unwrap();
    m.free_encoder_input("r", 0, "a").unwrap();
    m.free_encoder_input("r", 2, "c").unwrap();
    // 1 free; 4 needed: evicting "b" (oldest freeable) is enough.
    assert!(m.can_allocate(4, BIG, 0).unwrap());
    assert_eq!(m.num_free_slots(), 4);
    assert_eq!(freeable(&m), [("a".to_owned(), 3), ("c".to_owned(), 3)]);
    assert_eq!(m.get_freed_mm_hashes(), ["b"]);
    assert!(m.get_freed_mm_hashes().is_empty());
    // Neither budget nor capacity: no eviction.
    assert!(!m.can_allocate(4, 3, 0).unwrap());
    assert!(!m.can_allocate(4, BIG, 7).unwrap());
    assert_eq!(m.num_freeable_entries(), 2);
}

#[test]
fn recached_identifier_is_not_reported_freed() {
    let mut m = EncoderCacheManager::new(8).unwrap();
    admit(&mut m, "ra", 0, "a", 4);
    admit(&mut m, "rb", 0, "b", 4);
    m.free("ra").unwrap();
    m.free("rb").unwrap();
    admit(&mut m, "rc", 0, "c", 4);
    admit(&mut m, "ra", 0, "a", 4);
    assert_eq!(m.get_freed_mm_hashes(), ["b"]);
}

#[test]
fn repeated_item_stays_referenced_until_its_last_input_is_freed() {
    let mut m = EncoderCacheManager::new(8).unwrap();
    admit(&mut m, "r1", 0, "a", 4);
    assert!(m.check_and_update_cache("r1", 1, "a").unwrap());
    assert_eq!(m.request_hash_refs("r1"), Some(vec![("a", 2)]));
    m.free_encoder_input("r1", 0, "a").unwrap();
    assert_eq!(m.cached_request_ids("a"), Some(vec!["r1"]));
    assert!(!m.can_allocate(8, BIG, 0).unwrap());
    m.free_encoder_input("r1", 1, "a").unwrap();
    assert_eq!(freeable(&m), [("a".to_owned(), 4)]);
    assert!(m.request_hash_refs("r1").is_none());
}

#[test]
fn free_releases_inputs_in_python_set_order() {
    let mut m = EncoderCacheManager::new(100).unwrap();
    // Small ids: ascending, whatever the insertion order.
    admit(&mut m, "r", 2, "c", 3);
    admit(&mut m, "r", 0, "a", 3);
    admit(&mut m, "r", 1, "b", 3);
    m.free("r").unwrap();
    let order: Vec<_> = freeable(&m).into_iter().map(|(k, _)| k).collect();
    assert_eq!(order, ["a", "b", "c"]);
    // Colliding ids: {9, 1, 17} iterates as inserted (CPython 3.11 prints [9, 1, 17]).
    for (i, id) in [(9, "i9"), (1, "i1"), (17, "i17")] {
        admit(&mut m, "s", i, id, 1);
    }
    assert_eq!(m.get_cached_input_ids("s").collect::<Vec<_>>(), [9, 1, 17]);
    m.free("s").unwrap();
    let order: Vec<_> = freeable(&m).into_iter().skip(3).map(|(k, _)| k).collect();
    assert_eq!(order, ["i9", "i1", "i17"]);
}

#[test]
fn names_are_released_when_nothing_refers_to_them() {
    let mut m = EncoderCacheManager::new(4).unwrap();
    for i in 0..100 {
        let id = format!("img{i}");
        let req = format!("r{i}");
        admit(&mut m, &req, 0, &id, 4);
        m.free(&req).unwrap();
        let _ = m.get_freed_mm_hashes();
    }
    // One entry cached (freeable), no request left.
    assert_eq!(m.entries.len(), 1);
    assert_eq!(m.requests.len(), 0);
}

#[test]
fn a_handle_from_find_cached_survives_changes_in_between() {
    let mut m = EncoderCacheManager::new(4).unwrap();
    admit(&mut m, "r1", 0, "a", 4);
    m.free("r1").unwrap();
    let handle = m.find_cached("a").unwrap();
    // "a" is evicted and its slot reused for "b" before the handle is used.
    admit(&mut m, "r2", 0, "b", 4);
    let _ = m.get_freed_mm_hashes();
    assert!(!m.add_cached_reference(handle, "a", "r3", 0).unwrap());
    let handle = m.find_cached("b").unwrap();
    assert!(m.add_cached_reference(handle, "b", "r3", 0).unwrap());
    let mut refs = m.cached_request_ids("b").unwrap();
    refs.sort_unstable();
    assert_eq!(refs, ["r2", "r3"]);
}

#[test]
fn errors_leave_state_unchanged() {
    let mut m = EncoderCacheManager::new(10).unwrap();
    admit(&mut m, "r1", 0, "a", 4);
    let before = format!("{m:?}");
    let e = m.allocate("r2", 0, "a", 5).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = m.allocate("r2", 0, "b", 7).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::EncoderCacheFull);
    let e = m.free_encoder_input("r1", 0, "b").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = m.can_allocate(-1, BIG, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(format!("{m:?}"), before);
    assert!(EncoderCacheManager::new(-1).is_err());
}

#[test]
fn clear_cached_keeps_the_other_maps_like_vllm() {
    let mut m = EncoderCacheManager::new(10).unwrap();
    admit(&mut m, "r1", 0, "a", 4);
    m.free("r1").unwrap();
    m.clear_cached();
    assert_eq!(m.cached_identifiers().count(), 0);
    assert_eq!(m.freeable_get("a"), Some(4));
    assert_eq!(m.get_cached_num_encoder_embeds("a"), Some(4));
    // vLLM raises KeyError evicting an entry missing from `cached`.
    let e = m.can_allocate(8, BIG, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownEncoderEntry);
    assert_eq!(m.num_free_slots(), 6);
}

#[test]
fn reset_restores_capacity_and_forgets_everything() {
    let mut m = EncoderCacheManager::new(10).unwrap();
    admit(&mut m, "r1", 0, "a", 4);
    admit(&mut m, "r1", 1, "b", 6);
    m.free_encoder_input("r1", 0, "a").unwrap();
    assert!(m.can_allocate(4, BIG, 0).unwrap());
    m.reset();
    assert_eq!((m.num_free_slots(), m.num_freeable_slots()), (10, 10));
    assert_eq!(m.cached_identifiers().count(), 0);
    assert_eq!(m.freed().count(), 0);
    assert_eq!(m.get_cached_num_encoder_embeds("b"), None);
    assert_eq!(m.get_cached_input_ids("r1").count(), 0);
}

/// Under Scheduler-like use, `num_freeable_slots` is the free capacity plus the
/// sizes in `freeable`, and `num_free_slots` the capacity no entry holds.
#[test]
fn counters_match_the_maps_on_random_traces() {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut rand = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let mut m = EncoderCacheManager::new(64).unwrap();
    for _ in 0..20_000 {
        let (r, input) = (rand(12), rand(40) as u32);
        let req = format!("r{r}");
        // A request's inputs keep their identifiers; requests share some.
        let item = (r * 7 + u64::from(input) * 5) % 24;
        let id = format!("i{item}");
        let n = 1 + (item as i64 % 7) * 3;
        match rand(10) {
            0..=3 => {
                if !m.check_and_update_cache(&req, input, &id).unwrap()
                    && m.can_allocate(n, BIG, 0).unwrap()
                {
                    m.allocate(&req, input, &id, n).unwrap();
                }
            }
            4..=6 => m.free_encoder_input(&req, input, &id).unwrap(),
            7 => m.free(&req).unwrap(),
            8 => drop(m.get_freed_mm_hashes()),
            _ => {
                if rand(50) == 0 {
                    m.reset();
                }
            }
        }
        let freeable_sum: i64 = m.freeable().map(|(_, n)| n).sum();
        let held: i64 = m.num_embeds_by_hash().map(|(_, n)| n).sum();
        assert_eq!(m.num_freeable_slots(), m.num_free_slots() + freeable_sum);
        assert_eq!(m.num_free_slots() + held, m.cache_size());
        assert_eq!(m.num_freeable_entries(), m.freeable().count());
    }
}
