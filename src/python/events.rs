//! KV-cache events for Python: [`PyEventBuilder`], which turns the core's records
//! into vLLM's event structs inside the call that recorded them, and
//! `block_stored_fields`, the per-block part of vLLM's `BlockStored` event (wraps
//! `src/extra_keys.rs`).
//!
//! It owns vLLM's event fields from the core's records: the 0.32 and 0.33 struct
//! shapes, the fallback rules, and the check `allocate_slots` runs before it mutates.
//!
//! The core records `BlockStored { group, start_block, end_block, block_size }` (a
//! range of the recording call's request), `BlockRemoved` and `AllBlocksCleared`; the
//! bindings hand each call's records and request to the pool's `EventBuilder`
//! (`python/hscache/vllm/events.py` makes it). This module computes the fields that
//! take work per block: the converted hashes, the token ids, the per-block extra keys
//! in the untagged event shape of vLLM's `to_event_extra_keys`, and the lookahead
//! token ids. The values are vLLM's own objects wherever vLLM's event carries them
//! (hashes when not converted to ints, multimodal identifiers, LoRA name, cache salt,
//! prompt-embedding digests), so the event equals, field for field, what vLLM 0.33's
//! `BlockPool.cache_full_blocks` emits. vLLM 0.32's `BlockStored` has no
//! `lookahead_token_ids` (14 fields, and 0.32 has no lookahead hashing): the builder
//! passes only the fields the installed class declares.
//!
//! Extra keys are computed by the core's `generate_block_hash_extra_keys` /
//! `generate_lookahead_block_hash_extra_keys` with the multimodal scan starting at
//! item 0 for every event, as vLLM's `cache_full_blocks` does. Nothing here is
//! serialized, so the core's keys only carry *which* object each key holds: item `i`'s
//! identifier is passed as `Atom::Int(i)`, the LoRA pair and the salt as placeholders.
//!
//! Anything this reader cannot represent exactly (a multimodal item with a `None`
//! identifier, which vLLM asserts on only when its scan reaches it; positions that are
//! not non-negative ints; a token window or memoized digest of an unexpected type;
//! arithmetic beyond `isize`) raises `UnsupportedError`, and the adapter converts that
//! event with its pure-Python path instead.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PySlice, PyTuple, PyType};

use super::errors::UnsupportedError;

mod compact;
mod spec;
pub(crate) use compact::Compactor;
pub use compact::{coalesce_kv_events, normalize_kv_events_mode};
pub(crate) use spec::{clear_specs, GroupSpecs, SpecTable};

/// How far past `block_hashes` a range may reach and still be converted here.
const MAX_BLOCKS_PAST_HASHES: usize = 64;
use super::hasher::{type_name, MmHolder};
use crate::events::KVCacheEvent;
use crate::extra_keys::{
    generate_block_hash_extra_keys, generate_lookahead_block_hash_extra_keys, prompt_embeds_digest,
    ExtraKey, MmFeature, RequestExtraKeys,
};
use crate::hash::value::Atom;

fn unsupported(what: impl std::fmt::Display) -> PyErr {
    UnsupportedError::new_err(format!("block_stored_fields: {what}"))
}

/// `a * b` (token positions), or `UnsupportedError` when it does not fit an `isize`
/// (Python's slices would still work; the pure-Python path handles it).
fn mul(a: usize, b: usize) -> PyResult<usize> {
    a.checked_mul(b)
        .filter(|&v| isize::try_from(v).is_ok())
        .ok_or_else(|| unsupported("token position out of range"))
}

fn add(a: usize, b: usize) -> PyResult<usize> {
    a.checked_add(b)
        .filter(|&v| isize::try_from(v).is_ok())
        .ok_or_else(|| unsupported("token position out of range"))
}

/// A block index or count argument as `usize`; anything else (negative, beyond
/// `isize`, not an int) is left to the pure-Python path, which gives Python's answer.
fn index_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    obj.extract::<usize>()
        .ok()
        .filter(|&v| isize::try_from(v).is_ok())
        .ok_or_else(|| unsupported(format!("{name} is not an int in 0..2**63")))
}

/// `seq[lo:hi]` (both fit `isize`, checked by [`mul`] / [`add`]): a list slice for a
/// `list`, else the object's own `__getitem__` with a slice.
fn slice<'py>(seq: &Bound<'py, PyAny>, lo: usize, hi: usize) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(list) = seq.cast::<PyList>() {
        return Ok(list.get_slice(lo, hi).into_any());
    }
    // Both fit `isize` (callers check): the casts are lossless.
    let s = PySlice::new(seq.py(), lo as isize, hi as isize, 1);
    seq.get_item(s)
}

/// The list behind vLLM's read-only `ConstantList` view (whose `__getitem__` is
/// `self._x[item]`), so that slicing it costs no Python frame; any other sequence
/// as it is.
fn token_list<'py>(seq: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    static CONSTANT_LIST: PyOnceLock<Option<Py<PyType>>> = PyOnceLock::new();
    let py = seq.py();
    let constant_list = CONSTANT_LIST.get_or_init(py, || {
        py.import(intern!(py, "vllm.v1.utils"))
            .and_then(|m| m.getattr(intern!(py, "ConstantList")))
            .and_then(|t| Ok(t.cast_into::<PyType>()?.unbind()))
            .ok()
    });
    if let Some(t) = constant_list {
        if seq.get_type().is(t.bind(py)) {
            if let Ok(inner) = seq.getattr(intern!(py, "_x")) {
                if inner.is_exact_instance_of::<PyList>() {
                    return Ok(inner);
                }
            }
        }
    }
    Ok(seq.clone())
}

/// vLLM's `maybe_convert_block_hash` with the flag read once by the caller: the hash
/// object itself, or `int.from_bytes(h, "big") & (2**64 - 1)` (its last 8 bytes).
fn convert_hash<'py>(h: Bound<'py, PyAny>, to_int: bool) -> PyResult<Bound<'py, PyAny>> {
    if !to_int {
        return Ok(h);
    }
    let bytes = convertible_hash(&h)?.as_bytes();
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    let v = tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    Ok(v.into_pyobject(h.py())?.into_any())
}

