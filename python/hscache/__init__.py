"""hscache: Rust-core cache bookkeeping for LLM serving engines.

``hscache.vllm`` holds the drop-in ``KVCacheManager`` and ``Scheduler`` for vLLM;
``hscache._core`` is the compiled extension they drive.
"""

from hscache._core import KVCacheBlock, KVCacheCore, __version__, build_profile

__all__ = ["KVCacheBlock", "KVCacheCore", "__version__", "build_profile"]
