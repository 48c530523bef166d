//! HiSparse: KV pages backed by a host tier, with GPU-resident copies.
//!
//! Mirrors vLLM 0.33 `v1/hisparse/coordinator.py::HiSparseCoordinator` and the
//! three managers it drives (`single_type_kv_cache_manager.py`): the *source*
//! group ([`source`]: full attention on a private host pool), *resident* groups
//! ([`resident`]: the GPU pages a request reads) and *hot* groups ([`hot`]: a fixed
//! region a request needs once it reads host-backed history). The coordinator is
//! split by concept: admission and release ([`lifecycle`]), host publication
//! ([`publication`]), write-backs ([`spills`]), residency ([`residency`]); [`hooks`]
//! are its calls from inside the KV-cache coordinator's group loops.
//!
//! GPU-resident pages are a write-back cache of the host tier. The scheduler side
//! (this module) decides everything: which pages to write back ("spills", planned
//! per step and acknowledged by the workers), when a host page becomes durable and
//! its hash is published to the prefix cache, when a clean GPU page's reference is
//! released (`BlockPool::unpin_blocks`: the page stays readable until the pool hands
//! its block out again), which GPU copies a later prefix hit can adopt, and what
//! residency the worker must learn. The worker side (vLLM's HiSparse connector
//! worker: the copies themselves, the host memory, the sparse attention kernels)
//! only executes the commands built here and reports completions back through
//! [`HiSparseCoordinator::update_spills`]; nothing of it is reproduced.
//!
//! Lifecycle of a resident page:
//!
//! ```text
//! dirty (GPU only) --spill planned--> pending --acks--> clean (valid_pages)
//!   clean --request can read the host--> unpinned (free-queue tail, still read)
//!   unpinned --pool reuses the block--> lost (read from the host; hot region needed)
//! ```
//!
//! Key properties:
//! - The coordinator is built with the manager (vLLM builds it on the connector's
//!   first `get_hisparse_coordinator` call, which must come before the first
//!   admission) and validates the layout as vLLM does then.
//! - Per-request state lives in a slab: a request's state is shared by its entry in
//!   `request_states` and by its in-flight spills, which outlive a freed request
//!   (vLLM keeps the object alive through the spill's reference).
//! - The pool's reuse notifications (vLLM's `_on_block_reused` callbacks) are
//!   drained by [`HiSparseCoordinator::process_reused`] right after each pool call
//!   that can hand blocks out, before anything reads what the callbacks change.
//! - A publication remembers the request's hashes it may publish later (a snapshot
//!   taken when it is made) and an id; the bindings map the id to the request object,
//!   from which KV events are built.
//! - Where vLLM iterates a `set` of request ids (completed host writes), the order
//!   is CPython's for the ids' `hash()` values, which the caller supplies.
//!
//! Where it differs from vLLM: the publication's hashes are copied when it is made,
//! not read from `request.block_hashes` when the durable prefix grows (the Scheduler
//! only rewrites that list for a request without computed tokens, whose publication
//! is gone by then).

pub mod hooks;
pub mod hot;
pub mod lifecycle;
pub mod publication;
pub mod residency;
pub mod resident;
pub mod set_order;
pub mod source;
pub mod spills;

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

pub use hot::HiSparseHotManager;
pub use publication::{HashSnapshot, PlainPublicationRequests, Publication, PublicationRequests};
pub use resident::HiSparseResidentManager;
pub use set_order::cpython_set_order;
pub use source::HiSparseSourceManager;
pub use spills::{PageTransfer, PendingSpill};

use super::single_type::{RequestState, SingleTypeManager};
use super::spec::{GroupSpec, ManagerKind};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::request_table::RequestTable;
use crate::types::{BlockHashWithGroupId, BlockId};

/// Sealed pages this many positions behind the table's tail stay pinned, so a page
/// an in-flight step writes is never handed out under it (vLLM's
/// `ACTIVE_TAIL_PAGES`).
pub const ACTIVE_TAIL_PAGES: usize = 2;

