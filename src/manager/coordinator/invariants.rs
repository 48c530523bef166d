//! The coordinator's invariants on top of the pools': every block a table holds is
//! referenced at least as often as tables (and queued copy-on-write pairs) hold it,
//! exactly as often with the external references counted, and hit bookkeeping is in
//! range. Read by the checked mode and the tests; never on the hot path.

use super::KVCacheCoordinator;
use crate::types::{BlockId, NULL_BLOCK_ID};

impl KVCacheCoordinator {
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
        // One piece: one count of every table's holds, read against each pool in turn.
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
