"""Parity mode (``HSCACHE_PARITY=1``) and the vLLM general plugin (``HSCACHE=1``)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import hscache.vllm
import pytest
import vllm
import vllm.plugins
import vllm.v1.core.sched.scheduler as scheduler_module
from hscache.vllm.parity import ParityError, ParityKVCacheManager
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request

from tests.scheduler.test_scheduler_hook import make_scheduler, run_stream


@pytest.mark.parametrize("seed", [0, 1])
def test_parity_mode_runs_a_full_scheduler_trace_without_divergence(
    monkeypatch: pytest.MonkeyPatch, seed: int, model_dir: Path
) -> None:
    monkeypatch.setenv("HSCACHE_PARITY", "1")
    sched = make_scheduler(hscache.vllm.Scheduler, model_dir, 40)
    assert isinstance(sched.kv_cache_manager, ParityKVCacheManager)
    with_parity = run_stream(hscache.vllm.Scheduler, model_dir, seed, 40)
    monkeypatch.delenv("HSCACHE_PARITY")
    assert with_parity == run_stream(scheduler_module.Scheduler, model_dir, seed, 40)


def test_parity_mode_catches_an_injected_divergence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_PARITY", "1")
    m = hscache.vllm.KVCacheManager(**manager_kwargs(full_attention_config(32)))
    assert isinstance(m, ParityKVCacheManager)
    req = make_request("a", list(range(40)))
    blocks, hit, _ = m.get_computed_blocks(req)
    m.allocate_slots(req, 40 - hit, hit, blocks)
    # Corrupt hscache's side behind the parity manager's back: one block leaks.
    m.hscache.block_pool.get_new_blocks(1)
    with pytest.raises(ParityError, match="free blocks"):
        m.free(req)


def test_plugin_is_declared_and_switches_the_stock_scheduler(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    names = {
        ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
    }
    assert names.get("hscache") == "hscache.vllm.plugin:register"
    from hscache.vllm.plugin import scheduler_bindings

    for name in scheduler_bindings():  # restored afterwards
        monkeypatch.setattr(scheduler_module, name, getattr(scheduler_module, name))
    monkeypatch.setenv("HSCACHE", "1")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()  # what EngineCore.__init__ does first
    import vllm.v1.engine.core as engine_core
    from hscache.vllm.block_hasher import uninstall_block_hasher

    try:
        sched = make_scheduler(scheduler_module.Scheduler, model_dir, 64)
        assert isinstance(sched.kv_cache_manager, hscache.vllm.KVCacheManager)
        assert isinstance(sched.encoder_cache_manager, hscache.vllm.EncoderCacheManager)
        # EngineCore's hasher factory is hscache's now.
        hasher = engine_core.get_request_block_hasher(16, __import__("vllm").utils.hashing.sha256)
        assert getattr(hasher, "hscache_algo", None) == "sha256"
    finally:
        uninstall_block_hasher()


def test_plugin_does_nothing_without_the_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from hscache.vllm import plugin

    monkeypatch.delenv("HSCACHE", raising=False)
    saved = scheduler_module.KVCacheManager
    plugin.register()
    assert scheduler_module.KVCacheManager is saved