/// A slab index of a [`HiSparseRequestState`].
pub type StateId = u32;

/// Residency bookkeeping of one request (vLLM's `_HiSparseRequestState`).
#[derive(Clone, Debug, Default)]
pub struct HiSparseRequestState {
    /// Pages whose host copy is complete.
    pub valid_pages: BTreeSet<usize>,
    /// The durable prefix: every page below it is valid.
    pub ready_prefix_pages: usize,
    /// Page -> the spill in flight for it.
    pub pending_pages: BTreeMap<usize, u64>,
    /// Hashes waiting for their pages to become durable.
    pub publication: Option<Publication>,
    pub copies_recorded_blocks: usize,
    /// Clean pages still holding their allocation reference.
    pub pinned_clean: BTreeSet<usize>,
    /// Clean pages whose reference was released; still read until reused.
    pub unpinned_pages: BTreeSet<usize>,
    /// Prefix pages whose GPU copies are adopted after the admitting allocation.
    pub pages_to_adopt: usize,
    /// The worker holds this request's residency below this page, except
    /// `stale_pages`.
    pub synced_pages: usize,
    pub stale_pages: BTreeSet<usize>,
}

#[derive(Clone, Debug)]
struct StateSlot {
    state: HiSparseRequestState,
    /// `request_states`' entry (0 or 1) plus the spills in flight.
    refs: u32,
}

/// The layout's HiSparse groups and the constants vLLM derives from them.
#[derive(Clone, Debug)]
pub struct HiSparseLayout {
    pub host_group: usize,
    pub resident_groups: SmallVec<[usize; 4]>,
    pub hot_groups: SmallVec<[usize; 4]>,
    /// The host and resident groups' block size.
    pub block_size: usize,
    /// Spills planned per step at most (`max_model_len // block_size`).
    pub max_spill_pages: usize,
    /// Requests start reading from the host once the device pool has fewer free
    /// blocks.
    pub transition_watermark: usize,
    pub num_reprefillable_tokens: usize,
}

impl HiSparseLayout {
    /// vLLM's `HiSparseCoordinator.__init__` checks, as errors; None when the layout
    /// has no HiSparse group.
    pub fn new(
        groups: &[GroupSpec],
        num_blocks: u32,
        max_model_len: usize,
        num_reprefillable_tokens: usize,
        block_size_of: impl Fn(usize) -> usize,
    ) -> Result<Option<Self>> {
        let mut host_group = None;
        let mut resident_groups = SmallVec::new();
        let mut hot_groups = SmallVec::new();
        let mut hot_cost = 0usize;
        for (g, spec) in groups.iter().enumerate() {
            match spec.kind {
                ManagerKind::HiSparseSource { .. } => {
                    if host_group.is_some() {
                        return Err(Error::InvalidArgument(
                            "Only one HiSparse host group is supported.".into(),
                        ));
                    }
                    host_group = Some(g);
                }
                ManagerKind::HiSparseResident => resident_groups.push(g),
                ManagerKind::HiSparseHot { blocks_per_request } => {
                    hot_groups.push(g);
                    hot_cost += blocks_per_request;
                }
                _ => {}
            }
        }
        let Some(host_group) = host_group else {
            if resident_groups.is_empty() && hot_groups.is_empty() {
                return Ok(None);
            }
            return Err(Error::Unsupported(
                "HiSparse resident or hot groups without a HiSparse source group".into(),
            ));
        };
        let block_size = block_size_of(host_group);
        let mut layout = Self {
            host_group,
            resident_groups,
            hot_groups,
            block_size,
            max_spill_pages: 0,
            transition_watermark: 0,
            num_reprefillable_tokens,
        };
        if let Some(&first_resident) = layout.resident_groups.first() {
            if host_group > first_resident {
                return Err(Error::InvalidArgument(
                    "HiSparse host group must precede resident groups.".into(),
                ));
            }
            let bs = block_size_of(first_resident);
            if layout
                .resident_groups
                .iter()
                .any(|&g| block_size_of(g) != bs)
            {
                return Err(Error::InvalidArgument(
                    "HiSparse resident cache groups must use one block size.".into(),
                ));
            }
            if bs != block_size {
                return Err(Error::InvalidArgument(
                    "HiSparse host and resident block sizes must match.".into(),
                ));
            }
            layout.max_spill_pages = max_model_len / bs;
            layout.transition_watermark = hot_cost.max(num_blocks as usize / 10);
        }
        Ok(Some(layout))
    }
}

