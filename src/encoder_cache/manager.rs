//! `EncoderCacheManager`: the bookkeeping of the multimodal encoder-output cache.
//!
//! Mirrors vLLM 0.33 `v1/core/encoder_cache_manager.py`'s `EncoderCacheManager`. An
//! entry is one multimodal item, keyed by its identifier (`mm_hash`), and is shared by
//! every request that carries the same item.
//!
//! Each of vLLM's dicts is mirrored field by field, so that every sequence of calls
//! (including vLLM tests that poke at the state) gives vLLM's answers:
//! `cached` (identifier → referencing requests), `num_embeds_by_hash`,
//! `request_cached_ids` / `request_hash_refs` (derived here from one
//! [`InputIdSet`] of `input_id → entry` per request), `freeable` (an ordered dict: an
//! intrusive LRU list through the entries) and `freed`.
//!
//! Key properties:
//! - Identifiers and request ids live in two [`RequestTable`]s (one string lookup per
//!   call; records link to each other by handle) and are released as soon as nothing
//!   refers to them, so a long-running server does not accumulate dead names.
//! - `num_freeable_slots` counts free *plus* reclaimable capacity; `can_allocate`
//!   evicts unreferenced entries oldest first until the request fits, and eviction
//!   is the only thing that returns capacity to `num_free_slots`.
//! - An entry becomes evictable only when no request references it. A request that
//!   holds the same item through several inputs keeps one reference until its last
//!   such input is freed.
//! - `free` releases a request's inputs in the order vLLM's Python `set` iterates
//!   them (see [`super::input_ids`]), so entries become `freeable`, and later evicted,
//!   in vLLM's order for every input id.
//! - `get_freed_mm_hashes` drains `freed`, leaving out identifiers that were cached
//!   again after their eviction in the same scheduling pass (the worker must keep
//!   that tensor).
//! - Plan, then apply: every state-changing call first works out what it will change
//!   (pure, may fail with a typed error) and then changes it (cannot fail), so an
//!   `Err` changes nothing.
//!
//! Layout: this file owns the state machine (one struct, one method per vLLM method,
//! each mirroring vLLM's dict updates in order); its read-only views of vLLM's dicts
//! are in `views.rs` and its tests in `manager_tests.rs`.
//!
//! Deliberate differences from vLLM, all on misuse paths only:
//! - vLLM asserts in `allocate` (after it has already created the entry); here the
//!   call fails with [`Error::EncoderCacheFull`] or [`Error::InvalidArgument`]
//!   (embedding-count mismatch) and leaves the state unchanged.
//! - An input is freed under the identifier it was cached with; freeing it under a
//!   different identifier is an [`Error::InvalidArgument`] (vLLM corrupts its
//!   per-request counts or raises `KeyError` half-way).

use super::check_embeds;
use super::input_ids::{InputIdOp, InputIdSet};

#[cfg(test)]
#[path = "manager_tests.rs"]
mod tests;
use crate::error::{Error, Result};
use crate::request_table::{RequestHandle, RequestTable};

/// End of the `freeable` list.
pub(super) const NIL: RequestHandle = RequestHandle::MAX;

/// A cached entry found by [`EncoderCacheManager::find_cached`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedEntry(RequestHandle);

/// One multimodal item (one identifier); the fields mirror vLLM's dicts.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    /// `identifier in cached`.
    pub(super) cached: bool,
    /// `cached[identifier]`: the referencing requests (a small unordered set).
    pub(super) refs: Vec<RequestHandle>,
    /// `num_embeds_by_hash[identifier]`.
    pub(super) num_embeds: Option<i64>,
    /// `freeable[identifier]`; `prev` / `next` link the LRU list while `Some`.
    pub(super) freeable: Option<i64>,
    pub(super) prev: RequestHandle,
    pub(super) next: RequestHandle,
    /// How many `(request, input)` pairs were cached under this identifier.
    pub(super) input_refs: u32,
    /// How many times the identifier is in `freed`.
    pub(super) freed: u32,
}

impl Default for Entry {
    fn default() -> Self {
        Self {
            cached: false,
            refs: Vec::new(),
            num_embeds: None,
            freeable: None,
            prev: NIL,
            next: NIL,
            input_refs: 0,
            freed: 0,
        }
    }
}

impl Entry {
    fn is_unused(&self) -> bool {
        !self.cached
            && self.num_embeds.is_none()
            && self.freeable.is_none()
            && self.input_refs == 0
            && self.freed == 0
    }
}

