//! `KVCacheManager`: the scheduler-facing facade over the coordinator.
//!
//! Mirrors vLLM 0.33 `v1/core/kv_cache_manager.py::KVCacheManager`: the rules of
//! the Scheduler's interface live here (when a lookup is skipped, the
//! `num_tokens - 1` hit cap, when the watermark applies, what `allocate_slots`
//! counts, adopts, allocates and caches); the groups' mechanics live in
//! [`coordinator`] and the single-type managers beside it. The hits handed back
//! are checked in `hit_check.rs`; the calls vLLM code makes past the facade (its
//! block pool, coordinator and single-type managers) are in `past_facade.rs`.
//!
//! `allocate_slots` follows vLLM's stages on the token layout
//!
//! ```text
//! | comp | new_comp | ext_comp | new | lookahead |
//!                   |<-- to be computed ------->|
//!        |<-------- to be allocated ----------->|
//! ```
//!
//! 0. `validate_allocation`, `plan_allocation`: validate every argument, read every
//!    request field the call may need and the hashes it may cache — nothing has
//!    changed yet, and an `Err` leaves the manager exactly as it was
//!    (`full_sequence_fits` is vLLM's optional first check);
//! 1. `free_skipped_blocks` (done even if the call then does not fit, as in vLLM),
//!    then `new_blocks_fit`: count the blocks needed (new blocks + prefix hits that
//!    sit in the free queue) and give up (`Ok(false)`) if they do not fit beside the
//!    watermark and the reserved blocks — hits are not touched then;
//! 2. `adopt_computed_blocks`: adopt the hits (touch) and allocate blocks for
//!    external tokens;
//! 3. `allocate_new_blocks` for the new and lookahead tokens, then `cache_planned`:
//!    every block fully covered by the request's hashes, capped at `num_tokens` so
//!    draft tokens are never cached.
//!
//! A running request that adopts nothing and needs no new block skips the stages
//! (`allocate_slots_in_place`, the steady decode step); both paths decide alike.
//!
//! Steps 1–3 cannot fail on input. If one fails anyway (a broken invariant, e.g.
//! blocks freed twice behind the manager's back), the manager is *poisoned*
//! ([`crate::shield::Poison`]): that call and every later one raise, naming the
//! first failure.

pub mod batch;
pub mod chunked_local;
pub mod circular_buffer;
pub mod coordinator;
pub mod cross_attention;
mod digest;
mod explain;
pub mod full_attention;
mod grouped;
pub mod hisparse;
mod hit_check;
pub mod mamba;
#[cfg(any(test, feature = "testing", feature = "mutants"))]
pub mod mutants;
mod past_facade;
mod poison;
pub mod registry;
pub mod request;
pub mod rswa;
pub mod single_type;
pub mod sink;
pub mod sliding_window;
pub mod spec;
mod steady;
mod vllm_rules;

use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::events::{KVCacheEvent, MetricsOp};
use crate::pool::BlockPool;
pub use crate::request_table::{RequestHandle, RequestTable};
use crate::shield::Poison;
use crate::types::{cdiv, BlockHash, BlockHashSource, BlockId};
pub use batch::{BatchProgress, BatchStop, RunningBatch};
pub use coordinator::{
    CoordinatorConfig, CoordinatorKind, KVCacheCoordinator, NumBlocksToAllocate, RequestState,
};
pub use grouped::{GroupedBlockIds, GroupedBlocks};
pub use hisparse::{
    HiSparseCoordinator, HiSparseCtx, PlainPublicationRequests, PublicationRequests,
};
pub use poison::check_invariants_from_env;
pub use request::{PlainRequest, PlannedHashes, RequestLike, RequestStatus};
pub use single_type::{BoundaryOffload, GroupBlocks, SteadyQuery};
pub use spec::{GroupSpec, MambaCacheMode, MambaParams, ManagerKind};

/// Construction parameters (vLLM's `KVCacheManager` keywords, resolved).
#[derive(Clone, Debug)]
pub struct KVCacheManagerConfig {
    pub coordinator: CoordinatorConfig,
    pub max_model_len: usize,
    /// `int(watermark * num_blocks)`.
    pub watermark_blocks: usize,
    /// `enable_mamba_shared_prefix_checkpoint`.
    pub enable_mamba_shared_prefix_checkpoint: bool,
}

impl KVCacheManagerConfig {
    /// One full-attention group of `block_size` tokens (tests, benches, the batched
    /// API's common case).
    pub fn full_attention(num_blocks: u32, block_size: usize, max_model_len: usize) -> Self {
        Self {
            coordinator: CoordinatorConfig {
                num_blocks,
                groups: vec![GroupSpec::full_attention(block_size)],
                use_eagle: false,
                enable_caching: true,
                enable_kv_cache_events: false,
                dcp_world_size: 1,
                pcp_world_size: 1,
                scheduler_block_size: block_size,
                hash_block_size: block_size,
                collect_metrics: false,
                num_hash_lookahead_tokens: 0,
                num_prefill_lookahead: 0,
                retention_interval: None,
                needs_kv_cache_zeroing: false,
                allow_partial_hash_hits: true,
            },
            max_model_len,
            watermark_blocks: 0,
            enable_mamba_shared_prefix_checkpoint: false,
        }
    }
}

