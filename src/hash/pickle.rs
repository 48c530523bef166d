//! A pickle protocol 5 writer for the shapes vLLM hashes, byte-identical to CPython's
//! `pickle.dumps(obj, protocol=5)` (the C `_pickle` module of CPython 3.10–3.13).
//!
//! Mirrors the `sha256` / `xxhash` serialization of vLLM 0.33 `vllm/utils/hashing.py`
//! (`pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)`).
//!
//! Key properties (each checked against `pickle.dumps` in `tests/hashing/test_block_hasher.py`):
//! - `PROTO 5`, then opcodes inside `FRAME`s. A frame is committed when the next object
//!   starts (CPython checks at the top of `save()`) and the frame holds at least 64 KiB,
//!   and after `STOP`; a frame of fewer than 4 bytes loses its header. A `str`/`bytes` payload of 64 KiB or
//!   more is written outside any frame.
//! - Ints: `BININT1` (0..=255), `BININT2` (..=65535), `BININT` (signed 32 bit), else
//!   `LONG1` (minimal little-endian two's complement). Ints and `None` are not memoized.
//! - `str` → `SHORT_BINUNICODE` / `BINUNICODE` / `BINUNICODE8`; `bytes` →
//!   `SHORT_BINBYTES` / `BINBYTES` / `BINBYTES8`; tuples of 1–3 items → `TUPLE1..3`,
//!   longer → `MARK … TUPLE`, empty → `EMPTY_TUPLE` (not memoized). Every other `str`,
//!   `bytes` and tuple is followed by `MEMOIZE`, and a later occurrence of the *same
//!   object* ([`ObjId`]) is written as `BINGET i` / `LONG_BINGET i`.

use super::value::{Encoder, ObjId};

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const EMPTY_TUPLE: u8 = b')';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// CPython's `FRAME_SIZE_TARGET`: commit a frame once it holds this many bytes.
const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// CPython's `FRAME_SIZE_MIN`: smaller frames are written without a header.
const FRAME_SIZE_MIN: usize = 4;
/// `FRAME` opcode + 8-byte length.
const FRAME_HEADER_SIZE: usize = 9;
/// The longest pickled `u32`: `LONG1`, length 5, 5 bytes.
const MAX_TOKEN_BYTES: usize = 7;

/// Writes one pickle into a caller-owned buffer (cleared first, reused across blocks).
pub struct PickleWriter<'b> {
    buf: &'b mut Vec<u8>,
    /// Start of the open frame's header, if a frame is open.
    frame_start: Option<usize>,
    framing: bool,
    /// Memo entries of objects with a known identity: (id, memo index).
    memo: &'b mut Vec<(ObjId, u32)>,
    /// Number of memo entries so far (every memoized object, identified or not).
    memo_len: u32,
}

impl<'b> PickleWriter<'b> {
    /// Starts a pickle (`PROTO 5`) in `buf`, using `memo` as scratch.
    pub fn new(buf: &'b mut Vec<u8>, memo: &'b mut Vec<(ObjId, u32)>) -> Self {
        buf.clear();
        memo.clear();
        buf.extend_from_slice(&[PROTO, 5]);
        Self {
            buf,
            frame_start: None,
            framing: true,
            memo,
            memo_len: 0,
        }
    }

