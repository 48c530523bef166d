//! `KVCacheCoordinator`: the KV-cache groups of one model over one block pool.
//!
//! Mirrors vLLM 0.33 `v1/core/kv_cache_coordinator.py`: its three coordinators are
//! the three [`CoordinatorKind`]s of one struct (they differ only in the hit search
//! and in how many tokens a group may cache).
//!
//! Key properties:
//! - One [`BlockPool`] shared by every group; one request table holding each
//!   request's [`GroupBlocks`] of every group (one lookup per call, whatever the
//!   number of groups); one manager per group.
//! - Admission is two-phase: every group adopts (touches) its hits before any
//!   group allocates blocks for external tokens, so one group's allocation cannot
//!   evict another group's hit.
//! - The hybrid hit search is a fixed point: each spec group accepts the
//!   candidate length or shortens it, until no group shortens it (full attention,
//!   whose hits are downward closed, is looked up once and then only trimmed).
//!   EAGLE groups look one drop unit further and drop it, at most once per
//!   candidate length.
//! - Groups in a hybrid model cache only up to the scheduler block (or, with
//!   partial hash hits, any hash boundary), which is where a hit can land.
//! - One loop over the groups per call. On a HiSparse layout the HiSparse
//!   coordinator is called between the groups (`manager/hisparse/hooks.rs`), where vLLM's
//!   HiSparse managers call theirs; elsewhere that is one `None` check a group.
//!
//! Files, by concern (each opens with what it owns):
//! - this file: the types, the struct, its accessors, the request table's states,
//!   the HiSparse handle, the step queues and the prefix-cache resets;
//! - `build.rs`: construction (vLLM's `get_kv_cache_coordinator` and each
//!   coordinator's constructor checks, the spec groups, [`FieldNeeds`]);
//! - `hit_search.rs`: the prefix-hit search (unitary and the hybrid fixed point,
//!   per group for connectors) and the events of adopted hits;
//! - `allocate.rs`: the group loops of `get_num_blocks_to_allocate` and both
//!   allocations (two-phase admission);
//! - `caching.rs`: what a group may cache and `cache_blocks`, with its checks;
//! - `free.rs`: skipped-block removal, free / pop, and the release of a request;
//! - `invariants.rs`: the checked mode's coordinator-wide invariants.

use smallvec::SmallVec;

use super::hisparse::{HiSparseCoordinator, HiSparseCtx, HiSparseLayout};
pub use super::single_type::RequestState;
use super::single_type::{GroupBlocks, NumBlocksQuery, SingleTypeManager, SteadyQuery};
use super::spec::{GroupSpec, ManagerKind};
use super::GroupedBlocks;
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::request_table::RequestTable;
use crate::types::BlockId;

mod allocate;
mod build;
mod caching;
mod free;
mod hit_search;
mod invariants;

/// vLLM's coordinator-level `get_num_blocks_to_allocate` arguments, for every
/// group at once; [`Self::group_query`] is what one group's manager sees.
#[derive(Clone, Copy, Debug)]
pub struct NumBlocksToAllocate<'a> {
    pub request_id: &'a str,
    pub num_tokens: usize,
    /// Each group's prefix hits.
    pub hits: GroupedBlocks<'a>,
    /// What a cross-attention group counts instead of `num_tokens`.
    pub num_encoder_tokens: usize,
    pub total_computed_tokens: usize,
    pub num_local_computed_tokens: usize,
    pub num_tokens_main_model: usize,
    pub apply_admission_cap: bool,
    /// Where the prefill ends (read only with a retention interval of 0).
    pub prefill_end: usize,
}