/// `h` as the bytes [`convert_hash`] converts to an int, or the `UnsupportedError`
/// it raises.
fn convertible_hash<'a, 'py>(h: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PyBytes>> {
    h.cast::<PyBytes>()
        .map_err(|_| unsupported(format!("block hash is a {}, not bytes", type_name(h))))
}

/// The prompt-embedding digests of a request, as vLLM's
/// `_gen_prompt_embeds_extra_hash_keys` finds them: memoized on the request
/// (`_prompt_embeds_per_block_hashes[(start, end)]`, filled by the block hasher for
/// the same ranges), else SHA-256 of `tensor_data(prompt_embeds[start:end])`, then
/// memoized there exactly as vLLM does.
struct PromptEmbeds<'py> {
    embeds: Bound<'py, PyAny>,
    memo: Bound<'py, PyDict>,
    /// vLLM's `tensor_data`, imported on the first memo miss.
    tensor_data: Option<Bound<'py, PyAny>>,
}

impl<'py> PromptEmbeds<'py> {
    fn read(request: &Bound<'py, PyAny>, embeds: Bound<'py, PyAny>) -> PyResult<Self> {
        let py = request.py();
        let memo = request
            .getattr(intern!(py, "_prompt_embeds_per_block_hashes"))
            .map_err(|_| unsupported("request has no _prompt_embeds_per_block_hashes"))?;
        let memo = memo
            .cast_exact::<PyDict>()
            .map_err(|_| unsupported("_prompt_embeds_per_block_hashes is not a dict"))?
            .clone();
        Ok(Self {
            embeds,
            memo,
            tensor_data: None,
        })
    }

    /// The digest of rows `[start, end)`: the bytes object (vLLM's own when memoized)
    /// and its value for the core.
    fn digest(&mut self, start: usize, end: usize) -> PyResult<(Bound<'py, PyBytes>, [u8; 32])> {
        let py = self.memo.py();
        let key = PyTuple::new(py, [start, end])?;
        let obj = match self.memo.get_item(&key)? {
            Some(d) => d,
            None => {
                let tensor_data = match &self.tensor_data {
                    Some(f) => f.clone(),
                    None => {
                        let f = py
                            .import(intern!(py, "vllm.v1.core.kv_cache_utils"))?
                            .getattr(intern!(py, "tensor_data"))?;
                        self.tensor_data = Some(f.clone());
                        f
                    }
                };
                let rows = slice(&self.embeds, start, end)?;
                let data = tensor_data
                    .call1((rows,))?
                    .call_method0(intern!(py, "tobytes"))?;
                let data = data
                    .cast::<PyBytes>()
                    .map_err(|_| unsupported("tensor_data(...).tobytes() is not bytes"))?;
                let d = PyBytes::new(py, &prompt_embeds_digest(data.as_bytes())).into_any();
                self.memo.set_item(key, &d)?;
                d
            }
        };
        let bytes = obj
            .cast_exact::<PyBytes>()
            .map_err(|_| unsupported("memoized prompt-embeds digest is not bytes"))?
            .clone();
        let value = <[u8; 32]>::try_from(bytes.as_bytes())
            .map_err(|_| unsupported("memoized prompt-embeds digest is not 32 bytes"))?;
        Ok((bytes, value))
    }
}

/// The multimodal items of `request.mm_features` for the scan from `start`, each with
/// its list index as identifier (see the module docs). Reader errors become
/// `UnsupportedError`: the pure-Python path then reports (or accepts) them as vLLM does.
fn mm_items<'py>(
    request: &Bound<'py, PyAny>,
    start: usize,
) -> PyResult<(MmHolder<'py>, Vec<MmFeature<'static>>)> {
    let py = request.py();
    let features = request.getattr(intern!(py, "mm_features"))?;
    let holder = MmHolder::read(Some(&features), start)
        .map_err(|e| unsupported(format!("mm_features: {e}")))?;
    if holder
        .identifiers
        .iter()
        .any(pyo3::types::PyAnyMethods::is_none)
    {
        return Err(unsupported("a multimodal item has identifier None"));
    }
    let items = holder
        .positions
        .iter()
        .enumerate()
        .map(|(i, &(offset, length))| {
            let index = i128::try_from(i).map_err(|_| unsupported("too many items"))?;
            MmFeature::new(offset, length, Atom::Int(index))
                .map_err(|e| unsupported(format!("mm_features[{i}]: {e}")))
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok((holder, items))
}

/// Per-request objects the event keys are made of.
struct KeyObjects<'a, 'py> {
    lora_name: Option<&'a Bound<'py, PyAny>>,
    cache_salt: &'a Bound<'py, PyAny>,
    identifiers: &'a [Bound<'py, PyAny>],
}

/// One block's entry of `to_event_extra_keys`: `None` without keys, else a tuple of
/// `(identifier, offset)` for multimodal keys and the bare value for the others.
fn event_keys<'py>(
    py: Python<'py>,
    keys: &[ExtraKey<'_>],
    objs: &KeyObjects<'_, 'py>,
    digest: Option<&Bound<'py, PyBytes>>,
) -> PyResult<Bound<'py, PyAny>> {
    if keys.is_empty() {
        return Ok(py.None().into_bound(py));
    }
    let mut items: Vec<Bound<'py, PyAny>> = Vec::with_capacity(keys.len());
    for key in keys {
        let item = match key {
            ExtraKey::Lora { .. } => objs
                .lora_name
                .ok_or_else(|| PyRuntimeError::new_err("LoRA key without a LoRA request"))?
                .clone(),
            ExtraKey::Mm { identifier, offset } => {
                let ident = match identifier {
                    Atom::Int(i) => usize::try_from(*i)
                        .ok()
                        .and_then(|i| objs.identifiers.get(i)),
                    _ => None,
                }
                .ok_or_else(|| PyRuntimeError::new_err("multimodal key of an unknown item"))?;
                PyTuple::new(py, [ident.clone(), (*offset).into_pyobject(py)?.into_any()])?
                    .into_any()
            }
            ExtraKey::CacheSalt(_) => objs.cache_salt.clone(),
            ExtraKey::PromptEmbeds(_) => digest
                .ok_or_else(|| PyRuntimeError::new_err("prompt-embeds key without a digest"))?
                .clone()
                .into_any(),
        };
        items.push(item);
    }
    Ok(PyTuple::new(py, items)?.into_any())
}