/// One request's state.
#[derive(Clone, Debug, Default)]
pub(super) struct RequestState {
    /// `request_cached_ids[request_id]`, each input with the entry it was cached
    /// under; `request_hash_refs[request_id]` is its per-entry count.
    pub(super) inputs: InputIdSet,
    /// In how many `cached[...]` sets the request is.
    pub(super) in_cached: u32,
}

impl RequestState {
    fn is_unused(&self) -> bool {
        self.inputs.is_empty() && self.in_cached == 0
    }
}

/// What `free_encoder_input` will change (see [`EncoderCacheManager::plan_free_input`]).
struct FreeInputPlan {
    request: Option<RequestHandle>,
    /// The input's record is dropped (it was cached under `entry`).
    drop_input: Option<RequestHandle>,
    /// The request's reference to this entry is dropped; `Some(n)`: the entry then has
    /// no reference and becomes freeable with `n` embeddings.
    drop_ref: Option<(RequestHandle, Option<i64>)>,
}

/// The encoder-cache bookkeeping (see module docs).
#[derive(Clone, Debug)]
pub struct EncoderCacheManager {
    cache_size: i64,
    num_free_slots: i64,
    num_freeable_slots: i64,
    pub(super) entries: RequestTable<Entry>,
    pub(super) requests: RequestTable<RequestState>,
    /// Oldest and newest entry of `freeable`.
    pub(super) head: RequestHandle,
    tail: RequestHandle,
    pub(super) num_freeable_entries: usize,
    pub(super) freed: Vec<RequestHandle>,
}

impl EncoderCacheManager {
    /// A cache of `cache_size` embeddings.
    pub fn new(cache_size: i64) -> Result<Self> {
        check_embeds("cache_size", cache_size)?;
        Ok(Self {
            cache_size,
            num_free_slots: cache_size,
            num_freeable_slots: cache_size,
            entries: RequestTable::default(),
            requests: RequestTable::default(),
            head: NIL,
            tail: NIL,
            num_freeable_entries: 0,
            freed: Vec::new(),
        })
    }

    /// Total capacity in embeddings.
    pub fn cache_size(&self) -> i64 {
        self.cache_size
    }

    /// Capacity not held by any entry.
    pub fn num_free_slots(&self) -> i64 {
        self.num_free_slots
    }

    /// Free capacity plus the capacity of unreferenced (evictable) entries.
    pub fn num_freeable_slots(&self) -> i64 {
        self.num_freeable_slots
    }

    /// Overwrites `cache_size` (a plain attribute in vLLM, which tests assign).
    pub fn set_cache_size(&mut self, n: i64) -> Result<()> {
        check_embeds("cache_size", n)?;
        self.cache_size = n;
        Ok(())
    }

    /// Overwrites `num_free_slots` (a plain attribute in vLLM, which tests assign).
    pub fn set_num_free_slots(&mut self, n: i64) -> Result<()> {
        check_embeds("num_free_slots", n)?;
        self.num_free_slots = n;
        Ok(())
    }

    /// Overwrites `num_freeable_slots` (a plain attribute in vLLM, which tests assign).
    pub fn set_num_freeable_slots(&mut self, n: i64) -> Result<()> {
        check_embeds("num_freeable_slots", n)?;
        self.num_freeable_slots = n;
        Ok(())
    }

    /// vLLM's `reset`: forget everything (model weights changed).
    pub fn reset(&mut self) {
        self.entries.clear();
        self.requests.clear();
        self.head = NIL;
        self.tail = NIL;
        self.num_freeable_entries = 0;
        self.freed.clear();
        self.num_free_slots = self.cache_size;
        self.num_freeable_slots = self.cache_size;
    }

    pub(super) fn name(&self, e: RequestHandle) -> &str {
        self.entries.key_of(e).unwrap_or_default()
    }

    /// vLLM's `check_and_update_cache`: whether `identifier` is cached; if so the
    /// request (through `input_id`) now references it, taking it out of `freeable`.
    pub fn check_and_update_cache(
        &mut self,
        request_id: &str,
        input_id: u32,
        identifier: &str,
    ) -> Result<bool> {
        match self.find_cached(identifier) {
            Some(entry) => self.add_cached_reference(entry, identifier, request_id, input_id),
            None => Ok(false),
        }
    }

    /// The first half of [`Self::check_and_update_cache`]: the entry of `identifier`
    /// if it is in `cached`. Lets a caller skip reading the request on a miss.
    pub fn find_cached(&self, identifier: &str) -> Option<CachedEntry> {
        let e = self.entries.handle(identifier)?;
        self.entries[e].cached.then_some(CachedEntry(e))
    }

