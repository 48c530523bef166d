//! Criterion benches of the core operations, per block.
//!
//! Why: the drop-in's cost is one FFI crossing plus these loops; they guard the
//! core targets of the performance issue (allocate/free/touch <= 30 ns per block,
//! hit lookup <= 50 ns per block). `Throughput::Elements` is blocks, so criterion
//! prints ns per block directly.
//!
//! Run: `cargo bench --bench block_pool` (add `-- --quick` for a short run).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use hscache::free_queue::FreeKVCacheBlockQueue;
use hscache::manager::{AllocateSlots, KVCacheManager, KVCacheManagerConfig, RequestView};
use hscache::pool::BlockPool;
use hscache::testing::prompt_hashes;
use hscache::types::{BlockHash, BlockId};

const POOL_SIZES: [u32; 2] = [1024, 65536];

fn manager(num_blocks: u32) -> KVCacheManager {
    KVCacheManager::new(KVCacheManagerConfig {
        num_blocks,
        block_size: 16,
        max_model_len: 1 << 20,
        enable_caching: true,
        enable_kv_cache_events: false,
        use_eagle: false,
        watermark_blocks: 0,
        num_reprefillable_tokens: 0,
        needs_kv_cache_zeroing: false,
    })
    .expect("valid config")
}

fn free_queue(c: &mut Criterion) {
    let mut g = c.benchmark_group("free_queue/popleft_n+append_n");
    for n in POOL_SIZES {
        let batch = 512usize.min(n as usize);
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let mut q = FreeKVCacheBlockQueue::new(n);
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
            let mut pool = BlockPool::new(n, true, 16, false).expect("valid");
            let mut out = Vec::with_capacity(batch);
            b.iter(|| {
                out.clear();
                pool.get_new_blocks(batch, &mut out).expect("enough blocks");
                pool.free_blocks(out.iter().rev().copied())
                    .expect("allocated");
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
        let mut pool = BlockPool::new(65536, true, 16, false).expect("valid");
        let mut ids = vec![];
        pool.get_new_blocks(batch, &mut ids).expect("enough blocks");
        let hashes = prompt_hashes(1, batch as u64, 2, 0);
        pool.cache_full_blocks(&hashes, &ids, 0, batch, 16, 0)
            .expect("cacheable");
        pool.free_blocks(ids.iter().rev().copied())
            .expect("allocated");
        b.iter(|| {
            pool.touch(black_box(&ids)).expect("free cached blocks");
            pool.free_blocks(ids.iter().rev().copied())
                .expect("touched");
        });
    });
    g.finish();
}

/// Admits a new request of `tokens` tokens with no hits, caching its full blocks.
fn prefill(
    m: &mut KVCacheManager,
    id: &str,
    hashes: &[BlockHash],
    tokens: usize,
    out: &mut Vec<BlockId>,
) {
    let view = RequestView {
        request_id: id,
        num_computed_tokens: 0,
        num_tokens: &|| Ok(tokens),
        block_hashes: &|| Ok(hashes),
    };
    let args = AllocateSlots {
        num_new_tokens: tokens,
        ..Default::default()
    };
    m.allocate_slots(&view, &args, out).expect("fits");
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
                prefill(&mut m, "warm", &hashes, tokens, &mut vec![]);
                let mut hits = Vec::with_capacity(blocks);
                b.iter(|| {
                    hits.clear();
                    black_box(
                        m.find_longest_cache_hit(&hashes, tokens - 1, &mut hits)
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
                        prompt_hashes(seed, blocks as u64, 0, 0)
                    },
                    |hashes| {
                        out.clear();
                        prefill(&mut m, "r", &hashes, tokens, &mut out);
                        m.free("r").expect("allocated");
                    },
                    BatchSize::SmallInput,
                );
            },
        );
    }
    g.finish();
}

criterion_group!(
    benches,
    free_queue,
    allocate_free,
    touch_free,
    hit_lookup,
    allocate_slots_prefill
);
criterion_main!(benches);
