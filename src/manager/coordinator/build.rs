//! Building a [`KVCacheCoordinator`]: vLLM's `get_kv_cache_coordinator` and the
//! three coordinators' constructors (every assertion vLLM makes is an `Err` here),
//! the retention-interval check, the hybrid layout's divisibility and
//! context-parallel checks, partial hash hits, and the [`FieldNeeds`] derived from
//! the groups.

use smallvec::SmallVec;

use super::{CoordinatorConfig, CoordinatorKind, FieldNeeds, KVCacheCoordinator, SpecGroup};
use crate::error::{Error, Result};
use crate::manager::registry::new_manager;
use crate::manager::single_type::{ManagerBase, SingleTypeManager};
use crate::manager::spec::{GroupSpec, MambaCacheMode, ManagerKind};
use crate::pool::BlockPool;
use crate::request_table::RequestTable;

fn lcm_divides(scheduler_block_size: usize, block_size: usize) -> bool {
    block_size != 0 && scheduler_block_size % block_size == 0
}

/// The EAGLE groups (the config's, or every group when the model drafts with EAGLE
/// and names none) and those whose hits drop the last block (only with EAGLE on).
fn eagle_group_ids(c: &CoordinatorConfig) -> (SmallVec<[u32; 4]>, SmallVec<[u32; 4]>) {
    let n = c.groups.len() as u32;
    let mut eagle_group_ids: SmallVec<[u32; 4]> = (0..n)
        .filter(|&i| c.groups[i as usize].is_eagle_group)
        .collect();
    if c.use_eagle && eagle_group_ids.is_empty() {
        eagle_group_ids = (0..n).collect();
    }
    let drop_eagle_group_ids = if c.use_eagle {
        eagle_group_ids.clone()
    } else {
        SmallVec::new()
    };
    (eagle_group_ids, drop_eagle_group_ids)
}

/// One manager per group, each built by the registry from its [`ManagerBase`].
fn new_managers(c: &CoordinatorConfig, caching: bool) -> Result<Vec<Box<dyn SingleTypeManager>>> {
    let mut managers = Vec::with_capacity(c.groups.len());
    for (i, spec) in c.groups.iter().enumerate() {
        let mut base = ManagerBase::new(
            spec.clone(),
            i as u32,
            caching,
            c.scheduler_block_size,
            c.hash_block_size,
            c.dcp_world_size,
            c.pcp_world_size,
            c.needs_kv_cache_zeroing,
        );
        base.num_hash_lookahead_tokens = c.num_hash_lookahead_tokens;
        base.eagle_checkpoints = c.use_eagle;
        managers.push(new_manager(base, c.enable_kv_cache_events)?);
    }
    Ok(managers)
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
        let (eagle_group_ids, drop_eagle_group_ids) = eagle_group_ids(&c);
        if caching && !eagle_group_ids.is_empty() && sbs < c.num_prefill_lookahead {
            return Err(Error::InvalidArgument(format!(
                "Multi-module MTP with prefix caching requires scheduler_block_size \
                 (={sbs}) >= num_speculative_tokens (={})",
                c.num_prefill_lookahead
            )));
        }
        let managers = new_managers(&c, caching)?;
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
            CoordinatorKind::Unitary => this.init_unitary()?,
            CoordinatorKind::Hybrid => this.init_hybrid(&c)?,
        }
        this.needs = this.field_needs();
        Ok(this)
    }

    /// vLLM's `_validate_prefix_cache_retention_interval`.
    pub(super) fn validate_retention(
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

    /// The unitary coordinator's constructor: one group, hashed at its block size.
    fn init_unitary(&mut self) -> Result<()> {
        let hbs = self.hash_block_size;
        let bs = self.managers[0].base().block_size;
        if hbs != bs {
            return Err(Error::InvalidArgument(format!(
                "one KV-cache group needs hash_block_size ({hbs}) == block_size ({bs})"
            )));
        }
        let drop = self.drop_eagle_group_ids.contains(&0);
        self.managers[0].base_mut().use_eagle = drop;
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
        let groups = self.spec_groups()?;
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

    /// The hybrid coordinator's spec groups: equal specs of the same manager kind are
    /// looked up together, full attention first.
    fn spec_groups(&self) -> Result<Vec<SpecGroup>> {
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
        Ok(groups)
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

    pub(super) fn field_needs(&self) -> FieldNeeds {
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
}
