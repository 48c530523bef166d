//! Block hashing: every `--prefix-caching-hash-algo` of vLLM 0.33, bit-exact, plus BLAKE3.
//!
//! Mirrors vLLM 0.33 `vllm/utils/hashing.py` (`sha256`, `sha256_cbor`, `xxhash`,
//! `xxhash_cbor`) and `vllm/v1/core/kv_cache_utils.py` (`hash_block_tokens`,
//! `init_none_hash`, `get_request_block_hasher` → [`request`]).
//!
//! A block hash is `H((parent_hash, tuple(block_token_ids), extra_keys))`, where `H` is:
//!
//! | algo          | serialization (own encoders)                  | digest            |
//! |---------------|-----------------------------------------------|-------------------|
//! | `sha256`      | `pickle.dumps(obj, protocol=5)` ([`pickle`])  | SHA-256, 32 bytes |
//! | `sha256_cbor` | `cbor2.dumps(obj, canonical=True)` ([`cbor`]) | SHA-256, 32 bytes |
//! | `xxhash`      | pickle protocol 5                             | XXH3-128, 16 bytes (big endian, as `xxh3_128_digest`) |
//! | `xxhash_cbor` | canonical CBOR                                | XXH3-128, 16 bytes |
//! | `blake3`      | hscache only, see below                       | BLAKE3, 32 bytes  |
//!
//! **The `blake3` block scheme** (not a vLLM algorithm; its values only need to be
//! collision resistant and stable across hscache versions). Token ids are `u32`.
//! ```text
//! K0 = parent                       if len(parent) == 32, else BLAKE3(parent)
//! K  = K0                           if extra_keys is None
//!    = BLAKE3-keyed(K0, CBOR(extra_keys) ‖ pad)  otherwise; pad = (k-1) zero bytes then
//!      the byte k, k in 1..=4 the least making the message length ≡ 1 (mod 4)
//! H  = BLAKE3-keyed(K, token ids as u32 little endian)
//! ```
//! Why: a chain step without extra keys is one keyed BLAKE3 over the raw token bytes
//! (one compression per 16 tokens, and BLAKE3's SIMD across 1 KiB chunks for large
//! blocks), with no serialization at all. Token messages have a length ≡ 0 (mod 4) and
//! extra-key messages ≡ 1, so no choice of tokens can make a derived key equal a chain
//! value by construction; anything else is a BLAKE3 collision. Any other object
//! (`init_none_hash`'s seed string) hashes as `BLAKE3(CBOR(obj))` ([`BlockHasher::hash_value`]).
//!
//! Key properties:
//! - The parent of the first block is `NONE_HASH`, which the caller passes (the Python
//!   side reads `vllm.v1.core.kv_cache_utils.NONE_HASH` at call time); a falsy (empty)
//!   parent is replaced by it, as in vLLM.
//! - One [`BlockHasher`] reuses its buffers: hashing a block allocates nothing.

pub mod cbor;
pub mod pickle;
pub mod request;
pub mod value;

use sha2::Digest;

use crate::error::{Error, Result};
use crate::extra_keys::ExtraKeysValue;
use crate::types::BlockHash;
use cbor::CborWriter;
use pickle::PickleWriter;
use value::{Atom, Encode, Encoder, Item, ObjId, ValueRef, ValueSeq};

/// A block-hash algorithm: vLLM's four `--prefix-caching-hash-algo` values and BLAKE3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// SHA-256 over pickle protocol 5 (vLLM's default).
    Sha256,
    /// SHA-256 over canonical CBOR.
    Sha256Cbor,
    /// XXH3-128 over pickle protocol 5.
    Xxhash,
    /// XXH3-128 over canonical CBOR.
    XxhashCbor,
    /// hscache's BLAKE3 block scheme (see the module doc).
    Blake3,
}

/// How an algorithm serializes the value it hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serialization {
    /// CPython `pickle.dumps(obj, protocol=5)`.
    Pickle,
    /// `cbor2.dumps(obj, canonical=True)`.
    Cbor,
}

impl HashAlgo {
    /// Every algorithm, vLLM's first.
    pub const ALL: [HashAlgo; 5] = [
        HashAlgo::Sha256,
        HashAlgo::Sha256Cbor,
        HashAlgo::Xxhash,
        HashAlgo::XxhashCbor,
        HashAlgo::Blake3,
    ];

