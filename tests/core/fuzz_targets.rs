//! The fuzz targets of `fuzz/` (shared code: `tests/fuzz_common`) driven from a stable
//! `cargo test`: every committed corpus input, then seeded random inputs for a bounded
//! number of iterations (`HSCACHE_FUZZ_ITERS`, default below) or time
//! (`HSCACHE_FUZZ_SECS`). Each target panics only on a broken property; the operations
//! executed are counted and printed (`cargo test -- --nocapture`).
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test
#![allow(clippy::print_stdout)] // the operation counts are the report

use crate::fuzz_common;

use std::path::Path;
use std::time::{Duration, Instant};

use fuzz_common::{manager_ops, random_bytes, request_hash, value_hash};

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `target` over the corpus of `name`, then `iters` random inputs (or until the
/// time bound); returns the operations executed.
fn drive(name: &str, target: fn(&[u8]) -> usize, iters: u64, max_len: usize) -> usize {
    let mut ops = 0;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(name);
    let mut corpus = 0;
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries {
            let data = std::fs::read(e.unwrap().path()).unwrap();
            ops += target(&data);
            corpus += 1;
        }
    }
    let iters = env_num("HSCACHE_FUZZ_ITERS", iters);
    let limit = Duration::from_secs(env_num("HSCACHE_FUZZ_SECS", 3600));
    let seed0 = env_num("HSCACHE_FUZZ_SEED", 0);
    let t0 = Instant::now();
    let mut done = 0;
    for i in 0..iters {
        let len = (i as usize * 7919) % max_len + 1;
        ops += target(&random_bytes(
            seed0 ^ (i + 1).wrapping_mul(0x2545_F491_4F6C_DD1D),
            len,
        ));
        done += 1;
        if t0.elapsed() > limit {
            break;
        }
    }
    println!("fuzz target {name}: {corpus} corpus + {done} random inputs, {ops} ops");
    ops
}

#[test]
fn fuzz_manager_ops() {
    let ops = drive("manager_ops", manager_ops, 4000, 1200);
    assert!(ops > 0);
}

#[test]
fn fuzz_value_hash() {
    drive("value_hash", value_hash, 20000, 256);
}

#[test]
fn fuzz_request_hash() {
    drive("request_hash", request_hash, 20000, 512);
}
