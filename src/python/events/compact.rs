//! Compact KV events in the bindings: the core's rule (`crate::events::compact`)
//! applied to vLLM's structs.
//!
//! A manager in compact mode keeps a [`Compactor`]: the event at the end of its
//! sink (the list `take_events()` drains) with that event's [`Link`] and its list
//! fields. Each new event is first tried against it: when it continues it, its
//! hashes (and, for a store, token ids, extra keys and lookahead ids) are appended
//! to the tail's lists in place, and no struct is built; otherwise it is built
//! and appended and becomes the tail. The tail only merges while it is still the
//! sink's last element (checked by identity), so a drained or replaced sink simply
//! starts a new run.
//!
//! A `Link` is computed from the fields the builder is about to make a struct of
//! (no attribute reads), or read back from a struct (the pure-Python fallback's,
//! or any event handed to [`coalesce_kv_events`]). Either way the fields that a
//! merged event states once are compared whole: values for `None`, ints and
//! strings, identity for any other object (never a wrong merge). A class without
//! `__struct_fields__`, a hash that is neither bytes nor an int, or a store whose
//! token ids are not `block_size` per hash makes a barrier.
//!
//! Lists are only extended when this module owns them: the builder's and the
//! fallback's lists are made fresh for each event; events handed in from outside
//! ([`coalesce_kv_events`]) are copied (`msgspec.structs.replace` with copied
//! lists) before their first merge.

use std::sync::Arc;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString};
use smallvec::SmallVec;

use super::{struct_fields, PyEventBuilder, StoredMemo, StoredParts};
use crate::events::compact::Link;
use crate::events::KVCacheEvent;

/// A block hash as an event states it: bytes, or an int
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum EventHash {
    Bytes(SmallVec<[u8; 32]>),
    Int(u64),
}

impl EventHash {
    fn of(obj: &Bound<'_, PyAny>) -> Option<Self> {
        if let Ok(b) = obj.cast_exact::<PyBytes>() {
            return Some(EventHash::Bytes(SmallVec::from_slice(b.as_bytes())));
        }
        if obj.is_exact_instance_of::<PyInt>() {
            return obj.extract::<u64>().ok().map(EventHash::Int);
        }
        None
    }
}

/// One field that a merged event states once: compared by value for `None`, ints
/// and strings, by identity for any other object (two equal objects that are not
/// the same one do not merge, which is always safe).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Attr {
    None,
    Int(i64),
    /// Shared, so that the fixed fields of a builder's events clone cheaply.
    Str(Arc<str>),
    Object(usize),
}

impl Attr {
    fn of(obj: &Bound<'_, PyAny>) -> Self {
        let identity = || Attr::Object(obj.as_ptr() as usize);
        if obj.is_none() {
            Attr::None
        } else if obj.is_exact_instance_of::<PyInt>() || obj.is_exact_instance_of::<PyBool>() {
            obj.extract::<i64>().map_or_else(|_| identity(), Attr::Int)
        } else if let Ok(s) = obj.cast_exact::<PyString>() {
            s.to_str()
                .map_or_else(|_| identity(), |s| Attr::Str(s.into()))
        } else {
            identity()
        }
    }

    /// Whether a list field (`extra_keys`, `lookahead_token_ids`) is `None`: the two
    /// events of a merge must agree.
    fn absent(obj: &Bound<'_, PyAny>) -> Self {
        Attr::Int(i64::from(obj.is_none()))
    }
}

/// Every field of an event that a merged event states once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Attrs {
    /// An event a builder makes from its fields: the builder (its fixed fields: the
    /// medium and the class defaults it leaves), the per-event fields (`block_size`,
    /// `lora_id`, `lora_name`, `session_id`; all `None` for a removal) and whether
    /// `extra_keys` / `lookahead_token_ids` are `None`.
    Built {
        builder: usize,
        values: [Attr; 4],
        absent: [bool; 2],
    },
    /// An event read back from a struct: every compared field, in declaration
    /// order, then whether those two lists are `None`. Never equal to `Built`.
    Read(Box<[Attr]>),
}

type EventLink = Link<EventHash, Attrs>;

/// Fields that are not compared whole: the chain, the per-block lists, the group.
const CHAIN_FIELDS: [&str; 6] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "extra_keys",
    "lookahead_token_ids",
    "group_idx",
];

/// The list fields a merge extends, in this order.
const LIST_FIELDS: [&str; 4] = [
    "block_hashes",
    "token_ids",
    "extra_keys",
    "lookahead_token_ids",
];

