//! `KVCacheCore`'s HiSparse methods, for the Python views of vLLM's
//! `HiSparseCoordinator`, its managers and its host pool
//! (`python/hscache/vllm/hisparse.py`).
//!
//! Conversion only: request ids, counts and block handles in, a core call, ids and
//! tuples out; the views build vLLM's objects (`SparseKVPageTransfer`, ...). The
//! core names a HiSparse publication's request by id; [`Publications`] answers its
//! questions about those requests (and the interpreter's `hash()` of request ids,
//! which orders what vLLM iterates as a `set`) from the request objects this
//! binding keeps, by publication id, in `PyKVCacheCore::publications`.

use std::cell::RefCell;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use rustc_hash::FxHashMap;

use super::block::PyKVCacheBlock;
use super::convert::blocks::{id_in, ids_in};
use super::convert::count;
use super::errors::InvalidArgumentError;
use super::manager::PyKVCacheCore;
use crate::error::{Error, Result};
use crate::manager::hisparse::{HiSparseRequestState, PublicationRequests};
use crate::manager::single_type::{GroupBlocks, NumBlocksQuery};
use crate::types::BlockId;

/// [`PublicationRequests`] over the publications' request objects.
pub(crate) struct Publications<'a, 'py> {
    py: Python<'py>,
    requests: &'a FxHashMap<u64, Py<PyAny>>,
    err: RefCell<Option<PyErr>>,
}

impl<'a, 'py> Publications<'a, 'py> {
    pub(crate) fn new(py: Python<'py>, requests: &'a FxHashMap<u64, Py<PyAny>>) -> Self {
        Self {
            py,
            requests,
            err: RefCell::new(None),
        }
    }

    fn stash(&self, e: PyErr) -> Error {
        let msg = e.to_string();
        *self.err.borrow_mut() = Some(e);
        Error::InvalidArgument(msg)
    }

    /// The error to raise for a failed call: the Python error behind it, if any.
    pub(crate) fn error(&self, e: Error) -> PyErr {
        self.err.borrow_mut().take().unwrap_or_else(|| e.into())
    }
}

impl PublicationRequests for Publications<'_, '_> {
    fn is_finished(&self, publication: u64) -> Result<bool> {
        let Some(request) = self.requests.get(&publication) else {
            return Err(Error::Internal(format!(
                "HiSparse publication {publication} has no request"
            )));
        };
        request
            .bind(self.py)
            .call_method0("is_finished")
            .and_then(|v| v.is_truthy())
            .map_err(|e| self.stash(e))
    }

    fn request_hash(&self, request_id: &str) -> Result<u64> {
        PyString::new(self.py, request_id)
            .hash()
            .map(|h| h as u64)
            .map_err(|e| self.stash(e))
    }
}

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

#[pymethods]
impl PyKVCacheCore {
    // ---- layout ---------------------------------------------------------------------

