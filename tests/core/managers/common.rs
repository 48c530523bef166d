//! Shared helpers of the single-type manager tests: group specs as hscache's Python
//! adapter builds them from vLLM's spec objects (`python/hscache/vllm/specs.py`),
//! managers over a layout, requests made of token ids (so that equal token prefixes
//! have equal block hashes, as with vLLM's hasher), and the Scheduler's calls.

#![allow(dead_code)]

use hscache::manager::{
    AllocateSlots, GroupSpec, KVCacheManager, KVCacheManagerConfig, MambaCacheMode, MambaParams,
    ManagerKind, PlainRequest,
};
use hscache::testing::chain_hash;
use hscache::types::{BlockHash, BlockId};

// ---- group specs (the dicts `group_specs` hands the core, field for field) ----------

pub fn fa(block_size: usize) -> GroupSpec {
    GroupSpec::full_attention(block_size)
}

pub fn swa(block_size: usize, window: usize) -> GroupSpec {
    GroupSpec::sliding_window(block_size, window)
}

pub fn chunked_local(block_size: usize, chunk: usize) -> GroupSpec {
    GroupSpec {
        kind: ManagerKind::ChunkedLocal {
            attention_chunk_size: chunk,
        },
        is_full_attention_spec: false,
        spec_class: 3,
        ..fa(block_size)
    }
}

pub fn mamba(block_size: usize, mode: MambaCacheMode, num_speculative_blocks: usize) -> GroupSpec {
    GroupSpec {
        kind: ManagerKind::Mamba(MambaParams {
            mode,
            num_speculative_blocks,
            num_prefill_checkpoint_blocks: 0,
            prefill_checkpoint_alignment: None,
        }),
        ..GroupSpec::mamba(block_size, mode)
    }
}

pub fn cross(block_size: usize) -> GroupSpec {
    GroupSpec {
        kind: ManagerKind::CrossAttention,
        is_full_attention_spec: false,
        is_cross_or_encoder_only: true,
        spec_class: 4,
        ..fa(block_size)
    }
}

pub fn sink(block_size: usize, sink_len: usize) -> GroupSpec {
    GroupSpec {
        kind: ManagerKind::SinkFullAttention { sink_len },
        spec_class: 5,
        ..fa(block_size)
    }
}

pub fn rswa(block_size: usize, rswa_window: usize) -> GroupSpec {
    GroupSpec {
        kind: ManagerKind::Rswa { rswa_window },
        spec_class: 6,
        ..fa(block_size)
    }
}

pub fn ring(block_size: usize) -> GroupSpec {
    GroupSpec {
        kind: ManagerKind::CircularBuffer,
        prefix_cacheable: false,
        is_full_attention_spec: false,
        spec_class: 7,
        ..fa(block_size)
    }
}

// ---- managers -------------------------------------------------------------------------

/// The config of a manager over `groups` with explicit scheduler and hash block sizes
/// (vLLM's resolved values; `hscache_tools.testing.kv_cache.block_sizes` prints them), prefix
/// caching and events on, max model length 8192.
pub fn config(
    groups: Vec<GroupSpec>,
    num_blocks: u32,
    scheduler_block_size: usize,
    hash_block_size: usize,
) -> KVCacheManagerConfig {
    let mut c = KVCacheManagerConfig::full_attention(num_blocks, hash_block_size, 8192);
    c.coordinator.groups = groups;
    c.coordinator.scheduler_block_size = scheduler_block_size;
    c.coordinator.hash_block_size = hash_block_size;
    c.coordinator.enable_kv_cache_events = true;
    c
}

/// A manager over `groups` whose block sizes are all `block_size`.
pub fn manager(groups: Vec<GroupSpec>, num_blocks: u32, block_size: usize) -> KVCacheManager {
    KVCacheManager::new(config(groups, num_blocks, block_size, block_size)).expect("valid layout")
}

/// The same without prefix caching (vLLM's `KVCacheCoordinatorNoPrefixCache`).
pub fn manager_without_caching(
    groups: Vec<GroupSpec>,
    num_blocks: u32,
    block_size: usize,
) -> KVCacheManager {
    let mut c = config(groups, num_blocks, block_size, block_size);
    c.coordinator.enable_caching = false;
    KVCacheManager::new(c).expect("valid layout")
}

// ---- requests -------------------------------------------------------------------------

