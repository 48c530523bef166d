//! Block hashing for Python: `RequestBlockHasher`, `hash_block_tokens`, `hash_object`,
//! `serialize`, `blake3_digest`, `blake3_block` (wraps `src/hash.rs`,
//! `src/hash/request.rs`, `src/extra_keys.rs`).
//!
//! It owns pickle's identity-exact conversion of Python objects to core values: one
//! recursion whose type cases are read together.
//!
//! Conversion only. Python objects become core values *with their identity*: every
//! `str`, `bytes` and `tuple` carries its object address as [`ObjId`], and every object
//! is kept alive until the call returns, so addresses are unique and pickle's
//! identity-based memo is reproduced exactly (two equal but distinct strings are written
//! twice, one object twice is a memo reference; a value that *is* an interned tag such
//! as `"mm"` matches the tag, as in CPython). Types whose bytes the core cannot
//! reproduce (subclasses, `bool`, `float`, ints beyond `i128`, strings with lone
//! surrogates, nesting deeper than 32) raise `UnsupportedError`; the Python adapter
//! then falls back to vLLM's own function for that call.
//!
//! Every hashing call runs inside `crate::shield::catch`: a panic is `InternalError`.
//! The hashers hold no mutable state (each call builds its core hasher), so there is
//! nothing to poison and the next call starts afresh.

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PySequence, PyString, PyTuple};

use super::errors::{BlockHashError, InvalidArgumentError, UnsupportedError};
use crate::extra_keys::{
    ExtraKeysForm, MmFeature, RequestExtraKeys, TagIds, TAG_CACHE_SALT, TAG_LORA, TAG_MM,
    TAG_PROMPT_EMBEDS,
};
use crate::hash::request::{RequestBlockHasher, RequestHashInput};
use crate::hash::value::{Atom, ObjId, ValueSeq};
use crate::hash::{blake3_block_hash, BlockHasher, HashAlgo, Serialization};
use crate::types::BlockHash;

/// Deepest tuple nesting converted (vLLM's keys nest 3 deep).
const MAX_DEPTH: usize = 32;

