//! Block-hash extra keys: what besides the token ids distinguishes two blocks.
//!
//! Mirrors vLLM 0.33 `vllm/v1/core/kv_cache_utils.py`: `generate_block_hash_extra_keys`,
//! `_gen_mm_extra_hash_keys`, `_gen_lora_extra_hash_keys`,
//! `_gen_prompt_embeds_extra_hash_keys`, `generate_lookahead_block_hash_extra_keys` and
//! the initial multimodal index of `get_request_block_hasher`
//! (`vllm.multimodal.utils.get_mm_features_in_window`).
//!
//! Key properties:
//! - Order and shapes are vLLM's: `("lora", name, path)`, then `("mm", identifier,
//!   offset - block_start)` for every multimodal item overlapping the block (the offset
//!   is negative for an item that began in an earlier block), then `("cache_salt",
//!   salt)` on the block starting at token 0 only, then `("prompt_embeds", sha256 of the
//!   block's embedding bytes)`. No key at all → `None`.
//! - The multimodal scan is vLLM's, step for step, including its early exit and its
//!   binary search, so lists vLLM accepts without complaint (overlapping items, as
//!   interleaved audio-in-video placeholders produce) give vLLM's keys.
//! - With `L` lookahead tokens the keys cover `[start, end + L)` and the extra-keys
//!   value is `(E, t_end, …, t_end+L-1)`; the multimodal index rewinds to the first item
//!   still open at the block end.
//! - Two forms ([`ExtraKeysForm`]), chosen per hasher from the version profile:
//!   **tagged** (vLLM 0.31 and later; above) and **untagged** (vLLM 0.30): the same keys
//!   in the same order but bare, i.e. the LoRA name alone (no path), `(identifier,
//!   offset - block_start)`, the salt alone and the digest alone; and a call whose first
//!   new block starts past token 0 scans multimodal items from the *last* item (0.30's
//!   `curr_mm_idx = -1`), so an earlier item still open there is not keyed.
//! - Differs from vLLM: a negative `start_mm_idx` ("from the end") is not accepted (the
//!   request hasher never passes one); malformed positions are rejected when the
//!   features are built ([`MmFeature::new`]) and a scanned item without identifier is an
//!   error instead of an `AssertionError`.

use crate::error::{Error, Result};
use crate::hash::value::{Atom, Encode, Encoder, ObjId};

/// The tag strings of the four kinds of extra keys.
pub const TAG_LORA: &str = "lora";
/// See [`TAG_LORA`].
pub const TAG_MM: &str = "mm";
/// See [`TAG_LORA`].
pub const TAG_CACHE_SALT: &str = "cache_salt";
/// See [`TAG_LORA`].
pub const TAG_PROMPT_EMBEDS: &str = "prompt_embeds";

/// Identities of the four tag strings.
///
/// In vLLM they are string literals of `kv_cache_utils.py`, hence interned: every
/// `"mm"` of one key is the same object and pickles as a memo reference after the
/// first. The Python bindings pass the addresses of the interned strings (so a value
/// that *is* an interned tag also matches, as in CPython); [`TagIds::default`] uses
/// 1..=4, which no object address can equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TagIds {
    pub lora: ObjId,
    pub mm: ObjId,
    pub cache_salt: ObjId,
    pub prompt_embeds: ObjId,
}

impl Default for TagIds {
    fn default() -> Self {
        Self {
            lora: ObjId::new(1),
            mm: ObjId::new(2),
            cache_salt: ObjId::new(3),
            prompt_embeds: ObjId::new(4),
        }
    }
}

/// How the keys of a block are written (a field of the version profile, never a
/// version check).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExtraKeysForm {
    /// Each key is a tuple led by its tag string (`("mm", identifier, offset)` ...),
    /// and a later call's multimodal scan starts at the first item still open
    /// ([`initial_mm_index`]). vLLM 0.31 and later.
    #[default]
    Tagged,
    /// Bare keys: the LoRA name, `(identifier, offset)`, the salt, the embeddings
    /// digest; a later call's multimodal scan starts at the last item. vLLM 0.30.
    Untagged,
}

