"""Stand-ins for the vLLM upstream tests that cannot run with hscache swapped in.

``tests/vllm_upstream/swap_known_failures.txt`` lists the upstream tests that observe
vLLM's Python internals (a spy on a per-group method, say) and so cannot see hscache's
Rust coordinator. Each is restated here as a differential test: the same calls on vLLM's
``KVCacheManager`` and on hscache's, the same observable outcome. The attributes vLLM code
sets after construction (``coordinator.retention_interval``, a manager's ``use_eagle``),
the live ``req_to_blocks`` lists and the AssertionError contract of argument checks are
tested here too.
"""

from __future__ import annotations

from typing import Any

import pytest
from hscache.exceptions import InvalidArgumentError
from hscache.vllm import KVCacheManager
from hscache_tools.testing import kv_cache as kc
from hscache_tools.testing.manager import build_manager
from hscache_tools.testing.requests import init_none_hash, make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

HASH_BLOCK = 2


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    init_none_hash("sha256")


def _full_mamba_config(mamba_block: int, num_blocks: int = 40) -> Any:
    return kc.kv_cache_config(
        [kc.full_attention(HASH_BLOCK), kc.mamba(mamba_block, mode="align")], num_blocks
    )


def _both(config_factory: Any, **kwargs: Any) -> tuple[Any, Any]:
    return (
        build_manager(VllmKVCacheManager, config_factory(), hash_block_size=HASH_BLOCK, **kwargs),
        build_manager(KVCacheManager, config_factory(), hash_block_size=HASH_BLOCK, **kwargs),
    )


def _cached_counts(manager: Any, request_id: str) -> list[int | None]:
    return [m.num_cached_block.get(request_id) for m in manager.coordinator.single_type_managers]


def test_eagle_group_set_after_construction_registers_unaligned_tail() -> None:
    """Upstream ``test_eagle_group_registers_unaligned_tail_under_partial_hash_hits``:
    an EAGLE full-attention group with a block smaller than the scheduler block registers
    the whole unaligned tail (22 tokens, 11 blocks), as vLLM does."""
    vllm_manager, ours = _both(lambda: _full_mamba_config(4 * HASH_BLOCK))
    outcomes = []
    for manager in (vllm_manager, ours):
        coordinator = manager.coordinator
        assert coordinator.enable_partial_hash_hits
        coordinator.single_type_managers[0].use_eagle = True
        assert coordinator.single_type_managers[0].use_eagle
        num_tokens = coordinator.scheduler_block_size * 2 + HASH_BLOCK * 3
        req = make_request("0", range(num_tokens), hash_block_size=HASH_BLOCK)
        blocks, num_computed = manager.get_computed_blocks(req)[:2]
        assert manager.allocate_slots(req, num_tokens, num_computed, blocks) is not None
        outcomes.append((num_tokens, _cached_counts(manager, "0")))
    assert outcomes[0] == outcomes[1]
    num_tokens, counts = outcomes[1]
    assert counts[0] == num_tokens // HASH_BLOCK == 11


