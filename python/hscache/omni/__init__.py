"""hscache inside vllm-omni: its hidden-state prefix cache served by hscache.

vllm-omni's AR model runners drive a prefix cache for hidden states and per-token
multimodal outputs through a small interface (``PrefixCacheRunnerMixin``, vllm-omni 0.30):
``register_policy``, per step ``new_step_starts(scheduler_output)``, ``save_outputs(...)``
returning a step id, and exactly one ``materialize(step_id, req_ids)`` or
``discard_step(step_id)`` for it. :class:`OmniHiddenStateCache` implements it on
:class:`hscache.hidden_states.HiddenStateCache`, whose Rust slot mirror (``src/slots/``)
decides which rows are valid for whom; this package is glue: it parses nothing vLLM's
``SchedulerOutput`` carries (the mirror does), holds the consume-once step table and shapes
the results the way vllm-omni's runners expect them.

Switching it on: ``HSCACHE_OMNI_PREFIX_CACHE=1`` in a stage's environment (a deploy YAML's
per-stage ``env:``), read through hscache's vLLM plugin :func:`register`, or :func:`install`
in code, makes vllm-omni's runners build :class:`OmniHiddenStateCache` where they would
build their own ``OmniPrefixCacheManager`` (see :mod:`hscache.omni.switch` and
:mod:`hscache.omni.settings`); prefix caching itself stays vllm-omni's per-stage
``enable_prefix_caching``.

The stage's KV-cache manager is another switch: ``HSCACHE=1`` (hscache's vLLM plugin), or
``scheduler_cls: hscache.omni.OmniARScheduler`` / ``hscache.omni.OmniARAsyncScheduler`` as
a pipeline stage's ``scheduler_cls`` (not the deploy YAML's, which vllm-omni 0.30
overwrites; :mod:`hscache.omni.scheduler`: vllm-omni's schedulers on hscache's manager,
with the fast path). Importing this package needs neither vllm nor vllm-omni, and imports
:mod:`hscache.vllm` (the KV-manager drop-in) only when one of those two names is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hscache.omni.errors import (
    StepIdError,
    UnservableHitError,
    UnsupportedOutputError,
)
from hscache.omni.prefix_cache import OmniHiddenStateCache, StageOutputs
from hscache.omni.settings import OmniSettings
from hscache.omni.switch import install, register

if TYPE_CHECKING:
    from hscache.omni.scheduler import OmniARAsyncScheduler, OmniARScheduler

__all__ = [
    "OmniARAsyncScheduler",
    "OmniARScheduler",
    "OmniHiddenStateCache",
    "OmniSettings",
    "StageOutputs",
    "StepIdError",
    "UnservableHitError",
    "UnsupportedOutputError",
    "install",
    "register",
]

# Imported on first use: they need vLLM and vllm-omni, the names above need neither.
_SCHEDULERS = frozenset({"OmniARScheduler", "OmniARAsyncScheduler"})


def __getattr__(name: str) -> Any:
    if name not in _SCHEDULERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.scheduler"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
