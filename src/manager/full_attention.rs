//! `FullAttentionManager`: one KV-cache group's request block tables and hit search.
//!
//! Mirrors vLLM 0.33 `v1/core/single_type_kv_cache_manager.py` (the base class and
//! `FullAttentionManager`) for a full-attention group whose block size equals the
//! hash block size.
//!
//! Key properties:
//! - A request's table is append-only while it lives; `free` releases it in reverse
//!   so that the chain's tail is evicted before its prefix.
//! - `num_cached_block` is `None` until a request adopts prefix hits or caches its
//!   first block; like vLLM, presence marks a request that is already running.
//! - The hit search stops at the first miss: hashes are chained, so no later block
//!   can hit. It never changes ref counts (the caller touches hits once the
//!   allocation is known to fit).
//! - Freed tables are recycled, so steady-state admission allocates nothing.

use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::request_table::{RequestHandle, RequestTable};
use crate::types::{cdiv, BlockHashSource, BlockId, NULL_BLOCK_ID};

/// What `try_allocate_running` needs to cache the request's newly full blocks.
pub struct RunningCache<'a, H: BlockHashSource + ?Sized> {
    /// Read only once `upper` shows that a block may have become full.
    pub block_hashes: &'a dyn Fn() -> Result<&'a H>,
    /// `total_computed + num_new_tokens`, before the `num_tokens` cap.
    pub upper: usize,
    pub num_tokens: &'a dyn Fn() -> Result<usize>,
    pub num_reprefillable_tokens: usize,
}

/// One running request's `allocate_slots` (no hits adopted): what it needs besides
/// the request's table.
struct RunningStep {
    block_size: usize,
    group_id: u32,
    record_new_block_ids: bool,
    num_tokens_need_slot: usize,
    /// Free blocks the call may take (free minus reserved minus watermark).
    budget: i64,
}

/// What a running step caches: `(hashes, num_cached, num_full)`.
type CachePlan<'h, H> = Option<(&'h H, usize, usize)>;

impl RunningStep {
    /// New blocks the step takes from the free queue.
    fn num_new_blocks(&self, req: &RequestBlocks) -> usize {
        cdiv(self.num_tokens_need_slot, self.block_size).saturating_sub(req.blocks.len())
    }

    /// Validates the caching part of the step (nothing changes): the blocks it will
    /// register, once `need` new blocks are allocated.
    fn plan_cache<'h, H: BlockHashSource + ?Sized>(
        &self,
        pool: &BlockPool,
        req: &RequestBlocks,
        need: usize,
        cache: Option<RunningCache<'h, H>>,
        who: &dyn Fn() -> String,
    ) -> Result<CachePlan<'h, H>> {
        let Some(c) = cache else {
            return Ok(None);
        };
        let bs = self.block_size;
        let have = req.blocks.len();
        let num_cached = req.num_cached_block.unwrap_or(0);
        if c.upper / bs <= num_cached {
            return Ok(None);
        }
        let hashes = (c.block_hashes)()?;
        let num_hashed = hashes.len() * pool.hash_block_size();
        if c.upper.min(num_hashed) / bs <= num_cached {
            return Ok(None);
        }
        let n = c
            .upper
            .min((c.num_tokens)()?)
            .saturating_sub(c.num_reprefillable_tokens);
        let num_full = n.min(num_hashed) / bs;
        if num_full <= num_cached {
            return Ok(None);
        }
        if num_full > have + need {
            return Err(Error::InvalidArgument(format!(
                "cannot cache {num_full} blocks of request {}: only {} allocated",
                who(),
                have + need
            )));
        }
        let known = num_full.min(have);
        pool.check_cacheable(hashes, &req.blocks[..known], num_cached, known)?;
        for i in known..num_full {
            hashes.get(i)?;
        }
        Ok(Some((hashes, num_cached, num_full)))
    }

    /// Allocates and caches for `req`: `Ok(false)` if the new blocks do not fit
    /// (nothing changes). Every input is validated before anything changes.
    fn apply<H: BlockHashSource + ?Sized>(
        &self,
        pool: &mut BlockPool,
        req: &mut RequestBlocks,
        new_block_ids: &mut Vec<BlockId>,
        cache: Option<RunningCache<'_, H>>,
        out: &mut Vec<BlockId>,
        who: &dyn Fn() -> String,
    ) -> Result<bool> {
        let have = req.blocks.len();
        let need = self.num_new_blocks(req);
        if need as i64 > self.budget {
            return Ok(false);
        }
        let cache_to = self.plan_cache(pool, req, need, cache, who)?;
        if need > 0 {
            pool.get_new_blocks(need, &mut req.blocks)?;
            out.extend_from_slice(&req.blocks[have..]);
            if self.record_new_block_ids {
                new_block_ids.extend_from_slice(&req.blocks[have..]);
            }
        }
        if let Some((hashes, num_cached, num_full)) = cache_to {
            let bs = self.block_size;
            pool.cache_full_blocks(hashes, &req.blocks, num_cached, num_full, bs, self.group_id)?;
            req.num_cached_block = Some(num_full);
        }
        Ok(true)
    }
}

