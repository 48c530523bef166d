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
//!   coordinator is called between the groups (`hisparse/hooks.rs`), where vLLM's
//!   HiSparse managers call theirs; elsewhere that is one `None` check a group.
//!
//! Length: one struct whose methods are vLLM's coordinator call by call (plan, then
//! apply over every group); the hit search, the allocation and the caching share the
//! request table and the per-group plans, so splitting them would spread one call's
//! order over files.

use smallvec::SmallVec;

use super::hisparse::{HiSparseCoordinator, HiSparseCtx, HiSparseLayout, PublicationRequests};
use super::registry::new_manager;
use super::request::PlannedHashes;
pub use super::single_type::RequestState;
use super::single_type::{
    cache_range, running_cannot_adopt, CacheQuery, GroupBlocks, HitQuery, ManagerBase,
    NumBlocksQuery, SingleTypeManager, SteadyQuery,
};
use super::spec::{GroupSpec, MambaCacheMode, ManagerKind};
use super::GroupedBlocks;
use crate::error::{Error, Result};
use crate::events::KVCacheEvent;
use crate::pool::BlockPool;
use crate::request_table::RequestTable;
use crate::types::{cdiv, BlockHashSource, BlockId, NULL_BLOCK_ID};

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

/// Where [`KVCacheCoordinator::release`] hands a request's blocks.
enum Release<'a> {
    /// Freed: gathered into this scratch, then freed.
    Free(&'a mut Vec<BlockId>),
    /// Handed back (`pop_blocks_for_free`), appended here.
    Pop(&'a mut Vec<BlockId>),
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

fn lcm_divides(scheduler_block_size: usize, block_size: usize) -> bool {
    block_size != 0 && scheduler_block_size % block_size == 0
}

impl KVCacheCoordinator {
    /// vLLM's `get_kv_cache_coordinator` + the coordinators' constructors: every
    /// assertion vLLM makes is an `Err` here.
    pub fn new(c: CoordinatorConfig) -> Result<Self> {
        let n = c.groups.len();
        let kind = if !c.enable_caching {
            CoordinatorKind::NoPrefixCache
        } else if n == 1 {
            CoordinatorKind::Unitary
        } else {
            CoordinatorKind::Hybrid
        };
        let (sbs, hbs) = (c.scheduler_block_size, c.hash_block_size);
        if sbs == 0 || hbs == 0 || sbs % hbs != 0 {
            return Err(Error::InvalidArgument(format!(
                "scheduler_block_size {sbs} must be a positive multiple of hash_block_size {hbs}"
            )));
        }
        if let Some(g) = c.groups.iter().find(|g| !lcm_divides(sbs, g.block_size)) {
            return Err(Error::InvalidArgument(format!(
                "scheduler_block_size {sbs} is not a multiple of a group's block size {}",
                g.block_size
            )));
        }
        let caching = kind != CoordinatorKind::NoPrefixCache;
        let pool = BlockPool::new(
            c.num_blocks,
            caching,
            hbs,
            c.enable_kv_cache_events,
            c.collect_metrics,
        )?;
        let mut eagle_group_ids: SmallVec<[u32; 4]> = (0..n as u32)
            .filter(|&i| c.groups[i as usize].is_eagle_group)
            .collect();
        if c.use_eagle && eagle_group_ids.is_empty() {
            eagle_group_ids = (0..n as u32).collect();
        }
        let drop_eagle_group_ids = if c.use_eagle {
            eagle_group_ids.clone()
        } else {
            SmallVec::new()
        };
        if caching && !eagle_group_ids.is_empty() && sbs < c.num_prefill_lookahead {
            return Err(Error::InvalidArgument(format!(
                "Multi-module MTP with prefix caching requires scheduler_block_size \
                 (={sbs}) >= num_speculative_tokens (={})",
                c.num_prefill_lookahead
            )));
        }
        let mut managers = Vec::with_capacity(n);
        for (i, spec) in c.groups.iter().enumerate() {
            let mut base = ManagerBase::new(
                spec.clone(),
                i as u32,
                caching,
                sbs,
                hbs,
                c.dcp_world_size,
                c.pcp_world_size,
                c.needs_kv_cache_zeroing,
            );
            base.num_hash_lookahead_tokens = c.num_hash_lookahead_tokens;
            base.eagle_checkpoints = c.use_eagle;
            managers.push(new_manager(base, c.enable_kv_cache_events)?);
        }
        Self::validate_retention(c.retention_interval, sbs, &c.groups)?;
        let mamba_align = c
            .groups
            .iter()
            .any(|g| g.mamba_mode() == Some(MambaCacheMode::Align));
        let mut this = Self {
            kind,
            pool,
            managers,
            requests: RequestTable::default(),
            spare_states: Vec::new(),
            scheduler_block_size: sbs,
            hash_block_size: hbs,
            num_reprefillable_tokens: c.num_prefill_lookahead.saturating_sub(1),
            eagle_group_ids,
            drop_eagle_group_ids,
            retention_interval: c.retention_interval,
            enable_partial_hash_hits: false,
            attention_groups: Vec::new(),
            full_attention_group_id: None,
            needs: FieldNeeds::default(),
            mamba_align,
            hisparse: None,
        };
        match kind {
            CoordinatorKind::NoPrefixCache => {}
            CoordinatorKind::Unitary => {
                let bs = this.managers[0].base().block_size;
                if hbs != bs {
                    return Err(Error::InvalidArgument(format!(
                        "one KV-cache group needs hash_block_size ({hbs}) == block_size ({bs})"
                    )));
                }
                let drop = this.drop_eagle_group_ids.contains(&0);
                this.managers[0].base_mut().use_eagle = drop;
            }
            CoordinatorKind::Hybrid => this.init_hybrid(&c)?,
        }
        this.needs = this.field_needs();
        Ok(this)
    }

    /// vLLM's `_validate_prefix_cache_retention_interval`.
    fn validate_retention(
        retention: Option<usize>,
        sbs: usize,
        groups: &[GroupSpec],
    ) -> Result<()> {
        let Some(r) = retention else {
            return Ok(());
        };
        let sparse_capable = groups
            .iter()
            .any(|g| g.is_mamba() || matches!(g.kind, ManagerKind::SlidingWindow { .. }));
        if !sparse_capable {
            if r == 0 {
                return Ok(());
            }
            return Err(Error::InvalidArgument(
                "prefix_cache_retention_interval is set but this model has no \
                 sliding-window or Mamba KV cache group, so retention has no effect. Set \
                 it to 0 (it only applies to sliding-window and Mamba attention)."
                    .into(),
            ));
        }
        if r % sbs != 0 {
            return Err(Error::InvalidArgument(format!(
                "prefix_cache_retention_interval ({r}) must be non-negative and a multiple \
                 of scheduler_block_size ({sbs})."
            )));
        }
        Ok(())
    }

    /// The hybrid coordinator's constructor: divisibility and context-parallel
    /// checks, partial hash hits, hit alignment, and the spec groups.
    fn init_hybrid(&mut self, c: &CoordinatorConfig) -> Result<()> {
        let hbs = self.hash_block_size;
        for m in &self.managers {
            let b = m.base();
            if b.spec.prefix_cacheable && b.block_size % hbs != 0 {
                return Err(Error::InvalidArgument(format!(
                    "each KV cache group's block size must be divisible by hash_block_size \
                     {hbs}, got {}",
                    b.block_size
                )));
            }
        }
        for g in &c.groups {
            let replicated = !g.dcp_sharded;
            if c.pcp_world_size > 1
                && !(g.is_full_attention_spec || (g.is_attention_spec && replicated))
            {
                return Err(Error::Unsupported(
                    "PCP only supports full attention and replicated draft groups".into(),
                ));
            }
            if c.dcp_world_size > 1 && !(g.is_full_attention_spec || replicated) {
                return Err(Error::Unsupported(
                    "DCP with hybrid KV cache layouts only supports full-attention, Mamba, \
                     and replicated draft groups"
                        .into(),
                ));
            }
        }
        self.enable_partial_hash_hits =
            c.allow_partial_hash_hits && self.partial_hash_hits_enabled(c.dcp_world_size);
        let align = if self.enable_partial_hash_hits {
            hbs
        } else {
            self.scheduler_block_size
        };
        for m in &mut self.managers {
            m.base_mut().cache_hit_alignment_tokens = align;
        }
        // Spec groups: equal specs of the same manager kind are looked up together.
        let mut groups: Vec<SpecGroup> = Vec::new();
        let mut classes: Vec<u32> = Vec::new();
        for (i, m) in self.managers.iter().enumerate() {
            let spec = &m.base().spec;
            if !spec.prefix_cacheable {
                continue;
            }
            let use_eagle = self.drop_eagle_group_ids.contains(&(i as u32));
            match classes.iter().position(|&cl| cl == spec.spec_class) {
                Some(idx) => {
                    groups[idx].group_ids.push(i as u32);
                    groups[idx].use_eagle |= use_eagle;
                }
                None => {
                    classes.push(spec.spec_class);
                    groups.push(SpecGroup {
                        group_ids: SmallVec::from_slice(&[i as u32]),
                        use_eagle,
                        is_full_attention: spec.is_full_attention_spec,
                        is_mamba: spec.is_mamba(),
                        supports_fine_grained: spec.supports_fine_grained_hash_lookup(),
                    });
                }
            }
        }
        if groups.is_empty() {
            return Err(Error::InvalidArgument(
                "the hybrid coordinator requires at least one prefix-cacheable group".into(),
            ));
        }
        // Full attention first (stable): its left-to-right scan bounds the others.
        groups.sort_by_key(|g| !g.is_full_attention);
        self.full_attention_group_id = groups[0].is_full_attention.then(|| groups[0].group_ids[0]);
        for g in &groups {
            if g.use_eagle {
                for &gid in &g.group_ids {
                    self.managers[gid as usize].base_mut().use_eagle = true;
                }
            }
        }
        self.attention_groups = groups;
        Ok(())
    }

    /// vLLM's `partial_hash_hits_enabled`: a Mamba "align" group finer-hashed than
    /// its block, and every other cacheable group able to look up fine boundaries.
    fn partial_hash_hits_enabled(&self, dcp_world_size: usize) -> bool {
        let hbs = self.hash_block_size;
        let mamba = self.managers.iter().any(|m| {
            let s = &m.base().spec;
            s.mamba_mode() == Some(MambaCacheMode::Align)
                && ((dcp_world_size <= 1 && s.block_size > hbs)
                    || (dcp_world_size > 1 && s.block_size >= hbs))
        });
        mamba
            && self.managers.iter().all(|m| {
                let b = m.base();
                !b.spec.prefix_cacheable
                    || b.spec.supports_fine_grained_hash_lookup()
                    || b.block_size == hbs
            })
    }

    fn field_needs(&self) -> FieldNeeds {
        let mut needs = FieldNeeds::default();
        let retention = self.retention_interval.is_some();
        // A group caching on every call whose steady check does not cover it.
        let mut unsteady_caching = false;
        for m in &self.managers {
            let b = m.base();
            match &b.spec.kind {
                ManagerKind::SlidingWindow { .. } | ManagerKind::ChunkedLocal { .. } => {
                    needs.in_flight_for_skip = true;
                }
                ManagerKind::Rswa { .. } => {
                    needs.in_flight_for_skip = true;
                    needs.prompt_for_skip = true;
                }
                ManagerKind::Mamba(p) => {
                    needs.in_flight_for_skip = true;
                    if p.mode == MambaCacheMode::Align && b.enable_caching {
                        needs.prompt_for_cache = true;
                        needs.shared_prefix_for_cache = true;
                        needs.cache_every_call = true;
                        needs.steady_reads_prompt = true;
                        needs.prefill_end |= self.retention_interval == Some(0);
                    }
                }
                // HiSparse's source group replaces its publication on every call.
                ManagerKind::HiSparseSource { .. } if b.enable_caching => {
                    needs.cache_every_call = true;
                    unsteady_caching = true;
                }
                ManagerKind::FullAttention | ManagerKind::SinkFullAttention { .. }
                    if b.block_size != self.hash_block_size && b.enable_caching =>
                {
                    needs.prompt_for_cache = true;
                    needs.cache_every_call = true;
                    unsteady_caching = true;
                }
                _ => {}
            }
        }
        if retention {
            needs.prompt_for_cache = true;
            needs.shared_prefix_for_cache = true;
        }
        needs.steady_decode = self.hisparse.is_none() && !unsteady_caching;
        needs
    }

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

    // ---- HiSparse ------------------------------------------------------------------

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

    /// HiSparse's `after_allocate` hook after a group took device blocks (nothing
    /// on other layouts).
    #[inline]
    fn after_allocate(&mut self) -> Result<()> {
        match self.hisparse_split() {
            Some((h, mut ctx)) => h.after_allocate(&mut ctx),
            None => Ok(()),
        }
    }

    /// Drains the device pool's reuse notifications (vLLM's callbacks) after a pool
    /// call outside the group loops.
    pub(crate) fn process_reused(&mut self) -> Result<()> {
        if !self.pool.has_reused_watched() {
            return Ok(());
        }
        match self.hisparse_split() {
            Some((h, mut ctx)) => h.process_reused(&mut ctx),
            None => {
                self.pool.take_reused_watched();
                Ok(())
            }
        }
    }

    /// One group's `allocate_new_blocks` (a single-type manager called directly).
    pub(crate) fn group_allocate_new_blocks(
        &mut self,
        g: usize,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let slot = self.state_mut(request_id).0;
        let state = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))?;
        self.managers[g].allocate_new_blocks(
            &mut self.pool,
            slot,
            request_id,
            &mut state.groups[g],
            num_tokens,
            num_tokens_main_model,
            out,
        )?;
        self.process_reused()
    }

    /// One group's `get_num_blocks_to_allocate` (a single-type manager called
    /// directly).
    pub(crate) fn group_num_blocks_to_allocate(
        &mut self,
        g: usize,
        q: &NumBlocksQuery<'_>,
    ) -> Result<i64> {
        let slot = self.slot_of(q.request_id).unwrap_or(u32::MAX);
        let req = self
            .requests
            .get(q.request_id)
            .and_then(|s| s.groups.get(g));
        self.managers[g].get_num_blocks_to_allocate(&self.pool, slot, req, q)
    }

    // ---- prefix hits ---------------------------------------------------------------

    fn eagle_proof_margin(&self, block_size: usize, fine_grained: bool) -> usize {
        let hbs = self.hash_block_size;
        if fine_grained && block_size > hbs {
            hbs
        } else {
            block_size
        }
    }

    /// vLLM's `find_longest_cache_hit`: per-group hit blocks (appended to `out[g]`),
    /// the hit length, and the uncached common prefix (hybrid only).
    pub fn find_longest_cache_hit(
        &self,
        block_hashes: &dyn BlockHashSource,
        max_cache_hit_length: usize,
        out: &mut [Vec<BlockId>],
    ) -> Result<(usize, usize)> {
        match self.kind {
            CoordinatorKind::NoPrefixCache => Ok((0, 0)),
            CoordinatorKind::Unitary => {
                let m = &self.managers[0];
                let q = HitQuery {
                    block_hashes,
                    max_length: max_cache_hit_length,
                    group_ids: &[0],
                    drop_eagle_block: self.drop_eagle_group_ids.contains(&0),
                    alignment_tokens: m.base().block_size,
                };
                let hit = m.find_longest_cache_hit(&self.pool, &q, &mut out[..1])?;
                Ok((hit, 0))
            }
            CoordinatorKind::Hybrid => {
                self.find_hybrid_hit(block_hashes, max_cache_hit_length, out)
            }
        }
    }

    /// One spec group's lookup into fresh per-group lists.
    fn spec_group_hit(
        &self,
        sg: &SpecGroup,
        block_hashes: &dyn BlockHashSource,
        max_length: usize,
        drop_eagle_block: bool,
    ) -> Result<(SmallVec<[Vec<BlockId>; 2]>, usize)> {
        let m = &self.managers[sg.group_ids[0] as usize];
        let mut found: SmallVec<[Vec<BlockId>; 2]> =
            sg.group_ids.iter().map(|_| Vec::new()).collect();
        let q = HitQuery {
            block_hashes,
            max_length,
            group_ids: &sg.group_ids,
            drop_eagle_block,
            alignment_tokens: self.cache_hit_alignment_tokens(),
        };
        let hit = m.find_longest_cache_hit(&self.pool, &q, &mut found)?;
        Ok((found, hit))
    }

    fn find_hybrid_hit(
        &self,
        block_hashes: &dyn BlockHashSource,
        max_cache_hit_length: usize,
        out: &mut [Vec<BlockId>],
    ) -> Result<(usize, usize)> {
        let n = self.managers.len();
        let mut hit_length = max_cache_hit_length;
        let mut longest = 0usize;
        let mut found_by_group: SmallVec<[Option<Vec<BlockId>>; 4]> =
            (0..n).map(|_| None).collect();
        let mut length_by_group: SmallVec<[usize; 4]> = SmallVec::from_elem(0, n);
        let simple = self.attention_groups.len() == 2 && self.attention_groups[0].is_full_attention;
        let mut eagle_verified: SmallVec<[usize; 4]> = SmallVec::new();
        let num_hashed_tokens = block_hashes.len() * self.hash_block_size;
        loop {
            let mut curr = hit_length;
            for (idx, sg) in self.attention_groups.iter().enumerate() {
                let first = sg.group_ids[0] as usize;
                if sg.is_full_attention && found_by_group[first].is_some() {
                    // Downward closed: trim, don't look up again.
                    curr = curr.min(length_by_group[first]);
                    continue;
                }
                let drop = sg.use_eagle && !eagle_verified.contains(&idx);
                let mut max_length = curr;
                if drop && !sg.is_mamba {
                    let bs = self.managers[first].base().block_size;
                    let margin = self.eagle_proof_margin(
                        bs,
                        self.enable_partial_hash_hits && sg.supports_fine_grained,
                    );
                    // vLLM 0.30 caps the probe at the hit cap, 0.32 / 0.33 at the hashes.
                    let cap = if self.pool.vllm_rules().eagle_probe_capped_at_max_hit {
                        max_cache_hit_length
                    } else {
                        num_hashed_tokens
                    };
                    max_length = (curr + margin).min(cap);
                }
                let (found, new_hit) = self.spec_group_hit(sg, block_hashes, max_length, drop)?;
                if drop {
                    eagle_verified.push(idx);
                } else if new_hit < curr {
                    // The candidate shrank: earlier EAGLE verifications no longer hold.
                    eagle_verified.clear();
                }
                curr = new_hit;
                for (&gid, blocks) in sg.group_ids.iter().zip(found) {
                    found_by_group[gid as usize] = Some(blocks);
                    length_by_group[gid as usize] = new_hit;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        // Truncate every full-attention group to the reconciled hit.
        for sg in &self.attention_groups {
            if !sg.is_full_attention {
                continue;
            }
            let m = &self.managers[sg.group_ids[0] as usize];
            if m.retains_longer_hit() {
                continue;
            }
            let bs = m.base().block_size;
            let keep = cdiv(hit_length, bs);
            for &gid in &sg.group_ids {
                if let Some(b) = found_by_group[gid as usize].as_mut() {
                    b.truncate(keep);
                }
            }
        }
        for (o, f) in out.iter_mut().zip(found_by_group) {
            if let Some(f) = f {
                o.extend(f);
            }
        }
        Ok((hit_length, longest - hit_length.min(longest)))
    }

    /// vLLM's `find_longest_cache_hit_per_group` (connectors): each spec group's own
    /// hit, per group, with its length.
    pub fn find_longest_cache_hit_per_group(
        &self,
        block_hashes: &dyn BlockHashSource,
        max_cache_hit_length: usize,
        out: &mut [Vec<BlockId>],
        lengths: &mut [usize],
    ) -> Result<()> {
        let num_hashed_tokens = block_hashes.len() * self.hash_block_size;
        for sg in &self.attention_groups {
            let first = sg.group_ids[0] as usize;
            let mut lookup = max_cache_hit_length;
            // vLLM 0.30 looks each group up at the cap itself, EAGLE or not.
            let probes = !self.pool.vllm_rules().eagle_probe_capped_at_max_hit;
            if probes && sg.use_eagle && !sg.is_mamba {
                let bs = self.managers[first].base().block_size;
                let margin = self.eagle_proof_margin(
                    bs,
                    self.enable_partial_hash_hits && sg.supports_fine_grained,
                );
                lookup = (max_cache_hit_length + margin).min(num_hashed_tokens);
            }
            let (found, hit) = self.spec_group_hit(sg, block_hashes, lookup, sg.use_eagle)?;
            for (&gid, blocks) in sg.group_ids.iter().zip(found) {
                out[gid as usize] = blocks;
                lengths[gid as usize] = hit;
            }
        }
        Ok(())
    }

    /// vLLM's `emit_cached_block_events` for a hit of `hit_length` tokens: a
    /// `BlockStored` per group for its reused blocks. A hit that ends inside a block
    /// (partial hits) has no full-block hash for that block: vLLM 0.33 raises
    /// `IndexError` there; hscache reports the full blocks and the partial entry.
    /// Blocks are reported at the group's block size as caching reports them (DCP
    /// included: vLLM 0.33 passes the spec's unscaled size there and fails an
    /// assertion).
    pub fn emit_cached_block_events(
        &mut self,
        num_hashes: usize,
        hit_length: usize,
        blocks: &[Vec<BlockId>],
    ) -> Result<()> {
        let hbs = self.hash_block_size;
        for (g, b) in blocks.iter().enumerate() {
            if b.is_empty() {
                continue;
            }
            let bs = self.managers[g].base().block_size;
            let scale = self.pool.hash_scale(bs)?;
            let full = b.len().min(num_hashes / scale);
            if let Some(src) = self.managers[g].hisparse_source_mut() {
                // The host pool's events (medium CPU) join the device pool's queue.
                let r = src
                    .host_pool_mut()
                    .emit_cached_block_events(full, bs, g as u32);
                self.pool.absorb_host_events(src.host_pool_mut(), None);
                r?;
                continue;
            }
            self.pool.emit_cached_block_events(full, bs, g as u32)?;
            if b.len() > full && hit_length >= hbs {
                self.pool.push_event(KVCacheEvent::PartialBlockStored {
                    group_id: g as u32,
                    num_tokens: (hit_length / hbs * hbs) as u32,
                    hash_block_size: hbs as u32,
                });
            }
        }
        Ok(())
    }

    // ---- allocation ----------------------------------------------------------------

    /// vLLM's `get_num_blocks_to_allocate`, summed over the groups.
    pub fn get_num_blocks_to_allocate(&mut self, q: &NumBlocksToAllocate<'_>) -> Result<i64> {
        let request_id = q.request_id;
        // Mamba "align" keeps per-request state from here on (vLLM's defaultdict
        // creates the request's entry too).
        let slot = if self.mamba_align {
            Some(self.state_mut(request_id).0)
        } else {
            self.requests.get_mut_with_slot(request_id).map(|(s, _)| s)
        };
        let retention_applies = self.retention_interval == Some(0);
        let state = self.requests.get(request_id);
        let mut total: i64 = 0;
        for (g, m) in self.managers.iter_mut().enumerate() {
            let req = state.and_then(|s| s.groups.get(g));
            let cross = m.base().spec.kind == ManagerKind::CrossAttention;
            let gq = q.group_query(g, cross, retention_applies);
            total +=
                m.get_num_blocks_to_allocate(&self.pool, slot.unwrap_or(u32::MAX), req, &gq)?;
        }
        Ok(total)
    }

    /// vLLM's `allocate_new_computed_blocks`: every group adopts its hits, then every
    /// group allocates its external-token blocks (HiSparse's hooks run between the
    /// groups, where vLLM's HiSparse managers call their coordinator).
    pub fn allocate_new_computed_blocks<'h>(
        &mut self,
        request_id: &str,
        hits: &dyn Fn(usize) -> &'h [BlockId],
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
        skip_zeroing: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let n = self.managers.len();
        let spare = &mut self.spare_states;
        let handle = self
            .requests
            .handle_or_insert_with(request_id, || Self::new_state(spare, n));
        if self
            .requests
            .get_by_handle(handle)
            .is_some_and(RequestState::is_running)
        {
            if (0..n).any(|g| !hits(g).is_empty()) {
                return Err(running_cannot_adopt(request_id));
            }
            return Ok(());
        }
        for g in 0..n {
            let state = state_of(&mut self.requests, handle, request_id)?;
            self.managers[g].add_local_computed_blocks(
                &mut self.pool,
                request_id,
                &mut state.groups[g],
                hits(g),
                num_local_computed_tokens,
                num_external_computed_tokens,
            )?;
            if let Some((h, ctx)) = self.hisparse_split() {
                h.after_adopt(&ctx, g, request_id, num_local_computed_tokens)?;
            }
        }
        if num_external_computed_tokens == 0 {
            return Ok(());
        }
        let num_tokens = num_local_computed_tokens + num_external_computed_tokens;
        for g in 0..n {
            if let Some(h) = self.hisparse.as_deref_mut() {
                h.before_external(g, request_id, num_tokens);
            }
            let state = state_of(&mut self.requests, handle, request_id)?;
            self.managers[g].allocate_external_computed_blocks(
                &mut self.pool,
                request_id,
                &mut state.groups[g],
                num_local_computed_tokens,
                num_external_computed_tokens,
                !skip_zeroing(g),
            )?;
            self.after_allocate()?;
        }
        Ok(())
    }

    /// vLLM's `allocate_new_blocks`: every group's new blocks, appended to `out`
    /// group after group (`ends[g]` marks the end of group `g`).
    pub fn allocate_new_blocks(
        &mut self,
        request_id: &str,
        num_tokens: usize,
        num_tokens_main_model: usize,
        num_encoder_tokens: usize,
        out: &mut Vec<BlockId>,
        ends: &mut SmallVec<[usize; 4]>,
    ) -> Result<()> {
        let n = self.managers.len();
        let spare = &mut self.spare_states;
        let handle = self
            .requests
            .handle_or_insert_with(request_id, || Self::new_state(spare, n));
        let slot = RequestTable::<RequestState>::slot_of_handle(handle);
        for g in 0..n {
            let m = &mut self.managers[g];
            let tokens = if m.base().spec.kind == ManagerKind::CrossAttention {
                num_encoder_tokens
            } else {
                num_tokens
            };
            let state = state_of(&mut self.requests, handle, request_id)?;
            m.allocate_new_blocks(
                &mut self.pool,
                slot,
                request_id,
                &mut state.groups[g],
                tokens,
                num_tokens_main_model,
                out,
            )?;
            ends.push(out.len());
            self.after_allocate()?;
        }
        Ok(())
    }

    /// vLLM's `get_num_cacheable_tokens`: the prefix group `g` may cache.
    pub fn get_num_cacheable_tokens(&self, num_computed_tokens: usize, g: usize) -> usize {
        let finalized = num_computed_tokens.saturating_sub(self.num_reprefillable_tokens);
        if self.kind != CoordinatorKind::Hybrid {
            return finalized;
        }
        let align = |n: usize| {
            if self.enable_partial_hash_hits {
                n
            } else {
                n / self.scheduler_block_size * self.scheduler_block_size
            }
        };
        let cached = align(num_computed_tokens);
        let m = self.managers[g].base();
        if m.use_eagle && cached > 0 {
            // EAGLE matches one block past the aligned boundary, then drops it.
            return finalized.min(align(finalized) + m.block_size);
        }
        cached
    }

    /// vLLM's `replay_boundaries`: where a request replaying this prompt resumes.
    pub fn replay_boundaries(&self, num_prompt_tokens: usize) -> SmallVec<[i64; 2]> {
        let p = num_prompt_tokens as i64;
        if self.drop_eagle_group_ids.is_empty() {
            return SmallVec::from_slice(&[p - 1]);
        }
        let b = self.scheduler_block_size as i64;
        let resend = (p - 1).div_euclid(b) * b;
        let extension = p.div_euclid(b) * b;
        let mut out: SmallVec<[i64; 2]> = SmallVec::new();
        for v in [(resend - b).max(0), (extension - b).max(0)] {
            if !out.contains(&v) {
                out.push(v);
            }
        }
        out.sort_unstable();
        out
    }

    /// The raw hash indices caching `num_computed_tokens` of `request_id` may read:
    /// the run `[lo, hi)` and `points` (see [`PlannedHashes`]). `hits_lower_bound`
    /// gives, for a request that adopts hits in this call, the cached blocks it will
    /// have (else its current count is used).
    pub fn cache_reads(
        &self,
        request_id: &str,
        num_computed_tokens: usize,
        num_prompt_tokens: usize,
        num_hashes: usize,
        adopting_tokens: Option<usize>,
        points: &mut SmallVec<[usize; 4]>,
    ) -> (usize, usize) {
        let hbs = self.hash_block_size;
        let state = self.requests.get(request_id);
        let (slot, _) = self
            .requests
            .handle(request_id)
            .map_or((u32::MAX, ()), |h| {
                (RequestTable::<RequestState>::slot_of_handle(h), ())
            });
        let mut lo = usize::MAX;
        let mut hi = 0usize;
        for (g, m) in self.managers.iter().enumerate() {
            let b = m.base();
            if !b.enable_caching {
                continue;
            }
            let scale = (b.block_size / hbs).max(1);
            let cached = match adopting_tokens {
                Some(local) => local / b.block_size,
                None => state
                    .and_then(|s| s.groups.get(g))
                    .and_then(|gb| gb.num_cached_block)
                    .unwrap_or(0),
            };
            lo = lo.min(cached * scale);
            let n = self.get_num_cacheable_tokens(num_computed_tokens, g);
            hi = hi.max(n / hbs);
            m.extra_hash_reads(
                slot,
                num_prompt_tokens,
                num_hashes,
                n,
                num_computed_tokens,
                points,
            );
        }
        (lo.min(hi), hi.min(num_hashes))
    }

    /// vLLM's `cache_blocks` over the groups, with the hashes the call planned.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_blocks(
        &mut self,
        request_id: &str,
        block_hashes: &PlannedHashes,
        num_computed_tokens: usize,
        num_prompt_tokens: usize,
        request_num_computed_tokens: usize,
        shared_prefix_boundary: usize,
    ) -> Result<()> {
        let boundaries = self.replay_boundaries(num_prompt_tokens);
        let Some(handle) = self.requests.handle(request_id) else {
            return Err(Error::UnknownRequest(request_id.to_owned()));
        };
        let slot = RequestTable::<RequestState>::slot_of_handle(handle);
        for g in 0..self.managers.len() {
            if !self.managers[g].base().enable_caching {
                continue;
            }
            let q = CacheQuery {
                request_id,
                block_hashes,
                num_tokens: self.get_num_cacheable_tokens(num_computed_tokens, g),
                retention_interval: self.retention_interval,
                replay_boundaries: &boundaries,
                num_prompt_tokens,
                num_computed_tokens: request_num_computed_tokens,
                shared_prefix_boundary,
            };
            if let Some((h, mut ctx)) = self.hisparse_split() {
                if h.cache_group(&mut ctx, g, &q)? {
                    continue;
                }
            }
            let state = state_of(&mut self.requests, handle, request_id)?;
            self.managers[g].cache_blocks(&mut self.pool, slot, &mut state.groups[g], &q)?;
        }
        Ok(())
    }

    /// Refuses, before anything changes, a `cache_blocks` call that would cache past
    /// a group's table (a request whose caching was delayed, asked to cache more
    /// tokens than it holds blocks for): vLLM slices the table short and records a
    /// cached count past it; the pool's own check would find it only half-way
    /// through the groups.
    pub fn check_cache_fits(
        &self,
        request_id: &str,
        num_computed_tokens: usize,
        num_hashes: usize,
    ) -> Result<()> {
        if self.hisparse.is_some() {
            return Ok(());
        }
        let Some(state) = self.requests.get(request_id) else {
            return Err(Error::UnknownRequest(request_id.to_owned()));
        };
        for (g, m) in self.managers.iter().enumerate() {
            let base = m.base();
            if !base.enable_caching || !base.spec.prefix_cacheable {
                continue;
            }
            let cacheable = self.get_num_cacheable_tokens(num_computed_tokens, g);
            let req = &state.groups[g];
            let (num_cached, num_full) = cache_range(base, &self.pool, req, num_hashes, cacheable);
            if num_full > num_cached && num_full > req.blocks.len() {
                return Err(Error::InvalidArgument(format!(
                    "cannot cache {num_computed_tokens} tokens of request {request_id:?}: \
                     group {g} would cache {num_full} blocks and the request holds {}",
                    req.blocks.len()
                )));
            }
        }
        Ok(())
    }

    /// Refuses a `free_blocks` of the shared pool that would leave a block with
    /// fewer references than the live block tables holding it (a caller freeing a
    /// running request's block: vLLM takes it, and the block can then be handed to
    /// another request while the first still reads it). Scans every table: the
    /// checked mode's check, not the hot path's.
    #[cold]
    #[inline(never)]
    pub fn check_free_keeps_tables(&self, ids: &[BlockId]) -> Result<()> {
        let mut freed: Vec<(BlockId, u32)> = Vec::new();
        for &b in ids.iter().filter(|&&b| b != NULL_BLOCK_ID) {
            self.pool.check_block_id(i64::from(b))?;
            match freed.iter_mut().find(|(id, _)| *id == b) {
                Some((_, n)) => *n += 1,
                None => freed.push((b, 1)),
            }
        }
        for &(b, n) in &freed {
            let mut holders = 0u32;
            let mut first = None;
            for (rid, state) in self.requests.iter() {
                for (g, gb) in state.groups.iter().enumerate() {
                    if self.managers[g].host_pool().is_some() {
                        continue;
                    }
                    let k = gb.blocks.iter().filter(|&&x| x == b).count() as u32;
                    if k > 0 {
                        holders += k;
                        first.get_or_insert(rid);
                    }
                }
            }
            // More frees than references is a double free: the pool names it.
            let rc = self.pool.ref_cnt(b);
            if holders > 0 && rc >= n && rc - n < holders {
                return Err(Error::InvalidArgument(format!(
                    "block {b} is still in the block table of request {:?}: free the \
                     request, or pop its blocks (pop_blocks_for_free), before freeing them",
                    first.unwrap_or_default()
                )));
            }
        }
        Ok(())
    }

    /// vLLM's `remove_skipped_blocks` over the groups.
    pub fn remove_skipped_blocks(
        &mut self,
        request_id: &str,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        let Some((slot, state)) = self.requests.get_mut_with_slot(request_id) else {
            return Ok(());
        };
        for (g, m) in self.managers.iter_mut().enumerate() {
            m.remove_skipped_blocks(
                &mut self.pool,
                slot,
                &mut state.groups[g],
                processed_computed_tokens,
                num_prompt_tokens,
            )?;
        }
        Ok(())
    }

    /// vLLM's `free`: every group's table, tail first (no-op for an unknown
    /// request). All or nothing: a double free leaves every table in place (on a
    /// HiSparse layout, see `release`).
    pub fn free(
        &mut self,
        request_id: &str,
        scratch: &mut Vec<BlockId>,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        match self.requests.handle(request_id) {
            Some(h) => self.free_handles(&[h], scratch, pubs),
            None => self.release_untracked(request_id, pubs),
        }
    }

    /// `free` of each request `handles` name, in order, checked as one: either every
    /// reference is dropped or none (stale handles are an error).
    pub fn free_handles(
        &mut self,
        handles: &[crate::request_table::RequestHandle],
        scratch: &mut Vec<BlockId>,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        self.release(handles, pubs, Release::Free(scratch))
            .map(|_| ())
    }

    /// vLLM's `pop_blocks_for_free`: the request's blocks in allocation order, group
    /// after group, leading nulls trimmed; not freed.
    /// On a HiSparse layout the request is detached from the HiSparse coordinator
    /// first, and the host group's blocks (host pool ids) are the returned range.
    pub fn pop_blocks_for_free(
        &mut self,
        request_id: &str,
        out: &mut Vec<BlockId>,
        pubs: &dyn PublicationRequests,
    ) -> Result<Option<std::ops::Range<usize>>> {
        match self.requests.handle(request_id) {
            Some(h) => self.release(&[h], pubs, Release::Pop(out)),
            None => self.release_untracked(request_id, pubs).map(|_| None),
        }
    }

    /// `free` / `pop_blocks_for_free` of a request that holds no tables: nothing,
    /// but HiSparse still detaches it (vLLM does: its spills may be in flight).
    fn release_untracked(
        &mut self,
        request_id: &str,
        pubs: &dyn PublicationRequests,
    ) -> Result<()> {
        match self.hisparse_split() {
            Some((h, mut ctx)) => h.free(&mut ctx, request_id, pubs),
            None => Ok(()),
        }
    }

    /// The one group loop of `free`, the batch free and `pop_blocks_for_free`: each
    /// request's groups in order hand back their blocks (`blocks_for_free`) to
    /// `sink`. Freeing, the device pool's blocks are gathered (each group tail
    /// first) and freed as one checked call; the host group's go back to the host
    /// pool. Popping returns the host group's range of `out` (the last request's).
    ///
    /// HiSparse's `before_free` hook detaches the request at the source group; what
    /// the groups before it gathered is freed first, so the device pool sees vLLM's
    /// group-by-group order. A HiSparse free is therefore all or nothing only
    /// between two source groups (vLLM's is not either: each group frees in turn).
    fn release(
        &mut self,
        handles: &[crate::request_table::RequestHandle],
        pubs: &dyn PublicationRequests,
        mut sink: Release<'_>,
    ) -> Result<Option<std::ops::Range<usize>>> {
        // vLLM 0.32 hands back (and frees) the leading nulls too.
        let keep_nulls = self.pool.vllm_rules().null_block_ref_counted;
        let host_group = self.hisparse.as_deref().map(|h| h.layout().host_group);
        let mut ends: SmallVec<[usize; 8]> = SmallVec::new();
        let mut host_range = None;
        let stale = |h| Error::UnknownRequest(format!("handle {h:#x}"));
        if let Release::Free(scratch) = &mut sink {
            scratch.clear();
        }
        for &h in handles {
            for g in 0..self.managers.len() {
                let is_host = Some(g) == host_group;
                if is_host {
                    if let Release::Free(scratch) = &mut sink {
                        self.pool.free_block_segments(scratch, &ends)?;
                        scratch.clear();
                        ends.clear();
                    }
                    let Some(rid) = self.requests.key_of(h) else {
                        return Err(stale(h));
                    };
                    let rid: Box<str> = rid.into();
                    if let Some((hs, mut ctx)) = self.hisparse_split() {
                        hs.before_free(&mut ctx, g, &rid, pubs)?;
                    }
                }
                let (Some(rid), Some(state)) =
                    (self.requests.key_of(h), self.requests.get_by_handle(h))
                else {
                    return Err(stale(h));
                };
                let buf: &mut Vec<BlockId> = match &mut sink {
                    Release::Free(scratch) => scratch,
                    Release::Pop(out) => out,
                };
                let start = buf.len();
                self.managers[g].blocks_for_free(rid, &state.groups[g], keep_nulls, buf);
                let end = buf.len();
                match &mut sink {
                    Release::Pop(_) if is_host => host_range = Some(start..end),
                    Release::Pop(_) => {}
                    Release::Free(scratch) => {
                        scratch[start..].reverse();
                        if is_host {
                            self.free_host_blocks(g, &scratch[start..])?;
                            scratch.truncate(start);
                        } else {
                            ends.push(end);
                        }
                    }
                }
            }
        }
        if let Release::Free(scratch) = &mut sink {
            self.pool.free_block_segments(scratch, &ends)?;
        }
        for &h in handles {
            if let Some(rid) = self.requests.key_of(h) {
                let rid: Box<str> = rid.into();
                self.pop_request_state(&rid);
            }
        }
        Ok(host_range)
    }

    /// Frees `blocks` (tail first) into group `g`'s host pool, its events joining
    /// the device pool's queue.
    fn free_host_blocks(&mut self, g: usize, blocks: &[BlockId]) -> Result<()> {
        let src = self.managers[g]
            .hisparse_source_mut()
            .ok_or_else(|| Error::Internal("no HiSparse source".into()))?;
        let r = src.host_pool_mut().free_blocks(blocks);
        self.pool.absorb_host_events(src.host_pool_mut(), None);
        r
    }

    /// Removes the request's state and the managers' per-request state.
    pub(crate) fn pop_request_state(&mut self, request_id: &str) {
        let Some(handle) = self.requests.handle(request_id) else {
            return;
        };
        let slot = RequestTable::<RequestState>::slot_of_handle(handle);
        for m in &mut self.managers {
            m.pop_request(slot, request_id);
        }
        if let Some(state) = self.requests.remove_by_handle(handle) {
            self.recycle(state);
        }
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

    /// Checks the coordinator's invariants on top of the pool's: every block a
    /// request holds is referenced at least as often as tables hold it, no table
    /// holds a free block, and hit bookkeeping is in range.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.check_invariants_with(None)
    }

    /// [`Self::check_invariants`]; with `external` (the references the manager
    /// handed out beside the tables: the `BlockPool` view's `get_new_blocks` and
    /// `touch`, `pop_blocks_for_free`), every device block's ref count must equal
    /// the number of table slots holding it plus its external references.
    pub fn check_invariants_with(
        &self,
        external: Option<&[i32]>,
    ) -> std::result::Result<(), String> {
        self.pool.check_invariants()?;
        let host_group = self.managers.iter().position(|m| m.host_pool().is_some());
        if let Some(g) = host_group {
            self.pool_of(g).check_invariants()?;
        }
        let mut held = vec![0u32; self.pool.num_gpu_blocks() as usize];
        let mut host_held =
            vec![0u32; host_group.map_or(0, |g| self.pool_of(g).num_gpu_blocks() as usize)];
        for (rid, state) in self.requests.iter() {
            if state.groups.len() != self.managers.len() {
                return Err(format!(
                    "request {rid:?} has {} group tables",
                    state.groups.len()
                ));
            }
            for (g, gb) in state.groups.iter().enumerate() {
                let counts = if Some(g) == host_group {
                    &mut host_held
                } else {
                    &mut held
                };
                for &b in &gb.blocks {
                    if b != NULL_BLOCK_ID {
                        counts[b as usize] += 1;
                    }
                }
                if gb.num_cached_block.is_some_and(|n| n > gb.blocks.len()) {
                    return Err(format!(
                        "request {rid:?} group {g}: {} cached blocks of a {}-block table",
                        gb.num_cached_block.unwrap_or(0),
                        gb.blocks.len()
                    ));
                }
            }
        }
        // A queued copy-on-write pair holds one reference to each endpoint until
        // the Scheduler takes it (then the manager counts it as external).
        for m in self.managers.iter().filter(|m| m.host_pool().is_none()) {
            for &(src, cow) in &m.base().pending_cow_copies {
                for b in [src, cow] {
                    if let Some(c) = held.get_mut(b as usize) {
                        *c += 1;
                    }
                }
            }
        }
        for (b, &h) in held.iter().enumerate() {
            let rc = self.pool.ref_cnt(b as BlockId);
            if let Some(ext) = external {
                let e = ext.get(b).copied().unwrap_or(0);
                if b != NULL_BLOCK_ID as usize && i64::from(h) + i64::from(e) != i64::from(rc) {
                    let queued = if self.pool.free_block_queue().contains(b as BlockId) {
                        " (and it is in the free queue)"
                    } else {
                        ""
                    };
                    return Err(format!(
                        "block {b} has ref_cnt {rc} but {h} table slots or queued copies \
                         and {e} external references hold it{queued}"
                    ));
                }
            } else if h > rc {
                return Err(format!("block {b} is held {h} times but has ref_cnt {rc}"));
            }
        }
        if let Some(g) = host_group {
            for (b, &h) in host_held.iter().enumerate() {
                let rc = self.pool_of(g).ref_cnt(b as BlockId);
                if h > rc {
                    return Err(format!(
                        "host block {b} is held {h} times but has ref_cnt {rc}"
                    ));
                }
            }
        }
        Ok(())
    }
}
