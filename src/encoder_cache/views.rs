//! Read-only views of vLLM's dicts over the encoder cache (`cached`, `freeable`,
//! `num_embeds_by_hash`, `request_cached_ids`, `request_hash_refs`, `freed`), and the
//! one write vLLM's scheduler tests do (`cached = {}`). Cold paths: tests, debugging,
//! the Python subclass's mapping views.

use super::manager::{EncoderCacheManager, NIL};
use crate::request_table::RequestHandle;

impl EncoderCacheManager {
    /// The keys of `cached` (any order).
    pub fn cached_identifiers(&self) -> impl Iterator<Item = &str> + '_ {
        self.entries
            .iter()
            .filter(|(_, e)| e.cached)
            .map(|(name, _)| name)
    }

    /// `cached[identifier]`: the referencing request ids, or `None` if not cached.
    pub fn cached_request_ids(&self, identifier: &str) -> Option<Vec<&str>> {
        let entry = self.entries.get(identifier)?;
        entry.cached.then(|| {
            entry
                .refs
                .iter()
                .map(|&r| self.requests.key_of(r).unwrap_or_default())
                .collect()
        })
    }

    /// `freeable` items, oldest first.
    pub fn freeable(&self) -> impl Iterator<Item = (&str, i64)> + '_ {
        let mut e = self.head;
        std::iter::from_fn(move || {
            if e == NIL {
                return None;
            }
            let entry = &self.entries[e];
            let item = (self.name(e), entry.freeable.unwrap_or(0));
            e = entry.next;
            Some(item)
        })
    }

    /// `freeable.get(identifier)`.
    pub fn freeable_get(&self, identifier: &str) -> Option<i64> {
        self.entries.get(identifier).and_then(|e| e.freeable)
    }

    /// `len(freeable)`.
    pub fn num_freeable_entries(&self) -> usize {
        self.num_freeable_entries
    }

    /// `num_embeds_by_hash` items (any order).
    pub fn num_embeds_by_hash(&self) -> impl Iterator<Item = (&str, i64)> + '_ {
        self.entries
            .iter()
            .filter_map(|(name, e)| e.num_embeds.map(|n| (name, n)))
    }

    /// The keys of `request_cached_ids` (requests with cached inputs, any order).
    pub fn request_ids(&self) -> impl Iterator<Item = &str> + '_ {
        self.requests
            .iter()
            .filter(|(_, r)| !r.inputs.is_empty())
            .map(|(name, _)| name)
    }

    /// `request_hash_refs[request_id]`: identifier → number of the request's cached
    /// inputs with that identifier, or `None` if the request has no cached input.
    pub fn request_hash_refs(&self, request_id: &str) -> Option<Vec<(&str, u32)>> {
        let inputs = &self.requests.get(request_id)?.inputs;
        if inputs.is_empty() {
            return None;
        }
        let mut out: Vec<(RequestHandle, u32)> = Vec::new();
        for (_, e) in inputs.iter() {
            match out.iter_mut().find(|(x, _)| *x == e) {
                Some((_, n)) => *n += 1,
                None => out.push((e, 1)),
            }
        }
        Some(out.into_iter().map(|(e, n)| (self.name(e), n)).collect())
    }

    /// `freed`, in eviction order (not drained).
    pub fn freed(&self) -> impl Iterator<Item = &str> + '_ {
        self.freed.iter().map(|&e| self.name(e))
    }

    /// `cached = {}` (what some vLLM scheduler tests do): empty `cached` only, every
    /// other map keeps its content, exactly as rebinding the dict does in vLLM.
    pub fn clear_cached(&mut self) {
        let live: Vec<RequestHandle> = self.entries.iter_handles().map(|(h, _, _)| h).collect();
        for e in live {
            let refs = std::mem::take(&mut self.entries[e].refs);
            self.entries[e].cached = false;
            for r in refs {
                self.requests[r].in_cached -= 1;
                self.release_request_if_unused(r);
            }
            self.release_entry_if_unused(e);
        }
    }
}