/// The coordinator's view of the rest of the KV-cache coordinator, borrowed for
/// one call: the device pool, every group's manager, every request's tables.
pub struct HiSparseCtx<'a> {
    pub pool: &'a mut BlockPool,
    pub managers: &'a mut [Box<dyn SingleTypeManager>],
    pub requests: &'a mut RequestTable<RequestState>,
}

impl HiSparseCtx<'_> {
    /// The request's table in group `g` (None if the request holds no tables).
    fn table(&self, request_id: &str, g: usize) -> Option<&[BlockId]> {
        self.requests
            .get(request_id)
            .and_then(|s| s.groups.get(g))
            .map(|gb| gb.blocks.as_slice())
    }

    fn resident(&self, g: usize) -> Result<&HiSparseResidentManager> {
        self.managers[g]
            .hisparse_resident()
            .ok_or_else(|| Error::Internal(format!("group {g} is not a HiSparse resident group")))
    }

    /// `get_resident_page` of resident group `g`.
    fn resident_page(&self, g: usize, request_id: &str, page: usize) -> Result<Option<BlockId>> {
        let table = self.table(request_id, g).unwrap_or(&[]);
        Ok(self.resident(g)?.get_resident_page(request_id, table, page))
    }

    fn hot(&self, g: usize) -> Result<&HiSparseHotManager> {
        self.managers[g]
            .hisparse_hot()
            .ok_or_else(|| Error::Internal(format!("group {g} is not a HiSparse hot group")))
    }

    fn hot_mut(&mut self, g: usize) -> Result<&mut HiSparseHotManager> {
        self.managers[g]
            .hisparse_hot_mut()
            .ok_or_else(|| Error::Internal(format!("group {g} is not a HiSparse hot group")))
    }

    fn source_mut(&mut self, g: usize) -> Result<&mut HiSparseSourceManager> {
        self.managers[g]
            .hisparse_source_mut()
            .ok_or_else(|| Error::Internal(format!("group {g} is not the HiSparse source group")))
    }

    /// Runs `f` on the host pool (the source group `g`'s), then moves the host
    /// pool's events to the device pool's queue; stored ranges cover publication
    /// `publication`'s request.
    pub fn with_host<T>(
        &mut self,
        g: usize,
        publication: Option<u64>,
        f: impl FnOnce(&mut BlockPool) -> Result<T>,
    ) -> Result<T> {
        let HiSparseCtx { pool, managers, .. } = self;
        let src = managers[g].hisparse_source_mut().ok_or_else(|| {
            Error::Internal(format!("group {g} is not the HiSparse source group"))
        })?;
        let r = f(src.host_pool_mut());
        pool.absorb_host_events(src.host_pool_mut(), publication);
        r
    }

    /// The host pool (the source group's).
    fn host_pool(&self, g: usize) -> Result<&BlockPool> {
        self.managers[g]
            .host_pool()
            .ok_or_else(|| Error::Internal(format!("group {g} has no host pool")))
    }
}

