"""Deliberately wrong KVCacheManagers (subclasses of vLLM's) used to prove that the
differential harness notices a divergence.  Each one breaks exactly one documented behaviour.

:data:`ALL` break behaviours of any layout; :data:`HYBRID` (mutant -> the layout family of
:data:`vllm_diff.config.FAMILIES` it shows in) break one group type or the interplay of
groups, so that the per-group comparisons are proven too.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core import single_type_kv_cache_manager as stm
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


# One broken rule each of a single-type manager or of the hybrid coordinator.


def _posing_as(base: type):
    """A mutant manager class keeps its base's name: the harness compares class names
    after construction, and only the broken rule should tell the mutant apart."""

    def name(cls: type) -> type:
        cls.__name__, cls.__qualname__ = base.__name__, base.__qualname__
        return cls

    return name


def _swap_manager_class(mgr, base: type, sub: type) -> None:
    """Give ``mgr``'s single-type managers of class ``base`` the class ``sub`` (these
    instances only: vLLM's classes stay intact for the reference manager), including
    the hybrid coordinator's lookup table."""
    for manager in mgr.coordinator.single_type_managers:
        if type(manager) is base:
            manager.__class__ = sub
    groups = getattr(mgr.coordinator, "attention_groups", None)
    for i, group in enumerate(groups or ()):
        if group.manager_cls is base:
            groups[i] = group._replace(manager_cls=sub)


def _managers(mgr, name: str) -> list:
    return [m for m in mgr.coordinator.single_type_managers if type(m).__name__ == name]


@_posing_as(stm.SlidingWindowManager)
class _SlidingWindowWholeWindow(stm.SlidingWindowManager):
    @classmethod
    def _contiguous_blocks_for_hit(cls, window_size, block_size, use_eagle):
        return super()._contiguous_blocks_for_hit(window_size + 1, block_size, use_eagle)


class SlidingWindowHitNeedsWholeWindow(KVCacheManager):
    """Sliding-window hits need cdiv(window, block) contiguous blocks (vLLM:
    cdiv(window - 1, block): the next token attends to window - 1 cached tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_manager_class(self, stm.SlidingWindowManager, _SlidingWindowWholeWindow)


@_posing_as(stm.ChunkedLocalAttentionManager)
class _ChunkedLocalFromZero(stm.ChunkedLocalAttentionManager):
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length,
        kv_cache_group_ids,
        block_pool,
        kv_cache_spec,
        *args,
        **kwargs,
    ):
        one_chunk = dataclasses.replace(kv_cache_spec, attention_chunk_size=1 << 40)
        return super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, one_chunk, *args, **kwargs
        )


class ChunkedLocalLooksUpEarlierChunks(KVCacheManager):
    """Chunked-local hits look blocks up from the start instead of counting the chunks
    before the current one as computed (null blocks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_manager_class(self, stm.ChunkedLocalAttentionManager, _ChunkedLocalFromZero)


class MambaPartialHitWithoutCopy(KVCacheManager):
    """A Mamba hit that ends inside a block shares that block instead of copying it on
    write (no extra block reserved, no copy queued)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for manager in _managers(self, "MambaManager"):
            manager._has_partial_local_hit = lambda blocks, num_tokens: False


class MambaAlignIgnoresSpeculativeBlocks(KVCacheManager):
    """Mamba "align" allocates no speculative (draft) state blocks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for manager in _managers(self, "MambaManager"):
            manager.num_speculative_blocks = 0


class CrossAttentionNotCountedInFit(KVCacheManager):
    """The fit check forgets the cross-attention group's encoder blocks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for manager in _managers(self, "CrossAttentionManager"):
            manager.get_num_blocks_to_allocate = lambda *a, **kw: 0


@_posing_as(stm.CircularBufferManager)
class _RingEveryStep(stm.CircularBufferManager):
    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        new_blocks = self.block_pool.get_new_blocks(1)
        self.req_to_blocks[request_id].extend(new_blocks)
        return new_blocks


class RingClaimsBlockEveryStep(KVCacheManager):
    """A circular buffer claims a new ring block at every allocation (vLLM: one per
    request, kept for its lifetime)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_manager_class(self, stm.CircularBufferManager, _RingEveryStep)


@_posing_as(stm.RSWAManager)
class _RswaFloorGap(stm.RSWAManager):
    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        if num_prompt_tokens is None:
            return super().remove_skipped_blocks(request_id, processed_computed_tokens)
        window_start = max(num_prompt_tokens, processed_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(
            request_id, num_prompt_tokens // self.block_size, window_start // self.block_size
        )


class RswaGapStartsInsidePrompt(KVCacheManager):
    """R-SWA's gap starts at the block holding the prompt's last tokens (floor instead
    of cdiv), freeing prompt KV that stays visible."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_manager_class(self, stm.RSWAManager, _RswaFloorGap)


class _LooksLikeTwoGroups(list):
    def __len__(self):
        return 2


class HybridHitSinglePass(KVCacheManager):
    """The hybrid hit search stops after one pass over the groups (vLLM iterates to a
    fixed point unless the model is full attention + one other type)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        groups = getattr(self.coordinator, "attention_groups", None)
        if groups is not None:
            self.coordinator.attention_groups = _LooksLikeTwoGroups(groups)


class HybridCachesPastTheSchedulerBlock(KVCacheManager):
    """A hybrid model caches every full block of each group, not only up to the
    scheduler block where a hit can land."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator._align_cacheable = lambda num_tokens: num_tokens


HYBRID = {
    FreesGroupsLastFirst: "fa+swa",
    SlidingWindowKeepsOldBlocks: "fa+swa",
    ChunkedLocalKeepsOldChunks: "fa+cl",
    MambaHitsStatesOfThisStep: "fa+mamba-align",
    CrossAttentionIgnoresEncoder: "fa+cross",
    SlidingWindowHitNeedsWholeWindow: "fa+swa",
    ChunkedLocalLooksUpEarlierChunks: "fa+cl",
    MambaPartialHitWithoutCopy: "fa+mamba-align",
    MambaAlignIgnoresSpeculativeBlocks: "fa+mamba-align",
    CrossAttentionNotCountedInFit: "fa+cross",
    RingClaimsBlockEveryStep: "rswa|ring",
    RswaGapStartsInsidePrompt: "rswa|ring",
    HybridHitSinglePass: "fa+swa",
    HybridCachesPastTheSchedulerBlock: "mixed",
}
