//! vLLM's KV-cache configuration as the core's [`KVCacheManagerConfig`]: each group
//! arrives as a dict of plain values (`python/hscache/vllm/specs.py` reads vLLM's
//! spec objects into it), read here key by key.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::count;
use crate::manager::{GroupSpec, MambaCacheMode, MambaParams, ManagerKind};
use crate::python::errors::InvalidArgumentError;

fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?
        .ok_or_else(|| InvalidArgumentError::new_err(format!("group spec lacks {key:?}")))
}

fn usize_of(d: &Bound<'_, PyDict>, key: &str) -> PyResult<usize> {
    count(key, item(d, key)?.extract()?)
}

fn bool_of(d: &Bound<'_, PyDict>, key: &str) -> PyResult<bool> {
    item(d, key)?.extract()
}

fn opt_usize_of(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<usize>> {
    match d.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => Ok(Some(count(key, v.extract()?)?)),
    }
}

/// One group's dict as a [`GroupSpec`].
pub(crate) fn group_spec(d: &Bound<'_, PyDict>) -> PyResult<GroupSpec> {
    let kind: String = item(d, "kind")?.extract()?;
    let kind = match kind.as_str() {
        "full_attention" => ManagerKind::FullAttention,
        "sink_full_attention" => ManagerKind::SinkFullAttention {
            sink_len: usize_of(d, "sink_len")?,
        },
        "rswa" => ManagerKind::Rswa {
            rswa_window: usize_of(d, "rswa_window")?,
        },
        "circular_buffer" => ManagerKind::CircularBuffer,
        "sliding_window" => ManagerKind::SlidingWindow {
            sliding_window: usize_of(d, "sliding_window")?,
            extra_retained_tokens: usize_of(d, "extra_retained_tokens")?,
        },
        "chunked_local" => ManagerKind::ChunkedLocal {
            attention_chunk_size: usize_of(d, "attention_chunk_size")?,
        },
        "mamba" => {
            let mode: String = item(d, "mamba_cache_mode")?.extract()?;
            let mode = match mode.as_str() {
                "none" => MambaCacheMode::None,
                "all" => MambaCacheMode::All,
                "align" => MambaCacheMode::Align,
                other => {
                    return Err(InvalidArgumentError::new_err(format!(
                        "unknown mamba_cache_mode {other:?}"
                    )))
                }
            };
            ManagerKind::Mamba(MambaParams {
                mode,
                num_speculative_blocks: usize_of(d, "num_speculative_blocks")?,
                num_prefill_checkpoint_blocks: usize_of(d, "num_prefill_checkpoint_blocks")?,
                prefill_checkpoint_alignment: opt_usize_of(d, "prefill_checkpoint_alignment")?,
            })
        }
        "cross_attention" => ManagerKind::CrossAttention,
        "hisparse_source" => ManagerKind::HiSparseSource {
            host_num_blocks: u32::try_from(usize_of(d, "host_num_blocks")?).map_err(|_| {
                InvalidArgumentError::new_err("hisparse_host_num_blocks is too large")
            })?,
        },
        "hisparse_resident" => ManagerKind::HiSparseResident,
        "hisparse_hot" => ManagerKind::HiSparseHot {
            blocks_per_request: usize_of(d, "blocks_per_request")?,
        },
        other => {
            return Err(InvalidArgumentError::new_err(format!(
                "unknown KV-cache group kind {other:?}"
            )))
        }
    };
    Ok(GroupSpec {
        kind,
        block_size: usize_of(d, "block_size")?,
        dcp_sharded: bool_of(d, "dcp_sharded")?,
        prefix_cacheable: bool_of(d, "prefix_cacheable")?,
        is_eagle_group: bool_of(d, "is_eagle_group")?,
        is_full_attention_spec: bool_of(d, "is_full_attention_spec")?,
        is_attention_spec: bool_of(d, "is_attention_spec")?,
        is_cross_or_encoder_only: bool_of(d, "is_cross_or_encoder_only")?,
        spec_class: u32::try_from(usize_of(d, "spec_class")?)
            .map_err(|_| InvalidArgumentError::new_err("spec_class is too large"))?,
        max_admission_blocks_per_request: opt_usize_of(d, "max_admission_blocks_per_request")?,
    })
}
