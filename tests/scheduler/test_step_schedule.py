"""``hscache._core.StepSchedule`` (``src/python/step_schedule.rs``), the ``schedule()``
phase of the steady decode step, call by call against vLLM's own manager.

The differential (``test_scheduler_fast_path.py``) proves the fast path end to end; this
file pins the call's contract: the decision is all-or-nothing and changes nothing when it
refuses, the allocations are vLLM's ``allocate_slots(request, 1)`` per request with
``get_block_ids(allow_none=True)``'s ids (full attention and a sliding-window hybrid),
it stops at the first request that does not fit and resumes there, and its rule names
are the core's ``ScheduleRule``s, listed in ``step.RULES``.
"""

from __future__ import annotations

from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache import exceptions as hx
from hscache._core import StepSchedule
from hscache.vllm import KVCacheManager
from hscache.vllm.step import rules
from hscache_tools.bench.layouts import layout_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import init_none_hash, make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

pytestmark = pytest.mark.vllm

SYNC = StepSchedule(is_async=False, max_model_len=4096, num_sampled_tokens_per_step=1)
ASYNC = StepSchedule(is_async=True, max_model_len=4096, num_sampled_tokens_per_step=1)


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    init_none_hash("sha256")


def _managers(layout: str, num_blocks: int) -> tuple[Any, Any]:
    """hscache's manager and vLLM's, on the same configuration (KV events on)."""
    kwargs = manager_kwargs(layout_config(layout, num_blocks).kv_cache_config)
    return KVCacheManager(**kwargs), VllmKVCacheManager(**kwargs)


def _prefilled(
    managers: tuple[Any, Any], n: int, prompt_len: int, first: int = 0
) -> list[tuple[Any, Any]]:
    """Requests ``r{first}``... (``n``) prefilled on both managers, each with one output
    token to decode."""
    pairs = []
    for i in range(first, first + n):
        prompt = [(i * 97 + j) % 1000 for j in range(prompt_len)]
        pair = (make_request(f"r{i}", prompt), make_request(f"r{i}", prompt))
        for m, r in zip(managers, pair, strict=True):
            assert m.allocate_slots(r, prompt_len) is not None
            r.num_computed_tokens = prompt_len
            r.append_output_token_ids(7)
        pairs.append(pair)
    return pairs


@pytest.mark.parametrize("layout", ["full", "full+swa"])
def test_allocations_are_vllms_per_request(layout: str) -> None:
    ours, theirs = _managers(layout, 256)
    # Prompts of 15, 16 and 17 tokens: the decode fits in place, needs a new block, fits.
    pairs = [p for i, n in enumerate((15, 16, 17)) for p in _prefilled((ours, theirs), 1, n, i)]
    ours_running = [a for a, _ in pairs]
    result = SYNC.decodes(ours, ours_running, 0, 1)
    assert result is not None
    done, new_block_ids, computed, outputs, _, _, _ = result
    expected = []
    for _, b in pairs:
        blocks = theirs.allocate_slots(b, 1)
        assert blocks is not None
        expected.append(blocks.get_block_ids(allow_none=True))
    assert done == len(pairs)
    assert new_block_ids == expected
    assert any(ids is None for ids in expected) and any(ids is not None for ids in expected)
    assert computed == [a.num_computed_tokens for a in ours_running]
    assert outputs == [1, 1, 1]
    for a, _ in pairs:
        assert ours.get_block_ids(a.request_id) == theirs.get_block_ids(a.request_id)


def test_refusal_changes_nothing() -> None:
    managers = _managers("full", 64)
    ours = managers[0]
    pairs = _prefilled(managers, 3, 16)
    running = [a for a, _ in pairs]
    running[2].next_decode_eligible_step = 2  # vLLM skips it at step 1
    before = ours.state_digest()
    assert SYNC.decodes(ours, running, 0, 1) is None
    assert ours.state_digest() == before
    assert SYNC.plain_decodes(running, 1) is None
    running[2].next_decode_eligible_step = 0
    assert SYNC.plain_decodes(running, 1) == ([16, 16, 16], [1, 1, 1], [1, 1, 1], None, True)
    # A queue vLLM could admit from unless the budget is spent: refused while it is not.
    assert SYNC.decodes(ours, running, 0, 1, token_budget=4, queue_left=0) is None
    assert ours.state_digest() == before


