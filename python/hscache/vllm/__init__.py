"""hscache for vLLM 0.33: a drop-in ``KVCacheManager`` and the schedulers that use it.

``--scheduler-cls hscache.vllm.Scheduler`` (or ``hscache.vllm.AsyncScheduler``)
switches a vLLM server to hscache's manager.
"""

from hscache.vllm.block_pool import BlockPool
from hscache.vllm.kv_cache_manager import KVCacheManager
from hscache.vllm.scheduler import AsyncScheduler, Scheduler

__all__ = ["AsyncScheduler", "BlockPool", "KVCacheManager", "Scheduler"]
