//! Fixtures shared by the cargo tests and the criterion benches: deterministic
//! hash chains and a small request model.

use crate::types::BlockHash;

/// A deterministic stand-in for a chained block hash: block `i` of chain `seed`.
pub fn chain_hash(seed: u64, i: u64) -> BlockHash {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&i.to_le_bytes());
    bytes[16..24].copy_from_slice(
        &(seed ^ i.rotate_left(17))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .to_le_bytes(),
    );
    BlockHash::new(&bytes).expect("32 bytes")
}

/// The hashes of a prompt made of `shared` blocks of chain `prefix_seed` followed
/// by `own` blocks of chain `own_seed` (chained hashes: the suffix depends on the
/// prefix, which the distinct seeds model).
pub fn prompt_hashes(prefix_seed: u64, shared: u64, own_seed: u64, own: u64) -> Vec<BlockHash> {
    (0..shared)
        .map(|i| chain_hash(prefix_seed, i))
        .chain((0..own).map(|i| chain_hash(own_seed, shared + i)))
        .collect()
}

use crate::manager::{
    AllocateSlots, GroupedBlockIds, KVCacheManager, KVCacheManagerConfig, PlainRequest,
};
use crate::types::BlockId;

/// A one-group full-attention manager.
pub fn full_attention_manager(
    num_blocks: u32,
    block_size: usize,
    max_model_len: usize,
    caching: bool,
    events: bool,
    zeroing: bool,
) -> KVCacheManager {
    let mut c = KVCacheManagerConfig::full_attention(num_blocks, block_size, max_model_len);
    c.coordinator.enable_caching = caching;
    c.coordinator.enable_kv_cache_events = events;
    c.coordinator.needs_kv_cache_zeroing = zeroing;
    KVCacheManager::new(c).expect("a valid full-attention config")
}

/// A manager over `groups` (hybrid when there are several) with vLLM's resolved
/// block sizes: scheduler block = lcm of the group block sizes, hash block = their gcd.
pub fn hybrid_manager(
    num_blocks: u32,
    groups: Vec<crate::manager::GroupSpec>,
    max_model_len: usize,
    events: bool,
) -> KVCacheManager {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    let sizes: Vec<usize> = groups.iter().map(|g| g.block_size).collect();
    let hash = sizes.iter().copied().fold(0, gcd);
    let scheduler = sizes.iter().copied().fold(1, |a, b| a / gcd(a, b) * b);
    let mut c = KVCacheManagerConfig::full_attention(num_blocks, hash, max_model_len);
    c.coordinator.groups = groups;
    c.coordinator.scheduler_block_size = scheduler;
    c.coordinator.hash_block_size = hash;
    c.coordinator.enable_kv_cache_events = events;
    c.coordinator.needs_kv_cache_zeroing = c
        .coordinator
        .groups
        .iter()
        .any(super::manager::spec::GroupSpec::is_mamba);
    KVCacheManager::new(c).expect("a valid hybrid config")
}

/// A request of `num_tokens` tokens (all prompt), `num_computed` of them computed,
/// with `hashes`.
pub fn request(
    id: &str,
    num_computed: usize,
    num_tokens: usize,
    hashes: &[BlockHash],
) -> PlainRequest {
    PlainRequest {
        request_id: id.to_owned(),
        num_computed_tokens: num_computed,
        num_tokens,
        num_prompt_tokens: num_tokens,
        block_hashes: hashes.to_vec(),
        ..PlainRequest::default()
    }
}

/// `get_computed_blocks`: the hit length and each group's hit blocks.
pub fn lookup(m: &mut KVCacheManager, req: &PlainRequest) -> (usize, Vec<Vec<BlockId>>) {
    let mut out = vec![Vec::new(); m.num_kv_cache_groups()];
    let (hit, _) = m
        .get_computed_blocks(req, None, &|| Ok(false), &mut out)
        .expect("lookup");
    (hit, out)
}

/// `allocate_slots` with `hits` (per group; `None`: no lookup result): every group's new
/// blocks, or None if they do not fit.
pub fn allocate_groups(
    m: &mut KVCacheManager,
    req: &PlainRequest,
    hits: Option<&[Vec<BlockId>]>,
    args: AllocateSlots<'_>,
) -> crate::Result<Option<Vec<Vec<BlockId>>>> {
    let hit_ids: Option<GroupedBlockIds> = hits.map(|h| h.iter().map(Vec::as_slice).collect());
    let args = AllocateSlots {
        new_computed_blocks: hit_ids.as_ref().map(GroupedBlockIds::view),
        ..args
    };
    let mut out = Vec::new();
    let mut group_ends = smallvec::SmallVec::new();
    if !m.allocate_slots(req, &args, &mut out, &mut group_ends)? {
        return Ok(None);
    }
    let mut start = 0;
    Ok(Some(
        group_ends
            .iter()
            .map(|&end| {
                let group = out[start..end].to_vec();
                start = end;
                group
            })
            .collect(),
    ))
}

