//! The values a block hash covers, and the encoder interface both serializers implement.
//!
//! Mirrors the Python objects vLLM 0.33 hands to its hash function
//! (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`):
//! `(parent_hash: bytes, tuple(token_ids), extra_keys: tuple | None)`, where extra keys
//! are tuples of `str`, `bytes`, `int` and `None`, possibly nested.
//!
//! Key properties:
//! - **Identity is data.** CPython's pickle memoizes `str`, `bytes` and `tuple` objects by
//!   identity, so two equal strings pickle differently depending on whether they are one
//!   object. Every such value carries an [`ObjId`]: the Python bindings use the object's
//!   address (all objects are kept alive for the whole call, so addresses are unique),
//!   pure-Rust callers use [`ObjId::UNIQUE`] ("occurs once") or ids of their own.
//!   CBOR and BLAKE3 ignore identities.
//! - **Flat trees.** A generic value ([`ValueSeq`]) is a pre-order list of items, each
//!   tuple recording the size of its subtree, so encoders walk it without recursion and
//!   a pickle memo hit skips a whole subtree.

use crate::error::{Error, Result};

/// The identity of a Python object inside one serialized value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ObjId(u64);

impl ObjId {
    /// An object that occurs once: memoized by pickle, never looked up again.
    pub const UNIQUE: ObjId = ObjId(0);

    /// An identity shared by every occurrence that carries the same `raw` value
    /// (0 means [`ObjId::UNIQUE`]).
    #[inline]
    pub const fn new(raw: u64) -> Self {
        ObjId(raw)
    }

    /// Whether this is [`ObjId::UNIQUE`].
    #[inline]
    pub const fn is_unique(self) -> bool {
        self.0 == 0
    }
}

/// A scalar inside extra keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Atom<'a> {
    /// Python `None`.
    None,
    /// A Python `int` (both serializers cover the whole `i128` range).
    Int(i128),
    /// A Python `str` and its identity.
    Str(&'a str, ObjId),
    /// A Python `bytes` and its identity.
    Bytes(&'a [u8], ObjId),
}

impl Atom<'_> {
    /// Python truthiness (`bool(x)`), which vLLM applies to `cache_salt`.
    pub fn is_truthy(&self) -> bool {
        match self {
            Atom::None => false,
            Atom::Int(v) => *v != 0,
            Atom::Str(s, _) => !s.is_empty(),
            Atom::Bytes(b, _) => !b.is_empty(),
        }
    }
}

/// The serializer interface: one method per Python type that occurs in a block key.
///
/// `begin_tuple` returns `false` when it wrote the whole tuple itself (always for the
/// empty tuple; a pickle memo reference): the caller then writes no items and does not
/// call `end_tuple`.
pub trait Encoder {
    /// `None`.
    fn none(&mut self);
    /// Any integer of the `i128` range.
    fn int(&mut self, v: i128);
    /// A token id: the hot path, same bytes as `int(v as i128)`.
    fn token(&mut self, v: u32) {
        self.int(i128::from(v));
    }
    /// A `str`.
    fn str(&mut self, s: &str, id: ObjId);
    /// A `bytes`.
    fn bytes(&mut self, b: &[u8], id: ObjId);
    /// Opens a tuple of `len` items (see the trait doc for the return value).
    fn begin_tuple(&mut self, len: usize, id: ObjId) -> bool;
    /// Closes a tuple whose `begin_tuple` returned `true`, after its `len` items.
    fn end_tuple(&mut self, len: usize, id: ObjId);

    /// A scalar.
    fn atom(&mut self, a: &Atom<'_>) {
        match *a {
            Atom::None => self.none(),
            Atom::Int(v) => self.int(v),
            Atom::Str(s, id) => self.str(s, id),
            Atom::Bytes(b, id) => self.bytes(b, id),
        }
    }

    /// `tuple(tokens)`: a fresh tuple of token ids.
    fn token_tuple(&mut self, tokens: &[u32]) {
        if self.begin_tuple(tokens.len(), ObjId::UNIQUE) {
            for &t in tokens {
                self.token(t);
            }
            self.end_tuple(tokens.len(), ObjId::UNIQUE);
        }
    }
}

/// Something that writes itself through an [`Encoder`].
pub trait Encode {
    /// Writes `self`.
    fn encode<E: Encoder>(&self, e: &mut E);
}

impl Encode for Atom<'_> {
    fn encode<E: Encoder>(&self, e: &mut E) {
        e.atom(self);
    }
}

/// One item of a [`ValueSeq`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Item<'a> {
    /// A scalar.
    Atom(Atom<'a>),
    /// A tuple of `len` items; `span` counts the [`Item`]s of its subtree, itself excluded.
    Tuple { len: usize, span: usize, id: ObjId },
}

/// A generic value (exactly one root) as a flat pre-order list of items.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ValueSeq<'a> {
    items: Vec<Item<'a>>,
}

impl<'a> ValueSeq<'a> {
    /// An empty sequence; push exactly one root value.
    pub fn new() -> Self {
        Self { items: Vec::new() }
    }

