//! A proptest state machine over the core manager: random sequences of scheduler-like
//! ops (new requests over shared system prompts, admission with prefix hits, prefill
//! chunks, decode steps, finish, preemption and re-admission, `reset_prefix_cache`,
//! `evict_blocks`, `take_events`) run on a full-attention `KVCacheManager` and checked
//! after every op against the reference model of `tests/fuzz_common` (table lengths, ref
//! counts = owners, free count, hits = the index's blocks for the request's hashes,
//! sharing only along a common hash chain, `check_invariants()`). The case count is
//! `PROPTEST_CASES` (default below); failures persist in
//! `proptest-regressions/test_manager_statemachine.txt`.
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test
#![allow(clippy::print_stdout)] // the operation count is the report

use crate::fuzz_common;

use fuzz_common::{Harness, Op};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use proptest::test_runner::FileFailurePersistence;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/proptest-regressions/test_manager_statemachine.txt"
        )))),
        ..ProptestConfig::with_cases(cases)
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 0u8..5, 1u8..41)
            .prop_map(|(family, shared, len)| Op::New { family, shared, len }),
        3 => (any::<u8>(), 1u8..41).prop_map(|(idx, budget)| Op::Admit { idx, budget }),
        4 => (any::<u8>(), 1u8..41).prop_map(|(idx, budget)| Op::Step { idx, budget }),
        1 => any::<u8>().prop_map(|idx| Op::Finish { idx }),
        1 => any::<u8>().prop_map(|idx| Op::Preempt { idx }),
        1 => Just(Op::Reset),
        1 => proptest::collection::vec(any::<u8>(), 0..4).prop_map(|ids| Op::Evict { ids }),
        1 => Just(Op::TakeEvents),
    ]
}

/// Every op sequence keeps the manager equal to the model and internally consistent.
#[test]
fn manager_matches_model() {
    let mut runner = proptest::test_runner::TestRunner::new(config());
    let ops = std::cell::Cell::new(0usize);
    let hits = std::cell::Cell::new(0usize);
    let strategy = (4u32..40, proptest::collection::vec(op(), 1..300));
    runner
        .run(&strategy, |(num_blocks, seq)| {
            let mut h = Harness::new(num_blocks);
            for op in &seq {
                h.apply(op);
            }
            h.drain();
            ops.set(ops.get() + h.ops);
            hits.set(hits.get() + h.hit_tokens);
            Ok(())
        })
        .unwrap();
    println!(
        "manager state machine: {} ops, {} hit tokens",
        ops.get(),
        hits.get()
    );
    assert!(hits.get() > 0, "the sequences never hit the prefix cache");
}