    /// The HiSparse layout (None without one): `host_group`, `resident_groups`,
    /// `hot_groups`, `block_size`, `max_spill_pages`, `transition_watermark`,
    /// `num_reprefillable_tokens`, `host_num_blocks`.
    fn core_hisparse_layout<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(h) = self.core.coordinator().hisparse() else {
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
            self.core.host_pool().map_or(0, |p| p.num_gpu_blocks()),
        )?;
        Ok(Some(d))
    }

    /// Sets `max_spill_pages` or `transition_watermark` (vLLM code assigns them).
    fn core_hisparse_set(&mut self, name: &str, value: i64) -> PyResult<()> {
        let n = count(name, value)?;
        let which = name.to_owned();
        self.core.hisparse_call(|h, _| {
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
    fn core_hisparse_advance_scheduled(
        slf: &Bound<'_, Self>,
        requests: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let requests = rid_counts(requests)?;
        slf.try_borrow_mut()?
            .core
            .hisparse_call(|h, ctx| h.advance_scheduled(ctx, &requests))?;
        Self::flush(slf, None)
    }

    /// vLLM's `plan_prefix_materialization`.
    fn core_hisparse_plan_prefix_materialization(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let n = count("num_computed_tokens", num_computed_tokens)?;
        slf.try_borrow_mut()?
            .core
            .hisparse_call(|h, ctx| h.plan_prefix_materialization(ctx, request_id, n))?;
        Self::flush(slf, None)
    }

    /// vLLM's `update_residency`.
    fn core_hisparse_update_residency(slf: &Bound<'_, Self>, request_id: &str) -> PyResult<()> {
        slf.try_borrow_mut()?
            .core
            .hisparse_call(|h, ctx| h.update_residency(ctx, request_id))?;
        Self::flush(slf, None)
    }

    /// vLLM's `commit_computed_blocks`.
    fn core_hisparse_commit_computed_blocks(
        &mut self,
        request_id: &str,
        num_host_pages: i64,
    ) -> PyResult<()> {
        let n = count("num_host_pages", num_host_pages)?;
        Ok(self
            .core
            .hisparse_call(|h, ctx| h.commit_computed_blocks(ctx, request_id, n))?)
    }

    /// vLLM's `record_pending_host_import`.
    fn core_hisparse_record_pending_host_import(
        &mut self,
        request_id: &str,
        num_tokens: i64,
    ) -> PyResult<()> {
        let n = count("num_tokens", num_tokens)?;
        Ok(self.core.hisparse_call(|h, _| {
            h.record_pending_host_import(request_id, n);
            Ok(())
        })?)
    }

    /// vLLM's `finish_host_import`.
    fn core_hisparse_finish_host_import(
        slf: &Bound<'_, Self>,
        request_id: &str,
        failed: bool,
    ) -> PyResult<()> {
        slf.try_borrow_mut()?
            .core
            .hisparse_call(|h, ctx| h.finish_host_import(ctx, request_id, failed))?;
        Self::flush(slf, None)
    }

    /// vLLM's `complete_host_import`.
    fn core_hisparse_complete_host_import(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let n = count("num_computed_tokens", num_computed_tokens)?;
        slf.try_borrow_mut()?
            .core
            .hisparse_call(|h, ctx| h.complete_host_import(ctx, request_id, n))?;
        Self::flush(slf, None)
    }

    /// vLLM's `build_offload_command`: None without resident groups, else the
    /// planned transfers `(transfer_id, host_block_id, resident_block_ids,
    /// after_forward, restore)`, drained.
    #[allow(clippy::type_complexity)]
    fn core_hisparse_build_offload_command(
        &mut self,
    ) -> PyResult<Option<Vec<(u64, BlockId, Vec<BlockId>, bool, bool)>>> {
        let cmd = self
            .core
            .hisparse_call(|h, _| Ok(h.build_offload_command()))?;
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
    fn core_hisparse_take_host_block_copies(&mut self) -> PyResult<Vec<(BlockId, BlockId)>> {
        Ok(self
            .core
            .hisparse_call(|h, ctx| h.take_host_block_copies(ctx))?)
    }

    /// vLLM's `release_completed_host_copies`.
    fn core_hisparse_release_completed_host_copies(
        slf: &Bound<'_, Self>,
        dst_block_ids: Vec<BlockId>,
    ) -> PyResult<()> {
        slf.try_borrow_mut()?
            .core
            .hisparse_call(|h, ctx| h.release_completed_host_copies(ctx, &dst_block_ids))?;
        Self::flush(slf, None)
    }

    /// vLLM's `build_row_mirrors`: `(source_starts, destination_start, num_rows)`.
    #[allow(clippy::type_complexity)]
    fn core_hisparse_build_row_mirrors(
        &mut self,
        requests: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(Vec<usize>, usize, usize)>> {
        let requests = rid_ranges(requests)?;
        let mirrors = self
            .core
            .hisparse_call(|h, ctx| h.build_row_mirrors(ctx, &requests))?;
        Ok(mirrors
            .into_iter()
            .map(|m| (m.source_starts.to_vec(), m.destination_start, m.num_rows))
            .collect())
    }

    /// vLLM's `all_context_pages_resident`.
    fn core_hisparse_all_context_pages_resident(
        &mut self,
        requests: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let requests = rid_ranges(requests)?;
        Ok(self
            .core
            .hisparse_call(|h, ctx| h.all_context_pages_resident(ctx, &requests))?)
    }

    /// vLLM's `take_residency_updates`: `(request_id, pages, block_ids per resident
    /// group)` for the requests that have one.
    #[allow(clippy::type_complexity)]
    fn core_hisparse_take_residency_updates(
        &mut self,
        request_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(String, Vec<usize>, Vec<Vec<BlockId>>)>> {
        let ids = request_ids
            .try_iter()?
            .map(|r| Ok(r?.extract::<String>()?.into_boxed_str()))
            .collect::<PyResult<Vec<_>>>()?;
        let updates = self
            .core
            .hisparse_call(|h, ctx| h.take_residency_updates(ctx, &ids))?;
        Ok(updates
            .into_iter()
            .map(|(rid, u)| (rid.into(), u.pages, u.block_ids))
            .collect())
    }

    /// vLLM's `has_pending_reclamation`.
    fn core_hisparse_has_pending_reclamation(&mut self) -> PyResult<bool> {
        Ok(self
            .core
            .hisparse_call(|h, ctx| h.has_pending_reclamation(ctx))?)
    }

    /// vLLM's `has_pending_work`.
    fn core_hisparse_has_pending_work(&self) -> bool {
        self.core
            .coordinator()
            .hisparse()
            .is_some_and(|h| h.has_pending_work())
    }

    /// vLLM's `update_spills(enqueued_counts, completed_counts)` (dicts).
    fn core_hisparse_update_spills(
        slf: &Bound<'_, Self>,
        enqueued_counts: &Bound<'_, PyAny>,
        completed_counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let enqueued = id_counts(enqueued_counts)?;
        let completed = id_counts(completed_counts)?;
        {
            let mut this = slf.try_borrow_mut()?;
            let this = &mut *this;
            let oracle = Publications::new(slf.py(), &this.publications);
            this.core
                .hisparse_call(|h, ctx| h.update_spills(ctx, &enqueued, &completed, &oracle))
                .map_err(|e| oracle.error(e))?;
        }
        Self::flush(slf, None)
    }

    /// vLLM's `HiSparseCoordinator.free(request_id)` alone.
    fn core_hisparse_free(slf: &Bound<'_, Self>, request_id: &str) -> PyResult<()> {
        {
            let mut this = slf.try_borrow_mut()?;
            let this = &mut *this;
            let oracle = Publications::new(slf.py(), &this.publications);
            this.core
                .hisparse_call(|h, ctx| h.free(ctx, request_id, &oracle))
                .map_err(|e| oracle.error(e))?;
        }
        Self::flush(slf, None)
    }

    // ---- state, for the views ----------------------------------------------------------

    /// The request ids of `request_states`.
    fn core_hisparse_request_ids(&self) -> Vec<String> {
        self.core
            .coordinator()
            .hisparse()
            .map(|h| h.request_states().map(|(rid, _)| rid.to_owned()).collect())
            .unwrap_or_default()
    }

    /// `request_states[request_id]` as a dict (None if absent); `state_id` names
    /// the state object (pending spills refer to it).
    fn core_hisparse_request_state<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Option<(u32, Bound<'py, PyDict>)>> {
        let Some(h) = self.core.coordinator().hisparse() else {
            return Ok(None);
        };
        let Some(id) = h.request_state_id(request_id) else {
            return Ok(None);
        };
        match h.state(id) {
            Some(s) => Ok(Some((id, state_dict(py, s)?))),
            None => Ok(None),
        }
    }

    /// The state of slab entry `state_id` as a dict (None if gone).
    fn core_hisparse_state<'py>(
        &self,
        py: Python<'py>,
        state_id: u32,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self
            .core
            .coordinator()
            .hisparse()
            .and_then(|h| h.state(state_id))
        else {
            return Ok(None);
        };
        Ok(Some(state_dict(py, s)?))
    }

    /// `pending_spills` in order: `(transfer_id, request_id, page, state_id,
    /// host_block, resident_blocks, restore, expected_worker_completions,
    /// worker_completions, enqueue_applied)`.
    #[allow(clippy::type_complexity)]
    fn core_hisparse_pending_spills(
        &self,
    ) -> Vec<(
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
    )> {
        self.core
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
    }

    /// `spills_to_send` (not drained), as `build_offload_command`'s tuples.
    #[allow(clippy::type_complexity)]
    fn core_hisparse_spills_to_send(&self) -> Vec<(u64, BlockId, Vec<BlockId>, bool, bool)> {
        self.core
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
    }

    /// The request of HiSparse publication `publication` (None if gone).
    fn core_hisparse_publication_request(
        &self,
        py: Python<'_>,
        publication: u64,
    ) -> Option<Py<PyAny>> {
        self.publications.get(&publication).map(|r| r.clone_ref(py))
    }

    /// The rest of the coordinator's state: `copies` `[(key bytes, [block ids])]`,
    /// `copy_by_block` `[(block, key bytes)]`, `owners` `[(block, [(request, page)])]`,
    /// `retained_copies` `[(dst, src, dst)]`, `pending_imports` `[(request, tokens)]`,
    /// `resident_requests`, `next_spill_id`.
    fn core_hisparse_tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let Some(h) = self.core.coordinator().hisparse() else {
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
    }

    // ---- resident and hot managers --------------------------------------------------

    /// vLLM's `get_resident_page` of resident group `g`.
    fn core_resident_page(
        &self,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let page = count("block_idx", page)?;
        let m = resident(&self.core, g)?;
        let table = self.core.get_blocks(request_id, g);
        Ok(m.get_resident_page(request_id, table, page))
    }

    /// vLLM's `get_residency_row(request_id, start)` of resident group `g` (ids).
    fn core_residency_row(&self, g: usize, request_id: &str, start: i64) -> PyResult<Vec<BlockId>> {
        let start = count("start", start)?;
        let m = resident(&self.core, g)?;
        let mut out = Vec::new();
        m.residency_row(
            request_id,
            self.core.get_blocks(request_id, g),
            start,
            &mut out,
        );
        Ok(out)
    }

    /// vLLM's `adopt_resident_page` of resident group `g`.
    fn core_adopt_resident_page(
        slf: &Bound<'_, Self>,
        g: usize,
        request_id: &str,
        page: i64,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
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
    fn core_drop_resident_page(
        &mut self,
        g: usize,
        request_id: &str,
        page: i64,
    ) -> PyResult<Option<BlockId>> {
        let page = count("block_idx", page)?;
        Ok(self.core.hisparse_call(|_, ctx| {
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
    fn core_residency_changes(&self, g: usize) -> PyResult<Vec<(String, Vec<(usize, BlockId)>)>> {
        let m = resident(&self.core, g)?;
        Ok(m.requests_with_changes()
            .map(|rid| {
                let changes = m
                    .residency_changes(rid)
                    .map(|c| c.iter().map(|(&p, &b)| (p, b)).collect())
                    .unwrap_or_default();
                (rid.to_owned(), changes)
            })
            .collect())
    }

    /// vLLM's `require_hot` of hot group `g`.
    fn core_hot_require(&mut self, g: usize, request_id: &str) -> PyResult<()> {
        Ok(self.core.hisparse_call(|_, ctx| {
            ctx.managers[g]
                .hisparse_hot_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("group {g} is not hot")))?
                .require_hot(request_id);
            Ok(())
        })?)
    }

    /// `hot_required` of hot group `g`.
    fn core_hot_required(&self, g: usize) -> PyResult<Vec<String>> {
        let m = self
            .core
            .coordinator()
            .managers()
            .get(g)
            .and_then(|m| m.hisparse_hot())
            .ok_or_else(|| InvalidArgumentError::new_err(format!("group {g} is not hot")))?;
        Ok(m.hot_required().map(str::to_owned).collect())
    }

    /// One group's `allocate_new_blocks` (vLLM code may call a manager directly):
    /// the new block ids.
    fn core_group_allocate_new_blocks(
        slf: &Bound<'_, Self>,
        g: usize,
        request_id: &str,
        num_tokens: i64,
        num_tokens_main_model: i64,
    ) -> PyResult<Vec<BlockId>> {
        let n = count("num_tokens", num_tokens)?;
        let main = count("num_tokens_main_model", num_tokens_main_model)?;
        let out = slf
            .try_borrow_mut()?
            .core
            .group_allocate_new_blocks(g, request_id, n, main)?;
        Self::flush(slf, None)?;
        Ok(out)
    }

    /// One group's `get_num_blocks_to_allocate` (vLLM code may call a manager
    /// directly); `new_computed_blocks` are handles of the group's pool.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (g, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
        num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=false,
        prefill_end=0))]
    fn core_group_num_blocks_to_allocate(
        slf: &Bound<'_, Self>,
        g: usize,
        request_id: &str,
        num_tokens: i64,
        new_computed_blocks: &Bound<'_, PyAny>,
        total_computed_tokens: i64,
        num_local_computed_tokens: i64,
        num_tokens_main_model: i64,
        apply_admission_cap: bool,
        prefill_end: i64,
    ) -> PyResult<i64> {
        let host = slf.try_borrow()?.core.host_group() == Some(g);
        let mut hits = Vec::new();
        ids_in(slf, new_computed_blocks, host, &mut hits)?;
        let q = NumBlocksQuery {
            request_id,
            num_tokens: count("num_tokens", num_tokens)?,
            new_computed_blocks: &hits,
            total_computed_tokens: count("total_computed_tokens", total_computed_tokens)?,
            num_local_computed_tokens: count(
                "num_local_computed_tokens",
                num_local_computed_tokens,
            )?,
            num_tokens_main_model: count("num_tokens_main_model", num_tokens_main_model)?,
            apply_admission_cap,
            prefill_end: count("prefill_end", prefill_end)?,
        };
        Ok(slf
            .try_borrow_mut()?
            .core
            .group_num_blocks_to_allocate(g, &q)?)
    }

    // ---- the host pool ----------------------------------------------------------------

    /// The host pool's block count (null block included).
    fn core_host_num_blocks(&self) -> u32 {
        self.core.host_pool().map_or(0, |p| p.num_gpu_blocks())
    }

    /// The host pool's free blocks.
    fn core_host_num_free_blocks(&self) -> usize {
        self.core.host_pool().map_or(0, |p| p.get_num_free_blocks())
    }

    /// The host pool's usage.
    fn core_host_usage(&self) -> f64 {
        self.core.host_pool().map_or(0.0, |p| p.get_usage())
    }

    /// The handle of host block `block_id`.
    fn core_host_block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<Py<PyKVCacheBlock>> {
        let mut this = slf.try_borrow_mut()?;
        let id = host_pool(&this.core)?.check_block_id(block_id)?;
        Self::pool_handle(slf, &mut this, id, true)
    }

    /// Host free block ids, head first.
    fn core_host_free_block_ids(&self) -> PyResult<Vec<BlockId>> {
        Ok(host_pool(&self.core)?
            .free_block_queue()
            .get_all_free_blocks())
    }

    /// The host pool's `get_new_blocks`.
    fn core_host_get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = count("num_blocks", num_blocks)?;
        let list = {
            let mut this = slf.try_borrow_mut()?;
            let mut ids = Vec::new();
            this.core
                .host_pool_call(|pool| pool.get_new_blocks(n, &mut ids))?;
            Self::pool_handles_list(slf, &mut this, &ids, true)?
        };
        Self::flush(slf, None)?;
        Ok(list)
    }

    /// The host pool's `free_blocks` (handles of the host pool).
    fn core_host_free_blocks(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        ids_in(slf, blocks, true, &mut ids)?;
        slf.try_borrow_mut()?
            .core
            .host_pool_call(|pool| pool.free_blocks(&ids))?;
        Self::flush(slf, None)
    }

    /// The host pool's `touch`.
    fn core_host_touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        ids_in(slf, blocks, true, &mut ids)?;
        slf.try_borrow_mut()?
            .core
            .host_pool_call(|pool| pool.touch(&ids))?;
        Self::flush(slf, None)
    }

    /// The host pool's `evict_blocks`.
    fn core_host_evict_blocks(slf: &Bound<'_, Self>, block_ids: Vec<i64>) -> PyResult<()> {
        slf.try_borrow_mut()?
            .core
            .host_pool_call(|pool| pool.evict_blocks(&block_ids))?;
        Self::flush(slf, None)
    }

    /// The host pool's `reset_prefix_cache`.
    fn core_host_reset_prefix_cache(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let ok = slf
            .try_borrow_mut()?
            .core
            .host_pool_call(|pool| Ok(pool.reset_prefix_cache()))?;
        Self::flush(slf, None)?;
        Ok(ok)
    }

    /// The host pool's first-inserted block cached under `(block_hash, group_id)`.
    fn core_host_get_cached_block(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        group_id: u32,
    ) -> PyResult<Option<Py<PyKVCacheBlock>>> {
        let hash = super::convert::hashes::hash_from_bytes(block_hash)?;
        let mut this = slf.try_borrow_mut()?;
        match host_pool(&this.core)?.get_cached_block(&hash, group_id) {
            Some(id) => Ok(Some(Self::pool_handle(slf, &mut this, id, true)?)),
            None => Ok(None),
        }
    }

    /// The host pool's index keys: `[(key bytes, [block ids])]`.
    fn core_host_index_items<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Bound<'py, PyBytes>, Vec<BlockId>)>> {
        Ok(host_pool(&self.core)?
            .cached_block_hash_to_block()
            .iter()
            .map(|(k, blocks)| (PyBytes::new(py, &k.to_vllm_bytes()), blocks))
            .collect())
    }

    /// Every request's table of group `g`, for `req_to_blocks` views: ids.
    fn core_group_tables(&self, g: usize) -> Vec<(String, Vec<BlockId>, Option<usize>)> {
        self.core
            .coordinator()
            .request_tables(g)
            .map(|(rid, gb): (&str, &GroupBlocks)| {
                (rid.to_owned(), gb.blocks.clone(), gb.num_cached_block)
            })
            .collect()
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

fn host_pool(core: &crate::manager::KVCacheManager) -> PyResult<&crate::pool::BlockPool> {
    core.host_pool()
        .ok_or_else(|| InvalidArgumentError::new_err("this KV-cache layout has no host pool"))
}
