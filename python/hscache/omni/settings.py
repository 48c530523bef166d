"""How a vllm-omni user switches hscache's hidden-state cache on, and its storage.

Environment (read when a runner builds its cache, in the stage's worker process; a
vllm-omni deploy YAML sets it per stage with ``env:`` / ``runtime: env:``):

- ``HSCACHE_OMNI_PREFIX_CACHE=1``: vllm-omni's runners build
  :class:`hscache.omni.OmniHiddenStateCache` where they would build their own
  ``OmniPrefixCacheManager``. :func:`hscache.omni.switch.register`, hscache's
  ``vllm.general_plugins`` entry point ``hscache_omni`` (vLLM runs it in every process),
  puts the switch in vllm-omni's runner mixin (``vllm_omni.core.prefix_cache.runner_mixin``)
  when vllm-omni is installed; :func:`hscache.omni.switch.install` swaps the class at once
  instead. Stages without ``enable_prefix_caching`` build no cache either way.
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

import os
from dataclasses import dataclass
from typing import Literal

from hscache.exceptions import InvalidArgumentError

__all__ = ["OmniSettings", "Storage"]


Storage = Literal["pinned", "device", "cpu"]
_STORAGES: tuple[Storage, ...] = ("pinned", "device", "cpu")


@dataclass(frozen=True)
class OmniSettings:
    """The cache's options (see the module doc for their environment variables)."""

    enabled: bool = False
    storage: Storage = "pinned"
    max_unconsumed_steps: int = 4
    step_wait_s: float = 30.0

    @staticmethod
    def enabled_in_env() -> bool:
        """``HSCACHE_OMNI_PREFIX_CACHE`` asks for hscache's cache (the other variables
        unread, so unchecked)."""
        value = os.environ.get("HSCACHE_OMNI_PREFIX_CACHE", "0").strip().lower()
        return value in ("1", "true", "yes", "on")

    @classmethod
    def from_env(cls) -> OmniSettings:
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
            enabled=cls.enabled_in_env(),
            storage=storage,
            max_unconsumed_steps=max_steps,
        )
