//! PyO3 bindings (feature `python`): the `hscache._core` extension module.
//!
//! `convert/` reads Python objects into core values and back; it decides nothing
//! (see its module docs for the review rule). The other files are the classes and
//! functions Python sees, each a thin call into the core (which file binds which
//! core concept: the concept map in `docs/architecture.md`). No bookkeeping lives
//! here; the Python adapter (`python/hscache/vllm/`) wraps these classes into vLLM's
//! interface.

mod batch;
mod block;
mod blocks;
mod convert;
mod coordinator;
mod encoder_cache;
mod encoder_decoder;
mod errors;
mod events;
mod explain;
mod hasher;
mod hisparse;
mod manager;
mod manager_calls;
mod omni_rules;
mod omni_save_plan;
mod pool;
mod prefill_skip;
mod prefix_stats;
mod retention;
mod slot_facts;
mod slot_reads;
mod slots;
mod step_schedule;
mod step_update;

// Sibling modules address it as `super::buffers`.
pub(crate) use convert::buffers;

use pyo3::prelude::*;

/// `"release"` or `"debug"`: benchmarks refuse to report numbers of a debug build.
const BUILD_PROFILE: &str = if cfg!(debug_assertions) {
    "debug"
} else {
    "release"
};

/// Whether this extension carries the test-only switches (the `mutants` feature:
/// `_break_step_rules`, `_break_invariant`, `_break_rule`): only the test-hooks build
/// of `scripts/panic_python.sh` does.
const TEST_HOOKS: bool = cfg!(feature = "mutants");

/// Per-operation latency counters of the drop-in: `{op: {calls, total_ns, mean_ns,
/// p50_ns, p90_ns, p99_ns}}` (percentiles are log2-bucket upper bounds).
#[pyfunction]
#[pyo3(signature = () -> "dict[str, dict[str, float]]")]
fn stats(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let out = pyo3::types::PyDict::new(py);
    for s in crate::stats::snapshot() {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("calls", s.calls)?;
        d.set_item("total_ns", s.total_ns)?;
        d.set_item("mean_ns", s.total_ns as f64 / s.calls as f64)?;
        d.set_item("p50_ns", s.p50_ns)?;
        d.set_item("p90_ns", s.p90_ns)?;
        d.set_item("p99_ns", s.p99_ns)?;
        out.set_item(s.name, d)?;
    }
    Ok(out)
}

/// Turns the latency counters on (default) or off.
#[pyfunction]
#[pyo3(signature = (on=true))]
fn enable_stats(on: bool) {
    crate::stats::set_enabled(on);
}

/// Zeroes the latency counters.
#[pyfunction]
fn reset_stats() {
    crate::stats::reset();
}

/// Test only (`fault-injection` builds): arms the fault point `site` (`src/fault.rs`);
/// its `skip + 1`-th pass panics. Absent from release builds and from the stubs.
#[cfg(feature = "fault-injection")]
#[pyfunction]
#[pyo3(signature = (site, skip=0))]
fn _arm_fault(site: &str, skip: usize) {
    crate::fault::arm(site, skip);
}

// The module, declared (not built in a function) so that PyO3's introspection
// (`experimental-inspect`, read by `scripts/gen_stubs.py`) sees every export.
#[pymodule]
mod _core {
    use pyo3::prelude::*;

    #[pymodule_export]
    use super::{enable_stats, reset_stats, stats};

    #[cfg(feature = "fault-injection")]
    #[pymodule_export]
    use super::_arm_fault;

    #[pymodule_export]
    use super::{
        block::PyKVCacheBlock,
        blocks::PyKVCacheBlocks,
        coordinator::PyKVCacheCoordinatorCore,
        encoder_cache::{py_compute_mm_encoder_budget, PyEncoderCacheCore},
        encoder_decoder::PyEncoderDecoderCacheCore,
        events::{
            block_stored_fields, coalesce_kv_events, normalize_kv_events_mode, PyEventBuilder,
        },
        hasher::{
            blake3_block, blake3_digest, hash_block_tokens, hash_object, serialize,
            PyRequestBlockHasher,
        },
        hisparse::PyHiSparseCore,
        manager::PyKVCacheCore,
        omni_rules::PyOmniStepRules,
        omni_save_plan::PyOmniSavePlan,
        pool::PyBlockPoolCore,
        prefill_skip::prefill_skip,
        slot_reads::PySlotReads,
        slots::PySlotMirror,
        step_schedule::PyStepSchedule,
        step_update::PyStepUpdate,
    };

    #[cfg(feature = "mutants")]
    #[pymodule_export]
    use super::step_schedule::_break_step_rules;

    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");
    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const build_profile: &str = super::BUILD_PROFILE;
    #[pymodule_export]
    const TEST_HOOKS: bool = super::TEST_HOOKS;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        super::errors::register(m)
    }
}
