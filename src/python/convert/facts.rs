//! A vLLM `Request`'s facts for explain mode's fingerprints (`crate::explain`): the
//! token ids of a block range and the extra-key fields (cache salt, LoRA, multimodal
//! features, prompt embeddings, why it skips reading the prefix cache). Read only
//! when explain mode is on; `request.rs` hands them to the core and
//! `src/python/explain.rs` binds the rest of explain mode.

use pyo3::intern;
use pyo3::prelude::*;

use crate::error::Error;
use crate::explain::RequestFacts;

fn opt_str(obj: PyResult<Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    match obj {
        Ok(o) if o.is_none() => Ok(None),
        Ok(o) => Ok(Some(o.str()?.to_str()?.to_owned())),
        Err(_) => Ok(None),
    }
}

/// Why a request skips reading the prefix cache (vLLM's
/// `Request.get_skip_reading_prefix_cache`), named for the user.
fn skip_cause(request: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let py = request.py();
    if let Ok(sp) = request.getattr(intern!(py, "sampling_params")) {
        if !sp.is_none() {
            if sp
                .getattr(intern!(py, "prompt_logprobs"))
                .is_ok_and(|p| !p.is_none())
            {
                return Ok(Some("prompt_logprobs".into()));
            }
            if sp
                .getattr(intern!(py, "skip_reading_prefix_cache"))
                .and_then(|v| v.is_truthy())
                .unwrap_or(false)
            {
                return Ok(Some("sampling_params.skip_reading_prefix_cache".into()));
            }
        }
    }
    if let Ok(pp) = request.getattr(intern!(py, "pooling_params")) {
        if !pp.is_none() {
            return Ok(Some("pooling".into()));
        }
    }
    Ok(None)
}

/// Reads what explanations compare from a vLLM `Request`: the token ids of blocks
/// `[start, end)` and the extra-key fields.
pub(crate) fn read_request_facts(
    request: &Bound<'_, PyAny>,
    block_size: usize,
    start: usize,
    end: usize,
) -> PyResult<RequestFacts> {
    let py = request.py();
    let mut facts = RequestFacts::default();
    if end > start {
        let tokens = request.getattr(intern!(py, "all_token_ids"))?;
        let slice = tokens.get_item(pyo3::types::PySlice::new(
            py,
            (start * block_size) as isize,
            (end * block_size) as isize,
            1,
        ))?;
        facts.tokens = slice.extract()?;
    }
    facts.cache_salt = opt_str(request.getattr(intern!(py, "cache_salt")))?;
    if let Ok(lora) = request.getattr(intern!(py, "lora_request")) {
        if !lora.is_none() {
            facts.lora = opt_str(lora.getattr(intern!(py, "lora_name")))?;
        }
    }
    if let Ok(features) = request.getattr(intern!(py, "mm_features")) {
        if !features.is_none() {
            for f in features.try_iter()? {
                let f = f?;
                let pos = f.getattr(intern!(py, "mm_position"))?;
                let offset: usize = pos.getattr(intern!(py, "offset"))?.extract()?;
                let length: usize = pos.getattr(intern!(py, "length"))?.extract()?;
                let id = opt_str(f.getattr(intern!(py, "identifier")))?.unwrap_or_default();
                facts.mm.push((offset, length, id));
            }
        }
    }
    if let Ok(embeds) = request.getattr(intern!(py, "prompt_embeds")) {
        if !embeds.is_none() {
            facts.num_prompt_embeds = embeds.len()?;
        }
    }
    facts.skip_cause = skip_cause(request)?;
    Ok(facts)
}

/// [`read_request_facts`] with the core's error type (a Python error becomes
/// `InvalidArgument`; the explanation then skips the comparison).
pub(crate) fn request_facts(
    request: &Bound<'_, PyAny>,
    block_size: usize,
    start: usize,
    end: usize,
) -> crate::error::Result<Option<RequestFacts>> {
    read_request_facts(request, block_size, start, end)
        .map(Some)
        .map_err(|e| Error::InvalidArgument(e.to_string()))
}