    /// The `--prefix-caching-hash-algo` name (`"blake3"` for BLAKE3).
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::XxhashCbor => "xxhash_cbor",
            HashAlgo::Blake3 => "blake3",
        }
    }

    /// Parses a name of [`HashAlgo::name`]; `Unsupported` for any other.
    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| Error::Unsupported(format!("unknown block-hash algorithm {name:?}")))
    }

    /// Digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => 16,
            _ => 32,
        }
    }

    /// The serialization of generic values (BLAKE3 uses CBOR for non-block values).
    pub fn serialization(self) -> Serialization {
        match self {
            HashAlgo::Sha256 | HashAlgo::Xxhash => Serialization::Pickle,
            _ => Serialization::Cbor,
        }
    }

    fn digest(self, bytes: &[u8]) -> BlockHash {
        let out = match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => BlockHash::new(&sha2::Sha256::digest(bytes)),
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
                BlockHash::new(&xxhash_rust::xxh3::xxh3_128(bytes).to_be_bytes())
            }
            HashAlgo::Blake3 => BlockHash::new(blake3::hash(bytes).as_bytes()),
        };
        // Every digest is 16 or 32 bytes, which `BlockHash` always holds.
        out.unwrap_or_else(|_| unreachable!("digests are 16 or 32 bytes"))
    }
}

/// `(parent, tuple(tokens), extras)`, the value vLLM hashes for one block.
struct BlockValue<'x, X: ?Sized> {
    parent: &'x [u8],
    tokens: &'x [u32],
    extras: &'x X,
}

impl<X: Encode + ?Sized> Encode for BlockValue<'_, X> {
    fn encode<E: Encoder>(&self, e: &mut E) {
        if e.begin_tuple(3, ObjId::UNIQUE) {
            e.bytes(self.parent, ObjId::UNIQUE);
            e.token_tuple(self.tokens);
            self.extras.encode(e);
            e.end_tuple(3, ObjId::UNIQUE);
        }
    }
}

impl ExtraKeysValue for ValueRef<'_, '_> {
    fn is_none(&self) -> bool {
        matches!(self.head(), Some(Item::Atom(Atom::None)))
    }
}

/// Hashes blocks and values with one algorithm, reusing its buffers.
#[derive(Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    buf: Vec<u8>,
    aux: Vec<u8>,
    memo: Vec<(ObjId, u32)>,
}

impl BlockHasher {
    /// A hasher for `algo`.
    pub fn new(algo: HashAlgo) -> Self {
        Self {
            algo,
            buf: Vec::with_capacity(256),
            aux: Vec::new(),
            memo: Vec::new(),
        }
    }

    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// vLLM's `hash_block_tokens(hash_fn, parent, tokens, extras)` with the parent already
    /// resolved (a falsy parent means `NONE_HASH`; see [`resolve_parent`]).
    pub fn hash_block<X: ExtraKeysValue + ?Sized>(
        &mut self,
        parent: &[u8],
        tokens: &[u32],
        extras: &X,
    ) -> BlockHash {
        match self.algo {
            HashAlgo::Blake3 => self.blake3_block(parent, tokens, extras),
            algo => {
                let value = BlockValue {
                    parent,
                    tokens,
                    extras,
                };
                let bytes =
                    serialize_into(algo.serialization(), &value, &mut self.buf, &mut self.memo);
                algo.digest(bytes)
            }
        }
    }

    /// The hash function applied to any supported value (vLLM's `hash_fn(obj)`), e.g.
    /// `init_none_hash`'s seed string. Under BLAKE3 a block-shaped value
    /// `(bytes, tuple of u32 ints, extras)` gets the block scheme, anything else
    /// `BLAKE3(CBOR(value))`.
    pub fn hash_value(&mut self, value: &ValueSeq<'_>) -> Result<BlockHash> {
        value.validate()?;
        if self.algo == HashAlgo::Blake3 {
            if let Some((parent, tokens, extras)) = as_block(value.root()) {
                return Ok(self.blake3_block(parent, &tokens, &extras));
            }
        }
        let algo = self.algo;
        let bytes = serialize_into(algo.serialization(), value, &mut self.buf, &mut self.memo);
        Ok(algo.digest(bytes))
    }

    /// The serialized bytes of `value` (for tests and debugging).
    pub fn serialize(&mut self, format: Serialization, value: &ValueSeq<'_>) -> Result<&[u8]> {
        value.validate()?;
        Ok(serialize_into(format, value, &mut self.buf, &mut self.memo))
    }

    fn blake3_block<X: ExtraKeysValue + ?Sized>(
        &mut self,
        parent: &[u8],
        tokens: &[u32],
        extras: &X,
    ) -> BlockHash {
        let cbor = if extras.is_none() {
            None
        } else {
            self.aux.clear();
            extras.encode(&mut CborWriter::append(&mut self.aux));
            Some(self.aux.as_slice())
        };
        blake3_block_hash(parent, tokens, cbor, &mut self.buf)
    }
}