fn obj_id(obj: &Bound<'_, PyAny>) -> ObjId {
    ObjId::new(obj.as_ptr() as usize as u64)
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn algo_from_name(name: &str) -> PyResult<HashAlgo> {
    HashAlgo::from_name(name).map_err(|_| {
        InvalidArgumentError::new_err(format!(
            "unknown hash algorithm {name:?}: expected one of sha256, sha256_cbor, xxhash, \
             xxhash_cbor, blake3"
        ))
    })
}

fn unsupported(what: &str, obj: &Bound<'_, PyAny>) -> PyErr {
    UnsupportedError::new_err(format!(
        "{what}: cannot reproduce the serialization of a {} natively",
        type_name(obj)
    ))
}

/// A scalar object held for the call: exact `str` / `bytes` / `int` / `None`.
fn is_atom(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_none()
        || obj.is_exact_instance_of::<PyString>()
        || obj.is_exact_instance_of::<PyBytes>()
        || obj.is_exact_instance_of::<PyInt>()
}

/// An [`Atom`] borrowing from `obj` (which the caller keeps alive); `UnsupportedError`
/// for anything but exact `None` / `int` (within `i128`) / `str` (UTF-8) / `bytes`.
fn atom_of<'o>(what: &str, obj: &'o Bound<'_, PyAny>) -> PyResult<Atom<'o>> {
    if obj.is_none() {
        return Ok(Atom::None);
    }
    if obj.is_exact_instance_of::<PyInt>() {
        return obj
            .extract::<i128>()
            .map(Atom::Int)
            .map_err(|_| UnsupportedError::new_err(format!("{what}: int beyond 128 bits")));
    }
    if let Ok(s) = obj.cast_exact::<PyString>() {
        let text = s
            .to_str()
            .map_err(|_| UnsupportedError::new_err(format!("{what}: str is not valid UTF-8")))?;
        return Ok(Atom::Str(text, obj_id(obj)));
    }
    if let Ok(b) = obj.cast_exact::<PyBytes>() {
        return Ok(Atom::Bytes(b.as_bytes(), obj_id(obj)));
    }
    Err(unsupported(what, obj))
}

/// Pass 1 of a value conversion: the tree's shape, with scalars held in an arena.
enum Node {
    Tuple { len: usize, id: ObjId },
    Leaf(usize),
}

fn flatten<'py>(
    obj: &Bound<'py, PyAny>,
    depth: usize,
    nodes: &mut Vec<Node>,
    arena: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<()> {
    if let Ok(t) = obj.cast_exact::<PyTuple>() {
        if depth >= MAX_DEPTH {
            return Err(UnsupportedError::new_err(
                "value nests deeper than 32 tuples",
            ));
        }
        nodes.push(Node::Tuple {
            len: t.len(),
            id: obj_id(obj),
        });
        for item in t.iter() {
            flatten(&item, depth + 1, nodes, arena)?;
        }
        return Ok(());
    }
    if !is_atom(obj) {
        return Err(unsupported("value", obj));
    }
    nodes.push(Node::Leaf(arena.len()));
    arena.push(obj.clone());
    Ok(())
}

/// Pass 2: the core value, borrowing strings and bytes from the arena.
fn build<'a>(nodes: &[Node], arena: &'a [Bound<'_, PyAny>]) -> PyResult<ValueSeq<'a>> {
    let mut v = ValueSeq::new();
    // Open tuples: (handle, items still to push).
    let mut open: Vec<(usize, usize)> = Vec::new();
    for node in nodes {
        match node {
            Node::Tuple { len, id } => {
                let h = v.open_tuple(*len, *id);
                if *len > 0 {
                    open.push((h, *len));
                    continue;
                }
                v.close_tuple(h);
            }
            Node::Leaf(i) => v.push_atom(atom_of("value", &arena[*i])?),
        }
        // A value is complete: count it, and close every tuple it completes.
        while let Some((h, remaining)) = open.last_mut() {
            *remaining -= 1;
            if *remaining > 0 {
                break;
            }
            let h = *h;
            open.pop();
            v.close_tuple(h);
        }
    }
    Ok(v)
}

/// Holds the objects of a converted value; [`ValueHolder::value`] borrows from it.
struct ValueHolder<'py> {
    nodes: Vec<Node>,
    arena: Vec<Bound<'py, PyAny>>,
}

impl<'py> ValueHolder<'py> {
    fn new(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let mut h = Self {
            nodes: Vec::new(),
            arena: Vec::new(),
        };
        flatten(obj, 0, &mut h.nodes, &mut h.arena)?;
        Ok(h)
    }

    fn value(&self) -> PyResult<ValueSeq<'_>> {
        build(&self.nodes, &self.arena)
    }
}

/// Token ids as `u32`. A value outside `0..2**32` (vLLM's tests use `-1` placeholders),
/// a non-`int` (`bool`, numpy ints) or a container that is not a sequence (a numpy
/// array) is an `UnsupportedError`: the Python layer then hashes that call with vLLM's
/// own hasher, which accepts any int in any iterable.
fn read_tokens(
    seq: &Bound<'_, PyAny>,
    start: usize,
    count: usize,
    out: &mut Vec<u32>,
) -> PyResult<()> {
    out.reserve(count);
    let check = |i: usize, item: &Bound<'_, PyAny>| -> PyResult<u32> {
        if !item.is_exact_instance_of::<PyInt>() {
            return Err(unsupported(&format!("token id at index {i}"), item));
        }
        item.extract::<u32>().map_err(|_| {
            UnsupportedError::new_err(format!(
                "token id {} at index {i} is outside 0..2**32",
                item.repr()
                    .map(|r| r.to_string())
                    .unwrap_or_else(|_| "?".into())
            ))
        })
    };
    if let Ok(list) = seq.cast::<PyList>() {
        return read_list_tokens(list, start, count, out, check);
    } else if let Ok(tuple) = seq.cast::<PyTuple>() {
        for i in start..start + count {
            let item = tuple.get_item(i)?;
            out.push(check(i, &item)?);
        }
    } else {
        // Another container (a numpy array, ...): vLLM hashes `tuple(token_ids)` of
        // anything iterable, the core only lists, tuples and sequences of ints; the
        // Python adapter hashes the call with vLLM's function.
        let s = seq
            .cast::<PySequence>()
            .map_err(|_| unsupported("token ids", seq))?;
        for i in start..start + count {
            let item = s.get_item(i)?;
            out.push(check(i, &item)?);
        }
    }
    Ok(())
}

