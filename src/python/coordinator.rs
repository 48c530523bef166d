//! `KVCacheCoordinatorCore`: the coordinator of a `KVCacheCore` and its
//! single-type managers, for the Python coordinator and manager views
//! (`python/hscache/vllm/views.py`: `kv_cache_manager.coordinator`,
//! `.single_type_managers[g]`): what the Scheduler, connectors and vLLM's tests
//! read or call there, and one group's calls that vLLM code makes on a manager
//! directly (`group_allocate_new_blocks`, `group_num_blocks_to_allocate`).
//!
//! The class holds its owner (`Py<KVCacheCore>`) and borrows it per call, as
//! `BlockPoolCore` does (`pool.rs`). Conversion only: every value comes from the
//! core's coordinator and managers.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use pyo3::PyTraverseError;

use super::convert::blocks::{id_of, ids_in};
use super::convert::count;
use super::convert::hashes::PyListHashes;
use super::manager::PyKVCacheCore;
use crate::manager::single_type::NumBlocksQuery;
use crate::manager::{GroupedBlockIds, KVCacheCoordinator, NumBlocksToAllocate};
use crate::types::BlockId;

impl PyKVCacheCore {
    fn coordinator(&self) -> &KVCacheCoordinator {
        self.core.coordinator()
    }

    fn check_group(&self, g: usize) -> PyResult<()> {
        if g >= self.core.num_kv_cache_groups() {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "KV-cache group {g} out of range"
            )));
        }
        Ok(())
    }

    /// The request ids a slot-keyed map names, with their values.
    fn by_request<T: Copy>(&self, entries: impl Iterator<Item = (u32, T)>) -> Vec<(String, T)> {
        entries
            .filter_map(|(slot, v)| {
                let id = self.coordinator().requests.key_of_slot(slot)?;
                Some((id.to_owned(), v))
            })
            .collect()
    }
}

/// The token counts of both `get_num_blocks_to_allocate` forms (the coordinator's and
/// one group's), checked non-negative.
struct AllocationCounts {
    num_tokens: usize,
    total_computed_tokens: usize,
    num_local_computed_tokens: usize,
    num_tokens_main_model: usize,
    prefill_end: usize,
}

impl AllocationCounts {
    fn read(
        num_tokens: i64,
        total_computed_tokens: i64,
        num_local_computed_tokens: i64,
        num_tokens_main_model: i64,
        prefill_end: i64,
    ) -> PyResult<Self> {
        Ok(Self {
            num_tokens: count("num_tokens", num_tokens)?,
            total_computed_tokens: count("total_computed_tokens", total_computed_tokens)?,
            num_local_computed_tokens: count(
                "num_local_computed_tokens",
                num_local_computed_tokens,
            )?,
            num_tokens_main_model: count("num_tokens_main_model", num_tokens_main_model)?,
            prefill_end: count("prefill_end", prefill_end)?,
        })
    }
}

#[pyclass(name = "KVCacheCoordinatorCore", module = "hscache._core", frozen)]
pub struct PyKVCacheCoordinatorCore {
    /// The manager whose coordinator this is (borrowed per call).
    owner: Py<PyKVCacheCore>,
}

#[pymethods]
impl PyKVCacheCoordinatorCore {
    /// The coordinator of `owner`.
    #[new]
    fn new(owner: &Bound<'_, PyKVCacheCore>) -> Self {
        Self {
            owner: owner.clone().unbind(),
        }
    }

