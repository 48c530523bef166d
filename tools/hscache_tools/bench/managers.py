"""The two managers of ``python -m hscache bench`` and the requests they are fed.

Owns the manager classes' names (``--reference`` / ``--candidate``) and their import
(:func:`load_class`), the construction of a manager for a scenario exactly as vLLM's
Scheduler constructs one (the scenario's pool as one full-attention group with a realistic
page: 8 KV heads of 128, bfloat16), and :class:`RequestFactory`, which builds each side's own
``vllm.v1.request.Request`` objects from the trace's specs. The vLLM objects come from
:mod:`hscache_tools.testing`; vLLM is imported only when a manager is loaded or built.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any

import hscache_tools.testing  # noqa: F401 (vLLM's CPU / offline environment defaults)
from hscache_tools.bench.scenarios import RequestSpec, Scenario

__all__ = [
    "CANDIDATE_SPEC",
    "REFERENCE_SPEC",
    "RequestFactory",
    "build_manager",
    "candidate_events",
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

    from hscache_tools.testing.kv_cache import full_attention, group, kv_cache_config

    spec = full_attention(scenario.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return kv_cache_config([group(spec, "model.layers.0.self_attn")], scenario.num_blocks)


def manager_kwargs(scenario: Scenario, candidate: bool = False) -> dict[str, Any]:
    """The keywords vLLM's Scheduler passes to ``KVCacheManager`` for this scenario (for the
    candidate: without events when ``scenario.candidate_events`` is ``"off"``)."""
    from hscache_tools.testing.manager import manager_kwargs as scheduler_manager_kwargs

    return scheduler_manager_kwargs(
        scenario_kv_cache_config(scenario),
        max_model_len=scenario.max_model_len,
        max_in_flight_tokens=scenario.token_budget,
        enable_caching=True,
        log_stats=True,
        enable_kv_cache_events=events_on(scenario, candidate),
    )


def events_on(scenario: Scenario, candidate: bool) -> bool:
    """Whether that side's manager is built with KV events."""
    return scenario.kv_events and not (candidate and scenario.candidate_events == "off")


@contextlib.contextmanager
def candidate_events(scenario: Scenario) -> Iterator[None]:
    """``HSCACHE_KV_EVENTS`` as the candidate is built (read once, at construction): how any
    manager vLLM's Scheduler builds, or ``--candidate`` names, is put in compact mode."""
    name = "HSCACHE_KV_EVENTS"
    saved = os.environ.get(name)
    os.environ[name] = "compact" if scenario.candidate_events == "compact" else "vllm"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def build_manager(cls: type, scenario: Scenario, candidate: bool = False) -> Any:
    """Construct a manager of class ``cls`` exactly as the Scheduler would."""
    if not candidate:
        return cls(**manager_kwargs(scenario))
    with candidate_events(scenario):
        return cls(**manager_kwargs(scenario, candidate=True))


class RequestFactory:
    """Builds pairs of identical ``Request`` objects (one per side) from trace specs, hashed
    by vLLM's sha256 block hasher (``NONE_HASH`` seeded for it)."""

    def __init__(self, scenario: Scenario) -> None:
        from hscache_tools.testing import requests

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