impl ExtraKeysForm {
    /// The form's name as the Python profile spells it.
    pub fn name(self) -> &'static str {
        match self {
            ExtraKeysForm::Tagged => "tagged",
            ExtraKeysForm::Untagged => "untagged",
        }
    }

    /// The form named `name` (`"tagged"` or `"untagged"`).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "tagged" => Ok(ExtraKeysForm::Tagged),
            "untagged" => Ok(ExtraKeysForm::Untagged),
            other => Err(Error::InvalidArgument(format!(
                "unknown extra-keys form {other:?}: expected \"tagged\" or \"untagged\""
            ))),
        }
    }

    /// The multimodal index the request hasher starts from when the call's first new
    /// block starts at `start`: [`initial_mm_index`] when tagged; untagged, 0 at
    /// token 0 and otherwise the last item (0.30 resolves its `-1` to it).
    pub fn initial_mm_index(self, features: &[MmFeature<'_>], start: usize) -> usize {
        match self {
            ExtraKeysForm::Tagged => initial_mm_index(features, start),
            ExtraKeysForm::Untagged if start == 0 => 0,
            ExtraKeysForm::Untagged => features.len().saturating_sub(1),
        }
    }
}

/// One extra key of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// `("lora", lora_name, lora_path)`.
    Lora { name: Atom<'a>, path: Atom<'a> },
    /// `("mm", identifier, offset relative to the block start)`.
    Mm { identifier: Atom<'a>, offset: i64 },
    /// `("cache_salt", salt)`.
    CacheSalt(Atom<'a>),
    /// `("prompt_embeds", sha256 digest of the block's embedding bytes)`.
    PromptEmbeds([u8; 32]),
}

impl ExtraKey<'_> {
    fn encode<E: Encoder>(&self, e: &mut E, tags: &TagIds, form: ExtraKeysForm) {
        if form == ExtraKeysForm::Untagged {
            self.encode_untagged(e);
            return;
        }
        match self {
            ExtraKey::Lora { name, path } => {
                if e.begin_tuple(3, ObjId::UNIQUE) {
                    e.str(TAG_LORA, tags.lora);
                    e.atom(name);
                    e.atom(path);
                    e.end_tuple(3, ObjId::UNIQUE);
                }
            }
            ExtraKey::Mm { identifier, offset } => {
                if e.begin_tuple(3, ObjId::UNIQUE) {
                    e.str(TAG_MM, tags.mm);
                    e.atom(identifier);
                    e.int(i128::from(*offset));
                    e.end_tuple(3, ObjId::UNIQUE);
                }
            }
            ExtraKey::CacheSalt(salt) => {
                if e.begin_tuple(2, ObjId::UNIQUE) {
                    e.str(TAG_CACHE_SALT, tags.cache_salt);
                    e.atom(salt);
                    e.end_tuple(2, ObjId::UNIQUE);
                }
            }
            ExtraKey::PromptEmbeds(digest) => {
                if e.begin_tuple(2, ObjId::UNIQUE) {
                    e.str(TAG_PROMPT_EMBEDS, tags.prompt_embeds);
                    e.bytes(digest, ObjId::UNIQUE);
                    e.end_tuple(2, ObjId::UNIQUE);
                }
            }
        }
    }

    /// [`ExtraKeysForm::Untagged`]: the bare value; a multimodal key is the fresh
    /// tuple `(identifier, offset)`. The LoRA path is not part of the key.
    fn encode_untagged<E: Encoder>(&self, e: &mut E) {
        match self {
            ExtraKey::Lora { name, .. } => e.atom(name),
            ExtraKey::Mm { identifier, offset } => {
                if e.begin_tuple(2, ObjId::UNIQUE) {
                    e.atom(identifier);
                    e.int(i128::from(*offset));
                    e.end_tuple(2, ObjId::UNIQUE);
                }
            }
            ExtraKey::CacheSalt(salt) => e.atom(salt),
            ExtraKey::PromptEmbeds(digest) => e.bytes(digest, ObjId::UNIQUE),
        }
    }
}

