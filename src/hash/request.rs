//! The request block hasher: the hashes of a request's new full blocks, incrementally.
//!
//! Mirrors the closure of vLLM 0.33 `vllm/v1/core/kv_cache_utils.py`
//! `get_request_block_hasher(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens)`,
//! which `Request.update_block_hashes` calls whenever tokens are appended and whose
//! result vLLM appends to `request.block_hashes`.
//!
//! Key properties:
//! - O(new full blocks): the caller hands only the tokens from the first unhashed block
//!   on and the last known hash; nothing before is re-read or re-hashed.
//! - A block `[s, s + B)` is hashed once `s + B + L <= num_tokens` (`L` lookahead
//!   tokens, which join its extra keys; see [`crate::extra_keys`]).
//! - Validate, then compute: on `Err` nothing was appended to the output.

use super::{resolve_parent, BlockHasher, HashAlgo};
use crate::error::{Error, Result};
use crate::extra_keys::{
    generate_block_hash_extra_keys, generate_lookahead_block_hash_extra_keys, BlockExtras,
    ExtraKey, ExtraKeysForm, RequestExtraKeys, TagIds,
};
use crate::types::BlockHash;

/// What one call reads of a request.
#[derive(Clone, Copy, Debug)]
pub struct RequestHashInput<'a> {
    /// `len(request.block_hashes)`: blocks hashed before this call.
    pub num_hashed_blocks: usize,
    /// `request.block_hashes[-1]`, if any.
    pub parent: Option<&'a [u8]>,
    /// `kv_cache_utils.NONE_HASH`, the parent of the first block.
    pub none_hash: &'a [u8],
    /// `request.all_token_ids[num_hashed_blocks * hash_block_size:]`.
    pub tokens: &'a [u32],
    /// LoRA, multimodal items and cache salt.
    pub keys: RequestExtraKeys<'a>,
    /// With prompt embeddings: the SHA-256 digest of each new block's embedding rows
    /// (`[start, end + L)`), in block order.
    pub prompt_embeds_digests: Option<&'a [[u8; 32]]>,
}

/// `get_request_block_hasher`'s configuration and reusable buffers.
#[derive(Debug)]
pub struct RequestBlockHasher {
    hasher: BlockHasher,
    hash_block_size: usize,
    num_lookahead_tokens: usize,
    tags: TagIds,
    form: ExtraKeysForm,
}

impl RequestBlockHasher {
    /// `hash_block_size` must be positive.
    pub fn new(
        algo: HashAlgo,
        hash_block_size: usize,
        num_lookahead_tokens: usize,
    ) -> Result<Self> {
        if hash_block_size == 0 {
            return Err(Error::InvalidArgument(
                "hash_block_size must be positive".into(),
            ));
        }
        Ok(Self {
            hasher: BlockHasher::new(algo),
            hash_block_size,
            num_lookahead_tokens,
            tags: TagIds::default(),
            form: ExtraKeysForm::default(),
        })
    }

    /// Writes the extra keys in `form` (tagged by default; see [`ExtraKeysForm`]).
    pub fn set_extra_keys_form(&mut self, form: ExtraKeysForm) {
        self.form = form;
    }

    /// The extra-keys form.
    pub fn extra_keys_form(&self) -> ExtraKeysForm {
        self.form
    }

