//! Invariant mutants: test-only corruptions that each break exactly one
//! structural invariant, so tests can prove `check_invariants()` catches it.
//!
//! Compiled only for tests: the crate's own (`cfg(test)`, the `testing` feature of the
//! cargo tests) and the `mutants` feature (the Python tests reach them through
//! `KVCacheCore._break_invariant` in the test-hooks extension that
//! `scripts/panic_python.sh` builds); never in the extension maturin builds. Each one
//! deliberately leaves the manager in a state no operation can produce. A mutated
//! manager must be thrown away.

use super::KVCacheManager;
use crate::hash_index::BlockHashToBlockMap;
use crate::types::{BlockHash, BlockHashWithGroupId, BlockId, NULL_BLOCK_ID};

/// One way to break one invariant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// The free queue counts a block twice (a block freed twice into it).
    DoubleFree,
    /// An owned block keeps one reference too many (a free that forgot to
    /// decrement its ref count).
    MissingDecrement,
    /// A cached block's key changes while its index entry stays put.
    StaleHashEntry,
    /// A block a request holds is put in the free queue with ref count 0.
    FreeAndOwned,
    /// A free-queue link points past its neighbour (`next`/`prev` asymmetric).
    BrokenLink,
    /// The null block gains a reference.
    NullBlockTouched,
    /// The manager believes the caller holds a reference nobody took.
    PhantomExternalRef,
}

impl Mutant {
    /// Every mutant, in a fixed order.
    pub const ALL: [Mutant; 7] = [
        Mutant::DoubleFree,
        Mutant::MissingDecrement,
        Mutant::StaleHashEntry,
        Mutant::FreeAndOwned,
        Mutant::BrokenLink,
        Mutant::NullBlockTouched,
        Mutant::PhantomExternalRef,
    ];

    /// The mutant's name (`KVCacheCore._break_invariant`'s argument).
    pub fn name(self) -> &'static str {
        match self {
            Mutant::DoubleFree => "double_free",
            Mutant::MissingDecrement => "missing_decrement",
            Mutant::StaleHashEntry => "stale_hash_entry",
            Mutant::FreeAndOwned => "free_and_owned",
            Mutant::BrokenLink => "broken_link",
            Mutant::NullBlockTouched => "null_block_touched",
            Mutant::PhantomExternalRef => "phantom_external_ref",
        }
    }

    /// The mutant called `name`.
    pub fn from_name(name: &str) -> Option<Mutant> {
        Mutant::ALL.into_iter().find(|m| m.name() == name)
    }
}

impl KVCacheManager {
    /// Test-only: applies `mutant` (see [`Mutant`]). `Err` says what the state
    /// lacks for it (an owned block, a cached block, two free blocks).
    #[doc(hidden)]
    pub fn break_invariant_for_tests(&mut self, mutant: Mutant) -> Result<(), String> {
        let owned = self.owned_block();
        let n = self.block_pool().num_gpu_blocks();
        let cached = (1..n).find(|&b| self.block_pool().block_hash(b).is_some());
        let free: Vec<BlockId> = self
            .block_pool()
            .free_block_queue()
            .iter()
            .take(3)
            .collect();
        match mutant {
            Mutant::DoubleFree => {
                if free.is_empty() {
                    return Err("no free block".into());
                }
                self.corrupt_pool_for_tests()
                    .corrupt_for_tests()
                    .free_queue()
                    .corrupt_for_tests(None, None, 1);
            }
            Mutant::MissingDecrement => {
                let b = owned.ok_or("no block held by a request")?;
                let rc = self.block_pool().ref_cnt(b);
                self.corrupt_pool_for_tests()
                    .corrupt_for_tests()
                    .set_ref_cnt(b, rc + 1);
            }
            Mutant::StaleHashEntry => {
                let b = cached.ok_or("no cached block")?;
                let key = *self.block_pool().block_hash(b).ok_or("no key")?;
                let mut bytes = key.hash.as_bytes().to_vec();
                bytes[0] ^= 0xff;
                let other = BlockHashWithGroupId {
                    hash: BlockHash::new(&bytes).map_err(|e| e.to_string())?,
                    group_id: key.group_id,
                };
                let mut pool = self.corrupt_pool_for_tests().corrupt_for_tests();
                let index: &mut BlockHashToBlockMap = pool.index();
                index.corrupt_key_for_tests(b, other);
            }
            Mutant::FreeAndOwned => {
                let b = owned.ok_or("no block held by a request")?;
                let mut pool = self.corrupt_pool_for_tests().corrupt_for_tests();
                pool.set_ref_cnt(b, 0);
                pool.free_queue().append(b).map_err(|e| e.to_string())?;
            }
            Mutant::BrokenLink => {
                if free.len() < 3 {
                    return Err("fewer than three free blocks".into());
                }
                // next(free[0]) skips free[1]; prev(free[2]) still names free[1].
                self.corrupt_pool_for_tests()
                    .corrupt_for_tests()
                    .free_queue()
                    .corrupt_for_tests(Some(free[0]), Some(free[2]), 0);
            }
            Mutant::NullBlockTouched => {
                self.corrupt_pool_for_tests()
                    .corrupt_for_tests()
                    .set_ref_cnt(NULL_BLOCK_ID, 1);
            }
            Mutant::PhantomExternalRef => {
                let b = owned.or(free.first().copied()).ok_or("no block")?;
                self.corrupt_external_refs_for_tests()[b as usize] += 1;
            }
        }
        Ok(())
    }

    /// A non-null block some request's table holds.
    fn owned_block(&self) -> Option<BlockId> {
        let c = self.coordinator();
        (0..c.num_groups()).find_map(|g| {
            c.request_tables(g)
                .find_map(|(_, gb)| gb.blocks.iter().copied().find(|&b| b != NULL_BLOCK_ID))
        })
    }
}
