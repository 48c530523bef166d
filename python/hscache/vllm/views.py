"""Read-through views of the core's coordinator and single-type managers.

vLLM's Scheduler, connectors and tests read ``kv_cache_manager.coordinator`` and
``coordinator.single_type_managers[g]`` (block sizes, specs, ``req_to_blocks``,
Mamba's ``_checkpoints``, ...), check their classes (``isinstance(coordinator,
HybridKVCacheCoordinator)``, ``isinstance(manager, CrossAttentionManager)``) and call a
few coordinator methods directly (``get_num_blocks_to_allocate`` for async-load
admission). Each view is an instance of a subclass of vLLM's own class (built by
``coordinator_view`` / ``manager_view``, never running vLLM's ``__init__``) whose
attributes and methods answer from the core at the moment they are read, through the
core's coordinator class (``KVCacheCoordinatorCore``, ``src/python/coordinator.rs``);
the views hold no state of their own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from vllm.v1.core import kv_cache_coordinator as kcc
from vllm.v1.kv_cache_interface import MambaSpec

from hscache._core import KVCacheCoordinatorCore
from hscache.vllm.unserved import refused, unserved_methods

# The views read an ``hscache.vllm.KVCacheManager`` (``KVCacheManager`` below); they take
# it as ``Any`` so that this module does not import the module that imports it.
KVCacheManager = Any


class SpecGroup(NamedTuple):
    """vLLM's ``SpecGroup``: groups of one spec, looked up together."""

    spec: Any
    group_ids: list[int]
    manager_cls: Any
    use_eagle: bool


class _CowQueue:
    """A manager's ``_pending_cow_copies``: appending queues a copy in the core."""

    def __init__(self, core: KVCacheCoordinatorCore, group: int) -> None:
        self._core = core
        self._group = group

    def append(self, pair: tuple[Any, Any]) -> None:
        self._core.push_cow_copy(self._group, pair[0], pair[1])


class _LiveBlockList(list):  # type: ignore[type-arg]
    """``req_to_blocks[request_id]``: vLLM's list is the manager's own and grows in place,
    and callers keep it across steps; this one reads the core's table each time it is
    looked at. After the request is freed it keeps its last contents, as the list vLLM
    pops does. Mutating it changes nothing in the core."""

    __slots__ = ("_core", "_group", "_request_id")

    def __init__(self, core: KVCacheCoordinatorCore, request_id: str, group: int) -> None:
        self._core, self._request_id, self._group = core, request_id, group
        self._sync()

    def _sync(self) -> None:
        blocks = self._core.group_blocks(self._request_id, self._group)
        if blocks is not None:
            list.__setitem__(self, slice(None), blocks)

    def __getitem__(self, index: Any) -> Any:
        self._sync()
        return list.__getitem__(self, index)

    def __len__(self) -> int:
        self._sync()
        return list.__len__(self)

    def __iter__(self) -> Iterator[Any]:
        self._sync()
        return list.__iter__(self)

    def __reversed__(self) -> Iterator[Any]:
        self._sync()
        return list.__reversed__(self)

    def __contains__(self, item: object) -> bool:
        self._sync()
        return list.__contains__(self, item)

    def __eq__(self, other: object) -> bool:
        self._sync()
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None

    def __repr__(self) -> str:
        self._sync()
        return list.__repr__(self)


_SPEC_FIELDS = ("sliding_window", "extra_retained_tokens", "attention_chunk_size")


