"""Views of HiSparse's coordinator, managers and host pool, served by the core.

vLLM 0.33's HiSparse connector binds its scheduler side with
``get_hisparse_coordinator(kv_cache_manager)``, which returns the ``coordinator`` of
the first single-type manager that has one. hscache's core builds HiSparse's
coordinator (``src/manager/hisparse/``) with the manager, so the HiSparse manager
views carry a :class:`HiSparseCoordinatorView` there: an instance of a subclass of
vLLM's own ``HiSparseCoordinator`` whose methods call the core and whose attributes
(``request_states``, ``pending_spills``, ``copies``, ...) are snapshots of the
core's state, built as vLLM's objects (``_HiSparseRequestState``,
``SparseKVPageTransfer``, ...) when read. Assigning ``max_spill_pages`` or
``transition_watermark`` sets them in the core; mutating a snapshot changes nothing.

The manager mixins (:class:`SourceView`, :class:`ResidentView`, :class:`HotView`)
add what vLLM code calls on a HiSparse manager directly. :class:`HostBlockPool` is
the source group's ``block_pool``: vLLM's host ``SharedEventQueueBlockPool`` (medium
CPU), whose events share the device pool's queue; it is the core's pool class
(``BlockPoolCore``) addressing the host pool, so every pool rule (``is_block_writable``
included) is the core's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, KVCacheEvent
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.hisparse import coordinator as _vllm_hisparse
from vllm.v1.hisparse import types as _hisparse_types
from vllm.v1.hisparse.types import (
    SparseKVOffloadCommand,
    SparseKVPageTransfer,
    SparseKVRowMirror,
)

from hscache._core import BlockPoolCore, HiSparseCore, KVCacheBlock
from hscache.vllm.block_pool import BlockList, FreeKVCacheBlockQueue

# The views read an ``hscache.vllm.KVCacheManager``; ``Any`` keeps this module free of
# an import of the module that imports it.
KVCacheManager = Any


class HostBlockPool:
    """HiSparse's host pool (vLLM's ``SharedEventQueueBlockPool``, medium CPU): the
    core's pool class addressing the host pool, with the device pool's views of its
    parts (``blocks``, ``free_block_queue``)."""

    def __init__(self, core: KVCacheManager, enable_caching: bool) -> None:
        self.pool_core = pool = BlockPoolCore(core, host=True)
        device = core.block_pool
        self.num_gpu_blocks = pool.num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = device.hash_block_size
        self.enable_kv_cache_events = device.enable_kv_cache_events
        self.num_hash_lookahead_tokens = device.num_hash_lookahead_tokens
        self.medium = MEDIUM_CPU
        # The host pool records no block-metrics calls (see src/manager/hisparse/source.rs).
        self.metrics_collector = None
        self.blocks = BlockList(pool)
        self.null_block = pool.block(0)
        self.free_block_queue = FreeKVCacheBlockQueue(pool)
        self._event_owner = device

    @property
    def kv_event_queue(self) -> list[KVCacheEvent]:
        """The device pool's queue, which this pool publishes into."""
        queue: list[KVCacheEvent] = self._event_owner.kv_event_queue
        return queue

    def get_num_free_blocks(self) -> int:
        return self.pool_core.num_free_blocks

    def get_usage(self) -> float:
        return self.pool_core.usage

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        return self.pool_core.get_new_blocks(num_blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        self.pool_core.free_blocks(list(ordered_blocks))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.pool_core.touch(list(blocks))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.pool_core.evict_blocks(list(block_ids))

    def reset_prefix_cache(self) -> bool:
        return self.pool_core.reset_prefix_cache()

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        cached = []
        for group_id in kv_cache_group_ids:
            block = self.pool_core.get_cached_block(block_hash, group_id)
            if block is None:
                return None
            cached.append(block)
        return cached

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        return self.pool_core.is_block_writable(block)


# ---- manager mixins -------------------------------------------------------------------


class _GroupView:
    """One HiSparse group's allocation calls, shared by the source, resident and hot views."""

    _manager: KVCacheManager
    # The core's coordinator (``KVCacheCoordinatorCore``), set by the manager view.
    _core: Any
    kv_cache_group_id: int

    def _block(self, block_id: int) -> Any:
        return self._manager.block_pool.pool_core.block(block_id)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Any],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return int(
            self._core.group_num_blocks_to_allocate(
                self.kv_cache_group_id,
                request_id,
                num_tokens,
                list(new_computed_blocks),
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
                prefill_end,
            )
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[Any]:
        ids = self._core.group_allocate_new_blocks(
            self.kv_cache_group_id, request_id, num_tokens, num_tokens_main_model
        )
        return [self._block(i) for i in ids]


class SourceView(_GroupView):
    """What vLLM code calls on ``HiSparseSourceManager`` directly."""

    # The HiSparse coordinator view (vLLM's managers carry theirs here).
    coordinator: Any = None

    def take_new_block_ids(self) -> list[int]:
        return []

    def take_pending_cow_copies(self) -> list[tuple[Any, Any]]:
        """Host copies never reach the worker's generic block-copy path."""
        return []

    def _block(self, block_id: int) -> Any:
        return self._manager.host_block_pool.pool_core.block(block_id)


class _AuxiliaryView(_GroupView):
    """Shared by the resident and hot views (vLLM's ``_HiSparseAuxiliaryManager``)."""

    coordinator: Any = None

    @property
    def _hisparse(self) -> HiSparseCore:
        """The core's HiSparse coordinator (``HiSparseCore``), through its view."""
        core: HiSparseCore = self.coordinator.hisparse_core
        return core


class ResidentView(_AuxiliaryView):
    """What vLLM code calls on ``HiSparseResidentManager`` directly."""

    @property
    def max_admission_blocks_per_request(self) -> int:
        info = self._core.group_info(self.kv_cache_group_id)
        return int(info["max_admission_blocks_per_request"])

    @property
    def residency_changes(self) -> dict[str, dict[int, Any]]:
        block = self._manager.block_pool.pool_core.block
        return {
            rid: {page: block(b) for page, b in changes}
            for rid, changes in self._hisparse.residency_changes(self.kv_cache_group_id)
        }

    def get_resident_page(self, request_id: str, block_idx: int) -> Any:
        b = self._hisparse.get_resident_page(self.kv_cache_group_id, request_id, block_idx)
        return None if b is None else self._manager.block_pool.pool_core.block(b)

    def get_residency_row(self, request_id: str, start: int = 0) -> list[Any]:
        block = self._manager.block_pool.pool_core.block
        ids = self._hisparse.get_residency_row(self.kv_cache_group_id, request_id, start)
        return [block(b) for b in ids]

    def adopt_resident_page(self, request_id: str, block_idx: int, block: Any) -> bool:
        return bool(
            self._hisparse.adopt_resident_page(self.kv_cache_group_id, request_id, block_idx, block)
        )

    def drop_resident_page(self, request_id: str, block_idx: int) -> Any:
        b = self._hisparse.drop_resident_page(self.kv_cache_group_id, request_id, block_idx)
        return None if b is None else self._manager.block_pool.pool_core.block(b)


class HotView(_AuxiliaryView):
    """What vLLM code calls on ``HiSparseHotManager`` directly."""

    @property
    def blocks_per_request(self) -> int:
        return int(self.kv_cache_spec.blocks_per_request)  # type: ignore[attr-defined]

    @property
    def hot_required(self) -> set[str]:
        return set(self._hisparse.hot_required(self.kv_cache_group_id))

    def require_hot(self, request_id: str) -> None:
        self._hisparse.require_hot(self.kv_cache_group_id, request_id)

    def has_hot(self, request_id: str) -> bool:
        blocks = self._manager.get_block_ids(request_id)[self.kv_cache_group_id]
        return len(blocks) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        blocks = self._manager.get_block_ids(request_id)[self.kv_cache_group_id]
        return max(self.blocks_per_request - len(blocks), 0)


# ---- the coordinator ------------------------------------------------------------------


class HiSparseCoordinatorView:
    """``get_hisparse_coordinator(manager)`` (see module docs)."""

    def __init__(self, manager: KVCacheManager, managers: tuple[Any, ...]) -> None:
        self._manager = manager
        # The core's HiSparse coordinator; the resident and hot views call it too.
        self.hisparse_core = core = HiSparseCore(manager)
        layout = core.layout()
        self.managers = managers
        self.max_model_len = manager.max_model_len
        self.num_reprefillable_tokens: int = layout["num_reprefillable_tokens"]
        self.resident_managers = tuple(managers[g] for g in layout["resident_groups"])
        self.hot_managers = tuple(managers[g] for g in layout["hot_groups"])
        self.host_group_id: int | None = layout["host_group"]
        self.host_manager = managers[layout["host_group"]]
        self.has_host_cache = True
        self.gpu_pool = manager.block_pool if self.resident_managers else None

    # -- settable configuration ----------------------------------------------------------

    @property
    def max_spill_pages(self) -> int:
        return int(self.hisparse_core.layout()["max_spill_pages"])

    @max_spill_pages.setter
    def max_spill_pages(self, value: int) -> None:
        self.hisparse_core.set("max_spill_pages", value)

    @property
    def transition_watermark(self) -> int:
        return int(self.hisparse_core.layout()["transition_watermark"])

    @transition_watermark.setter
    def transition_watermark(self, value: int) -> None:
        self.hisparse_core.set("transition_watermark", value)

    # -- state snapshots -----------------------------------------------------------------

    def _state(self, data: dict[str, Any]) -> Any:
        state = _vllm_hisparse._HiSparseRequestState(
            valid_pages=set(data["valid_pages"]),
            ready_prefix_pages=data["ready_prefix_pages"],
            pending_pages=dict(data["pending_pages"]),
            copies_recorded_blocks=data["copies_recorded_blocks"],
            pinned_clean=set(data["pinned_clean"]),
            unpinned_pages=set(data["unpinned_pages"]),
            pages_to_adopt=data["pages_to_adopt"],
            synced_pages=data["synced_pages"],
            stale_pages=set(data["stale_pages"]),
        )
        p = data["publication"]
        if p is not None:
            host_block = self._manager.host_block_pool.pool_core.block
            detached = p["detached_blocks"]
            # The request object the core keeps for the publication (None once gone).
            request: Any = self.hisparse_core.publication_request(p["id"])
            state.publication = _vllm_hisparse._PendingPublication(
                request=request,
                num_computed_tokens=p["num_computed_tokens"],
                num_pages=p["num_pages"],
                retention_interval=p["retention_interval"],
                replay_boundaries=list(p["replay_boundaries"]),
                detached_blocks=None if detached is None else [host_block(b) for b in detached],
                num_cached_blocks=p["num_cached_blocks"],
            )
        return state

    @property
    def request_states(self) -> dict[str, Any]:
        out = {}
        for rid in self.hisparse_core.request_ids():
            found = self.hisparse_core.request_state(rid)
            if found is not None:
                out[rid] = self._state(found[1])
        return out

    @property
    def pending_spills(self) -> dict[int, Any]:
        block, host_block = (
            self._manager.block_pool.pool_core.block,
            self._manager.host_block_pool.pool_core.block,
        )
        out = {}
        for (
            transfer_id,
            rid,
            page,
            state_id,
            host,
            resident,
            restore,
            expected,
            completions,
            applied,
        ) in self.hisparse_core.pending_spills():
            data = self.hisparse_core.state(state_id)
            if data is None:  # a spill keeps its request's state alive
                raise RuntimeError(f"HiSparse spill {transfer_id} lost its request state")
            out[transfer_id] = _vllm_hisparse._PendingSpill(
                transfer_id=transfer_id,
                page=(rid, page),
                request_state=self._state(data),
                host_block=host_block(host),
                resident_blocks=tuple(block(b) for b in resident),
                restore=restore,
                expected_worker_completions=expected,
                worker_completions=completions,
                enqueue_applied=applied,
            )
        return out

    @property
    def spills_to_send(self) -> list[SparseKVPageTransfer]:
        return [_transfer(t) for t in self.hisparse_core.spills_to_send()]

    def _tables(self) -> dict[str, Any]:
        tables: dict[str, Any] = self.hisparse_core.tables()
        return tables

    @property
    def copies(self) -> dict[bytes, tuple[Any, ...]]:
        block = self._manager.block_pool.pool_core.block
        return {key: tuple(block(b) for b in ids) for key, ids in self._tables()["copies"]}

    @property
    def _copy_by_block(self) -> dict[int, bytes]:
        return dict(self._tables()["copy_by_block"])

    @property
    def _owners(self) -> dict[int, set[tuple[str, int]]]:
        return {b: set(pairs) for b, pairs in self._tables()["owners"]}

    @property
    def _retained_copies(self) -> dict[int, tuple[Any, Any]]:
        host_block = self._manager.host_block_pool.pool_core.block
        return {
            dst: (host_block(src), host_block(cow))
            for dst, src, cow in self._tables()["retained_copies"]
        }

    @property
    def _pending_imports(self) -> dict[str, int]:
        return dict(self._tables()["pending_imports"])

    @property
    def _resident_requests(self) -> set[str]:
        return set(self._tables()["resident_requests"])

    @property
    def next_spill_id(self) -> int:
        return int(self._tables()["next_spill_id"])

    # -- vLLM's methods ------------------------------------------------------------------

    def _get_request_state(self, request_id: str) -> Any:
        found = self.hisparse_core.request_state(request_id)
        return None if found is None else self._state(found[1])

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        self.hisparse_core.commit_computed_blocks(request_id, num_host_pages)

    def take_host_block_copies(self) -> tuple[KVCacheBlockCopy, ...]:
        pairs = self.hisparse_core.take_host_block_copies()
        return tuple(KVCacheBlockCopy(src_block_id=s, dst_block_id=d) for s, d in pairs)

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        self.hisparse_core.release_completed_host_copies(list(dst_block_ids))

    def get_host_block_pool(self) -> Any:
        return self.host_manager.block_pool

    def _can_read_from_host(self, request_id: str) -> bool:
        return bool(self.hot_managers) and all(m.has_hot(request_id) for m in self.hot_managers)

    def update_residency(self, request_id: str) -> None:
        self.hisparse_core.update_residency(request_id)

    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        self.hisparse_core.advance_scheduled(list(requests))

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        self.hisparse_core.plan_prefix_materialization(request_id, num_computed_tokens)

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        self.hisparse_core.record_pending_host_import(request_id, num_tokens)

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        self.hisparse_core.finish_host_import(request_id, failed)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        self.hisparse_core.complete_host_import(request_id, num_computed_tokens)

    def build_row_mirrors(
        self, requests: Iterable[tuple[str, int, int]]
    ) -> tuple[SparseKVRowMirror, ...]:
        return tuple(
            SparseKVRowMirror(source_starts=tuple(starts), destination_start=dest, num_rows=rows)
            for starts, dest, rows in self.hisparse_core.build_row_mirrors(list(requests))
        )

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        return bool(self.hisparse_core.all_context_pages_resident(list(requests)))

    def take_residency_updates(self, request_ids: Iterable[str]) -> dict[str, Any]:
        # ``SparseKVResidencyUpdate`` (0.32, 0.33; vLLM 0.30 has none and its HiSparse
        # layouts stay on vLLM's manager: ``hisparse_residency_updates`` of the profile).
        update = _hisparse_types.SparseKVResidencyUpdate
        return {
            rid: update(pages=list(pages), block_ids=tuple(ids))
            for rid, pages, ids in self.hisparse_core.take_residency_updates(list(request_ids))
        }

    def build_offload_command(self) -> SparseKVOffloadCommand | None:
        transfers = self.hisparse_core.build_offload_command()
        if transfers is None:
            return None
        return SparseKVOffloadCommand(page_transfers=[_transfer(t) for t in transfers])

    def has_pending_reclamation(self) -> bool:
        return bool(self.hisparse_core.has_pending_reclamation())

    def has_pending_work(self) -> bool:
        return bool(self.hisparse_core.has_pending_work())

    def update_spills(
        self, enqueued_counts: dict[int, int], completed_counts: dict[int, int]
    ) -> None:
        self.hisparse_core.update_spills(dict(enqueued_counts), dict(completed_counts))

    def free(self, request_id: str) -> None:
        self.hisparse_core.free(request_id)


def _transfer(t: tuple[int, int, list[int], bool, bool]) -> SparseKVPageTransfer:
    transfer_id, host, resident, after_forward, restore = t
    return SparseKVPageTransfer(
        transfer_id=transfer_id,
        host_block_id=host,
        resident_block_ids=tuple(resident),
        after_forward=after_forward,
        restore=restore,
    )