    /// The HiSparse layout (None without one; see `HiSparseCore.layout`).
    #[pyo3(signature = () -> "dict[str, Any] | None")]
    fn hisparse_layout<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        super::hisparse::layout(py, &self.owner.bind(py).try_borrow()?.core)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.owner)
    }

    /// The coordinator's settings: `{kind, scheduler_block_size, hash_block_size,
    /// num_reprefillable_tokens, retention_interval, enable_partial_hash_hits,
    /// eagle_group_ids, drop_eagle_group_ids, full_attention_group_id,
    /// cache_hit_alignment_tokens, attention_groups, mamba_shared_prefix_checkpoint}`.
    #[pyo3(signature = () -> "dict[str, Any]")]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let this = self.owner.bind(py).try_borrow()?;
        let c = this.coordinator();
        let d = PyDict::new(py);
        d.set_item("kind", format!("{:?}", c.kind()))?;
        d.set_item("scheduler_block_size", c.scheduler_block_size())?;
        d.set_item("hash_block_size", c.hash_block_size())?;
        d.set_item("num_reprefillable_tokens", c.num_reprefillable_tokens())?;
        d.set_item("retention_interval", c.retention_interval())?;
        d.set_item("enable_partial_hash_hits", c.enable_partial_hash_hits())?;
        d.set_item("eagle_group_ids", c.eagle_group_ids().to_vec())?;
        d.set_item("drop_eagle_group_ids", c.drop_eagle_group_ids().to_vec())?;
        d.set_item("full_attention_group_id", c.full_attention_group_id())?;
        d.set_item("cache_hit_alignment_tokens", c.cache_hit_alignment_tokens())?;
        let groups: Vec<(Vec<u32>, bool)> = c
            .attention_groups()
            .iter()
            .map(|g| (g.group_ids.to_vec(), g.use_eagle))
            .collect();
        d.set_item("attention_groups", groups)?;
        d.set_item(
            "mamba_shared_prefix_checkpoint",
            this.core.mamba_shared_prefix_checkpoint(),
        )?;
        Ok(d)
    }

    /// Group `g`'s manager settings: `{block_size, use_eagle, records_new_block_ids,
    /// cache_hit_alignment_tokens, dcp_world_size, pcp_world_size,
    /// drop_eagle_checkpoint_block, shared_prefix_checkpoint}`.
    #[pyo3(signature = (g: "int") -> "dict[str, Any]")]
    fn group_info<'py>(&self, py: Python<'py>, g: usize) -> PyResult<Bound<'py, PyDict>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.check_group(g)?;
        let m = this.coordinator().manager(g);
        let b = m.base();
        let d = PyDict::new(py);
        d.set_item("block_size", b.block_size)?;
        d.set_item("use_eagle", b.use_eagle)?;
        d.set_item("records_new_block_ids", b.record_new_block_ids)?;
        d.set_item("cache_hit_alignment_tokens", b.cache_hit_alignment_tokens)?;
        d.set_item("dcp_world_size", b.dcp_world_size)?;
        d.set_item("pcp_world_size", b.pcp_world_size)?;
        d.set_item("shared_prefix_checkpoint", b.shared_prefix_checkpoint)?;
        d.set_item(
            "drop_eagle_checkpoint_block",
            m.mamba().is_some_and(|x| x.drop_eagle_checkpoint_block),
        )?;
        Ok(d)
    }

    /// Ids of the requests that hold state.
    fn request_ids(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let this = self.owner.bind(py).try_borrow()?;
        Ok({
            this.coordinator()
                .requests
                .iter()
                .map(|(k, _)| k.to_owned())
                .collect()
        })
    }

    /// The request's table in group `g` as block handles (None if the request is
    /// unknown).
    #[pyo3(signature = (request_id, g: "int") -> "list[KVCacheBlock] | None")]
    fn group_blocks<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        g: usize,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let slf = self.owner.bind(py);
        let mut this = slf.try_borrow_mut()?;
        this.check_group(g)?;
        if this.coordinator().request(request_id).is_none() {
            return Ok(None);
        }
        let ids = this.core.get_blocks(request_id, g).to_vec();
        let host = this.core.host_group() == Some(g);
        PyKVCacheCore::pool_handles_list(slf, &mut this, &ids, host).map(Some)
    }

    /// The request's `num_cached_block` in group `g` (None if it has none).
    #[pyo3(signature = (request_id, g: "int"))]
    fn num_cached_block(
        &self,
        py: Python<'_>,
        request_id: &str,
        g: usize,
    ) -> PyResult<Option<usize>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.check_group(g)?;
        Ok(this
            .coordinator()
            .request(request_id)
            .and_then(|s| s.groups.get(g))
            .and_then(|gb| gb.num_cached_block))
    }

    /// Group `g`'s partial hits awaiting copy-on-write: `{request_id: (block_idx,
    /// block)}` (vLLM's `_partial_hit_reqs`).
    #[pyo3(signature = (g: "int") -> "dict[str, tuple[int, KVCacheBlock]]")]
    fn partial_hit_reqs<'py>(&self, py: Python<'py>, g: usize) -> PyResult<Bound<'py, PyDict>> {
        let slf = self.owner.bind(py);
        let entries: Vec<(String, usize, BlockId)> = {
            let this = slf.try_borrow()?;
            this.check_group(g)?;
            this.coordinator()
                .requests
                .iter()
                .filter_map(|(k, s)| {
                    let (idx, b) = s.groups.get(g)?.partial_hit?;
                    Some((k.to_owned(), idx, b))
                })
                .collect()
        };
        let d = PyDict::new(py);
        let mut this = slf.try_borrow_mut()?;
        let host = this.core.host_group() == Some(g);
        for (rid, idx, b) in entries {
            d.set_item(
                rid,
                (idx, PyKVCacheCore::pool_handle(slf, &mut this, b, host)?),
            )?;
        }
        Ok(d)
    }

    /// Group `g`'s Mamba "align" state: `{checkpoints: {rid: (position, idx)},
    /// last_state_block_idx: {rid: idx}, allocated: [rid], cached_this_step:
    /// [key bytes]}`; None for other groups.
    #[pyo3(signature = (g: "int") -> "dict[str, Any] | None")]
    fn mamba_state<'py>(&self, py: Python<'py>, g: usize) -> PyResult<Option<Bound<'py, PyDict>>> {
        let this = self.owner.bind(py).try_borrow()?;
        this.check_group(g)?;
        let Some(m) = this.coordinator().manager(g).mamba() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        let checkpoints = PyDict::new(py);
        let entries = || m.align_requests();
        for (rid, v) in this.by_request(entries().filter_map(|(s, r)| Some((s, r.checkpoint?)))) {
            checkpoints.set_item(rid, v)?;
        }
        d.set_item("checkpoints", checkpoints)?;
        let last = PyDict::new(py);
        let last_idx = entries().filter_map(|(s, r)| Some((s, r.last_state_block_idx?)));
        for (rid, v) in this.by_request(last_idx) {
            last.set_item(rid, v)?;
        }
        d.set_item("last_state_block_idx", last)?;
        let allocated: Vec<String> = this
            .by_request(entries().filter(|(_, r)| r.allocated).map(|(s, _)| (s, ())))
            .into_iter()
            .map(|(r, ())| r)
            .collect();
        d.set_item("allocated", allocated)?;
        let cached: Vec<Bound<'py, PyBytes>> = m
            .cached_blocks_this_step
            .iter()
            .map(|k| PyBytes::new(py, &k.to_vllm_bytes()))
            .collect();
        d.set_item("cached_this_step", cached)?;
        Ok(Some(d))
    }

    /// Sets the coordinator's `retention_interval` (None: dense retention).
    #[pyo3(signature = (retention_interval: "int | None"))]
    fn set_retention_interval(
        &self,
        py: Python<'_>,
        retention_interval: Option<i64>,
    ) -> PyResult<()> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        let r = retention_interval
            .map(|r| count("retention_interval", r))
            .transpose()?;
        Ok(this.core.set_retention_interval(r)?)
    }

    /// Sets group `g`'s `use_eagle`.
    #[pyo3(signature = (g: "int", use_eagle))]
    fn set_group_use_eagle(&self, py: Python<'_>, g: usize, use_eagle: bool) -> PyResult<()> {
        let mut this = self.owner.bind(py).try_borrow_mut()?;
        this.check_group(g)?;
        Ok(this.core.set_group_use_eagle(g, use_eagle)?)
    }

    /// Queues a copy-on-write pair on group `g` (vLLM code appends to a manager's
    /// `_pending_cow_copies`).
    #[pyo3(signature = (g: "int", source: "KVCacheBlock", copy: "KVCacheBlock"))]
    fn push_cow_copy(
        &self,
        py: Python<'_>,
        g: usize,
        source: &Bound<'_, PyAny>,
        copy: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let slf = self.owner.bind(py);
        let (s, d) = (id_of(slf, source)?, id_of(slf, copy)?);
        let mut this = slf.try_borrow_mut()?;
        this.check_group(g)?;
        this.core.push_cow_copy(g, (s, d))?;
        Ok(())
    }

    /// vLLM's `coordinator.get_num_blocks_to_allocate` (may be negative with Mamba
    /// "align", as in vLLM).
    #[pyo3(signature = (request_id, num_tokens: "int", new_computed_blocks: "Iterable[Iterable[KVCacheBlock]]", num_encoder_tokens: "int", total_computed_tokens: "int", num_local_computed_tokens: "int", num_tokens_main_model: "int", apply_admission_cap=false, prefill_end: "int"=0))]
    #[allow(clippy::too_many_arguments)]
    fn get_num_blocks_to_allocate(
        &self,
        py: Python<'_>,
        request_id: &str,
        num_tokens: i64,
        new_computed_blocks: &Bound<'_, PyAny>,
        num_encoder_tokens: i64,
        total_computed_tokens: i64,
        num_local_computed_tokens: i64,
        num_tokens_main_model: i64,
        apply_admission_cap: bool,
        prefill_end: i64,
    ) -> PyResult<i64> {
        let slf = self.owner.bind(py);
        let c = AllocationCounts::read(
            num_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            prefill_end,
        )?;
        let mut hits = GroupedBlockIds::new();
        let host_group = slf.try_borrow()?.core.host_group();
        for (g, group) in new_computed_blocks.try_iter()?.enumerate() {
            let open = hits.open_group_mut();
            super::convert::blocks::ids_in(slf, &group?, host_group == Some(g), open)?;
            hits.end_group();
        }
        let mut this = slf.try_borrow_mut()?;
        Ok(this
            .core
            .coordinator_num_blocks_to_allocate(&NumBlocksToAllocate {
                request_id,
                num_tokens: c.num_tokens,
                hits: hits.view(),
                num_encoder_tokens: count("num_encoder_tokens", num_encoder_tokens)?,
                total_computed_tokens: c.total_computed_tokens,
                num_local_computed_tokens: c.num_local_computed_tokens,
                num_tokens_main_model: c.num_tokens_main_model,
                apply_admission_cap,
                prefill_end: c.prefill_end,
            })?)
    }

    /// vLLM's `coordinator.find_longest_cache_hit(block_hashes,
    /// max_cache_hit_length)`: `(blocks per group, hit, uncached common prefix)`.
    #[pyo3(signature = (block_hashes: "list[bytes]", max_cache_hit_length: "int") -> "tuple[tuple[list[KVCacheBlock], ...], int, int]")]
    fn find_longest_cache_hit<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: i64,
    ) -> PyResult<(Bound<'py, PyTuple>, usize, usize)> {
        let slf = self.owner.bind(py);
        let max_len = count("max_cache_hit_length", max_cache_hit_length)?;
        let hashes = PyListHashes::new(block_hashes)?;
        let mut this = slf.try_borrow_mut()?;
        let mut groups = vec![Vec::new(); this.core.num_kv_cache_groups()];
        let (hit, uncached) =
            this.coordinator()
                .find_longest_cache_hit(&hashes, max_len, &mut groups)?;
        let host_group = this.core.host_group();
        let lists = groups
            .iter()
            .enumerate()
            .map(|(g, ids)| {
                PyKVCacheCore::pool_handles_list(slf, &mut this, ids, host_group == Some(g))
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok((PyTuple::new(slf.py(), lists)?, hit, uncached))
    }

    /// vLLM's `coordinator.find_longest_cache_hit_per_group`: `(blocks per group,
    /// hit length per group)`.
    #[pyo3(signature = (block_hashes: "list[bytes]", max_cache_hit_length: "int") -> "tuple[tuple[list[KVCacheBlock], ...], list[int]]")]
    fn find_longest_cache_hit_per_group<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: i64,
    ) -> PyResult<(Bound<'py, PyTuple>, Vec<usize>)> {
        let slf = self.owner.bind(py);
        let max_len = count("max_cache_hit_length", max_cache_hit_length)?;
        let hashes = PyListHashes::new(block_hashes)?;
        let mut this = slf.try_borrow_mut()?;
        let n = this.core.num_kv_cache_groups();
        let mut groups = vec![Vec::new(); n];
        let mut lengths = vec![0usize; n];
        this.coordinator().find_longest_cache_hit_per_group(
            &hashes,
            max_len,
            &mut groups,
            &mut lengths,
        )?;
        let host_group = this.core.host_group();
        let lists = groups
            .iter()
            .enumerate()
            .map(|(g, ids)| {
                PyKVCacheCore::pool_handles_list(slf, &mut this, ids, host_group == Some(g))
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok((PyTuple::new(slf.py(), lists)?, lengths))
    }

    /// One group's `allocate_new_blocks` (vLLM code may call a manager directly):
    /// the new block ids.
    #[pyo3(signature = (g: "int", request_id, num_tokens: "int", num_tokens_main_model: "int"))]
    fn group_allocate_new_blocks(
        &self,
        py: Python<'_>,
        g: usize,
        request_id: &str,
        num_tokens: i64,
        num_tokens_main_model: i64,
    ) -> PyResult<Vec<BlockId>> {
        let slf = self.owner.bind(py);
        let n = count("num_tokens", num_tokens)?;
        let main = count("num_tokens_main_model", num_tokens_main_model)?;
        let out = slf
            .try_borrow_mut()?
            .core
            .group_allocate_new_blocks(g, request_id, n, main)?;
        PyKVCacheCore::flush(slf, None)?;
        Ok(out)
    }

    /// One group's `get_num_blocks_to_allocate` (vLLM code may call a manager
    /// directly); `new_computed_blocks` are handles of the group's pool.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (g: "int", request_id, num_tokens: "int", new_computed_blocks: "Iterable[KVCacheBlock]", total_computed_tokens: "int", num_local_computed_tokens: "int", num_tokens_main_model: "int", apply_admission_cap=false, prefill_end: "int"=0))]
    fn group_num_blocks_to_allocate(
        &self,
        py: Python<'_>,
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
        let slf = self.owner.bind(py);
        let host = slf.try_borrow()?.core.host_group() == Some(g);
        let mut hits = Vec::new();
        ids_in(slf, new_computed_blocks, host, &mut hits)?;
        let c = AllocationCounts::read(
            num_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            prefill_end,
        )?;
        let q = NumBlocksQuery {
            request_id,
            num_tokens: c.num_tokens,
            new_computed_blocks: &hits,
            total_computed_tokens: c.total_computed_tokens,
            num_local_computed_tokens: c.num_local_computed_tokens,
            num_tokens_main_model: c.num_tokens_main_model,
            apply_admission_cap,
            prefill_end: c.prefill_end,
        };
        Ok(slf
            .try_borrow_mut()?
            .core
            .group_num_blocks_to_allocate(g, &q)?)
    }
}