/// The hot loop of [`read_tokens`] for a `list` (vLLM's `request._all_token_ids`):
/// borrowed items and `PyLong_AsUnsignedLong`, no reference counting, about 3x faster
/// than `get_item` + `extract`. Any item that is not an exact `int` in `0..2**32` goes
/// through `check` for its precise error.
fn read_list_tokens(
    list: &Bound<'_, PyList>,
    start: usize,
    count: usize,
    out: &mut Vec<u32>,
    check: impl Fn(usize, &Bound<'_, PyAny>) -> PyResult<u32>,
) -> PyResult<()> {
    let py = list.py();
    let end = start
        .checked_add(count)
        .filter(|&e| e <= list.len())
        .ok_or_else(|| InvalidArgumentError::new_err("token ids end before the blocks do"))?;
    let long_type = py.get_type::<PyInt>();
    for i in start..end {
        // SAFETY: `list` is a list with more than `i` items (checked above; the length
        // cannot change: no Python code runs in this loop) and the GIL is held, so the
        // borrowed item is alive while it is read below.
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
        // SAFETY: `item` is a valid object pointer (non-null, checked first).
        let exact_int = !item.is_null() && unsafe { ffi::Py_TYPE(item) } == long_type.as_type_ptr();
        if exact_int {
            // SAFETY: `item` is an exact `int`; `PyLong_AsUnsignedLong` runs no Python code.
            let v = unsafe { ffi::PyLong_AsUnsignedLong(item) };
            if let Ok(t) = u32::try_from(v) {
                out.push(t);
                continue;
            }
            // Out of range, or the error marker: drop any error, `check` reports it.
            let _ = PyErr::take(py);
        }
        let item = list.get_item(i)?;
        out.push(check(i, &item)?);
    }
    Ok(())
}

fn hash_bytes_of<'o>(what: &str, obj: &'o Bound<'_, PyAny>) -> PyResult<&'o [u8]> {
    obj.cast::<PyBytes>()
        .map(pyo3::types::PyBytesMethods::as_bytes)
        .map_err(|_| {
            BlockHashError::new_err(format!("{what} must be bytes, got {}", type_name(obj)))
        })
}

fn hash_to_py<'py>(py: Python<'py>, h: &BlockHash) -> Bound<'py, PyBytes> {
    PyBytes::new(py, h.as_bytes())
}

/// A non-negative Python int as `usize`, or a clear `InvalidArgumentError`.
fn position(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    obj.extract::<i64>()
        .ok()
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| {
            InvalidArgumentError::new_err(format!(
                "{what} must be a non-negative int, got {}",
                obj.repr()
                    .map(|r| r.to_string())
                    .unwrap_or_else(|_| type_name(obj))
            ))
        })
}

/// `(offset, length)` of a vLLM `MultiModalFeatureSpec` (its `mm_position`).
fn mm_position<'py>(i: usize, feature: &Bound<'py, PyAny>) -> PyResult<(usize, usize)> {
    let py = feature.py();
    let pos = feature.getattr(intern!(py, "mm_position")).map_err(|_| {
        InvalidArgumentError::new_err(format!(
            "mm_features[{i}] has no mm_position (got a {})",
            type_name(feature)
        ))
    })?;
    let field = |name: &Bound<'py, PyString>| -> PyResult<usize> {
        let value = pos.getattr(name).map_err(|_| {
            InvalidArgumentError::new_err(format!("mm_features[{i}].mm_position has no {name}"))
        })?;
        position(&format!("mm_features[{i}].mm_position.{name}"), &value)
    };
    let offset = field(intern!(py, "offset"))?;
    let length = field(intern!(py, "length"))?;
    Ok((offset, length))
}

/// The multimodal features a call needs, read from vLLM's `request.mm_features`:
/// none when the last item ends at or before `start` (vLLM then never scans them).
/// Also read by `events.rs`, which keeps the identifier objects for its event keys.
pub(crate) struct MmHolder<'py> {
    /// `(mm_position.offset, mm_position.length)` of each item, in list order.
    pub(crate) positions: Vec<(usize, usize)>,
    /// Each item's `identifier` object, in list order.
    pub(crate) identifiers: Vec<Bound<'py, PyAny>>,
}

