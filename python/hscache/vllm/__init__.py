"""hscache for vLLM 0.33: a drop-in ``KVCacheManager`` and the schedulers that use it.

``--scheduler-cls hscache.vllm.Scheduler`` (or ``hscache.vllm.AsyncScheduler``)
switches a vLLM server to hscache's manager.
"""

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