/// Per-request bookkeeping of one group.
#[derive(Clone, Debug, Default)]
pub struct RequestBlocks {
    /// The block table (may start with null blocks in groups that skip tokens).
    pub blocks: Vec<BlockId>,
    /// Number of leading blocks already registered in the prefix-cache index.
    pub num_cached_block: Option<usize>,
    /// The last batch this request was checked in (duplicate detection).
    batch_epoch: u64,
}

/// Tables and hit search of one full-attention group (see module docs).
#[derive(Clone, Debug)]
pub struct FullAttentionManager {
    block_size: usize,
    group_id: u32,
    /// EAGLE: drop the last matched block of a hit (its KV is recomputed).
    drop_eagle_block: bool,
    enable_caching: bool,
    record_new_block_ids: bool,
    requests: RequestTable<RequestBlocks>,
    new_block_ids: Vec<BlockId>,
    spare_tables: Vec<Vec<BlockId>>,
    /// Counter of checked batches (see `mark_for_batch`).
    batch_epoch: u64,
}

impl FullAttentionManager {
    /// A manager for group `group_id` with `block_size` tokens per block.
    pub fn new(
        block_size: usize,
        group_id: u32,
        enable_caching: bool,
        drop_eagle_block: bool,
        record_new_block_ids: bool,
    ) -> Self {
        Self {
            block_size,
            group_id,
            drop_eagle_block,
            enable_caching,
            record_new_block_ids,
            requests: RequestTable::default(),
            new_block_ids: Vec::new(),
            spare_tables: Vec::new(),
            batch_epoch: 0,
        }
    }

    /// Tokens per block.
    #[inline]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The KV-cache group id.
    #[inline]
    pub fn group_id(&self) -> u32 {
        self.group_id
    }

    /// Whether allocated block ids are recorded for worker-side zeroing.
    #[inline]
    pub fn records_new_block_ids(&self) -> bool {
        self.record_new_block_ids
    }

    /// The bookkeeping of a request, if it has any.
    #[inline]
    pub fn request(&self, request_id: &str) -> Option<&RequestBlocks> {
        self.requests.get(request_id)
    }

    /// Iterates live requests (diagnostics).
    pub fn requests(&self) -> impl Iterator<Item = (&str, &RequestBlocks)> {
        self.requests.iter()
    }

    /// The request's table (empty if unknown).
    #[inline]
    pub fn blocks(&self, request_id: &str) -> &[BlockId] {
        self.requests
            .get(request_id)
            .map_or(&[], |r| r.blocks.as_slice())
    }

    fn entry(&mut self, request_id: &str) -> &mut RequestBlocks {
        let spare = &mut self.spare_tables;
        self.requests
            .get_or_insert_with(request_id, || RequestBlocks {
                blocks: spare.pop().unwrap_or_default(),
                num_cached_block: None,
                batch_epoch: 0,
            })
    }

    /// The handle of a request that has bookkeeping (see `RequestTable`).
    #[inline]
    pub fn handle(&self, request_id: &str) -> Option<RequestHandle> {
        self.requests.handle(request_id)
    }

    /// The request id a handle names, if it is still live.
    #[inline]
    pub fn request_id_of(&self, handle: RequestHandle) -> Option<&str> {
        self.requests.key_of(handle)
    }