/// The fields of vLLM's `BlockStored` event for blocks `start_block..end_block` of
/// `request` (blocks of `block_size` tokens) that depend on the request:
/// `(block_hashes, parent_block_hash, token_ids, lora_id, lora_name, extra_keys,
/// session_id, lookahead_token_ids)`. `int_block_hashes` is vLLM's
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`. Raises `UnsupportedError` for requests it
/// cannot convert exactly (see the module docs).
#[pyfunction]
#[pyo3(signature = (request, start_block: "int", end_block: "int", block_size: "int", num_hash_lookahead_tokens: "int", int_block_hashes) -> "tuple[list[Any], Any, list[int], int | None, str | None, list[tuple[Any, ...] | None] | None, str | None, list[list[int]] | None]")]
pub fn block_stored_fields<'py>(
    py: Python<'py>,
    request: &Bound<'py, PyAny>,
    start_block: &Bound<'py, PyAny>,
    end_block: &Bound<'py, PyAny>,
    block_size: &Bound<'py, PyAny>,
    num_hash_lookahead_tokens: &Bound<'py, PyAny>,
    int_block_hashes: bool,
) -> PyResult<Bound<'py, PyTuple>> {
    let fields = stored_fields(
        request,
        index_arg("start_block", start_block)?,
        index_arg("end_block", end_block)?,
        index_arg("block_size", block_size)?,
        index_arg("num_hash_lookahead_tokens", num_hash_lookahead_tokens)?,
        int_block_hashes,
        1,
        &[],
    )?;
    PyTuple::new(py, fields)
}

/// The blocks one `BlockStored` describes: the range, its layout and its lookahead.
struct StoredRange<'s> {
    start_block: usize,
    end_block: usize,
    block_size: usize,
    /// Lookahead tokens per block (`num_hash_lookahead_tokens`).
    la: usize,
    /// Hash blocks per block (at least 1).
    scale: usize,
    /// Left-out (null or masked) blocks, sorted.
    skipped: &'s [u32],
    /// How many blocks the event describes.
    n: usize,
}

impl<'s> StoredRange<'s> {
    fn new(
        start_block: usize,
        end_block: usize,
        block_size: usize,
        la: usize,
        hash_scale: usize,
        skipped: &'s [u32],
    ) -> Self {
        let mut range = Self {
            start_block,
            end_block,
            block_size,
            la,
            scale: hash_scale.max(1),
            skipped,
            n: 0,
        };
        range.n = range.blocks().count();
        range
    }

    /// The blocks the event describes: the range minus null and masked-out blocks.
    fn blocks(&self) -> impl Iterator<Item = usize> + '_ {
        (self.start_block..self.end_block)
            .filter(|i| self.skipped.binary_search(&(*i as u32)).is_err())
    }

    /// One hash per block and nothing left out: `hashes[start:end]` is the list.
    fn plain(&self) -> bool {
        self.scale == 1 && self.skipped.is_empty()
    }

    /// `request.block_hashes`, when the range is near enough to them. The core only
    /// records hashed blocks: a range far past them (any huge one included) is left to
    /// vLLM's helpers, so that no caller-chosen size is ever allocated here.
    fn hashes<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let hashes = request.getattr(intern!(request.py(), "block_hashes"))?;
        if mul(self.end_block, self.scale)? > hashes.len()?.saturating_add(MAX_BLOCKS_PAST_HASHES) {
            return Err(UnsupportedError::new_err(
                "end_block is far past the request's block hashes",
            ));
        }
        Ok(hashes)
    }

    /// `[maybe_convert_block_hash(h) for h in hashes[start:end]]`; block i's hash is
    /// the hash at its last hash-block boundary (vLLM's `BlockHashListWithBlockSize`).
    fn block_hashes<'py>(
        &self,
        hashes: &Bound<'py, PyAny>,
        to_int: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = hashes.py();
        if self.plain() {
            let sliced = slice(hashes, self.start_block, self.end_block)?;
            return Ok(match sliced.cast_exact::<PyList>() {
                Ok(list) if !to_int => list.clone().into_any(),
                _ => PyList::new(
                    py,
                    sliced
                        .try_iter()?
                        .map(|h| convert_hash(h?, to_int))
                        .collect::<PyResult<Vec<_>>>()?,
                )?
                .into_any(),
            });
        }
        let scale = self.scale;
        Ok(PyList::new(
            py,
            self.blocks()
                .map(|i| convert_hash(hashes.get_item((i + 1) * scale - 1)?, to_int))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any())
    }

    /// What [`Self::block_hashes`] raises, without the list where it cannot fail.
    fn check_block_hashes(&self, hashes: &Bound<'_, PyAny>, to_int: bool) -> PyResult<()> {
        if !self.plain() {
            return self.block_hashes(hashes, to_int).map(drop);
        }
        if !to_int && hashes.is_exact_instance_of::<PyList>() {
            // A list's slice, unconverted, cannot fail: nothing to check.
            return Ok(());
        }
        // Each hash must be bytes (no int or list is made).
        match hashes.cast::<PyList>() {
            Ok(list) => {
                let n = self
                    .end_block
                    .min(list.len())
                    .saturating_sub(self.start_block);
                for h in list.iter().skip(self.start_block).take(n) {
                    convertible_hash(&h)?;
                }
            }
            Err(_) => {
                for h in slice(hashes, self.start_block, self.end_block)?.try_iter()? {
                    convertible_hash(&h?)?;
                }
            }
        }
        Ok(())
    }

    /// The hash of the block before the range (`None` for block 0).
    fn parent<'py>(&self, hashes: &Bound<'py, PyAny>, to_int: bool) -> PyResult<Bound<'py, PyAny>> {
        if self.start_block == 0 {
            return Ok(hashes.py().None().into_bound(hashes.py()));
        }
        convert_hash(hashes.get_item(self.start_block * self.scale - 1)?, to_int)
    }

    /// `request.all_token_ids` and the token positions of the range: the first, the
    /// last, and the end of the window `all_token_ids[first : last + la]`.
    fn tokens<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Tokens<'py>> {
        let first = mul(self.start_block, self.block_size)?;
        let last = mul(self.end_block.max(self.start_block), self.block_size)?;
        let all = token_list(&request.getattr(intern!(request.py(), "all_token_ids"))?)?;
        let window_end = add(last, self.la)?;
        Ok(Tokens {
            all,
            first,
            last,
            window_end,
        })
    }

    /// `(token_ids, lookahead_token_ids)` from the window (vLLM's per-block lookahead
    /// lists only with lookahead tokens).
    fn token_fields<'py>(
        &self,
        tokens: &Tokens<'py>,
        window: Bound<'py, PyList>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let py = window.py();
        if self.la == 0 {
            return Ok((window.into_any(), py.None().into_bound(py)));
        }
        let lists = self
            .blocks()
            .map(|i| {
                let end = (i - self.start_block + 1) * self.block_size; // <= span, which fits isize
                Ok(window.get_slice(end, add(end, self.la)?))
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok((
            window.get_slice(0, tokens.last - tokens.first).into_any(),
            PyList::new(py, lists)?.into_any(),
        ))
    }
}

/// The range's token positions in `all_token_ids` ([`StoredRange::tokens`]).
struct Tokens<'py> {
    all: Bound<'py, PyAny>,
    first: usize,
    last: usize,
    window_end: usize,
}

impl<'py> Tokens<'py> {
    /// `all_token_ids[first : last + la]`, which must be a list.
    fn window(&self) -> PyResult<Bound<'py, PyList>> {
        slice(&self.all, self.first, self.window_end)?
            .cast_into_exact::<PyList>()
            .map_err(|_| unsupported("all_token_ids[a:b] is not a list"))
    }
}

/// What the request's extra keys and its LoRA and session fields are made of.
struct KeySources<'py> {
    /// The `lora_id` and `lora_name` fields (`None` without LoRA).
    lora_id: Bound<'py, PyAny>,
    lora_name: Bound<'py, PyAny>,
    /// The key's LoRA object (`lora_request.lora_name`), with LoRA only.
    lora_key: Option<Bound<'py, PyAny>>,
    session_id: Bound<'py, PyAny>,
    cache_salt: Bound<'py, PyAny>,
    /// The salt is keyed on the block starting at token 0 only.
    salt_keyed: bool,
    embeds: Option<PromptEmbeds<'py>>,
    mm: MmHolder<'py>,
    mm_features: Vec<MmFeature<'static>>,
}

impl<'py> KeySources<'py> {
    /// LoRA, session id, salt, embeddings and multimodal items, read in that order.
    fn read(
        request: &Bound<'py, PyAny>,
        range: &StoredRange<'_>,
        first_token: usize,
    ) -> PyResult<Self> {
        let py = request.py();
        let none = py.None().into_bound(py);
        let lora = request.getattr(intern!(py, "lora_request"))?;
        let (lora_id, lora_name, lora_key) = if lora.is_truthy()? {
            (
                lora.getattr(intern!(py, "adapter_id"))?,
                lora.getattr(intern!(py, "name"))?,
                Some(lora.getattr(intern!(py, "lora_name"))?),
            )
        } else {
            (none.clone(), none, None)
        };
        let session_id = request.getattr(intern!(py, "session_id"))?;
        let cache_salt = request.getattr(intern!(py, "cache_salt"))?;
        let salt_keyed = range.n > 0
            && (range.start_block == 0 || range.block_size == 0)
            && cache_salt.is_truthy()?;
        let embeds = request.getattr(intern!(py, "prompt_embeds"))?;
        let embeds = if embeds.is_none() {
            None
        } else {
            Some(PromptEmbeds::read(request, embeds)?)
        };
        let (mm, mm_features) = mm_items(request, first_token)?;
        Ok(Self {
            lora_id,
            lora_name,
            lora_key,
            session_id,
            cache_salt,
            salt_keyed,
            embeds,
            mm,
            mm_features,
        })
    }

    /// Whether any block can have a key (else the keys are `[None] * n`).
    fn may_key(&self) -> bool {
        self.lora_key.is_some()
            || self.salt_keyed
            || self.embeds.is_some()
            || !self.mm_features.is_empty()
    }

    /// The `extra_keys` list of the range's blocks, in `to_event_extra_keys`' shape.
    fn extra_keys(&mut self, range: &StoredRange<'_>) -> PyResult<Bound<'py, PyAny>> {
        let py = self.cache_salt.py();
        let req_keys = RequestExtraKeys {
            lora: self.lora_key.is_some().then_some((Atom::None, Atom::None)),
            mm_features: &self.mm_features,
            // Truthy placeholder: the core keys it on the block at token 0.
            cache_salt: self.salt_keyed.then_some(Atom::Int(1)),
        };
        let objs = KeyObjects {
            lora_name: self.lora_key.as_ref(),
            cache_salt: &self.cache_salt,
            identifiers: &self.mm.identifiers,
        };
        let (bs, la) = (range.block_size, range.la);
        let mut keys = Vec::new();
        let mut mm_idx = 0;
        let mut out = Vec::with_capacity(range.n);
        for i in range.blocks() {
            let start = i * bs; // <= last_token, which fits isize
            let end = start + bs;
            let hash_end = add(end, la)?;
            let digest = match self.embeds.as_mut() {
                Some(e) => Some(e.digest(start, hash_end)?),
                None => None,
            };
            let value = digest.as_ref().map(|d| d.1);
            mm_idx = if la > 0 {
                generate_lookahead_block_hash_extra_keys(
                    &req_keys, start, end, hash_end, mm_idx, value, &mut keys,
                )?
            } else {
                generate_block_hash_extra_keys(&req_keys, start, end, mm_idx, value, &mut keys)?
            };
            out.push(event_keys(py, &keys, &objs, digest.as_ref().map(|d| &d.0))?);
        }
        Ok(PyList::new(py, out)?.into_any())
    }
}

/// [`block_stored_fields`] with the arguments already read, in its tuple's order.
#[allow(clippy::too_many_arguments)]
fn stored_fields<'py>(
    request: &Bound<'py, PyAny>,
    start_block: usize,
    end_block: usize,
    block_size: usize,
    la: usize,
    int_block_hashes: bool,
    hash_scale: usize,
    skipped: &[u32],
) -> PyResult<[Bound<'py, PyAny>; 8]> {
    let py = request.py();
    let none = py.None().into_bound(py);
    let range = StoredRange::new(start_block, end_block, block_size, la, hash_scale, skipped);
    let hashes = range.hashes(request)?;
    let block_hashes = range.block_hashes(&hashes, int_block_hashes)?;
    let parent = range.parent(&hashes, int_block_hashes)?;
    let tokens = range.tokens(request)?;
    let (token_ids, lookahead_token_ids) = range.token_fields(&tokens, tokens.window()?)?;
    let mut sources = KeySources::read(request, &range, tokens.first)?;
    let extra_keys = if range.n == 0 {
        none
    } else if sources.may_key() {
        sources.extra_keys(&range)?
    } else {
        PyList::new(py, std::iter::repeat_n(&none, range.n))?.into_any()
    };
    let KeySources {
        lora_id,
        lora_name,
        session_id,
        ..
    } = sources;
    Ok([
        block_hashes,
        parent,
        token_ids,
        lora_id,
        lora_name,
        extra_keys,
        session_id,
        lookahead_token_ids,
    ])
}

/// Raises exactly what [`stored_fields`] would for these arguments, in the same
/// order, without building what cannot fail (the token window of a `list`, the hash
/// list, `[None] * n` keys): the pre-allocation check of [`PyEventBuilder::dry_run`].
#[allow(clippy::too_many_arguments)]
fn check_stored_fields(
    request: &Bound<'_, PyAny>,
    start_block: usize,
    end_block: usize,
    block_size: usize,
    la: usize,
    int_block_hashes: bool,
    hash_scale: usize,
    skipped: &[u32],
) -> PyResult<()> {
    let range = StoredRange::new(start_block, end_block, block_size, la, hash_scale, skipped);
    let hashes = range.hashes(request)?;
    range.check_block_hashes(&hashes, int_block_hashes)?;
    range.parent(&hashes, int_block_hashes)?;
    let tokens = range.tokens(request)?;
    // A list's slice is a list: with nothing to build, no window is made.
    if !tokens.all.is_exact_instance_of::<PyList>() {
        tokens.window()?;
    }
    let mut sources = KeySources::read(request, &range, tokens.first)?;
    if range.n > 0 && sources.may_key() {
        sources.extra_keys(&range)?;
    }
    Ok(())
}

/// vLLM 0.33's `BlockStored` fields, in declaration order: when the class has
/// exactly these, events are built with positional arguments (no keyword dict).
/// vLLM 0.32's struct has the first 14 (no `lookahead_token_ids`): positional too.
const BLOCK_STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// How a `BlockStored` struct is called, decided once from its declared fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StoredCall {
    /// vLLM 0.33's 15 fields, positionally.
    Positional15,
    /// vLLM 0.32's 14 fields (no `lookahead_token_ids`), positionally.
    Positional14,
    /// Any other layout: keywords, `lookahead_token_ids` and the two spec fields
    /// (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`) only if declared.
    Keywords {
        lookahead_field: bool,
        spec_fields: bool,
    },
}