impl<'a> NumBlocksToAllocate<'a> {
    /// Group `g`'s query: a `cross` attention group counts the encoder tokens and
    /// adopts nothing; `prefill_end` counts only where `retention_applies`.
    fn group_query(&self, g: usize, cross: bool, retention_applies: bool) -> NumBlocksQuery<'a> {
        if cross {
            return NumBlocksQuery {
                request_id: self.request_id,
                num_tokens: self.num_encoder_tokens,
                new_computed_blocks: &[],
                total_computed_tokens: 0,
                num_local_computed_tokens: 0,
                num_tokens_main_model: self.num_encoder_tokens,
                apply_admission_cap: self.apply_admission_cap,
                prefill_end: 0,
            };
        }
        NumBlocksQuery {
            request_id: self.request_id,
            num_tokens: self.num_tokens,
            new_computed_blocks: self.hits.group(g),
            total_computed_tokens: self.total_computed_tokens,
            num_local_computed_tokens: self.num_local_computed_tokens,
            num_tokens_main_model: self.num_tokens_main_model,
            apply_admission_cap: self.apply_admission_cap,
            prefill_end: if retention_applies {
                self.prefill_end
            } else {
                0
            },
        }
    }
}

/// Which of vLLM's coordinators this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordinatorKind {
    /// `KVCacheCoordinatorNoPrefixCache`: caching off, any number of groups.
    NoPrefixCache,
    /// `UnitaryKVCacheCoordinator`: one group.
    Unitary,
    /// `HybridKVCacheCoordinator`: several groups.
    Hybrid,
}

/// The coordinator's construction parameters.
#[derive(Clone, Debug)]
pub struct CoordinatorConfig {
    pub num_blocks: u32,
    pub groups: Vec<GroupSpec>,
    pub use_eagle: bool,
    pub enable_caching: bool,
    pub enable_kv_cache_events: bool,
    pub dcp_world_size: usize,
    pub pcp_world_size: usize,
    pub scheduler_block_size: usize,
    pub hash_block_size: usize,
    pub collect_metrics: bool,
    pub num_hash_lookahead_tokens: usize,
    pub num_prefill_lookahead: usize,
    /// `kv_cache_config.prefix_cache_retention_interval`.
    pub retention_interval: Option<usize>,
    pub needs_kv_cache_zeroing: bool,
    pub allow_partial_hash_hits: bool,
}

/// Groups with one spec, looked up together (vLLM's `SpecGroup`).
#[derive(Clone, Debug)]
pub struct SpecGroup {
    pub group_ids: SmallVec<[u32; 4]>,
    pub use_eagle: bool,
    pub is_full_attention: bool,
    pub is_mamba: bool,
    pub supports_fine_grained: bool,
}

/// When a call needs which request field (derived once from the groups).
#[derive(Clone, Copy, Debug, Default)]
pub struct FieldNeeds {
    /// Some group frees blocks attention skips: `num_in_flight_tokens`.
    pub in_flight_for_skip: bool,
    /// Some group (R-SWA) frees by the prompt length: `num_prompt_tokens`.
    pub prompt_for_skip: bool,
    /// Caching reads the prompt length (masks, partial prompt tails).
    pub prompt_for_cache: bool,
    /// Caching reads `shared_prefix_boundary`.
    pub shared_prefix_for_cache: bool,
    /// Mamba "align" reserves prefill checkpoints by `prefill_end`.
    pub prefill_end: bool,
    /// Some group's caching has effects beyond new full blocks (partial entries,
    /// Mamba checkpoints), so it runs on every call.
    pub cache_every_call: bool,
    /// No HiSparse, and every group that caches on every call says itself when a
    /// call would cache nothing beyond full blocks (Mamba "align"): a call that
    /// changes no group's table and caches no block changes nothing, so
    /// `allocate_slots` can decide the steady decode step from the request's tables
    /// alone (see [`KVCacheCoordinator::is_steady`]).
    pub steady_decode: bool,
    /// The steady check reads `num_prompt_tokens` and the tokens the call would
    /// cache (Mamba "align" keys partial tails at the prompt's boundary).
    pub steady_reads_prompt: bool,
}

/// The coordinator (see module docs).
#[derive(Debug)]
pub struct KVCacheCoordinator {
    kind: CoordinatorKind,
    pub(crate) pool: BlockPool,
    pub(crate) managers: Vec<Box<dyn SingleTypeManager>>,
    pub(crate) requests: RequestTable<RequestState>,
    spare_states: Vec<RequestState>,
    scheduler_block_size: usize,
    hash_block_size: usize,
    num_reprefillable_tokens: usize,
    eagle_group_ids: SmallVec<[u32; 4]>,
    drop_eagle_group_ids: SmallVec<[u32; 4]>,
    retention_interval: Option<usize>,
    enable_partial_hash_hits: bool,
    attention_groups: Vec<SpecGroup>,
    full_attention_group_id: Option<u32>,
    needs: FieldNeeds,
    /// Some Mamba "align" group keeps per-request state from the first lookup on.
    mamba_align: bool,
    /// HiSparse's coordinator, on a layout with a HiSparse source group.
    pub(crate) hisparse: Option<Box<HiSparseCoordinator>>,
}