    /// Writes `STOP`, commits the last frame and returns the pickle.
    pub fn finish(mut self) -> &'b [u8] {
        self.write(&[STOP]);
        self.commit_frame();
        self.buf
    }

    #[inline]
    fn open_frame_if_needed(&mut self) {
        if self.framing && self.frame_start.is_none() {
            self.frame_start = Some(self.buf.len());
            self.buf.extend_from_slice(&[0u8; FRAME_HEADER_SIZE]);
        }
    }

    #[inline]
    fn write(&mut self, data: &[u8]) {
        self.open_frame_if_needed();
        self.buf.extend_from_slice(data);
    }

    fn commit_frame(&mut self) {
        if !self.framing {
            return;
        }
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let frame_len = self.buf.len() - start - FRAME_HEADER_SIZE;
        if frame_len >= FRAME_SIZE_MIN {
            self.buf[start] = FRAME;
            self.buf[start + 1..start + FRAME_HEADER_SIZE]
                .copy_from_slice(&(frame_len as u64).to_le_bytes());
        } else {
            self.buf.drain(start..start + FRAME_HEADER_SIZE);
        }
    }

    /// CPython's `_Pickler_OpcodeBoundary`, checked when `save()` starts an object
    /// (before its first byte, after the previous object's last one).
    #[inline]
    fn boundary(&mut self) {
        if let Some(start) = self.frame_start {
            if self.buf.len() - start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    /// CPython's `_Pickler_write_bytes`: large payloads go outside any frame.
    fn write_payload(&mut self, header: &[u8], data: &[u8]) {
        if data.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.framing = false;
            self.buf.extend_from_slice(header);
            self.buf.extend_from_slice(data);
            self.framing = true;
        } else {
            self.write(header);
            self.write(data);
        }
    }

    fn memo_put(&mut self, id: ObjId) {
        self.write(&[MEMOIZE]);
        if !id.is_unique() {
            self.memo.push((id, self.memo_len));
        }
        self.memo_len += 1;
    }

    /// Writes a memo reference if `id` was memoized already; returns whether it did.
    fn memo_get(&mut self, id: ObjId) -> bool {
        if id.is_unique() {
            return false;
        }
        let Some(&(_, index)) = self.memo.iter().find(|(m, _)| *m == id) else {
            return false;
        };
        match u8::try_from(index) {
            Ok(i) => self.write(&[BINGET, i]),
            Err(_) => {
                let mut op = [LONG_BINGET, 0, 0, 0, 0];
                op[1..].copy_from_slice(&index.to_le_bytes());
                self.write(&op);
            }
        }
        true
    }

    /// A non-negative int: `BININT1`, `BININT2`, `BININT` or (above `2**31 - 1`) `LONG1`.
    #[inline]
    fn write_uint(&mut self, v: u32) {
        if v <= 0xff {
            self.write(&[BININT1, v as u8]);
        } else if v <= 0xffff {
            let b = (v as u16).to_le_bytes();
            self.write(&[BININT2, b[0], b[1]]);
        } else if v <= 0x7fff_ffff {
            let b = v.to_le_bytes();
            self.write(&[BININT, b[0], b[1], b[2], b[3]]);
        } else {
            self.long(i128::from(v));
        }
    }

    fn long(&mut self, v: i128) {
        // `_PyLong_NumBits` of |v|, then one byte more than needed for a sign bit.
        let nbits = 128 - v.unsigned_abs().leading_zeros() as usize;
        let mut bytes = [0u8; 17];
        bytes[..16].copy_from_slice(&v.to_le_bytes());
        bytes[16] = if v < 0 { 0xff } else { 0 };
        let mut n = (nbits >> 3) + 1;
        // A negative value may need one byte less: drop a redundant 0xff sign byte.
        if v < 0 && n > 1 && bytes[n - 1] == 0xff && bytes[n - 2] & 0x80 != 0 {
            n -= 1;
        }
        // n <= 17, so LONG4 never occurs here; kept for completeness of the format.
        match u8::try_from(n) {
            Ok(n8) => self.write(&[LONG1, n8]),
            Err(_) => {
                let mut op = [LONG4, 0, 0, 0, 0];
                op[1..].copy_from_slice(&(n as u32).to_le_bytes());
                self.write(&op);
            }
        }
        self.write(&bytes[..n]);
    }
}

