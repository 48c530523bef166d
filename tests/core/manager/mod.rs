//! The core manager (`src/manager/`) through its facade: vLLM's own scenarios, the
//! batched running-set API, the invariant checker's completeness, and a proptest state
//! machine over scheduler-like operations.

mod batch;
mod facade;
mod invariants;
mod statemachine;
