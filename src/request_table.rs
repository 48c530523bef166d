//! `RequestTable`: request id → per-request state, with stable integer handles.
//!
//! The Scheduler names requests by string id on every call, so the lookup is on the
//! hot path of `allocate_slots` for every running request every step, and between
//! steps the model runner evicts the table from the CPU caches. The layout is chosen
//! for that cold lookup:
//! - the hash index holds only `u32` slot numbers (4 bytes per request, dense), so
//!   probing it rarely misses;
//! - each slot keeps the key's hash and, for ids up to [`INLINE_KEY_LEN`] bytes (every
//!   id vLLM generates), the key bytes themselves next to the state, so a lookup costs
//!   one miss on the slot's cache lines instead of one on a bucket plus one on a
//!   separately allocated key.
//!
//! Slots are reused after `remove`; a [`RequestHandle`] carries the slot's generation,
//! so a handle of a removed request never reaches its slot's next occupant. Batched
//! calls name requests by handle and skip the string lookup altogether.
//!
//! One call of the manager looks its request up several times (count, allocate,
//! cache: one lookup per coordinator stage); the table remembers the slot it found
//! last and compares that slot's key first, so the repeats cost one compare of the
//! key's bytes and no hashing or probing.
//!
//! Users: the KV manager (request id → its blocks), the encoder cache (multimodal
//! identifier → entry, request id → cached inputs) and the worker-side slot mirror
//! (request id → block table). Callers that link records to each other (the encoder
//! cache's LRU list) store handles and index the table with them (`table[handle]`,
//! which, like `Vec` indexing, panics on a handle that names no live record: those
//! callers hold handles only while the record lives).

use hashbrown::HashTable;
use rustc_hash::FxHasher;
use std::hash::Hasher;
use std::sync::atomic::{AtomicU32, Ordering};

/// Key bytes stored inline in a slot; longer ids live in a separate allocation.
pub const INLINE_KEY_LEN: usize = 62;

/// A request's slot number (low 32 bits) and the slot's generation (high 32 bits).
pub type RequestHandle = u64;

#[derive(Clone)]
enum SlotKey {
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_LEN],
    },
    Heap(Box<str>),
}

impl SlotKey {
    fn new(key: &str) -> Self {
        if key.len() <= INLINE_KEY_LEN {
            let mut bytes = [0u8; INLINE_KEY_LEN];
            bytes[..key.len()].copy_from_slice(key.as_bytes());
            // `len <= 62` fits in a u8.
            SlotKey::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            SlotKey::Heap(key.into())
        }
    }

    #[inline]
    fn as_bytes(&self) -> &[u8] {
        match self {
            SlotKey::Inline { len, bytes } => &bytes[..*len as usize],
            SlotKey::Heap(s) => s.as_bytes(),
        }
    }

    #[inline]
    fn as_str(&self) -> &str {
        match self {
            // Built from a `&str` prefix that ends at a char boundary (the whole key).
            SlotKey::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..*len as usize]).unwrap_or_default()
            }
            SlotKey::Heap(s) => s,
        }
    }
}

// Two slots per 128-byte pair of cache lines at most: the adjacent-line prefetcher
// brings the whole slot in with its first line.
#[derive(Clone)]
#[repr(align(128))]
struct Slot<T> {
    hash: u64,
    generation: u32,
    occupied: bool,
    key: SlotKey,
    value: T,
}

/// The slot found last (`u32::MAX`: none). A hint only: always verified against the
/// slot's key, so a stale value costs one compare and is never wrong.
#[derive(Debug)]
struct LastFound(AtomicU32);

impl LastFound {
    const NONE: u32 = u32::MAX;

    #[inline]
    fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }

    #[inline]
    fn set(&self, slot: u32) {
        self.0.store(slot, Ordering::Relaxed);
    }
}

impl Clone for LastFound {
    fn clone(&self) -> Self {
        Self(AtomicU32::new(self.get()))
    }
}

/// Request id → `T`, with handles (see module docs).
#[derive(Clone)]
pub struct RequestTable<T> {
    index: HashTable<u32>,
    slots: Vec<Slot<T>>,
    free_slots: Vec<u32>,
    len: usize,
    last_found: LastFound,
}

