"""The switch: vllm-omni's runners build hscache's cache when the settings say so.

:func:`register` is hscache's ``vllm.general_plugins`` entry point ``hscache_omni``;
:func:`install` swaps vllm-omni's manager class at once. What the environment says lives in
:mod:`hscache.omni.settings`; the cache itself in :mod:`hscache.omni.prefix_cache`.
"""

from __future__ import annotations

import logging
from typing import Any

from hscache.omni.prefix_cache import OmniHiddenStateCache
from hscache.omni.settings import OmniSettings

logger = logging.getLogger(__name__)


def install(force: bool = False) -> bool:
    """Makes vllm-omni's runners build :class:`hscache.omni.OmniHiddenStateCache` instead
    of their own manager, when ``HSCACHE_OMNI_PREFIX_CACHE=1`` (or ``force``). Returns
    whether it did. Call it in every process that runs a model runner (a
    ``vllm_omni.general_plugins`` entry point does); calling it twice is harmless."""
    if not (force or OmniSettings.from_env().enabled):
        return False
    from vllm_omni.core.prefix_cache import runner_mixin

    # The runners build the manager by this module-level name (cfg, group view).
    runner_mixin.OmniPrefixCacheManager = OmniHiddenStateCache
    return True


def _build_manager(original: Any) -> Any:
    """What vllm-omni's runner mixin calls to build its cache: hscache's when the
    environment says so at that moment, vllm-omni's own otherwise."""

    def build(config: Any, view: Any, **kwargs: Any) -> Any:
        settings = OmniSettings.from_env()
        if not settings.enabled:
            return original(config, view, **kwargs)
        from hscache.omni.prefix_cache import OmniHiddenStateCache

        logger.info(
            "hscache: the hidden-state prefix cache is hscache's (%s storage)", settings.storage
        )
        return OmniHiddenStateCache(config, view, settings=settings, **kwargs)

    build.hscache_original = original  # type: ignore[attr-defined]
    return build


def register() -> None:
    """vLLM general plugin (entry point ``hscache_omni``): with vllm-omni installed, its
    runners build their cache through :func:`_build_manager`. Without vllm-omni it does
    nothing; it never raises (a plugin must not break vLLM's start)."""
    try:
        from vllm_omni.core.prefix_cache import runner_mixin
    except Exception:  # no vllm-omni (or one that does not import): nothing to switch
        return
    current = runner_mixin.OmniPrefixCacheManager
    if hasattr(current, "hscache_original"):
        return  # vLLM loads plugins once per process; be idempotent anyway
    runner_mixin.OmniPrefixCacheManager = _build_manager(current)
