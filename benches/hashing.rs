//! Criterion benches of block hashing in the core, per token.
//!
//! Why: vLLM hashes every full block of every prompt on the engine-core thread; these
//! guard the core cost of hscache's hasher (`src/hash.rs`, `src/hash/request.rs`) for
//! each algorithm, without the Python binding (token-list conversion) around it. Targets:
//! BLAKE3 near 1 G tokens/s on one core for large hash blocks (4096 tokens); every vLLM algorithm far
//! below vLLM's Python cost (~3e6 tokens/s for sha256, see `python -m hscache_tools.bench.hashing`).
//! `Throughput::Elements` is tokens, so criterion prints tokens/s directly.
//!
//! Run: `cargo bench --bench hashing` (add `-- --quick` for a short run).
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hscache::extra_keys::{MmFeature, RequestExtraKeys};
use hscache::hash::request::{RequestBlockHasher, RequestHashInput};
use hscache::hash::value::{Atom, ObjId};
use hscache::hash::{none_hash, HashAlgo};
use hscache::types::BlockHash;

/// Tokens per hashed prompt.
const PROMPT: usize = 65536;

/// Deterministic token ids below a 152k vocabulary (xorshift).
fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 152_064) as u32
        })
        .collect()
}

fn hash_prompt(
    h: &mut RequestBlockHasher,
    toks: &[u32],
    root: &[u8],
    keys: RequestExtraKeys<'_>,
    out: &mut Vec<BlockHash>,
) {
    out.clear();
    let input = RequestHashInput {
        num_hashed_blocks: 0,
        parent: None,
        none_hash: root,
        tokens: toks,
        keys,
        prompt_embeds_digests: None,
    };
    h.hash_new_blocks(&input, out).expect("valid input");
}

/// A prompt without extra keys, per algorithm and hash block size.
fn plain(c: &mut Criterion) {
    let toks = tokens(PROMPT, 7);
    for algo in HashAlgo::ALL {
        let mut g = c.benchmark_group(format!("hash_prompt/{}", algo.name()));
        g.throughput(Throughput::Elements(PROMPT as u64));
        let root = none_hash(algo, "vllm-none-hash");
        for bs in [16usize, 256, 4096] {
            let mut h = RequestBlockHasher::new(algo, bs, 0).expect("valid");
            let mut out = Vec::with_capacity(PROMPT / bs);
            g.bench_with_input(BenchmarkId::from_parameter(bs), &bs, |b, _| {
                b.iter(|| {
                    hash_prompt(
                        &mut h,
                        black_box(&toks),
                        root.as_bytes(),
                        RequestExtraKeys::default(),
                        &mut out,
                    );
                });
            });
        }
        g.finish();
    }
}

/// A LoRA, salted, multimodal prompt (an image every 1000 tokens) at block size 16.
fn with_extra_keys(c: &mut Criterion) {
    let toks = tokens(PROMPT, 11);
    let ids: Vec<String> = (0..PROMPT / 1000)
        .map(|i| format!("image-hash-{i:040}"))
        .collect();
    let features: Vec<MmFeature<'_>> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| MmFeature::new(i * 1000 + 17, 576, Atom::Str(id, ObjId::UNIQUE)))
        .collect::<Result<_, _>>()
        .expect("valid positions");
    let keys = RequestExtraKeys {
        lora: Some((
            Atom::Str("my-adapter", ObjId::UNIQUE),
            Atom::Str("/adapters/my-adapter", ObjId::UNIQUE),
        )),
        mm_features: &features,
        cache_salt: Some(Atom::Str("tenant-salt", ObjId::UNIQUE)),
    };
    let mut g = c.benchmark_group("hash_prompt_lora_mm_salt/bs16");
    g.throughput(Throughput::Elements(PROMPT as u64));
    for algo in HashAlgo::ALL {
        let root = none_hash(algo, "vllm-none-hash");
        let mut h = RequestBlockHasher::new(algo, 16, 0).expect("valid");
        let mut out = Vec::with_capacity(PROMPT / 16);
        g.bench_function(algo.name(), |b| {
            b.iter(|| hash_prompt(&mut h, black_box(&toks), root.as_bytes(), keys, &mut out));
        });
    }
    g.finish();
}

criterion_group!(benches, plain, with_extra_keys);
criterion_main!(benches);
