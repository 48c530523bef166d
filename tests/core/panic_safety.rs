//! Panic safety: an internal panic inside a manager call is caught by
//! `KVCacheManager::shielded` (the wrapper the Python bindings put around every mutating
//! call), comes back as `Error::Internal` (Python: `InternalError`, a `RuntimeError`),
//! leaves the process alive and the manager poisoned: every later lookup, allocation,
//! free, reset or eviction fails with `Error::Poisoned`, saying why. Other managers are
//! unaffected.
//!
//! The tests under `fault-injection` (`cargo test --features fault-injection --test core
//! panic_safety::`, run by scripts/test.sh) panic at real points inside the core's
//! operations (src/fault.rs) — half-way through an allocation, inside a free; the others
//! panic inside the wrapped closure and run in every `cargo test`.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use hscache::manager::{AllocateSlots, KVCacheManager};
use hscache::testing::{allocate, full_attention_manager, lookup, prompt_hashes, request};
use hscache::Error;

fn manager() -> KVCacheManager {
    full_attention_manager(16, 4, 256, true, true, false)
}

/// Every mutating entry point refuses a poisoned manager, naming the first failure.
fn assert_poisoned(m: &mut KVCacheManager, why: &str) {
    let poisoned = m.poisoned().unwrap().to_owned();
    assert!(poisoned.contains(why), "{poisoned}");
    let req = request("late", 0, 9, &prompt_hashes(1, 2, 0, 0));
    let mut out = vec![Vec::new()];
    let errs = [
        m.get_computed_blocks(&req, None, &|| Ok(false), &mut out)
            .map(|_| ())
            .unwrap_err(),
        allocate(
            m,
            &req,
            None,
            AllocateSlots {
                num_new_tokens: 9,
                ..Default::default()
            },
        )
        .map(|_| ())
        .unwrap_err(),
        m.free("a").unwrap_err(),
        m.reset_prefix_cache().map(|_| ()).unwrap_err(),
        m.evict_blocks(&[1]).unwrap_err(),
    ];
    for e in errs {
        assert!(matches!(e, Error::Poisoned(_)), "{e:?}");
        assert!(e.to_string().contains("poisoned"), "{e}");
    }
}

#[test]
fn a_panic_inside_a_shielded_call_poisons_the_manager() {
    let mut m = manager();
    let mut other = manager();
    hscache::testing::admit(&mut m, &request("a", 0, 9, &prompt_hashes(1, 2, 0, 0)));
    let r: hscache::Result<()> = m.shielded("allocate_slots", |m| {
        m.free("a")?; // a half-done operation
        panic!("boom");
    });
    let e = r.unwrap_err();
    assert!(matches!(e, Error::Internal(_)), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("internal panic in allocate_slots: boom") && msg.contains("poisoned"),
        "{msg}"
    );
    assert_poisoned(&mut m, "boom");
    // the process and every other manager carry on
    hscache::testing::admit(&mut other, &request("b", 0, 9, &prompt_hashes(1, 2, 0, 0)));
    other.free("b").unwrap();
    other.check_invariants().unwrap();
}

#[test]
fn a_shielded_call_without_a_panic_is_transparent() {
    let mut m = manager();
    let req = request("a", 0, 9, &prompt_hashes(1, 2, 0, 0));
    let (hit, _) = m
        .shielded("get_computed_blocks", |m| Ok(lookup(m, &req)))
        .unwrap();
    assert_eq!(hit, 0);
    let e = m.shielded("free", |m| m.free_blocks(&[999])).unwrap_err();
    assert!(
        !matches!(e, Error::Internal(_) | Error::Poisoned(_)),
        "{e:?}"
    );
    assert!(m.poisoned().is_none(), "a typed error does not poison");
}

#[cfg(feature = "fault-injection")]
mod injected {
    use super::*;
    // The armed point is per thread (src/fault.rs): these tests run in parallel with
    // each other and with the tests above, none of them seeing another's point.

    fn admit_shielded(m: &mut KVCacheManager, id: &str) -> hscache::Result<bool> {
        let req = request(id, 0, 13, &prompt_hashes(7, 3, 0, 0));
        m.shielded("allocate_slots", |m| {
            let (hit, hits) = lookup(m, &req);
            let any = hits.iter().any(|h| !h.is_empty());
            let args = AllocateSlots {
                num_new_tokens: 13 - hit,
                num_new_computed_tokens: hit,
                ..Default::default()
            };
            Ok(allocate(m, &req, any.then_some(&hits[..]), args)?.is_some())
        })
    }

    #[test]
    fn an_internal_panic_half_way_through_an_allocation_poisons() {
        let mut m = manager();
        assert!(admit_shielded(&mut m, "a").unwrap());
        m.free("a").unwrap();
        // "b" hits "a"'s cached blocks: the panic comes after they are adopted
        hscache::fault::arm("allocate_slots.adopted", 0);
        let e = admit_shielded(&mut m, "b").unwrap_err();
        hscache::fault::disarm();
        assert!(matches!(e, Error::Internal(_)), "{e:?}");
        assert!(
            e.to_string()
                .contains("injected panic at allocate_slots.adopted"),
            "{e}"
        );
        assert_poisoned(&mut m, "allocate_slots.adopted");
    }

    #[test]
    fn an_internal_panic_inside_free_poisons() {
        let mut m = manager();
        assert!(admit_shielded(&mut m, "a").unwrap());
        hscache::fault::arm("free", 0);
        let e = m.shielded("free", |m| m.free("a")).unwrap_err();
        hscache::fault::disarm();
        assert!(e.to_string().contains("injected panic at free"), "{e}");
        assert_poisoned(&mut m, "free");
        // a fresh manager works: the fault point disarmed itself
        let mut fresh = manager();
        assert!(admit_shielded(&mut fresh, "c").unwrap());
        fresh.free("c").unwrap();
        fresh.check_invariants().unwrap();
    }

    #[test]
    fn an_armed_point_lets_earlier_passes_through() {
        let mut m = manager();
        hscache::fault::arm("allocate_slots.cached", 1);
        assert!(admit_shielded(&mut m, "a").unwrap());
        let e = admit_shielded(&mut m, "b").unwrap_err();
        hscache::fault::disarm();
        assert!(e.to_string().contains("allocate_slots.cached"), "{e}");
        assert!(m.poisoned().is_some());
    }
}
