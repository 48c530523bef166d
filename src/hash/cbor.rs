//! A canonical CBOR writer for the shapes vLLM hashes, byte-identical to
//! `cbor2.dumps(obj, canonical=True)` (cbor2 5.x and 6.x).
//!
//! Mirrors the `sha256_cbor` / `xxhash_cbor` serialization of vLLM 0.33
//! `vllm/utils/hashing.py`.
//!
//! Key properties (each checked against `cbor2.dumps` in `tests/hashing/test_block_hasher.py`):
//! - Value-deterministic: identities ([`ObjId`]) are ignored (no value sharing, no
//!   string references: both are off by default in cbor2).
//! - Tuples are arrays (major type 4), `bytes` byte strings (2), `str` text strings (3),
//!   `None` is `0xf6`. Integers in `-2**64 ..= 2**64 - 1` are major types 0/1 with the
//!   shortest argument; beyond that, bignum tags 2/3 over the minimal big-endian bytes.

use super::value::{Encoder, ObjId};

const MAJOR_UINT: u8 = 0;
const MAJOR_NINT: u8 = 1;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const MAJOR_TAG: u8 = 6;
const SIMPLE_NULL: u8 = 0xf6;
const TAG_POS_BIGNUM: u64 = 2;
const TAG_NEG_BIGNUM: u64 = 3;

/// Writes one CBOR item into a caller-owned buffer (cleared first, reused across blocks).
pub struct CborWriter<'b> {
    buf: &'b mut Vec<u8>,
}

impl<'b> CborWriter<'b> {
    /// Starts an item in `buf`, which is cleared.
    pub fn new(buf: &'b mut Vec<u8>) -> Self {
        buf.clear();
        Self { buf }
    }

    /// Appends to `buf` without clearing it.
    pub fn append(buf: &'b mut Vec<u8>) -> Self {
        Self { buf }
    }

    /// The encoded bytes.
    pub fn finish(self) -> &'b [u8] {
        self.buf
    }

    #[inline]
    fn head(&mut self, major: u8, arg: u64) {
        let m = major << 5;
        if arg < 24 {
            self.buf.push(m | arg as u8);
        } else if let Ok(a) = u8::try_from(arg) {
            self.buf.extend_from_slice(&[m | 24, a]);
        } else if let Ok(a) = u16::try_from(arg) {
            let b = a.to_be_bytes();
            self.buf.extend_from_slice(&[m | 25, b[0], b[1]]);
        } else if let Ok(a) = u32::try_from(arg) {
            self.buf.push(m | 26);
            self.buf.extend_from_slice(&a.to_be_bytes());
        } else {
            self.buf.push(m | 27);
            self.buf.extend_from_slice(&arg.to_be_bytes());
        }
    }

    fn bignum(&mut self, tag: u64, magnitude: u128) {
        self.head(MAJOR_TAG, tag);
        let be = magnitude.to_be_bytes();
        let skip = (magnitude.leading_zeros() / 8) as usize;
        let payload = &be[skip..];
        self.head(MAJOR_BYTES, payload.len() as u64);
        self.buf.extend_from_slice(payload);
    }
}

impl Encoder for CborWriter<'_> {
    #[inline]
    fn none(&mut self) {
        self.buf.push(SIMPLE_NULL);
    }

    fn int(&mut self, v: i128) {
        if v >= 0 {
            match u64::try_from(v) {
                Ok(u) => self.head(MAJOR_UINT, u),
                Err(_) => self.bignum(TAG_POS_BIGNUM, v.unsigned_abs()),
            }
        } else {
            // CBOR stores -1 - v; `!v` is that value for negative `v`.
            let n = !v;
            match u64::try_from(n) {
                Ok(u) => self.head(MAJOR_NINT, u),
                Err(_) => self.bignum(TAG_NEG_BIGNUM, n.unsigned_abs()),
            }
        }
    }

    #[inline]
    fn token(&mut self, v: u32) {
        self.head(MAJOR_UINT, u64::from(v));
    }

    fn str(&mut self, s: &str, _id: ObjId) {
        self.head(MAJOR_TEXT, s.len() as u64);
        self.buf.extend_from_slice(s.as_bytes());
    }

    fn bytes(&mut self, b: &[u8], _id: ObjId) {
        self.head(MAJOR_BYTES, b.len() as u64);
        self.buf.extend_from_slice(b);
    }

    fn begin_tuple(&mut self, len: usize, _id: ObjId) -> bool {
        self.head(MAJOR_ARRAY, len as u64);
        len > 0
    }

    #[inline]
    fn end_tuple(&mut self, _len: usize, _id: ObjId) {}

    fn token_tuple(&mut self, tokens: &[u32]) {
        self.head(MAJOR_ARRAY, tokens.len() as u64);
        let mut pos = self.buf.len();
        self.buf.resize(pos + tokens.len() * 5, 0);
        for &t in tokens {
            // Branch-light: always store 5 bytes (head + big-endian argument, left
            // aligned), advance by the item's length.
            let (head, n) = if t < 24 {
                (t as u8, 0)
            } else if t <= 0xff {
                (24, 1)
            } else if t <= 0xffff {
                (25, 2)
            } else {
                (26, 4)
            };
            let arg = ((u64::from(t) << 32) << (32 - 8 * n)).to_be_bytes();
            self.buf[pos..pos + 5].copy_from_slice(&[head, arg[0], arg[1], arg[2], arg[3]]);
            pos += 1 + n;
        }
        self.buf.truncate(pos);
    }
}
