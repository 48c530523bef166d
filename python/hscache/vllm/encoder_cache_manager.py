"""vLLM 0.33's encoder-cache managers, backed by the Rust core.

Mirrors ``vllm/v1/core/encoder_cache_manager.py``: ``EncoderCacheManager`` (multimodal
decoder models), ``EncoderDecoderCacheManager`` (encoder-decoder models) and
``compute_mm_encoder_budget``. The bookkeeping (per-identifier entries, per-request
references, the ``freeable`` LRU, eviction, ``freed``) lives in ``src/encoder_cache/``;
the methods vLLM's Scheduler calls are the Rust methods of ``hscache._core.EncoderCacheCore``
with vLLM's signatures (they read ``request.request_id``,
``request.mm_features[input_id].identifier`` and ``request.get_num_encoder_embeds(input_id)``).
This subclass adds the cold parts: ``create_manager``, ``get_manager_metadata`` and read-only
views of vLLM's dicts (``cached``, ``freeable``, ``num_embeds_by_hash``,
``request_cached_ids``, ``request_hash_refs``, ``freed``), each built from the core on access.

How to switch vLLM to it (the Scheduler builds its manager through
``vllm_config.ec_manager_config``): ``--ec-manager-config
'{"encoder_cache_manager_cls": "hscache.vllm.encoder_cache_manager.EncoderCacheManager"}'``.
For encoder-decoder models ``create_manager`` hands back hscache's
``EncoderDecoderCacheManager`` (vLLM's counterpart, which the Scheduler would have chosen).

Differences from vLLM (misuse paths and introspection only):

- ``allocate`` without room, or with an embedding count that differs from the cached
  entry's, raises ``EncoderCacheFullError`` / ``InvalidArgumentError`` (both ``ValueError``)
  and changes nothing; vLLM asserts after it has created the entry.
- ``free`` releases a request's inputs in the order vLLM's Python set iterates them, for every
  input id (the core replays CPython's set table), and ``get_cached_input_ids`` returns a set
  built by replaying the same adds and removes, so the Scheduler's ``_free_encoder_inputs``
  also frees in vLLM's order.
- The views are snapshots: ``cached[h]`` is a new set per access, and mutating it does not
  change the manager. The one write vLLM's tests do, ``manager.cached = {}``, is supported.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from hscache import _core
from hscache._core import EncoderCacheCore, EncoderDecoderCacheCore

if TYPE_CHECKING:
    from vllm.config import SchedulerConfig, VllmConfig

logger = init_logger(__name__)

__all__ = ["EncoderCacheManager", "EncoderDecoderCacheManager", "compute_mm_encoder_budget"]


class EncoderCacheManager(EncoderCacheCore):
    """Drop-in for vLLM's ``EncoderCacheManager``: capacity is counted in encoder embeddings.

    Entries are shared by identifier between requests; an entry no request references is
    ``freeable`` and is evicted, oldest first, only when ``can_allocate`` needs its room.
    """

    @classmethod
    def create_manager(
        cls, *, cache_size: int, vllm_config: VllmConfig | None
    ) -> EncoderCacheManager | EncoderDecoderCacheManager:
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is not None and model_config.is_encoder_decoder:
            return EncoderDecoderCacheManager(cache_size=cache_size)
        return cls(cache_size=cache_size)

    def __init__(self, cache_size: int) -> None:
        """The core was built by ``EncoderCacheCore.__new__`` with ``cache_size``."""

    def get_manager_metadata(self) -> None:
        return None

    @property
    def cached(self) -> Mapping[str, set[str]]:
        """``identifier -> ids of the requests that reference it`` (empty: freeable)."""
        return _CachedView(self)

    @cached.setter
    def cached(self, value: Mapping[str, set[str]]) -> None:
        if len(value):
            raise TypeError("EncoderCacheManager.cached can only be reset to an empty mapping")
        self.core_clear_cached()

    @property
    def freeable(self) -> Mapping[str, int]:
        """``identifier -> num_embeds`` of unreferenced entries, oldest first."""
        return _FreeableView(self)

    @property
    def num_embeds_by_hash(self) -> Mapping[str, int]:
        """``identifier -> num_embeds`` of every entry."""
        return _NumEmbedsView(self)

    @property
    def request_cached_ids(self) -> Mapping[str, set[int]]:
        """``request_id -> cached input ids`` (requests with at least one)."""
        return _RequestCachedIdsView(self)

    @property
    def request_hash_refs(self) -> Mapping[str, dict[str, int]]:
        """``request_id -> identifier -> number of its cached inputs with it``."""
        return _RequestHashRefsView(self)

    @property
    def freed(self) -> list[str]:
        """Identifiers evicted since the last ``get_freed_mm_hashes`` (a copy)."""
        return self.core_freed()


class EncoderDecoderCacheManager(EncoderDecoderCacheCore):
    """Drop-in for vLLM's ``EncoderDecoderCacheManager``: a scheduling-only encoder budget.

    Nothing is shared or ever a hit; every allocated identifier is reported freed by the
    second ``get_freed_mm_hashes`` after its allocation (the worker frees before it runs the
    model). ``allocated`` and ``to_free`` are copies of vLLM's two lists.
    """

    @classmethod
    def create_manager(
        cls, *, cache_size: int, vllm_config: VllmConfig | None
    ) -> EncoderDecoderCacheManager:
        return cls(cache_size=cache_size)

    def __init__(self, cache_size: int) -> None:
        """The core was built by ``EncoderDecoderCacheCore.__new__`` with ``cache_size``."""

    def get_manager_metadata(self) -> None:
        return None


def compute_mm_encoder_budget(
    scheduler_config: SchedulerConfig,
    mm_max_toks_per_item: Mapping[str, int],
) -> tuple[int, int]:
    """vLLM's ``compute_mm_encoder_budget``: ``(encoder_compute_budget, encoder_cache_size)``.

    Both are at least the largest item: an item larger than the cache could never be
    scheduled. ``(0, 0)`` with vLLM's warning when no modality is enabled.
    """
    if not isinstance(mm_max_toks_per_item, Mapping):
        raise TypeError(
            "mm_max_toks_per_item must map modality -> tokens, got "
            f"{type(mm_max_toks_per_item).__name__}"
        )
    if not mm_max_toks_per_item:
        logger.warning(
            "All non-text modalities supported by the model have been explicitly disabled "
            "via limit_mm_per_prompt. Encoder cache will not be initialized."
        )
    try:
        limits = (
            scheduler_config.max_num_encoder_input_tokens,
            scheduler_config.encoder_cache_size,
            scheduler_config.max_num_batched_tokens,
            scheduler_config.disable_chunked_mm_input,
        )
    except AttributeError as e:
        raise TypeError(
            f"expected vLLM's SchedulerConfig, got {type(scheduler_config).__name__}: {e}"
        ) from e
    return _core.compute_mm_encoder_budget(*limits, list(mm_max_toks_per_item.values()))


class _View(Mapping[str, Any]):
    """A read-only mapping over one of the core's maps; nothing is copied until read."""

    __slots__ = ("_core",)

    def __init__(self, core: EncoderCacheCore) -> None:
        self._core = core

    def _get(self, key: str) -> Any:
        raise NotImplementedError

    def _keys(self) -> list[str]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        value = self._get(key) if isinstance(key, str) else None
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._get(key) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


class _CachedView(_View):
    def _get(self, key: str) -> set[str] | None:
        return self._core.core_cached_request_ids(key)

    def _keys(self) -> list[str]:
        return self._core.core_cached_identifiers()


class _FreeableView(_View):
    def _get(self, key: str) -> int | None:
        return self._core.core_freeable_get(key)

    def _keys(self) -> list[str]:
        return [k for k, _ in self._core.core_freeable_items()]

    def __len__(self) -> int:
        return self._core.core_num_freeable_entries()


class _NumEmbedsView(_View):
    def _get(self, key: str) -> int | None:
        return self._core.core_num_embeds_get(key)

    def _keys(self) -> list[str]:
        return [k for k, _ in self._core.core_num_embeds_items()]


class _RequestCachedIdsView(_View):
    def _get(self, key: str) -> set[int] | None:
        return self._core.core_request_cached_ids(key)

    def _keys(self) -> list[str]:
        return self._core.core_request_ids()


class _RequestHashRefsView(_View):
    def _get(self, key: str) -> dict[str, int] | None:
        return self._core.core_request_hash_refs(key)

    def _keys(self) -> list[str]:
        return self._core.core_request_ids()
