//! `OmniSavePlan`: one step laid out by `OmniStepRules.lay_out` (`omni_rules.rs`),
//! the core's `crate::slots::SavePlan` as a Python class, read-only.

use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::slots::SavePlan;

/// One laid-out step (`OmniStepRules.lay_out`), taken once by `OmniStepRules.save`.
#[pyclass(name = "OmniSavePlan", module = "hscache._core", frozen)]
pub struct PyOmniSavePlan {
    pub(super) plan: SavePlan,
}

#[pymethods]
impl PyOmniSavePlan {
    /// The step's requests in row order.
    #[getter]
    fn req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.plan.req_ids())
    }

    /// Rows of each request, in row order.
    #[getter]
    fn sizes(&self) -> Vec<usize> {
        self.plan.sizes().to_vec()
    }

    /// The step's rows.
    #[getter]
    fn num_rows(&self) -> usize {
        self.plan.num_rows()
    }

    /// The rules that laid it out.
    #[getter]
    fn rules_id(&self) -> u64 {
        self.plan.rules_id()
    }

    fn __repr__(&self) -> String {
        format!(
            "OmniSavePlan(requests={}, rows={})",
            self.plan.req_ids().len(),
            self.plan.num_rows()
        )
    }
}