    /// Longest prefix hit: the cached blocks of the first hashes, up to
    /// `max_length` tokens, appended to `out`. Returns the hit length in tokens.
    pub fn find_longest_cache_hit<H: BlockHashSource + ?Sized>(
        &self,
        pool: &BlockPool,
        block_hashes: &H,
        max_length: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<usize> {
        let start = out.len();
        let max_blocks = (max_length / self.block_size).min(block_hashes.len());
        for i in 0..max_blocks {
            let hash = block_hashes.get(i)?;
            match pool.get_cached_block(&hash, self.group_id) {
                Some(id) => out.push(id),
                None => break,
            }
        }
        let mut hit_length = (out.len() - start) * self.block_size;
        if self.drop_eagle_block && hit_length > 0 {
            hit_length -= self.block_size;
        }
        out.truncate(start + cdiv(hit_length, self.block_size));
        Ok(hit_length)
    }

    /// Blocks a call must take from the free queue: new ones plus hits that sit in
    /// the free queue (touching them removes them from it).
    pub fn get_num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        request_id: &str,
        num_tokens: usize,
        new_computed_blocks: &[BlockId],
    ) -> Result<usize> {
        let required = cdiv(num_tokens, self.block_size);
        let req = self.requests.get(request_id);
        let have = req.map_or(0, |r| r.blocks.len());
        if req.is_some_and(|r| r.num_cached_block.is_some()) {
            if !new_computed_blocks.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "request {request_id:?} is already running and cannot adopt prefix hits"
                )));
            }
            return Ok(required.saturating_sub(have));
        }
        let local = new_computed_blocks.len() + have;
        let new = required.saturating_sub(local);
        let evictable = new_computed_blocks
            .iter()
            .filter(|&&b| b != NULL_BLOCK_ID && pool.ref_cnt(b) == 0)
            .count();
        Ok(new + evictable)
    }

    /// Checks that `add_local_computed_blocks` would succeed.
    pub fn check_new_computed_blocks(
        &self,
        pool: &BlockPool,
        request_id: &str,
        new_computed_blocks: &[BlockId],
    ) -> Result<()> {
        for &b in new_computed_blocks {
            pool.check_block_id(b as i64)?;
        }
        match self.requests.get(request_id) {
            Some(r) if r.num_cached_block.is_some() && !new_computed_blocks.is_empty() => {
                return Err(Error::InvalidArgument(format!(
                    "request {request_id:?} is already running and cannot adopt prefix hits"
                )));
            }
            Some(r) if r.num_cached_block.is_some() => {}
            Some(r) if !r.blocks.is_empty() => {
                return Err(Error::InvalidArgument(format!(
                    "request {request_id:?} already has blocks and cannot adopt prefix hits"
                )));
            }
            _ => {}
        }
        if !self.enable_caching && !new_computed_blocks.is_empty() {
            return Err(Error::InvalidArgument(
                "computed blocks must be empty when prefix caching is disabled".into(),
            ));
        }
        Ok(())
    }

    /// Whether the request already counts as running (no hits can be adopted).
    #[inline]
    pub fn is_running(&self, request_id: &str) -> bool {
        self.requests
            .get(request_id)
            .is_some_and(|r| r.num_cached_block.is_some())
    }

    /// Adopts prefix hits (touching them) as the start of a new request's table.
    pub fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        request_id: &str,
        new_computed_blocks: &[BlockId],
    ) -> Result<()> {
        self.check_new_computed_blocks(pool, request_id, new_computed_blocks)?;
        if self.enable_caching {
            pool.touch(new_computed_blocks)?;
        }
        let req = self.entry(request_id);
        req.blocks.extend_from_slice(new_computed_blocks);
        req.num_cached_block = Some(req.blocks.len());
        Ok(())
    }

    /// Allocates blocks for tokens computed by an external KV connector.
    pub fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        request_id: &str,
        num_local_computed_tokens: usize,
        num_external_computed_tokens: usize,
        record_for_zeroing: bool,
    ) -> Result<()> {
        if num_external_computed_tokens == 0 {
            return Ok(());
        }
        let total = num_local_computed_tokens + num_external_computed_tokens;
        let block_size = self.block_size;
        let record = self.record_new_block_ids && record_for_zeroing;
        let mut new_ids = std::mem::take(&mut self.new_block_ids);
        let req = self.entry(request_id);
        let n = cdiv(total, block_size).saturating_sub(req.blocks.len());
        let start = req.blocks.len();
        let result = pool.get_new_blocks(n, &mut req.blocks);
        if record && result.is_ok() {
            new_ids.extend_from_slice(&req.blocks[start..]);
        }
        self.new_block_ids = new_ids;
        result
    }

    /// Grows the table to hold `num_tokens` slots; the new block ids are appended
    /// to `out`.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        request_id: &str,
        num_tokens: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let block_size = self.block_size;
        let record = self.record_new_block_ids;
        let mut new_ids = std::mem::take(&mut self.new_block_ids);
        let req = self.entry(request_id);
        let required = cdiv(num_tokens, block_size);
        let result = if required > req.blocks.len() {
            let start = req.blocks.len();
            let r = pool.get_new_blocks(required - start, &mut req.blocks);
            if r.is_ok() {
                out.extend_from_slice(&req.blocks[start..]);
                if record {
                    new_ids.extend_from_slice(&req.blocks[start..]);
                }
            }
            r
        } else {
            Ok(())
        };
        self.new_block_ids = new_ids;
        result
    }

    /// The block range `cache_blocks(num_tokens)` would register.
    pub fn cache_range<H: BlockHashSource + ?Sized>(
        &self,
        pool: &BlockPool,
        request_id: &str,
        block_hashes: &H,
        num_tokens: usize,
    ) -> (usize, usize) {
        let num_cached = self
            .requests
            .get(request_id)
            .and_then(|r| r.num_cached_block)
            .unwrap_or(0);
        let num_hashed_tokens = block_hashes.len() * pool.hash_block_size();
        let num_full = num_tokens.min(num_hashed_tokens) / self.block_size;
        (num_cached, num_full)
    }

    /// `allocate_slots` for a request that already has a table and adopts no hits
    /// or external tokens (decode steps and later prefill chunks): the same
    /// decisions as the general path with one table lookup. `Ok(None)`: the request
    /// has no table yet (the caller takes the general path).
    pub fn try_allocate_running<H: BlockHashSource + ?Sized>(
        &mut self,
        pool: &mut BlockPool,
        request_id: &str,
        num_tokens_need_slot: usize,
        budget: i64,
        cache: Option<RunningCache<'_, H>>,
        out: &mut Vec<BlockId>,
    ) -> Result<Option<bool>> {
        let step = self.running_step(num_tokens_need_slot, budget);
        let Some(req) = self.requests.get_mut(request_id) else {
            return Ok(None);
        };
        step.apply(pool, req, &mut self.new_block_ids, cache, out, &|| {
            format!("{request_id:?}")
        })
        .map(Some)
    }

    fn running_step(&self, num_tokens_need_slot: usize, budget: i64) -> RunningStep {
        RunningStep {
            block_size: self.block_size,
            group_id: self.group_id,
            record_new_block_ids: self.record_new_block_ids,
            num_tokens_need_slot,
            budget,
        }
    }

    /// [`Self::try_allocate_running`] for the request `handle` names (batched
    /// calls); a stale or unknown handle is an error.
    pub fn allocate_running_by_handle<H: BlockHashSource + ?Sized>(
        &mut self,
        pool: &mut BlockPool,
        handle: RequestHandle,
        num_tokens_need_slot: usize,
        budget: i64,
        cache: Option<RunningCache<'_, H>>,
        out: &mut Vec<BlockId>,
    ) -> Result<bool> {
        let step = self.running_step(num_tokens_need_slot, budget);
        let Some(req) = self.requests.get_mut_by_handle(handle) else {
            return Err(Error::UnknownRequest(format!("handle {handle:#x}")));
        };
        step.apply(pool, req, &mut self.new_block_ids, cache, out, &|| {
            format!("with handle {handle:#x}")
        })
    }

    /// Starts checking a new batch (see [`Self::mark_for_batch`]).
    pub fn begin_batch(&mut self) {
        self.batch_epoch += 1;
    }

    /// Marks the request `handle` names as part of the batch being checked:
    /// `None` if the handle is stale or unknown, else whether this is its first
    /// entry in the batch and its number of cached blocks.
    pub fn mark_for_batch(&mut self, handle: RequestHandle) -> Option<(bool, usize)> {
        let epoch = self.batch_epoch;
        let req = self.requests.get_mut_by_handle(handle)?;
        let first = req.batch_epoch != epoch;
        req.batch_epoch = epoch;
        Some((first, req.num_cached_block.unwrap_or(0)))
    }

    /// Validates the caching part of [`Self::allocate_running_by_handle`] without
    /// changing anything (batched calls check every entry before the first runs).
    pub fn check_running_by_handle<H: BlockHashSource + ?Sized>(
        &self,
        pool: &BlockPool,
        handle: RequestHandle,
        num_tokens_need_slot: usize,
        cache: Option<RunningCache<'_, H>>,
    ) -> Result<()> {
        let step = self.running_step(num_tokens_need_slot, 0);
        let Some(req) = self.requests.get_by_handle(handle) else {
            return Err(Error::UnknownRequest(format!("handle {handle:#x}")));
        };
        let need = step.num_new_blocks(req);
        step.plan_cache(pool, req, need, cache, &|| {
            format!("with handle {handle:#x}")
        })
        .map(|_| ())
    }

    /// The state of the request `handle` names (None if stale or unknown).
    #[inline]
    pub fn request_by_handle(&self, handle: RequestHandle) -> Option<&RequestBlocks> {
        self.requests.get_by_handle(handle)
    }

    /// Registers the request's newly full blocks in the prefix-cache index.
    pub fn cache_blocks<H: BlockHashSource + ?Sized>(
        &mut self,
        pool: &mut BlockPool,
        request_id: &str,
        block_hashes: &H,
        num_tokens: usize,
    ) -> Result<()> {
        let (num_cached, num_full) = self.cache_range(pool, request_id, block_hashes, num_tokens);
        if num_cached >= num_full {
            return Ok(());
        }
        let Some(req) = self.requests.get_mut(request_id) else {
            return Err(Error::UnknownRequest(request_id.to_owned()));
        };
        pool.cache_full_blocks(
            block_hashes,
            &req.blocks,
            num_cached,
            num_full,
            self.block_size,
            self.group_id,
        )?;
        req.num_cached_block = Some(num_full);
        Ok(())
    }

    /// Removes the request's bookkeeping and appends its blocks to `out` in
    /// allocation order, leading null blocks trimmed.
    pub fn pop_blocks_for_free(&mut self, request_id: &str, out: &mut Vec<BlockId>) {
        if let Some(mut req) = self.requests.remove(request_id) {
            let skip = req
                .blocks
                .iter()
                .take_while(|&&b| b == NULL_BLOCK_ID)
                .count();
            out.extend_from_slice(&req.blocks[skip..]);
            req.blocks.clear();
            self.spare_tables.push(req.blocks);
        }
    }

    /// Frees the request's blocks, tail first.
    pub fn free(&mut self, pool: &mut BlockPool, request_id: &str) -> Result<()> {
        let Some(handle) = self.requests.handle(request_id) else {
            return Ok(());
        };
        self.free_by_handle(pool, handle)
    }

    /// Frees the blocks of the request `handle` names, tail first; a stale or
    /// unknown handle is an error.
    pub fn free_by_handle(&mut self, pool: &mut BlockPool, handle: RequestHandle) -> Result<()> {
        let Some(req) = self.requests.get_by_handle(handle) else {
            return Err(Error::UnknownRequest(format!("handle {handle:#x}")));
        };
        let skip = req
            .blocks
            .iter()
            .take_while(|&&b| b == NULL_BLOCK_ID)
            .count();
        pool.free_blocks(req.blocks[skip..].iter().rev().copied())?;
        if let Some(mut req) = self.requests.remove_by_handle(handle) {
            req.blocks.clear();
            self.spare_tables.push(req.blocks);
        }
        Ok(())
    }

    /// Drains the block ids recorded for zeroing.
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.new_block_ids)
    }

    /// Re-records the request's blocks from `start_token` on for zeroing.
    pub fn record_blocks_for_zeroing(
        &mut self,
        request_id: &str,
        start_token: usize,
    ) -> Result<()> {
        if !self.record_new_block_ids {
            return Ok(());
        }
        if start_token % self.block_size != 0 {
            return Err(Error::InvalidArgument(format!(
                "start_token {start_token} is not a multiple of the block size {}",
                self.block_size
            )));
        }
        let start = start_token / self.block_size;
        if let Some(req) = self.requests.get(request_id) {
            if start < req.blocks.len() {
                self.new_block_ids.extend_from_slice(&req.blocks[start..]);
            }
        }
        Ok(())
    }
}
