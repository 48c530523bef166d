//! `schedule()`'s decisions for a steady decode step: which running requests are plain
//! decodes, and their allocation. See [`crate::step`].
