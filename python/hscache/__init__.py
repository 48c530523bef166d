"""hscache: Rust-core cache bookkeeping for LLM serving engines.

``hscache.vllm`` holds the drop-in ``KVCacheManager`` and ``Scheduler`` for vLLM;
``hscache._core`` is the compiled extension they drive. ``stats()`` returns the
per-operation latency counters of the drop-in (on with ``enable_stats()`` or
``HSCACHE_STATS=1``) and explain mode's summary; ``explain(request_id)`` says why a
request's last prefix-cache lookup stopped where it did (managers built with
``explain=True`` or ``HSCACHE_EXPLAIN=1``). Where each concept lives (Rust file,
binding, module, tests): the concept map in ``docs/architecture.md``.
"""

import os as _os

from hscache._core import (
    KVCacheBlock,
    KVCacheBlocks,
    KVCacheCore,
    __version__,
    build_profile,
    enable_stats,
    reset_stats,
)
from hscache.explanations import Explanation, explain
from hscache.observability import stats

if _os.environ.get("HSCACHE_STATS", "0").lower() in ("1", "true", "yes", "on"):
    enable_stats()

__all__ = [
    "Explanation",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheCore",
    "__version__",
    "build_profile",
    "enable_stats",
    "explain",
    "reset_stats",
    "stats",
]
