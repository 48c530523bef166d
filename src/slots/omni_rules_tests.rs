//! Unit tests of `OmniStepRules` (`omni_rules.rs`): each rule, its bad inputs, its mutants.

use super::*;

fn rules() -> OmniStepRules {
    OmniStepRules::new(4, 2).unwrap()
}

/// Begins, lays out in `batch` order with every scheduled row, saves.
fn step(
    r: &mut OmniStepRules,
    new: &[(&str, usize)],
    scheduled: &[(&str, usize)],
    batch: &[&str],
    reads: Option<(&[usize], &[usize])>,
) -> SavedStep {
    r.begin_step(&[], new, scheduled, &[]).unwrap();
    let n = scheduled.iter().map(|s| s.1).sum();
    let plan = r.lay_out(batch, n).unwrap();
    let nulls = vec![NULL_BLOCK_ID; reads.map_or(0, |(_, m)| m.len())];
    r.save(&plan, reads.map(|(h, m)| (h, m, &nulls[..])))
        .unwrap()
}

#[test]
fn first_hits_are_served_their_prefix_and_continuations_are_not() {
    let mut r = rules();
    let s = step(
        &mut r,
        &[("a", 8), ("b", 0)],
        &[("a", 2), ("b", 3)],
        &["b", "a"],
        Some((&[1], &[])),
    );
    assert_eq!(s.served, vec![Served::Plain, Served::Prefix]);
    // `a` resent among the new requests (a resumption) is a continuation.
    let s2 = step(&mut r, &[("a", 12)], &[("a", 1)], &["a"], Some((&[0], &[])));
    assert_eq!(s2.served, vec![Served::Plain]);
    assert_eq!(
        (s.prefix.clone(), s.plain_sizes.clone()),
        (vec![1], vec![3])
    );
    assert_eq!(s.plain_rows, Some(vec![0, 1, 2]));
    let picks = r.materialize(s.step_id, &["a", "b"]).unwrap();
    assert_eq!(picks.index, vec![0, 0]);
    assert_eq!(picks.prefix, vec![true, false]);
    assert_eq!(s2.plain_rows, None, "every request plain: the whole step");
}

#[test]
fn a_finished_request_is_new_again() {
    let mut r = rules();
    step(&mut r, &[("a", 0)], &[("a", 4)], &["a"], Some((&[], &[])));
    r.begin_step(&["a"], &[("a", 4)], &[("a", 1)], &[]).unwrap();
    let plan = r.lay_out(&["a"], 1).unwrap();
    assert_eq!(plan.first_hit, vec![true]);
}

#[test]
fn misses_are_unservable_with_their_reason() {
    let mut r = rules();
    let s = step(
        &mut r,
        &[("a", 4), ("b", 4), ("c", 0)],
        &[("a", 1), ("b", 1), ("c", 1)],
        &["a", "b", "c"],
        Some((&[], &[0])),
    );
    let why = |i: usize| s.served[i];
    assert_eq!(why(0), Served::Unservable(UnservableReason::NotWritten));
    assert_eq!(why(1), Served::Unservable(UnservableReason::NotPlanned));
    assert_eq!(why(2), Served::Plain);
    let err = r.materialize(s.step_id, &["c", "b"]).unwrap_err();
    assert!(matches!(
        err,
        OmniRuleError::Unservable {
            reason: UnservableReason::NotPlanned,
            ..
        }
    ));
    assert_eq!(
        r.unconsumed_steps(),
        &[s.step_id],
        "a refusal consumes nothing"
    );
    assert!(r.materialize(s.step_id, &["c"]).is_ok());
}

#[test]
fn an_unsaved_step_serves_no_prefix() {
    let mut r = rules();
    let s = step(&mut r, &[("a", 4)], &[("a", 1)], &["a"], None);
    assert_eq!(s.served, vec![Served::Plain]);
}