    /// The second half of [`Self::check_and_update_cache`], for an entry returned by
    /// [`Self::find_cached`] for the same `identifier`. Should the manager have
    /// changed in between, the identifier is looked up again.
    pub fn add_cached_reference(
        &mut self,
        entry: CachedEntry,
        identifier: &str,
        request_id: &str,
        input_id: u32,
    ) -> Result<bool> {
        let e = entry.0;
        if self.entries.key_of(e) != Some(identifier) {
            return match self.find_cached(identifier) {
                Some(entry) => self.add_cached_reference(entry, identifier, request_id, input_id),
                None => Ok(false),
            };
        }
        // Plan.
        let entry = &self.entries[e];
        if !entry.cached {
            return Ok(false);
        }
        let restore = entry.refs.is_empty();
        if restore && entry.freeable.is_none() {
            return Err(Error::UnknownEncoderEntry {
                identifier: identifier.to_owned(),
                map: "freeable",
            });
        }
        // Apply.
        if restore {
            let n = self.unlink(e);
            self.num_freeable_slots -= n;
        }
        let r = self
            .requests
            .handle_or_insert_with(request_id, RequestState::default);
        self.add_ref(e, r);
        self.add_input(r, input_id, e);
        Ok(true)
    }

    /// vLLM's `get_cached_num_encoder_embeds`: `num_embeds_by_hash.get(identifier)`.
    pub fn get_cached_num_encoder_embeds(&self, identifier: &str) -> Option<i64> {
        self.entries.get(identifier).and_then(|e| e.num_embeds)
    }

    /// vLLM's `can_allocate`: whether an item of `num_embeds` embeddings fits the
    /// compute budget and, with `num_embeds_to_schedule` already promised, the
    /// cache; evicts unreferenced entries (oldest first, into `freed`) to make room.
    pub fn can_allocate(
        &mut self,
        num_embeds: i64,
        encoder_compute_budget: i64,
        num_embeds_to_schedule: i64,
    ) -> Result<bool> {
        let Some(victims) =
            self.plan_can_allocate(num_embeds, encoder_compute_budget, num_embeds_to_schedule)?
        else {
            return Ok(false);
        };
        for _ in 0..victims {
            self.evict_oldest();
        }
        Ok(true)
    }

    /// `None`: the item does not fit; `Some(k)`: it fits after evicting the `k`
    /// oldest freeable entries.
    fn plan_can_allocate(
        &self,
        num_embeds: i64,
        encoder_compute_budget: i64,
        num_embeds_to_schedule: i64,
    ) -> Result<Option<usize>> {
        check_embeds("num_embeds", num_embeds)?;
        if num_embeds > encoder_compute_budget {
            return Ok(None);
        }
        let need = i128::from(num_embeds) + i128::from(num_embeds_to_schedule);
        if need <= i128::from(self.num_free_slots) {
            return Ok(Some(0));
        }
        if need > i128::from(self.num_freeable_slots) {
            return Ok(None);
        }
        let mut free = i128::from(self.num_free_slots);
        let mut victims = 0usize;
        let mut e = self.head;
        while need > free {
            if e == NIL {
                return Err(Error::UnknownEncoderEntry {
                    identifier: "<oldest>".into(),
                    map: "freeable",
                });
            }
            let entry = &self.entries[e];
            if !entry.cached || entry.num_embeds.is_none() {
                let map = if entry.cached {
                    "num_embeds_by_hash"
                } else {
                    "cached"
                };
                return Err(Error::UnknownEncoderEntry {
                    identifier: self.name(e).to_owned(),
                    map,
                });
            }
            free += i128::from(entry.freeable.unwrap_or(0));
            victims += 1;
            e = entry.next;
        }
        Ok(Some(victims))
    }

