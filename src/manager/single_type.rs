//! `SingleTypeManager`: the per-group hooks every KV-cache group's manager
//! implements, and the base behaviour most of them share.
//!
//! Mirrors vLLM 0.33 `v1/core/single_type_kv_cache_manager.py::SingleTypeKVCacheManager`.
//! The trait's default methods are vLLM's base-class methods; each file beside this
//! one (`full_attention.rs`, `sliding_window.rs`, ...) overrides what its vLLM
//! subclass overrides, and nothing else. The free functions `base_*` are those
//! defaults, callable by overriders the way a subclass calls `super()`.
//!
//! Key properties:
//! - A manager holds no per-request block tables: the coordinator's one request
//!   table holds a [`GroupBlocks`] per group and hands each manager its own.
//!   Per-request state only one kind needs (Mamba's) lives in that manager, keyed
//!   by the request's slot in the table.
//! - Hooks that change state never fail on input: the coordinator validated the
//!   call and planned its hash reads first. An `Err` from them means a broken
//!   invariant and poisons the manager.
//!
//! A manager that never hits (vLLM's circular buffer, HiSparse's auxiliary groups)
//! takes its two hooks from `never_hit_hooks!` instead of writing them again.
//!
//! Adding a single-type manager: a file here implementing [`SingleTypeManager`]
//! (override only what the vLLM class overrides), a
//! [`ManagerKind`](super::spec::ManagerKind) variant in `spec.rs`, one line in
//! `registry.rs`'s `new_manager`, the spec's mapping in `python/hscache/vllm/specs.py`,
//! and a differential config in `tests/vllm_diff/`.
//!
//! This file owns the trait (vLLM's base class, hook by hook) with each default's
//! body beside it (the `base_*` functions, so an override reads against what it
//! replaces), the state every manager shares ([`ManagerBase`]), the per-request
//! tables ([`GroupBlocks`], [`RequestState`]) and the queries the coordinator hands
//! the hooks.

use smallvec::SmallVec;

use super::spec::GroupSpec;
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::types::{cdiv, BlockHashSource, BlockId, NULL_BLOCK_ID};

/// One request's block table in one group (vLLM's `req_to_blocks[id]`,
/// `num_cached_block[id]` and `_partial_hit_reqs[id]`).
#[derive(Clone, Debug, Default)]
pub struct GroupBlocks {
    /// The block table; may hold the null block where the group keeps nothing.
    pub blocks: Vec<BlockId>,
    /// Leading blocks already registered in the prefix cache. `Some` marks a
    /// request that adopted its hits (or cached a block): it is running.
    pub num_cached_block: Option<usize>,
    /// A prefix hit that ends inside block `.0`, shared block `.1`: copied on write
    /// at the next allocation.
    pub partial_hit: Option<(usize, BlockId)>,
}

impl GroupBlocks {
    /// Whether the request adopted its hits (or cached a block) in this group: it
    /// is running, and cannot adopt hits again.
    #[inline]
    pub fn is_running(&self) -> bool {
        self.num_cached_block.is_some()
    }
}

/// One request's tables in every group (the coordinator's request table holds one
/// per request; HiSparse's coordinator reads them too).
#[derive(Clone, Debug, Default)]
pub struct RequestState {
    pub groups: SmallVec<[GroupBlocks; 2]>,
    /// The last batch this request was checked in (batched calls).
    pub batch_epoch: u64,
}

impl RequestState {
    /// Whether the request is running in some group ([`GroupBlocks::is_running`]).
    #[inline]
    pub fn is_running(&self) -> bool {
        self.groups.iter().any(GroupBlocks::is_running)
    }
}

/// The refusal of prefix hits handed to a running request (the one rule, wherever
/// a stage meets it).
#[cold]
#[inline(never)]
pub fn running_cannot_adopt(request_id: &str) -> Error {
    Error::InvalidArgument(format!(
        "request {request_id:?} is already running and cannot adopt prefix hits"
    ))
}

/// A copy-on-write pair queued for the worker: `(source, copy)`; both hold an extra
/// reference until the Scheduler frees them after the copy ran.
pub type CowCopy = (BlockId, BlockId);