/// The leading `BlockRemoved` fields this module fills (the rest keep defaults).
const BLOCK_REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

/// `cls.__struct_fields__` as strings (empty when the class declares none).
fn struct_fields(cls: &Bound<'_, PyAny>) -> Vec<String> {
    cls.getattr(intern!(cls.py(), "__struct_fields__"))
        .and_then(|f| f.extract::<Vec<String>>())
        .unwrap_or_default()
}

/// Whether `fields` is `expected` (`prefix`: starts with it).
fn has_fields(fields: &[String], expected: &[&str], prefix: bool) -> bool {
    let n = expected.len();
    (fields.len() == n || (prefix && fields.len() > n))
        && fields.iter().zip(expected).all(|(a, b)| a == b)
}

impl StoredCall {
    fn of(fields: &[String]) -> Self {
        if has_fields(fields, &BLOCK_STORED_FIELDS, false) {
            StoredCall::Positional15
        } else if has_fields(fields, &BLOCK_STORED_FIELDS[..14], false) {
            StoredCall::Positional14
        } else {
            let has = |name: &str| fields.iter().any(|f| f == name);
            StoredCall::Keywords {
                lookahead_field: has("lookahead_token_ids"),
                spec_fields: has("kv_cache_spec_kind") && has("kv_cache_spec_sliding_window"),
            }
        }
    }

