//! Criterion benches of the slot mirror (the hidden-state cache's bookkeeping) and of the
//! host-side KV-sharing prefill skip, per scheduled request.
//!
//! Why: a decode step of the hidden-state cache must stay within 1.2x of the bare torch
//! `index_copy_` on the same rows (`python -m hscache bench --hidden-states`); these are
//! the core's share of that step, without the Python attribute reads. `Throughput::Elements`
//! is requests, so criterion prints ns per scheduled request.
//!
//! Run: `cargo bench --bench slots` (add `-- --quick` for a short run).
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hscache::prefill_skip::{plan_prefill_skip, PrefillSkip, PrefillSkipInput};
use hscache::slots::{ScheduledRequest, SlotMirror, StepInput};
use hscache::types::BlockId;

const BATCHES: [usize; 2] = [128, 1024];
const BLOCK_SIZE: usize = 16;

/// A mirror with `n` running requests of 2 blocks each, positioned at token 20.
fn running(n: usize) -> (SlotMirror, Vec<String>) {
    let mut m = SlotMirror::new((4 + n * 64) as u32, BLOCK_SIZE).expect("valid size");
    let ids: Vec<String> = (0..n).map(|i| format!("req-{i}")).collect();
    let tables: Vec<[BlockId; 2]> = (0..n)
        .map(|i| [1 + 2 * i as BlockId, 2 + 2 * i as BlockId])
        .collect();
    let scheduled = ids
        .iter()
        .zip(&tables)
        .map(|(id, t)| ScheduledRequest::start(id, t, 0, 20))
        .collect();
    let step = m
        .plan_step(&StepInput {
            scheduled,
            ..Default::default()
        })
        .expect("valid plan");
    m.commit(step).expect("pending step");
    (m, ids)
}

fn decode_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("slots/decode plan+slots+commit");
    for n in BATCHES {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let (mut m, ids) = running(n);
            let mut slots: Vec<i64> = Vec::with_capacity(n);
            b.iter(|| {
                let scheduled = ids
                    .iter()
                    .map(|id| ScheduledRequest::cont(id, &[], 1))
                    .collect();
                let step = m
                    .plan_step(&StepInput {
                        scheduled,
                        ..Default::default()
                    })
                    .expect("valid plan");
                slots.clear();
                slots.extend(m.write_slots());
                black_box(&slots);
                black_box(m.commit(step).expect("pending step"));
                // Stay inside the tables: rewind every request to position 20.
                let scheduled = ids
                    .iter()
                    .map(|id| ScheduledRequest {
                        req_id: id,
                        assignment: hscache::slots::Assignment::Continue {
                            new_block_ids: &[],
                            num_computed_tokens: Some(20),
                            reread: false,
                        },
                        num_scheduled_tokens: 0,
                    })
                    .collect();
                let step = m
                    .plan_step(&StepInput {
                        scheduled,
                        ..Default::default()
                    })
                    .expect("valid plan");
                black_box(m.commit(step).expect("pending step"));
            });
        });
    }
    g.finish();
}

fn prefill_skip(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefill_skip/mixed batch");
    for n in BATCHES {
        let sched: Vec<u32> = (0..n as u32)
            .map(|i| if i % 8 == 0 { 512 } else { 1 + i % 3 })
            .collect();
        let spec: Vec<u32> = sched
            .iter()
            .map(|&s| s - 1)
            .map(|s| if s > 2 { 0 } else { s })
            .collect();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let mut out = PrefillSkip::default();
            b.iter(|| {
                plan_prefill_skip(
                    &PrefillSkipInput {
                        num_scheduled_tokens: &sched,
                        num_spec_tokens: &spec,
                        samples: &[],
                        num_reqs_padded: n,
                        num_logits_padded: 0,
                        query_start_loc: None,
                    },
                    &mut out,
                )
                .expect("valid batch");
                black_box(&out);
            });
        });
    }
    g.finish();
}

criterion_group!(benches, decode_step, prefill_skip);
criterion_main!(benches);
