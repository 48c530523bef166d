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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("build_profile", BUILD_PROFILE)?;
    m.add("TEST_HOOKS", TEST_HOOKS)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(enable_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_stats, m)?)?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_arm_fault, m)?)?;
    m.add_class::<block::PyKVCacheBlock>()?;
    m.add_class::<blocks::PyKVCacheBlocks>()?;
    m.add_class::<manager::PyKVCacheCore>()?;
    m.add_class::<pool::PyBlockPoolCore>()?;
    m.add_class::<coordinator::PyKVCacheCoordinatorCore>()?;
    m.add_class::<hisparse::PyHiSparseCore>()?;
    m.add_class::<slots::PySlotMirror>()?;
    m.add_class::<slot_reads::PySlotReads>()?;
    m.add_class::<omni_rules::PyOmniStepRules>()?;
    m.add_class::<omni_save_plan::PyOmniSavePlan>()?;
    m.add_class::<step_schedule::PyStepSchedule>()?;
    #[cfg(feature = "mutants")]
    m.add_function(wrap_pyfunction!(step_schedule::_break_step_rules, m)?)?;
    m.add_class::<step_update::PyStepUpdate>()?;
    m.add_function(wrap_pyfunction!(prefill_skip::prefill_skip, m)?)?;
    m.add_class::<encoder_cache::PyEncoderCacheCore>()?;
    m.add_class::<encoder_decoder::PyEncoderDecoderCacheCore>()?;
    m.add_function(wrap_pyfunction!(
        encoder_cache::py_compute_mm_encoder_budget,
        m
    )?)?;
    m.add_class::<hasher::PyRequestBlockHasher>()?;
    m.add_function(wrap_pyfunction!(hasher::hash_block_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(hasher::hash_object, m)?)?;
    m.add_function(wrap_pyfunction!(hasher::serialize, m)?)?;
    m.add_function(wrap_pyfunction!(hasher::blake3_digest, m)?)?;
    m.add_function(wrap_pyfunction!(hasher::blake3_block, m)?)?;
    m.add_function(wrap_pyfunction!(events::block_stored_fields, m)?)?;
    m.add_function(wrap_pyfunction!(events::coalesce_kv_events, m)?)?;
    m.add_function(wrap_pyfunction!(events::normalize_kv_events_mode, m)?)?;
    m.add_class::<events::PyEventBuilder>()?;
    errors::register(m)?;
    Ok(())
}
