//! `HiSparseCore`: HiSparse's coordinator of a `KVCacheCore`, for the Python view
//! of vLLM's `HiSparseCoordinator` (`python/hscache/vllm/hisparse.py`), and the calls
//! vLLM code makes on its resident and hot managers directly (the last section). One
//! group's allocation or admission count is the coordinator's (`coordinator.rs`),
//! the host pool a `BlockPoolCore` (`pool.rs`).
//!
//! The class holds its owner (`Py<KVCacheCore>`) and borrows it per call.
//! Conversion only: request ids, counts and block handles in, a core call, ids and
//! tuples out; the views build vLLM's objects (`SparseKVPageTransfer`, ...). The
//! core names a HiSparse publication's request by id; `Publications`
//! (`convert/publications.rs`) answers its
//! questions about those requests (and the interpreter's `hash()` of request ids,
//! which orders what vLLM iterates as a `set`) from the request objects the
//! manager's binding keeps, by publication id, in `PyKVCacheCore::publications`.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::PyTraverseError;

use super::convert::blocks::id_in;
use super::convert::count;
use super::convert::publications::Publications;
use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;
use crate::error::{Error, Result};
use crate::manager::hisparse::{HiSparseCoordinator, HiSparseCtx, HiSparseRequestState};
use crate::manager::KVCacheManager;
use crate::types::BlockId;

fn rid_counts(items: &Bound<'_, PyAny>) -> PyResult<Vec<(Box<str>, usize)>> {
    items
        .try_iter()?
        .map(|item| {
            let (rid, n): (String, i64) = item?.extract()?;
            Ok((rid.into(), count("num_tokens", n)?))
        })
        .collect()
}

fn rid_ranges(items: &Bound<'_, PyAny>) -> PyResult<Vec<(Box<str>, usize, usize)>> {
    items
        .try_iter()?
        .map(|item| {
            let (rid, a, b): (String, i64, i64) = item?.extract()?;
            Ok((
                rid.into(),
                count("num_computed_tokens", a)?,
                count("num_scheduled_tokens", b)?,
            ))
        })
        .collect()
}

fn id_counts(d: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64)>> {
    let dict = d.cast::<PyDict>()?;
    dict.iter()
        .map(|(k, v)| Ok((k.extract::<u64>()?, v.extract::<u64>()?)))
        .collect()
}

fn state_dict<'py>(py: Python<'py>, s: &HiSparseRequestState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(
        "valid_pages",
        s.valid_pages.iter().copied().collect::<Vec<_>>(),
    )?;
    d.set_item("ready_prefix_pages", s.ready_prefix_pages)?;
    d.set_item(
        "pending_pages",
        s.pending_pages
            .iter()
            .map(|(&p, &i)| (p, i))
            .collect::<Vec<_>>(),
    )?;
    d.set_item("copies_recorded_blocks", s.copies_recorded_blocks)?;
    d.set_item(
        "pinned_clean",
        s.pinned_clean.iter().copied().collect::<Vec<_>>(),
    )?;
    d.set_item(
        "unpinned_pages",
        s.unpinned_pages.iter().copied().collect::<Vec<_>>(),
    )?;
    d.set_item("pages_to_adopt", s.pages_to_adopt)?;
    d.set_item("synced_pages", s.synced_pages)?;
    d.set_item(
        "stale_pages",
        s.stale_pages.iter().copied().collect::<Vec<_>>(),
    )?;
    match &s.publication {
        Some(p) => {
            let pd = PyDict::new(py);
            pd.set_item("id", p.id)?;
            pd.set_item("num_computed_tokens", p.num_computed_tokens)?;
            pd.set_item("num_pages", p.num_pages)?;
            pd.set_item("retention_interval", p.retention_interval)?;
            pd.set_item("replay_boundaries", p.replay_boundaries.to_vec())?;
            pd.set_item("detached_blocks", p.detached_blocks.clone())?;
            pd.set_item("num_cached_blocks", p.num_cached_blocks)?;
            d.set_item("publication", pd)?;
        }
        None => d.set_item("publication", py.None())?,
    }
    Ok(d)
}

