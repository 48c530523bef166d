//! The prefix-hit search: vLLM's `find_longest_cache_hit` (one lookup for a
//! unitary coordinator; for a hybrid one, the fixed point over the spec groups, with
//! EAGLE's drop unit), `find_longest_cache_hit_per_group` for connectors, and the
//! `BlockStored` events of adopted hits.

use smallvec::SmallVec;

use super::{CoordinatorKind, KVCacheCoordinator, SpecGroup};
use crate::error::Result;
use crate::events::KVCacheEvent;
use crate::manager::single_type::HitQuery;
use crate::types::{cdiv, BlockHashSource, BlockId};

impl KVCacheCoordinator {
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
        // One piece: the fixed point, each spec group shortening the candidate in turn,
        // reads as vLLM's loop does; split, its state would pass between functions.
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
}