/// The extra-keys value of one block, as vLLM passes it to `hash_block_tokens`:
/// `None`, `tuple(keys)`, or with lookahead tokens `(E, *lookahead)`.
#[derive(Clone, Copy, Debug)]
pub struct BlockExtras<'k, 'a> {
    pub keys: &'k [ExtraKey<'a>],
    /// The lookahead token ids (empty without lookahead).
    pub lookahead: &'k [u32],
    pub tags: &'k TagIds,
    /// Tagged or bare keys.
    pub form: ExtraKeysForm,
}

/// An extra-keys value that may be `None` (the BLAKE3 scheme treats `None` specially).
pub trait ExtraKeysValue: Encode {
    /// Whether the value is Python `None`.
    fn is_none(&self) -> bool;
}

impl BlockExtras<'_, '_> {
    fn encode_keys<E: Encoder>(&self, e: &mut E) {
        if self.keys.is_empty() {
            e.none();
        } else if e.begin_tuple(self.keys.len(), ObjId::UNIQUE) {
            for k in self.keys {
                k.encode(e, self.tags, self.form);
            }
            e.end_tuple(self.keys.len(), ObjId::UNIQUE);
        }
    }
}

impl Encode for BlockExtras<'_, '_> {
    fn encode<E: Encoder>(&self, e: &mut E) {
        if self.lookahead.is_empty() {
            self.encode_keys(e);
            return;
        }
        let len = 1 + self.lookahead.len();
        if e.begin_tuple(len, ObjId::UNIQUE) {
            self.encode_keys(e);
            for &t in self.lookahead {
                e.token(t);
            }
            e.end_tuple(len, ObjId::UNIQUE);
        }
    }
}

impl ExtraKeysValue for BlockExtras<'_, '_> {
    fn is_none(&self) -> bool {
        self.keys.is_empty() && self.lookahead.is_empty()
    }
}

/// A multimodal item of a request: vLLM's `MultiModalFeatureSpec` reduced to what the
/// hash reads (`mm_position.offset`, `mm_position.length`, `identifier`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmFeature<'a> {
    offset: usize,
    length: usize,
    identifier: Atom<'a>,
}

impl<'a> MmFeature<'a> {
    /// Checks the position: `offset + length` must not overflow and `offset` must fit
    /// an `i64` (relative offsets are signed). An `identifier` of `None` is accepted
    /// here and rejected if the scan reaches the item, as vLLM asserts.
    pub fn new(offset: usize, length: usize, identifier: Atom<'a>) -> Result<Self> {
        let end = offset.checked_add(length);
        if end.is_none() || i64::try_from(offset).is_err() {
            return Err(Error::InvalidArgument(format!(
                "multimodal position offset={offset} length={length} is out of range"
            )));
        }
        Ok(Self {
            offset,
            length,
            identifier,
        })
    }

    /// First token of the item.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of placeholder tokens.
    pub fn length(&self) -> usize {
        self.length
    }

    /// One past the last token (checked at construction).
    #[inline]
    pub fn end(&self) -> usize {
        self.offset + self.length
    }

    /// The encoder-cache identifier the key carries.
    pub fn identifier(&self) -> Atom<'a> {
        self.identifier
    }
}

/// The request fields extra keys are made of.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestExtraKeys<'a> {
    /// `(lora_name, lora_path)` when the request has a (truthy) `lora_request`.
    pub lora: Option<(Atom<'a>, Atom<'a>)>,
    /// `request.mm_features`, sorted by offset as vLLM assumes.
    pub mm_features: &'a [MmFeature<'a>],
    /// `request.cache_salt` (keyed only when truthy).
    pub cache_salt: Option<Atom<'a>>,
}

/// vLLM's `_gen_mm_extra_hash_keys`: appends the `("mm", …)` keys of the block
/// `[start, end)` scanning from `start_mm_idx`; returns the next index.
pub fn gen_mm_extra_hash_keys<'a>(
    features: &[MmFeature<'a>],
    start: usize,
    end: usize,
    start_mm_idx: usize,
    out: &mut Vec<ExtraKey<'a>>,
) -> Result<usize> {
    let Some(last) = features.last() else {
        return Ok(start_mm_idx);
    };
    // Past the last item (late prefill, decode): nothing to scan.
    if last.end() <= start {
        return Ok(start_mm_idx);
    }
    let mut curr = start_mm_idx;
    while let Some(f) = features.get(curr) {
        if matches!(f.identifier, Atom::None) {
            return Err(Error::InvalidArgument(format!(
                "multimodal feature {curr} has no identifier"
            )));
        }
        if end <= f.offset {
            // The block has not reached this item.
            break;
        }
        if start >= f.end() {
            // The block is past this item.
            curr += 1;
            continue;
        }
        out.push(ExtraKey::Mm {
            identifier: f.identifier,
            // Both fit i64 (checked by `MmFeature::new` and by the caller's token count).
            offset: f.offset as i64 - start as i64,
        });
        if end >= f.end() {
            // The item ends in this block, which may hold the next one too.
            curr += 1;
        } else {
            break;
        }
    }
    Ok(curr)
}