    /// Uses `tags` as the identities of the tag strings (see [`TagIds`]).
    pub fn set_tag_ids(&mut self, tags: TagIds) {
        self.tags = tags;
    }

    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.hasher.algo()
    }

    /// Tokens per hashed block.
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// `num_hash_lookahead_tokens`.
    pub fn num_lookahead_tokens(&self) -> usize {
        self.num_lookahead_tokens
    }

    /// How many new blocks a call with `num_new_tokens` tokens (counted from the first
    /// unhashed block) hashes.
    #[inline]
    pub fn num_new_blocks(&self, num_new_tokens: usize) -> usize {
        num_new_tokens.saturating_sub(self.num_lookahead_tokens) / self.hash_block_size
    }

    /// Appends the hashes of the request's new full blocks to `out`.
    pub fn hash_new_blocks(
        &mut self,
        input: &RequestHashInput<'_>,
        out: &mut Vec<BlockHash>,
    ) -> Result<()> {
        let bs = self.hash_block_size;
        let la = self.num_lookahead_tokens;
        let n = self.num_new_blocks(input.tokens.len());
        if n == 0 {
            return Ok(());
        }
        let first = input
            .num_hashed_blocks
            .checked_mul(bs)
            .filter(|f| f.checked_add(input.tokens.len()).is_some())
            .filter(|f| i64::try_from(f + input.tokens.len()).is_ok())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} hashed blocks of {bs} tokens overflow the token index",
                    input.num_hashed_blocks
                ))
            })?;
        if let Some(d) = input.prompt_embeds_digests {
            if d.len() < n {
                return Err(Error::InvalidArgument(format!(
                    "{} prompt-embeds digests for {n} new blocks",
                    d.len()
                )));
            }
        }

        let mut mm_idx = self.form.initial_mm_index(input.keys.mm_features, first);
        let mut keys: Vec<ExtraKey<'_>> = Vec::new();
        let mut hashes = Vec::with_capacity(n);
        let mut parent: Option<BlockHash> = None;
        for k in 0..n {
            let rel = k * bs;
            let (start, end) = (first + rel, first + rel + bs);
            let digest = input.prompt_embeds_digests.map(|d| d[k]);
            let lookahead = if la > 0 {
                mm_idx = generate_lookahead_block_hash_extra_keys(
                    &input.keys,
                    start,
                    end,
                    end + la,
                    mm_idx,
                    digest,
                    &mut keys,
                )?;
                &input.tokens[rel + bs..rel + bs + la]
            } else {
                mm_idx = generate_block_hash_extra_keys(
                    &input.keys,
                    start,
                    end,
                    mm_idx,
                    digest,
                    &mut keys,
                )?;
                &[]
            };
            let extras = BlockExtras {
                keys: &keys,
                lookahead,
                tags: &self.tags,
                form: self.form,
            };
            let parent_bytes = match &parent {
                Some(p) => p.as_bytes(),
                None => resolve_parent(input.parent, input.none_hash),
            };
            let h = self
                .hasher
                .hash_block(parent_bytes, &input.tokens[rel..rel + bs], &extras);
            hashes.push(h);
            parent = Some(h);
        }
        out.extend_from_slice(&hashes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(tokens: &[u32], num_hashed_blocks: usize) -> RequestHashInput<'_> {
        RequestHashInput {
            num_hashed_blocks,
            parent: None,
            none_hash: &[9u8; 32],
            tokens,
            keys: RequestExtraKeys::default(),
            prompt_embeds_digests: None,
        }
    }

    #[test]
    fn only_full_blocks_and_lookahead_delays_the_last() {
        let tokens: Vec<u32> = (0..10).collect();
        let mut h = RequestBlockHasher::new(HashAlgo::Sha256, 4, 0).expect("valid");
        let mut out = Vec::new();
        h.hash_new_blocks(&input(&tokens, 0), &mut out).expect("ok");
        assert_eq!(out.len(), 2);
        let mut la = RequestBlockHasher::new(HashAlgo::Sha256, 4, 2).expect("valid");
        let mut out2 = Vec::new();
        la.hash_new_blocks(&input(&tokens, 0), &mut out2)
            .expect("ok");
        assert_eq!(out2.len(), 2);
        let mut out3 = Vec::new();
        la.hash_new_blocks(&input(&tokens[..9], 0), &mut out3)
            .expect("ok");
        assert_eq!(out3.len(), 1);
        assert_ne!(out[0], out2[0], "lookahead tokens join the key");
    }

    #[test]
    fn incremental_equals_one_shot() {
        let tokens: Vec<u32> = (100..164).collect();
        for algo in HashAlgo::ALL {
            let mut h = RequestBlockHasher::new(algo, 8, 1).expect("valid");
            let mut all = Vec::new();
            h.hash_new_blocks(&input(&tokens, 0), &mut all).expect("ok");
            let mut inc = Vec::new();
            for n in 1..=tokens.len() {
                let first = inc.len() * 8;
                let parent = inc.last().map(|p: &BlockHash| p.as_bytes().to_vec());
                let mut req = input(&tokens[first..n], inc.len());
                req.parent = parent.as_deref();
                let mut new = Vec::new();
                h.hash_new_blocks(&req, &mut new).expect("ok");
                inc.extend(new);
            }
            assert_eq!(all, inc, "{algo:?}");
        }
    }

    #[test]
    fn too_few_prompt_embeds_digests_is_an_error_and_appends_nothing() {
        let tokens: Vec<u32> = (0..8).collect();
        let mut h = RequestBlockHasher::new(HashAlgo::Sha256Cbor, 4, 0).expect("valid");
        let digests = [[0u8; 32]];
        let mut req = input(&tokens, 0);
        req.prompt_embeds_digests = Some(&digests);
        let mut out = Vec::new();
        assert!(h.hash_new_blocks(&req, &mut out).is_err());
        assert!(out.is_empty());
    }

    #[test]
    fn zero_block_size_is_rejected() {
        assert!(RequestBlockHasher::new(HashAlgo::Sha256, 0, 0).is_err());
    }
}
