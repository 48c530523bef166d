//! PyO3 bindings (feature `python`): the `hscache._core` extension module.
//!
//! Conversion only: arguments in, one core call, results and errors out. No
//! bookkeeping lives here; the Python adapter (`python/hscache/vllm/`) wraps
//! these classes into vLLM's interface.

mod block;
mod errors;
mod hashes;
mod manager;

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
    m.add_class::<manager::PyKVCacheCore>()?;
    errors::register(m)?;
    Ok(())
}
