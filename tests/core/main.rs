//! hscache's Rust integration tests: one test binary (one link), a module per concept.
//!
//! - `hashing`: block hashing without Python (golden values from vLLM 0.33, properties).
//! - `pool`: the free queue and the block pool against naive models (property tests).
//! - `retention`: the retention policies (property tests).
//! - `manager`: the core manager's facade (vLLM's scenarios), the batched API, the
//!   invariant checker and a proptest state machine.
//! - `managers`: each single-type manager and the coordinator that combines them.
//! - `fuzz_targets`: the fuzz targets of `fuzz/` from a stable `cargo test`.
//! - `panic_safety`: internal panics are caught and poison only their manager (the armed
//!   points need `--features fault-injection`: `cargo test --features fault-injection
//!   --test core panic_safety`).
//!
//! Shared fixtures: `hscache::testing` (the crate's `testing` feature, on for every cargo
//! test and bench through the dev-dependency on the crate itself), `managers::common`
//! (single-type managers) and `fuzz_common` (shared with the cargo-fuzz crate in `fuzz/`).
#![allow(clippy::unwrap_used)] // test code: a panic is a failed test

#[path = "../fuzz_common/mod.rs"]
mod fuzz_common;

mod fuzz_targets;
mod hashing;
mod manager;
mod managers;
mod panic_safety;
mod pool;
mod retention;