/// A Mamba boundary state handed to a KV connector: `(request id, group id, block,
/// boundary tokens)` (vLLM's `_pending_boundary_state_offloads`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundaryOffload {
    pub request_id: Box<str>,
    pub group_id: u32,
    pub block: BlockId,
    pub num_tokens: usize,
}

/// State and parameters every manager has (vLLM's base-class attributes).
#[derive(Clone, Debug)]
pub struct ManagerBase {
    pub spec: GroupSpec,
    pub group_id: u32,
    /// Tokens per block: the spec's, scaled by DCP for sharded specs.
    pub block_size: usize,
    pub dcp_world_size: usize,
    pub pcp_world_size: usize,
    pub scheduler_block_size: usize,
    /// Tokens per hash block (the pool's).
    pub hash_block_size: usize,
    /// Tokens after each block its hash also covers (the pool's).
    pub num_hash_lookahead_tokens: usize,
    /// The coordinator's `use_eagle`: Mamba checkpoints follow EAGLE's replay
    /// boundary (vLLM's `drop_eagle_checkpoint_block`).
    pub eagle_checkpoints: bool,
    /// Hit lengths are multiples of this (the hybrid coordinator may lower it to
    /// the hash block size for partial hits).
    pub cache_hit_alignment_tokens: usize,
    pub enable_caching: bool,
    /// Record newly allocated block ids for worker-side zeroing.
    pub record_new_block_ids: bool,
    pub new_block_ids: Vec<BlockId>,
    /// This group's hits drop the EAGLE block (set by the coordinator).
    pub use_eagle: bool,
    /// Mamba shared-prefix checkpoints (set by the facade).
    pub shared_prefix_checkpoint: bool,
    /// vLLM 0.30's partial prompt tail (`VllmRules::partial_tail_at_prompt_floor`, set
    /// with the rules): full attention keys it at `floor(prompt / hash block)`.
    pub partial_tail_at_prompt_floor: bool,
    pub pending_cow_copies: Vec<CowCopy>,
    pub pending_boundary_state_offloads: Vec<BoundaryOffload>,
}

impl ManagerBase {
    /// The base of a manager for `spec` as group `group_id`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: GroupSpec,
        group_id: u32,
        enable_caching: bool,
        scheduler_block_size: usize,
        hash_block_size: usize,
        dcp_world_size: usize,
        pcp_world_size: usize,
        needs_kv_cache_zeroing: bool,
    ) -> Self {
        Self {
            block_size: spec.manager_block_size(dcp_world_size),
            dcp_world_size: spec.effective_cp(dcp_world_size),
            pcp_world_size: spec.effective_cp(pcp_world_size),
            record_new_block_ids: needs_kv_cache_zeroing && spec.zeroes_new_blocks(),
            spec,
            group_id,
            scheduler_block_size,
            hash_block_size,
            num_hash_lookahead_tokens: 0,
            eagle_checkpoints: false,
            cache_hit_alignment_tokens: scheduler_block_size,
            enable_caching,
            new_block_ids: Vec::new(),
            use_eagle: false,
            shared_prefix_checkpoint: false,
            partial_tail_at_prompt_floor: false,
            pending_cow_copies: Vec::new(),
            pending_boundary_state_offloads: Vec::new(),
        }
    }

    /// The prefix hit ends inside one of this group's blocks (vLLM's
    /// `_has_partial_local_hit`): the shared tail block needs copy-on-write.
    #[inline]
    pub fn has_partial_local_hit(&self, hits: &[BlockId], num_local: usize) -> bool {
        !hits.is_empty() && num_local % self.block_size != 0
    }

    /// `get_new_blocks(n)` appended to the table (and to `out`, and recorded for
    /// zeroing when asked).
    pub(crate) fn grow(
        &mut self,
        pool: &mut BlockPool,
        blocks: &mut Vec<BlockId>,
        n: usize,
        record: bool,
        out: Option<&mut Vec<BlockId>>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let start = blocks.len();
        pool.get_new_blocks(n, blocks)?;
        if let Some(out) = out {
            out.extend_from_slice(&blocks[start..]);
        }
        if record {
            self.new_block_ids.extend_from_slice(&blocks[start..]);
        }
        Ok(())
    }
}