/// Chained hashes of the full `hash_block_size`-token blocks of `tokens`: equal token
/// prefixes give equal hashes, as vLLM's block hasher does.
pub fn token_hashes(tokens: &[u32], hash_block_size: usize) -> Vec<BlockHash> {
    let mut parent = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .chunks_exact(hash_block_size)
        .enumerate()
        .map(|(i, block)| {
            for &t in block {
                parent = (parent ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
            }
            parent = parent.rotate_left(29) ^ i as u64;
            chain_hash(parent, i as u64)
        })
        .collect()
}

/// A request as the Scheduler sees it: its tokens (prompt + accepted outputs), its
/// computed count and its hashes, kept in step with the tokens.
#[derive(Clone, Debug)]
pub struct Req {
    pub r: PlainRequest,
    pub tokens: Vec<u32>,
    pub hash_block_size: usize,
}

impl Req {
    /// A waiting request whose prompt is `prompt`.
    pub fn new(id: &str, prompt: impl IntoIterator<Item = u32>, hash_block_size: usize) -> Self {
        let tokens: Vec<u32> = prompt.into_iter().collect();
        let mut r = PlainRequest {
            request_id: id.to_owned(),
            num_prompt_tokens: tokens.len(),
            waiting: true,
            ..PlainRequest::default()
        };
        r.num_tokens = tokens.len();
        r.block_hashes = token_hashes(&tokens, hash_block_size);
        Self {
            r,
            tokens,
            hash_block_size,
        }
    }

    pub fn id(&self) -> &str {
        &self.r.request_id
    }

    /// Appends sampled tokens (`append_output_token_ids`).
    pub fn append(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        self.r.num_tokens = self.tokens.len();
        self.r.block_hashes = token_hashes(&self.tokens, self.hash_block_size);
    }
}

/// `tokens` as u32 ids (the Python probes use `range(a, b)`).
pub fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

// ---- the Scheduler's calls ------------------------------------------------------------

/// `get_computed_blocks`: the hit length and every group's hit blocks.
pub fn lookup(m: &mut KVCacheManager, req: &Req) -> (usize, Vec<Vec<BlockId>>) {
    hscache::testing::lookup(m, &req.r)
}

/// `allocate_slots(request, n, ...)` with `hits` (None: no lookup result): every group's
/// new blocks, or None if they do not fit. `args` sets the other parameters.
pub fn allocate(
    m: &mut KVCacheManager,
    req: &Req,
    n: usize,
    hits: Option<(usize, &[Vec<BlockId>])>,
    args: AllocateSlots<'_>,
) -> Option<Vec<Vec<BlockId>>> {
    let args = AllocateSlots {
        num_new_tokens: n,
        num_new_computed_tokens: hits.map_or(0, |(hit, _)| hit),
        ..args
    };
    hscache::testing::allocate_groups(m, &req.r, hits.map(|(_, h)| h), args)
        .expect("allocate_slots")
}

/// What [`admit`] returns: the hit length, every group's hit blocks, every group's new
/// blocks (None: they did not fit).
pub type Admitted = (usize, Vec<Vec<BlockId>>, Option<Vec<Vec<BlockId>>>);

/// The Scheduler admits a waiting request: lookup, then `n` new tokens (None: the
/// rest of the prompt) with the hits. On success the request runs with `hit + n`
/// tokens computed. Returns the hit, the hit blocks and the new blocks.
pub fn admit(
    m: &mut KVCacheManager,
    req: &mut Req,
    n: Option<usize>,
    args: AllocateSlots<'_>,
) -> Admitted {
    let (hit, hits) = lookup(m, req);
    let n = n.unwrap_or(req.r.num_tokens - hit);
    // A miss is vLLM's `empty_kv_cache_blocks` singleton: nothing to adopt.
    let found = hits
        .iter()
        .any(|g| !g.is_empty())
        .then_some((hit, &hits[..]));
    let new = allocate(m, req, n, found, args);
    if new.is_some() {
        req.r.num_computed_tokens = hit + n;
        req.r.waiting = false;
    }
    (hit, hits, new)
}

/// A running request's next chunk of `n` tokens.
pub fn chunk(
    m: &mut KVCacheManager,
    req: &mut Req,
    n: usize,
    args: AllocateSlots<'_>,
) -> Option<Vec<Vec<BlockId>>> {
    let new = allocate(m, req, n, None, args);
    if new.is_some() {
        req.r.num_computed_tokens += n;
    }
    new
}

/// A decode step: `token` was sampled, the request computes it.
pub fn decode(
    m: &mut KVCacheManager,
    req: &mut Req,
    token: u32,
    args: AllocateSlots<'_>,
) -> Option<Vec<Vec<BlockId>>> {
    req.append(&[token]);
    let n = req.r.num_tokens - req.r.num_computed_tokens;
    chunk(m, req, n, args)
}

/// Every group's block table of `rid`.
pub fn tables(m: &KVCacheManager, rid: &str) -> Vec<Vec<BlockId>> {
    (0..m.num_kv_cache_groups())
        .map(|g| m.get_blocks(rid, g).to_vec())
        .collect()
}

/// The free queue, head first.
pub fn queue(m: &KVCacheManager) -> Vec<BlockId> {
    m.block_pool().free_block_queue().get_all_free_blocks()
}

/// The end of a Scheduler step: the worker ran this step's copy-on-write copies, both
/// endpoints are released (in pair order, as vLLM's Scheduler frees them), and the
/// next step starts. Returns the copies.
pub fn end_step(m: &mut KVCacheManager) -> Vec<(BlockId, BlockId)> {
    let copies = m.take_kv_cache_block_copies();
    let retained: Vec<BlockId> = copies.iter().flat_map(|&(s, d)| [s, d]).collect();
    m.free_blocks(&retained).expect("release copy endpoints");
    m.new_step_starts();
    copies
}

/// `(block, ref_cnt, tokens its hash covers)` of every block that holds a reference or
/// a hash (the probes print vLLM's pool this way).
pub fn pool_state(m: &KVCacheManager) -> Vec<(BlockId, u32, Option<u32>)> {
    let pool = m.block_pool();
    (1..pool.num_gpu_blocks())
        .filter(|&b| pool.ref_cnt(b) > 0 || pool.block_hash(b).is_some())
        .map(|b| (b, pool.ref_cnt(b), pool.block_hash_num_tokens(b)))
        .collect()
}

/// `vec![...]` of block-id tables, for terse expectations.
#[macro_export]
macro_rules! t {
    ($([$($b:expr),* $(,)?]),* $(,)?) => { vec![$(vec![$($b as hscache::types::BlockId),*]),*] };
}
