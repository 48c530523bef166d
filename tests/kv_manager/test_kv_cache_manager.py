"""The drop-in ``hscache.vllm.KVCacheManager``: identity of block handles, bad input,
fallback to vLLM for unsupported configurations, and the Scheduler hook."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache import exceptions
from hscache._core import BlockPoolCore, KVCacheCore
from hscache.vllm import KVCacheManager
from hscache_tools.testing.kv_cache import (
    full_attention,
    full_attention_config,
    kv_cache_config,
    mamba,
    sliding_window,
)
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.kv_cache_interface import KVCacheGroupRole

# Two KV-cache groups (full attention + a 64-token sliding window), block size 16.
_FULL_AND_SLIDING_WINDOW = kv_cache_config([full_attention(16), sliding_window(16, 64)], 32)


def _state(m: KVCacheManager) -> tuple[list[int], float, dict[str, list[int]]]:
    queue = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    tables = {
        rid: [b.block_id for b in blocks]
        for rid, blocks in m.coordinator.single_type_managers[0].req_to_blocks.items()
    }
    return queue, m.usage, tables


def _admit(m: KVCacheManager, req) -> None:
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None


def test_block_handles_are_identity_stable() -> None:
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = make_request("a", list(range(40)))
    new = m.allocate_slots(req, 40)
    assert new is not None
    first = new.blocks[0][0]
    assert first is m.block_pool.blocks[first.block_id]
    assert m.get_blocks("a").blocks[0][0] is first
    assert m.block_pool.null_block is m.block_pool.blocks[0]
    assert m.block_pool.null_block.is_null and not first.is_null
    assert first.ref_cnt == 1 and first.block_hash is not None
    assert first.block_hash_num_tokens == 16


def test_vllm_prefill_expectations() -> None:
    """The block ids and free-queue order vLLM's test_prefill asserts."""
    m = KVCacheManager(**manager_kwargs(full_attention_config(11)))
    common = list(range(48))
    r0 = make_request("0", common + list(range(100, 107)))
    _admit(m, r0)
    assert m.get_block_ids("0") == ([1, 2, 3, 4],)
    r1 = make_request("1", common + list(range(200, 205)))
    blocks, hit, _ = m.get_computed_blocks(r1)
    assert hit == 48 and blocks.get_block_ids() == ([1, 2, 3],)
    new = m.allocate_slots(r1, 5, hit, blocks)
    assert new is not None and new.get_block_ids() == ([5],)
    m.free(r0)
    m.free(r1)
    assert _state(m)[0] == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda m, r: m.allocate_slots(r, -1), exceptions.InvalidArgumentError),
        (lambda m, r: m.allocate_slots(r, 10**6), exceptions.InvalidArgumentError),
        (lambda m, r: m.allocate_slots(r, 0), ValueError),
        (lambda m, r: m.evict_blocks({10**6}), exceptions.BlockIdError),
        (lambda m, r: m.evict_blocks({-1}), exceptions.BlockIdError),
        (
            lambda m, r: m.block_pool.free_blocks([m.block_pool.blocks[9]]),
            exceptions.DoubleFreeError,
        ),
        (lambda m, r: m.record_blocks_for_zeroing("a", -3), exceptions.InvalidArgumentError),
        (lambda m, r: m.block_pool.free_blocks([object()]), exceptions.InvalidArgumentError),
        # Sizes far past the pool fail cleanly (no giant allocation up front).
        (lambda m, r: m.block_pool.get_new_blocks(2**40), exceptions.OutOfBlocksError),
        (lambda m, r: m.get_blocks("a") + _other_pool_blocks(), exceptions.InvalidArgumentError),
    ],
)
def test_bad_input_raises_and_leaves_state_unchanged(call, exc) -> None:
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = make_request("a", list(range(40)))
    _admit(m, req)
    before = _state(m)
    with pytest.raises(exc):
        call(m, req)
    assert _state(m) == before
    m.check_invariants()


def _other_pool_blocks():
    other = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = make_request("b", list(range(40)))
    _admit(other, req)
    return other.get_blocks("b")


@pytest.mark.parametrize(
    "kwargs",
    [{"block_size": 0}, {"block_size": 2**21}, {"max_model_len": 2**33}, {"num_blocks": 2**31}],
)
def test_constructor_bounds_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        _bare_core(**kwargs)