impl<T: Default> Default for RequestTable<T> {
    fn default() -> Self {
        Self {
            index: HashTable::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            len: 0,
            last_found: LastFound(AtomicU32::new(LastFound::NONE)),
        }
    }
}

impl<T: Default + std::fmt::Debug> std::fmt::Debug for RequestTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[inline]
fn hash_key(key: &str) -> u64 {
    let mut h = FxHasher::default();
    h.write(key.as_bytes());
    h.finish()
}

/// `a == b`, inlined: request ids are short, and a call to `memcmp` costs more than
/// comparing them here.
#[inline]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

#[inline]
fn handle_of(slot: u32, generation: u32) -> RequestHandle {
    (u64::from(generation) << 32) | u64::from(slot)
}

impl<T: Default> RequestTable<T> {
    /// Number of requests.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn find(&self, key: &str) -> Option<u32> {
        let last = self.last_found.get();
        if let Some(slot) = self.slots.get(last as usize) {
            if slot.occupied && same_bytes(slot.key.as_bytes(), key.as_bytes()) {
                return Some(last);
            }
        }
        let hash = hash_key(key);
        let slots = &self.slots;
        let found = self
            .index
            .find(hash, |&s| {
                let slot = &slots[s as usize];
                slot.hash == hash && same_bytes(slot.key.as_bytes(), key.as_bytes())
            })
            .copied()?;
        self.last_found.set(found);
        Some(found)
    }

    /// The request's state.
    #[inline]
    pub fn get(&self, key: &str) -> Option<&T> {
        let s = self.find(key)?;
        Some(&self.slots[s as usize].value)
    }

    /// The request's slot number (stable while it lives) and state.
    #[inline]
    pub fn get_with_slot(&self, key: &str) -> Option<(u32, &T)> {
        let s = self.find(key)?;
        Some((s, &self.slots[s as usize].value))
    }

    /// The request's state, mutably.
    #[inline]
    pub fn get_mut(&mut self, key: &str) -> Option<&mut T> {
        let s = self.find(key)?;
        Some(&mut self.slots[s as usize].value)
    }

    /// Whether the request is in the table.
    #[inline]
    pub fn contains_key(&self, key: &str) -> bool {
        self.find(key).is_some()
    }

    /// The request's handle.
    #[inline]
    pub fn handle(&self, key: &str) -> Option<RequestHandle> {
        let s = self.find(key)?;
        Some(handle_of(s, self.slots[s as usize].generation))
    }

    #[inline]
    fn slot_of(&self, handle: RequestHandle) -> Option<usize> {
        let s = (handle & u64::from(u32::MAX)) as usize;
        let slot = self.slots.get(s)?;
        (slot.occupied && u64::from(slot.generation) == handle >> 32).then_some(s)
    }

    /// The state of the request `handle` names (None for a stale or unknown handle).
    #[inline]
    pub fn get_by_handle(&self, handle: RequestHandle) -> Option<&T> {
        let s = self.slot_of(handle)?;
        Some(&self.slots[s].value)
    }

    /// The state of the request `handle` names, mutably.
    #[inline]
    pub fn get_mut_by_handle(&mut self, handle: RequestHandle) -> Option<&mut T> {
        let s = self.slot_of(handle)?;
        Some(&mut self.slots[s].value)
    }

    /// The request id of `handle`.
    pub fn key_of(&self, handle: RequestHandle) -> Option<&str> {
        let s = self.slot_of(handle)?;
        Some(self.slots[s].key.as_str())
    }

    /// The request's handle, inserting `make()` first if the request is absent.
    pub fn handle_or_insert_with(&mut self, key: &str, make: impl FnOnce() -> T) -> RequestHandle {
        let s = match self.find(key) {
            Some(s) => s,
            None => self.insert_new(key, make()),
        };
        handle_of(s, self.slots[s as usize].generation)
    }

    /// Whether `handle` names a live request.
    #[inline]
    pub fn contains_handle(&self, handle: RequestHandle) -> bool {
        self.slot_of(handle).is_some()
    }

    /// Removes every request (slots are kept for reuse; every handle goes stale).
    pub fn clear(&mut self) {
        let live: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&s| self.slots[s as usize].occupied)
            .collect();
        for s in live {
            self.vacate(s);
        }
        self.index.clear();
    }

    /// Iterates `(handle, request id, state)` (slot order).
    pub fn iter_handles(&self) -> impl Iterator<Item = (RequestHandle, &str, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.occupied)
            .map(|(i, s)| (handle_of(i as u32, s.generation), s.key.as_str(), &s.value))
    }

    /// The request's state, inserted with `make` if absent.
    pub fn get_or_insert_with(&mut self, key: &str, make: impl FnOnce() -> T) -> &mut T {
        let s = match self.find(key) {
            Some(s) => s,
            None => self.insert_new(key, make()),
        };
        &mut self.slots[s as usize].value
    }

    /// The request's slot number (stable while it lives) and state, mutably.
    #[inline]
    pub fn get_mut_with_slot(&mut self, key: &str) -> Option<(u32, &mut T)> {
        let s = self.find(key)?;
        Some((s, &mut self.slots[s as usize].value))
    }

    /// The request's slot number and state, inserted with `make` if absent.
    pub fn get_or_insert_with_slot(
        &mut self,
        key: &str,
        make: impl FnOnce() -> T,
    ) -> (u32, &mut T) {
        let s = match self.find(key) {
            Some(s) => s,
            None => self.insert_new(key, make()),
        };
        (s, &mut self.slots[s as usize].value)
    }

    /// The id of the request in `slot`, if one lives there.
    pub fn key_of_slot(&self, slot: u32) -> Option<&str> {
        let s = self.slots.get(slot as usize)?;
        s.occupied.then(|| s.key.as_str())
    }

    /// The slot number a handle names (valid only while the handle is).
    #[inline]
    pub fn slot_of_handle(handle: RequestHandle) -> u32 {
        (handle & u64::from(u32::MAX)) as u32
    }

    fn insert_new(&mut self, key: &str, value: T) -> u32 {
        let hash = hash_key(key);
        let s = match self.free_slots.pop() {
            Some(s) => {
                let slot = &mut self.slots[s as usize];
                slot.hash = hash;
                slot.key = SlotKey::new(key);
                slot.occupied = true;
                slot.value = value;
                s
            }
            None => {
                // 2^32 slots of 128 bytes would need 512 GiB: the cast cannot wrap.
                let s = self.slots.len() as u32;
                self.slots.push(Slot {
                    hash,
                    generation: 0,
                    occupied: true,
                    key: SlotKey::new(key),
                    value,
                });
                s
            }
        };
        let slots = &self.slots;
        self.index
            .insert_unique(hash, s, |&t| slots[t as usize].hash);
        self.len += 1;
        s
    }

    /// Removes the request; returns its state.
    pub fn remove(&mut self, key: &str) -> Option<T> {
        let hash = hash_key(key);
        let slots = &self.slots;
        let entry = self
            .index
            .find_entry(hash, |&s| {
                let slot = &slots[s as usize];
                slot.hash == hash && slot.key.as_bytes() == key.as_bytes()
            })
            .ok()?;
        let (s, _) = entry.remove();
        Some(self.vacate(s))
    }

    /// Removes the request `handle` names; returns its state.
    pub fn remove_by_handle(&mut self, handle: RequestHandle) -> Option<T> {
        let s = self.slot_of(handle)? as u32;
        let hash = self.slots[s as usize].hash;
        let entry = self.index.find_entry(hash, |&t| t == s).ok()?;
        entry.remove();
        Some(self.vacate(s))
    }

    fn vacate(&mut self, s: u32) -> T {
        let slot = &mut self.slots[s as usize];
        slot.generation = slot.generation.wrapping_add(1);
        if let SlotKey::Heap(_) = slot.key {
            slot.key = SlotKey::Inline {
                len: 0,
                bytes: [0; INLINE_KEY_LEN],
            };
        }
        slot.occupied = false;
        self.free_slots.push(s);
        self.len -= 1;
        std::mem::take(&mut slot.value)
    }

    /// Iterates `(request id, state)` (diagnostics; slot order).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &T)> {
        self.slots
            .iter()
            .filter(|s| s.occupied)
            .map(|s| (s.key.as_str(), &s.value))
    }
}

