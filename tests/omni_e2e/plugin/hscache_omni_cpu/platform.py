"""Test scaffolding (not shipped with hscache): vllm-omni's ``OmniPlatform`` on vLLM's CPU.

``OmniPlatform`` declares its device hooks as ``NotImplementedError`` and comes first in
the MRO, so each is answered here for the CPU; everything else is vLLM's ``CpuPlatform``.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vllm-omni on vLLM's CPU platform: AR stages run :mod:`hscache_omni_cpu.worker`."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "hscache_omni_cpu.worker.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("generation stages (code2wav) are not run on this CPU")

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        from vllm_omni.diffusion.attention.backends.registry import (
            DiffusionAttentionBackendEnum,
        )

        return str(DiffusionAttentionBackendEnum.TORCH_SDPA.get_path())

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: Any = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: Any = None) -> tuple[int, int]:
        mem = psutil.virtual_memory()
        return int(mem.available), int(mem.total)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)