    fn has_lookahead_field(self) -> bool {
        match self {
            StoredCall::Positional15 => true,
            StoredCall::Positional14 => false,
            StoredCall::Keywords {
                lookahead_field, ..
            } => lookahead_field,
        }
    }

    fn has_spec_fields(self) -> bool {
        match self {
            StoredCall::Positional15 | StoredCall::Positional14 => true,
            StoredCall::Keywords { spec_fields, .. } => spec_fields,
        }
    }
}

/// The fields of the last `BlockStored` a batch of records built, kept for the
/// record right after it when that one describes the same blocks of the same
/// request with the same builder (another KV-cache group of a hybrid layout caching
/// the same range in the same call): its lists are then copied instead of read and
/// built again. Each event still owns its lists, as vLLM's do. A memo lives for one
/// batch; the lists it keeps are the previous event's, which only a later record
/// continuing that event could extend, and such a record (same group, next range)
/// replaces the memo before it is read again.
///
/// It also carries the batch's spec annotation: with a manager's [`SpecTable`] in
/// force, each `BlockStored` gets its group's `kv_cache_spec_kind` and
/// `kv_cache_spec_sliding_window` as it is built (`spec.rs`).
#[derive(Default)]
pub(crate) struct StoredMemo<'py> {
    last: Option<MemoEntry<'py>>,
    specs: Option<GroupSpecs<'py>>,
}

impl<'py> StoredMemo<'py> {
    /// A batch's memo; `specs`: the annotation its `BlockStored` events get (None:
    /// left un-annotated, as vLLM's pool builds them).
    pub(crate) fn new(specs: Option<GroupSpecs<'py>>) -> Self {
        Self { last: None, specs }
    }

    /// Whether an event of the batch fell outside its annotation table.
    pub(crate) fn missed_specs(&self) -> bool {
        self.specs.as_ref().is_some_and(GroupSpecs::missed)
    }

    /// The `(kind, window)` of group `group`'s events (None: not annotated).
    fn spec(&mut self, group: u32) -> Option<[Bound<'py, PyAny>; 2]> {
        self.specs.as_mut()?.get(group)
    }

    /// Annotates an event the fallback built (`stored`: the builder's class).
    fn annotate_built(
        &mut self,
        event: &Bound<'py, PyAny>,
        stored: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        match self.specs.as_mut() {
            Some(specs) => specs.annotate_built(event, stored),
            None => Ok(()),
        }
    }
}

struct MemoEntry<'py> {
    builder: usize,
    request: Bound<'py, PyAny>,
    range: (u32, u32, u32),
    hash_scale: usize,
    fields: [Bound<'py, PyAny>; 8],
}

