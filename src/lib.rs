//! hscache: the cache bookkeeping of an LLM serving engine, in Rust.
//!
//! The first user is vLLM v1: `hscache.vllm.KVCacheManager` (Python) drives this
//! crate and makes exactly the decisions of vLLM 0.33.0's Python `KVCacheManager`.
//! Python hands the core integers and byte strings; the core owns all bookkeeping
//! state and hands back integers and events.
//!
//! Modules:
//! - [`types`]: block ids, block hashes, hash keys, the hash-source trait.
//! - [`error`]: the typed error enum and its stable kinds.
//! - [`free_queue`]: `FreeKVCacheBlockQueue`, the O(1) intrusive LRU free list.
//! - [`hash_index`]: `BlockHashToBlockMap`, hash key → cached block(s), duplicates kept.
//! - [`pool`]: `BlockPool`, ref counts, lazy eviction, events.
//! - [`events`]: KV-cache event records.
//! - [`hash`]: block hashing, bit-exact with every vLLM algorithm, plus BLAKE3; the
//!   incremental request block hasher.
//! - [`extra_keys`]: block-hash extra keys (LoRA, multimodal, cache salt, prompt embeds).
//! - [`stats`]: opt-in per-operation latency counters (`hscache.stats()`).
//! - [`testing`]: deterministic fixtures shared by tests and benches.
//! - [`request_table`]: `RequestTable`, request id → per-request state with stable
//!   handles (the manager's, the encoder cache's and the slot mirror's tables).
//! - [`manager`]: the `KVCacheManager` facade, the coordinator and one single-type
//!   manager per group kind (HiSparse's host-backed groups in `manager::hisparse`).
//! - [`encoder_cache`]: `EncoderCacheManager` (the multimodal encoder-output cache) and
//!   `EncoderDecoderCacheManager` (the encoder budget of encoder-decoder models).
//! - [`slots`]: `SlotMirror`, the worker-side mirror of block assignments (versions, slot
//!   mappings, validated reads) behind the hidden-state cache.
//! - [`prefill_skip`]: the reduced batch of KV-sharing layers (`--kv-sharing-fast-prefill`)
//!   computed on the host.
//! - [`shield`]: panic shields, an internal panic as a typed error and a poisoned object.
//! - `python` (feature `python`): the PyO3 bindings, conversion only.

pub mod alloc;
pub mod encoder_cache;
pub mod error;
pub mod events;
pub mod explain;
pub mod extra_keys;
pub mod fault;
pub mod free_queue;
pub mod hash;
pub mod hash_index;
pub mod manager;
pub mod pool;
pub mod prefill_skip;
pub mod request_table;
pub mod shield;
pub mod slots;
pub mod stats;
pub mod testing;
pub mod types;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, ErrorKind, Result};
