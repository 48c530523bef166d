//! `update_from_output()`'s decisions for a steady decode step: which sampled tokens
//! certainly do not stop their request. See [`crate::step`].
