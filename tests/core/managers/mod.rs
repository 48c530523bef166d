//! Tests of each single-type KV-cache manager and of the coordinator that combines
//! them, with the numbers vLLM 0.33's own classes give for the same calls (block ids,
//! hit lengths, free-queue orders), plus property tests of hybrid layouts.
//!
//! One test binary (one link) with a module per manager file of `src/manager/`.

mod common;

mod chunked_local;
mod circular_buffer;
mod coordinator;
mod cross_attention;
mod hybrid_proptest;
mod mamba;
mod rswa;
mod sink;
mod sliding_window;