/// The fields whose objects are lists, by index (`block_hashes`, `token_ids`,
/// `extra_keys`, `lookahead_token_ids`).
const LIST_FIELD_INDICES: [usize; 4] = [0, 2, 5, 7];

/// `fields` with each list replaced by a copy.
fn copied_fields<'py>(fields: &[Bound<'py, PyAny>; 8]) -> [Bound<'py, PyAny>; 8] {
    let mut out = fields.clone();
    for i in LIST_FIELD_INDICES {
        if let Ok(list) = fields[i].cast_exact::<PyList>() {
            out[i] = list.get_slice(0, list.len()).into_any();
        }
    }
    out
}

/// A stored range on its way to an event: the fields of vLLM's struct (and its
/// `block_size` object), or the struct the pure-Python fallback built.
enum StoredParts<'py> {
    Fields([Bound<'py, PyAny>; 8], Bound<'py, PyAny>),
    Built(Bound<'py, PyAny>),
}

/// Builds vLLM's KV-cache event structs from the core's records, inside the call
/// that recorded them (as vLLM's `BlockPool` does), with the configuration of one
/// pool: the event classes, the medium, the lookahead, the int-hash flag (vLLM's
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, read once when the pool is built) and
/// the pure-Python fallback for requests [`block_stored_fields`] cannot convert.
#[pyclass(name = "EventBuilder", module = "hscache._core", frozen)]
pub struct PyEventBuilder {
    block_stored: Py<PyAny>,
    block_removed: Py<PyAny>,
    all_blocks_cleared: Py<PyAny>,
    medium: Py<PyAny>,
    num_hash_lookahead_tokens: usize,
    int_block_hashes: bool,
    /// `fallback(request, start, end, block_size, group_idx, lookahead, medium)`.
    fallback: Py<PyAny>,
    stored_call: StoredCall,
    removed_positional: bool,
    /// What compact mode compares, per event class (`compact.rs`).
    compact: CompactTemplates,
}

/// Compact mode's view of the classes a builder makes structs of.
struct CompactTemplates {
    /// Whether the class declares its fields (`__struct_fields__`): else its events
    /// never merge.
    stored: bool,
    removed: bool,
    /// Whether the classes keep the list objects they are given (set on the first
    /// struct of each: then a merge extends the lists the builder made, unread).
    stored_keeps_lists: std::sync::OnceLock<bool>,
    removed_keeps_lists: std::sync::OnceLock<bool>,
}

#[pymethods]
impl PyEventBuilder {
    #[new]
    #[pyo3(signature = (block_stored: "type", block_removed: "type", all_blocks_cleared: "type", medium: "str | None", num_hash_lookahead_tokens: "int", int_block_hashes, fallback: "Callable[..., Any]"))]
    fn new(
        block_stored: Bound<'_, PyAny>,
        block_removed: Bound<'_, PyAny>,
        all_blocks_cleared: Bound<'_, PyAny>,
        medium: Bound<'_, PyAny>,
        num_hash_lookahead_tokens: usize,
        int_block_hashes: bool,
        fallback: Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let stored_fields = struct_fields(&block_stored);
        let removed_fields = struct_fields(&block_removed);
        let stored_call = StoredCall::of(&stored_fields);
        if num_hash_lookahead_tokens > 0 && !stored_call.has_lookahead_field() {
            return Err(PyValueError::new_err(format!(
                "num_hash_lookahead_tokens={num_hash_lookahead_tokens}, but this BlockStored \
                 has no lookahead_token_ids field (vLLM before 0.33 has no lookahead hashing)"
            )));
        }
        Ok(Self {
            stored_call,
            removed_positional: has_fields(&removed_fields, &BLOCK_REMOVED_FIELDS, true),
            compact: CompactTemplates {
                stored: !stored_fields.is_empty(),
                removed: !removed_fields.is_empty(),
                stored_keeps_lists: std::sync::OnceLock::new(),
                removed_keeps_lists: std::sync::OnceLock::new(),
            },
            block_stored: block_stored.unbind(),
            block_removed: block_removed.unbind(),
            all_blocks_cleared: all_blocks_cleared.unbind(),
            medium: medium.unbind(),
            num_hash_lookahead_tokens,
            int_block_hashes,
            fallback: fallback.unbind(),
        })
    }

    #[getter]
    fn num_hash_lookahead_tokens(&self) -> usize {
        self.num_hash_lookahead_tokens
    }

    #[getter]
    fn int_block_hashes(&self) -> bool {
        self.int_block_hashes
    }

    #[getter]
    fn medium(&self, py: Python<'_>) -> Py<PyAny> {
        self.medium.clone_ref(py)
    }

    /// vLLM's `BlockStored` for blocks `start_block..end_block` of `request`, as
    /// `BlockPool.cache_full_blocks` emits it for group `group_idx`.
    #[pyo3(signature = (request, start_block: "int", end_block: "int", block_size: "int", group_idx: "int"))]
    fn block_stored<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        start_block: &Bound<'py, PyAny>,
        end_block: &Bound<'py, PyAny>,
        block_size: &Bound<'py, PyAny>,
        group_idx: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fields = index_arg("start_block", start_block).and_then(|start| {
            let end = index_arg("end_block", end_block)?;
            let bs = index_arg("block_size", block_size)?;
            let fields = stored_fields(
                request,
                start,
                end,
                bs,
                self.num_hash_lookahead_tokens,
                self.int_block_hashes,
                1,
                &[],
            )?;
            Ok((fields, block_size))
        });
        self.stored_struct(
            request,
            fields,
            (start_block, end_block, block_size),
            group_idx,
            (1, &[]),
        )
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.block_stored)?;
        visit.call(&self.block_removed)?;
        visit.call(&self.all_blocks_cleared)?;
        visit.call(&self.medium)?;
        visit.call(&self.fallback)
    }
}