/// A prefix-hit lookup for the groups in `group_ids` (which share one spec).
pub struct HitQuery<'a> {
    /// The request's hashes, one per hash block.
    pub block_hashes: &'a dyn BlockHashSource,
    pub max_length: usize,
    pub group_ids: &'a [u32],
    pub drop_eagle_block: bool,
    pub alignment_tokens: usize,
}

/// `get_num_blocks_to_allocate`'s arguments.
#[derive(Clone, Copy)]
pub struct NumBlocksQuery<'a> {
    pub request_id: &'a str,
    pub num_tokens: usize,
    pub new_computed_blocks: &'a [BlockId],
    pub total_computed_tokens: usize,
    pub num_local_computed_tokens: usize,
    pub num_tokens_main_model: usize,
    pub apply_admission_cap: bool,
    pub prefill_end: usize,
}

/// `cache_blocks`' arguments.
pub struct CacheQuery<'a> {
    pub request_id: &'a str,
    pub block_hashes: &'a dyn BlockHashSource,
    /// Tokens this group may cache (the coordinator's cacheable count).
    pub num_tokens: usize,
    pub retention_interval: Option<usize>,
    /// Token positions a replaying request resumes at (may be negative, as in vLLM,
    /// for an empty prompt).
    pub replay_boundaries: &'a [i64],
    pub num_prompt_tokens: usize,
    pub num_computed_tokens: usize,
    pub shared_prefix_boundary: usize,
}

/// What a steady-step check knows of an `allocate_slots` call for a running
/// request that adopts nothing ([`SingleTypeManager::is_steady`]).
#[derive(Clone, Copy, Debug)]
pub struct SteadyQuery {
    /// Slots the call needs (new and lookahead tokens included).
    pub num_tokens: usize,
    /// Tokens of the main model (no lookahead): Mamba "align" sizes by these.
    pub num_tokens_main_model: usize,
    /// `request.num_computed_tokens` (the query's start).
    pub num_computed_tokens: usize,
    /// Computed tokens the workers have processed (in-flight ones excluded).
    pub processed_computed_tokens: usize,
    /// Tokens this group would cache in the call (the coordinator's cacheable
    /// count); `None` when the call caches nothing (caching off or delayed).
    pub cacheable_tokens: Option<usize>,
    /// `request.num_prompt_tokens`, read only where some group's caching needs
    /// it on a steady call (`FieldNeeds::steady_reads_prompt`), else 0.
    pub num_prompt_tokens: usize,
}

/// `reachable_block_mask`'s arguments.
pub struct MaskQuery<'a> {
    pub start_block: usize,
    pub end_block: usize,
    pub alignment_tokens: usize,
    pub use_eagle: bool,
    pub retention_interval: Option<usize>,
    pub reachable_boundaries: &'a [i64],
}

/// Refuses prefix hits handed to a group whose manager never finds any
/// (`kind` names it in the error: "HiSparse hot", "cross-attention").
pub fn reject_prefix_hits(hits: &[BlockId], kind: &str) -> Result<()> {
    if hits.is_empty() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{kind} groups take no prefix hits"
        )))
    }
}

/// The hooks of a manager that never hits: vLLM's `CircularBufferManager` and
/// HiSparse's `_HiSparseAuxiliaryManager` (resident and hot groups), whose
/// `find_longest_cache_hit` finds nothing and whose `cache_blocks` keeps nothing.
/// Expands inside an `impl SingleTypeManager` block.
macro_rules! never_hit_hooks {
    () => {
        fn find_longest_cache_hit(
            &self,
            _pool: &$crate::pool::BlockPool,
            _q: &$crate::manager::single_type::HitQuery<'_>,
            _out: &mut [Vec<$crate::types::BlockId>],
        ) -> $crate::error::Result<usize> {
            Ok(0)
        }

        fn cache_blocks(
            &mut self,
            _pool: &mut $crate::pool::BlockPool,
            _slot: u32,
            _req: &mut $crate::manager::single_type::GroupBlocks,
            _q: &$crate::manager::single_type::CacheQuery<'_>,
        ) -> $crate::error::Result<()> {
            Ok(())
        }
    };
}
pub(crate) use never_hit_hooks;