impl<T> std::ops::Index<RequestHandle> for RequestTable<T> {
    type Output = T;
    /// The state of a live request's handle (panics on a handle that names nothing).
    #[inline]
    fn index(&self, handle: RequestHandle) -> &T {
        let slot = &self.slots[(handle & u64::from(u32::MAX)) as usize];
        debug_assert!(slot.occupied && u64::from(slot.generation) == handle >> 32);
        &slot.value
    }
}

impl<T> std::ops::IndexMut<RequestHandle> for RequestTable<T> {
    #[inline]
    fn index_mut(&mut self, handle: RequestHandle) -> &mut T {
        let slot = &mut self.slots[(handle & u64::from(u32::MAX)) as usize];
        debug_assert!(slot.occupied && u64::from(slot.generation) == handle >> 32);
        &mut slot.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_lookup_remove_and_handles() {
        let mut t: RequestTable<u32> = RequestTable::default();
        let long = "x".repeat(INLINE_KEY_LEN + 5);
        *t.get_or_insert_with("a", || 1) += 10;
        t.get_or_insert_with(&long, || 2);
        assert_eq!(t.len(), 2);
        assert_eq!(t.get("a"), Some(&11));
        assert_eq!(t.get(&long), Some(&2));
        assert_eq!(t.get("b"), None);
        let ha = t.handle("a").unwrap();
        assert_eq!(t.get_by_handle(ha), Some(&11));
        assert_eq!(t.key_of(ha), Some("a"));
        assert_eq!(t.remove("a"), Some(11));
        assert_eq!(t.get_by_handle(ha), None, "a stale handle names nothing");
        // The slot is reused by the next request, under a new generation.
        t.get_or_insert_with("c", || 3);
        let hc = t.handle("c").unwrap();
        assert_eq!(hc & 0xffff_ffff, ha & 0xffff_ffff);
        assert_ne!(hc, ha);
        assert_eq!(t.get_by_handle(ha), None);
        assert_eq!(t.remove_by_handle(hc), Some(3));
        assert_eq!(t.remove(&long), Some(2));
        assert!(t.is_empty());
        assert_eq!(t.iter().count(), 0);
    }

    #[test]
    fn handle_insert_index_and_clear() {
        let mut t: RequestTable<u32> = RequestTable::default();
        let a = t.handle_or_insert_with("a", || 1);
        assert_eq!(t.handle_or_insert_with("a", || 99), a);
        let b = t.handle_or_insert_with("b", || 2);
        t[b] += 40;
        assert_eq!((t[a], t[b]), (1, 42));
        let seen: Vec<_> = t
            .iter_handles()
            .map(|(h, k, v)| (h, k.to_owned(), *v))
            .collect();
        assert_eq!(seen, vec![(a, "a".to_owned(), 1), (b, "b".to_owned(), 42)]);
        t.clear();
        assert!(t.is_empty() && !t.contains_handle(a) && t.get("b").is_none());
        let c = t.handle_or_insert_with("c", || 3);
        assert!(t.contains_handle(c) && !t.contains_handle(a) && !t.contains_handle(b));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn many_keys_match_a_map() {
        use std::collections::HashMap;
        let mut t: RequestTable<usize> = RequestTable::default();
        let mut m: HashMap<String, usize> = HashMap::new();
        for i in 0..5000usize {
            let key = format!("req-{}", (i * 7919) % 1500);
            if i % 3 == 0 {
                assert_eq!(t.remove(&key), m.remove(&key));
            } else {
                *t.get_or_insert_with(&key, || 0) += i;
                *m.entry(key).or_insert(0) += i;
            }
        }
        assert_eq!(t.len(), m.len());
        for (k, v) in &m {
            assert_eq!(t.get(k), Some(v));
        }
        let mut seen: Vec<_> = t.iter().map(|(k, v)| (k.to_owned(), *v)).collect();
        seen.sort();
        let mut want: Vec<_> = m.into_iter().collect();
        want.sort();
        assert_eq!(seen, want);
    }
}