    /// vLLM's `allocate`: reserve `num_embeds` slots for `identifier` and record the
    /// request's reference through `input_id`. Call after `can_allocate` said yes.
    pub fn allocate(
        &mut self,
        request_id: &str,
        input_id: u32,
        identifier: &str,
        num_embeds: i64,
    ) -> Result<()> {
        // Plan.
        check_embeds("num_embeds", num_embeds)?;
        let existing = self.entries.handle(identifier);
        if let Some(cached) = existing.and_then(|e| self.entries[e].num_embeds) {
            if cached != num_embeds {
                return Err(Error::InvalidArgument(format!(
                    "encoder cache entry {identifier:?} holds {cached} embeddings, \
                     but {num_embeds} were allocated for it"
                )));
            }
        }
        if self.num_free_slots < num_embeds || self.num_freeable_slots < num_embeds {
            return Err(Error::EncoderCacheFull {
                requested: num_embeds,
                num_free_slots: self.num_free_slots,
                num_freeable_slots: self.num_freeable_slots,
            });
        }
        // Apply.
        let e = match existing {
            Some(e) => e,
            None => self
                .entries
                .handle_or_insert_with(identifier, Entry::default),
        };
        let entry = &mut self.entries[e];
        entry.cached = true;
        entry.num_embeds.get_or_insert(num_embeds);
        let r = self
            .requests
            .handle_or_insert_with(request_id, RequestState::default);
        self.add_ref(e, r);
        self.add_input(r, input_id, e);
        self.num_free_slots -= num_embeds;
        self.num_freeable_slots -= num_embeds;
        Ok(())
    }

    /// vLLM's `free_encoder_input`: drop the request's reference through `input_id`;
    /// the entry becomes freeable (not evicted) when no request references it.
    pub fn free_encoder_input(
        &mut self,
        request_id: &str,
        input_id: u32,
        identifier: &str,
    ) -> Result<()> {
        let r = self.requests.handle(request_id);
        let e = self.entries.handle(identifier);
        let plan = self.plan_free_input(r, input_id, e, identifier)?;
        self.apply_free_input(plan, input_id);
        Ok(())
    }

    /// vLLM's `free`: free every cached input of the request, in vLLM's set order.
    ///
    /// A sequence of `free_encoder_input`s, each planned and applied on its own (the
    /// next one's plan depends on the previous one's effect, as in vLLM). Only a state
    /// that vLLM's own code would fail on (an entry missing from `num_embeds_by_hash`
    /// after `cached = {}`) can make one of them fail; vLLM then raises half-way too.
    pub fn free(&mut self, request_id: &str) -> Result<()> {
        let Some(r) = self.requests.handle(request_id) else {
            return Ok(());
        };
        let inputs: Vec<(u32, RequestHandle)> = self.requests[r].inputs.iter().collect();
        for (input_id, e) in inputs {
            // The request may have been released by the previous input's free.
            let r = self.requests.handle(request_id);
            let name = self.name(e).to_owned();
            let plan = self.plan_free_input(r, input_id, Some(e), &name)?;
            self.apply_free_input(plan, input_id);
        }
        Ok(())
    }

    fn plan_free_input(
        &self,
        r: Option<RequestHandle>,
        input_id: u32,
        e: Option<RequestHandle>,
        identifier: &str,
    ) -> Result<FreeInputPlan> {
        let cached_under = r.and_then(|r| self.requests[r].inputs.get(input_id));
        if let (Some(r), Some(under)) = (r, cached_under) {
            if Some(under) != e {
                return Err(Error::InvalidArgument(format!(
                    "input {input_id} of request {:?} was cached as {:?}, not {identifier:?}",
                    self.requests.key_of(r).unwrap_or_default(),
                    self.name(under),
                )));
            }
        }
        let mut drop_ref = None;
        if let (Some(e), Some(r)) = (e, r) {
            let entry = &self.entries[e];
            if entry.cached && !entry.refs.is_empty() {
                // vLLM: the reference stays while another input of the request holds
                // the same item.
                let still_held = self.requests[r]
                    .inputs
                    .iter()
                    .any(|(i, x)| x == e && i != input_id);
                if !still_held {
                    let empties = matches!(entry.refs.as_slice(), [only] if *only == r);
                    let size = if empties {
                        Some(entry.num_embeds.ok_or_else(|| Error::UnknownEncoderEntry {
                            identifier: identifier.to_owned(),
                            map: "num_embeds_by_hash",
                        })?)
                    } else {
                        None
                    };
                    drop_ref = Some((e, size));
                }
            }
        }
        Ok(FreeInputPlan {
            request: r,
            drop_input: cached_under,
            drop_ref,
        })
    }

    fn apply_free_input(&mut self, plan: FreeInputPlan, input_id: u32) {
        let Some(r) = plan.request else {
            return;
        };
        if plan.drop_input.is_some() {
            if let Some(under) = self.requests[r].inputs.remove(input_id) {
                self.entries[under].input_refs -= 1;
            }
        }
        if let Some((e, size)) = plan.drop_ref {
            let refs = &mut self.entries[e].refs;
            if let Some(k) = refs.iter().position(|&x| x == r) {
                refs.swap_remove(k);
                self.requests[r].in_cached -= 1;
            }
            if let Some(n) = size {
                self.push_freeable(e, n);
                self.num_freeable_slots += n;
            }
        }
        self.release_request_if_unused(r);
        if let Some(under) = plan.drop_input {
            self.release_entry_if_unused(under);
        }
    }

