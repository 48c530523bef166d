"""Test and benchmark scaffolding shared by hscache's tests, the differential suite and the
benchmark: vLLM 0.33 objects built the way vLLM's engine builds them.

One module per concept (import from the submodule; this package imports none of them, so
that ``import hscache_tools.testing.scheduler_step`` stays free of vLLM):

- :mod:`.kv_cache` — ``KVCacheConfig``s for any list of KV-cache groups (full attention, MLA,
  sliding window and its MLA variant, chunked local, Mamba in each ``mamba_cache_mode``,
  cross attention, sink; EAGLE groups; per-group block sizes) and the scheduler / hash block
  sizes vLLM's engine resolves for them.
- :mod:`.manager` — the keyword arguments vLLM's ``Scheduler`` passes to ``KVCacheManager``.
- :mod:`.requests` — ``vllm.v1.request.Request`` factories (prompt, multimodal features,
  LoRA, cache salt, prompt logprobs, hash algorithm, hash lookahead) and block hashers.
- :mod:`.offline_scheduler` — a real vLLM ``Scheduler`` built offline on CPU (a config-only
  model directory), stub model outputs and a summary of a ``SchedulerOutput``.
- :mod:`.scheduler_step` — the one emulation of ``Scheduler.schedule()``'s calls on a
  ``KVCacheManager`` (running loop with preemption from the tail, FCFS admission), used by
  the differential generator (``tests/vllm_diff/generator.py``) and the benchmark driver
  (``hscache_tools.bench.driver``). Needs no vLLM.

Importing this package sets ``VLLM_TARGET_DEVICE=cpu`` and ``HF_HUB_OFFLINE=1`` unless they
are set: everything here runs vLLM's CPU-side scheduling code offline. The modules that
build vLLM objects need the ``vllm`` extra (``vllm==0.33.0``).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
