//! `check_invariants()` completeness: each invariant mutant (`src/manager/mutants.rs`)
//! is caught, the after-every-operation check poisons the manager with
//! `ErrorKind::Invariant`, external references (the `BlockPool` view, deferred
//! frees) keep ref count == owners exact, and `state_digest()` tracks state.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use hscache::manager::mutants::Mutant;
use hscache::manager::KVCacheManager;
use hscache::testing::{admit, full_attention_manager, prompt_hashes, request};
use hscache::ErrorKind;

/// Two running requests sharing a cached prefix, one freed (cached free blocks).
fn busy_manager() -> KVCacheManager {
    let mut m = full_attention_manager(32, 16, 8192, true, false, false);
    m.set_check_invariants(false);
    admit(&mut m, &request("a", 0, 70, &prompt_hashes(1, 4, 10, 0)));
    admit(&mut m, &request("b", 0, 70, &prompt_hashes(1, 4, 11, 0)));
    admit(&mut m, &request("c", 0, 40, &prompt_hashes(2, 2, 12, 0)));
    m.free("c").unwrap();
    m.check_invariants().unwrap();
    m
}

#[test]
fn every_mutant_is_caught() {
    let mut caught = 0;
    for mutant in Mutant::ALL {
        let mut m = busy_manager();
        m.break_invariant_for_tests(mutant).unwrap();
        let err = m.check_invariants().expect_err(mutant.name());
        assert!(!err.is_empty(), "{}", mutant.name());
        caught += 1;
    }
    assert_eq!(caught, Mutant::ALL.len());
}

#[test]
fn mutant_names_round_trip() {
    for mutant in Mutant::ALL {
        assert_eq!(Mutant::from_name(mutant.name()), Some(mutant));
    }
    assert_eq!(Mutant::from_name("nope"), None);
}

#[test]
fn the_check_after_each_operation_poisons_with_an_invariant_error() {
    let mut m = busy_manager();
    m.set_check_invariants(true);
    m.break_invariant_for_tests(Mutant::MissingDecrement)
        .unwrap();
    let e = m.free("a").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invariant);
    assert!(m.poisoned().is_some());
    assert_eq!(m.free("b").unwrap_err().kind(), ErrorKind::Internal);
}

#[test]
fn external_references_keep_ref_counts_exact() {
    let mut m = busy_manager();
    m.set_check_invariants(true);
    let mut ids = Vec::new();
    m.get_new_blocks(3, &mut ids).unwrap();
    m.touch(&ids[..1]).unwrap();
    m.check_invariants().unwrap();
    let mut popped = Vec::new();
    m.pop_blocks_for_free("a", &mut popped).unwrap();
    m.check_invariants().unwrap();
    popped.reverse();
    m.free_blocks(&popped).unwrap();
    m.free_blocks(&ids).unwrap();
    m.free_blocks(&ids[..1]).unwrap();
    m.check_invariants().unwrap();
    assert!(m.external_refs().iter().all(|&e| e == 0));
    // Freeing a table's block behind the manager's back is refused before it is
    // dropped (checked mode), and the manager keeps serving.
    let held = m.get_blocks("b", 0)[0];
    let digest = m.state_digest();
    let e = m.free_blocks(&[held]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(m.state_digest(), digest);
    assert!(m.poisoned().is_none());
    m.check_invariants().unwrap();
}

#[test]
fn state_digest_moves_with_state_and_only_with_it() {
    let mut m = busy_manager();
    let d0 = m.state_digest();
    assert_eq!(d0, busy_manager().state_digest());
    assert!(m.evict_blocks(&[-1]).is_err());
    assert!(m.free_blocks(&[999]).is_err());
    assert_eq!(m.state_digest(), d0);
    m.free("b").unwrap();
    let d1 = m.state_digest();
    assert_ne!(d1, d0);
    admit(&mut m, &request("d", 0, 20, &prompt_hashes(3, 1, 13, 0)));
    assert_ne!(m.state_digest(), d1);
}

#[test]
fn a_poisoned_manager_refuses_every_shielded_call() {
    // The per-step drains have no guard of their own (`new_step_starts`,
    // `take_new_block_ids`, ...): `shielded`, which every binding goes through, refuses.
    let mut m = busy_manager();
    m.set_check_invariants(true);
    m.break_invariant_for_tests(Mutant::MissingDecrement)
        .unwrap();
    m.free("a").unwrap_err();
    let before = m.state_digest();
    let e = m
        .shielded("new_step_starts", |c| {
            c.new_step_starts();
            Ok(())
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Internal);
    let e = m
        .shielded("take_new_block_ids", |c| Ok(c.take_new_block_ids()))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Internal);
    assert_eq!(m.state_digest(), before);
}

#[test]
fn the_null_block_never_gets_a_hash() {
    let mut m = busy_manager();
    let before = m.state_digest();
    let pool = m.block_pool_mut().unwrap();
    let e = pool.move_block_hashes(1, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let key = *pool.block_hash(1).unwrap();
    let e = pool.insert_block_hash_checked(key, 0, 16).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        pool.insert_block_hash_checked(key, 99, 16)
            .unwrap_err()
            .kind(),
        ErrorKind::BlockIdOutOfRange
    );
    assert_eq!(m.state_digest(), before);
    m.check_invariants().unwrap();
}