/// The concrete manager behind a `dyn SingleTypeManager`, for the kind-typed views
/// (`registry.rs`: `mamba()`, `hisparse_hot()`, ...), so that this trait names none
/// of its implementors.
pub trait AsAny: std::any::Any {
    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// vLLM's per-type manager hooks (see module docs).
pub trait SingleTypeManager: AsAny + std::fmt::Debug + Send + Sync {
    fn base(&self) -> &ManagerBase;
    fn base_mut(&mut self) -> &mut ManagerBase;

    /// Tokens at the start that attention no longer reads (freed, or never kept).
    fn get_num_skipped_tokens(&self, _num_computed_tokens: usize) -> usize {
        0
    }

    /// The longest prefix hit of `q.group_ids` (one list per group in `out`) and its
    /// length in tokens. Never changes ref counts.
    fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        q: &HitQuery<'_>,
        out: &mut [Vec<BlockId>],
    ) -> Result<usize>;

    /// Whether a call for the running request in `slot` (no hits adopted) leaves
    /// this group exactly as it is: no skipped block to free, none to allocate, no
    /// copy-on-write pending, no per-request state to update, and nothing to cache
    /// beyond new full blocks (those are decided apart, by the coordinator). Types
    /// whose calls have other effects keep the default, `false`: the general path.
    fn is_steady(&self, _slot: u32, _req: &GroupBlocks, _q: &SteadyQuery) -> bool {
        false
    }

    /// A fingerprint of the per-request state this type keeps beside the request's
    /// table (for `state_digest`; 0 when it keeps none).
    fn request_state_digest(&self, _slot: u32) -> u64 {
        0
    }

    /// Blocks this group takes from the free queue for the call (Mamba "align" may
    /// report a negative count, which offsets the other groups, as in vLLM).
    fn get_num_blocks_to_allocate(
        &mut self,
        pool: &BlockPool,
        _slot: u32,
        req: Option<&GroupBlocks>,
        q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        base_get_num_blocks_to_allocate(self, pool, req, q)
    }

