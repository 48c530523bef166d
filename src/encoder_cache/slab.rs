//! `Slab`: interned names (identifiers, request ids) with per-name data.
//!
//! No vLLM counterpart: vLLM keys its dicts by the strings themselves. Interning
//! lets the encoder cache hash a string once per call and keep everything else in
//! dense `u32`-indexed vectors.
//!
//! Key properties:
//! - A name maps to one id while interned; [`Slab::release`] frees the id (and the
//!   name) for reuse, so dead names do not accumulate in a long-running server.
//! - Ids stay below `u32::MAX`, which callers use as a list sentinel.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::error::{Error, Result};

/// Ids are `0..MAX_IDS`; `u32::MAX` is left free for sentinels.
const MAX_IDS: usize = u32::MAX as usize;

/// Interned names with per-name data; ids are reused after release.
#[derive(Clone, Debug)]
pub(super) struct Slab<T> {
    pub(super) ids: FxHashMap<Arc<str>, u32>,
    names: Vec<Option<Arc<str>>>,
    pub(super) data: Vec<T>,
    vacant: Vec<u32>,
}

impl<T: Default> Slab<T> {
    pub(super) fn new() -> Self {
        Self {
            ids: FxHashMap::default(),
            names: Vec::new(),
            data: Vec::new(),
            vacant: Vec::new(),
        }
    }

    #[inline]
    pub(super) fn get(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// Fails when `name` is new and no id is left; call before mutating anything.
    pub(super) fn ensure_room(&self, name: &str) -> Result<()> {
        if self.vacant.is_empty() && self.data.len() >= MAX_IDS && self.get(name).is_none() {
            return Err(Error::InvalidArgument(
                "encoder cache: too many distinct identifiers or requests".into(),
            ));
        }
        Ok(())
    }

    /// The id of `name`, interning it if new (after [`Self::ensure_room`]).
    pub(super) fn intern(&mut self, name: &str) -> u32 {
        match self.get(name) {
            Some(id) => id,
            None => self.insert_new(name),
        }
    }

    /// Interns a name that is not interned yet (after [`Self::ensure_room`]).
    pub(super) fn insert_new(&mut self, name: &str) -> u32 {
        let name: Arc<str> = Arc::from(name);
        let id = match self.vacant.pop() {
            Some(id) => {
                self.names[id as usize] = Some(name.clone());
                id
            }
            None => {
                self.names.push(Some(name.clone()));
                self.data.push(T::default());
                (self.data.len() - 1) as u32
            }
        };
        self.ids.insert(name, id);
        id
    }

    pub(super) fn release(&mut self, id: u32) {
        if let Some(name) = self.names[id as usize].take() {
            self.ids.remove(&name);
            self.data[id as usize] = T::default();
            self.vacant.push(id);
        }
    }

    /// Whether `id` is live and interned as `name` (a string compare, no hashing).
    pub(super) fn is_named(&self, id: u32, name: &str) -> bool {
        matches!(self.names.get(id as usize), Some(Some(n)) if **n == *name)
    }

    pub(super) fn name(&self, id: u32) -> &Arc<str> {
        // Only ids handed out by `intern` and not yet released are ever passed.
        match &self.names[id as usize] {
            Some(name) => name,
            None => unreachable!("encoder cache: released slab id {id} in use"),
        }
    }

    pub(super) fn clear(&mut self) {
        self.ids.clear();
        self.names.clear();
        self.data.clear();
        self.vacant.clear();
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&str, u32)> + '_ {
        self.ids.iter().map(|(name, &id)| (&**name, id))
    }
}

impl<T> std::ops::Index<u32> for Slab<T> {
    type Output = T;
    #[inline]
    fn index(&self, id: u32) -> &T {
        &self.data[id as usize]
    }
}

impl<T> std::ops::IndexMut<u32> for Slab<T> {
    #[inline]
    fn index_mut(&mut self, id: u32) -> &mut T {
        &mut self.data[id as usize]
    }
}