/// `allocate_slots`' arguments beyond the request.
#[derive(Clone, Copy, Debug)]
pub struct AllocateSlots<'a> {
    pub num_new_tokens: usize,
    pub num_new_computed_tokens: usize,
    /// `None`: the manager's empty `KVCacheBlocks` singleton (no lookup result);
    /// `Some(blocks)`: a lookup result, possibly empty.
    pub new_computed_blocks: Option<GroupedBlocks<'a>>,
    pub num_lookahead_tokens: usize,
    pub num_external_computed_tokens: usize,
    pub delay_cache_blocks: bool,
    pub num_encoder_tokens: usize,
    pub full_sequence_must_fit: bool,
    /// Blocks held back for in-flight prefills (the Scheduler's reservation; may be
    /// negative: a Mamba "align" group's over-allocated speculative blocks count
    /// against it, as in vLLM).
    pub reserved_blocks: i64,
    /// Other requests are scheduled this step (the watermark may apply).
    pub has_scheduled_reqs: bool,
    /// Groups whose external-token blocks an async load writes (not zeroed).
    pub skip_zeroing_group_ids: &'a [u32],
}

impl Default for AllocateSlots<'_> {
    fn default() -> Self {
        Self {
            num_new_tokens: 0,
            num_new_computed_tokens: 0,
            new_computed_blocks: None,
            num_lookahead_tokens: 0,
            num_external_computed_tokens: 0,
            delay_cache_blocks: false,
            num_encoder_tokens: 0,
            full_sequence_must_fit: false,
            reserved_blocks: 0,
            has_scheduled_reqs: true,
            skip_zeroing_group_ids: &[],
        }
    }
}

/// What a caching step reads, decided in the plan.
struct CachePlan {
    num_tokens: usize,
    hashes: PlannedHashes,
    num_prompt_tokens: usize,
    shared_prefix_boundary: usize,
}

/// What `allocate_slots`' stage 0 decided (vLLM's locals, named as there).
struct AllocationPlan<'h> {
    /// The hits handed back (retained groups cut to the reused tokens).
    hits: GroupedBlocks<'h>,
    /// A lookup result was handed back or external tokens arrive: stage 2 runs.
    adopt: bool,
    /// The request adopted its hits (or cached a block) in an earlier call.
    running: bool,
    /// `num_local_computed_tokens`: computed tokens plus the new hits.
    num_local: usize,
    /// Local plus external computed tokens, and the same capped at `max_model_len`.
    total_uncapped: usize,
    total: usize,
    watermark: usize,
    /// `num_prompt_tokens`, `prefill_end`, `num_in_flight_tokens`: read only where
    /// some group needs them, else 0.
    prompt: usize,
    prefill_end: usize,
    in_flight: usize,
    num_tokens_main_model: usize,
    num_tokens_need_slot: usize,
    /// What stage 3 caches (None: caching off or delayed, or no block to gain).
    cache: Option<CachePlan>,
}

/// The core KV-cache manager (see module docs).
#[derive(Debug)]
pub struct KVCacheManager {
    config: KVCacheManagerConfig,
    coordinator: KVCacheCoordinator,
    mamba_shared_prefix_checkpoint: bool,
    /// Set by the first apply-phase failure; every later call refuses to run.
    poison: Poison,
    /// Reused buffers (hashes of a caching step, a request's blocks when freed).
    hash_buffer: Vec<BlockHash>,
    free_scratch: Vec<BlockId>,
    /// Counter of checked batches (duplicate detection in the batched calls).
    batch_epoch: u64,
    /// Check every invariant after each mutating call (`HSCACHE_CHECK_INVARIANTS=1`,
    /// and always in debug builds); a violation poisons the manager.
    check_after_ops: bool,
    /// Device-pool references handed out beside the request tables, by block: the
    /// `BlockPool` view's `get_new_blocks` / `touch` and `pop_blocks_for_free`
    /// (given back by `free_blocks`). Lets `check_invariants` demand ref count ==
    /// owners exactly.
    external_refs: Vec<i32>,
    /// Explain mode (`crate::explain`, `explain.rs`); None = off.
    explain: Option<Box<crate::explain::Explainer>>,
    /// `allocate_slots` may decide the steady decode step without vLLM's stages
    /// (on; off only to check that both decide alike, see [`Self::set_steady_decode`]).
    steady_decode: bool,
    /// `allocate_slots` calls the steady decode step decided.
    num_steady_steps: u64,
}

