//! hscache: the cache bookkeeping of an LLM serving engine, in Rust.
//!
//! The first user is vLLM v1: `hscache.vllm.KVCacheManager` (Python) drives this
//! crate and makes exactly the decisions of vLLM 0.33.0's Python `KVCacheManager`.
//! Python hands the core integers and byte strings; the core owns all bookkeeping
//! state and hands back integers and events.
//!
//! Where each concept lives (its module here, its binding in `src/python/`, its
//! Python module and its tests): the concept map in `docs/architecture.md`. Each
//! module's doc says what it owns and which vLLM 0.33 file it mirrors; `python`
//! (feature `python`) holds the PyO3 bindings, conversion only.

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
pub mod step;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod types;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, ErrorKind, Result};