/// vLLM's `HiSparseCoordinator` (see module docs).
#[derive(Clone, Debug)]
pub struct HiSparseCoordinator {
    pub(crate) layout: HiSparseLayout,
    /// Host copies handed to the worker, by destination block, until it reports
    /// having run them: `(source, copy)`.
    pub(crate) retained_copies: BTreeMap<BlockId, (BlockId, BlockId)>,
    /// Request -> the prefix length an external load is still filling in.
    pub(crate) pending_imports: FxHashMap<Box<str>, usize>,
    /// Requests whose resident pages were all non-null when last scanned.
    pub(crate) resident_requests: FxHashSet<Box<str>>,
    pub(crate) spills_to_send: Vec<PageTransfer>,
    pub(crate) pending_spills: BTreeMap<u64, PendingSpill>,
    pub(crate) request_states: FxHashMap<Box<str>, StateId>,
    states: Vec<Option<StateSlot>>,
    free_states: Vec<StateId>,
    pub(crate) next_spill_id: u64,
    /// Published host hash -> the GPU copies of that page (one per resident group),
    /// readable until the pool reuses them.
    pub(crate) copies: FxHashMap<BlockHashWithGroupId, SmallVec<[BlockId; 4]>>,
    pub(crate) copy_by_block: FxHashMap<BlockId, BlockHashWithGroupId>,
    /// Unpinned GPU block -> the `(request, page)` pairs still reading it.
    pub(crate) owners: FxHashMap<BlockId, FxHashSet<(Box<str>, usize)>>,
    next_publication_id: u64,
    /// Publications made since the bindings last looked (their request is the
    /// recording call's), and publications dropped.
    publication_binds: Vec<u64>,
    publication_releases: Vec<u64>,
}

impl HiSparseCoordinator {
    pub fn new(layout: HiSparseLayout) -> Self {
        Self {
            layout,
            retained_copies: BTreeMap::new(),
            pending_imports: FxHashMap::default(),
            resident_requests: FxHashSet::default(),
            spills_to_send: Vec::new(),
            pending_spills: BTreeMap::new(),
            request_states: FxHashMap::default(),
            states: Vec::new(),
            free_states: Vec::new(),
            next_spill_id: 0,
            copies: FxHashMap::default(),
            copy_by_block: FxHashMap::default(),
            owners: FxHashMap::default(),
            next_publication_id: 1,
            publication_binds: Vec::new(),
            publication_releases: Vec::new(),
        }
    }

    // ---- configuration --------------------------------------------------------------

    #[inline]
    pub fn layout(&self) -> &HiSparseLayout {
        &self.layout
    }

    /// Whether the layout has resident groups (most of the coordinator is a no-op
    /// without).
    #[inline]
    pub fn has_resident(&self) -> bool {
        !self.layout.resident_groups.is_empty()
    }

    /// vLLM code sets `max_spill_pages` after construction (tests do).
    pub fn set_max_spill_pages(&mut self, n: usize) {
        self.layout.max_spill_pages = n;
    }

    /// vLLM code may set `transition_watermark` too.
    pub fn set_transition_watermark(&mut self, n: usize) {
        self.layout.transition_watermark = n;
    }

    // ---- the state slab ---------------------------------------------------------------

    /// The state of `id` (a live slab entry).
    pub fn state(&self, id: StateId) -> Option<&HiSparseRequestState> {
        self.states
            .get(id as usize)
            .and_then(Option::as_ref)
            .map(|s| &s.state)
    }

    fn state_mut(&mut self, id: StateId) -> Result<&mut HiSparseRequestState> {
        self.states
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .map(|s| &mut s.state)
            .ok_or_else(|| Error::Internal(format!("HiSparse request state {id} is gone")))
    }

    /// The request's state in `request_states`, if any.
    pub fn request_state(&self, request_id: &str) -> Option<&HiSparseRequestState> {
        self.request_states
            .get(request_id)
            .and_then(|&id| self.state(id))
    }

    /// The slab id of the request's state in `request_states`.
    pub fn request_state_id(&self, request_id: &str) -> Option<StateId> {
        self.request_states.get(request_id).copied()
    }

    /// `pending_spills`, in planning order.
    pub fn pending_spills(&self) -> impl Iterator<Item = &PendingSpill> {
        self.pending_spills.values()
    }

    /// `spills_to_send` (not drained).
    pub fn spills_to_send(&self) -> &[PageTransfer] {
        &self.spills_to_send
    }