impl<'py> MmHolder<'py> {
    pub(crate) fn read(features: Option<&Bound<'py, PyAny>>, start: usize) -> PyResult<Self> {
        let mut h = Self {
            positions: Vec::new(),
            identifiers: Vec::new(),
        };
        let Some(features) = features.filter(|f| !f.is_none()) else {
            return Ok(h);
        };
        let seq = features.cast::<PySequence>().map_err(|_| {
            InvalidArgumentError::new_err(format!(
                "mm_features must be a sequence, got {}",
                type_name(features)
            ))
        })?;
        let n = seq.len()?;
        if n == 0 {
            return Ok(h);
        }
        let (lo, ll) = mm_position(n - 1, &seq.get_item(n - 1)?)?;
        if lo.saturating_add(ll) <= start {
            return Ok(h);
        }
        let py = features.py();
        h.positions.reserve(n);
        h.identifiers.reserve(n);
        for i in 0..n {
            let f = seq.get_item(i)?;
            h.positions.push(mm_position(i, &f)?);
            h.identifiers
                .push(f.getattr(intern!(py, "identifier")).map_err(|_| {
                    InvalidArgumentError::new_err(format!("mm_features[{i}] has no identifier"))
                })?);
        }
        Ok(h)
    }

    fn features(&self) -> PyResult<Vec<MmFeature<'_>>> {
        self.positions
            .iter()
            .zip(&self.identifiers)
            .enumerate()
            .map(|(i, (&(offset, length), ident))| {
                let id = atom_of(&format!("mm_features[{i}].identifier"), ident)?;
                Ok(MmFeature::new(offset, length, id)?)
            })
            .collect()
    }
}

/// hscache's `get_request_block_hasher`: the new full-block hashes of a request.
///
/// Immutable (`frozen`): vLLM calls one hasher from the engine-core thread and from the
/// input thread that builds requests, so every call gets its own buffers.
#[pyclass(name = "RequestBlockHasher", module = "hscache._core", frozen)]
pub struct PyRequestBlockHasher {
    algo: HashAlgo,
    hash_block_size: usize,
    num_lookahead_tokens: usize,
    tags: TagIds,
    /// Tagged (vLLM 0.31+) or untagged (0.30) keys: the version profile's
    /// `extra_keys_form`.
    form: ExtraKeysForm,
    /// The interned tag strings, held so that their addresses stay theirs.
    _tags: Vec<Py<PyString>>,
}

impl PyRequestBlockHasher {
    fn core(&self) -> PyResult<RequestBlockHasher> {
        let mut core =
            RequestBlockHasher::new(self.algo, self.hash_block_size, self.num_lookahead_tokens)?;
        core.set_tag_ids(self.tags);
        core.set_extra_keys_form(self.form);
        Ok(core)
    }
}

