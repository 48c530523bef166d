//! Criterion benches of explain mode's cost (`src/explain.rs`): a prefix-cache lookup
//! (`get_computed_blocks`, a 64-block hit and a 64-block miss) and one decode step of
//! 1024 running requests (`allocate_slots(request, 1)`), with explain mode off and on.
//!
//! Why: explain mode must cost nothing when off (one `Option` test per call) and
//! little when on. Run: `cargo bench --bench explain -- --quick`. The `off` rows are
//! what `main` runs (compare with `benches/block_pool.rs`'s decode step too).
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hscache::manager::{AllocateSlots, KVCacheManager, PlainRequest};
use hscache::testing::{
    decode_step, full_attention_manager, prompt_hashes, request, running_requests,
};
use hscache::types::BlockId;

const MODES: [(&str, bool); 2] = [("off", false), ("on", true)];

fn manager(explain: bool) -> KVCacheManager {
    let mut m = full_attention_manager(65536, 16, 1 << 20, true, false, false);
    if explain {
        m.set_explain(true, None).unwrap();
    }
    m
}

fn prefill(m: &mut KVCacheManager, req: &PlainRequest) {
    let args = AllocateSlots {
        num_new_tokens: req.num_tokens,
        ..Default::default()
    };
    let (mut out, mut ends): (Vec<BlockId>, _) = (Vec::new(), smallvec::SmallVec::new());
    m.allocate_slots(req, &args, &mut out, &mut ends).unwrap();
}

fn lookup(c: &mut Criterion) {
    const BLOCKS: u64 = 64;
    let mut g = c.benchmark_group("explain/get_computed_blocks (64 blocks)");
    g.throughput(Throughput::Elements(1));
    for (mode, on) in MODES {
        for (case, seed) in [("hit", 3u64), ("miss", 4u64)] {
            g.bench_function(format!("{case}/{mode}"), |b| {
                let mut m = manager(on);
                let tokens = BLOCKS as usize * 16 + 1;
                prefill(
                    &mut m,
                    &request("warm", 0, tokens, &prompt_hashes(3, BLOCKS, 0, 0)),
                );
                let req = request("q", 0, tokens, &prompt_hashes(seed, BLOCKS, 0, 0));
                let mut out = vec![Vec::with_capacity(BLOCKS as usize)];
                b.iter(|| {
                    out[0].clear();
                    black_box(
                        m.get_computed_blocks(&req, None, &|| Ok(false), &mut out)
                            .unwrap(),
                    )
                });
            });
        }
    }
    g.finish();
}

fn decode(c: &mut Criterion) {
    const RUNNING: usize = 1024;
    const PROMPT: usize = 1000;
    let mut g = c.benchmark_group("explain/allocate_slots decode step (per request)");
    g.throughput(Throughput::Elements(RUNNING as u64));
    for (mode, on) in MODES {
        g.bench_function(mode, |b| {
            let mut m = manager(on);
            let reqs = running_requests(&mut m, RUNNING, PROMPT);
            let (mut out, mut ends) = (Vec::new(), smallvec::SmallVec::new());
            b.iter(|| black_box(decode_step(&mut m, &reqs, &mut out, &mut ends)));
        });
    }
    g.finish();
}

criterion_group!(benches, lookup, decode);
criterion_main!(benches);
