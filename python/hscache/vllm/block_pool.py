"""``BlockPool``: vLLM's block-pool interface over the Rust core.

The Scheduler calls ``block_pool.free_blocks(reversed(blocks))`` for deferred frees
and reads ``get_num_free_blocks()``; connectors and tests read ``blocks[i]``,
``null_block``, ``free_block_queue``, ``cached_block_hash_to_block`` and
``cached_block_hashes_by_block``, and call ``cache_full_blocks`` /
``cache_partial_block`` / ``_insert_block_hash``. Every call goes straight to the
core's pool class, ``BlockPoolCore`` (``src/python/pool.rs``), which addresses the
device pool or HiSparse's host pool; this class holds no bookkeeping of its own, only
the queue of KV events the core built. The views of the pool's parts (``blocks``, the
free queue) serve both pools.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

from vllm.distributed.kv_events import MEDIUM_GPU, KVCacheEvent
from vllm.v1.core import block_pool as vllm_block_pool
from vllm.v1.core import kv_cache_utils

from hscache._core import BlockPoolCore, KVCacheBlock, KVCacheCore
from hscache.vllm import events
from hscache.vllm.unserved import refuse_unserved


class BlockList(Sequence[KVCacheBlock]):
    """``block_pool.blocks``: block handles by id, created on first access."""

    def __init__(self, pool: BlockPoolCore) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_gpu_blocks

    @overload
    def __getitem__(self, index: int) -> KVCacheBlock: ...
    @overload
    def __getitem__(self, index: slice) -> list[KVCacheBlock]: ...
    def __getitem__(self, index: int | slice) -> KVCacheBlock | list[KVCacheBlock]:
        if isinstance(index, slice):
            return [self._pool.block(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"block index {index} out of range")
        return self._pool.block(index)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return (self._pool.block(i) for i in range(len(self)))


class _FreeListSentinel:
    """vLLM's ``fake_free_list_head`` / ``fake_free_list_tail`` (``block_id == -1``):
    the ends of the free queue's intrusive links, answered from the core."""

    block_id = -1
    is_null = False

    def __init__(self, pool: BlockPoolCore, is_head: bool) -> None:
        self._pool = pool
        self._is_head = is_head

    @property
    def next_free_block(self) -> Any:
        return self._pool.free_list_end(False) if self._is_head else None

    @property
    def prev_free_block(self) -> Any:
        return None if self._is_head else self._pool.free_list_end(True)


@refuse_unserved(
    kv_cache_utils.FreeKVCacheBlockQueue,
    "the free queue is the core's: blocks leave it through get_new_blocks and touch, and "
    "return through free_blocks",
)
class FreeKVCacheBlockQueue:
    """Read-only view of the core's free queue (head = next block to reuse)."""

    def __init__(self, pool: BlockPoolCore) -> None:
        self._pool = pool
        self.fake_free_list_head = _FreeListSentinel(pool, is_head=True)
        self.fake_free_list_tail = _FreeListSentinel(pool, is_head=False)

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return [self._pool.block(i) for i in self._pool.free_block_ids()]


@refuse_unserved(
    vllm_block_pool.BlockHashToBlockMap,
    "blocks enter the prefix cache through cache_full_blocks / _insert_block_hash",
)
class BlockHashToBlockMap:
    """Read-only view of the core's prefix-cache index."""

    def __init__(self, pool: BlockPoolCore) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_cached_keys

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        """The first-inserted block of a ``BlockHashWithGroupId`` key."""
        return self._pool.get_cached_block(key[:-4], int.from_bytes(key[-4:], "big"))

    def contain(self, key: bytes, block_id: int) -> bool:
        """Whether ``key`` maps to block ``block_id``."""
        return any(b.block_id == block_id for b in _blocks_of(self._pool, key))

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """vLLM's ``pop``: the map forgets ``(key, block_id)``; the block keeps its hash."""
        if self._pool.index_pop(key, block_id):
            return self._pool.block(block_id)
        return None

    @property
    def _cache(self) -> _LiveCache:
        """vLLM's internal dict, live: a key's single block bare, several as
        ``{id: block}`` in insertion order; ``pop(key)`` and restoring with
        ``_cache[key] = value`` work as on vLLM's dict."""
        return _LiveCache(self._pool)


def _blocks_of(pool: BlockPoolCore, key: bytes) -> list[KVCacheBlock]:
    for k, ids in pool.index_items():
        if k == key:
            return [pool.block(i) for i in ids]
    return []


def _value(blocks: list[KVCacheBlock]) -> KVCacheBlock | dict[int, KVCacheBlock]:
    return blocks[0] if len(blocks) == 1 else {b.block_id: b for b in blocks}


