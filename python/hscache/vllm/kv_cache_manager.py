"""``KVCacheManager``: vLLM 0.33's KV-cache manager interface, backed by the Rust core.

Why block 0 is reserved: vLLM uses block 0 as the null block, a placeholder that
keeps per-group block tables position-aligned; the core pops it at construction,
never hashes or ref-counts it, and excludes it from ``usage``, exactly like vLLM.

How caching maps: ``allocate_slots`` caches every block fully covered by
``request.block_hashes`` (capped at ``request.num_tokens``) inside the same core
call; ``delay_cache_blocks=True`` (async KV-connector loads) skips that and the
Scheduler calls ``cache_blocks`` when the load lands, as in vLLM.

What is not implemented in the core (the constructor then returns vLLM's own
``KVCacheManager`` and logs one line naming the reason):

- more than one KV-cache group (hybrid models), or a group whose vLLM manager is
  not ``FullAttentionManager`` (sliding window, chunked local, Mamba, cross
  attention, sink, circular buffer, HiSparse);
- decode / prefill context parallelism (``dcp_world_size * pcp_world_size > 1``);
- ``hash_block_size`` or ``scheduler_block_size`` different from the block size;
- a block-residency ``metrics_collector`` (``--kv-cache-metrics``);
- a non-zero ``prefix_cache_retention_interval``;
- ``HSCACHE_DISABLE=1`` in the environment.

``HSCACHE_PARITY=1`` returns a ``ParityKVCacheManager`` instead, which runs vLLM's
manager beside this one and raises on the first divergence (``hscache.vllm.parity``).

Adding a single-type manager: the Rust group manager goes in
``src/manager/<name>.rs`` beside ``full_attention.rs``, the facade in
``src/manager/mod.rs`` dispatches to it, ``_unsupported_reason`` below stops
rejecting its spec, and the differential tests in ``tests/vllm_diff/`` get a config
that exercises it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from vllm.distributed.kv_events import BlockStored
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core import kv_cache_manager as _vllm_kv_cache_manager
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from hscache._core import KVCacheBlock, KVCacheCore
from hscache.exceptions import InvalidArgumentError
from hscache.vllm.block_pool import BlockPool
from hscache.vllm.parity import ParityKVCacheManager, building_parity_side
from hscache.vllm.version import require

logger = init_logger(__name__)
_PROFILE = require()  # what differs between the supported vLLM versions

_SIGNATURE = inspect.signature(VllmKVCacheManager.__init__)
_WATERMARK_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class BatchAllocation(NamedTuple):
    """What ``allocate_slots_batch`` allocated."""

    num_allocated: int
    """Entries allocated; entry ``num_allocated`` (if any) did not fit."""
    new_block_ids: np.ndarray
    """int32: the new block ids of every allocated entry, concatenated."""
    offsets: np.ndarray
    """int32, ``num_allocated + 1`` values: entry ``i``'s new blocks are
    ``new_block_ids[offsets[i]:offsets[i + 1]]``."""


def _int64_arg(values: Sequence[int] | np.ndarray) -> list[int] | bytes:
    """A list as is (read item by item in Rust), an array as native int64 bytes."""
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values, dtype=np.int64).tobytes()
    if isinstance(values, list):
        return values
    return list(values)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no")


def _unsupported_reason(args: dict[str, Any]) -> str | None:
    """Why the core cannot serve this configuration, or None if it can."""
    if _env_flag("HSCACHE_DISABLE"):
        return "HSCACHE_DISABLE is set"
    config: KVCacheConfig = args["kv_cache_config"]
    groups = config.kv_cache_groups
    if len(groups) != 1:
        return f"{len(groups)} KV-cache groups (only one is supported)"
    group = groups[0]
    spec = group.kv_cache_spec
    try:
        manager_cls = KVCacheSpecRegistry.get_manager_class(spec, group.role)
    except Exception as e:  # an unregistered custom spec
        return f"no manager registered for {type(spec).__name__}: {e}"
    if manager_cls is not FullAttentionManager:
        name = getattr(manager_cls, "__name__", manager_cls)
        return f"{type(spec).__name__} needs {name}"
    if args["metrics_collector"] is not None:
        return "KV-cache block metrics collection"
    if spec.dcp_sharded and args["dcp_world_size"] * args["pcp_world_size"] > 1:
        return "decode/prefill context parallelism"
    if args["scheduler_block_size"] != spec.block_size:
        return "scheduler_block_size differs from the block size"
    if args["enable_caching"] and args["hash_block_size"] != spec.block_size:
        return "hash_block_size differs from the block size"
    if config.prefix_cache_retention_interval not in (None, 0):
        return "prefix_cache_retention_interval"
    if (
        args["enable_caching"]
        and (args["use_eagle"] or group.is_eagle_group)
        and args["scheduler_block_size"] < args["num_prefill_lookahead"]
    ):
        return "multi-module MTP with a block smaller than its lookahead"
    return None


class _SingleTypeManagerView:
    """``coordinator.single_type_managers[0]``: the attributes vLLM code reads."""

    def __init__(self, manager: KVCacheManager, kv_cache_spec: Any) -> None:
        self._manager = manager
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = manager.block_pool
        self.kv_cache_group_id = 0
        self.enable_caching = manager.enable_caching
        self.use_eagle = manager.use_eagle
        self.records_new_block_ids = manager.kv_cache_config.needs_kv_cache_zeroing
        # Copy-on-write pairs: full attention never makes them, but KV connectors and
        # tests may queue (source, copy) blocks here; take_kv_cache_block_copies drains.
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        core = self._manager
        return {rid: core.core_blocks(rid) for rid in core.core_request_ids()}

    @property
    def num_cached_block(self) -> dict[str, int]:
        core = self._manager
        out = {}
        for rid in core.core_request_ids():
            n = core.core_num_cached_block(rid)
            if n is not None:
                out[rid] = n
        return out

    def take_new_block_ids(self) -> list[int]:
        return self._manager.take_new_block_ids()


class _CoordinatorView:
    """``kv_cache_manager.coordinator``: what the Scheduler and connectors read."""

    def __init__(self, manager: KVCacheManager, kv_cache_spec: Any) -> None:
        self._manager = manager
        self.kv_cache_config = manager.kv_cache_config
        self.block_pool = manager.block_pool
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.scheduler_block_size = kv_cache_spec.block_size
        self.hash_block_size = kv_cache_spec.block_size
        self.dcp_world_size = 1
        self.pcp_world_size = 1
        self.enable_partial_hash_hits = False
        self.num_reprefillable_tokens = manager._num_reprefillable_tokens
        self.retention_interval = manager.kv_cache_config.prefix_cache_retention_interval
        self.eagle_group_ids = manager._eagle_group_ids
        self.drop_eagle_group_ids = self.eagle_group_ids if manager.use_eagle else set()
        self.single_type_managers = (_SingleTypeManagerView(manager, kv_cache_spec),)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return self._manager.core_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0]
        )

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return (self._manager.core_blocks(request_id),)

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        if not self._manager.enable_caching:
            return ([],), 0, 0
        blocks, hit = self._manager.core_find_longest_cache_hit(block_hashes, max_cache_hit_length)
        return (blocks,), hit, 0

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self._manager.core_free(request_id)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Full attention keeps every block: nothing to remove."""

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def new_step_starts(self) -> None:
        """Full attention keeps no per-step state."""