/// The state of the request `handle` names (a group loop looks it up again after
/// each group's hook, which may read every request's tables).
#[inline]
fn state_of<'a>(
    requests: &'a mut RequestTable<RequestState>,
    handle: crate::request_table::RequestHandle,
    request_id: &str,
) -> Result<&'a mut RequestState> {
    requests
        .get_mut_by_handle(handle)
        .ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))
}

impl KVCacheCoordinator {
    // ---- accessors -----------------------------------------------------------------

    #[inline]
    pub fn kind(&self) -> CoordinatorKind {
        self.kind
    }
    #[inline]
    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }
    #[inline]
    pub fn block_pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }
    #[inline]
    pub fn num_groups(&self) -> usize {
        self.managers.len()
    }
    #[inline]
    pub fn managers(&self) -> &[Box<dyn SingleTypeManager>] {
        &self.managers
    }
    #[inline]
    pub fn manager(&self, group_id: usize) -> &dyn SingleTypeManager {
        &*self.managers[group_id]
    }
    #[inline]
    pub fn scheduler_block_size(&self) -> usize {
        self.scheduler_block_size
    }
    #[inline]
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }
    #[inline]
    pub fn num_reprefillable_tokens(&self) -> usize {
        self.num_reprefillable_tokens
    }
    #[inline]
    pub fn retention_interval(&self) -> Option<usize> {
        self.retention_interval
    }
    /// Sets the retention interval of a live coordinator (vLLM's attribute is plain,
    /// and code sets it after construction), validated as at construction.
    pub fn set_retention_interval(&mut self, retention: Option<usize>) -> Result<()> {
        let specs: Vec<GroupSpec> = self
            .managers
            .iter()
            .map(|m| m.base().spec.clone())
            .collect();
        Self::validate_retention(retention, self.scheduler_block_size, &specs)?;
        self.retention_interval = retention;
        self.needs = self.field_needs();
        Ok(())
    }

    /// Sets group `g`'s `use_eagle` (vLLM's manager attribute is plain too).
    pub fn set_group_use_eagle(&mut self, g: usize, use_eagle: bool) {
        self.managers[g].base_mut().use_eagle = use_eagle;
        self.needs = self.field_needs();
    }
    #[inline]
    pub fn enable_partial_hash_hits(&self) -> bool {
        self.enable_partial_hash_hits
    }
    #[inline]
    pub fn eagle_group_ids(&self) -> &[u32] {
        &self.eagle_group_ids
    }
    #[inline]
    pub fn drop_eagle_group_ids(&self) -> &[u32] {
        &self.drop_eagle_group_ids
    }
    #[inline]
    pub fn attention_groups(&self) -> &[SpecGroup] {
        &self.attention_groups
    }
    #[inline]
    pub fn full_attention_group_id(&self) -> Option<u32> {
        self.full_attention_group_id
    }
    #[inline]
    pub fn needs(&self) -> FieldNeeds {
        self.needs
    }
    /// The alignment of hit lengths (vLLM's `_cache_hit_alignment_tokens`).
    #[inline]
    pub fn cache_hit_alignment_tokens(&self) -> usize {
        self.managers
            .first()
            .map_or(self.scheduler_block_size, |m| {
                m.base().cache_hit_alignment_tokens
            })
    }
    /// Sets the Mamba shared-prefix checkpoint flag on every Mamba group.
    pub fn set_mamba_shared_prefix_checkpoint(&mut self) {
        for m in &mut self.managers {
            if m.base().spec.is_mamba() {
                m.base_mut().shared_prefix_checkpoint = true;
            }
        }
    }

    /// Every request's table in group `g`.
    pub fn request_tables(&self, g: usize) -> impl Iterator<Item = (&str, &GroupBlocks)> {
        self.requests
            .iter()
            .filter_map(move |(rid, s)| s.groups.get(g).map(|gb| (rid, gb)))
    }

    /// The request's state (None if it holds nothing).
    #[inline]
    pub fn request(&self, request_id: &str) -> Option<&RequestState> {
        self.requests.get(request_id)
    }

    /// Whether a call for the running request in `slot` whose state is `state`
    /// (no hits adopted) leaves every group as it is
    /// ([`SingleTypeManager::is_steady`]); `cache_tokens`: the tokens the call would
    /// cache (`None`: it caches nothing), turned into each group's cacheable count.
    /// Meaningful only where `needs().steady_decode`.
    #[inline]
    pub fn is_steady(
        &self,
        slot: u32,
        state: &RequestState,
        q: &SteadyQuery,
        cache_tokens: Option<usize>,
    ) -> bool {
        state.groups.len() == self.managers.len()
            && self
                .managers
                .iter()
                .zip(&state.groups)
                .enumerate()
                .all(|(g, (m, gb))| {
                    let q = SteadyQuery {
                        cacheable_tokens: cache_tokens.map(|n| self.get_num_cacheable_tokens(n, g)),
                        ..*q
                    };
                    m.is_steady(slot, gb, &q)
                })
    }

    /// The request's slot and state (None if it holds nothing).
    #[inline]
    pub fn request_with_slot(&self, request_id: &str) -> Option<(u32, &RequestState)> {
        self.requests.get_with_slot(request_id)
    }

    /// vLLM 0.30 / 0.31's `get_num_common_prefix_blocks` (cascade attention), into
    /// `out` (one entry per group): the leading blocks of `request_id`'s table whose
    /// reference count (vLLM's, [`BlockPool::vllm_ref_cnt`]) equals the number of
    /// requests holding a table, i.e. blocks every such request shares. Groups whose
    /// vLLM manager answers 0 (sliding window, chunked local, circular buffer, Mamba,
    /// cross attention, HiSparse resident / hot) and the no-prefix-cache coordinator
    /// answer 0.
    ///
    /// vLLM's counting managers read `req_to_blocks[request_id]`, a `defaultdict`: an
    /// unknown request then holds an empty table until it is freed, and counts as a
    /// holder from then on. The core does the same (an empty state), so later answers
    /// stay vLLM's.
    pub fn num_common_prefix_blocks(&mut self, request_id: &str, out: &mut Vec<usize>) {
        out.clear();
        let counts = |m: &dyn SingleTypeManager| {
            matches!(
                m.base().spec.kind,
                ManagerKind::FullAttention
                    | ManagerKind::SinkFullAttention { .. }
                    | ManagerKind::Rswa { .. }
                    | ManagerKind::HiSparseSource { .. }
            )
        };
        if self.kind == CoordinatorKind::NoPrefixCache
            || !self.managers.iter().any(|m| counts(m.as_ref()))
        {
            out.resize(self.managers.len(), 0);
            return;
        }
        if self.requests.get(request_id).is_none() {
            self.state_mut(request_id);
        }
        let holders = i64::try_from(self.requests.len()).unwrap_or(i64::MAX);
        for (g, m) in self.managers.iter().enumerate() {
            if !counts(m.as_ref()) {
                out.push(0);
                continue;
            }
            let pool = self.pool_of(g);
            let n = self
                .blocks(request_id, g)
                .iter()
                .take_while(|&&b| pool.vllm_ref_cnt(b) == holders)
                .count();
            out.push(n);
        }
    }

    /// The table of `request_id` in group `g` (empty if unknown).
    #[inline]
    pub fn blocks(&self, request_id: &str, g: usize) -> &[BlockId] {
        self.requests
            .get(request_id)
            .and_then(|r| r.groups.get(g))
            .map_or(&[], |gb| gb.blocks.as_slice())
    }

    /// A fresh state with one (empty) table per group.
    fn new_state(spare: &mut Vec<RequestState>, n: usize) -> RequestState {
        let mut s = spare.pop().unwrap_or_default();
        s.groups.resize_with(n, GroupBlocks::default);
        s
    }

    /// The request's slot and state, created (empty) if absent.
    pub(crate) fn state_mut(&mut self, request_id: &str) -> (u32, &mut RequestState) {
        let n = self.managers.len();
        let spare = &mut self.spare_states;
        self.requests
            .get_or_insert_with_slot(request_id, || Self::new_state(spare, n))
    }

    /// Recycles a removed state's allocations.
    fn recycle(&mut self, mut state: RequestState) {
        for g in state.groups.iter_mut() {
            g.blocks.clear();
            g.num_cached_block = None;
            g.partial_hit = None;
        }
        state.batch_epoch = 0;
        self.spare_states.push(state);
    }

    /// Builds the HiSparse coordinator of a layout with HiSparse groups (vLLM's
    /// `get_hisparse_coordinator`, run with the manager).
    pub(crate) fn enable_hisparse(&mut self, num_blocks: u32, max_model_len: usize) -> Result<()> {
        let specs: Vec<_> = self
            .managers
            .iter()
            .map(|m| m.base().spec.clone())
            .collect();
        let sizes: Vec<usize> = self.managers.iter().map(|m| m.base().block_size).collect();
        let layout = HiSparseLayout::new(
            &specs,
            num_blocks,
            max_model_len,
            self.num_reprefillable_tokens(),
            |g| sizes[g],
        )?;
        let Some(layout) = layout else {
            return Ok(());
        };
        let has_resident = !layout.resident_groups.is_empty();
        for &g in &layout.hot_groups {
            if let Some(h) = self.managers[g].hisparse_hot_mut() {
                h.set_has_resident_groups(has_resident);
            }
        }
        self.hisparse = Some(Box::new(HiSparseCoordinator::new(layout)));
        // The steady decode step skips the group loops, hence the hooks: it needs the
        // HiSparse coordinator to be known (`field_needs` ran in `new`, before it was).
        self.needs = self.field_needs();
        Ok(())
    }

    /// The HiSparse coordinator and the rest of this coordinator, borrowed apart
    /// (None on a layout without HiSparse: the group loops' hook check).
    #[inline]
    pub(crate) fn hisparse_split(&mut self) -> Option<(&mut HiSparseCoordinator, HiSparseCtx<'_>)> {
        let h = self.hisparse.as_deref_mut()?;
        Some((
            h,
            HiSparseCtx {
                pool: &mut self.pool,
                managers: &mut self.managers,
                requests: &mut self.requests,
            },
        ))
    }

    /// Runs `f` on the HiSparse coordinator (`Err` on a layout without one).
    pub fn with_hisparse<T>(
        &mut self,
        f: impl FnOnce(&mut HiSparseCoordinator, &mut HiSparseCtx<'_>) -> Result<T>,
    ) -> Result<T> {
        let Some((h, mut ctx)) = self.hisparse_split() else {
            return Err(Error::InvalidArgument(
                "this KV-cache layout has no HiSparse group".into(),
            ));
        };
        f(h, &mut ctx)
    }

    /// The HiSparse coordinator, read only.
    #[inline]
    pub fn hisparse(&self) -> Option<&HiSparseCoordinator> {
        self.hisparse.as_deref()
    }

    /// The request's slot, if it holds state.
    #[inline]
    pub fn slot_of(&self, request_id: &str) -> Option<u32> {
        self.requests
            .handle(request_id)
            .map(RequestTable::<RequestState>::slot_of_handle)
    }

    /// A new scheduler step starts.
    pub fn new_step_starts(&mut self) {
        for m in &mut self.managers {
            m.new_step_starts();
        }
    }

    /// vLLM's `finalize_partial_tail_offloads` for one request.
    pub fn finalize_partial_tail_offloads(
        &mut self,
        request_id: &str,
        num_computed_tokens: usize,
        num_in_flight_tokens: usize,
        out: &mut Vec<(u32, BlockId, usize)>,
    ) {
        let Some(slot) = self.slot_of(request_id) else {
            return;
        };
        for m in &mut self.managers {
            if let Some(t) =
                m.finalize_partial_tail_offload(slot, num_computed_tokens, num_in_flight_tokens)
            {
                out.push(t);
            }
        }
    }

    /// Every group's copy-on-write pairs, drained.
    pub fn take_pending_cow_copies(&mut self) -> Vec<(BlockId, BlockId)> {
        let mut out = Vec::new();
        for m in &mut self.managers {
            // HiSparse's host copies go to its connector (`take_host_block_copies`).
            if m.host_pool().is_some() {
                continue;
            }
            out.append(&mut m.base_mut().pending_cow_copies);
        }
        out
    }

    /// Queues a copy-on-write pair on group `g` (connectors and tests do this).
    pub fn push_cow_copy(&mut self, g: usize, pair: (BlockId, BlockId)) {
        if let Some(m) = self.managers.get_mut(g) {
            m.base_mut().pending_cow_copies.push(pair);
        }
    }

    /// Every group's boundary-state hand-offs, drained, in group order.
    pub fn take_boundary_state_offloads(&mut self) -> Vec<super::single_type::BoundaryOffload> {
        let mut out = Vec::new();
        for m in &mut self.managers {
            out.append(&mut m.base_mut().pending_boundary_state_offloads);
        }
        out
    }

    /// Every group's block ids recorded for zeroing, drained.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        let mut out = Vec::new();
        for m in &mut self.managers {
            if m.host_pool().is_some() {
                // HiSparse's source group reports none (host blocks are not zeroed).
                m.base_mut().new_block_ids.clear();
                continue;
            }
            out.append(&mut m.base_mut().new_block_ids);
        }
        out
    }

    /// vLLM's `record_blocks_for_zeroing`: the request's blocks from `start_token` on,
    /// in the groups whose new blocks are zeroed.
    pub fn record_blocks_for_zeroing(
        &mut self,
        request_id: &str,
        start_token: usize,
    ) -> Result<()> {
        for m in &self.managers {
            let b = m.base();
            if b.record_new_block_ids && start_token % b.block_size != 0 {
                return Err(Error::InvalidArgument(format!(
                    "start_token {start_token} is not a multiple of the block size {}",
                    b.block_size
                )));
            }
        }
        let state = self.requests.get(request_id);
        for (g, m) in self.managers.iter_mut().enumerate() {
            let b = m.base_mut();
            if !b.record_new_block_ids {
                continue;
            }
            let start = start_token / b.block_size;
            if let Some(gb) = state.and_then(|s| s.groups.get(g)) {
                if start < gb.blocks.len() {
                    b.new_block_ids.extend_from_slice(&gb.blocks[start..]);
                }
            }
        }
        Ok(())
    }

    /// Resets the prefix cache of every pool (false while any block of one is in
    /// use).
    /// Each pool once, in the order the groups first use them (vLLM's
    /// `dict.fromkeys` of the managers' pools): the host pool first only when the
    /// source group is group 0.
    pub fn reset_prefix_cache(&mut self) -> Result<bool> {
        let host_first = self
            .managers
            .first()
            .is_some_and(|m| m.host_pool().is_some());
        let mut ok = true;
        if host_first {
            ok &= self.reset_host_prefix_cache()?;
        }
        ok &= self.reset_device_prefix_cache()?;
        if !host_first {
            ok &= self.reset_host_prefix_cache()?;
        }
        Ok(ok)
    }

    /// The device pool's `reset_prefix_cache`, with its reuse notifications.
    pub fn reset_device_prefix_cache(&mut self) -> Result<bool> {
        let ok = self.pool.reset_prefix_cache();
        self.process_reused()?;
        Ok(ok)
    }

    /// The host pool's `reset_prefix_cache` (true without one).
    pub fn reset_host_prefix_cache(&mut self) -> Result<bool> {
        let Some(g) = self.hisparse.as_deref().map(|h| h.layout().host_group) else {
            return Ok(true);
        };
        let Some(src) = self.managers[g].hisparse_source_mut() else {
            return Ok(true);
        };
        let ok = src.host_pool_mut().reset_prefix_cache();
        self.pool.absorb_host_events(src.host_pool_mut(), None);
        Ok(ok)
    }

    /// The pool group `g`'s blocks come from.
    #[inline]
    pub fn pool_of(&self, g: usize) -> &BlockPool {
        self.managers
            .get(g)
            .and_then(|m| m.host_pool())
            .unwrap_or(&self.pool)
    }
}