    /// Adopts a new request's prefix hits (touching them).
    fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        _request_id: &str,
        req: &mut GroupBlocks,
        hits: &[BlockId],
        num_local: usize,
        num_external: usize,
    ) -> Result<()> {
        base_add_local_computed_blocks(self, pool, req, hits, num_local, num_external)
    }

    /// Allocates blocks for tokens a KV connector computed.
    fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        _request_id: &str,
        req: &mut GroupBlocks,
        num_local: usize,
        num_external: usize,
        record_for_zeroing: bool,
    ) -> Result<()> {
        base_allocate_external_computed_blocks(
            self,
            pool,
            req,
            num_local,
            num_external,
            record_for_zeroing,
        )
    }

    /// Grows the table to `num_tokens` slots; the new blocks go to `out`.
    #[allow(clippy::too_many_arguments)]
    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        _request_id: &str,
        req: &mut GroupBlocks,
        num_tokens: usize,
        _num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        base_allocate_new_blocks(self, pool, req, num_tokens, out)
    }

    /// Registers the request's newly full blocks in the prefix cache.
    fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        req: &mut GroupBlocks,
        q: &CacheQuery<'_>,
    ) -> Result<()> {
        base_cache_blocks(self, pool, req, q).map(|_| ())
    }

    /// Which blocks of `[start_block, end_block)` are worth caching (None: all).
    fn reachable_block_mask(&self, _q: &MaskQuery<'_>) -> Option<Vec<bool>> {
        None
    }

    /// Frees blocks attention no longer reads, replacing them with the null block.
    fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        _slot: u32,
        req: &mut GroupBlocks,
        processed_computed_tokens: usize,
        _num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        base_remove_skipped_blocks(self, pool, req, processed_computed_tokens)
    }

    /// Forgets the request's per-group bookkeeping (not its table, which the
    /// coordinator pops); `request_id` names it in hand-offs.
    fn pop_request(&mut self, _slot: u32, _request_id: &str) {}

    /// Hash indices (of the request's hash list) that `cache_blocks` may read
    /// outside the run of newly full blocks: partial-entry boundaries.
    /// `num_tokens`: the group's cacheable tokens; `query_end`: the tokens the call
    /// computes up to (capped at `request.num_tokens`), from which an allocation
    /// derives checkpoint positions before it caches.
    fn extra_hash_reads(
        &self,
        _slot: u32,
        _num_prompt_tokens: usize,
        _num_hashes: usize,
        _num_tokens: usize,
        _query_end: usize,
        _out: &mut SmallVec<[usize; 4]>,
    ) {
    }

    /// A new scheduler step starts.
    fn new_step_starts(&mut self) {}

    /// A finishing producer's partial tail for a connector: `(group, block,
    /// tokens)`; Mamba "align" only.
    fn finalize_partial_tail_offload(
        &mut self,
        _slot: u32,
        _num_computed_tokens: usize,
        _num_in_flight_tokens: usize,
    ) -> Option<(u32, BlockId, usize)> {
        None
    }

    /// The blocks `pop_blocks_for_free` hands back for this group (allocation
    /// order, leading nulls trimmed unless `keep_null_head`: vLLM 0.32 keeps them),
    /// appended to `out`: the table by default.
    fn blocks_for_free(
        &self,
        _request_id: &str,
        req: &GroupBlocks,
        keep_null_head: bool,
        out: &mut Vec<BlockId>,
    ) {
        let head = if keep_null_head {
            0
        } else {
            null_head_len(&req.blocks)
        };
        out.extend_from_slice(&req.blocks[head..]);
    }

    /// vLLM's `retains_longer_hit`: the group keeps its own (longer) hit instead of
    /// the reconciled one, until the facade trims it to the local and external
    /// tokens (HiSparse's source group).
    fn retains_longer_hit(&self) -> bool {
        false
    }

    /// The pool this group's blocks come from when it is not the device pool
    /// (HiSparse's source group: the host pool).
    fn host_pool(&self) -> Option<&BlockPool> {
        None
    }
}

/// vLLM's base `get_num_blocks_to_allocate`.
pub fn base_get_num_blocks_to_allocate<M: SingleTypeManager + ?Sized>(
    m: &M,
    pool: &BlockPool,
    req: Option<&GroupBlocks>,
    q: &NumBlocksQuery<'_>,
) -> Result<i64> {
    let base = m.base();
    let bs = base.block_size;
    let mut required = cdiv(q.num_tokens, bs);
    if q.apply_admission_cap {
        if let Some(cap) = base.spec.max_admission_blocks_per_request {
            required = required.min(cap);
        }
    }
    let have = req.map_or(0, |r| r.blocks.len());
    if req.is_some_and(GroupBlocks::is_running) {
        if !q.new_computed_blocks.is_empty() {
            return Err(running_cannot_adopt(q.request_id));
        }
        return Ok(required.saturating_sub(have) as i64);
    }
    let skipped_blocks = m.get_num_skipped_tokens(q.total_computed_tokens) / bs;
    let local_blocks = q.new_computed_blocks.len() + have;
    let mut new = required.saturating_sub(skipped_blocks.max(local_blocks));
    let skipped_hits = skipped_blocks.saturating_sub(have);
    let evictable = q
        .new_computed_blocks
        .iter()
        .skip(skipped_hits)
        .filter(|&&b| b != NULL_BLOCK_ID && pool.ref_cnt(b) == 0)
        .count();
    if base.has_partial_local_hit(q.new_computed_blocks, q.num_local_computed_tokens) {
        new += 1;
    }
    Ok((new + evictable) as i64)
}

