"""How a vllm-omni user switches hscache's hidden-state cache on, and its storage.

Environment (read when a runner builds its cache, in the stage's worker process; a
vllm-omni deploy YAML sets it per stage with ``env:`` / ``runtime: env:``):

- ``HSCACHE_OMNI_PREFIX_CACHE=1``: vllm-omni's runners build
  :class:`hscache.omni.OmniHiddenStateCache` where they would build their own
  ``OmniPrefixCacheManager``. :func:`register`, hscache's ``vllm.general_plugins`` entry
  point ``hscache_omni`` (vLLM runs it in every process), puts the switch in vllm-omni's
  runner mixin (``vllm_omni.core.prefix_cache.runner_mixin``) when vllm-omni is installed;
  :func:`install` swaps the class at once instead. Stages without
  ``enable_prefix_caching`` build no cache either way.
- ``HSCACHE_OMNI_STORAGE``: ``pinned`` (page-locked host memory, the default on an
  accelerator: a thinker's rows for every KV slot are ``bytes_per_token`` x the KV pool's
  slots, tens of GB at real sizes), ``device`` (the accelerator holding the model's outputs:
  no copies, accelerator memory) or ``cpu`` (pageable host memory; what ``pinned`` becomes
  without an accelerator).
- ``HSCACHE_OMNI_MAX_UNCONSUMED_STEPS``: how many saved steps may wait for ``materialize``
  or ``discard_step`` at once (default 4, vllm-omni's staging depth). A save beyond it
  waits for one (the async output thread may be behind) up to
  ``HSCACHE_OMNI_STEP_WAIT_S`` seconds (default 30, vllm-omni's), then raises
  :class:`hscache.omni.StepIdError`, the sign of a step id never consumed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from hscache.exceptions import InvalidArgumentError

__all__ = ["OmniSettings", "Storage", "install", "register"]

logger = logging.getLogger(__name__)

Storage = Literal["pinned", "device", "cpu"]
_STORAGES: tuple[Storage, ...] = ("pinned", "device", "cpu")


@dataclass(frozen=True)
class OmniSettings:
    """The cache's options (see the module doc for their environment variables)."""

    enabled: bool = False
    storage: Storage = "pinned"
    max_unconsumed_steps: int = 4
    step_wait_s: float = 30.0

    @classmethod
    def from_env(cls) -> OmniSettings:
        enabled = os.environ.get("HSCACHE_OMNI_PREFIX_CACHE", "0").strip().lower()
        storage = os.environ.get("HSCACHE_OMNI_STORAGE", "pinned").strip().lower()
        if storage not in _STORAGES:
            raise InvalidArgumentError(
                f"HSCACHE_OMNI_STORAGE={storage!r}; expected one of {', '.join(_STORAGES)}"
            )
        steps = os.environ.get("HSCACHE_OMNI_MAX_UNCONSUMED_STEPS", "4")
        try:
            max_steps = int(steps)
        except ValueError:
            max_steps = 0
        if max_steps < 1:
            raise InvalidArgumentError(
                f"HSCACHE_OMNI_MAX_UNCONSUMED_STEPS={steps!r}; expected >= 1"
            )
        wait = os.environ.get("HSCACHE_OMNI_STEP_WAIT_S", "30")
        try:
            step_wait_s = float(wait)
        except ValueError:
            step_wait_s = -1.0
        if not step_wait_s >= 0:
            raise InvalidArgumentError(f"HSCACHE_OMNI_STEP_WAIT_S={wait!r}; expected >= 0")
        return cls(
            step_wait_s=step_wait_s,
            enabled=enabled in ("1", "true", "yes", "on"),
            storage=storage,
            max_unconsumed_steps=max_steps,
        )


def install(force: bool = False) -> bool:
    """Makes vllm-omni's runners build :class:`hscache.omni.OmniHiddenStateCache` instead
    of their own manager, when ``HSCACHE_OMNI_PREFIX_CACHE=1`` (or ``force``). Returns
    whether it did. Call it in every process that runs a model runner (a
    ``vllm_omni.general_plugins`` entry point does); calling it twice is harmless."""
    if not (force or OmniSettings.from_env().enabled):
        return False
    from vllm_omni.core.prefix_cache import runner_mixin

    from hscache.omni.prefix_cache import OmniHiddenStateCache

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
