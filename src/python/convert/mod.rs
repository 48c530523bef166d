//! The conversion layer: Python objects in, core values out (and back).
//!
//! Review rule (CONTRIBUTING.md): nothing here decides anything. No vLLM rule, no
//! comparison of a token count, no branch on a request's state — only reading an
//! attribute, checking its type and range, and building the core's plain value (or
//! the Python object of a core value). Every rule lives in `crate::manager` and its
//! siblings; `src/python/*.rs` call the core with what these functions read.

pub mod blocks;
pub mod buffers;
pub mod hashes;
pub mod request;
pub mod spec;

pub(crate) use crate::python::errors::count;
