"""Parity mode: vLLM's Python manager runs beside hscache's and every answer is compared.

``HSCACHE_PARITY=1`` (or constructing ``ParityKVCacheManager`` directly) makes
``hscache.vllm.KVCacheManager`` return a ``ParityKVCacheManager``: both managers receive
every call the Scheduler makes; hscache's answer is returned, and the first divergence
(return value, free-block count, free-queue order after frees, usage, stats or events)
raises ``ParityError`` naming the call and both answers. It costs vLLM's full Python time
plus hscache's: a tool to build trust, not to serve with.

Block objects handed to the Scheduler are hscache's; when the Scheduler hands them back
(hits, deferred frees), they are translated to vLLM's blocks by id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager


class ParityError(AssertionError):
    """hscache's manager answered differently from vLLM's on the same call."""


def _ids(blocks: Any) -> Any:
    """Comparable form of a ``KVCacheBlocks`` (or None)."""
    return None if blocks is None else blocks.get_block_ids()


def prefix_cache_stats_key(stats: Any) -> Any:
    """Comparable form of a vLLM ``PrefixCacheStats`` (or None)."""
    if stats is None:
        return None
    return (
        stats.reset,
        stats.requests,
        stats.queries,
        stats.hits,
        stats.preempted_requests,
        stats.preempted_queries,
        stats.preempted_hits,
    )


class _ParityBlockPool:
    """``block_pool`` of the parity manager: frees go to both pools."""

    def __init__(self, parity: ParityKVCacheManager) -> None:
        self._parity = parity

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parity.hscache.block_pool, name)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        p = self._parity
        p.hscache.block_pool.free_blocks(blocks)
        p.vllm.block_pool.free_blocks(p.to_vllm_blocks(blocks))
        p.check("block_pool.free_blocks", None, None, queue=True)

    def get_num_free_blocks(self) -> int:
        return int(self._parity.hscache.block_pool.get_num_free_blocks())


class ParityKVCacheManager:
    """Runs hscache's and vLLM's ``KVCacheManager`` side by side (see module docs)."""

    def __init__(self, hscache: Any, vllm: VllmKVCacheManager) -> None:
        """``hscache`` and ``vllm``: the two managers, built with the same arguments
        (``hscache.vllm.KVCacheManager`` builds both under ``HSCACHE_PARITY=1``)."""
        self.hscache = hscache
        self.vllm = vllm
        self.block_pool = _ParityBlockPool(self)
        self.num_calls = 0

    def __getattr__(self, name: str) -> Any:
        # Attributes the Scheduler only reads (config, coordinator, flags).
        return getattr(self.hscache, name)

    # -- comparison -------------------------------------------------------------------

    def to_vllm_blocks(self, blocks: Iterable[Any]) -> list[Any]:
        pool = self.vllm.block_pool.blocks
        return [pool[b.block_id] for b in blocks]

    def to_vllm_kv_cache_blocks(self, blocks: Any) -> Any:
        if blocks is None:
            return None
        if blocks is self.hscache.empty_kv_cache_blocks:
            return self.vllm.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(self.to_vllm_blocks(g) for g in blocks.blocks))

    def check(self, call: str, ours: Any, theirs: Any, *, queue: bool = False) -> None:
        self.num_calls += 1
        if ours != theirs:
            raise ParityError(f"{call}: hscache returned {ours!r}, vLLM returned {theirs!r}")
        h, v = self.hscache, self.vllm
        hf, vf = h.block_pool.get_num_free_blocks(), v.block_pool.get_num_free_blocks()
        if hf != vf:
            raise ParityError(f"after {call}: free blocks hscache={hf} vLLM={vf}")
        if queue:
            hq = [b.block_id for b in h.block_pool.free_block_queue.get_all_free_blocks()]
            vq = [b.block_id for b in v.block_pool.free_block_queue.get_all_free_blocks()]
            if hq != vq:
                raise ParityError(f"after {call}: free queue hscache={hq} vLLM={vq}")

    def _both(
        self,
        call: str,
        name: str,
        norm: Callable[[Any], Any],
        *args: Any,
        queue: bool = False,
        **kwargs: Any,
    ) -> Any:
        ours = getattr(self.hscache, name)(*args, **kwargs)
        theirs = getattr(self.vllm, name)(*args, **kwargs)
        self.check(call, norm(ours), norm(theirs), queue=queue)
        return ours

    # -- the Scheduler's calls ------------------------------------------------------------

    @property
    def usage(self) -> float:
        ours, theirs = self.hscache.usage, self.vllm.usage
        self.check("usage", ours, theirs)
        return float(ours)

    def get_computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # Both managers get the caller's exact arguments: vLLM 0.33 passes
        # ``max_cache_hit_length`` on some paths, 0.32's manager takes no such argument.
        ours = self.hscache.get_computed_blocks(request, *args, **kwargs)
        theirs = self.vllm.get_computed_blocks(request, *args, **kwargs)
        self.check(
            f"get_computed_blocks({request.request_id!r})",
            (_ids(ours[0]), *ours[1:]),
            (_ids(theirs[0]), *theirs[1:]),
        )
        return ours

    def get_computed_blocks_for_connector(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        ours = self.hscache.get_computed_blocks_for_connector(request, *args, **kwargs)
        theirs = self.vllm.get_computed_blocks_for_connector(request, *args, **kwargs)
        self.check(
            f"get_computed_blocks_for_connector({request.request_id!r})",
            (_ids(ours[0]), *ours[1:]),
            (_ids(theirs[0]), *theirs[1:]),
        )
        return ours

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        ours = self.hscache.truncate_computed_blocks(blocks, num_computed_tokens)
        theirs = self.vllm.truncate_computed_blocks(
            self.to_vllm_kv_cache_blocks(blocks), num_computed_tokens
        )
        self.check("truncate_computed_blocks", _ids(ours), _ids(theirs))
        return ours

    def take_kv_cache_block_copies(self) -> Any:
        ours = self.hscache.take_kv_cache_block_copies()
        theirs = self.vllm.take_kv_cache_block_copies()
        self.check(
            "take_kv_cache_block_copies",
            (list(ours[0]), [b.block_id for b in ours[1]]),
            (list(theirs[0]), [b.block_id for b in theirs[1]]),
        )
        return ours

    def take_boundary_state_offloads(self) -> Any:
        return self._both("take_boundary_state_offloads", "take_boundary_state_offloads", dict)

    def finalize_partial_tail_offloads(self, request: Any) -> Any:
        return self._both(
            "finalize_partial_tail_offloads", "finalize_partial_tail_offloads", list, request
        )

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        hits = kwargs.get("new_computed_blocks", args[1] if len(args) > 1 else None)
        vargs = list(args)
        vkwargs = dict(kwargs)
        if "new_computed_blocks" in vkwargs:
            vkwargs["new_computed_blocks"] = self.to_vllm_kv_cache_blocks(hits)
        elif len(vargs) > 1:
            vargs[1] = self.to_vllm_kv_cache_blocks(hits)
        ours = self.hscache.allocate_slots(request, num_new_tokens, *args, **kwargs)
        theirs = self.vllm.allocate_slots(request, num_new_tokens, *vargs, **vkwargs)
        self.check(
            f"allocate_slots({request.request_id!r}, {num_new_tokens}, ...)",
            _ids(ours),
            _ids(theirs),
        )
        return ours

    def free(self, request: Any) -> None:
        self._both(f"free({request.request_id!r})", "free", lambda r: r, request, queue=True)

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        ours = self.hscache.pop_blocks_for_free(request)
        theirs = self.vllm.pop_blocks_for_free(request)
        self.check(
            f"pop_blocks_for_free({request.request_id!r})",
            [b.block_id for b in ours],
            [b.block_id for b in theirs],
        )
        return list(ours)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._both(
            f"cache_blocks({request.request_id!r}, {num_computed_tokens})",
            "cache_blocks",
            lambda r: r,
            request,
            num_computed_tokens,
        )

    def get_blocks(self, request_id: str) -> Any:
        return self._both(f"get_blocks({request_id!r})", "get_blocks", _ids, request_id)

    def get_block_ids(self, request_id: str) -> Any:
        return self._both(f"get_block_ids({request_id!r})", "get_block_ids", list, request_id)

    def get_block_ids_for_computed_tokens(self, request_id: str, n: int) -> Any:
        return self._both(
            "get_block_ids_for_computed_tokens",
            "get_block_ids_for_computed_tokens",
            list,
            request_id,
            n,
        )

    def estimate_cached_tokens(self, request: Any) -> int:
        return int(self._both("estimate_cached_tokens", "estimate_cached_tokens", int, request))

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        self.hscache.record_prefix_cache_stats(request, num_hits)
        self.vllm.record_prefix_cache_stats(request, num_hits)

    def make_prefix_cache_stats(self) -> Any:
        return self._both(
            "make_prefix_cache_stats", "make_prefix_cache_stats", prefix_cache_stats_key
        )

    def take_events(self) -> list[Any]:
        return list(
            self._both(
                "take_events", "take_events", lambda evs: [msgspec.msgpack.encode(e) for e in evs]
            )
        )

    def take_new_block_ids(self) -> list[int]:
        return list(self._both("take_new_block_ids", "take_new_block_ids", list))

    def new_step_starts(self) -> None:
        self.hscache.new_step_starts()
        self.vllm.new_step_starts()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._both("evict_blocks", "evict_blocks", lambda r: r, block_ids, queue=True)

    def reset_prefix_cache(self) -> bool:
        return bool(self._both("reset_prefix_cache", "reset_prefix_cache", bool, queue=True))

    def remove_skipped_blocks(self, *args: Any, **kwargs: Any) -> None:
        self.hscache.remove_skipped_blocks(*args, **kwargs)
        self.vllm.remove_skipped_blocks(*args, **kwargs)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self.hscache.record_blocks_for_zeroing(request_id, start_token)
        self.vllm.record_blocks_for_zeroing(request_id, start_token)