    /// vLLM's `get_cached_input_ids`: the request's cached input ids, in the order
    /// vLLM's set iterates them.
    pub fn get_cached_input_ids(&self, request_id: &str) -> impl Iterator<Item = u32> + '_ {
        self.requests
            .get(request_id)
            .into_iter()
            .flat_map(|r| r.inputs.iter().map(|(input_id, _)| input_id))
    }

    /// The adds and removes that made the request's `request_cached_ids` set, in
    /// order: replayed into a fresh Python `set` they give vLLM's very table.
    pub fn cached_input_ids_log(&self, request_id: &str) -> impl Iterator<Item = InputIdOp> + '_ {
        self.requests
            .get(request_id)
            .into_iter()
            .flat_map(|r| r.inputs.log())
    }

    /// vLLM's `get_freed_mm_hashes`: drain `freed`, in eviction order, without the
    /// identifiers that are cached again.
    pub fn get_freed_mm_hashes(&mut self) -> Vec<String> {
        if self.freed.is_empty() {
            return Vec::new();
        }
        let freed = std::mem::take(&mut self.freed);
        let out = freed
            .iter()
            .filter(|&&e| !self.entries[e].cached)
            .map(|&e| self.name(e).to_owned())
            .collect();
        for &e in &freed {
            self.entries[e].freed -= 1;
            self.release_entry_if_unused(e);
        }
        // Keep the allocation for the next pass.
        self.freed = freed;
        self.freed.clear();
        out
    }

    // ---- internals ---------------------------------------------------------------

    /// `cached[e].add(r)`.
    fn add_ref(&mut self, e: RequestHandle, r: RequestHandle) {
        let refs = &mut self.entries[e].refs;
        if !refs.contains(&r) {
            refs.push(r);
            self.requests[r].in_cached += 1;
        }
    }

    /// vLLM's `_add_cached_input_id`.
    fn add_input(&mut self, r: RequestHandle, input_id: u32, e: RequestHandle) {
        let inputs = &mut self.requests[r].inputs;
        if inputs.contains(input_id) {
            return;
        }
        inputs.insert(input_id, e);
        self.entries[e].input_refs += 1;
    }

    /// `freeable[e] = n`: a new key goes to the tail, an existing one keeps its place.
    fn push_freeable(&mut self, e: RequestHandle, n: i64) {
        if self.entries[e].freeable.is_some() {
            self.entries[e].freeable = Some(n);
            return;
        }
        let tail = self.tail;
        let entry = &mut self.entries[e];
        entry.freeable = Some(n);
        entry.prev = tail;
        entry.next = NIL;
        if tail == NIL {
            self.head = e;
        } else {
            self.entries[tail].next = e;
        }
        self.tail = e;
        self.num_freeable_entries += 1;
    }

    /// `freeable.pop(e)`: its value (the entry must be in `freeable`).
    fn unlink(&mut self, e: RequestHandle) -> i64 {
        let entry = &mut self.entries[e];
        let n = entry.freeable.take().unwrap_or(0);
        let (prev, next) = (entry.prev, entry.next);
        entry.prev = NIL;
        entry.next = NIL;
        if prev == NIL {
            self.head = next;
        } else {
            self.entries[prev].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.entries[next].prev = prev;
        }
        self.num_freeable_entries -= 1;
        n
    }

    /// Evict the oldest freeable entry (planned by `plan_can_allocate`).
    fn evict_oldest(&mut self) {
        let e = self.head;
        let n = self.unlink(e);
        let refs = std::mem::take(&mut self.entries[e].refs);
        let entry = &mut self.entries[e];
        entry.cached = false;
        entry.num_embeds = None;
        entry.freed += 1;
        for r in refs {
            self.requests[r].in_cached -= 1;
            self.release_request_if_unused(r);
        }
        self.freed.push(e);
        self.num_free_slots += n;
    }

    pub(super) fn release_entry_if_unused(&mut self, e: RequestHandle) {
        if self.entries[e].is_unused() {
            self.entries.remove_by_handle(e);
        }
    }

    pub(super) fn release_request_if_unused(&mut self, r: RequestHandle) {
        if self.requests[r].is_unused() {
            self.requests.remove_by_handle(r);
        }
    }
}