class _LiveCache(Mapping[bytes, "KVCacheBlock | dict[int, KVCacheBlock]"]):
    """``BlockHashToBlockMap._cache`` (see ``BlockHashToBlockMap._cache``)."""

    def __init__(self, pool: BlockPoolCore) -> None:
        self._pool = pool

    def _snapshot(self) -> dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]]:
        return {
            key: _value([self._pool.block(i) for i in ids]) for key, ids in self._pool.index_items()
        }

    def __getitem__(self, key: bytes) -> KVCacheBlock | dict[int, KVCacheBlock]:
        blocks = _blocks_of(self._pool, key)
        if not blocks:
            raise KeyError(key)
        return _value(blocks)

    def __iter__(self) -> Iterator[bytes]:
        return iter([key for key, _ in self._pool.index_items()])

    def __len__(self) -> int:
        return int(self._pool.num_cached_keys)

    def __copy__(self) -> dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]]:
        return self._snapshot()

    def __eq__(self, other: object) -> bool:
        return self._snapshot() == other

    __hash__ = None  # type: ignore[assignment]

    def pop(self, key: bytes, *default: Any) -> Any:
        ids = self._pool.index_detach_key(key)
        if not ids:
            if default:
                return default[0]
            raise KeyError(key)
        return _value([self._pool.block(i) for i in ids])

    def __setitem__(self, key: bytes, value: Any) -> None:
        blocks = list(value.values()) if isinstance(value, dict) else [value]
        self._pool.index_reattach(key, [b.block_id for b in blocks])


class _SecondaryKeys(Mapping[int, set[bytes]]):
    """``cached_block_hashes_by_block``: each block's partial-prefix keys."""

    def __init__(self, pool: BlockPoolCore) -> None:
        self._pool = pool

    def __getitem__(self, block_id: int) -> set[bytes]:
        keys = self._pool.secondary_keys(block_id)
        if not keys:
            raise KeyError(block_id)
        return set(keys)

    def __iter__(self) -> Iterator[int]:
        return iter(self._pool.blocks_with_secondary_keys())

    def __len__(self) -> int:
        return len(self._pool.blocks_with_secondary_keys())


@refuse_unserved(
    vllm_block_pool.BlockPool,
    "the core runs the pool's own steps (eviction, events, pinning) inside the calls of "
    "this class and of the KVCacheManager",
)
class BlockPool:
    """vLLM's ``BlockPool`` interface over a ``KVCacheCore``."""

    def __init__(
        self,
        core: KVCacheCore,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
        metrics_collector: Any = None,
    ) -> None:
        if not isinstance(core, KVCacheCore):
            # hscache's pool is a view of a manager's core, not vLLM's constructor.
            raise TypeError(
                f"BlockPool views a KVCacheCore (the manager builds it), got {type(core).__name__}"
            )
        self._core = core
        # The core's device pool; HiSparse's views read block handles through it.
        self.pool_core = pool = BlockPoolCore(core)
        self.metrics_collector = metrics_collector
        self.num_gpu_blocks = pool.num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.medium = medium
        self.blocks = BlockList(pool)
        self.null_block = pool.block(0)
        self.free_block_queue = FreeKVCacheBlockQueue(pool)
        self.cached_block_hash_to_block = BlockHashToBlockMap(pool)
        self.cached_block_hashes_by_block = _SecondaryKeys(pool)
        # With events on, the queue is the core's (the list each call's events are
        # appended to, built by ``EventBuilder`` with the call's request before it
        # returns); this list serves only a pool with events off.
        self._kv_event_queue: list[KVCacheEvent] = []
        self.event_builder = events.make_event_builder(num_hash_lookahead_tokens, medium)

    @property
    def kv_event_queue(self) -> list[KVCacheEvent]:
        """vLLM's event queue: every event so far, in pool-operation order."""
        queue = self._core.core_kv_event_queue()
        return self._kv_event_queue if queue is None else queue

    @kv_event_queue.setter
    def kv_event_queue(self, queue: list[KVCacheEvent]) -> None:
        if not isinstance(queue, list):
            raise TypeError(f"kv_event_queue must be a list, got {type(queue).__name__}")
        if not self._core.core_set_kv_event_queue(queue):
            self._kv_event_queue = queue

    def drain_core_events(self, request: Any | None = None) -> None:
        """Builds the core's queued events (call after every pool-level mutation)."""
        if self.enable_kv_cache_events and self.pool_core.has_events:
            self._core.core_flush_events(request)

    def get_num_free_blocks(self) -> int:
        return self.pool_core.num_free_blocks

    def get_usage(self) -> float:
        return self.pool_core.usage

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference per block; the first block is evicted first."""
        self.pool_core.free_blocks(ordered_blocks)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.pool_core.touch(blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = self.pool_core.get_new_blocks(num_blocks)
        self.drain_core_events()
        return blocks

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

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        self.pool_core.cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            None if block_mask is None else list(block_mask),
        )

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> bytes | None:
        return self.pool_core.cache_partial_block(
            request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes
        )

    def _insert_block_hash(
        self, block_hash_with_group_id: bytes, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        self.pool_core.insert_block_hash(block_hash_with_group_id, block, num_tokens)

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        self.pool_core.move_block_hashes(src_block, dst_block)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.pool_core.evict_blocks(list(block_ids))
        self.drain_core_events()

    def reset_prefix_cache(self) -> bool:
        ok = self.pool_core.reset_prefix_cache()
        self.drain_core_events()
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        return self._core.core_take_pool_events()
