"""The two managers of ``python -m hscache bench`` and the requests they are fed.

Owns the manager classes' names (``--reference`` / ``--candidate``) and their import
(:func:`load_class`), the construction of a manager for a scenario exactly as vLLM's
Scheduler constructs one (the scenario's pool as one full-attention group with a realistic
page: 8 KV heads of 128, bfloat16), and :class:`RequestFactory`, which builds each side's own
``vllm.v1.request.Request`` objects from the trace's specs. The vLLM objects come from
:mod:`hscache.testing`; vLLM is imported only when a manager is loaded or built.
"""

from __future__ import annotations

import importlib
from typing import Any

import hscache.testing  # noqa: F401 (vLLM's CPU / offline environment defaults)
from hscache.bench.scenarios import RequestSpec, Scenario

__all__ = [
    "CANDIDATE_SPEC",
    "REFERENCE_SPEC",
    "RequestFactory",
    "build_manager",
    "load_class",
    "manager_kwargs",
    "scenario_kv_cache_config",
]

REFERENCE_SPEC = "vllm.v1.core.kv_cache_manager:KVCacheManager"
CANDIDATE_SPEC = "hscache.vllm:KVCacheManager"


def load_class(spec: str) -> type:
    """Import ``module:Class`` (or ``module.Class``) and return the class."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:Class', got {spec!r}")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{spec} is not a class")
    return obj


def scenario_kv_cache_config(scenario: Scenario) -> Any:
    """The scenario's pool: one full-attention group of ``scenario.num_blocks`` blocks."""
    import torch

    from hscache.testing.kv_cache import full_attention, group, kv_cache_config

    spec = full_attention(scenario.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return kv_cache_config([group(spec, "model.layers.0.self_attn")], scenario.num_blocks)


def manager_kwargs(scenario: Scenario) -> dict[str, Any]:
    """The keywords vLLM's Scheduler passes to ``KVCacheManager`` for this scenario."""
    from hscache.testing.manager import manager_kwargs as scheduler_manager_kwargs

    return scheduler_manager_kwargs(
        scenario_kv_cache_config(scenario),
        max_model_len=scenario.max_model_len,
        max_in_flight_tokens=scenario.token_budget,
        enable_caching=True,
        log_stats=True,
        enable_kv_cache_events=scenario.kv_events,
    )


def build_manager(cls: type, scenario: Scenario) -> Any:
    """Construct a manager of class ``cls`` exactly as the Scheduler would."""
    return cls(**manager_kwargs(scenario))


class RequestFactory:
    """Builds pairs of identical ``Request`` objects (one per side) from trace specs, hashed
    by vLLM's sha256 block hasher (``NONE_HASH`` seeded for it)."""

    def __init__(self, scenario: Scenario) -> None:
        from hscache.testing import requests

        requests.init_none_hash("sha256")
        self._hasher = requests.request_block_hasher(scenario.block_size, "sha256")
        self._make = requests.make_request

    def build(self, spec: RequestSpec) -> Any:
        return self._make(
            spec.request_id,
            spec.prompt,
            max_tokens=len(spec.output),
            block_hasher=self._hasher,
            arrival_time=0.0,
        )