/// hscache's BLAKE3 block scheme (module doc) with the extra keys given as their
/// canonical CBOR bytes (`None` for `extra_keys=None`); `scratch` is reused for the
/// token bytes.
pub fn blake3_block_hash(
    parent: &[u8],
    tokens: &[u32],
    extras_cbor: Option<&[u8]>,
    scratch: &mut Vec<u8>,
) -> BlockHash {
    let k0: [u8; 32] = match <[u8; 32]>::try_from(parent) {
        Ok(k) => k,
        Err(_) => *blake3::hash(parent).as_bytes(),
    };
    let key = match extras_cbor {
        None => k0,
        Some(cbor) => {
            // k in 1..=4 bytes, the least making the message length 1 (mod 4).
            let k = match (5 - cbor.len() % 4) % 4 {
                0 => 4,
                k => k,
            };
            let mut pad = [0u8; 4];
            pad[k - 1] = k as u8;
            let mut h = blake3::Hasher::new_keyed(&k0);
            h.update(cbor);
            h.update(&pad[..k]);
            *h.finalize().as_bytes()
        }
    };
    scratch.clear();
    scratch.reserve(tokens.len() * 4);
    for &t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    let h = blake3::keyed_hash(&key, scratch);
    BlockHash::new(h.as_bytes()).unwrap_or_else(|_| unreachable!("32-byte digest"))
}

/// vLLM's `parent_block_hash or NONE_HASH`.
#[inline]
pub fn resolve_parent<'p>(parent: Option<&'p [u8]>, none_hash: &'p [u8]) -> &'p [u8] {
    match parent {
        Some(p) if !p.is_empty() => p,
        _ => none_hash,
    }
}

/// `NONE_HASH` as vLLM's `init_none_hash` computes it: the hash function applied to the
/// seed string (`PYTHONHASHSEED`, or `"vllm-none-hash"`).
pub fn none_hash(algo: HashAlgo, seed: &str) -> BlockHash {
    let mut v = ValueSeq::new();
    v.push_atom(Atom::Str(seed, ObjId::UNIQUE));
    let mut h = BlockHasher::new(algo);
    // A single atom is always a valid value.
    h.hash_value(&v)
        .unwrap_or_else(|_| unreachable!("a str is a valid value"))
}

fn serialize_into<'b, V: Encode + ?Sized>(
    format: Serialization,
    value: &V,
    buf: &'b mut Vec<u8>,
    memo: &'b mut Vec<(ObjId, u32)>,
) -> &'b [u8] {
    match format {
        Serialization::Pickle => {
            let mut w = PickleWriter::new(buf, memo);
            value.encode(&mut w);
            w.finish()
        }
        Serialization::Cbor => {
            let mut w = CborWriter::new(buf);
            value.encode(&mut w);
            w.finish()
        }
    }
}

/// `(parent: bytes, tokens: tuple of u32 ints, extras)` if the value has that shape.
fn as_block<'s, 'a>(root: ValueRef<'s, 'a>) -> Option<(&'a [u8], Vec<u32>, ValueRef<'s, 'a>)> {
    if !matches!(root.head(), Some(Item::Tuple { len: 3, .. })) {
        return None;
    }
    let children = root.children();
    let [parent, tokens, extras] = children.as_slice() else {
        return None;
    };
    let Some(Item::Atom(Atom::Bytes(parent, _))) = parent.head() else {
        return None;
    };
    if !matches!(tokens.head(), Some(Item::Tuple { .. })) {
        return None;
    }
    let ids = tokens
        .children()
        .iter()
        .map(|t| match t.head() {
            Some(Item::Atom(Atom::Int(v))) => u32::try_from(*v).ok(),
            _ => None,
        })
        .collect::<Option<Vec<u32>>>()?;
    Some((parent, ids, *extras))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in HashAlgo::ALL {
            assert_eq!(HashAlgo::from_name(a.name()), Ok(a));
        }
        assert!(HashAlgo::from_name("md5").is_err());
    }

    #[test]
    fn falsy_parent_means_none_hash() {
        assert_eq!(resolve_parent(None, b"root"), b"root");
        assert_eq!(resolve_parent(Some(b""), b"root"), b"root");
        assert_eq!(resolve_parent(Some(b"p"), b"root"), b"p");
    }

    #[test]
    fn blake3_block_shape_of_hash_value_equals_hash_block() {
        let parent = [7u8; 32];
        let mut v = ValueSeq::new();
        let t = v.open_tuple(3, ObjId::UNIQUE);
        v.push_atom(Atom::Bytes(&parent, ObjId::UNIQUE));
        let toks = v.open_tuple(2, ObjId::UNIQUE);
        v.push_atom(Atom::Int(1));
        v.push_atom(Atom::Int(70000));
        v.close_tuple(toks);
        v.push_atom(Atom::None);
        v.close_tuple(t);
        let mut h = BlockHasher::new(HashAlgo::Blake3);
        let generic = h.hash_value(&v).expect("valid");
        let direct = h.hash_block(&parent, &[1, 70000], &NoExtras);
        assert_eq!(generic, direct);
    }

    /// `None` extra keys.
    struct NoExtras;
    impl Encode for NoExtras {
        fn encode<E: Encoder>(&self, e: &mut E) {
            e.none();
        }
    }
    impl ExtraKeysValue for NoExtras {
        fn is_none(&self) -> bool {
            true
        }
    }
}