#[test]
fn bad_input_changes_nothing() {
    let mut r = rules();
    // Misaligned hit.
    let e = r
        .begin_step(&[], &[("a", 3)], &[("a", 1)], &[])
        .unwrap_err();
    assert!(matches!(e, OmniRuleError::MisalignedHit { hit: 3, .. }));
    assert!(!r.has_pending_step() && r.num_live() == 0);
    // Save without a begun step, then a batch that is not the step's.
    assert!(r.lay_out(&["a"], 1).is_err());
    r.begin_step(&[], &[("a", 0), ("b", 0)], &[("a", 2), ("b", 2)], &[])
        .unwrap();
    assert!(r.lay_out(&["a"], 4).is_err(), "b missing from the batch");
    assert!(r.lay_out(&["a", "b"], 5).is_err(), "token count");
    assert!(r.lay_out(&["a", "b", "a"], 4).is_err(), "a twice");
    // A plan of other rules, and a plan taken twice.
    let mut o = OmniStepRules::new(4, 2).unwrap();
    o.begin_step(&[], &[("a", 0), ("b", 0)], &[("a", 2), ("b", 2)], &[])
        .unwrap();
    let foreign = o.lay_out(&["a", "b"], 4).unwrap();
    assert!(r.save(&foreign, None).is_err());
    let plan = r.lay_out(&["b", "a"], 4).unwrap();
    assert!(
        r.save(&plan, Some((&[7], &[], &[]))).is_err(),
        "read past the step"
    );
    assert!(r.has_pending_step());
    let s = r.save(&plan, None).unwrap();
    assert!(r.save(&plan, None).is_err(), "saved already");
    // Step ids: unknown request, another's id, consumed twice, no room.
    assert!(matches!(
        r.materialize(s.step_id, &["a", "zz"]),
        Err(OmniRuleError::UnknownRequests { .. })
    ));
    assert!(matches!(
        r.discard(s.step_id + 1000),
        Err(OmniRuleError::StepId { .. })
    ));
    assert_eq!(r.unconsumed_steps(), &[s.step_id]);
    r.discard(s.step_id).unwrap();
    assert!(matches!(
        r.discard(s.step_id),
        Err(OmniRuleError::StepId { .. })
    ));
    step(&mut r, &[], &[("a", 1)], &["a"], None);
    step(&mut r, &[], &[("a", 1)], &["a"], None);
    r.begin_step(&[], &[], &[("a", 1)], &[]).unwrap();
    let plan = r.lay_out(&["a"], 1).unwrap();
    assert!(matches!(
        r.save(&plan, None),
        Err(OmniRuleError::NoRoom { .. })
    ));
    assert!(r.has_pending_step());
    assert!(OmniStepRules::new(0, 2).is_err() && OmniStepRules::new(4, 0).is_err());
}

#[test]
fn a_step_never_saved_is_reported_by_the_next() {
    let mut r = rules();
    assert!(!r.begin_step(&[], &[("a", 0)], &[("a", 4)], &[]).unwrap().0);
    assert!(r.begin_step(&[], &[], &[("a", 1)], &[]).unwrap().0);
    let plan = r.lay_out(&["a"], 1).unwrap();
    r.save(&plan, None).unwrap();
    assert!(!r.begin_step(&[], &[], &[("a", 1)], &[]).unwrap().0);
}

#[test]
fn every_mutant_changes_a_decision() {
    for name in OmniStepRules::RULE_MUTANTS {
        if name == "recompute_as_plain" {
            continue; // needs recomputation on: its own test below
        }
        let mut r = rules();
        r.break_rule_for_tests(name).unwrap();
        let run = |r: &mut OmniStepRules| -> (Vec<Served>, Vec<u32>, Vec<Served>) {
            let s = step(
                r,
                &[("a", 4), ("b", 4)],
                &[("b", 1), ("a", 1)],
                &["a", "b"],
                Some((&[0], &[1])),
            );
            let s2 = step(r, &[("a", 8)], &[("a", 1)], &["a"], Some((&[0], &[])));
            r.begin_step(&[], &[], &[("b", 1), ("a", 1)], &[]).unwrap();
            let plan = r.lay_out(&["a", "b"], 2).unwrap();
            (s.served, plan.batch_positions, s2.served)
        };
        let broken = run(&mut r);
        let good = run(&mut rules());
        assert_ne!(broken, good, "mutant {name} changed nothing");
    }
    assert!(rules().break_rule_for_tests("nope").is_err());
}

#[test]
fn overflowing_counts_are_refused_and_zero_entries_schedule_nothing() {
    let mut r = rules();
    let big = usize::MAX / 2 + 1;
    let e = r
        .begin_step(&[], &[], &[("a", big), ("b", big)], &[])
        .unwrap_err();
    assert!(matches!(e, OmniRuleError::Invalid(_)));
    assert!(!r.has_pending_step() && r.num_live() == 0);
    // A request scheduled for 0 tokens has no rows: the batch without it is the step's.
    r.begin_step(&[], &[], &[("a", 2), ("b", 0)], &[]).unwrap();
    let plan = r.lay_out(&["a"], 2).unwrap();
    assert_eq!(plan.req_ids, vec!["a".to_owned()]);
    assert!(
        r.lay_out(&["a", "b"], 2).is_ok(),
        "b's 0 tokens are skipped"
    );
}