/// The HiSparse layout of `core` as a dict (see `HiSparseCore.layout`); None
/// without one.
pub(crate) fn layout<'py>(
    py: Python<'py>,
    core: &KVCacheManager,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(h) = core.coordinator().hisparse() else {
        return Ok(None);
    };
    let l = h.layout();
    let d = PyDict::new(py);
    d.set_item("host_group", l.host_group)?;
    d.set_item("resident_groups", l.resident_groups.to_vec())?;
    d.set_item("hot_groups", l.hot_groups.to_vec())?;
    d.set_item("block_size", l.block_size)?;
    d.set_item("max_spill_pages", l.max_spill_pages)?;
    d.set_item("transition_watermark", l.transition_watermark)?;
    d.set_item("num_reprefillable_tokens", l.num_reprefillable_tokens)?;
    d.set_item(
        "host_num_blocks",
        core.host_pool()
            .map_or(0, crate::pool::BlockPool::num_gpu_blocks),
    )?;
    Ok(Some(d))
}

fn no_hisparse() -> PyErr {
    InvalidArgumentError::new_err("this KV-cache layout has no HiSparse coordinator")
}

#[pyclass(name = "HiSparseCore", module = "hscache._core", frozen)]
pub struct PyHiSparseCore {
    /// The manager whose HiSparse coordinator this is (borrowed per call).
    pub(crate) owner: Py<PyKVCacheCore>,
}

impl PyHiSparseCore {
    /// One call on the owner's HiSparse coordinator.
    fn call<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut HiSparseCoordinator, &mut HiSparseCtx<'_>) -> Result<T>,
    ) -> PyResult<T> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        Ok(this.core.hisparse_call(f)?)
    }

    /// One call, then the KV events it recorded published.
    fn call_flushed(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut HiSparseCoordinator, &mut HiSparseCtx<'_>) -> Result<()>,
    ) -> PyResult<()> {
        let slf = self.owner.bind(py);
        slf.try_borrow_mut()?.core.hisparse_call(f)?;
        PyKVCacheCore::flush(slf, None)
    }

    /// One call that asks about publications' requests ([`Publications`]), then the
    /// KV events it recorded published.
    fn call_with_publications(
        &self,
        py: Python<'_>,
        f: impl FnOnce(
            &mut HiSparseCoordinator,
            &mut HiSparseCtx<'_>,
            &Publications<'_, '_>,
        ) -> Result<()>,
    ) -> PyResult<()> {
        let slf = self.owner.bind(py);
        {
            let mut this = slf.try_borrow_mut()?;
            let this = &mut *this;
            let oracle = Publications::new(py, &this.publications);
            this.core
                .hisparse_call(|h, ctx| f(h, ctx, &oracle))
                .map_err(|e| oracle.error(e))?;
        }
        PyKVCacheCore::flush(slf, None)
    }
}