/// vLLM's `generate_block_hash_extra_keys` for the block `[start, end)`: fills `out`
/// (cleared first) and returns the next multimodal index. `prompt_embeds_digest` is the
/// block's digest when the request has prompt embeddings.
pub fn generate_block_hash_extra_keys<'a>(
    request: &RequestExtraKeys<'a>,
    start: usize,
    end: usize,
    start_mm_idx: usize,
    prompt_embeds_digest: Option<[u8; 32]>,
    out: &mut Vec<ExtraKey<'a>>,
) -> Result<usize> {
    out.clear();
    if let Some((name, path)) = request.lora {
        out.push(ExtraKey::Lora { name, path });
    }
    let next = gen_mm_extra_hash_keys(request.mm_features, start, end, start_mm_idx, out)?;
    if start == 0 {
        if let Some(salt) = request.cache_salt.filter(Atom::is_truthy) {
            out.push(ExtraKey::CacheSalt(salt));
        }
    }
    if let Some(digest) = prompt_embeds_digest {
        out.push(ExtraKey::PromptEmbeds(digest));
    }
    Ok(next)
}

/// vLLM's `generate_lookahead_block_hash_extra_keys`: keys over `[start, hash_end)`,
/// then the index rewinds to the first item that ends after `end`.
pub fn generate_lookahead_block_hash_extra_keys<'a>(
    request: &RequestExtraKeys<'a>,
    start: usize,
    end: usize,
    hash_end: usize,
    start_mm_idx: usize,
    prompt_embeds_digest: Option<[u8; 32]>,
    out: &mut Vec<ExtraKey<'a>>,
) -> Result<usize> {
    let mut idx = generate_block_hash_extra_keys(
        request,
        start,
        hash_end,
        start_mm_idx,
        prompt_embeds_digest,
        out,
    )?;
    while idx > 0 {
        match request.mm_features.get(idx - 1) {
            Some(f) if f.end() > end => idx -= 1,
            _ => break,
        }
    }
    Ok(idx)
}