/// vLLM's base `add_local_computed_blocks`.
pub fn base_add_local_computed_blocks<M: SingleTypeManager + ?Sized>(
    m: &mut M,
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    hits: &[BlockId],
    num_local: usize,
    num_external: usize,
) -> Result<()> {
    let bs = m.base().block_size;
    let skipped = m.get_num_skipped_tokens(num_local + num_external) / bs;
    let hits = &hits[skipped.min(hits.len())..];
    if m.base().enable_caching {
        pool.touch(hits)?;
    } else if !hits.is_empty() {
        return Err(Error::InvalidArgument(
            "computed blocks must be empty when prefix caching is disabled".into(),
        ));
    }
    req.blocks
        .extend(std::iter::repeat_n(NULL_BLOCK_ID, skipped));
    req.blocks.extend_from_slice(hits);
    req.num_cached_block = Some(req.blocks.len());
    if m.base().has_partial_local_hit(hits, num_local) {
        let block_idx = num_local / bs;
        req.partial_hit = hits.last().map(|&b| (block_idx, b));
        req.num_cached_block = Some(block_idx);
    }
    Ok(())
}

/// vLLM's base `allocate_external_computed_blocks`.
pub fn base_allocate_external_computed_blocks<M: SingleTypeManager + ?Sized>(
    m: &mut M,
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    num_local: usize,
    num_external: usize,
    record_for_zeroing: bool,
) -> Result<()> {
    let total = num_local + num_external;
    let skipped = m.get_num_skipped_tokens(total);
    let num_external = if skipped > 0 {
        num_external.min(total - skipped.min(total))
    } else {
        num_external
    };
    if num_external == 0 {
        return Ok(());
    }
    let base = m.base_mut();
    let n = cdiv(total, base.block_size).saturating_sub(req.blocks.len());
    let record = base.record_new_block_ids && record_for_zeroing;
    base.grow(pool, &mut req.blocks, n, record, None)
}

/// vLLM's base `allocate_new_blocks` (including the copy-on-write redirect of a
/// partial hit, `_apply_cow`).
pub fn base_allocate_new_blocks<M: SingleTypeManager + ?Sized>(
    m: &mut M,
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    num_tokens: usize,
    out: &mut Vec<BlockId>,
) -> Result<()> {
    let base = m.base_mut();
    if let Some((block_idx, source)) = req.partial_hit.take() {
        // The copy leads the returned blocks (vLLM: `cow_blocks + new_blocks`).
        let at = out.len();
        pool.get_new_blocks(1, out)?;
        let cow = out[at];
        apply_cow(base, pool, req, block_idx, source, cow)?;
        base.new_block_ids.push(cow);
    }
    let n = cdiv(num_tokens, base.block_size).saturating_sub(req.blocks.len());
    let record = base.record_new_block_ids;
    base.grow(pool, &mut req.blocks, n, record, Some(out))
}

/// vLLM's `_apply_cow`: the request's table points at the private copy; both
/// endpoints keep a reference until the worker's copy ran.
pub(crate) fn apply_cow(
    base: &mut ManagerBase,
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    block_idx: usize,
    source: BlockId,
    cow: BlockId,
) -> Result<()> {
    if req.blocks.get(block_idx) != Some(&source) || source == NULL_BLOCK_ID {
        return Err(Error::Internal(format!(
            "copy-on-write source {source} is not block {block_idx} of the request"
        )));
    }
    req.blocks[block_idx] = cow;
    base.pending_cow_copies.push((source, cow));
    pool.retain(cow);
    Ok(())
}

/// The block range `cache_blocks(num_tokens)` registers: `(num_cached, num_full)`.
#[inline]
pub fn cache_range(
    base: &ManagerBase,
    pool: &BlockPool,
    req: &GroupBlocks,
    num_hashes: usize,
    num_tokens: usize,
) -> (usize, usize) {
    let num_cached = req.num_cached_block.unwrap_or(0);
    let num_hashed_tokens = num_hashes * pool.hash_block_size();
    (
        num_cached,
        num_tokens.min(num_hashed_tokens) / base.block_size,
    )
}

