//! Compact KV events (opt-in): the rule that coalesces consecutive events of one
//! `take_events()` batch, and the mode switch.
//!
//! vLLM emits one `BlockRemoved` per evicted key and one `BlockStored` per caching
//! call. A high-rate publisher (a router fed by many engines) pays per event: per
//! struct, per msgpack header, per dispatch in the consumer. In compact mode an
//! event that *continues* the one before it in the same batch is merged into it:
//!
//! - consecutive `BlockRemoved` of the same group and the same other fields (medium,
//!   locality, ownership) become one `BlockRemoved` with all their hashes, in order;
//! - a `BlockStored` whose parent hash is the last hash of the `BlockStored` just
//!   before it, of the same group and with every other field equal (medium, block
//!   size, LoRA, session, spec metadata, whether extra keys and lookahead ids are
//!   present), extends it: hashes, token ids, extra keys and lookahead ids are
//!   concatenated, so the merged struct is still a correct vLLM `BlockStored` (one
//!   chain, `block_size` tokens per hash, parent of its first block);
//! - nothing else merges: a removal never merges with a store, and anything that is
//!   neither (`AllBlocksCleared`, a store that leaves blocks of its range out, an
//!   event of another class) is a [`Link::Barrier`] that nothing continues. Events
//!   are never reordered, so replaying the compact stream leaves a consumer's index
//!   exactly where the exact stream leaves it, after every batch.
//!
//! The rule is generic over how a hash and the other fields are represented: the
//! bindings (`src/python/events/compact.rs`) read them from vLLM's structs, or take them
//! from the fields they are about to build a struct from, and merge lists in place.

use std::ops::Range;

use crate::error::{Error, Result};

/// Which KV-event stream a manager publishes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventsMode {
    /// vLLM's events, event for event (the default; the differential suites run it).
    #[default]
    Vllm,
    /// Consecutive events of one batch coalesced (see the module docs).
    Compact,
}

impl EventsMode {
    /// The accepted names, in the order the error message lists them.
    pub const NAMES: [&'static str; 2] = ["vllm", "compact"];

    /// The mode named `name` (case and surrounding blanks ignored; empty is the
    /// default), or `InvalidArgument` naming the accepted ones.
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "" | "vllm" => Ok(EventsMode::Vllm),
            "compact" => Ok(EventsMode::Compact),
            other => Err(Error::InvalidArgument(format!(
                "unknown KV events mode {other:?}: expected one of {}",
                Self::NAMES.join(", ")
            ))),
        }
    }

    /// The mode's name, as [`EventsMode::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            EventsMode::Vllm => "vllm",
            EventsMode::Compact => "compact",
        }
    }
}

/// One event as compact mode sees it. `H`: a block hash as the event states it;
/// `A`: every other field that a merged event states once, compared whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Link<H, A> {
    /// A `BlockStored` of `group` whose hashes chain from `parent` (`None`: the
    /// chain's first block) to `last`, with `block_size` tokens per hash (no block
    /// of its range left out).
    Stored {
        group: u32,
        attrs: A,
        parent: Option<H>,
        last: H,
    },
    /// A `BlockRemoved` of `group`.
    Removed { group: u32, attrs: A },
    /// Anything else: continues nothing, and nothing continues it.
    Barrier,
}

impl<H: PartialEq, A: PartialEq> Link<H, A> {
    /// Whether `next`, the event right after this one in the same batch, merges
    /// into it.
    pub fn continued_by(&self, next: &Self) -> bool {
        match (self, next) {
            (
                Link::Stored {
                    group, attrs, last, ..
                },
                Link::Stored {
                    group: g,
                    attrs: a,
                    parent: Some(p),
                    ..
                },
            ) => group == g && last == p && attrs == a,
            (Link::Removed { group, attrs }, Link::Removed { group: g, attrs: a }) => {
                group == g && attrs == a
            }
            _ => false,
        }
    }

    /// Merges `next` into this event when it continues it (a merged store now ends
    /// at `next`'s last hash) and says whether it did; else leaves this one as is.
    pub fn absorb(&mut self, next: Self) -> bool {
        if !self.continued_by(&next) {
            return false;
        }
        if let (Link::Stored { last, .. }, Link::Stored { last: l, .. }) = (self, next) {
            *last = l;
        }
        true
    }
}

