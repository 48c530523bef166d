"""Deliberately wrong KVCacheManagers (subclasses of vLLM's) used to prove that the
differential harness notices a divergence.  Each one breaks exactly one documented behaviour.

:data:`ALL` break behaviours of any layout; :data:`HYBRID` (mutant -> the layout family of
:data:`vllm_diff.config.FAMILIES` it shows in) break one group type or the interplay of
groups, so that the per-group comparisons are proven too.
"""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager


class FreeForwardOrder(KVCacheManager):
    """free() returns blocks in table order instead of reverse order (wrong LRU tie-break)."""

    def free(self, request):
        blocks = self.coordinator.pop_blocks_for_free(request.request_id)
        self.block_pool.free_blocks(blocks)


class HitOneBlockShort(KVCacheManager):
    """get_computed_blocks forgets the last block of a multi-block hit."""

    def get_computed_blocks(self, request, max_cache_hit_length=None):
        blocks, hit, boundary = super().get_computed_blocks(request, max_cache_hit_length)
        ids = blocks.blocks[0]
        if len(ids) >= 2:
            bs = self.coordinator.single_type_managers[0].block_size
            return KVCacheBlocks((list(ids[:-1]),)), hit - bs, boundary
        return blocks, hit, boundary


class DropRemovedEvents(KVCacheManager):
    """take_events() loses BlockRemoved events."""

    def take_events(self):
        return [e for e in super().take_events() if not isinstance(e, BlockRemoved)]


class UsageCountsNullBlock(KVCacheManager):
    """usage divides by all blocks instead of excluding the null block."""

    @property
    def usage(self):
        n = self.block_pool.num_gpu_blocks
        return 1.0 - self.block_pool.get_num_free_blocks() / n


class EvictIsNoop(KVCacheManager):
    """evict_blocks() does nothing."""

    def evict_blocks(self, block_ids):
        return None


class StatsIgnorePreemption(KVCacheManager):
    """record_prefix_cache_stats counts resumed (preempted) requests as new ones."""

    def record_prefix_cache_stats(self, request, num_hits):
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=False
        )


class ReadsCacheDespiteLogprobs(KVCacheManager):
    """Ignores request.skip_reading_prefix_cache (prompt_logprobs requests)."""

    def prefix_cache_lookup_enabled(self, request):
        return self.enable_caching


class IgnoresLookahead(KVCacheManager):
    """allocate_slots does not reserve num_lookahead_tokens slots."""

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        kwargs["num_lookahead_tokens"] = 0
        if len(args) >= 3:
            args = (*args[:2], 0, *args[3:])
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


class FreshEmptyBlocks(KVCacheManager):
    """Returns a new empty KVCacheBlocks instead of the `empty_kv_cache_blocks` singleton."""

    def create_kv_cache_blocks(self, blocks):
        if any(blocks):
            return KVCacheBlocks(blocks)
        return KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))


class LateFullHitCap(KVCacheManager):
    """Lets a fully cached prompt hit all its tokens (forgets the num_tokens - 1 cap)."""

    def get_computed_blocks(self, request, max_cache_hit_length=None):
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens
        return super().get_computed_blocks(request, max_cache_hit_length)


class _LatestFirstMap(BlockHashToBlockMap):
    def get_one_block(self, key):
        blocks = self._cache.get(key)
        if isinstance(blocks, dict):
            return next(reversed(blocks.values()))
        return blocks


class DuplicateLookupReturnsLatest(KVCacheManager):
    """Among duplicate cached blocks, lookups return the most recently cached one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_pool.cached_block_hash_to_block.__class__ = _LatestFirstMap

    def reset_prefix_cache(self):
        ok = super().reset_prefix_cache()
        self.block_pool.cached_block_hash_to_block.__class__ = _LatestFirstMap
        return ok


def _override_kw(args, kwargs, name, index, value):
    """Force one allocate_slots parameter (positional index after num_new_tokens)."""
    if len(args) > index:
        args = (*args[:index], value, *args[index + 1 :])
    else:
        kwargs[name] = value
    return args, kwargs


class IgnoresWatermark(KVCacheManager):
    """Admission ignores the watermark."""

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        saved, self.watermark_blocks = self.watermark_blocks, 0
        try:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        finally:
            self.watermark_blocks = saved


class IgnoresReservedBlocks(KVCacheManager):
    """allocate_slots ignores reserved_blocks (async KV loads)."""

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        args, kwargs = _override_kw(args, kwargs, "reserved_blocks", 7, 0)
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


class IgnoresFullSequenceMustFit(KVCacheManager):
    """allocate_slots ignores full_sequence_must_fit."""

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        args, kwargs = _override_kw(args, kwargs, "full_sequence_must_fit", 6, False)
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


class NoEagleBlockDrop(KVCacheManager):
    """With EAGLE, the last matched block is not dropped from hits."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator.drop_eagle_group_ids = set()  # vLLM 0.33 drops for these groups
        self.coordinator.eagle_group_ids = set()  # vLLM 0.32 for these


