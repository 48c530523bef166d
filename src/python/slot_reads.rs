//! `SlotReads`: the validated reads of one committed step (`SlotMirror.commit`,
//! `slots.rs`), the core's `crate::slots::StepReads` as a Python class.

use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use super::buffers::i64_bytearray;
use crate::slots::StepReads;

/// The validated reads of one committed step (`SlotMirror.commit`).
#[pyclass(name = "SlotReads", module = "hscache._core")]
pub struct PySlotReads {
    pub(super) reads: StepReads,
}

#[pymethods]
impl PySlotReads {
    #[getter]
    fn step_id(&self) -> u64 {
        self.reads.step_id
    }

    #[getter]
    fn mirror_id(&self) -> u64 {
        self.reads.mirror_id()
    }

    /// Plan index of every served read, in plan order.
    #[getter]
    fn plan_indices(&self) -> Vec<usize> {
        self.reads.entries().iter().map(|e| e.plan_index).collect()
    }

    /// Rows of every served read (positions `0..num_tokens`).
    #[getter]
    fn num_tokens(&self) -> Vec<usize> {
        self.reads.entries().iter().map(|e| e.num_tokens).collect()
    }

    /// How many rows of every served read come from the cache.
    #[getter]
    fn num_cached_tokens(&self) -> Vec<usize> {
        self.reads
            .entries()
            .iter()
            .map(|e| e.num_cached_tokens)
            .collect()
    }

    /// Whether every served read also serves the skip-layer keys.
    #[getter]
    fn skip_layers(&self) -> Vec<bool> {
        self.reads.entries().iter().map(|e| e.skip_layers).collect()
    }

    /// Plan indices of the reads refused (never served), in plan order.
    #[getter]
    fn misses(&self) -> Vec<usize> {
        self.reads.misses().to_vec()
    }

    /// Per miss (the order of `misses`): the first block of the read that failed
    /// validation (0, the null block, when the table maps a read position there).
    #[getter]
    fn miss_blocks(&self) -> Vec<u32> {
        self.reads.miss_blocks().to_vec()
    }

    #[getter]
    fn num_rows(&self) -> usize {
        self.reads.num_rows()
    }

    /// The slot of every served row (int64 bytearray), entry after entry; with
    /// `skip_layers_only`, of the reads served for the skip-layer keys too.
    #[pyo3(signature = (skip_layers_only=false))]
    fn slots<'py>(
        &self,
        py: Python<'py>,
        skip_layers_only: bool,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        if skip_layers_only {
            i64_bytearray(
                py,
                self.reads.num_skip_layer_rows(),
                self.reads.skip_layer_slots(),
            )
        } else {
            i64_bytearray(py, self.reads.num_rows(), self.reads.slots())
        }
    }

    fn __len__(&self) -> usize {
        self.reads.entries().len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SlotReads(step_id={}, served={}, misses={}, rows={})",
            self.reads.step_id,
            self.reads.entries().len(),
            self.reads.misses().len(),
            self.reads.num_rows()
        )
    }
}