class SingleTypeManagerView:
    """``coordinator.single_type_managers[g]``: the attributes vLLM code reads."""

    def __init__(
        self, manager: KVCacheManager, core: KVCacheCoordinatorCore, group_id: int
    ) -> None:
        from hscache.vllm.specs import manager_class

        self._manager = manager
        self._core = core
        group = manager.kv_cache_config.kv_cache_groups[group_id]
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = group.kv_cache_spec
        self.manager_cls = manager_class(group)
        self.block_pool = manager.block_pool
        self.enable_caching = manager.enable_caching
        self._null_block = manager.block_pool.null_block
        info = core.group_info(group_id)
        self.block_size: int = info["block_size"]
        self.dcp_world_size: int = info["dcp_world_size"]
        self.pcp_world_size: int = info["pcp_world_size"]
        self._records_new_block_ids: bool = info["records_new_block_ids"]
        self.scheduler_block_size = core.info()["scheduler_block_size"]
        self._pending_cow_copies = _CowQueue(core, group_id)
        spec = self.kv_cache_spec
        # The spec fields vLLM's managers copy in their constructors, which the
        # read-only methods they inherit (`get_num_skipped_tokens`) read.
        for field in _SPEC_FIELDS:
            if hasattr(spec, field):
                setattr(self, field, getattr(spec, field))
        if isinstance(spec, MambaSpec):
            self.mamba_cache_mode = spec.mamba_cache_mode
            self.num_speculative_blocks = spec.num_speculative_blocks

    def _info(self, key: str) -> Any:
        return self._core.group_info(self.kv_cache_group_id)[key]

    @property
    def records_new_block_ids(self) -> bool:
        return self._records_new_block_ids

    @property
    def use_eagle(self) -> bool:
        return bool(self._info("use_eagle"))

    @use_eagle.setter
    def use_eagle(self, value: bool) -> None:
        self._core.set_group_use_eagle(self.kv_cache_group_id, bool(value))

    @property
    def cache_hit_alignment_tokens(self) -> int:
        return int(self._info("cache_hit_alignment_tokens"))

    @property
    def shared_prefix_checkpoint(self) -> bool:
        return bool(self._info("shared_prefix_checkpoint"))

    @property
    def drop_eagle_checkpoint_block(self) -> bool:
        return bool(self._info("drop_eagle_checkpoint_block"))

    @property
    def req_to_blocks(self) -> dict[str, list[Any]]:
        c, g = self._core, self.kv_cache_group_id
        return {rid: _LiveBlockList(c, rid, g) for rid in c.request_ids()}

    @property
    def num_cached_block(self) -> dict[str, int]:
        c, g = self._core, self.kv_cache_group_id
        out = {}
        for rid in c.request_ids():
            n = c.num_cached_block(rid, g)
            if n is not None:
                out[rid] = n
        return out

    @property
    def _partial_hit_reqs(self) -> dict[str, tuple[int, Any]]:
        return dict(self._core.partial_hit_reqs(self.kv_cache_group_id))

    def _mamba(self, key: str) -> Any:
        state = self._core.mamba_state(self.kv_cache_group_id)
        if state is None:
            raise AttributeError(f"group {self.kv_cache_group_id} is not a Mamba group")
        return state[key]

    @property
    def _checkpoints(self) -> dict[str, tuple[int, int]]:
        return dict(self._mamba("checkpoints"))

    @property
    def last_state_block_idx(self) -> dict[str, int]:
        return dict(self._mamba("last_state_block_idx"))

    @property
    def _allocated_block_reqs(self) -> set[str]:
        return set(self._mamba("allocated"))

    @property
    def cached_blocks_this_step(self) -> set[bytes]:
        return set(self._mamba("cached_this_step"))