impl PyEventBuilder {
    /// The `BlockStored` class this builder makes structs of.
    pub(crate) fn block_stored_class<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.block_stored.bind(py).clone()
    }

    /// Whether this builder can annotate its `BlockStored` events as it builds
    /// them: its class declares both spec fields (vLLM's structs do).
    pub(crate) fn annotates(&self) -> bool {
        self.stored_call.has_spec_fields()
    }

    /// Checks that the `BlockStored` of group 0 for blocks `0..end_block` can be
    /// built: raises exactly where the real event would (the check-before-mutate of
    /// `allocate_slots` with events on). For vLLM's own struct classes, whose
    /// positional construction cannot fail, only the request is read (the token
    /// window, hash list and struct are not made: a 1k-token admission's check costs
    /// a few hundred ns instead of a prompt-wide event); a request only the fallback
    /// can describe, or another struct layout, is built and dropped.
    pub(crate) fn dry_run(
        &self,
        request: &Bound<'_, PyAny>,
        end_block: usize,
        block_size: usize,
    ) -> PyResult<()> {
        let py = request.py();
        let positional = matches!(
            self.stored_call,
            StoredCall::Positional15 | StoredCall::Positional14
        );
        if positional {
            let checked = check_stored_fields(
                request,
                0,
                end_block,
                block_size,
                self.num_hash_lookahead_tokens,
                self.int_block_hashes,
                1,
                &[],
            );
            match checked {
                Ok(_) => return Ok(()),
                Err(e) if !e.is_instance_of::<UnsupportedError>(py) => return Err(e),
                Err(_) => {} // the fallback's event: built below
            }
        }
        let start = 0usize.into_pyobject(py)?.into_any();
        let end = end_block.into_pyobject(py)?.into_any();
        let bs = block_size.into_pyobject(py)?.into_any();
        self.block_stored(request, &start, &end, &bs, &start)
            .map(drop)
    }

    /// The struct for `fields`, or the fallback's event when they are
    /// `UnsupportedError`.
    fn stored_struct<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        fields: PyResult<([Bound<'py, PyAny>; 8], &Bound<'py, PyAny>)>,
        range: (&Bound<'py, PyAny>, &Bound<'py, PyAny>, &Bound<'py, PyAny>),
        group_idx: &Bound<'py, PyAny>,
        layout: (usize, &[u32]),
    ) -> PyResult<Bound<'py, PyAny>> {
        match self.stored_parts(request, fields, range, group_idx, layout)? {
            StoredParts::Fields(fields, block_size) => {
                self.struct_of_fields(fields, &block_size, group_idx, None)
            }
            StoredParts::Built(event) => Ok(event),
        }
    }

    /// `fields` as they are, or the fallback's event when they are
    /// `UnsupportedError`.
    fn stored_parts<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        fields: PyResult<([Bound<'py, PyAny>; 8], &Bound<'py, PyAny>)>,
        range: (&Bound<'py, PyAny>, &Bound<'py, PyAny>, &Bound<'py, PyAny>),
        group_idx: &Bound<'py, PyAny>,
        layout: (usize, &[u32]),
    ) -> PyResult<StoredParts<'py>> {
        let py = request.py();
        match fields {
            Ok((fields, block_size)) => Ok(StoredParts::Fields(fields, block_size.clone())),
            Err(e) if e.is_instance_of::<UnsupportedError>(py) => {
                let (start, end, bs) = range;
                let (hash_scale, skipped) = layout;
                self.fallback
                    .bind(py)
                    .call1((
                        request,
                        start,
                        end,
                        bs,
                        group_idx,
                        self.num_hash_lookahead_tokens,
                        self.medium.bind(py),
                        hash_scale,
                        skipped.to_vec(),
                    ))
                    .map(StoredParts::Built)
            }
            Err(e) => Err(e),
        }
    }

    /// vLLM's `BlockStored` of [`stored_fields`]' fields; `spec`: its
    /// `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` (None: both None, as
    /// vLLM's pool leaves them).
    fn struct_of_fields<'py>(
        &self,
        fields: [Bound<'py, PyAny>; 8],
        block_size: &Bound<'py, PyAny>,
        group_idx: &Bound<'py, PyAny>,
        spec: Option<[Bound<'py, PyAny>; 2]>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = block_size.py();
        let [hashes, parent, token_ids, lora_id, lora_name, extra_keys, session_id, lookahead] =
            fields;
        let medium = self.medium.bind(py).clone();
        let cls = self.block_stored.bind(py);
        if let StoredCall::Positional15 | StoredCall::Positional14 = self.stored_call {
            let none = py.None().into_bound(py);
            let [kind, window] = spec.unwrap_or_else(|| [none.clone(), none.clone()]);
            let mut args = vec![
                hashes,
                parent,
                token_ids,
                block_size.clone(),
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx.clone(),
                kind,
                window,
                none.clone(),
                none,
                session_id,
            ];
            if self.stored_call == StoredCall::Positional15 {
                args.push(lookahead);
            }
            return cls.call1(PyTuple::new(py, args)?);
        }
        let kwargs = PyDict::new(py);
        for (k, v) in [
            ("block_hashes", hashes),
            ("parent_block_hash", parent),
            ("token_ids", token_ids),
            ("block_size", block_size.clone()),
            ("lora_id", lora_id),
            ("medium", medium),
            ("lora_name", lora_name),
            ("extra_keys", extra_keys),
            ("group_idx", group_idx.clone()),
            ("session_id", session_id),
        ] {
            kwargs.set_item(k, v)?;
        }
        if self.stored_call.has_lookahead_field() {
            kwargs.set_item("lookahead_token_ids", lookahead)?;
        }
        if let Some([kind, window]) = spec {
            // Only with a table in force, which needs the fields (`annotates`).
            kwargs.set_item("kv_cache_spec_kind", kind)?;
            kwargs.set_item("kv_cache_spec_sliding_window", window)?;
        }
        cls.call((), Some(&kwargs))
    }

    /// A `BlockStored` for blocks `range = (start, end, block_size)` of `request`.
    fn stored_event<'py>(
        &self,
        py: Python<'py>,
        request: Option<&Bound<'py, PyAny>>,
        range: (u32, u32, u32),
        group_id: u32,
        layout: (usize, &[u32]),
        memo: &mut StoredMemo<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let group = group_id.into_pyobject(py)?.into_any();
        match self.stored_event_parts(py, request, range, &group, layout, memo)? {
            StoredParts::Fields(fields, block_size) => {
                let spec = memo.spec(group_id);
                self.struct_of_fields(fields, &block_size, &group, spec)
            }
            StoredParts::Built(event) => {
                memo.annotate_built(&event, self.block_stored.bind(py))?;
                Ok(event)
            }
        }
    }

    /// [`Self::stored_event`]'s fields, before they become a struct (or the
    /// fallback's struct); copied from `memo` when it holds this range's.
    fn stored_event_parts<'py>(
        &self,
        py: Python<'py>,
        request: Option<&Bound<'py, PyAny>>,
        range: (u32, u32, u32),
        group: &Bound<'py, PyAny>,
        layout: (usize, &[u32]),
        memo: &mut StoredMemo<'py>,
    ) -> PyResult<StoredParts<'py>> {
        let request = request.ok_or_else(|| {
            PyRuntimeError::new_err("a BlockStored record needs the request of its call")
        })?;
        let (start_block, end_block, block_size) = range;
        let builder = std::ptr::from_ref(self) as usize;
        // Only ranges without left-out blocks are remembered, or matched.
        let whole = layout.1.is_empty();
        let last = memo.last.take().filter(|e| {
            whole
                && e.builder == builder
                && e.request.is(request)
                && e.range == range
                && e.hash_scale == layout.0
        });
        let fields = match last {
            Some(entry) => {
                let copy = copied_fields(&entry.fields);
                memo.last = Some(entry);
                Ok(copy)
            }
            None => {
                // u32 -> usize is lossless on the 32- and 64-bit targets PyO3 supports.
                let fields = stored_fields(
                    request,
                    start_block as usize,
                    end_block as usize,
                    block_size as usize,
                    self.num_hash_lookahead_tokens,
                    self.int_block_hashes,
                    layout.0,
                    layout.1,
                );
                if let (Ok(f), true) = (&fields, whole) {
                    memo.last = Some(MemoEntry {
                        builder,
                        request: request.clone(),
                        range,
                        hash_scale: layout.0,
                        fields: f.clone(),
                    });
                }
                fields
            }
        };
        let start = start_block.into_pyobject(py)?.into_any();
        let end = end_block.into_pyobject(py)?.into_any();
        let bs = block_size.into_pyobject(py)?.into_any();
        self.stored_parts(
            request,
            fields.map(|f| (f, &bs)),
            (&start, &end, &bs),
            group,
            layout,
        )
    }

    /// The hash a `BlockRemoved` states for `key` (converted as vLLM's
    /// `maybe_convert_block_hash` does).
    fn removed_hash<'py>(
        &self,
        py: Python<'py>,
        key: &crate::types::BlockHashWithGroupId,
    ) -> PyResult<Bound<'py, PyAny>> {
        let hash = PyBytes::new(py, key.hash.as_bytes()).into_any();
        convert_hash(hash, self.int_block_hashes)
    }

    /// vLLM's `BlockRemoved` of `hashes` in group `group_id`.
    fn removed_event<'py>(
        &self,
        hashes: Bound<'py, PyList>,
        group_id: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = hashes.py();
        let medium = self.medium.bind(py);
        let cls = self.block_removed.bind(py);
        if self.removed_positional {
            cls.call1((hashes, medium, group_id))
        } else {
            let kwargs = PyDict::new(py);
            kwargs.set_item("block_hashes", hashes)?;
            kwargs.set_item("medium", medium)?;
            kwargs.set_item("group_idx", group_id)?;
            cls.call((), Some(&kwargs))
        }
    }

    /// vLLM's event for one core record; `request` is the recording call's (a
    /// `BlockStored` record without one is a `RuntimeError`).
    pub(crate) fn build<'py>(
        &self,
        py: Python<'py>,
        event: KVCacheEvent,
        request: Option<&Bound<'py, PyAny>>,
        memo: &mut StoredMemo<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match event {
            KVCacheEvent::BlockStored {
                group_id,
                start_block,
                end_block,
                block_size,
                hash_scale,
                skipped,
            } => {
                let skipped = skipped.as_deref().unwrap_or(&[]);
                self.stored_event(
                    py,
                    request,
                    (start_block, end_block, block_size),
                    group_id,
                    (hash_scale as usize, skipped),
                    memo,
                )
            }
            KVCacheEvent::PartialBlockStored {
                group_id,
                num_tokens,
                hash_block_size,
            } => {
                // The partial entry's event covers its last hash block (vLLM's
                // `cache_partial_block`): one hash, its parent, those tokens.
                let n = num_tokens / hash_block_size.max(1);
                self.stored_event(
                    py,
                    request,
                    (n.saturating_sub(1), n, hash_block_size),
                    group_id,
                    (1, &[]),
                    memo,
                )
            }
            KVCacheEvent::BlockRemoved { key } => {
                let hashes = PyList::new(py, [self.removed_hash(py, &key)?])?;
                self.removed_event(hashes, key.group_id)
            }
            KVCacheEvent::AllBlocksCleared => self.all_blocks_cleared.bind(py).call0(),
            // The caller picks the host pool's builder; this one builds it as its own.
            KVCacheEvent::Host { event, .. } => self.build(py, *event, request, memo),
        }
    }
}

