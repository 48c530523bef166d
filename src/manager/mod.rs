//! `KVCacheManager`: the scheduler-facing facade over the pool and the group manager.
//!
//! Mirrors vLLM 0.33 `v1/core/kv_cache_manager.py::KVCacheManager` together with the
//! coordinator layer (`kv_cache_coordinator.py`) for one KV-cache group: with prefix
//! caching on this is vLLM's `UnitaryKVCacheCoordinator`, with it off the
//! `KVCacheCoordinatorNoPrefixCache` (same tables, no hits, freed blocks reused
//! LIFO). Hybrid models (several groups) are not implemented in the core yet; the
//! Python adapter falls back to vLLM's manager for them.
//!
//! `allocate_slots` follows vLLM's three stages on the token layout
//!
//! ```text
//! | comp | new_comp | ext_comp | new | lookahead |
//!                   |<-- to be computed ------->|
//!        |<-------- to be allocated ----------->|
//! ```
//!
//! 1. count the blocks needed (new blocks + prefix hits that sit in the free queue)
//!    and give up (`Ok(None)`) if they do not fit beside the watermark and the
//!    reserved blocks — hits are not touched then;
//! 2. adopt the hits (touch) and allocate blocks for external tokens;
//! 3. allocate blocks for the new and lookahead tokens, then cache every block
//!    fully covered by the request's hashes, capped at `num_tokens` so draft
//!    tokens are never cached.
//!
//! Every argument is validated before the first mutation, so an `Err` leaves the
//! manager exactly as it was.

pub mod batch;
pub mod full_attention;

use crate::error::{Error, Result};
use crate::events::KVCacheEvent;
use crate::pool::BlockPool;
pub use crate::request_table::{RequestHandle, RequestTable};
use crate::types::{cdiv, BlockHashSource, BlockId};
pub use batch::{BatchProgress, BatchStop, RunningBatch};
pub use full_attention::{FullAttentionManager, RunningCache};

/// Construction parameters (vLLM's `KVCacheManager` keywords, resolved for one group).
#[derive(Clone, Debug)]
pub struct KVCacheManagerConfig {
    /// Blocks in the pool, null block included (`kv_cache_config.num_blocks`).
    pub num_blocks: u32,
    /// Tokens per block (also the hash block size).
    pub block_size: usize,
    pub max_model_len: usize,
    pub enable_caching: bool,
    pub enable_kv_cache_events: bool,
    /// EAGLE last-block drop on hits.
    pub use_eagle: bool,
    /// `int(watermark * num_blocks)`.
    pub watermark_blocks: usize,
    /// `max(0, num_prefill_lookahead - 1)`: tokens never cached at the end.
    pub num_reprefillable_tokens: usize,
    /// Record allocated block ids for worker-side zeroing.
    pub needs_kv_cache_zeroing: bool,
}

/// What the manager reads from a vLLM `Request`.
pub struct RequestView<'a, H: BlockHashSource + ?Sized> {
    pub request_id: &'a str,
    pub num_computed_tokens: usize,
    /// Prompt plus output tokens (`request.num_tokens`), read only when needed: in
    /// vLLM it is a Python property, and most decode steps never need it.
    pub num_tokens: &'a dyn Fn() -> Result<usize>,
    /// `request.block_hashes`, read only when a block may be cached: most decode
    /// steps never need it.
    pub block_hashes: &'a dyn Fn() -> Result<&'a H>,
}

/// `allocate_slots`' arguments beyond the request.
#[derive(Clone, Debug, Default)]
pub struct AllocateSlots<'a> {
    pub num_new_tokens: usize,
    pub num_new_computed_tokens: usize,
    /// `None`: the manager's empty `KVCacheBlocks` singleton (no lookup result);
    /// `Some(ids)`: a lookup result, possibly empty.
    pub new_computed_blocks: Option<&'a [BlockId]>,
    pub num_lookahead_tokens: usize,
    pub num_external_computed_tokens: usize,
    pub delay_cache_blocks: bool,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: usize,
    /// The watermark applies (waiting/preempted request while others are scheduled).
    pub apply_watermark: bool,
    /// Skip zeroing of the external-token blocks (async loads write them).
    pub skip_zeroing: bool,
}

/// The core KV-cache manager (see module docs).
#[derive(Clone, Debug)]
pub struct KVCacheManager {
    config: KVCacheManagerConfig,
    pool: BlockPool,
    manager: FullAttentionManager,
}

