"""Test scaffolding (not shipped with hscache): vllm-omni 0.30 on a CPU-only machine.

vllm-omni 0.30 knows CUDA, ROCm, NPU, XPU and MUSA only; this package gives it an
out-of-tree CPU platform through its ``vllm_omni.platform_plugins`` entry point
(:mod:`hscache_omni_cpu.platform`), a CPU worker and model runner
(:mod:`hscache_omni_cpu.worker`), and a probe that writes, from every engine process,
which KV-cache manager and hidden-state cache served and their counters
(:mod:`hscache_omni_cpu.probe`). ``scripts/omni_e2e.sh`` installs it into the vLLM 0.30
venv; entry points are read in every process, spawned stage processes included.
"""

from __future__ import annotations

import os

PLATFORM = "hscache_omni_cpu.platform.CpuOmniPlatform"


def platform_plugin() -> str | None:
    """vllm-omni's platform hook: the CPU platform when ``HSCACHE_OMNI_CPU=1`` (the e2e run
    sets it), nothing otherwise, so that the installed scaffolding changes no other use of
    the venv."""
    if os.environ.get("HSCACHE_OMNI_CPU") != "1":
        return None
    return PLATFORM