impl Encoder for PickleWriter<'_> {
    #[inline]
    fn none(&mut self) {
        self.boundary();
        self.write(&[NONE]);
    }

    fn int(&mut self, v: i128) {
        self.boundary();
        match u32::try_from(v) {
            Ok(u) => self.write_uint(u),
            Err(_) => match i32::try_from(v) {
                Ok(i) => {
                    let b = i.to_le_bytes();
                    self.write(&[BININT, b[0], b[1], b[2], b[3]]);
                }
                Err(_) => self.long(v),
            },
        }
    }

    #[inline]
    fn token(&mut self, v: u32) {
        self.boundary();
        self.write_uint(v);
    }

    fn str(&mut self, s: &str, id: ObjId) {
        self.boundary();
        if self.memo_get(id) {
            return;
        }
        let n = s.len();
        if let Ok(n8) = u8::try_from(n) {
            self.write_payload(&[SHORT_BINUNICODE, n8], s.as_bytes());
        } else if let Ok(n32) = u32::try_from(n) {
            let mut h = [BINUNICODE, 0, 0, 0, 0];
            h[1..].copy_from_slice(&n32.to_le_bytes());
            self.write_payload(&h, s.as_bytes());
        } else {
            let mut h = [BINUNICODE8, 0, 0, 0, 0, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u64).to_le_bytes());
            self.write_payload(&h, s.as_bytes());
        }
        self.memo_put(id);
    }

    fn bytes(&mut self, b: &[u8], id: ObjId) {
        self.boundary();
        if self.memo_get(id) {
            return;
        }
        let n = b.len();
        if let Ok(n8) = u8::try_from(n) {
            self.write_payload(&[SHORT_BINBYTES, n8], b);
        } else if let Ok(n32) = u32::try_from(n) {
            let mut h = [BINBYTES, 0, 0, 0, 0];
            h[1..].copy_from_slice(&n32.to_le_bytes());
            self.write_payload(&h, b);
        } else {
            let mut h = [BINBYTES8, 0, 0, 0, 0, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u64).to_le_bytes());
            self.write_payload(&h, b);
        }
        self.memo_put(id);
    }

    fn begin_tuple(&mut self, len: usize, id: ObjId) -> bool {
        self.boundary();
        if self.memo_get(id) {
            return false;
        }
        if len == 0 {
            self.write(&[EMPTY_TUPLE]);
            return false;
        }
        if len > 3 {
            self.write(&[MARK]);
        }
        true
    }

    fn end_tuple(&mut self, len: usize, id: ObjId) {
        let op = match len {
            1 => TUPLE1,
            2 => TUPLE2,
            3 => TUPLE3,
            _ => TUPLE,
        };
        self.write(&[op]);
        self.memo_put(id);
    }

    fn token_tuple(&mut self, tokens: &[u32]) {
        if !self.begin_tuple(tokens.len(), ObjId::UNIQUE) {
            return;
        }
        // Opening the frame before the first token changes nothing (a boundary check
        // on an empty frame is a no-op) and lets the fast path below assume it open.
        self.open_frame_if_needed();
        let frame_len = self
            .frame_start
            .map_or(0, |start| self.buf.len() - start - FRAME_HEADER_SIZE);
        if frame_len + tokens.len() * MAX_TOKEN_BYTES < FRAME_SIZE_TARGET {
            // No token can start at or past FRAME_SIZE_TARGET (at most MAX_TOKEN_BYTES each):
            // every boundary check would be a no-op, so skip them.
            let mut pos = self.buf.len();
            self.buf.resize(pos + tokens.len() * 5, 0);
            for &t in tokens {
                if t > 0x7fff_ffff {
                    // LONG1: rare (ids of 2**31 and up); leave the fast path.
                    self.buf.truncate(pos);
                    self.long(i128::from(t));
                    pos = self.buf.len();
                    self.buf.resize(pos + tokens.len() * 5, 0);
                    continue;
                }
                // Branch-light: always store 5 bytes, advance by the opcode's length.
                let (op, n) = if t <= 0xff {
                    (BININT1, 2)
                } else if t <= 0xffff {
                    (BININT2, 3)
                } else {
                    (BININT, 5)
                };
                let b = t.to_le_bytes();
                self.buf[pos..pos + 5].copy_from_slice(&[op, b[0], b[1], b[2], b[3]]);
                pos += n;
            }
            self.buf.truncate(pos);
        } else {
            for &t in tokens {
                self.token(t);
            }
        }
        self.end_tuple(tokens.len(), ObjId::UNIQUE);
    }
}