class KVCacheManager(KVCacheCore):
    """Drop-in for ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (vLLM 0.33.0).

    Takes vLLM's constructor keywords unchanged. For configurations the core does
    not implement, construction returns vLLM's own manager (see the module docs).
    The per-step methods (``allocate_slots``, ``get_computed_blocks``, ``free``,
    ``get_blocks``, ``get_block_ids``, ``cache_blocks``, ``pop_blocks_for_free``,
    ``estimate_cached_tokens``, ``usage``, ...) are inherited from the Rust
    ``KVCacheCore`` with vLLM's signatures; this class adds the cold parts.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        params = bound.arguments
        reason = _unsupported_reason(params)
        if reason is not None:
            logger.info("hscache: using vLLM's Python KVCacheManager: %s", reason)
            return VllmKVCacheManager(*args, **kwargs)
        if _env_flag("HSCACHE_PARITY") and not building_parity_side.get():
            logger.info("hscache: parity mode, vLLM's manager runs beside hscache's")
            return ParityKVCacheManager(*args, **kwargs)
        config: KVCacheConfig = params["kv_cache_config"]
        watermark = params["watermark"]
        if watermark < 0.0:
            raise InvalidArgumentError("watermark must be non-negative")
        return super().__new__(
            cls,
            num_blocks=config.num_blocks,
            block_size=config.kv_cache_groups[0].kv_cache_spec.block_size,
            max_model_len=params["max_model_len"],
            enable_caching=params["enable_caching"],
            enable_kv_cache_events=params["enable_kv_cache_events"],
            use_eagle=_PROFILE.drops_eagle_block(
                params["use_eagle"], config.kv_cache_groups[0].is_eagle_group
            ),
            watermark_blocks=int(watermark * config.num_blocks),
            num_reprefillable_tokens=max(0, params["num_prefill_lookahead"] - 1),
            needs_kv_cache_zeroing=config.needs_kv_cache_zeroing,
        )

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = (
            max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        )
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = 1
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = (
            (get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)),
        )
        self._eagle_group_ids = {0} if (use_eagle or group.is_eagle_group) else set()
        self._num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self._core = self  # the Rust core is this object (kept for tools and tests)
        self.block_pool = BlockPool(
            self,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
        self.coordinator = _CoordinatorView(self, spec)
        # Also creates ``empty_kv_cache_blocks``, the no-hit singleton (a Rust
        # ``KVCacheBlocks``, duck-typed like vLLM's dataclass).
        self._bind_vllm(
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            (self.block_pool.pending_events, self.block_pool.event_builder)
            if enable_kv_cache_events
            else None,
            self._emit_cached_block_events if enable_kv_cache_events else None,
        )
        queue = self.block_pool.free_block_queue
        self._bind_free_list_sentinels(queue.fake_free_list_head, queue.fake_free_list_tail)

    # -- stats ----------------------------------------------------------------------

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    # -- lookup results ---------------------------------------------------------------

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> Any:
        """vLLM's ``KVCacheBlocks`` of ``blocks``, or the empty singleton."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def _emit_cached_block_events(self, request: Request, num_blocks: int) -> None:
        """BlockStored for reused hits (``kv_cache_report_mode == "full"``)."""
        self.block_pool.kv_event_queue.append(
            self.block_pool.event_builder.block_stored(request, 0, num_blocks, self.block_size, 0)
        )

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        if num_computed_tokens % self.block_size != 0:
            raise InvalidArgumentError(
                f"num_computed_tokens {num_computed_tokens} is not block aligned"
            )
        num_blocks = num_computed_tokens // self.block_size
        group: Sequence[Any] = blocks.blocks[0]
        if num_blocks > len(group):
            raise InvalidArgumentError(
                f"cannot truncate {len(group)} blocks to {num_blocks} blocks"
            )
        return self.create_kv_cache_blocks((list(group[:num_blocks]),))

    # -- freeing and eviction -----------------------------------------------------------

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Full attention keeps every block: nothing to remove."""

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self.num_gpu_blocks - self.num_free_blocks - 1,
            )
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[Any]:
        """The pool's events; ``BlockStored`` ones annotated with the group's spec."""
        events = self.block_pool.take_events()
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            if not 0 <= event.group_idx < len(self.kv_cache_event_metadata):
                # vLLM's own logger and words: log consumers see the same line.
                _vllm_kv_cache_manager.logger.warning(
                    "Group index `%s` not in KV cache metadata", event.group_idx
                )
                continue
            kind, sliding_window = self.kv_cache_event_metadata[event.group_idx]
            event.kv_cache_spec_kind = kind
            event.kv_cache_spec_sliding_window = sliding_window
        return events

    # -- block tables -------------------------------------------------------------------

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        (ids,) = self.get_block_ids(request_id)
        return (ids[: cdiv(num_computed_tokens, self.block_size)],)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM (cascade attention is gone): always ``[0]``."""
        return [0]

    # -- batched running-set calls (hscache only) ---------------------------------------

    def allocate_slots_batch(
        self,
        requests: list[Request],
        handles: Sequence[int] | np.ndarray,
        num_computed_tokens: Sequence[int] | np.ndarray,
        num_new_tokens: Sequence[int] | np.ndarray,
        num_lookahead_tokens: int = 0,
    ) -> BatchAllocation:
        """One step's ``allocate_slots`` for running requests, in one call.

        Entry ``i`` is ``allocate_slots(requests[i], num_new_tokens[i],
        num_lookahead_tokens=...)`` for a running request whose
        ``num_computed_tokens`` is ``num_computed_tokens[i]`` and whose handle
        (``request_handle``) is ``handles[i]``. Entries are allocated in order up to
        the first one that does not fit, which is left untouched
        (``num_allocated`` is its index): free a victim from the tail and call again
        with the remaining entries, as vLLM's Scheduler does after a ``None``. Every
        entry is validated before anything changes. Arrays may be lists of ints or
        numpy integer arrays.
        """
        done, ids, offsets = self.core_allocate_slots_batch(
            requests,
            _int64_arg(handles),
            _int64_arg(num_computed_tokens),
            _int64_arg(num_new_tokens),
            num_lookahead_tokens,
        )
        return BatchAllocation(
            done, np.frombuffer(ids, dtype=np.int32), np.frombuffer(offsets, dtype=np.int32)
        )

    def free_batch(self, handles: Sequence[int] | np.ndarray) -> None:
        """``free`` for each request ``handles`` names, in order (all checked first)."""
        self.core_free_batch(_int64_arg(handles))

    # -- worker-side hand-offs ----------------------------------------------------------

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Drains queued copy-on-write pairs: ``(copies, both endpoints of each)``."""
        manager = self.coordinator.single_type_managers[0]
        pairs, manager._pending_cow_copies = manager._pending_cow_copies, []
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs]
        return copies, [block for pair in pairs for block in pair]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Only Mamba "align" groups hand off boundary states."""
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """Only Mamba "align" groups have partial tails."""
        return []