/// The multimodal index `get_request_block_hasher` starts from for a call whose first
/// new block starts at `start`: 0, or (`start > 0` and the last item ends after
/// `start`) the first item ending after `start`, found by vLLM's binary search
/// (`bisect_left` on `offset + length`).
pub fn initial_mm_index(features: &[MmFeature<'_>], start: usize) -> usize {
    let Some(last) = features.last() else {
        return 0;
    };
    if start == 0 || last.end() <= start {
        return 0;
    }
    // bisect.bisect_left(features, start + 1, key=end), step for step.
    let (mut lo, mut hi) = (0usize, features.len());
    while lo < hi {
        let mid = (lo + hi) / 2;
        if features[mid].end() < start + 1 {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// SHA-256 of a block's prompt-embedding bytes (vLLM hashes
/// `tensor_data(prompt_embeds[start:end])` with SHA-256 whatever the block-hash
/// algorithm), for callers that hold the raw bytes.
pub fn prompt_embeds_digest(block_bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(block_bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::cbor::CborWriter;
    use crate::hash::pickle::PickleWriter;

    fn feat(offset: usize, length: usize, id: &str) -> MmFeature<'_> {
        MmFeature::new(offset, length, Atom::Str(id, ObjId::UNIQUE)).expect("valid")
    }

    fn mm_keys(features: &[MmFeature<'_>], start: usize, end: usize) -> Vec<(String, i64)> {
        let mut out = Vec::new();
        gen_mm_extra_hash_keys(features, start, end, 0, &mut out).expect("ok");
        out.iter()
            .map(|k| match k {
                ExtraKey::Mm {
                    identifier: Atom::Str(s, _),
                    offset,
                } => (s.to_string(), *offset),
                other => panic!("unexpected key {other:?}"),
            })
            .collect()
    }

    #[test]
    fn mm_item_spanning_blocks_has_negative_offsets() {
        let f = [feat(3, 10, "a")];
        assert_eq!(mm_keys(&f, 0, 4), vec![("a".into(), 3)]);
        assert_eq!(mm_keys(&f, 4, 8), vec![("a".into(), -1)]);
        assert_eq!(mm_keys(&f, 8, 12), vec![("a".into(), -5)]);
        assert_eq!(mm_keys(&f, 12, 16), vec![("a".into(), -9)]);
        assert!(mm_keys(&f, 16, 20).is_empty());
    }

    #[test]
    fn several_items_in_one_block_in_order() {
        let f = [feat(1, 2, "a"), feat(4, 1, "b"), feat(7, 5, "c")];
        assert_eq!(
            mm_keys(&f, 0, 8),
            vec![("a".into(), 1), ("b".into(), 4), ("c".into(), 7)]
        );
    }

    #[test]
    fn initial_index_is_first_item_ending_after_start() {
        let f = [feat(0, 4, "a"), feat(4, 4, "b"), feat(10, 4, "c")];
        assert_eq!(initial_mm_index(&f, 0), 0);
        assert_eq!(initial_mm_index(&f, 4), 1);
        assert_eq!(initial_mm_index(&f, 8), 2);
        assert_eq!(initial_mm_index(&f, 14), 0);
    }

    #[test]
    fn salt_only_on_first_block_and_only_when_truthy() {
        let req = RequestExtraKeys {
            cache_salt: Some(Atom::Str("s", ObjId::UNIQUE)),
            ..Default::default()
        };
        let mut out = Vec::new();
        generate_block_hash_extra_keys(&req, 0, 4, 0, None, &mut out).expect("ok");
        assert_eq!(out.len(), 1);
        generate_block_hash_extra_keys(&req, 4, 8, 0, None, &mut out).expect("ok");
        assert!(out.is_empty());
        let empty = RequestExtraKeys {
            cache_salt: Some(Atom::Str("", ObjId::UNIQUE)),
            ..Default::default()
        };
        generate_block_hash_extra_keys(&empty, 0, 4, 0, None, &mut out).expect("ok");
        assert!(out.is_empty());
    }

    #[test]
    fn scanned_item_without_identifier_is_an_error() {
        let f = [MmFeature::new(0, 4, Atom::None).expect("valid position")];
        let mut out = Vec::new();
        assert!(gen_mm_extra_hash_keys(&f, 0, 4, 0, &mut out).is_err());
    }

    #[test]
    fn overflowing_position_is_rejected() {
        assert!(MmFeature::new(usize::MAX, 1, Atom::None).is_err());
        assert!(MmFeature::new(usize::MAX / 2 + 1, 0, Atom::None).is_err());
    }

    /// The untagged block keys `("ad", (img, -3), (img, 2), "s", b"\xab" * 32)`, with
    /// one `img` object (pickle memoizes it), as `BlockExtras` writes them.
    fn untagged_sample(form: ExtraKeysForm, f: impl FnOnce(&BlockExtras<'_, '_>)) {
        let img = Atom::Str("img", ObjId::new(7));
        let keys = [
            ExtraKey::Lora {
                name: Atom::Str("ad", ObjId::UNIQUE),
                path: Atom::Str("/not/keyed", ObjId::UNIQUE),
            },
            ExtraKey::Mm {
                identifier: img,
                offset: -3,
            },
            ExtraKey::Mm {
                identifier: img,
                offset: 2,
            },
            ExtraKey::CacheSalt(Atom::Str("s", ObjId::UNIQUE)),
            ExtraKey::PromptEmbeds([0xab; 32]),
        ];
        let tags = TagIds::default();
        f(&BlockExtras {
            keys: &keys,
            lookahead: &[],
            tags: &tags,
            form,
        });
    }

    #[test]
    fn untagged_keys_pickle_to_golden_bytes() {
        let mut want: Vec<u8> = vec![
            0x80, 0x05, // PROTO 5
            0x95, 67, 0, 0, 0, 0, 0, 0, 0,    // FRAME 67
            b'(', // MARK
            0x8c, 2, b'a', b'd', 0x94, // SHORT_BINUNICODE 'ad', MEMOIZE 0 (name only)
            0x8c, 3, b'i', b'm', b'g', 0x94, // 'img', MEMOIZE 1
            b'J', 0xfd, 0xff, 0xff, 0xff, // BININT -3
            0x86, 0x94, // TUPLE2, MEMOIZE 2: (img, -3), no "mm" tag
            b'h', 1, // BINGET 1: the same img object
            b'K', 2, // BININT1 2
            0x86, 0x94, // TUPLE2, MEMOIZE 3
            0x8c, 1, b's', 0x94, // bare salt 's', MEMOIZE 4
            b'C', 32, // SHORT_BINBYTES, 32 bytes: the bare digest
        ];
        want.extend_from_slice(&[0xab; 32]);
        want.extend_from_slice(&[0x94, b't', 0x94, b'.']); // MEMOIZE 5, TUPLE, MEMOIZE 6, STOP
        untagged_sample(ExtraKeysForm::Untagged, |extras| {
            let (mut buf, mut memo) = (Vec::new(), Vec::new());
            let mut w = PickleWriter::new(&mut buf, &mut memo);
            extras.encode(&mut w);
            assert_eq!(w.finish(), want.as_slice());
        });
    }

    #[test]
    fn untagged_keys_cbor_to_golden_bytes() {
        let mut want: Vec<u8> = vec![
            0x85, // array(5)
            0x62, b'a', b'd', // text(2) "ad"
            0x82, 0x63, b'i', b'm', b'g', 0x22, // [ "img", -3 ]
            0x82, 0x63, b'i', b'm', b'g', 0x02, // [ "img", 2 ] (CBOR has no memo)
            0x61, b's', // text(1) "s"
            0x58, 32, // bytes(32)
        ];
        want.extend_from_slice(&[0xab; 32]);
        untagged_sample(ExtraKeysForm::Untagged, |extras| {
            let mut buf = Vec::new();
            let mut w = CborWriter::new(&mut buf);
            extras.encode(&mut w);
            assert_eq!(w.finish(), want.as_slice());
        });
    }

    #[test]
    fn tagged_and_untagged_differ_only_in_form() {
        let mut bytes = Vec::new();
        for form in [ExtraKeysForm::Tagged, ExtraKeysForm::Untagged] {
            untagged_sample(form, |extras| {
                let mut buf = Vec::new();
                let mut w = CborWriter::new(&mut buf);
                extras.encode(&mut w);
                bytes.push(w.finish().to_vec());
            });
        }
        assert_ne!(bytes[0], bytes[1]);
        assert_eq!(bytes[0][..6], [0x85, 0x83, 0x64, b'l', b'o', b'r']); // ("lora", ...
    }

    #[test]
    fn untagged_scan_of_a_later_call_starts_at_the_last_item() {
        // An earlier item still open at token 8 is not keyed untagged (vLLM 0.30).
        let f = [feat(0, 12, "long"), feat(6, 2, "short")];
        assert_eq!(ExtraKeysForm::Tagged.initial_mm_index(&f, 8), 0);
        assert_eq!(ExtraKeysForm::Untagged.initial_mm_index(&f, 8), 1);
        assert_eq!(ExtraKeysForm::Untagged.initial_mm_index(&f, 0), 0);
        assert_eq!(ExtraKeysForm::Untagged.initial_mm_index(&[], 8), 0);
        let mut out = Vec::new();
        gen_mm_extra_hash_keys(&f, 8, 12, 1, &mut out).expect("ok");
        assert!(
            out.is_empty(),
            "the scan from the last item sees only items from it on"
        );
    }

    #[test]
    fn form_names_round_trip() {
        for form in [ExtraKeysForm::Tagged, ExtraKeysForm::Untagged] {
            assert_eq!(ExtraKeysForm::from_name(form.name()).expect("known"), form);
        }
        assert!(ExtraKeysForm::from_name("bare").is_err());
    }
}
