//! `StepLedger`: the core `crate::slots::StepLedger` (consume-once step ids) as a
//! Python class, for `hscache.omni`.

use pyo3::prelude::*;

use super::convert::{count_arg, u64_arg, Int};
use crate::shield::Shielded;
use crate::slots::StepLedger;

/// Every call runs behind the core's panic shield (`src/shield.rs`).
#[pyclass(name = "StepLedger", module = "hscache._core")]
pub struct PyStepLedger {
    core: Shielded<StepLedger>,
}

#[pymethods]
impl PyStepLedger {
    #[new]
    #[pyo3(signature = (*, limit))]
    fn new(limit: Int) -> PyResult<Self> {
        Ok(Self {
            core: Shielded::new(StepLedger::new(count_arg("limit", limit)?)?, "step ledger"),
        })
    }

    /// The most outstanding step ids allowed.
    #[getter]
    fn limit(&self) -> PyResult<usize> {
        self.core.read("limit", |c| Ok(c.limit()))
    }

    /// The outstanding step ids, oldest first.
    fn outstanding(&self) -> PyResult<Vec<u64>> {
        self.core
            .read("outstanding", |c| Ok(c.outstanding().to_vec()))
    }

    /// Raises `InvalidArgumentError` when `limit` ids are outstanding.
    fn check_room(&self) -> PyResult<()> {
        self.core.read("check_room", |c| Ok(c.check_room()?))
    }

    /// Issues the id of a newly saved step (refused when `limit` are outstanding).
    fn issue(&mut self) -> PyResult<u64> {
        self.core.write("issue", |c| Ok(c.issue()?))
    }

    /// Whether `step_id` is outstanding here.
    fn __contains__(&self, step_id: Int) -> PyResult<bool> {
        let id = u64_arg("step_id", step_id)?;
        self.core.read("contains", |c| Ok(c.contains(id)))
    }

    /// Consumes `step_id` (refused unless outstanding here; nothing changes then).
    fn consume(&mut self, step_id: Int) -> PyResult<()> {
        let id = u64_arg("step_id", step_id)?;
        self.core.write("consume", |c| Ok(c.consume(id)?))
    }
}
