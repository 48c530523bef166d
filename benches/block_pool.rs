//! Criterion benches of the core operations, per block.
//!
//! Why: the drop-in's cost is one FFI crossing plus these loops; they guard the
//! core targets of the performance issue (allocate/free/touch <= 30 ns per block,
//! hit lookup <= 50 ns per block). `Throughput::Elements` is blocks, so criterion
//! prints ns per block directly.
//!
//! Run: `cargo bench --bench block_pool` (add `-- --quick` for a short run).
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use hscache::free_queue::FreeKVCacheBlockQueue;
use hscache::manager::{AllocateSlots, GroupSpec, KVCacheManager, MambaCacheMode, PlainRequest};
use hscache::pool::BlockPool;
use hscache::testing::{
    self, full_attention_manager, hybrid_manager, prompt_hashes, request, running_requests,
};
use hscache::types::BlockId;

const POOL_SIZES: [u32; 2] = [1024, 65536];

fn manager(num_blocks: u32) -> KVCacheManager {
    full_attention_manager(num_blocks, 16, 1 << 20, true, false, false)
}

fn free_queue(c: &mut Criterion) {
    let mut g = c.benchmark_group("free_queue/popleft_n+append_n");
    for n in POOL_SIZES {
        let batch = 512usize.min(n as usize);
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let mut q = FreeKVCacheBlockQueue::try_new(n).unwrap();
            let mut out = Vec::with_capacity(batch);
            b.iter(|| {
                out.clear();
                q.popleft_n(batch, &mut out).expect("enough blocks");
                q.append_n(black_box(&out)).expect("distinct");
            });
        });
    }
    g.finish();
}

fn allocate_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool/get_new_blocks+free_blocks");
    for n in POOL_SIZES {
        let batch = 512usize.min(n as usize - 1);
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let mut pool = BlockPool::new(n, true, 16, false, false).expect("valid");
            let mut out = Vec::with_capacity(batch);
            b.iter(|| {
                out.clear();
                pool.get_new_blocks(batch, &mut out).expect("enough blocks");
                out.reverse();
                pool.free_blocks(&out).expect("allocated");
            });
        });
    }
    g.finish();
}

fn touch_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool/touch+free_blocks");
    let batch = 512usize;
    g.throughput(Throughput::Elements(batch as u64));
    g.bench_function("65536", |b| {
        let mut pool = BlockPool::new(65536, true, 16, false, false).expect("valid");
        let mut ids = vec![];
        pool.get_new_blocks(batch, &mut ids).expect("enough blocks");
        let hashes = prompt_hashes(1, batch as u64, 2, 0);
        pool.cache_full_blocks(&hashes, &ids, 0, batch, 16, 0, None)
            .expect("cacheable");
        let rev: Vec<BlockId> = ids.iter().rev().copied().collect();
        pool.free_blocks(&rev).expect("allocated");
        b.iter(|| {
            pool.touch(black_box(&ids)).expect("free cached blocks");
            pool.free_blocks(&rev).expect("touched");
        });
    });
    g.finish();
}

/// Admits a new request with no hits, caching its full blocks.
fn prefill(m: &mut KVCacheManager, req: &PlainRequest, out: &mut Vec<BlockId>) {
    let args = AllocateSlots {
        num_new_tokens: req.num_tokens,
        ..Default::default()
    };
    let mut ends = smallvec::SmallVec::new();
    m.allocate_slots(req, &args, out, &mut ends).expect("fits");
}

fn hit_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("manager/find_longest_cache_hit");
    for blocks in [64usize, 512] {
        g.throughput(Throughput::Elements(blocks as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(blocks),
            &blocks,
            |b, &blocks| {
                let mut m = manager(65536);
                let hashes = prompt_hashes(3, blocks as u64, 4, 0);
                let tokens = blocks * 16 + 1;
                prefill(&mut m, &request("warm", 0, tokens, &hashes), &mut vec![]);
                let mut hits = vec![Vec::with_capacity(blocks)];
                b.iter(|| {
                    hits[0].clear();
                    black_box(
                        m.coordinator()
                            .find_longest_cache_hit(&hashes, tokens - 1, &mut hits)
                            .expect("ok"),
                    )
                });
            },
        );
    }
    g.finish();
}

fn allocate_slots_prefill(c: &mut Criterion) {
    let mut g = c.benchmark_group("manager/allocate_slots+cache+free (miss)");
    for blocks in [64usize, 512] {
        g.throughput(Throughput::Elements(blocks as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(blocks),
            &blocks,
            |b, &blocks| {
                let mut m = manager(65536);
                let tokens = blocks * 16;
                let mut seed = 10u64;
                let mut out = vec![];
                b.iter_batched(
                    || {
                        seed += 1;
                        request("r", 0, tokens, &prompt_hashes(seed, blocks as u64, 0, 0))
                    },
                    |req| {
                        out.clear();
                        prefill(&mut m, &req, &mut out);
                        m.free("r").expect("allocated");
                    },
                    BatchSize::SmallInput,
                );
            },
        );
    }
    g.finish();
}

/// One decode step of 1024 running requests (`allocate_slots(request, 1)`, no block
/// filled): the fixed cost of a call for a running request, per layout. The drop-in
/// adds one FFI crossing and two attribute reads to it.
fn decode_step(c: &mut Criterion) {
    const RUNNING: usize = 1024;
    const PROMPT: usize = 1000;
    let mut g = c.benchmark_group("manager/allocate_slots decode step (per request)");
    g.throughput(Throughput::Elements(RUNNING as u64));
    let layouts: [(&str, Vec<GroupSpec>); 3] = [
        ("full", vec![GroupSpec::full_attention(16)]),
        (
            "full+swa",
            vec![
                GroupSpec::full_attention(16),
                GroupSpec::sliding_window(16, 128),
            ],
        ),
        (
            "full+mamba",
            vec![
                GroupSpec::full_attention(16),
                GroupSpec::mamba(64, MambaCacheMode::Align),
            ],
        ),
    ];
    for (name, groups) in layouts {
        g.bench_function(name, |b| {
            let mut m = hybrid_manager(200_000, groups.clone(), 1 << 16, false);
            let reqs = running_requests(&mut m, RUNNING, PROMPT);
            let (mut out, mut ends) = (Vec::new(), smallvec::SmallVec::new());
            b.iter(|| black_box(testing::decode_step(&mut m, &reqs, &mut out, &mut ends)));
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    free_queue,
    allocate_free,
    touch_free,
    hit_lookup,
    allocate_slots_prefill,
    decode_step
);
criterion_main!(benches);
