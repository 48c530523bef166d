//! Plain value types shared by every module: block ids, block hashes, hash keys.
//!
//! Mirrors vLLM 0.33 `v1/core/kv_cache_utils.py`'s `BlockHash` (raw digest bytes) and
//! `BlockHashWithGroupId` (digest + 4-byte big-endian group id). Hashes are stored
//! inline (no heap): vLLM's digests are 32 bytes (sha256, sha256_cbor) or 16 bytes
//! (xxhash, xxhash_cbor).

use crate::error::{Error, Result};

/// Index of a KV-cache block in the pool. Block 0 is the null block.
pub type BlockId = u32;

/// The id of the null block (popped at construction, never hashed or ref-counted).
pub const NULL_BLOCK_ID: BlockId = 0;

/// The longest block hash the core stores inline.
pub const MAX_HASH_LEN: usize = 32;

/// A block hash: the raw digest bytes vLLM's hasher produced for one full block.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash {
    len: u8,
    bytes: [u8; MAX_HASH_LEN],
}

impl BlockHash {
    /// Copies `bytes` into a hash; `Err(BadHashLength)` if empty or longer than 32 bytes.
    #[inline]
    pub fn new(bytes: &[u8]) -> Result<Self> {
        if bytes.is_empty() || bytes.len() > MAX_HASH_LEN {
            return Err(Error::BadHashLength(bytes.len()));
        }
        let mut out = [0u8; MAX_HASH_LEN];
        out[..bytes.len()].copy_from_slice(bytes);
        Ok(Self {
            len: bytes.len() as u8,
            bytes: out,
        })
    }

    /// The digest bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockHash(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// The key of the prefix-cache index: a block hash plus the KV-cache group id
/// (vLLM's `BlockHashWithGroupId`, whose bytes are `hash + group_id.to_bytes(4, "big")`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockHashWithGroupId {
    pub hash: BlockHash,
    pub group_id: u32,
}

impl BlockHashWithGroupId {
    /// vLLM's byte encoding of the key: the digest followed by the big-endian group id.
    pub fn to_vllm_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.hash.as_bytes().len() + 4);
        out.extend_from_slice(self.hash.as_bytes());
        out.extend_from_slice(&self.group_id.to_be_bytes());
        out
    }
}

/// Read access to a request's chained block hashes (vLLM's `request.block_hashes`).
///
/// The Python bindings implement it over the request's `list[bytes]` without copying
/// the list; tests implement it over a slice.
pub trait BlockHashSource {
    /// Number of hashes (full hash blocks) the request has.
    fn len(&self) -> usize;
    /// Whether the request has no hash yet.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The `i`-th hash; `i < len()`.
    fn get(&self, i: usize) -> Result<BlockHash>;
}

impl BlockHashSource for [BlockHash] {
    fn len(&self) -> usize {
        <[BlockHash]>::len(self)
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        self.as_ref()
            .get(i)
            .copied()
            .ok_or_else(|| Error::InvalidArgument(format!("block hash index {i} out of range")))
    }
}

impl<T: BlockHashSource + ?Sized> BlockHashSource for &T {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        (**self).get(i)
    }
}

impl BlockHashSource for Vec<BlockHash> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        BlockHashSource::get(self.as_slice(), i)
    }
}

/// vLLM's `BlockHashListWithBlockSize`: a request's hashes (computed every
/// `hash_block_size` tokens) viewed at a coarser `block_size`, a multiple of it. The
/// hash at the last fine boundary of a coarse block chains over the whole prefix, so
/// it is that block's hash: `view[i] = hashes[(i + 1) * scale - 1]`. With `scale == 1`
/// the view is the list itself.
#[derive(Clone, Copy)]
pub struct HashView<'a, H: BlockHashSource + ?Sized> {
    hashes: &'a H,
    scale: usize,
}

impl<'a, H: BlockHashSource + ?Sized> HashView<'a, H> {
    /// The view of `hashes` at `scale = block_size / hash_block_size` (>= 1).
    #[inline]
    pub fn new(hashes: &'a H, scale: usize) -> Self {
        Self {
            hashes,
            scale: scale.max(1),
        }
    }

    /// The raw (hash-block-granular) list behind the view.
    #[inline]
    pub fn raw(&self) -> &'a H {
        self.hashes
    }

    /// Hash blocks per viewed block.
    #[inline]
    pub fn scale(&self) -> usize {
        self.scale
    }
}

impl<H: BlockHashSource + ?Sized> BlockHashSource for HashView<'_, H> {
    #[inline]
    fn len(&self) -> usize {
        self.hashes.len() / self.scale
    }
    #[inline]
    fn get(&self, i: usize) -> Result<BlockHash> {
        let raw = i
            .checked_add(1)
            .and_then(|n| n.checked_mul(self.scale))
            .ok_or_else(|| Error::InvalidArgument(format!("block hash index {i} out of range")))?;
        self.hashes.get(raw - 1)
    }
}

/// Ceiling division for token → block counts.
#[inline]
pub fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}