#[test]
fn a_refused_hit_is_recomputed_when_on_and_unservable_when_off() {
    // Off (the default): refused, materialize names the reason, consumes nothing.
    let mut r = rules();
    r.begin_step(&[], &[("a", 8)], &[("a", 2)], &[]).unwrap();
    let plan = r.lay_out(&["a"], 2).unwrap();
    let s = r.save(&plan, Some((&[], &[0], &[5]))).unwrap();
    assert_eq!(
        s.served,
        vec![Served::Unservable(UnservableReason::NotWritten)]
    );
    assert!(r.take_invalid_blocks(s.step_id).is_empty());
    // On: this step's rows, block 5 reported once, the next step a first hit again.
    let mut r = rules();
    r.set_recompute_refused(true);
    r.begin_step(&[], &[("a", 8), ("b", 0)], &[("a", 2), ("b", 3)], &[])
        .unwrap();
    let plan = r.lay_out(&["b", "a"], 5).unwrap();
    let s = r.save(&plan, Some((&[], &[1], &[5]))).unwrap();
    assert_eq!(s.served, vec![Served::Plain, Served::Recompute]);
    assert_eq!(
        (s.plain_sizes.clone(), s.plain_rows.clone()),
        (vec![3, 2], None)
    );
    let picks = r.materialize(s.step_id, &["a", "b"]).unwrap();
    assert_eq!(
        (picks.index, picks.prefix),
        (vec![1, 0], vec![false, false])
    );
    assert_eq!(r.take_invalid_blocks(s.step_id), vec![5]);
    assert!(r.take_invalid_blocks(s.step_id).is_empty(), "taken once");
    assert!(r.has_recomputing());
    // vLLM rolled `a` back to 4 tokens: its step from there is its first hit again.
    let (unsaved, rereads) = r
        .begin_step(&[], &[], &[("a", 6), ("b", 1)], &[("a", 4), ("b", 3)])
        .unwrap();
    assert!(!unsaved);
    assert_eq!(rereads, vec!["a".to_owned()]);
    let plan = r.lay_out(&["a", "b"], 7).unwrap();
    assert_eq!(plan.first_hit, vec![true, false]);
    assert!(!r.has_recomputing());
    // Rolled back to a misaligned count: refused before anything changes.
    let mut r = rules();
    r.set_recompute_refused(true);
    step(&mut r, &[("a", 8)], &[("a", 2)], &["a"], None);
    r.begin_step(&[], &[], &[("a", 1)], &[]).unwrap();
    let plan = r.lay_out(&["a"], 1).unwrap();
    r.save(&plan, None).unwrap();
    assert!(!r.has_recomputing(), "no reads: nothing refused");
}

#[test]
fn a_refused_hit_with_no_block_to_report_stays_unservable() {
    let mut r = rules();
    r.set_recompute_refused(true);
    r.begin_step(&[], &[("a", 8), ("b", 4)], &[("a", 1), ("b", 1)], &[])
        .unwrap();
    let plan = r.lay_out(&["a", "b"], 2).unwrap();
    // `a`'s read failed on the null block, `b` had no read planned.
    let s = r.save(&plan, Some((&[], &[0], &[NULL_BLOCK_ID]))).unwrap();
    assert_eq!(
        s.served,
        vec![
            Served::Unservable(UnservableReason::NotWritten),
            Served::Unservable(UnservableReason::NotPlanned)
        ]
    );
    assert!(!r.has_recomputing());
    assert!(matches!(
        r.materialize(s.step_id, &["a"]),
        Err(OmniRuleError::Unservable { .. })
    ));
}

#[test]
fn a_recomputing_request_that_finishes_or_rolls_back_misaligned() {
    let mut r = rules();
    r.set_recompute_refused(true);
    r.begin_step(&[], &[("a", 8), ("c", 8)], &[("a", 1), ("c", 1)], &[])
        .unwrap();
    let plan = r.lay_out(&["a", "c"], 2).unwrap();
    r.save(&plan, Some((&[], &[0, 1], &[3, 3]))).unwrap();
    assert_eq!(r.recomputing().count(), 2);
    let e = r
        .begin_step(&["a"], &[], &[("c", 1)], &[("c", 6)])
        .unwrap_err();
    assert!(matches!(e, OmniRuleError::MisalignedHit { .. }));
    assert_eq!(r.recomputing().count(), 2, "nothing changed");
    let (_, rereads) = r.begin_step(&["a"], &[], &[("c", 1)], &[("c", 0)]).unwrap();
    assert!(
        rereads.is_empty(),
        "rolled back to 0: every row is computed"
    );
    assert!(!r.has_recomputing());
}

#[test]
fn the_recompute_mutant_serves_the_recomputed_step_plain() {
    let mut r = rules();
    r.set_recompute_refused(true);
    r.break_rule_for_tests("recompute_as_plain").unwrap();
    r.begin_step(&[], &[("a", 8)], &[("a", 1)], &[]).unwrap();
    let plan = r.lay_out(&["a"], 1).unwrap();
    r.save(&plan, Some((&[], &[0], &[2]))).unwrap();
    let (_, rereads) = r.begin_step(&[], &[], &[("a", 4)], &[("a", 4)]).unwrap();
    assert_eq!(rereads, vec!["a".to_owned()]);
    assert_eq!(r.lay_out(&["a"], 4).unwrap().first_hit, vec![false]);
}