class CachesReprefillableTokens(KVCacheManager):
    """Multi-module MTP: caches the last num_prefill_lookahead - 1 tokens too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator.get_num_cacheable_tokens = lambda n, group_id: n


class ParentHashAlwaysNone(KVCacheManager):
    """BlockStored events lose their parent_block_hash."""

    def take_events(self):
        events = super().take_events()
        for e in events:
            if isinstance(e, BlockStored):
                e.parent_block_hash = None
        return events


class TouchesHitsOnFailure(KVCacheManager):
    """A failed allocation still touches (and so re-queues) its hit blocks."""

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        res = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        hits = kwargs.get("new_computed_blocks") or (args[1] if len(args) > 1 else None)
        if res is None and hits is not None and hits.blocks[0]:
            blocks = list(hits.blocks[0])
            self.block_pool.touch(blocks)
            self.block_pool.free_blocks(reversed(blocks))
        return res


ALL = [
    FreeForwardOrder,
    HitOneBlockShort,
    DropRemovedEvents,
    UsageCountsNullBlock,
    EvictIsNoop,
    StatsIgnorePreemption,
    ReadsCacheDespiteLogprobs,
    IgnoresLookahead,
    FreshEmptyBlocks,
    LateFullHitCap,
    DuplicateLookupReturnsLatest,
    IgnoresWatermark,
    IgnoresReservedBlocks,
    IgnoresFullSequenceMustFit,
    NoEagleBlockDrop,
    CachesReprefillableTokens,
    ParentHashAlwaysNone,
    TouchesHitsOnFailure,
]


# ------------------------------------------------------------------ hybrid layouts


class FreesGroupsLastFirst(KVCacheManager):
    """free() returns the groups' blocks last group first (vLLM: group order)."""

    def free(self, request):
        for manager in reversed(self.coordinator.single_type_managers):
            manager.free(request.request_id)


class SlidingWindowKeepsOldBlocks(KVCacheManager):
    """Sliding-window groups never free the blocks that left the window."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for manager in self.coordinator.single_type_managers:
            if type(manager).__name__ == "SlidingWindowManager":
                manager.get_num_skipped_tokens = lambda n: 0


class ChunkedLocalKeepsOldChunks(KVCacheManager):
    """Chunked-local groups never free the blocks of earlier chunks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for manager in self.coordinator.single_type_managers:
            if type(manager).__name__ == "ChunkedLocalAttentionManager":
                manager.get_num_skipped_tokens = lambda n: 0


class _NoSet(set):
    def add(self, item):
        return None


class MambaHitsStatesOfThisStep(KVCacheManager):
    """Mamba groups let a request hit a state another request cached in the same step
    (vLLM defers it to the next step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for manager in self.coordinator.single_type_managers:
            if hasattr(manager, "cached_blocks_this_step"):
                manager.cached_blocks_this_step = _NoSet()

    def new_step_starts(self):
        super().new_step_starts()
        for manager in self.coordinator.single_type_managers:
            if hasattr(manager, "cached_blocks_this_step"):
                manager.cached_blocks_this_step = _NoSet()


class CrossAttentionIgnoresEncoder(KVCacheManager):
    """allocate_slots ignores num_encoder_tokens (no cross-attention blocks)."""

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        args, kwargs = _override_kw(args, kwargs, "num_encoder_tokens", 5, 0)
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


HYBRID = {
    FreesGroupsLastFirst: "fa+swa",
    SlidingWindowKeepsOldBlocks: "fa+swa",
    ChunkedLocalKeepsOldChunks: "fa+cl",
    MambaHitsStatesOfThisStep: "fa+mamba-align",
    CrossAttentionIgnoresEncoder: "fa+cross",
}
