"""The switch: vllm-omni's runners build hscache's cache when the settings say so.

:func:`register` is hscache's ``vllm.general_plugins`` entry point ``hscache_omni``;
:func:`install` switches at once, in code. What the environment says lives in
:mod:`hscache.omni.settings`; the cache itself in :mod:`hscache.omni.prefix_cache`.

Hybrid KV layouts (a sliding-window, chunked-local or Mamba group beside full attention):
vllm-omni 0.30 refuses every layout but one full-attention group, at KV-cache init
(``vllm_omni/core/prefix_cache/group_view.py``, ``check_prefix_cache_kv_groups``: "omni
prefix caching requires a single full-attention kv-cache group; found 2"), and its group
view reads block table 0. While hscache's cache is on, the switch puts hscache's rule in
that check's place (a group that carries full-attention positions must exist,
:func:`hscache.hidden_states.full_attention_group`) and, for a layout of several groups,
hands the runner a view that names that group, whose block tables the cache then follows.
With hscache's cache off, vllm-omni's own check and view run unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from hscache.hidden_states import full_attention_group
from hscache.omni.prefix_cache import OmniHiddenStateCache
from hscache.omni.refusals import install_on_runner
from hscache.omni.settings import OmniSettings

logger = logging.getLogger(__name__)

Enabled = Callable[[], bool]


def _from_env() -> bool:
    return OmniSettings.from_env().enabled


def _always() -> bool:
    return True


class KVGroupView:
    """The runner-facing view of a multi-group layout: the runner's batch order
    (``batch_req_ids``, all :class:`OmniHiddenStateCache` reads of a view) and the KV-cache
    group whose block tables index the rows, with that group's block size."""

    def __init__(self, input_batch: Any, kv_cache_group: int, block_size: int) -> None:
        self._input_batch = input_batch
        self.kv_cache_group = kv_cache_group
        self.block_size = block_size

    def batch_req_ids(self) -> list[str]:
        return list(self._input_batch.req_ids)


def _full_group(kv_cache_groups: Sequence[Any] | None) -> int:
    """The group the cache follows; hscache's ``InvalidArgumentError`` when there is none."""
    return full_attention_group(SimpleNamespace(kv_cache_groups=list(kv_cache_groups or ())))


def _check_kv_groups(original: Any, enabled: Enabled) -> Any:
    """vllm-omni's ``check_prefix_cache_kv_groups``, hscache's rule while its cache is on."""

    def check(kv_cache_groups: Any) -> None:
        if not enabled():
            original(kv_cache_groups)
            return
        _full_group(kv_cache_groups)

    check.hscache_original = original  # type: ignore[attr-defined]
    return check


def _group_view(original: Any, enabled: Enabled) -> Any:
    """vllm-omni's ``get_prefix_cache_group_view``; a :class:`KVGroupView` of the
    full-attention group for a layout of several groups while hscache's cache is on."""

    def view(input_batch: Any, block_size: int, kv_cache_groups: Any = None) -> Any:
        groups = list(kv_cache_groups or ())
        if not enabled() or len(groups) <= 1:
            return original(input_batch, block_size, kv_cache_groups=kv_cache_groups)
        group = _full_group(groups)
        spec = groups[group].kv_cache_spec
        return KVGroupView(input_batch, group, int(getattr(spec, "block_size", block_size)))

    view.hscache_original = original  # type: ignore[attr-defined]
    return view


def _build_manager(original: Any, enabled: Enabled = _from_env) -> Any:
    """What vllm-omni's runner mixin calls to build its cache: hscache's when ``enabled()``
    at that moment (the environment, for the plugin), vllm-omni's own otherwise."""

    def build(config: Any, view: Any, **kwargs: Any) -> Any:
        if not enabled():
            return original(config, view, **kwargs)
        settings = OmniSettings.from_env()
        if isinstance(view, KVGroupView):
            kwargs.setdefault("kv_cache_group", view.kv_cache_group)
            config = SimpleNamespace(num_blocks=config.num_blocks, block_size=view.block_size)
        logger.info(
            "hscache: the hidden-state prefix cache is hscache's (%s storage, KV-cache group %d)",
            settings.storage,
            kwargs.get("kv_cache_group", 0),
        )
        # A refused hit is recomputed where the runner reports its blocks (refusals.py).
        kwargs.setdefault("recompute_refused", install_on_runner())
        return OmniHiddenStateCache(config, view, settings=settings, **kwargs)

    build.hscache_original = original  # type: ignore[attr-defined]
    return build


def _switch(enabled: Enabled) -> None:
    """Puts the three hooks into vllm-omni (once per process: a second call keeps the
    first call's hooks; the originals stay reachable as ``hscache_original``)."""
    from vllm_omni.core.prefix_cache import group_view, runner_mixin

    hooks = (
        (runner_mixin, "OmniPrefixCacheManager", _build_manager),
        (runner_mixin, "get_prefix_cache_group_view", _group_view),
        (group_view, "check_prefix_cache_kv_groups", _check_kv_groups),
    )
    for module, name, hook in hooks:
        current = getattr(module, name)
        if not hasattr(current, "hscache_original"):
            setattr(module, name, hook(current, enabled))


def install(force: bool = False) -> bool:
    """Makes vllm-omni's runners build :class:`hscache.omni.OmniHiddenStateCache` instead
    of their own manager (hybrid layouts included), when ``HSCACHE_OMNI_PREFIX_CACHE=1``
    (or ``force``). Returns whether it did. Call it in every process that runs a model
    runner (a ``vllm_omni.general_plugins`` entry point does); calling it twice is
    harmless."""
    if not (force or OmniSettings.from_env().enabled):
        return False
    from vllm_omni.core.prefix_cache import runner_mixin

    current = runner_mixin.OmniPrefixCacheManager
    if hasattr(current, "hscache_original"):
        # The plugin's hooks read the environment when a cache is built: from now on,
        # hscache's whatever it says. Put the originals back and switch for good.
        _restore()
    _switch(_always)
    return True


def _restore() -> None:
    from vllm_omni.core.prefix_cache import group_view, runner_mixin

    for module, name in (
        (runner_mixin, "OmniPrefixCacheManager"),
        (runner_mixin, "get_prefix_cache_group_view"),
        (group_view, "check_prefix_cache_kv_groups"),
    ):
        current = getattr(module, name)
        setattr(module, name, getattr(current, "hscache_original", current))


def register() -> None:
    """vLLM general plugin (entry point ``hscache_omni``): with vllm-omni installed, its
    runners build their cache through :func:`_build_manager`, and its KV-group check and
    group view defer to hscache's while ``HSCACHE_OMNI_PREFIX_CACHE=1``. Without vllm-omni
    it does nothing; it never raises (a plugin must not break vLLM's start)."""
    try:
        from vllm_omni.core.prefix_cache import group_view, runner_mixin  # noqa: F401
    except Exception:  # no vllm-omni (or one that does not import): nothing to switch
        return
    _switch(_from_env)