#[pymethods]
impl PyRequestBlockHasher {
    #[new]
    #[pyo3(signature = (algo, hash_block_size: "int", num_hash_lookahead_tokens: "int" = 0, *, extra_keys = "tagged"))]
    fn new(
        py: Python<'_>,
        algo: &str,
        hash_block_size: super::convert::Int,
        #[pyo3(from_py_with = super::convert::int64)] num_hash_lookahead_tokens: i64,
        extra_keys: &str,
    ) -> PyResult<Self> {
        let hash_block_size = hash_block_size.0;
        let algo = algo_from_name(algo)?;
        let form = ExtraKeysForm::from_name(extra_keys)?;
        let bs = usize::try_from(hash_block_size)
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                InvalidArgumentError::new_err(format!(
                    "hash_block_size must be positive, got {hash_block_size}"
                ))
            })?;
        let la = super::errors::count("num_hash_lookahead_tokens", num_hash_lookahead_tokens)?;
        let tags: Vec<Py<PyString>> = [TAG_LORA, TAG_MM, TAG_CACHE_SALT, TAG_PROMPT_EMBEDS]
            .iter()
            .map(|t| PyString::intern(py, t).unbind())
            .collect();
        let id = |i: usize| ObjId::new(tags[i].as_ptr() as usize as u64);
        Ok(Self {
            algo,
            hash_block_size: bs,
            num_lookahead_tokens: la,
            form,
            tags: TagIds {
                lora: id(0),
                mm: id(1),
                cache_salt: id(2),
                prompt_embeds: id(3),
            },
            _tags: tags,
        })
    }

    /// The algorithm's name.
    #[getter]
    fn algo(&self) -> &'static str {
        self.algo.name()
    }

    /// Tokens per hashed block.
    #[getter]
    fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// Lookahead tokens each hash also covers.
    #[getter]
    fn num_hash_lookahead_tokens(&self) -> usize {
        self.num_lookahead_tokens
    }

    /// `"tagged"` or `"untagged"` (vLLM 0.30's bare keys and last-item scan).
    #[getter]
    fn extra_keys(&self) -> &'static str {
        self.form.name()
    }

    /// The hashes of the new full blocks of a request (vLLM appends them to
    /// `request.block_hashes`), computed from its fields.
    #[pyo3(signature = (block_hashes: "list[bytes]", token_ids: "Sequence[int]", none_hash: "bytes", mm_features: "Sequence[Any] | None" = None, lora: "tuple[Any, Any] | None" = None, cache_salt: "Any" = None, prompt_embeds_digests: "Iterable[bytes] | None" = None) -> "list[bytes]")]
    #[allow(clippy::too_many_arguments)]
    fn hash_new_blocks<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
        none_hash: &Bound<'py, PyAny>,
        mm_features: Option<&Bound<'py, PyAny>>,
        lora: Option<&Bound<'py, PyAny>>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        prompt_embeds_digests: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        crate::shield::catch("hash_new_blocks", || {
            crate::fault::point("hasher.hash_new_blocks");
            let hashes = hash_list(block_hashes)?;
            let num_hashed = hashes.len();
            let mut core = self.core()?;
            let bs = self.hash_block_size;
            let start = num_hashed.checked_mul(bs).ok_or_else(|| {
                InvalidArgumentError::new_err("block_hashes is too long for hash_block_size")
            })?;
            let num_tokens = token_ids.len()?;
            let n = core.num_new_blocks(num_tokens.saturating_sub(start));
            if n == 0 {
                return Ok(PyList::empty(py));
            }
            let last = if num_hashed > 0 {
                Some(hashes.get_item(num_hashed - 1)?)
            } else {
                None
            };
            let parent = match &last {
                Some(p) => Some(hash_bytes_of("block_hashes[-1]", p)?),
                None => None,
            };
            let none_hash = hash_bytes_of("NONE_HASH", none_hash)?;

            let mut tokens = Vec::new();
            read_tokens(
                token_ids,
                start,
                n * bs + self.num_lookahead_tokens,
                &mut tokens,
            )?;

            let lora_pair = lora_pair(lora)?;
            let lora_atoms = match &lora_pair {
                Some((name, path)) => {
                    Some((atom_of("lora_name", name)?, atom_of("lora_path", path)?))
                }
                None => None,
            };
            let salt = match cache_salt {
                Some(s) => Some(atom_of("cache_salt", s)?),
                None => None,
            };
            let digests = embeds_digests(prompt_embeds_digests, n)?;
            let mm = MmHolder::read(mm_features, start)?;
            let features = mm.features()?;

            let input = RequestHashInput {
                num_hashed_blocks: num_hashed,
                parent,
                none_hash,
                tokens: &tokens,
                keys: RequestExtraKeys {
                    lora: lora_atoms,
                    mm_features: &features,
                    cache_salt: salt,
                },
                prompt_embeds_digests: digests.as_deref(),
            };
            let mut out = Vec::with_capacity(n);
            core.hash_new_blocks(&input, &mut out)?;
            PyList::new(py, out.iter().map(|h| hash_to_py(py, h)))
        })
    }
}

/// `hash_new_blocks`'s `block_hashes`, which must be a list.
fn hash_list<'a, 'py>(block_hashes: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PyList>> {
    block_hashes.cast::<PyList>().map_err(|_| {
        BlockHashError::new_err(format!(
            "block_hashes must be a list of bytes, got {}",
            type_name(block_hashes)
        ))
    })
}

/// `hash_new_blocks`'s `lora`: None, or a `(lora_name, lora_path)` tuple.
fn lora_pair<'py>(
    lora: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    match lora.filter(|l| !l.is_none()) {
        None => Ok(None),
        Some(l) => {
            let t = l
                .cast::<PyTuple>()
                .ok()
                .filter(|t| t.len() == 2)
                .ok_or_else(|| {
                    InvalidArgumentError::new_err("lora must be a (lora_name, lora_path) tuple")
                })?;
            Ok(Some((t.get_item(0)?, t.get_item(1)?)))
        }
    }
}