    /// Appends a scalar.
    pub fn push_atom(&mut self, a: Atom<'a>) {
        self.items.push(Item::Atom(a));
    }

    /// Opens a tuple of `len` items; returns the handle [`ValueSeq::close_tuple`] takes
    /// once the `len` items are pushed.
    pub fn open_tuple(&mut self, len: usize, id: ObjId) -> usize {
        self.items.push(Item::Tuple { len, span: 0, id });
        self.items.len() - 1
    }

    /// Records the subtree size of the tuple opened at `handle`.
    pub fn close_tuple(&mut self, handle: usize) {
        let span = self.items.len() - handle - 1;
        if let Some(Item::Tuple { span: s, .. }) = self.items.get_mut(handle) {
            *s = span;
        }
    }

    /// A tuple of scalars, for tests and simple callers.
    pub fn tuple_of(atoms: &[Atom<'a>], id: ObjId) -> Self {
        let mut v = Self::new();
        let h = v.open_tuple(atoms.len(), id);
        for a in atoms {
            v.push_atom(*a);
        }
        v.close_tuple(h);
        v
    }

    /// The items, pre-order.
    pub fn items(&self) -> &[Item<'a>] {
        &self.items
    }

    /// Checks that the items form exactly one well-formed value.
    pub fn validate(&self) -> Result<()> {
        let end = subtree_end(&self.items, 0)?;
        if end != self.items.len() {
            return Err(Error::InvalidArgument(format!(
                "value sequence has {} items after its root",
                self.items.len() - end
            )));
        }
        Ok(())
    }

    /// The root value.
    pub fn root(&self) -> ValueRef<'_, 'a> {
        ValueRef { items: &self.items }
    }
}

/// Where the subtree starting at item `i` ends; checks tuple lengths against spans.
fn subtree_end(items: &[Item<'_>], i: usize) -> Result<usize> {
    match items.get(i) {
        None => Err(Error::InvalidArgument(
            "value sequence ends inside a tuple".into(),
        )),
        Some(Item::Atom(_)) => Ok(i + 1),
        Some(Item::Tuple { len, span, .. }) => {
            let mut j = i + 1;
            for _ in 0..*len {
                j = subtree_end(items, j)?;
            }
            if j != i + 1 + span {
                return Err(Error::InvalidArgument(format!(
                    "tuple at item {i} spans {span} items but its {len} elements span {}",
                    j - i - 1
                )));
            }
            Ok(j)
        }
    }
}

/// One value (a root item and its subtree) of a [`ValueSeq`].
#[derive(Clone, Copy, Debug)]
pub struct ValueRef<'s, 'a> {
    items: &'s [Item<'a>],
}

impl<'s, 'a> ValueRef<'s, 'a> {
    /// The root item (`None` for an empty sequence).
    pub fn head(&self) -> Option<&'s Item<'a>> {
        self.items.first()
    }

    /// The items of this value's subtree, root first.
    fn subtree(&self) -> &'s [Item<'a>] {
        let end = match self.items.first() {
            Some(Item::Tuple { span, .. }) => (1 + span).min(self.items.len()),
            Some(Item::Atom(_)) => 1,
            None => 0,
        };
        &self.items[..end]
    }

    /// The direct children of a tuple root (none for a scalar).
    pub fn children(&self) -> Vec<ValueRef<'s, 'a>> {
        let items = self.subtree();
        let mut out = Vec::new();
        if let Some(Item::Tuple { len, .. }) = items.first() {
            let mut i = 1;
            for _ in 0..*len {
                if i >= items.len() {
                    break;
                }
                let size = match items[i] {
                    Item::Atom(_) => 1,
                    Item::Tuple { span, .. } => span + 1,
                };
                let stop = (i + size).min(items.len());
                out.push(ValueRef {
                    items: &items[i..stop],
                });
                i = stop;
            }
        }
        out
    }
}

impl Encode for ValueRef<'_, '_> {
    fn encode<E: Encoder>(&self, e: &mut E) {
        let items = self.subtree();
        // Open tuples: (items still to write, len, id).
        let mut stack: Vec<(usize, usize, ObjId)> = Vec::new();
        let mut i = 0;
        while i < items.len() {
            match items[i] {
                Item::Atom(a) => {
                    e.atom(&a);
                    i += 1;
                    value_done(e, &mut stack);
                }
                Item::Tuple { len, span, id } => {
                    if e.begin_tuple(len, id) {
                        stack.push((len, len, id));
                        i += 1;
                    } else {
                        i += 1 + span;
                        value_done(e, &mut stack);
                    }
                }
            }
        }
    }
}

/// After a complete value was written: counts it against the innermost open tuple and
/// closes every tuple whose items are all written.
fn value_done<E: Encoder>(e: &mut E, stack: &mut Vec<(usize, usize, ObjId)>) {
    while let Some(top) = stack.last_mut() {
        top.0 -= 1;
        if top.0 > 0 {
            return;
        }
        let (_, len, id) = *top;
        stack.pop();
        e.end_tuple(len, id);
    }
}

impl Encode for ValueSeq<'_> {
    fn encode<E: Encoder>(&self, e: &mut E) {
        self.root().encode(e);
    }
}