/// vLLM's base `cache_blocks`; returns whether blocks were registered.
pub fn base_cache_blocks<M: SingleTypeManager + ?Sized>(
    m: &mut M,
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    q: &CacheQuery<'_>,
) -> Result<bool> {
    let base = m.base();
    if !base.spec.prefix_cacheable {
        return Ok(false);
    }
    let (num_cached, num_full) = cache_range(base, pool, req, q.block_hashes.len(), q.num_tokens);
    if num_cached >= num_full {
        return Ok(false);
    }
    let mut reachable: SmallVec<[i64; 4]> = SmallVec::from_slice(q.replay_boundaries);
    if q.shared_prefix_boundary > 0 {
        let spb = q.shared_prefix_boundary as i64;
        reachable.push(spb);
        if base.use_eagle && pool.vllm_rules().eagle_junction_keeps_lower_block {
            // A sibling diverging right after the junction hits one block lower
            // (vLLM 0.33; 0.32 keeps the junction only).
            reachable.push(spb - base.block_size as i64);
        }
    }
    let mask = m.reachable_block_mask(&MaskQuery {
        start_block: num_cached,
        end_block: num_full,
        alignment_tokens: base.cache_hit_alignment_tokens,
        use_eagle: base.use_eagle,
        retention_interval: q.retention_interval,
        reachable_boundaries: &reachable,
    });
    let (bs, gid) = (base.block_size, base.group_id);
    pool.cache_full_blocks(
        q.block_hashes,
        &req.blocks,
        num_cached,
        num_full,
        bs,
        gid,
        mask.as_deref(),
    )?;
    req.num_cached_block = Some(num_full);
    Ok(true)
}

/// vLLM's `_remove_blocks_in_range`: frees `blocks[first..last)` from the end,
/// stopping at the first null block (freed earlier), higher indices first.
pub fn remove_blocks_in_range(
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    first: usize,
    last: usize,
) -> Result<()> {
    let last = last.min(req.blocks.len());
    if first >= last {
        return Ok(());
    }
    let mut freed: SmallVec<[BlockId; 8]> = SmallVec::new();
    for i in (first..last).rev() {
        if req.blocks[i] == NULL_BLOCK_ID {
            break;
        }
        freed.push(req.blocks[i]);
        req.blocks[i] = NULL_BLOCK_ID;
    }
    if freed.is_empty() {
        return Ok(());
    }
    pool.free_blocks(&freed)
}

/// [`SingleTypeManager::is_steady`] for the types that use the base
/// `get_num_blocks_to_allocate`, `allocate_new_blocks` and `remove_skipped_blocks`:
/// the table already covers `num_tokens`, and the last block the skip rule would
/// free is already the null block (freeing stops at the first null block from the
/// end, see [`remove_blocks_in_range`]).
#[inline]
pub fn base_is_steady<M: SingleTypeManager + ?Sized>(
    m: &M,
    req: &GroupBlocks,
    num_tokens: usize,
    processed_computed_tokens: usize,
) -> bool {
    let bs = m.base().block_size;
    if req.partial_hit.is_some() || cdiv(num_tokens, bs) > req.blocks.len() {
        return false;
    }
    let skipped = m.get_num_skipped_tokens(processed_computed_tokens) / bs;
    match skipped.min(req.blocks.len()) {
        0 => true,
        n => req.blocks[n - 1] == NULL_BLOCK_ID,
    }
}

/// vLLM's base `remove_skipped_blocks`.
pub fn base_remove_skipped_blocks<M: SingleTypeManager + ?Sized>(
    m: &M,
    pool: &mut BlockPool,
    req: &mut GroupBlocks,
    processed_computed_tokens: usize,
) -> Result<()> {
    let skipped = m.get_num_skipped_tokens(processed_computed_tokens);
    if skipped == 0 {
        return Ok(());
    }
    let n = (skipped / m.base().block_size).min(req.blocks.len());
    remove_blocks_in_range(pool, req, 0, n)
}

/// Number of leading null blocks of a table (vLLM's `null_head_len`).
#[inline]
pub fn null_head_len(blocks: &[BlockId]) -> usize {
    blocks.iter().take_while(|&&b| b == NULL_BLOCK_ID).count()
}