def test_a_prefill_chunk_is_planned_under_the_budget_and_threshold() -> None:
    managers = _managers("full", 64)
    ours, theirs = managers
    pairs = _prefilled(managers, 3, 16)
    running = [a for a, _ in pairs]
    # The third request is prefilling: 8 of its 17 tokens left to compute.
    running[2].num_computed_tokens -= 8
    running[2].is_prefill_chunk = True
    plan = SYNC.plain_decodes(running, 1)
    assert plan == ([16, 16, 8], [1, 1, 1], [1, 1, 9], 2, True)
    assert SYNC.plain_decodes(running, 1, long_prefill_token_threshold=4)[2] == [1, 1, 4]
    assert SYNC.plain_decodes(running, 1, token_budget=5)[2] == [1, 1, 3]
    # The budget spent before the chunk: it is not scheduled (vLLM's loop stops).
    assert SYNC.plain_decodes(running, 1, token_budget=2) == ([16, 16], [1, 1], [1, 1], None, True)
    assert SYNC.plain_decodes(running, 1, token_budget=3, queue_left=0) is not None
    # A step that defers prefills beside a decode is vLLM's.
    assert SYNC.plain_decodes(running, 1, throttle=True) is None
    assert SYNC.plain_decodes(running[2:], 1, throttle=True) is not None
    # The allocation is vLLM's for each planned request's tokens.
    theirs_req = pairs[2][1]
    theirs_req.num_computed_tokens -= 8
    result = SYNC.decodes(ours, running, 0, 1, token_budget=5)
    assert result is not None
    done, new_block_ids, computed, _, tokens, first_chunk, any_decode = result
    assert (done, computed, tokens, first_chunk, any_decode) == (3, [16, 16, 8], [1, 1, 3], 2, True)
    expected = [theirs.allocate_slots(b, k) for (_, b), k in zip(pairs, tokens, strict=True)]
    assert new_block_ids == [e.get_block_ids(allow_none=True) for e in expected if e is not None]


def test_stops_at_the_first_that_does_not_fit_and_resumes() -> None:
    # 5 usable blocks (block 0 is the null block): three one-block prompts take 3, and
    # each decode needs a second block, so the third request's does not fit.
    ours, theirs = _managers("full", 6)
    pairs = _prefilled((ours, theirs), 3, 16)
    running = [a for a, _ in pairs]
    result = SYNC.decodes(ours, running, 0, 1)
    assert result is not None
    done, new_block_ids, _, _, _, _, _ = result
    assert done == 2 and len(new_block_ids) == 2
    for _, b in pairs[:2]:
        assert theirs.allocate_slots(b, 1) is not None
    assert theirs.allocate_slots(pairs[2][1], 1) is None
    # The Scheduler frees a victim (here the first request) and resumes at entry 2,
    # which only allocates.
    ours.free(running[0])
    theirs.free(pairs[0][1])
    resumed = SYNC.decodes(ours, running, 2, 1)
    assert resumed is not None
    done, more, computed, outputs, tokens, _, _ = resumed
    expected = theirs.allocate_slots(pairs[2][1], 1)
    assert expected is not None
    assert (done, more, computed, outputs, tokens) == (
        3,
        [expected.get_block_ids(allow_none=True)],
        [],
        [],
        [],
    )


def test_rule_names_are_listed_and_bad_arguments_refused() -> None:
    assert set(StepSchedule.RULES) == {
        "chunk_tokens",
        "long_prefill",
        "token_budget",
        "async_last_step",
    }
    assert set(StepSchedule.RULES) <= set(rules.RULES)
    for bad in ({"max_model_len": -1}, {"num_sampled_tokens_per_step": -1}):
        args = {"is_async": False, "max_model_len": 16, "num_sampled_tokens_per_step": 1}
        with pytest.raises(hx.InvalidArgumentError):
            StepSchedule(**{**args, **bad})
    assert (SYNC.is_async, SYNC.max_model_len, SYNC.num_lookahead_tokens) == (False, 4096, 0)


def test_async_placeholder_is_the_token_to_compute() -> None:
    managers = _managers("full", 64)
    ((a, _),) = _prefilled(managers, 1, 20)
    a.num_computed_tokens += 1  # the output token's decode is in flight
    a.num_output_placeholders = 1
    assert SYNC.plain_decodes([a], 1) is None  # placeholders need async scheduling
    assert ASYNC.plain_decodes([a], 1) == ([21], [2], [1], None, True)
    a.max_tokens = a.num_output_tokens + 1  # the in-flight output reaches max_tokens
    assert ASYNC.plain_decodes([a], 1) == ([21], [2], [0], None, True)  # vLLM skips it


def test_a_skipped_request_is_planned_zero_and_not_allocated() -> None:
    """A request vLLM's running loop skips (async scheduling's last step) is planned 0
    tokens, gets no allocation (None as its block ids) and spends no budget; the
    requests after it are allocated as vLLM's manager allocates them."""
    ours, theirs = _managers("full", 256)
    pairs = _prefilled((ours, theirs), 3, 16)
    for a, b in pairs:
        for r in (a, b):
            r.num_computed_tokens += 1
            r.num_output_placeholders = 1
    for r in pairs[1]:
        r.max_tokens = r.num_output_tokens + 1  # its in-flight output is its last
    running = [a for a, _ in pairs]
    result = ASYNC.decodes(ours, running, 0, 1, token_budget=2)
    assert result is not None
    done, new_block_ids, _, _, tokens, _, _ = result
    assert (done, tokens) == (3, [1, 0, 1])
    assert new_block_ids[1] is None
    expected = [theirs.allocate_slots(b, 1) for b in (pairs[0][1], pairs[2][1])]
    assert [new_block_ids[0], new_block_ids[2]] == [
        e.get_block_ids(allow_none=True) for e in expected if e is not None
    ]
    for a, b in pairs:
        assert ours.get_block_ids(a.request_id) == theirs.get_block_ids(b.request_id)