/// [`allocate_groups`], every group's new blocks concatenated.
pub fn allocate(
    m: &mut KVCacheManager,
    req: &PlainRequest,
    hits: Option<&[Vec<BlockId>]>,
    args: AllocateSlots<'_>,
) -> crate::Result<Option<Vec<BlockId>>> {
    Ok(allocate_groups(m, req, hits, args)?.map(|groups| groups.concat()))
}

/// Lookup + allocation of a new request, as the Scheduler admits it: the hit length
/// and the request's group-0 table.
pub fn admit(m: &mut KVCacheManager, req: &PlainRequest) -> (usize, Vec<BlockId>) {
    let (hit, hits) = lookup(m, req);
    let args = AllocateSlots {
        num_new_tokens: req.num_tokens - hit,
        num_new_computed_tokens: hit,
        ..Default::default()
    };
    let any = hits.iter().any(|h| !h.is_empty());
    allocate(m, req, any.then_some(&hits[..]), args)
        .expect("allocate")
        .expect("fits");
    (hit, m.get_blocks(&req.request_id, 0).to_vec())
}

/// `n` running requests with distinct prompts of `prompt` tokens (hashed at the
/// manager's hash block size), each allocated and computed with no lookup, ready for
/// a decode token: `allocate_slots(request, 1)` (see [`decode_step`]).
pub fn running_requests(m: &mut KVCacheManager, n: usize, prompt: usize) -> Vec<PlainRequest> {
    let hash_block = m.coordinator().hash_block_size();
    (0..n as u64)
        .map(|i| {
            let hashes = prompt_hashes(i, (prompt / hash_block) as u64, 0, 0);
            let mut r = request(&i.to_string(), 0, prompt + 1, &hashes);
            let args = AllocateSlots {
                num_new_tokens: r.num_tokens,
                ..Default::default()
            };
            allocate(m, &r, None, args)
                .expect("allocate")
                .expect("fits");
            r.num_computed_tokens = prompt;
            r
        })
        .collect()
}

/// One decode step: `allocate_slots(request, 1)` for each of `reqs` (`out` and `ends`:
/// reused buffers). Returns how many fit.
pub fn decode_step(
    m: &mut KVCacheManager,
    reqs: &[PlainRequest],
    out: &mut Vec<BlockId>,
    ends: &mut smallvec::SmallVec<[usize; 4]>,
) -> usize {
    let args = AllocateSlots {
        num_new_tokens: 1,
        ..Default::default()
    };
    reqs.iter()
        .filter(|r| {
            out.clear();
            ends.clear();
            m.allocate_slots(*r, &args, out, ends).expect("decode")
        })
        .count()
}

/// vLLM's HiSparse layout: a source group on a host pool of `host_num_blocks` blocks,
/// an indexer group, one resident group (admission window `max_model_len`) and one hot
/// group of `blocks_per_request` blocks, all of `block_size` tokens.
pub fn hisparse_manager(
    num_blocks: u32,
    host_num_blocks: u32,
    block_size: usize,
    max_model_len: usize,
    blocks_per_request: usize,
    caching: bool,
) -> KVCacheManager {
    use crate::manager::{GroupSpec, ManagerKind};
    let aux = |kind: ManagerKind, class: u32, window: Option<usize>| GroupSpec {
        kind,
        prefix_cacheable: false,
        is_full_attention_spec: false,
        is_attention_spec: false,
        dcp_sharded: false,
        spec_class: class,
        max_admission_blocks_per_request: window,
        ..GroupSpec::full_attention(block_size)
    };
    let groups = vec![
        GroupSpec {
            kind: ManagerKind::HiSparseSource { host_num_blocks },
            ..GroupSpec::full_attention(block_size)
        },
        GroupSpec {
            spec_class: 1,
            ..GroupSpec::full_attention(block_size)
        },
        aux(
            ManagerKind::HiSparseResident,
            2,
            Some(max_model_len.div_ceil(block_size)),
        ),
        aux(ManagerKind::HiSparseHot { blocks_per_request }, 3, None),
    ];
    let mut c = KVCacheManagerConfig::full_attention(num_blocks, block_size, max_model_len);
    c.coordinator.groups = groups;
    c.coordinator.enable_caching = caching;
    c.coordinator.enable_kv_cache_events = true;
    KVCacheManager::new(c).expect("a valid HiSparse config")
}