/// The link of a store whose last and parent hashes are `hashes[-1]` and `parent`.
fn stored_link(
    group: u32,
    attrs: Attrs,
    hashes: &Bound<'_, PyList>,
    parent: &Bound<'_, PyAny>,
) -> PyResult<EventLink> {
    let n = hashes.len();
    if n == 0 {
        return Ok(Link::Barrier);
    }
    let Some(last) = EventHash::of(&hashes.get_item(n - 1)?) else {
        return Ok(Link::Barrier);
    };
    let parent = if parent.is_none() {
        None
    } else {
        match EventHash::of(parent) {
            Some(p) => Some(p),
            None => return Ok(Link::Barrier),
        }
    };
    Ok(Link::Stored {
        group,
        attrs,
        parent,
        last,
    })
}

/// The link of any event and its list fields (those that are lists), read from
/// the struct. `classes`: vLLM's `BlockStored` and `BlockRemoved`.
fn link_of<'py>(
    event: &Bound<'py, PyAny>,
    classes: (&Bound<'py, PyAny>, &Bound<'py, PyAny>),
) -> PyResult<(EventLink, [Option<Bound<'py, PyList>>; 4])> {
    let py = event.py();
    let mut lists: [Option<Bound<'py, PyList>>; 4] = Default::default();
    let ty = event.get_type();
    let stored = ty.is(classes.0);
    if !stored && !ty.is(classes.1) {
        return Ok((Link::Barrier, lists));
    }
    let fields = struct_fields(ty.as_any());
    if fields.is_empty() {
        return Ok((Link::Barrier, lists));
    }
    let field = |name: &str| -> PyResult<Bound<'py, PyAny>> {
        if fields.iter().any(|f| f == name) {
            event.getattr(PyString::new(py, name))
        } else {
            Ok(py.None().into_bound(py))
        }
    };
    let barrier = |lists| Ok((Link::Barrier, lists));
    let Ok(group) = field("group_idx")?.extract::<u32>() else {
        return barrier(lists);
    };
    for (slot, name) in lists.iter_mut().zip(LIST_FIELDS) {
        *slot = field(name)?.cast_into_exact::<PyList>().ok();
    }
    let Some(hashes) = lists[0].clone() else {
        return barrier(lists);
    };
    let mut attrs: Vec<Attr> = fields
        .iter()
        .filter(|f| !CHAIN_FIELDS.contains(&f.as_str()))
        .map(|f| field(f).map(|v| Attr::of(&v)))
        .collect::<PyResult<_>>()?;
    if !stored {
        if hashes.is_empty() {
            return barrier(lists);
        }
        let attrs = Attrs::Read(attrs.into_boxed_slice());
        return Ok((Link::Removed { group, attrs }, lists));
    }
    // A store merges only if it is one chain of whole blocks: `block_size` tokens
    // per hash, one extra-key entry and one lookahead list per hash (or none).
    let n = hashes.len();
    let per_block = |i: usize, name: &str| -> PyResult<bool> {
        let v = field(name)?;
        Ok(v.is_none() || lists[i].as_ref().is_some_and(|l| l.len() == n))
    };
    let whole = match (field("block_size")?.extract::<usize>(), &lists[1]) {
        (Ok(bs), Some(tokens)) => n.checked_mul(bs) == Some(tokens.len()),
        _ => false,
    };
    if !whole || !per_block(2, "extra_keys")? || !per_block(3, "lookahead_token_ids")? {
        return barrier(lists);
    }
    attrs.push(Attr::absent(&field("extra_keys")?));
    attrs.push(Attr::absent(&field("lookahead_token_ids")?));
    let attrs = Attrs::Read(attrs.into_boxed_slice());
    let link = stored_link(group, attrs, &hashes, &field("parent_block_hash")?)?;
    Ok((link, lists))
}

/// What a continuing event adds to the tail.
enum Parts<'py> {
    /// One removed key's hash.
    Hash(Bound<'py, PyAny>),
    /// The event's lists, in [`LIST_FIELDS`] order (`None`: not a list).
    Lists([Option<Bound<'py, PyList>>; 4]),
}

/// The event at the end of the sink, which a continuing event extends.
struct Tail {
    link: EventLink,
    event: Py<PyAny>,
    lists: [Option<Py<PyList>>; 4],
    /// Whether its lists are this module's to extend (else copied first).
    owned: bool,
}

impl Tail {
    /// Replaces the sink's last event (the tail, at `index`) by a copy with
    /// copied lists, which this module then owns.
    fn take_ownership(&mut self, sink: &Bound<'_, PyList>, index: usize) -> PyResult<()> {
        static REPLACE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let py = sink.py();
        let replace = REPLACE.import(py, "msgspec.structs", "replace")?;
        let changes = PyDict::new(py);
        let mut copies: [Option<Py<PyList>>; 4] = Default::default();
        for ((copy, list), name) in copies.iter_mut().zip(&self.lists).zip(LIST_FIELDS) {
            if let Some(list) = list {
                let fresh = PyList::new(py, list.bind(py).iter())?;
                changes.set_item(name, &fresh)?;
                *copy = Some(fresh.unbind());
            }
        }
        let event = replace.call((self.event.bind(py),), Some(&changes))?;
        sink.set_item(index, &event)?;
        self.event = event.unbind();
        self.lists = copies;
        self.owned = true;
        Ok(())
    }
}

/// Compact-mode state of one event sink: its last event, while it may still be
/// continued. `Default`: nothing to continue.
#[derive(Default)]
pub(crate) struct Compactor {
    tail: Option<Tail>,
}

impl Compactor {
    /// Forgets the sink's last event (the sink was drained: nothing can continue it),
    /// so that its objects are not kept alive here.
    pub(crate) fn release(&mut self) {
        self.tail = None;
    }

    /// The Python objects held (for the garbage collector).
    pub(crate) fn traverse(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Some(t) = &self.tail {
            visit.call(&t.event)?;
            for list in t.lists.iter().flatten() {
                visit.call(list)?;
            }
        }
        Ok(())
    }

    /// Merges the event `link` / `parts` into the sink's last event if it
    /// continues it; else gives `link` back.
    fn try_merge(
        &mut self,
        sink: &Bound<'_, PyList>,
        link: EventLink,
        parts: Parts<'_>,
    ) -> PyResult<Option<EventLink>> {
        let py = sink.py();
        let Some(tail) = self.tail.as_mut() else {
            return Ok(Some(link));
        };
        if !tail.link.continued_by(&link) {
            return Ok(Some(link));
        }
        let n = sink.len();
        if n == 0 || !sink.get_item(n - 1)?.is(tail.event.bind(py)) {
            // The sink was drained (take_events) or changed: a new run.
            self.tail = None;
            return Ok(Some(link));
        }
        if !tail.owned {
            tail.take_ownership(sink, n - 1)?;
        }
        match parts {
            Parts::Hash(h) => match &tail.lists[0] {
                Some(hashes) => hashes.bind(py).append(h)?,
                None => return Ok(Some(link)),
            },
            Parts::Lists(lists) => {
                // The links agree on which lists are present (the compared fields
                // include it); check anyway before touching any list.
                let agree = tail
                    .lists
                    .iter()
                    .zip(&lists)
                    .all(|(t, l)| t.is_some() == l.is_some());
                if !agree {
                    return Ok(Some(link));
                }
                for (t, l) in tail.lists.iter().zip(&lists) {
                    if let (Some(t), Some(l)) = (t, l) {
                        let t = t.bind(py);
                        let end = t.len();
                        t.set_slice(end, end, l.as_any())?;
                    }
                }
            }
        }
        tail.link.absorb(link);
        Ok(None)
    }

    /// Appends `event` (whose link is `link`) to the sink as the new tail; `owned`:
    /// its lists are this module's to extend.
    fn start<'py>(
        &mut self,
        sink: &Bound<'py, PyList>,
        event: Bound<'py, PyAny>,
        link: EventLink,
        lists: [Option<Bound<'py, PyList>>; 4],
        owned: bool,
    ) -> PyResult<()> {
        sink.append(&event)?;
        self.tail = match link {
            Link::Barrier => None,
            link => Some(Tail {
                link,
                event: event.unbind(),
                lists: lists.map(|l| l.map(Bound::unbind)),
                owned,
            }),
        };
        Ok(())
    }
}

/// The lists a merge must extend of a struct the builder just made from `given`:
/// `given` itself when the class keeps the objects it is given (msgspec's structs
/// do; checked on the first struct of each class, `keeps`), else read back.
fn kept_lists<'py>(
    keeps: &std::sync::OnceLock<bool>,
    event: &Bound<'py, PyAny>,
    given: [Option<Bound<'py, PyList>>; 4],
    n: usize,
) -> [Option<Bound<'py, PyList>>; 4] {
    let same = |read: &[Option<Bound<'py, PyList>>; 4]| {
        read.iter().zip(&given).all(|(r, g)| match (r, g) {
            (Some(r), Some(g)) => r.is(g),
            (None, None) => true,
            _ => false,
        })
    };
    if let Some(&true) = keeps.get() {
        return given;
    }
    let read = lists_of(event, n);
    if keeps.get().is_none() {
        let _ = keeps.set(same(&read));
    }
    read
}

/// The lists of a struct the builder just made, read back (the struct holds the
/// objects it was given, or its own: either way, the ones a merge must extend): the
/// first `n` of [`LIST_FIELDS`].
fn lists_of<'py>(event: &Bound<'py, PyAny>, n: usize) -> [Option<Bound<'py, PyList>>; 4] {
    let py = event.py();
    let names = [
        intern!(py, "block_hashes"),
        intern!(py, "token_ids"),
        intern!(py, "extra_keys"),
        intern!(py, "lookahead_token_ids"),
    ];
    let mut lists: [Option<Bound<'py, PyList>>; 4] = Default::default();
    for (slot, name) in lists.iter_mut().zip(names).take(n) {
        *slot = event
            .getattr(name)
            .ok()
            .and_then(|v| v.cast_into_exact::<PyList>().ok());
    }
    lists
}

impl PyEventBuilder {
    /// Appends vLLM's event for one core record to `sink` (see [`Self::build`]);
    /// with a compactor, merged into the sink's last event where it continues it.
    pub(crate) fn push<'py>(
        &self,
        py: Python<'py>,
        sink: &Bound<'py, PyList>,
        compactor: Option<&mut Compactor>,
        record: KVCacheEvent,
        request: Option<&Bound<'py, PyAny>>,
        memo: &mut StoredMemo<'py>,
    ) -> PyResult<()> {
        let Some(c) = compactor else {
            return sink.append(self.build(py, record, request, memo)?);
        };
        match record {
            KVCacheEvent::BlockRemoved { key } => {
                let hash = self.removed_hash(py, &key)?;
                let link = if self.compact.removed {
                    Link::Removed {
                        group: key.group_id,
                        attrs: Attrs::Built {
                            builder: self.identity(),
                            values: [Attr::None, Attr::None, Attr::None, Attr::None],
                            absent: [true, true],
                        },
                    }
                } else {
                    Link::Barrier
                };
                let Some(link) = c.try_merge(sink, link, Parts::Hash(hash.clone()))? else {
                    return Ok(());
                };
                let hashes = PyList::new(py, [hash])?;
                let event = self.removed_event(hashes.clone(), key.group_id)?;
                let given = [Some(hashes), None, None, None];
                let lists = kept_lists(&self.compact.removed_keeps_lists, &event, given, 1);
                c.start(sink, event, link, lists, true)
            }
            KVCacheEvent::BlockStored {
                group_id,
                start_block,
                end_block,
                block_size,
                hash_scale,
                skipped,
            } => {
                let skipped = skipped.as_deref().unwrap_or(&[]);
                let group = group_id.into_pyobject(py)?.into_any();
                let range = (start_block, end_block, block_size);
                let layout = (hash_scale as usize, skipped);
                let parts = self.stored_event_parts(py, request, range, &group, layout, memo)?;
                let whole = skipped.is_empty();
                self.push_stored(c, sink, parts, (group_id, &group), whole, memo)
            }
            KVCacheEvent::PartialBlockStored {
                group_id,
                num_tokens,
                hash_block_size,
            } => {
                // As `build`: the partial entry's last hash block.
                let n = num_tokens / hash_block_size.max(1);
                let group = group_id.into_pyobject(py)?.into_any();
                let range = (n.saturating_sub(1), n, hash_block_size);
                let parts = self.stored_event_parts(py, request, range, &group, (1, &[]), memo)?;
                self.push_stored(c, sink, parts, (group_id, &group), true, memo)
            }
            KVCacheEvent::AllBlocksCleared => {
                let event = self.all_blocks_cleared.bind(py).call0()?;
                c.start(sink, event, Link::Barrier, Default::default(), true)
            }
            // The caller picks the host pool's builder; this one builds it as its own.
            KVCacheEvent::Host { event, .. } => self.push(py, sink, Some(c), *event, request, memo),
        }
    }

    /// [`Self::push`] for a store: merged from its fields (no struct built) when it
    /// continues the tail, else built and appended. `whole`: no block of the range
    /// was left out (else it is a barrier). A store is annotated from `memo`'s
    /// specs as it is built; one annotation table holds for a whole run of the sink
    /// (it only changes when the sink is drained or handed out), so the events a
    /// merge joins, of one group, carry the same annotation.
    fn push_stored<'py>(
        &self,
        c: &mut Compactor,
        sink: &Bound<'py, PyList>,
        parts: StoredParts<'py>,
        (group_id, group): (u32, &Bound<'py, PyAny>),
        whole: bool,
        memo: &mut StoredMemo<'py>,
    ) -> PyResult<()> {
        let py = sink.py();
        match parts {
            StoredParts::Fields(fields, block_size) => {
                let link = if self.compact.stored && whole {
                    self.fields_link(&fields, &block_size, group_id)?
                } else {
                    Link::Barrier
                };
                let given =
                    [0, 2, 5, 7].map(|i| fields[i].clone().cast_into_exact::<PyList>().ok());
                let Some(link) = c.try_merge(sink, link, Parts::Lists(given.clone()))? else {
                    return Ok(());
                };
                let spec = memo.spec(group_id);
                let event = self.struct_of_fields(fields, &block_size, group, spec)?;
                let lists = kept_lists(&self.compact.stored_keeps_lists, &event, given, 4);
                c.start(sink, event, link, lists, true)
            }
            StoredParts::Built(event) => {
                let classes = (self.block_stored.bind(py), self.block_removed.bind(py));
                // Before its link is read: the annotation is one of the fields compared.
                memo.annotate_built(&event, classes.0)?;
                let (link, lists) = link_of(&event, classes)?;
                let link = if whole { link } else { Link::Barrier };
                let merge_lists = lists.clone();
                let Some(link) = c.try_merge(sink, link, Parts::Lists(merge_lists))? else {
                    return Ok(());
                };
                // The fallback makes fresh lists for each event.
                c.start(sink, event, link, lists, true)
            }
        }
    }

    /// The link of a store from the fields the builder makes its struct of.
    fn fields_link(
        &self,
        fields: &[Bound<'_, PyAny>; 8],
        block_size: &Bound<'_, PyAny>,
        group_id: u32,
    ) -> PyResult<EventLink> {
        let [hashes, parent, _, lora_id, lora_name, extra_keys, session_id, lookahead] = fields;
        let Ok(hashes) = hashes.cast_exact::<PyList>() else {
            return Ok(Link::Barrier);
        };
        let attrs = Attrs::Built {
            builder: self.identity(),
            values: [
                Attr::of(block_size),
                Attr::of(lora_id),
                Attr::of(lora_name),
                Attr::of(session_id),
            ],
            absent: [extra_keys.is_none(), lookahead.is_none()],
        };
        stored_link(group_id, attrs, hashes, parent)
    }

    /// This builder, as the fixed fields of the events it makes (a manager's builders
    /// live as long as the manager, and so as its compactor).
    fn identity(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }
}

/// The compact form of `events` (a batch of vLLM's KV events, in order):
/// consecutive events that continue one another merged by the same rule as a
/// manager in compact mode (`kv_events_mode="compact"`); every other event kept
/// as it is, in order. The input list and its events are left unchanged (a merged
/// run starts from a copy of its first event).
#[pyfunction]
#[pyo3(signature = (events: "list[Any]") -> "list[Any]")]
pub fn coalesce_kv_events<'py>(events: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyList>> {
    static CLASSES: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();
    let py = events.py();
    let (stored, removed) = CLASSES.get_or_try_init(py, || -> PyResult<_> {
        let m = py.import(intern!(py, "vllm.distributed.kv_events"))?;
        Ok((
            m.getattr(intern!(py, "BlockStored"))?.unbind(),
            m.getattr(intern!(py, "BlockRemoved"))?.unbind(),
        ))
    })?;
    let classes = (stored.bind(py), removed.bind(py));
    let out = PyList::empty(py);
    let mut c = Compactor::default();
    for event in events.iter() {
        let (link, lists) = link_of(&event, classes)?;
        let Some(link) = c.try_merge(&out, link, Parts::Lists(lists.clone()))? else {
            continue;
        };
        c.start(&out, event, link, lists, false)?;
    }
    Ok(out)
}

/// The KV-events mode named `name` (`"vllm"` or `"compact"`; case and blanks
/// ignored, empty is `"vllm"`), or `InvalidArgumentError` naming the accepted ones.
#[pyfunction]
pub fn normalize_kv_events_mode(name: &str) -> PyResult<&'static str> {
    Ok(crate::events::EventsMode::parse(name)?.name())
}
