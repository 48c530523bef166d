"""Opt-in retention policies through ``hscache.vllm.KVCacheManager``: selection
(keyword, environment, errors), the per-request hints of ``extra_args`` and each
policy's effect on which prompt survives memory pressure (``src/pool/retention/``;
the ordering properties are Rust property tests, ``tests/core/retention.rs``)."""

from __future__ import annotations

from typing import Any

import pytest
from hscache import exceptions
from hscache.vllm import KVCacheManager
from hscache.vllm.kv_cache_manager import RetentionKVCacheManager
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request

_BLOCK = 16
_counter = iter(range(10**9))


def _manager(retention: Any = None, num_blocks: int = 11) -> Any:
    kwargs = manager_kwargs(full_attention_config(num_blocks))
    if retention is not None:
        kwargs["retention"] = retention
    return KVCacheManager(**kwargs)


def _serve(m: Any, prompt: list[int], **extra: Any) -> int:
    """Admits, then frees, one request; returns its prefix-hit tokens."""
    req = make_request(f"r{next(_counter)}", prompt, extra_args=extra or None)
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    m.free(req)
    return int(hit)


def _prompt(seed: int, blocks: int = 3) -> list[int]:
    # `blocks` full blocks plus one token: every full block is cacheable and hittable.
    return [seed * 1000 + i for i in range(blocks * _BLOCK + 1)]


def test_lru_is_the_default_and_the_plain_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HSCACHE_RETENTION", raising=False)
    m = _manager()
    assert type(m) is KVCacheManager and m.retention_policy == "lru"
    assert m.retention_stats() == {"policy": "lru"}
    assert type(_manager("lru")) is KVCacheManager


def test_environment_and_keyword_select_a_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_RETENTION", "slru")
    m = _manager()
    assert isinstance(m, RetentionKVCacheManager) and m.retention_policy == "slru"
    assert _manager("priority").retention_policy == "priority"
    assert _manager({"policy": "ttl", "ttl_s": 5}).retention_policy == "ttl"
    with pytest.raises(exceptions.InvalidArgumentError):
        _manager("mru")
    with pytest.raises(exceptions.InvalidArgumentError):
        _manager({"policy": "pin", "bogus": 1})


def test_bad_hints_are_value_errors() -> None:
    m = _manager("priority")
    req = make_request("bad", _prompt(1), extra_args={"hscache_priority": 101})
    m.allocate_slots(req, req.num_tokens)
    with pytest.raises(ValueError, match="priority"):
        m.free(req)


def _pressure(m: Any, first: int, count: int) -> None:
    for seed in range(first, first + count):
        _serve(m, _prompt(seed, blocks=2))


def test_priority_keeps_the_high_priority_prompt() -> None:
    for policy, survives in (("lru", False), ("priority", True)):
        m = _manager(policy)
        _serve(m, _prompt(1), hscache_priority=80)
        _serve(m, _prompt(2), hscache_priority=20)
        # 10 usable blocks, 6 cached: a 6-block request evicts 2 cached blocks.
        _serve(m, _prompt(3, blocks=5), hscache_priority=20)
        assert (_serve(m, _prompt(1)) == 3 * _BLOCK) is survives, policy


def test_priority_duration_runs_out() -> None:
    m = _manager("priority")
    _serve(m, _prompt(1), hscache_priority=80, hscache_retention_s=10)
    _serve(m, _prompt(2), hscache_priority=50)
    m.retention_advance_clock(11)  # prompt 1 falls back to the default 35 < 50
    _serve(m, _prompt(3, blocks=5), hscache_priority=50)
    assert _serve(m, _prompt(2)) == 3 * _BLOCK
    assert _serve(m, _prompt(1)) < 3 * _BLOCK
    assert m.retention_stats()["expirations"] >= 3


def test_pinned_prompt_survives_until_unpinned() -> None:
    m = _manager({"policy": "pin", "max_pinned_blocks": 3})
    _serve(m, _prompt(1), hscache_pin=True)
    assert m.retention_stats()["pinned_blocks"] == 3
    assert m.block_pool.get_num_free_blocks() == 7  # pinned blocks are not free
    _pressure(m, 10, 6)
    assert _serve(m, _prompt(1)) == 3 * _BLOCK
    m.retention_unpin_all()
    assert m.block_pool.get_num_free_blocks() == 10
    _pressure(m, 20, 6)
    assert _serve(m, _prompt(1)) == 0


def test_pin_cap_refuses_extra_pins() -> None:
    m = _manager({"policy": "pin", "max_pinned_blocks": 2})
    _serve(m, _prompt(1), hscache_pin=True)
    stats = m.retention_stats()
    assert stats["pinned_blocks"] == 2 and stats["pins_refused"] == 1


def test_ttl_protects_then_expires() -> None:
    m = _manager({"policy": "ttl", "ttl_s": 30})
    _serve(m, _prompt(1))
    _serve(m, _prompt(2), hscache_retention_s=0)  # unprotected
    _serve(m, _prompt(3, blocks=2), hscache_retention_s=0)
    assert _serve(m, _prompt(1)) == 3 * _BLOCK
    m.retention_advance_clock(31)
    _pressure(m, 10, 6)  # new prompts are protected, prompt 1 no longer is
    assert _serve(m, _prompt(1)) < 3 * _BLOCK


def test_slru_keeps_a_reused_prompt_through_a_scan() -> None:
    for policy, survives in (("lru", False), ("slru", True)):
        m = _manager(policy)
        _serve(m, _prompt(1))
        _serve(m, _prompt(1))  # a second use: protected under SLRU
        _pressure(m, 10, 4)  # one-off prompts
        assert (_serve(m, _prompt(1)) == 3 * _BLOCK) is survives, policy


def test_lru_hint_keys_change_nothing() -> None:
    """Hints are read only under a non-LRU policy: with lru the queue is vLLM's."""
    a, b = _manager(), _manager()
    for seed in range(6):
        _serve(a, _prompt(seed))
        _serve(b, _prompt(seed), hscache_priority=90, hscache_pin=True)
    queue = [x.block_id for x in a.block_pool.free_block_queue.get_all_free_blocks()]
    assert queue == [x.block_id for x in b.block_pool.free_block_queue.get_all_free_blocks()]
