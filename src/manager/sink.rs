//! `SinkFullAttentionManager`: full attention with attention sinks.
//!
//! Mirrors vLLM 0.33 `single_type_kv_cache_manager.py::SinkFullAttentionManager`,
//! which changes nothing of full attention's bookkeeping but checks at construction
//! that the sink spans whole blocks.

use super::single_type::{ManagerBase, SingleTypeManager};
use crate::error::{Error, Result};

/// Full attention with a sink of `sink_len` tokens (see module docs).
#[derive(Debug)]
pub struct SinkFullAttentionManager {
    base: ManagerBase,
}

impl SinkFullAttentionManager {
    /// `Err` unless the sink is a positive number of whole blocks.
    pub fn new(base: ManagerBase, sink_len: usize) -> Result<Self> {
        if sink_len == 0 || sink_len % base.block_size != 0 {
            return Err(Error::InvalidArgument(format!(
                "sink_len {sink_len} must be a positive multiple of the block size {}",
                base.block_size
            )));
        }
        Ok(Self { base })
    }
}

impl SingleTypeManager for SinkFullAttentionManager {
    fn base(&self) -> &ManagerBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut ManagerBase {
        &mut self.base
    }

    super::full_attention::full_attention_hooks!();
}