def test_largest_pool_beyond_memory_raises_memory_error() -> None:
    """The largest accepted pool (2**31 - 1 blocks) on a machine without the memory for its
    per-block tables is MemoryError, not an abort ("memory allocation ... failed"): run in
    a child process under an address-space limit set after the imports."""
    code = (
        "import resource\n"
        "from hscache.vllm import KVCacheManager\n"
        "from hscache_tools.testing.kv_cache import full_attention_config\n"
        "from hscache_tools.testing.manager import manager_kwargs\n"
        "kwargs = manager_kwargs(full_attention_config(2**31 - 1))\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, hard))\n"
        "try:\n"
        "    KVCacheManager(**kwargs)\n"
        "except MemoryError as e:\n"
        "    print('MemoryError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("MemoryError: memory allocation of"), out.stdout


def _bare_core(num_blocks: int = 16, block_size: int = 16, max_model_len: int = 256) -> Any:
    group = {
        "kind": "full_attention",
        "block_size": block_size,
        "dcp_sharded": True,
        "prefix_cacheable": True,
        "is_eagle_group": False,
        "is_full_attention_spec": True,
        "is_attention_spec": True,
        "is_cross_or_encoder_only": False,
        "spec_class": 0,
    }
    return KVCacheCore(
        num_blocks=num_blocks,
        groups=[group],
        max_model_len=max_model_len,
        scheduler_block_size=max(block_size, 1),
        hash_block_size=max(block_size, 1),
    )


def test_bare_core_refuses_before_allocating() -> None:
    """A ``KVCacheCore`` without vLLM bindings cannot build results: it fails first."""
    core = _bare_core()
    pool = BlockPoolCore(core)
    free = pool.num_free_blocks
    with pytest.raises(RuntimeError, match="_bind_vllm"):
        core.allocate_slots(make_request("x", list(range(20))), 20)
    assert pool.num_free_blocks == free


def test_malformed_block_hashes_raise_before_any_change() -> None:
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = make_request("a", list(range(40)))
    req.block_hashes[1] = b"x" * 40  # longer than any vLLM digest
    before = _state(m)
    with pytest.raises(exceptions.BlockHashError):
        m.allocate_slots(req, 40)
    assert _state(m) == before
    req.block_hashes[0] = "not bytes"  # type: ignore[call-overload]
    with pytest.raises(ValueError):
        m.get_computed_blocks(req)
    assert _state(m) == before


def test_double_free_of_a_request_table_is_rejected_whole() -> None:
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = make_request("a", list(range(40)))
    _admit(m, req)
    blocks = m.pop_blocks_for_free(req)
    m.block_pool.free_blocks(reversed(blocks))
    before = _state(m)
    with pytest.raises(exceptions.DoubleFreeError):
        m.block_pool.free_blocks(reversed(blocks))
    assert _state(m) == before


def test_unknown_request_is_a_no_op_like_vllm() -> None:
    """vLLM frees requests that never got blocks (aborted while waiting)."""
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    ghost = make_request("ghost", [1, 2, 3])
    m.free(ghost)
    assert m.pop_blocks_for_free(ghost) == []
    assert m.get_block_ids("ghost") == ([],)
    assert m.get_blocks("ghost") is m.empty_kv_cache_blocks


@pytest.mark.parametrize(
    "change",
    [
        {"kv_cache_config": _FULL_AND_SLIDING_WINDOW},
        {"scheduler_block_size": 32},
        {"metrics_collector": KVCacheMetricsCollector(sample_rate=1.0)},
    ],
)
def test_configs_that_used_to_fall_back_are_served(change: dict) -> None:
    m = KVCacheManager(**{**manager_kwargs(full_attention_config(32)), **change})
    assert isinstance(m, KVCacheManager)
    req = make_request("a", list(range(40)))
    _admit(m, req)
    m.free(req)
    m.check_invariants()


def _hisparse_config() -> Any:
    config = full_attention_config(32)
    group = config.kv_cache_groups[0]
    config.kv_cache_groups = [dataclasses.replace(group, role=KVCacheGroupRole.HISPARSE_SOURCE)]
    return config


def test_unsupported_config_falls_back_to_vllm_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hscache.vllm import kv_cache_manager as module

    said: list[str] = []
    monkeypatch.setattr(module.logger, "info", lambda msg, *a: said.append(msg % a))
    m = KVCacheManager(
        **{**manager_kwargs(full_attention_config(32)), "kv_cache_config": _hisparse_config()}
    )
    assert type(m) is VllmKVCacheManager
    assert len(said) == 1 and said[0].startswith("hscache: using vLLM's Python KVCacheManager")
    assert "HiSparse" in said[0]


def test_strict_mode_raises_instead_of_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_STRICT", "1")
    with pytest.raises(exceptions.UnsupportedConfigError, match="HiSparse"):
        KVCacheManager(
            **{**manager_kwargs(full_attention_config(32)), "kv_cache_config": _hisparse_config()}
        )
    assert isinstance(KVCacheManager(**manager_kwargs(full_attention_config(16))), KVCacheManager)


def test_disable_env_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_DISABLE", "1")
    assert type(KVCacheManager(**manager_kwargs(full_attention_config(16)))) is VllmKVCacheManager


def test_reset_prefix_cache_fails_while_in_use_and_sets_stats_flag() -> None:
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = make_request("a", list(range(40)))
    _admit(m, req)
    assert not m.reset_prefix_cache()
    m.free(req)
    assert m.reset_prefix_cache()
    stats = m.make_prefix_cache_stats()
    assert stats is not None and stats.reset
    events = m.take_events()
    assert type(events[-1]).__name__ == "AllBlocksCleared"


def test_latency_counters_are_opt_in_and_count_calls() -> None:
    import hscache

    hscache.enable_stats(False)
    hscache.reset_stats()
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = make_request("a", list(range(40)))
    _admit(m, req)
    # Off, no latency counter ("explain" is explain mode's, on in other tests' managers).
    assert {op: v for op, v in hscache.stats().items() if op != "explain"} == {}
    hscache.enable_stats()
    try:
        m.allocate_slots(req, 1)
        m.free(req)
        s = hscache.stats()
        assert s["allocate_slots"]["calls"] == 1 and s["free"]["calls"] == 1
        assert 0 < s["allocate_slots"]["p50_ns"] <= s["allocate_slots"]["p99_ns"]
    finally:
        hscache.enable_stats(False)
        hscache.reset_stats()


def test_kv_event_batch_round_trips_through_msgspec_like_vllms() -> None:
    """hscache's events, published in vLLM's KVEventBatch, encode to the same msgpack
    bytes as vLLM's own and decode back to equal events (what a subscriber sees)."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    batches = []
    for cls in (VllmKVCacheManager, KVCacheManager):
        m = cls(**manager_kwargs(full_attention_config(5, 4)))
        common = list(range(8))
        r0 = make_request("a", [*common, 100, 101, 102, 103, 104], hash_block_size=4)
        _admit(m, r0)
        m.free(r0)
        r1 = make_request("b", [*common, 200, 201, 202, 203, 204], hash_block_size=4)
        _admit(m, r1)  # evicts a's tail (BlockRemoved), stores b's blocks
        m.free(r1)
        assert m.reset_prefix_cache()
        batch = KVEventBatch(ts=1.5, events=m.take_events(), data_parallel_rank=0)
        batches.append(msgspec.msgpack.encode(batch))
    assert batches[0] == batches[1]
    decoded = msgspec.msgpack.decode(batches[1], type=KVEventBatch)
    kinds = [type(e).__name__ for e in decoded.events]
    assert kinds[0] == "BlockStored" and "BlockRemoved" in kinds
    assert kinds[-1] == "AllBlocksCleared"


class _ReentrantRequest:
    """A request whose ``block_hashes`` calls back into the manager while the core
    reads it (from inside ``allocate_slots`` / ``allocate_slots_batch``)."""

    def __init__(self, inner, manager: KVCacheManager, call) -> None:
        self.__dict__["_inner"] = inner
        self.__dict__["_manager"] = manager
        self.__dict__["_call"] = call

    @property
    def block_hashes(self):  # type: ignore[no-untyped-def]
        self._call(self._manager)
        return self._inner.block_hashes

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.usage,  # a shared read
        lambda m: m.free(make_request("zz", [1, 2, 3])),  # a mutation
        lambda m: m.get_block_ids("a"),
    ],
)
def test_reentrant_request_raises_runtime_error_and_changes_nothing(call) -> None:
    """Calling back into the manager from a request attribute the core reads is a
    RuntimeError ("Already borrowed"), never a panic, and the call changes nothing."""
    m = KVCacheManager(**manager_kwargs(full_attention_config(16)))
    req = _ReentrantRequest(make_request("a", list(range(40))), m, call)
    before = _state(m)
    with pytest.raises(RuntimeError, match="borrowed"):
        m.allocate_slots(req, 40)
    assert _state(m) == before
    m.check_invariants()


_VIEW_LAYOUTS = {
    "full": full_attention_config(32),
    "full+swa": _FULL_AND_SLIDING_WINDOW,
    "full+mamba": kv_cache_config([full_attention(16), mamba(16, mode="align")], 32),
}


@pytest.mark.parametrize("layout", list(_VIEW_LAYOUTS))
def test_views_refuse_vllms_own_bookkeeping(layout: str) -> None:
    """The coordinator and manager views are instances of vLLM's classes; a vLLM method
    the view does not serve (``allocate_new_blocks``, ``free``, ``cache_blocks`` of a
    single-type manager, ...) would run vLLM's bookkeeping over the view: blocks taken
    from the pool behind the core's tables, then an ``AttributeError`` half-way. It raises
    ``UnsupportedError`` and changes nothing; the read-only ones vLLM code calls run."""
    m = KVCacheManager(**manager_kwargs(_VIEW_LAYOUTS[layout]))
    a = make_request("a", list(range(70)))
    _admit(m, a)
    views = [m.coordinator, *m.coordinator.single_type_managers]
    refused = 0
    for view in views:
        for name in dir(type(view)):
            method = getattr(type(view), name)
            if getattr(method, "__module__", None) != "hscache.vllm.unserved":
                continue  # served by the view, or a read-only method of vLLM's
            digest = m.state_digest()
            with pytest.raises(exceptions.UnsupportedError, match=name):
                getattr(view, name)("a", 16, 16)
            assert m.state_digest() == digest, name
            refused += 1
    assert refused >= 10
    for view in views[1:]:
        assert view.get_num_skipped_tokens(64) >= 0
    assert 0 < m.coordinator.get_num_cacheable_tokens(70, 0) <= 70
    m.free(a)
    m.check_invariants()


def test_blocks_and_pool_views_refuse_vllms_mutators() -> None:
    """vLLM's ``KVCacheBlock`` is a mutable dataclass and its free queue, prefix-cache
    index and pool have mutating methods; hscache's handles and views read the core, so
    each of those raises ``UnsupportedError`` (not ``AttributeError``) and changes
    nothing."""
    m = KVCacheManager(**manager_kwargs(full_attention_config(32)))
    a = make_request("a", list(range(70)))
    _admit(m, a)
    pool = m.block_pool
    block = pool.blocks[1]
    calls = {
        "KVCacheBlock.ref_cnt": lambda: setattr(block, "ref_cnt", 5),
        "KVCacheBlock.prev_free_block": lambda: setattr(block, "prev_free_block", None),
        "KVCacheBlock.reset_hash": block.reset_hash,
        "KVCacheBlock.set_block_hash": lambda: block.set_block_hash(b"k" * 36, 16),
        "FreeKVCacheBlockQueue.popleft": pool.free_block_queue.popleft,
        "FreeKVCacheBlockQueue.append": lambda: pool.free_block_queue.append(block),
        "FreeKVCacheBlockQueue.remove": lambda: pool.free_block_queue.remove(pool.blocks[20]),
        "BlockHashToBlockMap.insert": lambda: pool.cached_block_hash_to_block.insert(
            b"k" * 36, pool.blocks[20]
        ),
        "BlockPool.unpin_blocks": lambda: pool.unpin_blocks([block], None),
        "BlockPool._maybe_evict_cached_block": lambda: pool._maybe_evict_cached_block(block),
    }
    for what, call in calls.items():
        digest = m.state_digest()
        with pytest.raises(exceptions.UnsupportedError, match=what.split(".")[1]):
            call()
        assert m.state_digest() == digest, what
    assert block.ref_cnt == 1
    m.free(a)
    m.check_invariants()
