"""hscache for vLLM 0.33.0 and 0.32.x: a drop-in ``KVCacheManager`` and the schedulers
that use it.

``--scheduler-cls hscache.vllm.Scheduler`` (or ``hscache.vllm.AsyncScheduler``)
switches a vLLM server to hscache's manager.

The names below are imported on first use, not with the package: vLLM imports
``hscache.vllm.plugin`` (the ``vllm.general_plugins`` entry point) in every process,
and that must stay cheap and work, doing nothing, whatever vLLM is installed. Using
any of them with an unsupported vLLM raises ``UnsupportedVllmVersionError``
(``hscache.vllm.version``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hscache.vllm.block_hasher import get_request_block_hasher
    from hscache.vllm.block_pool import BlockPool
    from hscache.vllm.encoder_cache_manager import EncoderCacheManager
    from hscache.vllm.kv_cache_manager import BatchAllocation, KVCacheManager
    from hscache.vllm.parity import ParityError, ParityKVCacheManager
    from hscache.vllm.scheduler import AsyncScheduler, Scheduler

__all__ = [
    "AsyncScheduler",
    "BatchAllocation",
    "BlockPool",
    "EncoderCacheManager",
    "KVCacheManager",
    "ParityError",
    "ParityKVCacheManager",
    "Scheduler",
    "get_request_block_hasher",
]

_MODULE_OF = {
    "AsyncScheduler": "scheduler",
    "BatchAllocation": "kv_cache_manager",
    "BlockPool": "block_pool",
    "EncoderCacheManager": "encoder_cache_manager",
    "KVCacheManager": "kv_cache_manager",
    "ParityError": "parity",
    "ParityKVCacheManager": "parity",
    "Scheduler": "scheduler",
    "get_request_block_hasher": "block_hasher",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from hscache.vllm.version import require

    require()  # a clear error, before vLLM's missing names would make an obscure one
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
