//! `InputIdSet`: a request's cached input ids, iterated in the order CPython's `set`
//! would iterate them.
//!
//! vLLM 0.33 keeps `request_cached_ids[request_id]` as a Python `set[int]` and frees a
//! request's inputs by iterating it (`EncoderCacheManager.free`, and the Scheduler's
//! `_free_encoder_inputs` over `get_cached_input_ids`). The order decides the order in
//! which entries become `freeable`, i.e. which one is evicted first. For small ids a
//! set iterates in ascending order, but beyond its table size the order depends on the
//! insertion and deletion history (collisions, dummy slots, resizes). This module
//! replays CPython's open-addressing table for non-negative int keys (whose hash is
//! the int itself) so that iteration is exactly the interpreter's:
//!
//! - table of `2^k >= 8` slots, each empty, a *dummy* (deleted) or holding a key;
//! - probe sequence from `hash & mask`: the slot and, if 9 more fit before the end of
//!   the table, the 9 following ones; then `perturb >>= 5; i = (5 i + 1 + perturb) & mask`;
//! - insertion takes the last dummy seen before the first empty slot, else the empty
//!   slot; filling an empty slot (`fill += 1`) resizes once `5 fill >= 3 mask`, to the
//!   smallest power of two above `4 used` (`2 used` past 50 000 keys), reinserting the
//!   live keys in table order and dropping dummies;
//! - deletion leaves a dummy and never shrinks the table.
//!
//! This is CPython 3.10–3.14's `Objects/setobject.c` behaviour (checked against the
//! running interpreter by `tests/encoder_cache/test_encoder_cache.py`, which replays each request's
//! [`InputIdSet::log`] into a real `set` and compares orders).
//!
//! The set also keeps the log of its adds and removes since it was created, which the
//! Python binding replays into a real `set` for `get_cached_input_ids`: the same
//! operations on a fresh `set()` give the interpreter's own table, so the Scheduler
//! iterates it in vLLM's order. vLLM deletes a request's set when it becomes empty;
//! [`InputIdSet::remove`] does the same (back to a fresh table, empty log).

use crate::error::{Error, Result};
use crate::request_table::RequestHandle;

/// Largest accepted input id (the log uses bit 31 to mark removals).
pub const MAX_INPUT_ID: u32 = (1 << 31) - 1;

const EMPTY: u32 = u32::MAX;
const DUMMY: u32 = u32::MAX - 1;
const MIN_SIZE: usize = 8;
const LINEAR_PROBES: usize = 9;
const PERTURB_SHIFT: u32 = 5;
const REMOVED: u32 = 1 << 31;

#[derive(Clone, Copy, Debug)]
struct Slot {
    key: u32,
    /// The encoder-cache entry the input was cached under.
    entry: RequestHandle,
}

const EMPTY_SLOT: Slot = Slot {
    key: EMPTY,
    entry: 0,
};

/// One operation of [`InputIdSet::log`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputIdOp {
    Add(u32),
    Remove(u32),
}

/// A request's cached input ids with the entry each was cached under (module docs).
#[derive(Clone, Debug, Default)]
pub struct InputIdSet {
    /// Empty until the first insert (a fresh set has 8 empty slots).
    table: Vec<Slot>,
    fill: usize,
    used: usize,
    log: Vec<u32>,
}

/// CPython's probe sequence for `hash` in a table of `mask + 1` slots (endless).
pub(crate) fn probe(mask: usize, hash: u64) -> impl Iterator<Item = usize> {
    let mut i = (hash as usize) & mask;
    let mut run = if i + LINEAR_PROBES <= mask {
        LINEAR_PROBES
    } else {
        0
    };
    let mut j = 0usize;
    let mut perturb = hash;
    std::iter::from_fn(move || {
        if j > run {
            perturb >>= PERTURB_SHIFT;
            i = (i
                .wrapping_mul(5)
                .wrapping_add(1)
                .wrapping_add(perturb as usize))
                & mask;
            run = if i + LINEAR_PROBES <= mask {
                LINEAR_PROBES
            } else {
                0
            };
            j = 0;
        }
        let s = i + j;
        j += 1;
        Some(s)
    })
}

/// Checks that `input_id` fits the set (and the log's encoding).
pub fn check_input_id(input_id: i64) -> Result<u32> {
    u32::try_from(input_id)
        .ok()
        .filter(|&i| i <= MAX_INPUT_ID)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "input_id must be an index into mm_features (0..={MAX_INPUT_ID}), got {input_id}"
            ))
        })
}

impl InputIdSet {
    /// Number of ids.
    pub fn len(&self) -> usize {
        self.used
    }

    pub fn is_empty(&self) -> bool {
        self.used == 0
    }

    fn mask(&self) -> usize {
        self.table.len().wrapping_sub(1)
    }