impl KVCacheManager {
    /// vLLM's constructor: every assertion vLLM makes is an `Err`.
    pub fn new(config: KVCacheManagerConfig) -> Result<Self> {
        let c = &config.coordinator;
        // Bounds that keep every count sum below usize::MAX, token offsets below
        // 2^32 and block ids valid as int32 (the batched calls' output arrays).
        for g in &c.groups {
            if g.block_size == 0 || g.block_size > 1 << 20 {
                return Err(Error::InvalidArgument(format!(
                    "block_size must be in 1..=1048576, got {}",
                    g.block_size
                )));
            }
        }
        if c.scheduler_block_size > 1 << 30 || c.hash_block_size > 1 << 30 {
            return Err(Error::InvalidArgument(
                "scheduler_block_size and hash_block_size must be at most 2**30".into(),
            ));
        }
        if config.max_model_len > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "max_model_len must be at most {}, got {}",
                u32::MAX,
                config.max_model_len
            )));
        }
        if c.num_blocks > i32::MAX as u32 {
            return Err(Error::InvalidArgument(format!(
                "num_blocks must be at most {}, got {}",
                i32::MAX,
                c.num_blocks
            )));
        }
        let mut coordinator = KVCacheCoordinator::new(c.clone())?;
        coordinator.enable_hisparse(c.num_blocks, config.max_model_len)?;
        // One predicate for both sides of the feature (vLLM's comment): multi-module
        // MTP is excluded because caching then lags the chunk end.
        let mamba_shared_prefix_checkpoint = config.enable_mamba_shared_prefix_checkpoint
            && !coordinator.eagle_group_ids().is_empty()
            && coordinator.enable_partial_hash_hits()
            && coordinator.num_reprefillable_tokens() == 0;
        if mamba_shared_prefix_checkpoint {
            coordinator.set_mamba_shared_prefix_checkpoint();
        }
        let n = c.num_blocks as usize;
        let mut external_refs = Vec::new();
        external_refs
            .try_reserve_exact(n)
            .map_err(|_| Error::OutOfMemory {
                bytes: (n as u128) * 4,
                what: "the manager's external reference counts",
            })?;
        external_refs.resize(n, 0);
        Ok(Self {
            config,
            coordinator,
            mamba_shared_prefix_checkpoint,
            poison: Poison::new("KV-cache manager"),
            hash_buffer: Vec::new(),
            free_scratch: Vec::new(),
            batch_epoch: 0,
            check_after_ops: check_invariants_from_env(),
            steady_decode: true,
            num_steady_steps: 0,
            external_refs,
            explain: None,
        })
    }

    // ---- configuration and state ---------------------------------------------------

    /// The construction parameters.
    pub fn config(&self) -> &KVCacheManagerConfig {
        &self.config
    }

    /// The coordinator (groups, managers, request tables).
    #[inline]
    pub fn coordinator(&self) -> &KVCacheCoordinator {
        &self.coordinator
    }

    /// The shared block pool.
    #[inline]
    pub fn block_pool(&self) -> &BlockPool {
        self.coordinator.block_pool()
    }

    /// The shared block pool, mutable (deferred frees go through it).
    #[inline]
    pub fn block_pool_mut(&mut self) -> Result<&mut BlockPool> {
        self.guard()?;
        Ok(self.coordinator.block_pool_mut())
    }

    /// Whether prefix caching is on.
    #[inline]
    pub fn enable_caching(&self) -> bool {
        self.config.coordinator.enable_caching
    }

    /// Number of KV-cache groups.
    #[inline]
    pub fn num_kv_cache_groups(&self) -> usize {
        self.coordinator.num_groups()
    }

    /// vLLM's `mamba_shared_prefix_checkpoint`.
    #[inline]
    pub fn mamba_shared_prefix_checkpoint(&self) -> bool {
        self.mamba_shared_prefix_checkpoint
    }

    /// KV-cache usage in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        self.block_pool().get_usage()
    }

    #[inline(always)]
    fn check_tokens(&self, name: &'static str, n: usize) -> Result<()> {
        if n > self.config.max_model_len {
            return Err(self.too_many_tokens(name, n));
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn too_many_tokens(&self, name: &str, n: usize) -> Error {
        Error::InvalidArgument(format!(
            "{name} = {n} exceeds max_model_len = {}",
            self.config.max_model_len
        ))
    }

    // ---- prefix-cache lookups ------------------------------------------------------

    /// vLLM's `prefix_cache_lookup_enabled`: caching on and the request does not
    /// skip reading the cache (prompt logprobs, all-token pooling).
    pub fn prefix_cache_lookup_enabled<R: RequestLike>(&self, request: &R) -> Result<bool> {
        Ok(self.enable_caching() && !request.skip_reading_prefix_cache()?)
    }

    /// The lookup's hit cap: `max_cache_hit_length`, by default `num_tokens - 1`
    /// (the last token is always recomputed to get its logits).
    fn max_hit_length<R: RequestLike>(&self, request: &R, given: Option<usize>) -> Result<usize> {
        match given {
            Some(n) => Ok(n),
            None => Ok(request.num_tokens()?.saturating_sub(1)),
        }
    }

    /// vLLM's `get_computed_blocks`: the hit blocks of each group (appended to
    /// `out[g]`, which must hold one list per group), the hit length and the shared
    /// prefix boundary. Ref counts are not changed. `report_full(request)` says
    /// whether the request asked for `kv_cache_report_mode == "full"` (read only for
    /// a hit with events on).
    pub fn get_computed_blocks<R: RequestLike>(
        &mut self,
        request: &R,
        max_cache_hit_length: Option<usize>,
        report_full: &dyn Fn() -> Result<bool>,
        out: &mut [Vec<BlockId>],
    ) -> Result<(usize, usize)> {
        self.guard()?;
        if out.len() != self.num_kv_cache_groups() {
            return Err(Error::InvalidArgument("one output list per group".into()));
        }
        if !self.prefix_cache_lookup_enabled(request)? {
            if self.explain.is_some() {
                self.explain_skipped(request);
            }
            return Ok((0, 0));
        }
        let max_len = self.max_hit_length(request, max_cache_hit_length)?;
        let hashes = request.block_hashes()?;
        let (hit, uncached) = self
            .coordinator
            .find_longest_cache_hit(&hashes, max_len, out)?;
        if hit > 0 && self.block_pool().enable_kv_cache_events() && report_full()? {
            let num_hashes = hashes.len();
            let r = self
                .coordinator
                .emit_cached_block_events(num_hashes, hit, out);
            self.applied(r)?;
        }
        let shared_prefix_boundary = if uncached > 0 { hit + uncached } else { 0 };
        if self.explain.is_some() {
            self.explain_lookup(request, max_len, hit, None);
        }
        Ok((hit, shared_prefix_boundary))
    }

    /// vLLM's `get_computed_blocks_for_connector`: hybrid Mamba models report the
    /// full-attention hit (a connector supplies the Mamba state) and whether the
    /// groups' hits diverged; everything else is `get_computed_blocks`.
    pub fn get_computed_blocks_for_connector<R: RequestLike>(
        &mut self,
        request: &R,
        max_cache_hit_length: Option<usize>,
        report_full: &dyn Fn() -> Result<bool>,
        out: &mut [Vec<BlockId>],
    ) -> Result<(usize, usize, bool)> {
        self.guard()?;
        let fa = self.coordinator.full_attention_group_id();
        let hybrid_mamba = self.coordinator.kind() == CoordinatorKind::Hybrid
            && fa.is_some()
            && self
                .coordinator
                .managers()
                .iter()
                .any(|m| m.base().spec.is_mamba());
        let (Some(fa), true) = (fa, hybrid_mamba) else {
            let (hit, spb) =
                self.get_computed_blocks(request, max_cache_hit_length, report_full, out)?;
            return Ok((hit, spb, false));
        };
        if !self.prefix_cache_lookup_enabled(request)? {
            if self.explain.is_some() {
                self.explain_skipped(request);
            }
            return Ok((0, 0, false));
        }
        let max_len = self.max_hit_length(request, max_cache_hit_length)?;
        let mut lengths: SmallVec<[usize; 4]> = SmallVec::from_elem(0, out.len());
        let mut found: Vec<Vec<BlockId>> = vec![Vec::new(); out.len()];
        self.coordinator.find_longest_cache_hit_per_group(
            &request.block_hashes()?,
            max_len,
            &mut found,
            &mut lengths,
        )?;
        let num_local = lengths[fa as usize];
        if lengths.iter().any(|&h| h > num_local) {
            // A lagging group hit deeper than full attention: its full-attention
            // blocks were evicted; use the boundary every group agrees on.
            let (hit, spb) =
                self.get_computed_blocks(request, max_cache_hit_length, report_full, out)?;
            return Ok((hit, spb, false));
        }
        for (o, f) in out.iter_mut().zip(found) {
            o.extend(f);
        }
        let diverged = lengths.iter().copied().min().unwrap_or(0) < num_local;
        if self.explain.is_some() {
            self.explain_lookup(request, max_len, num_local, Some(&lengths));
        }
        Ok((num_local, 0, diverged))
    }

    // ---- allocation ------------------------------------------------------------------

    /// vLLM's `allocate_slots` (see module docs). The new blocks are appended to
    /// `out`, group after group; `ends[g]` is pushed as the end of group `g`.
    /// `Ok(false)`: the allocation does not fit (vLLM returns `None`).
    pub fn allocate_slots<R: RequestLike>(
        &mut self,
        request: &R,
        args: &AllocateSlots<'_>,
        out: &mut Vec<BlockId>,
        ends: &mut SmallVec<[usize; 4]>,
    ) -> Result<bool> {
        let r = self.allocate_slots_inner(request, args, out, ends);
        if self.explain.is_some() && matches!(r, Ok(true)) {
            self.explain_cached(request);
        }
        self.after("allocate_slots", r)
    }

    /// `allocate_slots` before the after-call check: vLLM's stages, in order.
    fn allocate_slots_inner<R: RequestLike>(
        &mut self,
        request: &R,
        args: &AllocateSlots<'_>,
        out: &mut Vec<BlockId>,
        ends: &mut SmallVec<[usize; 4]>,
    ) -> Result<bool> {
        self.guard()?;
        self.validate_allocation(request, args)?;
        if self.allocate_slots_in_place(request, args).is_some() {
            self.num_steady_steps += 1;
            let at = out.len();
            ends.extend(std::iter::repeat_n(at, self.num_kv_cache_groups()));
            return Ok(true);
        }
        let retained = args.new_computed_blocks.and_then(|given| {
            self.retained_hits(
                given,
                args.num_new_computed_tokens + args.num_external_computed_tokens,
            )
        });
        let hits = match &retained {
            Some(retained) => retained.view(),
            None => args.new_computed_blocks.unwrap_or(GroupedBlocks::EMPTY),
        };
        // Stage 0: nothing has changed yet, and an `Err` leaves everything as it was.
        let mut plan = self.plan_allocation(request, args, hits)?;
        if args.full_sequence_must_fit && !self.full_sequence_fits(request, args, &plan)? {
            return Ok(false);
        }
        let rid = request.request_id();
        // A call whose stage 1 frees nothing (an admission: the request holds no
        // blocks) is refused here, by vLLM's count, before the caching plan reads the
        // request's hashes and before its events are checked: under pool pressure
        // most admissions are refused, and retried every step.
        let settled = !self.skip_may_free(rid);
        if settled && !self.new_blocks_fit(rid, args, &plan)? {
            return Ok(false);
        }
        plan.cache = self.plan_allocation_cache(request, args, &plan)?;
        request.check_before_changes()?;
        // Stage 1: free what attention skips (even if the call then does not fit).
        self.free_skipped_blocks(rid, &plan)?;
        if !settled && !self.new_blocks_fit(rid, args, &plan)? {
            return Ok(false);
        }
        // Stage 2: adopt the hits, allocate the external tokens' blocks.
        if plan.adopt {
            self.adopt_computed_blocks(rid, args, &plan)?;
        }
        crate::fault::point("allocate_slots.adopted");
        // Stage 3: the new and lookahead tokens' blocks, then caching.
        self.allocate_new_blocks(rid, args, &plan, out, ends)?;
        crate::fault::point("allocate_slots.cached");
        if let Some(cache) = plan.cache {
            self.cache_planned(rid, request.num_computed_tokens(), cache)?;
        }
        Ok(true)
    }

    /// The arguments' own bounds (before anything is read or changed).
    fn validate_allocation<R: RequestLike>(
        &self,
        request: &R,
        args: &AllocateSlots<'_>,
    ) -> Result<()> {
        // vLLM 0.30 also refuses a step that only adopts local hits.
        let strict = self.vllm_rules().zero_new_tokens_needs_external;
        if args.num_new_tokens == 0
            && args.num_external_computed_tokens == 0
            && (strict || args.num_new_computed_tokens == 0)
        {
            return Err(Error::InvalidArgument(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
                    .into(),
            ));
        }
        self.check_tokens("num_new_tokens", args.num_new_tokens)?;
        self.check_tokens("num_new_computed_tokens", args.num_new_computed_tokens)?;
        self.check_tokens(
            "num_external_computed_tokens",
            args.num_external_computed_tokens,
        )?;
        self.check_tokens("num_lookahead_tokens", args.num_lookahead_tokens)?;
        // The encoder's length is not bounded by the decoder's max_model_len (Whisper:
        // 1500 encoder positions, 448 decoder tokens); beyond the pool it just does
        // not fit. Only absurd counts are refused.
        if args.num_encoder_tokens > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "num_encoder_tokens = {} is out of range",
                args.num_encoder_tokens
            )));
        }
        self.check_tokens("request.num_computed_tokens", request.num_computed_tokens())
    }

    /// Stage 0: checks the hits handed back, reads every request field the call
    /// may need and plans the caching; changes nothing.
    fn plan_allocation<'h, R: RequestLike>(
        &mut self,
        request: &R,
        args: &AllocateSlots<'_>,
        hits: GroupedBlocks<'h>,
    ) -> Result<AllocationPlan<'h>> {
        let rid = request.request_id();
        let adopt = args.new_computed_blocks.is_some() || args.num_external_computed_tokens > 0;
        let running = self
            .coordinator
            .request(rid)
            .is_some_and(RequestState::is_running);
        let num_local = request.num_computed_tokens() + args.num_new_computed_tokens;
        if adopt {
            self.check_hits(rid, hits, running)?;
            self.check_hits_cover(hits, num_local)?;
            if self.check_after_ops {
                self.check_hits_strictly(hits, args.num_new_computed_tokens)?;
                self.check_hits_are_the_requests(request, hits)?;
            }
        }
        let max_len = self.config.max_model_len;
        let total_uncapped = num_local + args.num_external_computed_tokens;
        let total = total_uncapped.min(max_len);
        let watermark = if args.has_scheduled_reqs
            && self.config.watermark_blocks > 0
            && request.status()? == RequestStatus::WaitingOrPreempted
        {
            self.config.watermark_blocks
        } else {
            0
        };
        let needs = self.coordinator.needs();
        let prompt = if needs.prompt_for_skip || needs.prompt_for_cache || needs.prefill_end {
            request.num_prompt_tokens()?
        } else {
            0
        };
        let prefill_end = if needs.prefill_end {
            prompt.max(request.num_tokens()?.saturating_sub(1))
        } else {
            0
        };
        let in_flight = if needs.in_flight_for_skip {
            request.num_in_flight_tokens()?
        } else {
            0
        };
        let num_tokens_main_model = total + args.num_new_tokens;
        let num_tokens_need_slot = (num_tokens_main_model + args.num_lookahead_tokens).min(max_len);
        Ok(AllocationPlan {
            hits,
            adopt,
            running,
            num_local,
            total_uncapped,
            total,
            watermark,
            prompt,
            prefill_end,
            in_flight,
            num_tokens_main_model,
            num_tokens_need_slot,
            cache: None,
        })
    }

    /// Stage 0, once the call is known to fit (or may fit after stage 1): what
    /// stage 3 caches ([`Self::plan_cache`]); changes nothing.
    fn plan_allocation_cache<R: RequestLike>(
        &mut self,
        request: &R,
        args: &AllocateSlots<'_>,
        plan: &AllocationPlan<'_>,
    ) -> Result<Option<CachePlan>> {
        if args.delay_cache_blocks || !self.enable_caching() {
            return Ok(None);
        }
        let adopting = (plan.adopt && !plan.running).then_some(plan.num_local);
        self.plan_cache(
            request,
            plan.num_tokens_main_model,
            true,
            adopting,
            plan.prompt,
        )
    }

    /// Whether stage 1 ([`Self::free_skipped_blocks`]) may free blocks of the
    /// request: some group frees what attention skips, and the request holds
    /// blocks. Where it may not, the fit check of stage 1b can run first.
    fn skip_may_free(&self, rid: &str) -> bool {
        self.coordinator.needs().in_flight_for_skip
            && self
                .coordinator
                .request(rid)
                .is_some_and(|s| s.groups.iter().any(|g| !g.blocks.is_empty()))
    }

    /// vLLM's first check with `full_sequence_must_fit`: the whole request's blocks
    /// (admission cap applied) fit beside the watermark.
    fn full_sequence_fits<R: RequestLike>(
        &mut self,
        request: &R,
        args: &AllocateSlots<'_>,
        plan: &AllocationPlan<'_>,
    ) -> Result<bool> {
        let full = request.num_tokens()?.min(self.config.max_model_len);
        let need = self
            .coordinator
            .get_num_blocks_to_allocate(&NumBlocksToAllocate {
                request_id: request.request_id(),
                num_tokens: full,
                hits: plan.hits,
                num_encoder_tokens: args.num_encoder_tokens,
                total_computed_tokens: plan.total,
                num_local_computed_tokens: plan.num_local,
                num_tokens_main_model: full,
                apply_admission_cap: true,
                prefill_end: plan.prefill_end,
            })?;
        Ok(need + plan.watermark as i64 <= self.block_pool().get_num_free_blocks() as i64)
    }

    /// Stage 1a: frees the blocks attention skips, counting only the tokens the
    /// workers have processed (in-flight steps still read below the boundary).
    fn free_skipped_blocks(&mut self, rid: &str, plan: &AllocationPlan<'_>) -> Result<()> {
        let needs = self.coordinator.needs();
        if !needs.in_flight_for_skip {
            return Ok(());
        }
        let processed = plan.total.saturating_sub(plan.in_flight);
        let prompt = needs.prompt_for_skip.then_some(plan.prompt);
        let r = self
            .coordinator
            .remove_skipped_blocks(rid, processed, prompt);
        self.applied(r)
    }

    /// Stage 1b: counts the blocks the call needs (new blocks and hits that sit in
    /// the free queue) and whether they fit beside the watermark and the reserved
    /// blocks.
    fn new_blocks_fit(
        &mut self,
        rid: &str,
        args: &AllocateSlots<'_>,
        plan: &AllocationPlan<'_>,
    ) -> Result<bool> {
        let need = self
            .coordinator
            .get_num_blocks_to_allocate(&NumBlocksToAllocate {
                request_id: rid,
                num_tokens: plan.num_tokens_need_slot,
                hits: plan.hits,
                num_encoder_tokens: args.num_encoder_tokens,
                total_computed_tokens: plan.total_uncapped,
                num_local_computed_tokens: plan.num_local,
                num_tokens_main_model: plan.num_tokens_main_model,
                apply_admission_cap: false,
                prefill_end: plan.prefill_end,
            });
        let need = self.applied(need)?;
        let free = self.block_pool().get_num_free_blocks();
        if need + plan.watermark as i64 > free as i64 - args.reserved_blocks {
            return Ok(false);
        }
        if need > free as i64 {
            // Only a negative reservation (Mamba align's over-allocated blocks, summed
            // by vLLM's Scheduler) gets here: vLLM's pool raises half-way through the
            // allocation; the same error is raised before anything changes.
            return Err(Error::NotEnoughFreeBlocks {
                requested: need as usize,
                available: free,
            });
        }
        Ok(true)
    }

    /// Stage 2: every group adopts (touches) its hits, then allocates the external
    /// tokens' blocks (vLLM's `allocate_new_computed_blocks`).
    fn adopt_computed_blocks(
        &mut self,
        rid: &str,
        args: &AllocateSlots<'_>,
        plan: &AllocationPlan<'_>,
    ) -> Result<()> {
        let hits = plan.hits;
        let skip = |g: usize| args.skip_zeroing_group_ids.contains(&(g as u32));
        let r = self.coordinator.allocate_new_computed_blocks(
            rid,
            &|g| hits.group(g),
            plan.num_local,
            args.num_external_computed_tokens,
            &skip,
        );
        self.applied(r)
    }

    /// Stage 3a: the new and lookahead tokens' blocks, appended to `out`.
    fn allocate_new_blocks(
        &mut self,
        rid: &str,
        args: &AllocateSlots<'_>,
        plan: &AllocationPlan<'_>,
        out: &mut Vec<BlockId>,
        ends: &mut SmallVec<[usize; 4]>,
    ) -> Result<()> {
        let start = ends.len();
        let r = self.coordinator.allocate_new_blocks(
            rid,
            plan.num_tokens_need_slot,
            plan.num_tokens_main_model,
            args.num_encoder_tokens,
            out,
            ends,
        );
        self.applied(r)?;
        debug_assert_eq!(ends.len() - start, self.num_kv_cache_groups());
        Ok(())
    }

    /// Stage 3b (and `cache_blocks`): caches what `plan` read; the hash buffer is
    /// kept for the next call.
    fn cache_planned(
        &mut self,
        rid: &str,
        num_computed_tokens: usize,
        plan: CachePlan,
    ) -> Result<()> {
        let r = self.coordinator.cache_blocks(
            rid,
            &plan.hashes,
            plan.num_tokens,
            plan.num_prompt_tokens,
            num_computed_tokens,
            plan.shared_prefix_boundary,
        );
        self.hash_buffer = plan.hashes.into_buffer();
        self.applied(r)
    }

    /// Decides whether caching `upper` tokens (capped at `num_tokens` when `cap`)
    /// can register anything, and if so reads the request fields and hashes it
    /// needs. `adopting`: the local computed tokens of a request that adopts its
    /// hits in this call.
    fn plan_cache<R: RequestLike>(
        &mut self,
        request: &R,
        upper: usize,
        cap: bool,
        adopting: Option<usize>,
        prompt: usize,
    ) -> Result<Option<CachePlan>> {
        let needs = self.coordinator.needs();
        let rid = request.request_id();
        let coordinator = &self.coordinator;
        // Skip reading anything when no group can gain a full block (the common
        // decode step): `num_tokens` only lowers the cap.
        if !self.may_cache(coordinator.request(rid), upper, adopting) {
            return Ok(None);
        }
        let num_tokens = if cap {
            upper.min(request.num_tokens()?)
        } else {
            upper
        };
        let hashes = request.block_hashes()?;
        let mut points = SmallVec::new();
        let (lo, hi) =
            coordinator.cache_reads(rid, num_tokens, prompt, hashes.len(), adopting, &mut points);
        let buffer = std::mem::take(&mut self.hash_buffer);
        let planned = PlannedHashes::read(hashes, lo, hi, points, buffer)?;
        let shared_prefix_boundary = if needs.shared_prefix_for_cache {
            request.shared_prefix_boundary()?
        } else {
            0
        };
        Ok(Some(CachePlan {
            num_tokens,
            hashes: planned,
            num_prompt_tokens: prompt,
            shared_prefix_boundary,
        }))
    }

    /// Whether caching `upper` tokens of the request whose state is `state` can
    /// register anything: some group gains a full block beyond those it cached
    /// (`adopting`: the local computed tokens of a request that adopts its hits),
    /// or some group caches on every call.
    #[inline]
    fn may_cache(
        &self,
        state: Option<&RequestState>,
        upper: usize,
        adopting: Option<usize>,
    ) -> bool {
        self.coordinator.needs().cache_every_call
            || self.may_cache_full_block(state, upper, adopting)
    }

    /// [`Self::may_cache`]'s full-block rule alone: some group gains a full block
    /// beyond those it cached.
    #[inline]
    fn may_cache_full_block(
        &self,
        state: Option<&RequestState>,
        upper: usize,
        adopting: Option<usize>,
    ) -> bool {
        let coordinator = &self.coordinator;
        coordinator.managers().iter().enumerate().any(|(g, m)| {
            let b = m.base();
            let cached = match adopting {
                Some(local) => local / b.block_size,
                None => state
                    .and_then(|s| s.groups.get(g))
                    .and_then(|gb| gb.num_cached_block)
                    .unwrap_or(0),
            };
            b.spec.prefix_cacheable
                && coordinator.get_num_cacheable_tokens(upper, g) / b.block_size > cached
        })
    }

    /// vLLM's `cache_blocks`: caches the request's full blocks up to
    /// `num_computed_tokens` (KV loads that landed, async-scheduling catch-up).
    pub fn cache_blocks<R: RequestLike>(
        &mut self,
        request: &R,
        num_computed_tokens: usize,
    ) -> Result<()> {
        let r = self.cache_blocks_inner(request, num_computed_tokens);
        if self.explain.is_some() && r.is_ok() {
            self.explain_cached(request);
        }
        self.after("cache_blocks", r)
    }

    /// `cache_blocks` before the after-call check.
    fn cache_blocks_inner<R: RequestLike>(
        &mut self,
        request: &R,
        num_computed_tokens: usize,
    ) -> Result<()> {
        self.guard()?;
        if !self.enable_caching() {
            return Ok(());
        }
        let rid = request.request_id();
        if self.coordinator.request(rid).is_none() {
            let hashed = request.block_hashes()?.len() * self.coordinator.hash_block_size();
            if num_computed_tokens.min(hashed) >= self.coordinator.hash_block_size() {
                return Err(Error::UnknownRequest(rid.to_owned()));
            }
            return Ok(());
        }
        let needs = self.coordinator.needs();
        let prompt = if needs.prompt_for_cache {
            request.num_prompt_tokens()?
        } else {
            0
        };
        let Some(plan) = self.plan_cache(request, num_computed_tokens, false, None, prompt)? else {
            return Ok(());
        };
        self.coordinator
            .check_cache_fits(rid, num_computed_tokens, plan.hashes.len())?;
        self.cache_planned(rid, request.num_computed_tokens(), plan)
    }

    // ---- freeing ---------------------------------------------------------------------

    /// vLLM's `free`: every group's table, tail first (no-op for an unknown request,
    /// as in vLLM: a request aborted before allocation has nothing to free).
    pub fn free(&mut self, request_id: &str) -> Result<()> {
        self.free_with(request_id, &PlainPublicationRequests::default())
    }

    /// `free`, with what the core asks about a HiSparse request's publication.
    pub fn free_with(&mut self, request_id: &str, pubs: &dyn PublicationRequests) -> Result<()> {
        self.guard()?;
        let mut scratch = std::mem::take(&mut self.free_scratch);
        let r = self.coordinator.free(request_id, &mut scratch, pubs);
        self.free_scratch = scratch;
        crate::fault::point("free");
        let r = if self.coordinator.hisparse().is_some() {
            self.applied(r)
        } else {
            r
        };
        self.after("free", r)
    }

    /// vLLM's `pop_blocks_for_free`: the request's blocks (allocation order, group
    /// after group, leading nulls trimmed) go to `out` and must later be freed,
    /// reversed, through the pool.
    pub fn pop_blocks_for_free(&mut self, request_id: &str, out: &mut Vec<BlockId>) -> Result<()> {
        self.pop_blocks_for_free_with(request_id, out, &PlainPublicationRequests::default())
            .map(|_| ())
    }

    /// `pop_blocks_for_free`; on a HiSparse layout the returned range of `out` holds
    /// the host group's blocks (host pool ids).
    pub fn pop_blocks_for_free_with(
        &mut self,
        request_id: &str,
        out: &mut Vec<BlockId>,
        pubs: &dyn PublicationRequests,
    ) -> Result<Option<std::ops::Range<usize>>> {
        self.guard()?;
        let start = out.len();
        let r = self.coordinator.pop_blocks_for_free(request_id, out, pubs);
        let r = self.applied(r);
        if let Ok(host) = &r {
            let host = host.clone().unwrap_or(0..0);
            for (i, &b) in out.iter().enumerate().skip(start) {
                if !host.contains(&i) {
                    self.add_external(&[b]);
                }
            }
        }
        self.after("pop_blocks_for_free", r)
    }

    /// vLLM's `remove_skipped_blocks` (connectors call it when a request finishes).
    pub fn remove_skipped_blocks(
        &mut self,
        request_id: &str,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> Result<()> {
        self.guard()?;
        let r = self.coordinator.remove_skipped_blocks(
            request_id,
            processed_computed_tokens,
            num_prompt_tokens,
        );
        let r = self.applied(r);
        self.after("remove_skipped_blocks", r)
    }

    /// Drops blocks from the prefix cache (connector load failures).
    pub fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<()> {
        self.guard()?;
        let r = self.coordinator.block_pool_mut().evict_blocks(block_ids);
        self.after("evict_blocks", r)
    }

    /// Resets the prefix cache of every pool; false while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> Result<bool> {
        self.guard()?;
        let r = self.coordinator.reset_prefix_cache();
        let r = self.applied(r);
        self.after("reset_prefix_cache", r)
    }

    /// The device pool's `reset_prefix_cache` alone (vLLM's
    /// `kv_cache_manager.block_pool.reset_prefix_cache()`).
    pub fn reset_device_prefix_cache(&mut self) -> Result<bool> {
        self.guard()?;
        let r = self.coordinator.reset_device_prefix_cache();
        let r = self.applied(r);
        self.after("reset_prefix_cache", r)
    }

    // ---- tables, estimates, hand-offs ------------------------------------------------

    /// The request's table in group `g` (empty if unknown).
    pub fn get_blocks(&self, request_id: &str, g: usize) -> &[BlockId] {
        self.coordinator.blocks(request_id, g)
    }

    /// vLLM's `get_block_ids_for_computed_tokens`: attention groups clipped to the
    /// blocks of `num_computed_tokens` (at the spec's block size).
    pub fn block_ids_for_computed_tokens(
        &self,
        request_id: &str,
        g: usize,
        n: usize,
    ) -> &[BlockId] {
        let blocks = self.get_blocks(request_id, g);
        let spec = &self.coordinator.manager(g).base().spec;
        if !spec.is_attention_spec || spec.is_cross_or_encoder_only {
            return blocks;
        }
        &blocks[..cdiv(n, spec.block_size).min(blocks.len())]
    }

    /// vLLM's `estimate_cached_tokens`: over the prefix-cacheable, non-cross groups,
    /// the smallest of each group's longest cached prefix among the request's
    /// blocks.
    pub fn estimate_cached_tokens(&self, request_id: &str) -> usize {
        let mut estimate: Option<usize> = None;
        for (g, m) in self.coordinator.managers().iter().enumerate() {
            let spec = &m.base().spec;
            if !spec.prefix_cacheable || spec.is_cross_or_encoder_only {
                continue;
            }
            let pool = self.coordinator.pool_of(g);
            let group = self
                .get_blocks(request_id, g)
                .iter()
                .filter_map(|&b| pool.block_hash_num_tokens(b))
                .max()
                .unwrap_or(0) as usize;
            estimate = Some(estimate.map_or(group, |e| e.min(group)));
        }
        estimate.unwrap_or(0)
    }

    /// vLLM 0.30's `get_num_common_prefix_blocks` (see
    /// [`KVCacheCoordinator::num_common_prefix_blocks`]).
    pub fn num_common_prefix_blocks(&mut self, request_id: &str, out: &mut Vec<usize>) {
        self.coordinator.num_common_prefix_blocks(request_id, out);
    }

    /// vLLM's `truncate_computed_blocks`: group `g`'s first blocks covering
    /// `num_computed_tokens` (Mamba may have fewer); pure.
    pub fn truncate_computed_blocks(
        &self,
        blocks: GroupedBlocks<'_>,
        num_computed_tokens: usize,
        out: &mut Vec<Vec<BlockId>>,
    ) -> Result<()> {
        out.clear();
        for (g, m) in self.coordinator.managers().iter().enumerate() {
            let b = m.base();
            let group = blocks.group(g);
            if !b.spec.prefix_cacheable {
                if !group.is_empty() {
                    return Err(Error::InvalidArgument(format!(
                        "group {g} is not prefix cacheable but the lookup result holds blocks"
                    )));
                }
                out.push(Vec::new());
                continue;
            }
            if num_computed_tokens % b.block_size != 0 {
                return Err(Error::InvalidArgument(format!(
                    "num_computed_tokens {num_computed_tokens} is not a multiple of group \
                     {g}'s block size {}",
                    b.block_size
                )));
            }
            let mut k = num_computed_tokens / b.block_size;
            if b.spec.is_mamba() {
                k = k.min(group.len());
            } else if k > group.len() {
                return Err(Error::InvalidArgument(format!(
                    "cannot truncate group {g}'s {} blocks to {k} blocks",
                    group.len()
                )));
            }
            out.push(group[..k].to_vec());
        }
        Ok(())
    }

    /// Drains the pool's events.
    pub fn take_events(&mut self) -> Vec<KVCacheEvent> {
        self.coordinator.block_pool_mut().take_events()
    }

    /// Drains the recorded block-metrics calls.
    pub fn take_metrics_ops(&mut self) -> Vec<MetricsOp> {
        self.coordinator.block_pool_mut().take_metrics_ops()
    }

    /// Drains block ids recorded for zeroing.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        self.coordinator.take_new_block_ids()
    }

    /// Re-records blocks from `start_token` on for zeroing.
    pub fn record_blocks_for_zeroing(
        &mut self,
        request_id: &str,
        start_token: usize,
    ) -> Result<()> {
        self.guard()?;
        self.coordinator
            .record_blocks_for_zeroing(request_id, start_token)
    }

    /// vLLM's `take_boundary_state_offloads` (Mamba "align" only).
    pub fn take_boundary_state_offloads(&mut self) -> Vec<BoundaryOffload> {
        self.coordinator.take_boundary_state_offloads()
    }

    /// vLLM's `finalize_partial_tail_offloads` for a finishing request.
    pub fn finalize_partial_tail_offloads<R: RequestLike>(
        &mut self,
        request: &R,
        out: &mut Vec<(u32, BlockId, usize)>,
    ) -> Result<()> {
        self.guard()?;
        let in_flight = request.num_in_flight_tokens()?;
        self.coordinator.finalize_partial_tail_offloads(
            request.request_id(),
            request.num_computed_tokens(),
            in_flight,
            out,
        );
        Ok(())
    }

    /// A new scheduler step starts (Mamba forgets what was cached this step).
    pub fn new_step_starts(&mut self) {
        self.coordinator.new_step_starts();
    }
}