class CoordinatorView:
    """``kv_cache_manager.coordinator``: what the Scheduler and connectors read."""

    @property
    def retention_interval(self) -> int | None:
        """Sparse-retention granularity (None: dense); settable, as in vLLM."""
        value: int | None = self.coordinator_core.info()["retention_interval"]
        return value

    @retention_interval.setter
    def retention_interval(self, value: int | None) -> None:
        self.coordinator_core.set_retention_interval(value)

    def __init__(self, manager: KVCacheManager, core: KVCacheCoordinatorCore) -> None:
        self._manager = manager
        # The core's coordinator; the manager views and HiSparse's read it too.
        self.coordinator_core = core
        self.kv_cache_config = manager.kv_cache_config
        self.block_pool = manager.block_pool
        info = core.info()
        self.scheduler_block_size: int = info["scheduler_block_size"]
        self.hash_block_size: int = info["hash_block_size"]
        self.num_reprefillable_tokens: int = info["num_reprefillable_tokens"]
        self.enable_partial_hash_hits: bool = info["enable_partial_hash_hits"]
        self.eagle_group_ids: set[int] = set(info["eagle_group_ids"])
        self.drop_eagle_group_ids: set[int] = set(info["drop_eagle_group_ids"])
        self.single_type_managers = tuple(
            manager_view(manager, core, g)
            for g in range(len(manager.kv_cache_config.kv_cache_groups))
        )
        if core.hisparse_layout() is not None:
            # vLLM's HiSparseCoordinator binds itself to its managers; the connector
            # finds it there (`get_hisparse_coordinator`).
            from hscache.vllm import hisparse

            hs = _hisparse_coordinator_view(manager, self.single_type_managers)
            for view in self.single_type_managers:
                if isinstance(view, hisparse.SourceView | hisparse.ResidentView | hisparse.HotView):
                    view.coordinator = hs
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        groups = self.kv_cache_config.kv_cache_groups
        if info["kind"] == "Unitary":
            self.kv_cache_spec = groups[0].kv_cache_spec
            self.block_size = self.single_type_managers[0].block_size
            self.dcp_world_size = self.single_type_managers[0].dcp_world_size
            self.pcp_world_size = self.single_type_managers[0].pcp_world_size
        if info["kind"] == "Hybrid":
            self.full_attention_group_id: int | None = info["full_attention_group_id"]
            self.attention_groups = [
                SpecGroup(
                    groups[ids[0]].kv_cache_spec,
                    list(ids),
                    self.single_type_managers[ids[0]].manager_cls,
                    use_eagle,
                )
                for ids, use_eagle in info["attention_groups"]
            ]

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        return int(self.coordinator_core.info()["cache_hit_alignment_tokens"])

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return int(
            self.coordinator_core.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                num_encoder_tokens,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
                prefill_end,
            )
        )

    def get_blocks(self, request_id: str) -> tuple[list[Any], ...]:
        c = self.coordinator_core
        return tuple(
            c.group_blocks(request_id, g) or [] for g in range(len(self.single_type_managers))
        )

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[Any], ...], int, int]:
        blocks, hit, uncached = self.coordinator_core.find_longest_cache_hit(
            block_hashes, max_cache_hit_length
        )
        return tuple(blocks), hit, uncached

    def find_longest_cache_hit_per_group(
        self, block_hashes: list[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
        blocks, lengths = self.coordinator_core.find_longest_cache_hit_per_group(
            block_hashes, max_cache_hit_length
        )
        return tuple(blocks), tuple(lengths)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self._manager.core_free(request_id)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        self._manager.remove_skipped_blocks(
            request_id, processed_computed_tokens, num_prompt_tokens
        )

    def reset_prefix_cache(self) -> bool:
        """Each pool once (HiSparse's host pool too), as vLLM's coordinator does."""
        return bool(self._manager.core_reset_all_prefix_caches())

    def new_step_starts(self) -> None:
        self._manager.new_step_starts()


_COORDINATORS = {
    "NoPrefixCache": kcc.KVCacheCoordinatorNoPrefixCache,
    "Unitary": kcc.UnitaryKVCacheCoordinator,
    "Hybrid": kcc.HybridKVCacheCoordinator,
}
_VIEW_CLASSES: dict[tuple[type, type], type] = {}
_MIXED: dict[type, type] = {}


def _manager_view_base(cls: Any) -> type:
    """The view base of vLLM manager class ``cls``: HiSparse's managers add their own
    methods (``hscache.vllm.hisparse``) to :class:`SingleTypeManagerView`."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    from hscache.vllm import hisparse

    mixins = {
        stm.HiSparseSourceManager: hisparse.SourceView,
        stm.HiSparseResidentManager: hisparse.ResidentView,
        stm.HiSparseHotManager: hisparse.HotView,
    }
    mixin = mixins.get(cls)
    if mixin is None:
        return SingleTypeManagerView
    if mixin not in _MIXED:
        _MIXED[mixin] = type(
            mixin.__name__, (mixin, SingleTypeManagerView), {"__module__": __name__}
        )
    return _MIXED[mixin]


# vLLM's methods that a view may run as inherited: they only read what the view answers
# (counts, skipped tokens, cacheable lengths), or, for Mamba's partial-tail keying that
# vLLM's own tests call on a manager, write only through the pool view's checked calls
# (`cache_partial_block`; the eviction it may need is refused first). Every other method
# vLLM's class defines and the view does not is refused (`hscache.vllm.unserved`).
_INHERITED = frozenset(
    {
        "get_num_blocks_to_allocate",
        "get_num_skipped_tokens",
        "get_num_cacheable_tokens",
        "_align_cacheable",
        "_has_partial_local_hit",
        "_needs_internal_checkpoint",
        "_cache_partial_tail_block",
    }
)
_INSTEAD = (
    "call the KVCacheManager (allocate_slots, cache_blocks, free, pop_blocks_for_free, "
    "take_new_block_ids, ...) instead"
)


def _view_class(view: type, vllm_cls: type) -> type:
    """``view`` over ``vllm_cls``: vLLM's class for ``isinstance``, the view's members
    first in the MRO, vLLM's methods that would mutate refused."""
    key = (view, vllm_cls)
    if key not in _VIEW_CLASSES:
        # vLLM's own name: code compares `type(x).__name__` too.
        name = vllm_cls.__name__
        members: dict[str, Any] = {"__module__": __name__, "__qualname__": name}
        for attr in unserved_methods(view, vllm_cls, keep=_INHERITED):
            members[attr] = refused(name, attr, _INSTEAD)
        _VIEW_CLASSES[key] = type(name, (view, vllm_cls), members)
    return _VIEW_CLASSES[key]


def manager_view(
    manager: KVCacheManager, core: KVCacheCoordinatorCore, group_id: int
) -> SingleTypeManagerView:
    """The view of group ``group_id``'s manager, an instance of vLLM's manager class."""
    from hscache.vllm.specs import manager_class

    cls = manager_class(manager.kv_cache_config.kv_cache_groups[group_id])
    base = _manager_view_base(cls)
    view_cls = _view_class(base, cls) if cls else SingleTypeManagerView
    view: SingleTypeManagerView = object.__new__(view_cls)
    SingleTypeManagerView.__init__(view, manager, core, group_id)
    host_pool = getattr(manager, "host_block_pool", None)
    layout = core.hisparse_layout()
    if host_pool is not None and layout is not None and layout["host_group"] == group_id:
        view.block_pool = host_pool
        view._null_block = host_pool.null_block
    return view


def coordinator_view(manager: KVCacheManager, core: KVCacheCoordinatorCore) -> CoordinatorView:
    """The coordinator view (of ``core``, ``manager``'s coordinator), an instance of
    vLLM's coordinator class of this layout."""
    kind = core.info()["kind"]
    view: CoordinatorView = object.__new__(_view_class(CoordinatorView, _COORDINATORS[kind]))
    CoordinatorView.__init__(view, manager, core)
    return view


def _hisparse_coordinator_view(manager: Any, managers: tuple[Any, ...]) -> Any:
    """The HiSparse coordinator view, an instance of vLLM's ``HiSparseCoordinator``."""
    from vllm.v1.hisparse import coordinator as vllm_hisparse

    from hscache.vllm.hisparse import HiSparseCoordinatorView

    cls = _view_class(HiSparseCoordinatorView, vllm_hisparse.HiSparseCoordinator)
    view: HiSparseCoordinatorView = object.__new__(cls)
    HiSparseCoordinatorView.__init__(view, manager, managers)
    return view