    fn find(&self, input_id: u32) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        for s in probe(self.mask(), u64::from(input_id)) {
            match self.table[s].key {
                EMPTY => return None,
                k if k == input_id => return Some(s),
                _ => {}
            }
        }
        None
    }

    /// The entry `input_id` was cached under, if it is in the set.
    pub fn get(&self, input_id: u32) -> Option<RequestHandle> {
        self.find(input_id).map(|s| self.table[s].entry)
    }

    pub fn contains(&self, input_id: u32) -> bool {
        self.find(input_id).is_some()
    }

    /// Adds an id that is not in the set (vLLM checks membership first).
    pub fn insert(&mut self, input_id: u32, entry: RequestHandle) {
        debug_assert!(input_id <= MAX_INPUT_ID && !self.contains(input_id));
        if self.table.is_empty() {
            self.table = vec![EMPTY_SLOT; MIN_SIZE];
        }
        self.log.push(input_id);
        let mask = self.mask();
        let mut dummy = None;
        let mut empty = 0;
        for s in probe(mask, u64::from(input_id)) {
            match self.table[s].key {
                EMPTY => {
                    empty = s;
                    break;
                }
                // CPython keeps the *last* dummy seen before the empty slot.
                DUMMY => dummy = Some(s),
                _ => {}
            }
        }
        let slot = Slot {
            key: input_id,
            entry,
        };
        self.used += 1;
        if let Some(s) = dummy {
            self.table[s] = slot;
            return;
        }
        self.table[empty] = slot;
        self.fill += 1;
        if self.fill * 5 >= mask * 3 {
            let min_used = if self.used > 50_000 {
                self.used * 2
            } else {
                self.used * 4
            };
            self.resize(min_used);
        }
    }

    fn resize(&mut self, min_used: usize) {
        let mut size = MIN_SIZE;
        while size <= min_used {
            size <<= 1;
        }
        let old = std::mem::replace(&mut self.table, vec![EMPTY_SLOT; size]);
        let mask = size - 1;
        for slot in old.into_iter().filter(|s| s.key < DUMMY) {
            if let Some(s) = probe(mask, u64::from(slot.key)).find(|&s| self.table[s].key == EMPTY)
            {
                self.table[s] = slot;
            }
        }
        self.fill = self.used;
    }

    /// Removes `input_id`; returns the entry it was cached under. A set that becomes
    /// empty starts over as a fresh one (vLLM deletes it).
    pub fn remove(&mut self, input_id: u32) -> Option<RequestHandle> {
        let s = self.find(input_id)?;
        let entry = self.table[s].entry;
        self.table[s] = Slot {
            key: DUMMY,
            entry: 0,
        };
        self.used -= 1;
        if self.used == 0 {
            *self = Self::default();
        } else {
            self.log.push(input_id | REMOVED);
        }
        Some(entry)
    }

    /// `(input_id, entry)` in the interpreter's iteration order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, RequestHandle)> + '_ {
        self.table
            .iter()
            .filter(|s| s.key < DUMMY)
            .map(|s| (s.key, s.entry))
    }

    /// The adds and removes since the set was created, in order.
    pub fn log(&self) -> impl Iterator<Item = InputIdOp> + '_ {
        self.log.iter().map(|&v| {
            if v & REMOVED != 0 {
                InputIdOp::Remove(v & !REMOVED)
            } else {
                InputIdOp::Add(v)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(ops: &[(bool, u32)]) -> Vec<u32> {
        let mut s = InputIdSet::default();
        for &(add, id) in ops {
            if add {
                if !s.contains(id) {
                    s.insert(id, 0);
                }
            } else {
                s.remove(id);
            }
        }
        s.iter().map(|(k, _)| k).collect()
    }

    /// Orders printed by CPython 3.11 for the same operations (`list(s)`).
    #[test]
    fn iteration_matches_cpython() {
        let add = |ids: &[u32]| ids.iter().map(|&i| (true, i)).collect::<Vec<_>>();
        // Small ids: ascending.
        assert_eq!(order(&add(&[5, 3, 0, 1])), vec![0, 1, 3, 5]);
        // Collisions in the 8-slot table: 9 lands after 1, 17 after both.
        assert_eq!(order(&add(&[9, 1, 17])), vec![9, 1, 17]);
        // A dummy is reused: {1, 9} - {1} + {17} -> 17 takes 1's slot.
        assert_eq!(
            order(&[(true, 1), (true, 9), (false, 1), (true, 17)]),
            vec![17, 9]
        );
        // 1 collides with 33 and jumps to slot 6; growing to 32 slots reinserts in
        // old-table order, so 1 (last) probes linearly past 2, 3, 4.
        assert_eq!(order(&add(&[33, 1, 2, 3, 4])), vec![33, 2, 3, 4, 1]);
        assert_eq!(order(&add(&[1, 2, 3, 4, 5, 33])), vec![1, 2, 3, 4, 5, 33]);
        // A grown table never shrinks: 40 and 9 keep their 32-slot places.
        let mut ops = add(&[0, 1, 2, 3, 4, 40, 9]);
        ops.extend([0, 1, 2, 3, 4].map(|i| (false, i)));
        assert_eq!(order(&ops), vec![40, 9]);
    }

    #[test]
    fn emptied_set_starts_over_and_log_records_history() {
        let mut s = InputIdSet::default();
        s.insert(9, 7);
        s.insert(1, 8);
        assert_eq!(s.remove(9), Some(7));
        assert_eq!(s.get(1), Some(8));
        let log: Vec<_> = s.log().collect();
        assert_eq!(
            log,
            vec![InputIdOp::Add(9), InputIdOp::Add(1), InputIdOp::Remove(9)]
        );
        assert_eq!(s.remove(1), Some(8));
        assert!(s.is_empty() && s.log().next().is_none() && s.table.is_empty());
        assert_eq!(s.remove(1), None);
    }

    #[test]
    fn many_ids_stay_consistent() {
        let mut s = InputIdSet::default();
        let mut want = std::collections::BTreeSet::new();
        let mut x: u64 = 12345;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = (x % 300) as u32;
            if x % 3 == 0 {
                assert_eq!(s.remove(id).is_some(), want.remove(&id));
            } else if want.insert(id) {
                s.insert(id, u64::from(id) + 1);
            }
            assert_eq!(s.len(), want.len());
        }
        let mut got: Vec<_> = s.iter().collect();
        got.sort_unstable();
        let want: Vec<_> = want.iter().map(|&k| (k, u64::from(k) + 1)).collect();
        assert_eq!(got, want);
        assert!(check_input_id(-1).is_err() && check_input_id(1 << 31).is_err());
    }
}
