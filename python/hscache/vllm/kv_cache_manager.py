"""``KVCacheManager``: vLLM 0.33's KV-cache manager interface, backed by the Rust core.

Every KV-cache layout vLLM 0.33 builds a manager for is served by the core: one or
several groups of full attention (MLA, sinks, R-SWA), sliding window, chunked local
attention, Mamba (``none``, ``all``, ``align``, with partial hits and copy-on-write),
cross attention and circular buffers, with mixed block sizes, EAGLE/MTP groups,
decode/prefill context parallelism, retention intervals and block-residency metrics.

Why block 0 is reserved: vLLM uses block 0 as the null block, a placeholder that
keeps per-group block tables position-aligned (a sliding window's skipped prefix, a
Mamba table's earlier states); the core pops it at construction, never hashes or
ref-counts it, and excludes it from ``usage``, exactly like vLLM.

How caching maps: ``allocate_slots`` caches every block fully covered by
``request.block_hashes`` (capped at ``request.num_tokens``) inside the same core
call; ``delay_cache_blocks=True`` (async KV-connector loads) skips that and the
Scheduler calls ``cache_blocks`` when the load lands, as in vLLM.

HiSparse layouts (a source group on a private host pool, resident and hot groups)
are served too: the core builds HiSparse's coordinator with the manager, and
``get_hisparse_coordinator(manager)`` returns its view (``hscache.vllm.hisparse``).

What is not implemented in the core (the constructor then returns vLLM's own
``KVCacheManager`` and logs one line naming the reason; with ``HSCACHE_STRICT=1`` it
raises ``hscache.exceptions.UnsupportedConfigError`` instead): specs registered by
out-of-tree plugins, a HiSparse source group whose block size differs from the hash
block size (partial host entries), HiSparse layouts vLLM's coordinator refuses to
bind (so that vLLM raises, at the same call), and ``HSCACHE_DISABLE=1``.

``HSCACHE_PARITY=1`` returns a ``ParityKVCacheManager`` instead, which runs vLLM's
manager beside this one and raises on the first divergence (``hscache.vllm.parity``).

``explain=True`` (or ``HSCACHE_EXPLAIN=1``) turns on hit-path explanations:
``manager.explain(request_id)`` / ``hscache.explain(request_id)`` (``docs/explain.md``).

``kv_events_mode="compact"`` (or ``HSCACHE_KV_EVENTS=compact``) publishes compact KV
events: consecutive events of one ``take_events()`` batch coalesced, still vLLM's
structs (``docs/retention.md``, "KV events"); the default ``"vllm"`` is vLLM's stream,
event for event.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from vllm.distributed.kv_events import MEDIUM_CPU
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from hscache import explanations
from hscache._core import KVCacheBlock, KVCacheCoordinatorCore, KVCacheCore
from hscache.exceptions import InvalidArgumentError, UnsupportedConfigError, UnsupportedError
from hscache.explanations import Explanation
from hscache.vllm import events, retention
from hscache.vllm.block_pool import BlockPool
from hscache.vllm.hisparse import HostBlockPool
from hscache.vllm.parity import ParityKVCacheManager
from hscache.vllm.specs import env_flag, group_specs, unsupported_reason
from hscache.vllm.version import require
from hscache.vllm.views import coordinator_view

logger = init_logger(__name__)
_PROFILE = require()  # what differs between the supported vLLM versions

_SIGNATURE = inspect.signature(VllmKVCacheManager.__init__)
_INT64_MAX = np.iinfo(np.int64).max


class BatchAllocation(NamedTuple):
    """What ``allocate_slots_batch`` allocated."""

    num_allocated: int
    """Entries allocated; entry ``num_allocated`` (if any) did not fit."""
    new_block_ids: np.ndarray
    """int32: the new block ids of every allocated entry, concatenated."""
    offsets: np.ndarray
    """int32, ``num_allocated + 1`` values: entry ``i``'s new blocks are
    ``new_block_ids[offsets[i]:offsets[i + 1]]``."""


def _check_config(config: Any) -> None:
    """A ``TypeError`` for what is not a ``KVCacheConfig`` (instead of an
    ``AttributeError`` from deep inside the constructor)."""
    if not (hasattr(config, "kv_cache_groups") and hasattr(config, "num_blocks")):
        raise TypeError(
            f"kv_cache_config must be a vLLM KVCacheConfig, got {type(config).__name__}"
        )


def _int64_arg(values: Sequence[int] | np.ndarray) -> list[int] | bytes:
    """A list as is (read item by item in Rust), a one-dimensional integer array as
    native int64 bytes (any layout: non-contiguous arrays are copied). A float or other
    non-integer array is a ``TypeError`` (casting would silently truncate token counts);
    an array of another shape, or a ``uint64`` value past ``int64``, is
    ``InvalidArgumentError`` (flattening or wrapping would silently change entries)."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise TypeError(f"expected an integer array, got dtype {values.dtype}")
        if values.ndim != 1:
            raise InvalidArgumentError(
                f"expected a one-dimensional array, got shape {values.shape}"
            )
        if values.dtype.kind == "u" and values.size and values.max() > _INT64_MAX:
            raise InvalidArgumentError(f"{values.max()} does not fit in a 64-bit integer")
        return np.ascontiguousarray(values, dtype=np.int64).tobytes()
    if isinstance(values, list):
        return values
    return list(values)


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
        # hscache's own keyword (opt-in retention policies, hscache.vllm.retention).
        policy, settings = retention.select(kwargs.pop("retention", None))
        explain = kwargs.pop("explain", None)
        explain_on = explanations.enabled_from_env() if explain is None else bool(explain)
        events_mode = events.select_mode(kwargs.pop("kv_events_mode", None))
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        params = bound.arguments
        _check_config(params["kv_cache_config"])
        reason = unsupported_reason(
            params["kv_cache_config"], params["hash_block_size"], bool(params["enable_caching"])
        )
        if reason is not None:
            if env_flag("HSCACHE_STRICT"):
                raise UnsupportedConfigError(f"hscache cannot serve this KV cache: {reason}")
            logger.info("hscache: using vLLM's Python KVCacheManager: %s", reason)
            return VllmKVCacheManager(*args, **kwargs)
        if env_flag("HSCACHE_PARITY"):
            logger.info("hscache: parity mode, vLLM's manager runs beside hscache's")
            if policy != "lru":
                logger.info("hscache: parity mode compares vLLM's LRU; %s is ignored", policy)
            if events_mode != "vllm":
                logger.info("hscache: parity mode compares vLLM's KV events; compact is ignored")
            return ParityKVCacheManager(
                cls.build(*args, **kwargs), VllmKVCacheManager(*args, **kwargs)
            )
        if policy == "lru":
            manager = cls._new_core(params)
        else:
            manager = RetentionKVCacheManager._new_core(params)
            retention.install(manager, policy, settings)
        if explain_on:
            manager.core_set_explain(True)
            explanations.register(manager)
        if events_mode != "vllm":
            manager.core_set_kv_events_mode(events_mode)
        return manager

    @classmethod
    def build(cls, *args: Any, **kwargs: Any) -> KVCacheManager:
        """An hscache manager for a configuration it serves, whatever the switches."""
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        manager: KVCacheManager = cls._new_core(bound.arguments)
        manager.__init__(*args, **kwargs)  # type: ignore[misc]
        return manager

    @classmethod
    def _new_core(cls, params: dict[str, Any]) -> Any:
        config: KVCacheConfig = params["kv_cache_config"]
        _check_config(config)
        watermark = params["watermark"]
        # vLLM asserts `watermark >= 0.0` (NaN fails it), then takes
        # `int(watermark * num_blocks)`: infinity would be an OverflowError there.
        if not 0.0 <= watermark < math.inf:
            raise InvalidArgumentError(
                f"watermark must be a finite non-negative fraction, got {watermark!r}"
            )
        max_model_len = params["max_model_len"]
        max_in_flight = params["max_in_flight_tokens"]
        if max_in_flight is None:
            max_in_flight = max_model_len
        return super().__new__(
            cls,
            num_blocks=config.num_blocks,
            groups=group_specs(config, max_in_flight, max_model_len),
            max_model_len=max_model_len,
            scheduler_block_size=params["scheduler_block_size"],
            hash_block_size=params["hash_block_size"],
            enable_caching=bool(params["enable_caching"]),
            enable_kv_cache_events=bool(params["enable_kv_cache_events"]),
            # vLLM 0.32 drops the EAGLE block of every flagged group, use_eagle or not.
            use_eagle=_PROFILE.drops_eagle_block(
                bool(params["use_eagle"]),
                any(g.is_eagle_group for g in config.kv_cache_groups),
            ),
            watermark_blocks=int(watermark * config.num_blocks),
            num_hash_lookahead_tokens=params.get("num_hash_lookahead_tokens", 0),
            num_prefill_lookahead=params["num_prefill_lookahead"],
            dcp_world_size=params["dcp_world_size"],
            pcp_world_size=params["pcp_world_size"],
            needs_kv_cache_zeroing=bool(config.needs_kv_cache_zeroing),
            retention_interval=config.prefix_cache_retention_interval,
            collect_metrics=params["metrics_collector"] is not None,
            enable_mamba_shared_prefix_checkpoint=bool(
                params.get(_PROFILE.mamba_prefix_keyword, False)
            ),
            # The core's rules where the releases differ (null block, EAGLE, Mamba).
            vllm_series=_PROFILE.series,
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
        enable_mamba_fine_grained_prefix_cache: bool = False,
        retention: str | dict[str, Any] | None = None,
        explain: bool | None = None,
        kv_events_mode: str | None = None,
    ) -> None:
        # One piece: vLLM's constructor's signature and its attributes in vLLM's order,
        # then the pool, the core's bindings and the coordinator view, each built from the
        # one before; what is long is the signature vLLM's Scheduler calls.
        if getattr(self, "_hscache_initialized", False):
            # The core keeps the configuration it was built with: re-running
            # __init__ would change the Python attributes only.
            raise UnsupportedError(
                "hscache KVCacheManager.__init__ was already called: build a new manager"
            )
        self._hscache_initialized = True
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = (
            max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        )
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        coordinator_core = KVCacheCoordinatorCore(self)
        coordinator_info = coordinator_core.info()
        hisparse_layout = coordinator_core.hisparse_layout()
        # Groups that keep their longer hit until the facade trims it (vLLM's
        # `retains_longer_hit`: HiSparse's source group).
        self.retained_hit_group_ids: tuple[int, ...] = (
            (hisparse_layout["host_group"],) if hisparse_layout is not None else ()
        )
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (
                get_kv_cache_spec_kind(group.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(group.kv_cache_spec),
            )
            for group in kv_cache_config.kv_cache_groups
        )
        self.block_pool = BlockPool(
            self,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            metrics_collector=metrics_collector,
        )
        # Also creates ``empty_kv_cache_blocks``, the no-hit singleton (a Rust
        # ``KVCacheBlocks``, duck-typed like vLLM's dataclass).
        self._bind_vllm(
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            ([], self.block_pool.event_builder) if enable_kv_cache_events else None,
            metrics_collector,
            events.make_event_builder(num_hash_lookahead_tokens, MEDIUM_CPU)
            if enable_kv_cache_events and hisparse_layout is not None
            else None,
        )
        if hisparse_layout is not None:
            source = kv_cache_config.kv_cache_groups[hisparse_layout["host_group"]]
            self.host_block_pool = HostBlockPool(
                self, enable_caching and bool(source.kv_cache_spec.prefix_cacheable)
            )
        queue = self.block_pool.free_block_queue
        self._bind_free_list_sentinels(queue.fake_free_list_head, queue.fake_free_list_tail)
        self.coordinator = coordinator_view(self, coordinator_core)
        # The Scheduler reads the keyword's value back (0.30: a Mamba layout never gets
        # here, see ``mamba_rules_implemented``): ``mamba_shared_prefix_checkpoint`` or
        # ``mamba_fine_grained_prefix_cache``.
        setattr(
            self,
            _PROFILE.mamba_prefix_keyword.removeprefix("enable_"),
            bool(coordinator_info["mamba_shared_prefix_checkpoint"]),
        )

    # -- stats ----------------------------------------------------------------------

    # log_stats, prefix_cache_stats, record_prefix_cache_stats and
    # make_prefix_cache_stats: the core's (src/python/prefix_stats.rs), which counts an
    # admission in Rust until the stats object is handed out, so that whoever reads it
    # reads what vLLM's would hold.

    def explain(self, request_id: str) -> Explanation:
        """Why the request's last prefix-cache lookup stopped where it did
        (``docs/explain.md``). ``UnsupportedError`` (a ``RuntimeError``) unless explain
        mode is on (``explain=True`` or ``HSCACHE_EXPLAIN=1``); ``UnknownRequestError``
        (a ``KeyError``) for a request without an explained lookup."""
        return Explanation.from_core(request_id, self.core_explain(request_id))

    # -- lookup results ---------------------------------------------------------------

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> Any:
        """vLLM's ``KVCacheBlocks`` of ``blocks``, or the empty singleton."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- freeing and eviction -----------------------------------------------------------

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        # Every pool once (HiSparse's host pool too), as vLLM's coordinator does.
        if not self.core_reset_all_prefix_caches():
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self.block_pool.num_gpu_blocks - self.block_pool.get_num_free_blocks() - 1,
            )
            return False
        if self.log_stats and self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # take_events: the core's (src/python/manager_calls.rs): the pool's queued events,
    # each BlockStored annotated with its group's spec from kv_cache_event_metadata
    # (annotated as they were built while the metadata stays the same tuple).

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks of the request's table that every request holding
        blocks shares (vLLM 0.30's count for cascade attention, from the core's reference
        counts); ``[0]`` per group where vLLM deprecated it (0.32, 0.33)."""
        if _PROFILE.counts_common_prefix_blocks:
            return self.num_common_prefix_blocks(running_request_id)
        return [0] * self.num_kv_cache_groups

    def get_zeroing_block_ids_in_range(
        self, request_id: str, start_token: int, end_token: int
    ) -> list[int]:
        """vLLM 0.30's query for async KV loads: the request's block ids covering
        ``[start_token, end_token)`` in the groups whose new blocks the worker zeroes.
        A negative bound is refused (a Python slice would silently count from the end)."""
        for name, value in (("start_token", start_token), ("end_token", end_token)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise InvalidArgumentError(f"{name} must be non-negative, got {value}")
        tables = self.get_block_ids(request_id)
        ids: list[int] = []
        for g, manager in enumerate(self.coordinator.single_type_managers):
            if manager.records_new_block_ids:
                size = manager.block_size
                ids.extend(tables[g][start_token // size : -(-end_token // size)])
        return ids

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
        numpy integer arrays. Layouts with sliding-window, chunked-local or Mamba
        groups are served per request only (``allocate_slots``).
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
        pairs = self.core_take_kv_cache_block_copies()
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs]
        return copies, [block for pair in pairs for block in pair]


class RetentionKVCacheManager(KVCacheManager):
    """``KVCacheManager`` under a non-LRU retention policy (``hscache.vllm.retention``).

    Only ``free`` differs: the core reads the request's retention hints
    (``sampling_params.extra_args``) and applies them to the blocks it frees. The
    LRU default never builds this class, so its ``free`` stays the core's.
    """

    # The core reads the hints from ``extra_args`` and frees with them, in one call.
    free = KVCacheCore.core_free_retained
