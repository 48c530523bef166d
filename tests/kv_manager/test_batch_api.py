"""The batched running-set API (``allocate_slots_batch`` / ``free_batch``).

Owns two kinds of evidence:
- differential: the benchmark's step driver replays seeded scheduler traces (chunked
  prefill, decode, shared prefixes, preemption from the tail, finishes) on vLLM's own
  ``KVCacheManager`` with one call per request and on hscache's with one batched call per
  step, and compares every decision, event, stat and free-block count at every step;
- contract: bad batches raise a clear exception and change nothing, numpy and list inputs
  agree, stale handles are refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache.exceptions import InvalidArgumentError, UnknownRequestError
from hscache.vllm import KVCacheManager
from hscache_tools.bench.driver import run_scenario
from hscache_tools.bench.managers import CANDIDATE_SPEC, REFERENCE_SPEC, load_class
from hscache_tools.bench.results import OP_ALLOC_BATCH, OP_FREE_BATCH
from hscache_tools.bench.scenarios import TINY_SCENARIO, find_scenario
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("kv_events", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_batched_path_makes_vllms_decisions(seed: int, kv_events: bool) -> None:
    scenario = dataclasses.replace(TINY_SCENARIO, kv_events=kv_events)
    result = run_scenario(
        scenario,
        load_class(REFERENCE_SPEC),
        load_class(CANDIDATE_SPEC),
        seed=seed,
        check=True,
        batched=True,
    )
    c = result.counters
    assert c.preemptions > 0 and c.finishes > 0 and c.hit_tokens > 0
    assert OP_ALLOC_BATCH in result.candidate.op_ns
    assert OP_FREE_BATCH in result.candidate.op_ns
    assert "allocate_slots(running)" not in result.candidate.op_ns


def test_batched_path_under_pressure_makes_vllms_decisions() -> None:
    scenario = find_scenario("quick-r128-pressure").with_steps(40, 20)
    result = run_scenario(
        scenario,
        load_class(REFERENCE_SPEC),
        load_class(CANDIDATE_SPEC),
        seed=3,
        check=True,
        batched=True,
    )
    assert result.counters.preemptions > 0
    assert result.counters.events > 0


def _running_pair(
    num_blocks: int = 64,
) -> tuple[KVCacheManager, list, list[int]]:
    m = KVCacheManager(**manager_kwargs(full_attention_config(num_blocks)))
    reqs = [make_request(f"r{i}", list(range(100 * i, 100 * i + 40))) for i in range(2)]
    for r in reqs:
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)
    handles = [m.request_handle(r.request_id) for r in reqs]
    assert all(isinstance(h, int) for h in handles)
    return m, reqs, handles  # type: ignore[return-value]


def _state(m: KVCacheManager, reqs: list) -> tuple:
    return (
        m.block_pool.get_num_free_blocks(),
        [m.get_block_ids(r.request_id) for r in reqs],
        m.take_new_block_ids(),
    )


def test_batch_equals_per_call_and_accepts_numpy() -> None:
    a, reqs_a, _ = _running_pair()
    b, reqs_b, handles_b = _running_pair()
    # 40 computed + 1 decode token + 30 more: blocks 3 and 4 are new.
    per_call = [a.allocate_slots(r, 31) for r in reqs_a]
    result = b.allocate_slots_batch(
        reqs_b,
        np.array(handles_b),
        np.array([r.num_computed_tokens for r in reqs_b]),
        np.array([31, 31]),
    )
    assert result.num_allocated == 2
    assert result.new_block_ids.dtype == np.int32
    got = [
        result.new_block_ids[result.offsets[i] : result.offsets[i + 1]].tolist() for i in range(2)
    ]
    assert got == [blocks.get_block_ids()[0] for blocks in per_call]
    assert _state(a, reqs_a) == _state(b, reqs_b)
    b.free_batch(np.array(handles_b))
    for r in reqs_a:
        a.free(r)
    assert _state(a, reqs_a) == _state(b, reqs_b)
    queues = [
        [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()]
        for m in (a, b)
    ]
    assert queues[0] == queues[1]


def test_batch_stops_at_the_first_entry_that_does_not_fit() -> None:
    m, reqs, handles = _running_pair(num_blocks=8)  # 7 usable: 3 + 3 taken
    computed = [r.num_computed_tokens for r in reqs]
    before = _state(m, reqs)
    result = m.allocate_slots_batch(reqs, handles, computed, [17, 17])
    assert result.num_allocated == 1  # r0 takes the last free block; r1 does not fit
    assert result.offsets.tolist() == [0, 1]
    after = _state(m, reqs)
    assert after[1][1] == before[1][1], "the entry that did not fit is untouched"


def test_bad_batches_raise_and_change_nothing() -> None:
    m, reqs, handles = _running_pair()
    computed = [r.num_computed_tokens for r in reqs]
    before = _state(m, reqs)
    with pytest.raises(UnknownRequestError):
        m.allocate_slots_batch(reqs, [handles[0], handles[1] + 99], computed, [1, 1])
    with pytest.raises(InvalidArgumentError, match="twice"):
        m.allocate_slots_batch(reqs, [handles[0], handles[0]], computed, [1, 1])
    with pytest.raises(InvalidArgumentError, match="length"):
        m.allocate_slots_batch(reqs, handles, computed, [1])
    with pytest.raises(InvalidArgumentError, match="greater than 0"):
        m.allocate_slots_batch(reqs, handles, computed, [1, 0])
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots_batch(reqs, handles, computed, [1, -3])
    with pytest.raises(InvalidArgumentError, match="requests"):
        m.allocate_slots_batch(reqs[:1], handles, computed, [1, 1])
    # Entry 0 fills a block (its hashes are read): the request must be its handle's.
    with pytest.raises(InvalidArgumentError, match="not the request of handle"):
        m.allocate_slots_batch(reqs[::-1], handles, computed, [8, 1])
    with pytest.raises(UnknownRequestError):
        m.free_batch([handles[0], 12345])
    with pytest.raises(InvalidArgumentError, match="twice"):
        m.free_batch([handles[0], handles[0]])
    with pytest.raises(InvalidArgumentError):
        m.free_batch(b"\x00" * 7)
    assert _state(m, reqs) == before
    # A freed request's handle is stale, even once another request reuses its slot.
    m.free_batch([handles[0]])
    with pytest.raises(UnknownRequestError):
        m.free_batch([handles[0]])
    late = make_request("late", list(range(5000, 5020)))
    assert m.allocate_slots(late, late.num_tokens) is not None
    assert m.request_handle("late") != handles[0]
    with pytest.raises(UnknownRequestError):
        m.allocate_slots_batch(reqs[:1], handles[:1], computed[:1], [1])
    assert m.request_handle("never-admitted") is None