/// The events compact mode makes of a batch: each range of consecutive events
/// becomes one event, in the batch's order.
pub fn runs<H: PartialEq, A: PartialEq>(
    links: impl IntoIterator<Item = Link<H, A>>,
) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut tail: Option<Link<H, A>> = None;
    for (i, link) in links.into_iter().enumerate() {
        match (tail.as_mut(), out.last_mut()) {
            (Some(t), Some(run)) if t.continued_by(&link) => {
                t.absorb(link);
                run.end = i + 1;
            }
            _ => {
                tail = Some(link);
                out.push(i..i + 1);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    type L = Link<u64, &'static str>;

    fn stored(group: u32, parent: Option<u64>, last: u64) -> L {
        Link::Stored {
            group,
            attrs: "GPU",
            parent,
            last,
        }
    }

    fn removed(group: u32) -> L {
        Link::Removed {
            group,
            attrs: "GPU",
        }
    }

    #[test]
    fn consecutive_removals_of_one_group_merge() {
        assert_eq!(runs([removed(0), removed(0), removed(0)]), vec![0..3]);
    }

    #[test]
    fn removals_of_another_group_or_medium_start_a_new_event() {
        let cpu = Link::Removed {
            group: 0,
            attrs: "CPU",
        };
        assert_eq!(
            runs([removed(0), removed(1), removed(1), cpu, removed(0)]),
            vec![0..1, 1..3, 3..4, 4..5]
        );
    }

    #[test]
    fn removals_are_never_merged_across_another_event() {
        // R0 S R0: the two removals are not adjacent; merging them would move the
        // second one before the store (a reorder).
        assert_eq!(
            runs([removed(0), stored(0, None, 1), removed(0)]),
            vec![0..1, 1..2, 2..3]
        );
    }

    #[test]
    fn a_store_that_continues_the_chain_merges() {
        let links = [
            stored(0, None, 2),
            stored(0, Some(2), 4),
            stored(0, Some(4), 5),
        ];
        assert_eq!(runs(links), vec![0..3]);
    }

    #[test]
    fn a_store_that_does_not_continue_the_chain_does_not_merge() {
        // Parent is an earlier hash of the previous store, not its last one; or
        // the chain's first block; or the same chain in another group.
        assert_eq!(
            runs([stored(0, None, 2), stored(0, Some(1), 3)]),
            vec![0..1, 1..2]
        );
        assert_eq!(
            runs([stored(0, None, 2), stored(0, None, 3)]),
            vec![0..1, 1..2]
        );
        assert_eq!(
            runs([stored(0, None, 2), stored(1, Some(2), 3)]),
            vec![0..1, 1..2]
        );
    }

    #[test]
    fn a_store_with_other_fields_does_not_merge() {
        let other_session = Link::Stored {
            group: 0,
            attrs: "GPU/session-b",
            parent: Some(2),
            last: 3,
        };
        assert_eq!(runs([stored(0, None, 2), other_session]), vec![0..1, 1..2]);
    }

    #[test]
    fn a_merged_store_is_continued_from_its_new_last_hash() {
        let mut head = stored(0, None, 2);
        assert!(head.absorb(stored(0, Some(2), 4)));
        assert!(!head.continued_by(&stored(0, Some(2), 6)));
        assert!(head.continued_by(&stored(0, Some(4), 6)));
        assert_eq!(head, stored(0, None, 4));
    }

    #[test]
    fn stores_and_removals_never_merge_with_each_other() {
        assert_eq!(
            runs([stored(0, None, 2), removed(0), stored(0, Some(2), 3)]),
            vec![0..1, 1..2, 2..3]
        );
        let mut r = removed(0);
        assert!(!r.absorb(stored(0, None, 1)));
        assert_eq!(r, removed(0));
    }

    #[test]
    fn a_barrier_ends_every_run() {
        // AllBlocksCleared between two removals, and between two links of one chain.
        assert_eq!(
            runs([removed(0), L::Barrier, removed(0)]),
            vec![0..1, 1..2, 2..3]
        );
        assert_eq!(
            runs([stored(0, None, 2), L::Barrier, stored(0, Some(2), 3)]),
            vec![0..1, 1..2, 2..3]
        );
        assert_eq!(runs([L::Barrier, L::Barrier]), vec![0..1, 1..2]);
    }

    #[test]
    fn runs_cover_the_batch_in_order() {
        let links = [
            removed(0),
            removed(0),
            stored(0, None, 1),
            stored(0, Some(1), 2),
            removed(1),
            L::Barrier,
            stored(1, Some(9), 3),
            removed(1),
            removed(1),
        ];
        let got = runs(links.clone());
        assert_eq!(got, vec![0..2, 2..4, 4..5, 5..6, 6..7, 7..9]);
        // Contiguous, in order, covering every event exactly once.
        let flat: Vec<usize> = got.into_iter().flatten().collect();
        assert_eq!(flat, (0..links.len()).collect::<Vec<_>>());
        assert!(runs(Vec::<L>::new()).is_empty());
    }

    #[test]
    fn modes_parse_by_name() {
        assert_eq!(EventsMode::parse("compact").ok(), Some(EventsMode::Compact));
        assert_eq!(
            EventsMode::parse(" Compact ").ok(),
            Some(EventsMode::Compact)
        );
        assert_eq!(EventsMode::parse("vllm").ok(), Some(EventsMode::Vllm));
        assert_eq!(EventsMode::parse("").ok(), Some(EventsMode::Vllm));
        assert_eq!(EventsMode::default(), EventsMode::Vllm);
        for m in [EventsMode::Vllm, EventsMode::Compact] {
            assert_eq!(EventsMode::parse(m.name()).ok(), Some(m));
        }
        let err = EventsMode::parse("fast").err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("\"fast\"") && e.contains("vllm, compact")));
    }
}