/// `hash_new_blocks`'s `prompt_embeds_digests` (None: none), room made for `n`.
fn embeds_digests(d: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Option<Vec<[u8; 32]>>> {
    match d.filter(|d| !d.is_none()) {
        None => Ok(None),
        Some(d) => {
            let mut v: Vec<[u8; 32]> = Vec::with_capacity(n);
            for item in d.try_iter()? {
                let item = item?;
                let arr = item
                    .cast::<PyBytes>()
                    .ok()
                    .and_then(|b| <[u8; 32]>::try_from(b.as_bytes()).ok())
                    .ok_or_else(|| {
                        InvalidArgumentError::new_err(
                            "prompt_embeds_digests must be 32-byte SHA-256 digests",
                        )
                    })?;
                v.push(arr);
            }
            Ok(Some(v))
        }
    }
}

/// vLLM's `hash_block_tokens` with the parent resolved by the caller
/// (`parent_block_hash or NONE_HASH`).
#[pyfunction]
#[pyo3(signature = (algo, parent: "bytes", token_ids: "Sequence[int]", extra_keys: "Any" = None))]
pub fn hash_block_tokens<'py>(
    py: Python<'py>,
    algo: &str,
    parent: &Bound<'py, PyAny>,
    token_ids: &Bound<'py, PyAny>,
    extra_keys: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    crate::shield::catch("hash_block_tokens", || {
        let algo = algo_from_name(algo)?;
        let parent = hash_bytes_of("parent_block_hash", parent)?;
        let mut tokens = Vec::new();
        read_tokens(token_ids, 0, token_ids.len()?, &mut tokens)?;
        let none = py.None().into_bound(py);
        let extras = ValueHolder::new(extra_keys.unwrap_or(&none))?;
        let extras_value = extras.value()?;
        let mut h = BlockHasher::new(algo);
        let digest = h.hash_block(parent, &tokens, &extras_value.root());
        Ok(hash_to_py(py, &digest))
    })
}

/// The hash function `algo` applied to `obj` (vLLM's `hash_fn(obj)`; for `blake3` a
/// block-shaped `(bytes, tuple[int], extras)` gets the block scheme).
#[pyfunction]
pub fn hash_object<'py>(
    py: Python<'py>,
    algo: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    crate::shield::catch("hash_object", || {
        let algo = algo_from_name(algo)?;
        let holder = ValueHolder::new(obj)?;
        let value = holder.value()?;
        let digest = BlockHasher::new(algo).hash_value(&value)?;
        Ok(hash_to_py(py, &digest))
    })
}

/// `obj` serialized as `pickle.dumps(obj, protocol=5)` (`"pickle"`) or
/// `cbor2.dumps(obj, canonical=True)` (`"cbor"`) by hscache's own encoders.
#[pyfunction]
pub fn serialize<'py>(
    py: Python<'py>,
    format: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    crate::shield::catch("serialize", || {
        let format = match format {
            "pickle" => Serialization::Pickle,
            "cbor" => Serialization::Cbor,
            other => {
                return Err(InvalidArgumentError::new_err(format!(
                    "unknown format {other:?}: expected \"pickle\" or \"cbor\""
                )))
            }
        };
        let holder = ValueHolder::new(obj)?;
        let value = holder.value()?;
        let mut h = BlockHasher::new(HashAlgo::Sha256);
        let bytes = h.serialize(format, &value)?;
        Ok(PyBytes::new(py, bytes))
    })
}

/// BLAKE3 of `data` (32 bytes).
#[pyfunction]
pub fn blake3_digest<'py>(py: Python<'py>, data: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, blake3::hash(data).as_bytes())
}

/// hscache's BLAKE3 block hash with the extra keys given as canonical CBOR bytes
/// (`None` for `extra_keys=None`): the fallback of `hscache.vllm.block_hasher.blake3`
/// for extra keys the core cannot convert.
#[pyfunction]
#[pyo3(signature = (parent: "bytes", token_ids: "Sequence[int]", extras_cbor = None))]
pub fn blake3_block<'py>(
    py: Python<'py>,
    parent: &Bound<'py, PyAny>,
    token_ids: &Bound<'py, PyAny>,
    extras_cbor: Option<&[u8]>,
) -> PyResult<Bound<'py, PyBytes>> {
    crate::shield::catch("blake3_block", || {
        let parent = hash_bytes_of("parent_block_hash", parent)?;
        let mut tokens = Vec::new();
        read_tokens(token_ids, 0, token_ids.len()?, &mut tokens)?;
        let h = blake3_block_hash(parent, &tokens, extras_cbor, &mut Vec::new());
        Ok(hash_to_py(py, &h))
    })
}