impl KVCacheManager {
    /// A manager for one full-attention group.
    pub fn new(config: KVCacheManagerConfig) -> Result<Self> {
        // Bounds that keep every count sum below usize::MAX, token offsets below
        // 2^32 and block ids valid as int32 (the batched calls' output arrays).
        if config.block_size == 0 || config.block_size > 1 << 20 {
            return Err(Error::InvalidArgument(format!(
                "block_size must be in 1..=1048576, got {}",
                config.block_size
            )));
        }
        if config.max_model_len > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "max_model_len must be at most {}, got {}",
                u32::MAX,
                config.max_model_len
            )));
        }
        if config.num_blocks > i32::MAX as u32 {
            return Err(Error::InvalidArgument(format!(
                "num_blocks must be at most {}, got {}",
                i32::MAX,
                config.num_blocks
            )));
        }
        let pool = BlockPool::new(
            config.num_blocks,
            config.enable_caching,
            config.block_size,
            config.enable_kv_cache_events,
        )?;
        let manager = FullAttentionManager::new(
            config.block_size,
            0,
            config.enable_caching,
            config.use_eagle,
            config.needs_kv_cache_zeroing,
        );
        Ok(Self {
            config,
            pool,
            manager,
        })
    }

    /// The construction parameters.
    pub fn config(&self) -> &KVCacheManagerConfig {
        &self.config
    }

    /// The shared block pool.
    #[inline]
    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The shared block pool, mutable (deferred frees go through it).
    #[inline]
    pub fn block_pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// The single group's manager.
    #[inline]
    pub fn single_type_manager(&self) -> &FullAttentionManager {
        &self.manager
    }

    /// KV-cache usage in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        self.pool.get_usage()
    }

    /// Longest prefix hit of a request (vLLM's `get_computed_blocks` minus the
    /// skip and stats logic, which the adapter owns). Hit blocks are appended to
    /// `out`; returns the hit length in tokens. Ref counts are not changed.
    pub fn find_longest_cache_hit<H: BlockHashSource + ?Sized>(
        &self,
        block_hashes: &H,
        max_cache_hit_length: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<usize> {
        if !self.config.enable_caching {
            return Ok(0);
        }
        self.manager
            .find_longest_cache_hit(&self.pool, block_hashes, max_cache_hit_length, out)
    }

    fn check_tokens(&self, name: &str, n: usize) -> Result<()> {
        if n > self.config.max_model_len {
            return Err(Error::InvalidArgument(format!(
                "{name} = {n} exceeds max_model_len = {}",
                self.config.max_model_len
            )));
        }
        Ok(())
    }

    /// vLLM's `allocate_slots` (see module docs). New block ids are appended to
    /// `out`; `Ok(false)` means the allocation does not fit (vLLM returns `None`).
    pub fn allocate_slots<H: BlockHashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        args: &AllocateSlots<'_>,
        out: &mut Vec<BlockId>,
    ) -> Result<bool> {
        if args.num_new_tokens == 0
            && args.num_external_computed_tokens == 0
            && args.num_new_computed_tokens == 0
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
        self.check_tokens("request.num_computed_tokens", request.num_computed_tokens)?;
        let bs = self.config.block_size;
        let hits: &[BlockId] = args.new_computed_blocks.unwrap_or(&[]);
        let adopt = args.new_computed_blocks.is_some() || args.num_external_computed_tokens > 0;
        let rid = request.request_id;

        let num_local = request.num_computed_tokens + args.num_new_computed_tokens;
        let total_uncapped = num_local + args.num_external_computed_tokens;
        let total = total_uncapped.min(self.config.max_model_len);
        if !hits.is_empty() && num_local % bs != 0 {
            return Err(Error::Unsupported(
                "prefix hits that end inside a block (copy-on-write of a partial block)".into(),
            ));
        }
        if adopt {
            self.manager
                .check_new_computed_blocks(&self.pool, rid, hits)?;
        }
        let watermark = if args.apply_watermark {
            self.config.watermark_blocks
        } else {
            0
        };
        let free = self.pool.get_num_free_blocks();

        if !adopt && !args.full_sequence_must_fit {
            let need_slot = (total + args.num_new_tokens + args.num_lookahead_tokens)
                .min(self.config.max_model_len);
            let cache =
                (self.config.enable_caching && !args.delay_cache_blocks).then(|| RunningCache {
                    block_hashes: request.block_hashes,
                    upper: total + args.num_new_tokens,
                    num_tokens: request.num_tokens,
                    num_reprefillable_tokens: self.config.num_reprefillable_tokens,
                });
            let budget = free as i64 - args.reserved_blocks as i64 - watermark as i64;
            if let Some(done) = self.manager.try_allocate_running(
                &mut self.pool,
                rid,
                need_slot,
                budget,
                cache,
                out,
            )? {
                return Ok(done);
            }
        }

        if args.full_sequence_must_fit {
            let full = (request.num_tokens)()?.min(self.config.max_model_len);
            let need = self
                .manager
                .get_num_blocks_to_allocate(&self.pool, rid, full, hits)?;
            if need + watermark > free {
                return Ok(false);
            }
        }
        let num_tokens_main_model = total + args.num_new_tokens;
        let num_tokens_need_slot =
            (num_tokens_main_model + args.num_lookahead_tokens).min(self.config.max_model_len);
        let need =
            self.manager
                .get_num_blocks_to_allocate(&self.pool, rid, num_tokens_need_slot, hits)?;
        if (need + watermark) as i64 > free as i64 - args.reserved_blocks as i64 {
            return Ok(false);
        }

        // Validate the caching step before anything changes. `num_tokens` only caps
        // what would be cached; skip reading it when nothing new can be cached.
        let cache_tokens = if args.delay_cache_blocks || !self.config.enable_caching {
            None
        } else {
            let upper = total + args.num_new_tokens;
            let num_hashed = (request.block_hashes)()?.len() * self.pool.hash_block_size();
            let num_cached = self.num_cached_after_adopting(rid, hits, adopt);
            if upper.min(num_hashed) / bs <= num_cached {
                None
            } else {
                let n = upper.min((request.num_tokens)()?);
                Some(n.saturating_sub(self.config.num_reprefillable_tokens))
            }
        };
        if let Some(n) = cache_tokens {
            self.check_cache_after_allocation(request, n, hits, adopt, num_tokens_need_slot)?;
        }

        // Stage 2: adopt hits, allocate external-token blocks.
        if adopt && !self.manager.is_running(rid) {
            self.manager
                .add_local_computed_blocks(&mut self.pool, rid, hits)?;
            self.manager.allocate_external_computed_blocks(
                &mut self.pool,
                rid,
                num_local,
                args.num_external_computed_tokens,
                !args.skip_zeroing,
            )?;
        }
        // Stage 3: new and lookahead slots, then caching.
        self.manager
            .allocate_new_blocks(&mut self.pool, rid, num_tokens_need_slot, out)?;
        if let Some(n) = cache_tokens {
            self.manager
                .cache_blocks(&mut self.pool, rid, (request.block_hashes)()?, n)?;
        }
        Ok(true)
    }

    /// The request's cached blocks once stage 2 has run: the adopted hits for a new
    /// request, else what it has cached so far.
    fn num_cached_after_adopting(&self, rid: &str, hits: &[BlockId], adopt: bool) -> usize {
        if adopt && !self.manager.is_running(rid) {
            hits.len()
        } else {
            self.manager
                .request(rid)
                .and_then(|r| r.num_cached_block)
                .unwrap_or(0)
        }
    }

    /// Checks that caching `num_tokens` after this allocation will succeed.
    fn check_cache_after_allocation<H: BlockHashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
        num_tokens: usize,
        hits: &[BlockId],
        adopt: bool,
        num_tokens_need_slot: usize,
    ) -> Result<()> {
        let rid = request.request_id;
        let running = self.manager.is_running(rid);
        let num_cached = self.num_cached_after_adopting(rid, hits, adopt);
        let hashes = (request.block_hashes)()?;
        let num_hashed = hashes.len() * self.pool.hash_block_size();
        let num_full = num_tokens.min(num_hashed) / self.config.block_size;
        if num_cached >= num_full {
            return Ok(());
        }
        let have = self.manager.blocks(rid).len() + if adopt && !running { hits.len() } else { 0 };
        let table_len = have.max(cdiv(num_tokens_need_slot, self.config.block_size));
        if num_full > table_len {
            return Err(Error::InvalidArgument(format!(
                "cannot cache {num_full} blocks of request {rid:?}: only {table_len} allocated"
            )));
        }
        for i in num_cached..num_full {
            hashes.get(i)?;
        }
        Ok(())
    }

    /// Caches the request's full blocks up to `num_computed_tokens`.
    pub fn cache_blocks<H: BlockHashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        num_computed_tokens: usize,
    ) -> Result<()> {
        if !self.config.enable_caching {
            return Ok(());
        }
        let n = num_computed_tokens.saturating_sub(self.config.num_reprefillable_tokens);
        self.manager.cache_blocks(
            &mut self.pool,
            request.request_id,
            (request.block_hashes)()?,
            n,
        )
    }

    /// Frees the request's blocks, tail first (no-op for an unknown request, as in
    /// vLLM: a request aborted before allocation has nothing to free).
    pub fn free(&mut self, request_id: &str) -> Result<()> {
        self.manager.free(&mut self.pool, request_id)
    }

    /// Pops the request's bookkeeping; its blocks (allocation order) go to `out`
    /// and must later be freed, reversed, through the pool.
    pub fn pop_blocks_for_free(&mut self, request_id: &str, out: &mut Vec<BlockId>) {
        self.manager.pop_blocks_for_free(request_id, out);
    }

    /// The request's block table (empty if unknown).
    pub fn get_blocks(&self, request_id: &str) -> &[BlockId] {
        self.manager.blocks(request_id)
    }

    /// Largest prefix length covered by a cached block of the request.
    pub fn estimate_cached_tokens(&self, request_id: &str) -> usize {
        self.manager
            .blocks(request_id)
            .iter()
            .filter_map(|&b| self.pool.block_hash_num_tokens(b))
            .max()
            .unwrap_or(0) as usize
    }

    /// Drops blocks from the prefix cache (connector load failures).
    pub fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<()> {
        self.pool.evict_blocks(block_ids)
    }

    /// Resets the prefix cache; false while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Drains the pool's events.
    pub fn take_events(&mut self) -> Vec<KVCacheEvent> {
        self.pool.take_events()
    }

    /// Drains block ids recorded for zeroing.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        self.manager.take_new_block_ids()
    }

    /// Re-records blocks from `start_token` on for zeroing.
    pub fn record_blocks_for_zeroing(
        &mut self,
        request_id: &str,
        start_token: usize,
    ) -> Result<()> {
        self.manager
            .record_blocks_for_zeroing(request_id, start_token)
    }
}