#[pymethods]
impl PyHiSparseCore {
    /// The HiSparse coordinator of `owner` (`InvalidArgumentError` without one).
    #[new]
    fn new(owner: &Bound<'_, PyKVCacheCore>) -> PyResult<Self> {
        if owner.try_borrow()?.core.coordinator().hisparse().is_none() {
            return Err(no_hisparse());
        }
        Ok(Self {
            owner: owner.clone().unbind(),
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> std::result::Result<(), PyTraverseError> {
        visit.call(&self.owner)
    }

    // ---- layout ---------------------------------------------------------------------

    /// The HiSparse layout: `host_group`, `resident_groups`, `hot_groups`,
    /// `block_size`, `max_spill_pages`, `transition_watermark`,
    /// `num_reprefillable_tokens`, `host_num_blocks`.
    #[pyo3(signature = () -> "dict[str, Any]")]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        layout(py, &self.owner.bind(py).try_borrow()?.core)?.ok_or_else(no_hisparse)
    }

    /// Sets `max_spill_pages` or `transition_watermark` (vLLM code assigns them).
    #[pyo3(signature = (name, value: "int"))]
    fn set(&self, py: Python<'_>, name: &str, value: i64) -> PyResult<()> {
        let n = count(name, value)?;
        let which = name.to_owned();
        self.call(py, |h, _| {
            match which.as_str() {
                "max_spill_pages" => h.set_max_spill_pages(n),
                "transition_watermark" => h.set_transition_watermark(n),
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "no settable HiSparse attribute {other:?}"
                    )))
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    // ---- the connector's calls ---------------------------------------------------------

    /// vLLM's `advance_scheduled(pairs of (request_id, num_tokens))`.
    #[pyo3(signature = (requests: "Iterable[tuple[str, int]]"))]
    fn advance_scheduled(&self, py: Python<'_>, requests: &Bound<'_, PyAny>) -> PyResult<()> {
        let requests = rid_counts(requests)?;
        self.call_flushed(py, |h, ctx| h.advance_scheduled(ctx, &requests))
    }

    /// vLLM's `plan_prefix_materialization`.
    #[pyo3(signature = (request_id, num_computed_tokens: "int"))]
    fn plan_prefix_materialization(
        &self,
        py: Python<'_>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let n = count("num_computed_tokens", num_computed_tokens)?;
        self.call_flushed(py, |h, ctx| {
            h.plan_prefix_materialization(ctx, request_id, n)
        })
    }

    /// vLLM's `update_residency`.
    fn update_residency(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        self.call_flushed(py, |h, ctx| h.update_residency(ctx, request_id))
    }

    /// vLLM's `commit_computed_blocks`.
    #[pyo3(signature = (request_id, num_host_pages: "int"))]
    fn commit_computed_blocks(
        &self,
        py: Python<'_>,
        request_id: &str,
        num_host_pages: i64,
    ) -> PyResult<()> {
        let n = count("num_host_pages", num_host_pages)?;
        self.call(py, |h, ctx| h.commit_computed_blocks(ctx, request_id, n))
    }

    /// vLLM's `record_pending_host_import`.
    #[pyo3(signature = (request_id, num_tokens: "int"))]
    fn record_pending_host_import(
        &self,
        py: Python<'_>,
        request_id: &str,
        num_tokens: i64,
    ) -> PyResult<()> {
        let n = count("num_tokens", num_tokens)?;
        self.call(py, |h, _| {
            h.record_pending_host_import(request_id, n);
            Ok(())
        })
    }

    /// vLLM's `finish_host_import`.
    fn finish_host_import(&self, py: Python<'_>, request_id: &str, failed: bool) -> PyResult<()> {
        self.call_flushed(py, |h, ctx| h.finish_host_import(ctx, request_id, failed))
    }

    /// vLLM's `complete_host_import`.
    #[pyo3(signature = (request_id, num_computed_tokens: "int"))]
    fn complete_host_import(
        &self,
        py: Python<'_>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let n = count("num_computed_tokens", num_computed_tokens)?;
        self.call_flushed(py, |h, ctx| h.complete_host_import(ctx, request_id, n))
    }

    /// vLLM's `build_offload_command`: None without resident groups, else the
    /// planned transfers `(transfer_id, host_block_id, resident_block_ids,
    /// after_forward, restore)`, drained.
    #[allow(clippy::type_complexity)]
    fn build_offload_command(
        &self,
        py: Python<'_>,
    ) -> PyResult<Option<Vec<(u64, BlockId, Vec<BlockId>, bool, bool)>>> {
        let cmd = self.call(py, |h, _| Ok(h.build_offload_command()))?;
        Ok(cmd.map(|ts| {
            ts.into_iter()
                .map(|t| {
                    (
                        t.transfer_id,
                        t.host_block_id,
                        t.resident_block_ids.to_vec(),
                        t.after_forward,
                        t.restore,
                    )
                })
                .collect()
        }))
    }

    /// vLLM's `take_host_block_copies`: `(source, copy)` host block ids.
    fn take_host_block_copies(&self, py: Python<'_>) -> PyResult<Vec<(BlockId, BlockId)>> {
        self.call(py, HiSparseCoordinator::take_host_block_copies)
    }

    /// vLLM's `release_completed_host_copies`.
    #[pyo3(signature = (dst_block_ids: "list[int]"))]
    fn release_completed_host_copies(
        &self,
        py: Python<'_>,
        dst_block_ids: Vec<BlockId>,
    ) -> PyResult<()> {
        self.call_flushed(py, |h, ctx| {
            h.release_completed_host_copies(ctx, &dst_block_ids)
        })
    }

    /// vLLM's `build_row_mirrors`: `(source_starts, destination_start, num_rows)`.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (requests: "Iterable[tuple[str, int, int]]"))]
    fn build_row_mirrors(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(Vec<usize>, usize, usize)>> {
        let requests = rid_ranges(requests)?;
        let mirrors = self.call(py, |h, ctx| h.build_row_mirrors(ctx, &requests))?;
        Ok(mirrors
            .into_iter()
            .map(|m| (m.source_starts.to_vec(), m.destination_start, m.num_rows))
            .collect())
    }

    /// vLLM's `all_context_pages_resident`.
    #[pyo3(signature = (requests: "Iterable[tuple[str, int, int]]"))]
    fn all_context_pages_resident(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let requests = rid_ranges(requests)?;
        self.call(py, |h, ctx| h.all_context_pages_resident(ctx, &requests))
    }

    /// vLLM's `take_residency_updates`: `(request_id, pages, block_ids per resident
    /// group)` for the requests that have one.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (request_ids: "Iterable[str]"))]
    fn take_residency_updates(
        &self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(String, Vec<usize>, Vec<Vec<BlockId>>)>> {
        let ids = request_ids
            .try_iter()?
            .map(|r| Ok(r?.extract::<String>()?.into_boxed_str()))
            .collect::<PyResult<Vec<_>>>()?;
        let updates = self.call(py, |h, ctx| h.take_residency_updates(ctx, &ids))?;
        Ok(updates
            .into_iter()
            .map(|(rid, u)| (rid.into(), u.pages, u.block_ids))
            .collect())
    }

    /// vLLM's `has_pending_reclamation`.
    fn has_pending_reclamation(&self, py: Python<'_>) -> PyResult<bool> {
        self.call(py, |h, ctx| h.has_pending_reclamation(ctx))
    }

    /// vLLM's `has_pending_work`.
    fn has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
        let this = self.owner.bind(py).try_borrow()?;
        Ok({
            this.core
                .coordinator()
                .hisparse()
                .is_some_and(HiSparseCoordinator::has_pending_work)
        })
    }

    /// vLLM's `update_spills(enqueued_counts, completed_counts)` (dicts).
    #[pyo3(signature = (enqueued_counts: "dict[int, int]", completed_counts: "dict[int, int]"))]
    fn update_spills(
        &self,
        py: Python<'_>,
        enqueued_counts: &Bound<'_, PyAny>,
        completed_counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let enqueued = id_counts(enqueued_counts)?;
        let completed = id_counts(completed_counts)?;
        self.call_with_publications(py, |h, ctx, oracle| {
            h.update_spills(ctx, &enqueued, &completed, oracle)
        })
    }

    /// vLLM's `HiSparseCoordinator.free(request_id)` alone.
    fn free(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        self.call_with_publications(py, |h, ctx, oracle| h.free(ctx, request_id, oracle))
    }

    // ---- state, for the views ----------------------------------------------------------

    /// The request ids of `request_states`.
    fn request_ids(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let this = self.owner.bind(py).try_borrow()?;
        Ok({
            this.core
                .coordinator()
                .hisparse()
                .map(|h| h.request_states().map(|(rid, _)| rid.to_owned()).collect())
                .unwrap_or_default()
        })
    }

    /// `request_states[request_id]` as a dict (None if absent); `state_id` names
    /// the state object (pending spills refer to it).
    #[pyo3(signature = (request_id) -> "tuple[int, dict[str, Any]] | None")]
    fn request_state<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Option<(u32, Bound<'py, PyDict>)>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.core.read("hisparse_request_state", |c| {
            let Some(h) = c.coordinator().hisparse() else {
                return Ok(None);
            };
            let Some(id) = h.request_state_id(request_id) else {
                return Ok(None);
            };
            match h.state(id) {
                Some(s) => Ok(Some((id, state_dict(py, s)?))),
                None => Ok(None),
            }
        })
    }

    /// The state of slab entry `state_id` as a dict (None if gone).
    #[pyo3(signature = (state_id: "int") -> "dict[str, Any] | None")]
    fn state<'py>(&self, py: Python<'py>, state_id: u32) -> PyResult<Option<Bound<'py, PyDict>>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.core.read("hisparse_state", |c| {
            match c.coordinator().hisparse().and_then(|h| h.state(state_id)) {
                Some(s) => Ok(Some(state_dict(py, s)?)),
                None => Ok(None),
            }
        })
    }

    /// `pending_spills` in order: `(transfer_id, request_id, page, state_id,
    /// host_block, resident_blocks, restore, expected_worker_completions,
    /// worker_completions, enqueue_applied)`.
    #[allow(clippy::type_complexity)]
    fn pending_spills(
        &self,
        py: Python<'_>,
    ) -> PyResult<
        Vec<(
            u64,
            String,
            usize,
            u32,
            BlockId,
            Vec<BlockId>,
            bool,
            u64,
            u64,
            bool,
        )>,
    > {
        let this = self.owner.bind(py).try_borrow()?;
        Ok({
            this.core
                .coordinator()
                .hisparse()
                .map(|h| {
                    h.pending_spills()
                        .map(|p| {
                            (
                                p.transfer_id,
                                p.request_id.to_string(),
                                p.page,
                                p.state,
                                p.host_block,
                                p.resident_blocks.to_vec(),
                                p.restore,
                                p.expected_worker_completions,
                                p.worker_completions,
                                p.enqueue_applied,
                            )
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
    }

    /// `spills_to_send` (not drained), as `build_offload_command`'s tuples.
    #[allow(clippy::type_complexity)]
    fn spills_to_send(
        &self,
        py: Python<'_>,
    ) -> PyResult<Vec<(u64, BlockId, Vec<BlockId>, bool, bool)>> {
        let this = self.owner.bind(py).try_borrow()?;
        Ok({
            this.core
                .coordinator()
                .hisparse()
                .map(|h| {
                    h.spills_to_send()
                        .iter()
                        .map(|t| {
                            (
                                t.transfer_id,
                                t.host_block_id,
                                t.resident_block_ids.to_vec(),
                                t.after_forward,
                                t.restore,
                            )
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
    }

    /// The request of HiSparse publication `publication` (None if gone).
    #[pyo3(signature = (publication: "int"))]
    fn publication_request(&self, py: Python<'_>, publication: u64) -> PyResult<Option<Py<PyAny>>> {
        let this = self.owner.bind(py).try_borrow()?;
        Ok(this.publications.get(&publication).map(|r| r.clone_ref(py)))
    }

    /// The rest of the coordinator's state: `copies` `[(key bytes, [block ids])]`,
    /// `copy_by_block` `[(block, key bytes)]`, `owners` `[(block, [(request, page)])]`,
    /// `retained_copies` `[(dst, src, dst)]`, `pending_imports` `[(request, tokens)]`,
    /// `resident_requests`, `next_spill_id`.
    #[pyo3(signature = () -> "dict[str, Any]")]
    fn tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.core.read("hisparse_tables", |c| {
            let d = PyDict::new(py);
            let Some(h) = c.coordinator().hisparse() else {
                return Ok(d);
            };
            let copies = PyList::empty(py);
            for (k, blocks) in h.copies() {
                copies.append((PyBytes::new(py, &k.to_vllm_bytes()), blocks.to_vec()))?;
            }
            d.set_item("copies", copies)?;
            let by_block = PyList::empty(py);
            for (b, k) in h.copy_by_block() {
                by_block.append((b, PyBytes::new(py, &k.to_vllm_bytes())))?;
            }
            d.set_item("copy_by_block", by_block)?;
            let owners = PyList::empty(py);
            for (b, set) in h.owners() {
                let mut pairs: Vec<(String, usize)> =
                    set.iter().map(|(r, p)| (r.to_string(), *p)).collect();
                pairs.sort_unstable();
                owners.append((b, pairs))?;
            }
            d.set_item("owners", owners)?;
            d.set_item(
                "retained_copies",
                h.retained_copies()
                    .map(|(&dst, &(src, cow))| (dst, src, cow))
                    .collect::<Vec<_>>(),
            )?;
            d.set_item(
                "pending_imports",
                h.pending_imports()
                    .map(|(r, &n)| (r.to_owned(), n))
                    .collect::<Vec<_>>(),
            )?;
            d.set_item(
                "resident_requests",
                h.resident_requests().map(str::to_owned).collect::<Vec<_>>(),
            )?;
            d.set_item("next_spill_id", h.next_spill_id())?;
            Ok(d)
        })
    }

    // ---- resident and hot managers --------------------------------------------------

    /// vLLM's `get_resident_page` of resident group `g`.
    #[pyo3(signature = (g: "int", request_id, page: "int"))]
    fn get_resident_page(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let this = self.owner.bind(py).try_borrow()?;
        let page = count("block_idx", page)?;
        this.core.read("get_resident_page", |c| {
            let m = resident(c, g)?;
            Ok(m.get_resident_page(request_id, c.get_blocks(request_id, g), page))
        })
    }

    /// vLLM's `get_residency_row(request_id, start)` of resident group `g` (ids).
    #[pyo3(signature = (g: "int", request_id, start: "int"))]
    fn get_residency_row(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        start: i64,
    ) -> PyResult<Vec<BlockId>> {
        let this = self.owner.bind(py).try_borrow()?;
        let start = count("start", start)?;
        this.core.read("get_residency_row", |c| {
            let m = resident(c, g)?;
            let mut out = Vec::new();
            m.residency_row(request_id, c.get_blocks(request_id, g), start, &mut out);
            Ok(out)
        })
    }

    /// vLLM's `adopt_resident_page` of resident group `g`.
    #[pyo3(signature = (g: "int", request_id, page: "int", block: "KVCacheBlock"))]
    fn adopt_resident_page(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        page: i64,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let slf = self.owner.bind(py);
        let page = count("block_idx", page)?;
        let id = id_in(slf, block, false)?;
        let mut this = slf.try_borrow_mut()?;
        Ok(this.core.hisparse_call(|_, ctx| {
            let table = ctx
                .requests
                .get(request_id)
                .map(|s| s.groups[g].blocks.clone());
            let m = ctx.managers[g]
                .hisparse_resident_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not resident")))?;
            Ok(m.adopt_resident_page(request_id, table.as_deref(), page, id))
        })?)
    }

    /// vLLM's `drop_resident_page` of resident group `g`.
    #[pyo3(signature = (g: "int", request_id, page: "int"))]
    fn drop_resident_page(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        let page = count("block_idx", page)?;
        Ok(this.core.hisparse_call(|_, ctx| {
            let table = ctx
                .requests
                .get(request_id)
                .map(|s| s.groups[g].blocks.clone());
            let m = ctx.managers[g]
                .hisparse_resident_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not resident")))?;
            Ok(m.drop_resident_page(request_id, table.as_deref(), page))
        })?)
    }

    /// `residency_changes` of resident group `g`: `[(request, [(page, block)])]`.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (g: "int"))]
    fn residency_changes(
        &self,
        py: Python<'_>,
        g: usize,
    ) -> PyResult<Vec<(String, Vec<(usize, BlockId)>)>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.core.read("residency_changes", |c| {
            let m = resident(c, g)?;
            Ok(m.requests_with_changes()
                .map(|rid| {
                    let changes = m
                        .residency_changes(rid)
                        .map(|c| c.iter().map(|(&p, &b)| (p, b)).collect())
                        .unwrap_or_default();
                    (rid.to_owned(), changes)
                })
                .collect())
        })
    }

    /// vLLM's `require_hot` of hot group `g`.
    #[pyo3(signature = (g: "int", request_id))]
    fn require_hot(&self, py: Python<'_>, g: usize, request_id: &str) -> PyResult<()> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        Ok(this.core.hisparse_call(|_, ctx| {
            ctx.managers[g]
                .hisparse_hot_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not hot")))?
                .require_hot(request_id);
            Ok(())
        })?)
    }

    /// `hot_required` of hot group `g`.
    #[pyo3(signature = (g: "int"))]
    fn hot_required(&self, py: Python<'_>, g: usize) -> PyResult<Vec<String>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.core.read("hot_required", |c| {
            let m = c
                .coordinator()
                .managers()
                .get(g)
                .and_then(|m| m.hisparse_hot())
                .ok_or_else(|| InvalidArgumentError::new_err(format!("group {g} is not hot")))?;
            Ok(m.hot_required().map(str::to_owned).collect())
        })
    }
}

fn resident(
    core: &crate::manager::KVCacheManager,
    g: usize,
) -> PyResult<&crate::manager::hisparse::HiSparseResidentManager> {
    core.coordinator()
        .managers()
        .get(g)
        .and_then(|m| m.hisparse_resident())
        .ok_or_else(|| InvalidArgumentError::new_err(format!("group {g} is not resident")))
}