/// The core's event records as tuples (a bare core without a builder):
/// `("stored", group, start, end, block_size)`, `("partial", group, num_tokens)`,
/// `("removed", hash bytes, group)`, `("cleared",)`; a host pool's record as
/// `("host", record, publication id or None)`.
pub(crate) fn records_to_py(
    py: Python<'_>,
    events: Vec<KVCacheEvent>,
) -> PyResult<Bound<'_, PyList>> {
    let list = PyList::empty(py);
    for e in events {
        let item = match e {
            KVCacheEvent::BlockStored {
                group_id,
                start_block,
                end_block,
                block_size,
                ..
            } => ("stored", group_id, start_block, end_block, block_size)
                .into_pyobject(py)?
                .into_any(),
            KVCacheEvent::PartialBlockStored {
                group_id,
                num_tokens,
                ..
            } => ("partial", group_id, num_tokens)
                .into_pyobject(py)?
                .into_any(),
            KVCacheEvent::BlockRemoved { key } => (
                "removed",
                PyBytes::new(py, key.hash.as_bytes()),
                key.group_id,
            )
                .into_pyobject(py)?
                .into_any(),
            KVCacheEvent::AllBlocksCleared => PyTuple::new(py, ["cleared"])?.into_any(),
            KVCacheEvent::Host { event, publication } => {
                let inner = records_to_py(py, vec![*event])?.get_item(0)?;
                ("host", inner, publication).into_pyobject(py)?.into_any()
            }
        };
        list.append(item)?;
    }
    Ok(list)
}