@pytest.mark.parametrize("retention", [None, 0, 8, 16])
def test_retention_interval_set_after_construction(retention: int | None) -> None:
    """vLLM reads ``coordinator.retention_interval`` at every use; setting it on a live
    hscache manager changes which Mamba states stay published, exactly as in vLLM."""
    vllm_manager, ours = _both(lambda: _full_mamba_config(4, num_blocks=64))
    seen = []
    for manager in (vllm_manager, ours):
        manager.coordinator.retention_interval = retention
        assert manager.coordinator.retention_interval == retention
        req = make_request("p", range(40), hash_block_size=HASH_BLOCK)
        blocks, num_computed = manager.get_computed_blocks(req)[:2]
        for chunk in (16, 16, 8):
            manager.new_step_starts()
            assert manager.allocate_slots(req, chunk, num_computed, blocks) is not None
            req.num_computed_tokens += chunk
            num_computed, blocks = 0, None
        manager.free(req)
        manager.new_step_starts()
        published = [
            end
            for end in range(HASH_BLOCK, 41, HASH_BLOCK)
            if manager.block_pool.get_cached_block(req.block_hashes[end // HASH_BLOCK - 1], [1])
            is not None
        ]
        replay = make_request("r", range(48), hash_block_size=HASH_BLOCK)
        seen.append((published, manager.get_computed_blocks(replay)[1]))
    assert seen[0] == seen[1]


def test_retention_interval_is_validated() -> None:
    """A retention interval that is not a multiple of the scheduler block is refused."""
    manager = build_manager(KVCacheManager, _full_mamba_config(4), hash_block_size=HASH_BLOCK)
    with pytest.raises(InvalidArgumentError, match="multiple of scheduler_block_size"):
        manager.coordinator.retention_interval = 3
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        manager.coordinator.retention_interval = -4
    assert manager.coordinator.retention_interval is None


def test_req_to_blocks_lists_stay_live() -> None:
    """A caller that keeps ``req_to_blocks[request_id]`` sees it grow as in vLLM, and
    keeps the last contents after the request is freed."""
    manager = build_manager(KVCacheManager, kc.full_attention_config(16, 4))
    req = make_request("0", range(12), hash_block_size=4)
    assert manager.allocate_slots(req, 4) is not None
    held = manager.coordinator.single_type_managers[0].req_to_blocks["0"]
    assert len(held) == 1
    req.num_computed_tokens = 4
    assert manager.allocate_slots(req, 8) is not None
    assert [b.block_id for b in held] == [b.block_id for b in manager.get_blocks("0").blocks[0]]
    assert len(held) == 3 and held[2] is held[-1]
    manager.free(req)
    assert len(held) == 3


def test_invalid_argument_is_an_assertion_error_too() -> None:
    """Where vLLM's manager asserts, hscache raises InvalidArgumentError, which is both a
    ValueError and an AssertionError (vLLM callers catch the latter)."""
    manager = build_manager(KVCacheManager, _full_mamba_config(4), hash_block_size=HASH_BLOCK)
    req = make_request("c", range(8), hash_block_size=HASH_BLOCK)
    blocks = manager.get_computed_blocks(req)[0]
    with pytest.raises(AssertionError):
        manager.truncate_computed_blocks(blocks, 3)
    assert issubclass(InvalidArgumentError, ValueError)


# ---- HiSparse ---------------------------------------------------------------------------

HS_BLOCK = 16


def _hisparse_pair(**kwargs: Any) -> list[tuple[Any, Any]]:
    """(manager, its HiSparse coordinator) for vLLM and for hscache."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    out = []
    for cls in (VllmKVCacheManager, KVCacheManager):
        manager = build_manager(
            cls,
            kc.hisparse_config(32, 16),
            hash_block_size=HS_BLOCK,
            max_model_len=128,
            **kwargs,
        )
        out.append((manager, get_hisparse_coordinator(manager)))
    return out


def _publish(manager: Any, coordinator: Any, request: Any) -> None:
    """Compute `request`'s prompt and acknowledge every write-back (as the connector)."""
    assert manager.allocate_slots(request, request.num_tokens) is not None
    coordinator.advance_scheduled([(request.request_id, request.num_tokens)])
    command = coordinator.build_offload_command()
    counts = {t.transfer_id: 1 for t in command.page_transfers}
    coordinator.update_spills(counts, counts)


def test_hisparse_host_copy_on_write_reaches_the_connector() -> None:
    """Upstream ``test_hisparse_host_cow_copy_is_drained_without_a_gpu_pool`` writes a
    table and a partial hit into the source manager's internal dicts. Restated with a
    real partial host hit: the host copy-on-write pair is drained by the HiSparse
    connector (not by ``take_kv_cache_block_copies``, which carries the device group's
    copy), both host endpoints stay retained until the worker reports the copy, and
    ``has_pending_work`` follows them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
        HiSparseConnectorScheduler,
        HiSparseConnectorWorkerMetadata,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    outcomes = []
    for manager, coordinator in _hisparse_pair(enable_caching=True):
        tokens = list(range(4 * HS_BLOCK))
        _publish(manager, coordinator, make_request("original", tokens))
        manager.free(make_request("original", tokens))
        resumed = make_request("resumed", tokens)
        blocks, num_local, _ = manager.get_computed_blocks(resumed)
        partial = num_local - HS_BLOCK // 2
        assert manager.allocate_slots(resumed, 8, partial, blocks) is not None
        device_copies, _ = manager.take_kv_cache_block_copies()
        connector = HiSparseConnectorScheduler(async_speculative=False)
        connector.bind_coordinator(coordinator)
        output = SchedulerOutput.make_empty()
        host_copies = connector.build_connector_meta(output).host_block_copies
        host = coordinator.get_host_block_pool()
        endpoints = [
            (host.blocks[c.src_block_id], host.blocks[c.dst_block_id]) for c in host_copies
        ]
        manager.free(resumed)
        held = [(s.ref_cnt, d.ref_cnt) for s, d in endpoints]
        pending = coordinator.has_pending_work()
        connector.update_connector_output(
            KVConnectorOutput(
                kv_connector_worker_meta=HiSparseConnectorWorkerMetadata(
                    {}, {}, completed_host_copy_dst_ids=tuple(c.dst_block_id for c in host_copies)
                )
            )
        )
        released = [(s.ref_cnt, d.ref_cnt) for s, d in endpoints]
        outcomes.append(
            (
                [tuple(c) for c in device_copies],
                [tuple(c) for c in host_copies],
                held,
                pending,
                released,
                coordinator.has_pending_work(),
                manager.take_new_block_ids(),
            )
        )
    assert outcomes[0] == outcomes[1]
    device_copies, host_copies, held, pending, released, pending_after, _ = outcomes[1]
    assert len(host_copies) == 1 and len(device_copies) == 1
    assert all(s > 0 and d > 0 for s, d in held) and pending
    assert released == [(0, 0)] and not pending_after


def test_pending_hisparse_spill_keeps_scheduler_alive() -> None:
    """Upstream ``test_pending_hisparse_spill_keeps_scheduler_alive`` puts a ``Mock`` into
    the coordinator's internal ``pending_spills`` dict. Restated with a real write-back:
    a Scheduler whose connector is bound to the coordinator has requests while the
    finished request's spill is in flight, and none once the workers acknowledged it."""
    from hscache_tools.testing.offline_scheduler import make_scheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
        HiSparseConnector,
        HiSparseConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.v1.core.sched.scheduler import Scheduler

    outcomes = []
    for manager, coordinator in _hisparse_pair():
        scheduler = make_scheduler(Scheduler, 16)
        connector = object.__new__(HiSparseConnector)
        connector.connector_scheduler = HiSparseConnectorScheduler(async_speculative=False)
        connector.connector_scheduler.bind_coordinator(coordinator)
        composite = object.__new__(MultiConnector)
        composite._connectors = (connector,)
        scheduler.connector = composite
        alive = [scheduler.has_requests()]
        request = make_request("r", list(range(2 * HS_BLOCK)))
        assert manager.allocate_slots(request, request.num_tokens) is not None
        coordinator.advance_scheduled([("r", request.num_tokens)])
        manager.free(request)
        alive.append(scheduler.has_requests())
        command = coordinator.build_offload_command()
        alive.append(scheduler.has_requests())
        counts = {t.transfer_id: 1 for t in command.page_transfers}
        coordinator.update_spills(counts, counts)
        alive.append(scheduler.has_requests())
        outcomes.append(alive)
    assert outcomes[0] == outcomes[1] == [False, True, True, False]
