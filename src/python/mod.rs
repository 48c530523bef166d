//! PyO3 bindings (feature `python`): the `hscache._core` extension module.
//!
//! Conversion only: arguments in, one core call, results and errors out. No
//! bookkeeping lives here; the Python adapter (`python/hscache/vllm/`) wraps
//! these classes into vLLM's interface.

mod block;
mod blocks;
mod encoder_cache;
mod errors;
mod hashes;
mod manager;
mod slots;

use pyo3::prelude::*;

/// `"release"` or `"debug"`: benchmarks refuse to report numbers of a debug build.
const BUILD_PROFILE: &str = if cfg!(debug_assertions) {
    "debug"
} else {
    "release"
};

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("build_profile", BUILD_PROFILE)?;
    m.add_class::<block::PyKVCacheBlock>()?;
    m.add_class::<blocks::PyKVCacheBlocks>()?;
    m.add_class::<manager::PyKVCacheCore>()?;
    m.add_class::<slots::PySlotMirror>()?;
    m.add_class::<slots::PySlotReads>()?;
    m.add_class::<encoder_cache::PyEncoderCacheCore>()?;
    m.add_function(wrap_pyfunction!(
        encoder_cache::py_compute_mm_encoder_budget,
        m
    )?)?;
    errors::register(m)?;
    Ok(())
}