    /// `copies`: published host hash -> GPU copies.
    pub fn copies(&self) -> impl Iterator<Item = (&BlockHashWithGroupId, &SmallVec<[BlockId; 4]>)> {
        self.copies.iter()
    }

    /// `_copy_by_block`.
    pub fn copy_by_block(&self) -> impl Iterator<Item = (BlockId, &BlockHashWithGroupId)> {
        self.copy_by_block.iter().map(|(&b, k)| (b, k))
    }

    /// `_owners`: unpinned block -> the `(request, page)` pairs reading it.
    pub fn owners(&self) -> impl Iterator<Item = (BlockId, &FxHashSet<(Box<str>, usize)>)> {
        self.owners.iter().map(|(&b, s)| (b, s))
    }

    /// `_retained_copies`: destination -> `(source, copy)`.
    pub fn retained_copies(&self) -> impl Iterator<Item = (&BlockId, &(BlockId, BlockId))> {
        self.retained_copies.iter()
    }

    /// `_pending_imports`.
    pub fn pending_imports(&self) -> impl Iterator<Item = (&str, &usize)> {
        self.pending_imports.iter().map(|(r, n)| (&**r, n))
    }

    /// `_resident_requests`.
    pub fn resident_requests(&self) -> impl Iterator<Item = &str> {
        self.resident_requests.iter().map(|r| &**r)
    }

    /// `next_spill_id`.
    pub fn next_spill_id(&self) -> u64 {
        self.next_spill_id
    }

    /// Every `(request, state)` of `request_states`.
    pub fn request_states(&self) -> impl Iterator<Item = (&str, &HiSparseRequestState)> {
        self.request_states
            .iter()
            .filter_map(|(rid, &id)| self.state(id).map(|s| (&**rid, s)))
    }

    /// vLLM's `_get_request_state`: the request's state, created empty if absent.
    pub(crate) fn get_request_state(&mut self, request_id: &str) -> StateId {
        if let Some(&id) = self.request_states.get(request_id) {
            return id;
        }
        let slot = Some(StateSlot {
            state: HiSparseRequestState::default(),
            refs: 1,
        });
        let id = match self.free_states.pop() {
            Some(id) => {
                self.states[id as usize] = slot;
                id
            }
            None => {
                self.states.push(slot);
                (self.states.len() - 1) as StateId
            }
        };
        self.request_states.insert(request_id.into(), id);
        id
    }

    fn retain_state(&mut self, id: StateId) {
        if let Some(Some(s)) = self.states.get_mut(id as usize) {
            s.refs += 1;
        }
    }

    fn release_state(&mut self, id: StateId) {
        let Some(Some(slot)) = self.states.get_mut(id as usize) else {
            return;
        };
        slot.refs -= 1;
        if slot.refs > 0 {
            return;
        }
        if let Some(p) = slot.state.publication.take() {
            self.publication_releases.push(p.id);
        }
        self.states[id as usize] = None;
        self.free_states.push(id);
    }

    /// Sets (or clears) a state's publication, telling the bindings.
    fn set_publication(&mut self, id: StateId, publication: Option<Publication>) -> Result<()> {
        if let Some(p) = &publication {
            self.publication_binds.push(p.id);
        }
        let state = self.state_mut(id)?;
        let old = std::mem::replace(&mut state.publication, publication);
        if let Some(old) = old {
            self.publication_releases.push(old.id);
        }
        Ok(())
    }

    fn new_publication_id(&mut self) -> u64 {
        let id = self.next_publication_id;
        self.next_publication_id += 1;
        id
    }

    /// Publications made since the last call (their request is that call's).
    pub fn take_publication_binds(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.publication_binds)
    }

    /// Publications dropped since the last call.
    pub fn take_publication_releases(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.publication_releases)
    }

    /// Whether the bindings have publication changes to look at.
    #[inline]
    pub fn has_publication_changes(&self) -> bool {
        !self.publication_binds.is_empty() || !self.publication_releases.is_empty()
    }
}

#[cfg(test)]
mod tests;
