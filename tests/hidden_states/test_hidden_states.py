"""Hidden-state cache (`hscache.hidden_states`, `src/slots/`): served rows equal recomputation.

The thinker of `examples/omni_two_stage.py` (vLLM's real `Scheduler` with hscache's manager,
a deterministic causal toy model) drives randomized traces with hits, misses, same-step hits,
chunked prefill, preemption, eviction and block reuse, and several keys of different widths
and dtypes. Every step, every request's returned rows must equal a full recomputation bit for
bit, and every finished request's assembled rows too. Stale reads are forced (block reuse
after eviction, rows never written, fresh blocks under a hit) and must be refused, never
served. CUDA variants run with `pytest -m gpu` where a GPU is present.
"""

from __future__ import annotations

import random
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hscache.exceptions import InvalidArgumentError, UnknownRequestError
from hscache.hidden_states import HiddenStateCache, KeySpec, StepPlan

from tests.fixtures import devices, load_example

KEYS: dict[str, KeySpec] = {
    "hidden": (16, torch.float32),
    "layer24": (8, torch.bfloat16),
    "codes": (3, torch.int32),
}
DEVICES = devices()


@pytest.fixture(scope="module")
def omni() -> ModuleType:
    """`examples/omni_two_stage.py` (imports vLLM)."""
    return load_example("omni_two_stage")


@pytest.fixture(scope="module")
def model(omni: ModuleType) -> Any:
    return omni.ToyCausalModel(KEYS, seed=1)


def assert_rows_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in KEYS:
        assert got[k].dtype == want[k].dtype
        assert torch.equal(got[k].cpu(), want[k].cpu()), k


def forward(model: Any, plan: StepPlan, tokens: dict[str, list[int]], device: str) -> Any:
    """The step's rows in plan order (what a model runner's forward pass produces)."""
    parts = [
        model.forward(tokens[r], int(plan.compute_start[i]), int(plan.num_tokens[i]), device)
        for i, r in enumerate(plan.req_ids)
    ]
    return {
        k: torch.cat([p[k] for p in parts])
        if parts
        else torch.empty((0, w), dtype=d, device=device)
        for k, (w, d) in KEYS.items()
    }


# ---------------------------------------------------------------- plain-id API, no scheduler


@pytest.mark.parametrize("device", DEVICES)
def test_hit_serves_cached_prefix_and_new_rows(model: Any, device: str) -> None:
    cache = HiddenStateCache(16, 4, KEYS, device)
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(8)]
    tokens = {"a": [*prefix, 1, 2, 3], "b": [*prefix, 4, 5]}
    plan = cache.plan_step(new=[("a", [3, 7, 2], 0, 11)])
    rows = cache.write_and_gather(plan, forward(model, plan, tokens, device))
    assert rows.hits == [] and rows.misses == []
    assert rows.start("a") == 0
    assert_rows_equal({k: rows.rows("a", k) for k in KEYS}, model.forward(tokens["a"], 0, 11))

    plan = cache.plan_step(new=[("b", [3, 7, 5], 8, 2)], running=[("a", [], 1)])
    tokens["a"].append(9)
    assert plan.req_ids == ["b", "a"]
    assert plan.compute_start.tolist() == [8, 11] and plan.num_tokens.tolist() == [10, 12]
    assert plan.write_slots.tolist() == [20, 21, 11]
    rows = cache.write_and_gather(plan, forward(model, plan, tokens, device))
    assert rows.hits == ["b"] and rows.start("b") == 0 and rows.start("a") == 11
    assert_rows_equal({k: rows.rows("b", k) for k in KEYS}, model.forward(tokens["b"], 0, 10))
    assert_rows_equal({k: rows.rows("a", k) for k in KEYS}, model.forward(tokens["a"], 11, 12))
    assert cache.stats()["cached_rows_served"] == 8


@pytest.mark.parametrize("device", DEVICES)
def test_same_step_hit_reads_rows_written_in_that_step(model: Any, device: str) -> None:
    cache = HiddenStateCache(16, 4, KEYS, device)
    tokens = {"a": list(range(100, 109)), "b": [*list(range(100, 108)), 7]}
    # b is laid out before a, and hits the two blocks a computes in this very step.
    plan = cache.plan_step(new=[("b", [3, 7, 6], 8, 1), ("a", [3, 7, 2], 0, 9)])
    rows = cache.write_and_gather(plan, forward(model, plan, tokens, device))
    assert rows.hits == ["b"]
    assert_rows_equal({k: rows.rows("b", k) for k in KEYS}, model.forward(tokens["b"], 0, 9))


def test_non_aligned_hit_recomputes_the_gap(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(50, 60)), "b": [*list(range(50, 58)), 1, 2, 3]}
    plan = cache.plan_step(new=[("a", [1, 2, 3], 0, 10)])
    cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    # An external KV load says 6 tokens are computed: rows 4..5 must be recomputed.
    plan = cache.plan_step(new=[("b", [1, 4, 5], 6, 5)])
    assert plan.compute_start.tolist() == [4] and plan.num_rows == 7
    rows = cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    assert rows.hits == ["b"]
    assert_rows_equal({k: rows.rows("b", k) for k in KEYS}, model.forward(tokens["b"], 0, 11))


def test_hit_on_reassigned_block_is_a_miss_not_served(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(8)), "c": [9, 9], "b": [*list(range(4)), 5]}
    plan = cache.plan_step(new=[("a", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    # a finishes; block 3 goes to c as a fresh block and c writes 2 of its rows.
    plan = cache.plan_step(finished=["a"], new=[("c", [3], 0, 2)])
    cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    # A (wrong) hit claim on block 3 must not return c's or a's rows.
    plan = cache.plan_step(new=[("b", [3, 6], 4, 1)])
    rows = cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    assert rows.misses == ["b"] and rows.hits == []
    assert rows.start("b") == 4 and rows.rows("b", "hidden").shape[0] == 1
    assert cache.stats()["read_misses"] == 1


def test_fresh_block_ids_make_external_blocks_misses(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(4)), "b": [*list(range(4)), 1]}
    plan = cache.plan_step(new=[("a", [3], 0, 4)])
    cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    # vLLM's new_block_ids_to_zero names block 3: it was popped fresh (an external load).
    plan = cache.plan_step(finished=["a"], new=[("b", [3, 6], 4, 1)], fresh_block_ids=[3, 6])
    rows = cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    assert rows.misses == ["b"]


def test_order_lays_rows_out_in_the_runner_batch_order(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    plan = cache.plan_step(new=[("a", [1], 0, 2), ("b", [2], 0, 3)], order=["b", "a"])
    assert plan.req_ids == ["b", "a"]
    assert plan.write_slots.tolist() == [8, 9, 10, 4, 5]
    assert plan.query_start_loc.tolist() == [0, 3, 5]
    with pytest.raises(InvalidArgumentError):
        cache.plan_step(new=[("c", [3], 0, 1)], order=["x"])


def test_scheduler_output_with_two_groups_follows_the_chosen_group(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS, kv_cache_group=1)

    def so(new: list[Any], cached: Any, sched: dict[str, int]) -> SimpleNamespace:
        return SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=sched,
            finished_req_ids=set(),
            preempted_req_ids=None,
            new_block_ids_to_zero=None,
        )

    empty = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    a = SimpleNamespace(req_id="a", block_ids=([1, 2], [5, 6]), num_computed_tokens=0)
    plan = cache.update_from_scheduler_output(so([a], empty, {"a": 6}))
    assert plan.write_slots.tolist() == [20, 21, 22, 23, 24, 25]
    cached = SimpleNamespace(
        req_ids=["a"], resumed_req_ids=set(), new_block_ids=[([3], [7])], num_computed_tokens=[6]
    )
    tokens = {"a": list(range(9))}
    cache.write_and_gather(plan, forward(model, plan, tokens, "cpu"))
    plan = cache.update_from_scheduler_output(so([], cached, {"a": 3}))
    assert plan.write_slots.tolist() == [26, 27, 28]
    assert cache.mirror.block_table("a") == [5, 6, 7]
    one_group = SimpleNamespace(req_id="z", block_ids=([1],), num_computed_tokens=0)
    with pytest.raises(InvalidArgumentError, match="group"):
        cache.update_from_scheduler_output(so([one_group], empty, {"z": 1}))


def test_bad_outputs_are_refused_before_any_write(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(6))}
    plan = cache.plan_step(new=[("a", [1, 2], 0, 6)])
    good = forward(model, plan, tokens, "cpu")
    before = cache.tensor("hidden").clone()
    bad = [
        {k: v for k, v in good.items() if k != "codes"},
        {**good, "hidden": good["hidden"].double()},
        {**good, "layer24": good["layer24"][:, :4]},
        {**good, "codes": good["codes"][:5]},
    ]
    for outputs in bad:
        with pytest.raises(InvalidArgumentError):
            cache.write(plan, outputs)
    assert torch.equal(cache.tensor("hidden"), before)
    assert cache.mirror.pending_step == plan.step_id
    # CUDA-graph padding: extra rows are ignored.
    padded = {k: torch.cat([v, v[:2]]) for k, v in good.items()}
    cache.write(plan, padded)
    with pytest.raises(InvalidArgumentError, match="pending"):
        cache.write(plan, good)


def test_construction_and_memory_accounting() -> None:
    cache = HiddenStateCache(10, 4, KEYS)
    assert cache.memory_bytes() == {"hidden": 40 * 16 * 4, "layer24": 40 * 8 * 2, "codes": 40 * 12}
    assert cache.bytes_per_token() == 64 + 16 + 12
    assert cache.tensor("hidden").shape == (40, 16)
    for keys in [{}, {"h": (0, torch.float32)}, {"h": (4, "float32")}, {"h": (True, torch.int8)}]:
        with pytest.raises(InvalidArgumentError):
            HiddenStateCache(10, 4, keys)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        HiddenStateCache(10, 0, KEYS)
    with pytest.raises(UnknownRequestError):
        cache.plan_step(running=[("ghost", [], 1)])
    with pytest.raises(UnknownRequestError):
        cache.plan_step().index("ghost")


# -------------------------------------------------------- vLLM's real Scheduler, random traces


def run_trace(omni: ModuleType, model: Any, *, seed: int, device: str, use_v2: bool) -> dict:
    """A randomized workload through vLLM's Scheduler; checks every step's rows."""
    rng = random.Random(seed)
    bs, num_blocks = 4, 32
    scheduler = omni.build_scheduler(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_batched_tokens=40,
        max_num_seqs=8,
        long_prefill_token_threshold=12,
        use_v2_model_runner=use_v2,
    )
    thinker = omni.Thinker(scheduler, model, HiddenStateCache(num_blocks, bs, KEYS, device))
    talker = omni.Talker(list(KEYS))
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(6, 26))] for _ in range(3)]
    prompts: list[list[int]] = []
    pending = []
    for i in range(40):
        if prompts and rng.random() < 0.25:
            prompt = list(prompts[-1] if rng.random() < 0.6 else rng.choice(prompts))  # repeat
        else:
            suffix = [rng.randrange(1000) for _ in range(rng.randrange(0, 10))]
            prompt = rng.choice(prefixes) + suffix if rng.random() < 0.8 else [*suffix, 1, 2]
        prompts.append(prompt)
        pending.append(omni.make_request(f"r{i}", prompt, rng.randrange(1, 30), bs))
    counters = "steps hits same_step_hits resumed_hits partial_prefills preempted"
    seen = dict.fromkeys([*counters.split(), "resumed_as_cached", "resumed_as_new"], 0)
    while pending or scheduler.has_unfinished_requests():
        n = rng.choice([0, 1, 1, 2, 3])
        if len(pending) > 1 and pending[0].prompt_token_ids == pending[1].prompt_token_ids:
            n = max(n, 2)  # keep a repeat with its twin: a same-step hit
        for _ in range(min(n, len(pending))):
            thinker.add(pending.pop(0))
        so, plan, rows, finished = thinker.step()
        seen["steps"] += 1
        seen["preempted"] += len(so.preempted_req_ids or ())
        seen["resumed_as_cached"] += len(so.scheduled_cached_reqs.resumed_req_ids)
        seen["resumed_as_new"] += sum(
            thinker.requests[r.req_id].num_preemptions > 0 for r in so.scheduled_new_reqs
        )
        assert rows.misses == [], "vLLM reported a hit whose rows were not valid"
        written = set((plan.write_slots // bs).tolist())
        for req_id, cached in zip(rows.hits, rows.reads.num_cached_tokens, strict=True):
            seen["hits"] += 1
            seen["resumed_hits"] += thinker.requests[req_id].num_preemptions > 0
            if written & set(thinker.cache.mirror.block_table(req_id)[: cached // bs]):
                seen["same_step_hits"] += 1
        for i, req_id in enumerate(plan.req_ids):
            req = thinker.requests[req_id]
            end = int(plan.num_tokens[i])
            seen["partial_prefills"] += end < req.num_prompt_tokens
            start = rows.start(req_id)
            got = {k: rows.rows(req_id, k) for k in KEYS}
            assert_rows_equal(got, model.forward(req.all_token_ids, start, end))
            talker.feed(req_id, start, got)
        for req_id in finished:
            req = thinker.requests.pop(req_id)
            end = req.num_tokens - 1
            assert_rows_equal(talker.take(req_id), model.forward(req.all_token_ids, 0, end))
        assert seen["steps"] < 2000
    assert not thinker.requests
    seen.update(thinker.cache.stats())
    return seen


@pytest.mark.vllm
@pytest.mark.parametrize("use_v2", [False, True], ids=["v1-runner", "v2-runner"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_random_traces_match_full_recomputation(
    omni: ModuleType, model: Any, seed: int, use_v2: bool, device: str
) -> None:
    seen = run_trace(omni, model, seed=seed, device=device, use_v2=use_v2)
    assert seen["hits"] >= 5 and seen["cached_rows_served"] > 0
    assert seen["partial_prefills"] > 0
    assert seen["fresh_blocks"] > 3 * 32  # blocks evicted and reused
    assert seen["same_step_hits"] > 0
    assert seen["preempted"] > 0 and seen["resumed_hits"] > 0
    # The v1 model runner learns resumptions from resumed_req_ids, v2 from new requests.
    assert (seen["resumed_as_new"] > 0) == use_v2 and (seen["resumed_as_cached"] > 0) != use_v2
    assert seen["read_misses"] == 0 and seen["stale_reads"] == 0


@pytest.mark.vllm
@pytest.mark.parametrize("device", DEVICES)
def test_same_step_hit_through_vllm_scheduler(omni: ModuleType, model: Any, device: str) -> None:
    scheduler = omni.build_scheduler(num_blocks=32, block_size=4)
    thinker = omni.Thinker(scheduler, model, HiddenStateCache(32, 4, KEYS, device))
    prompt = list(range(200, 213))
    thinker.add(omni.make_request("a", prompt, 1, 4))
    thinker.add(omni.make_request("b", prompt, 1, 4))
    so, _plan, rows, _ = thinker.step()
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [0, 12]
    assert rows.hits == ["b"]
    assert_rows_equal({k: rows.rows("b", k) for k in KEYS}, model.forward(prompt, 0, 13))


@pytest.mark.vllm
def test_delayed_read_after_eviction_and_reuse_is_detected(omni: ModuleType, model: Any) -> None:
    bs, num_blocks = 4, 16
    scheduler = omni.build_scheduler(num_blocks=num_blocks, block_size=bs)
    cache = HiddenStateCache(num_blocks, bs, KEYS)
    thinker = omni.Thinker(scheduler, model, cache)
    prompt = list(range(300, 312))
    thinker.add(omni.make_request("a", prompt, 1, bs))
    thinker.step()
    # c hits a's 3 cached blocks; its reads are taken now but gathered later.
    c_tokens = [*prompt, 5]
    thinker.add(omni.make_request("c", c_tokens, 1, bs))
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    plan = cache.update_from_scheduler_output(so)
    outputs = thinker.forward(plan)
    reads = cache.write(plan, outputs)
    assert list(reads.plan_indices) == [0]
    hit_blocks = cache.mirror.block_table("c")[:3]
    epochs = [cache.mirror.block_state(b)[0] for b in hit_blocks]
    slots = torch.frombuffer(bytearray(reads.slots()), dtype=torch.int64).clone()
    scheduler.update_from_output(so, thinker.runner_output(plan))
    # Distinct prompts evict a/c's cached blocks and reuse them.
    rng = random.Random(3)
    for i in range(12):
        thinker.add(omni.make_request(f"f{i}", [rng.randrange(1000) for _ in range(12)], 1, bs))
        thinker.step()
        if any(
            cache.mirror.block_state(b)[0] != e for b, e in zip(hit_blocks, epochs, strict=True)
        ):
            break
    else:
        pytest.fail("the hit blocks were never reused")
    while scheduler.has_unfinished_requests():
        thinker.step()
    # A naive gather would now return another request's rows ...
    want = model.forward(c_tokens, 0, 13)
    assert not torch.equal(torch.index_select(cache.tensor("hidden"), 0, slots), want["hidden"])
    # ... the cache refuses it.
    rows = cache.gather(plan, reads)
    assert rows.misses == ["c"] and rows.hits == []
    with pytest.raises(UnknownRequestError):
        rows.rows("c", "hidden")
    assert cache.stats()["stale_reads"] == 1
    assert np.array_equal(plan.compute_start, [12])


def test_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from hscache_tools.bench.hidden_states import main

    argv = "--steps 3 --warmup 1 --width 8 --keys 2 --batch 2 --prefix 32 --new 8"
    assert main([*argv.split(), "--decode-batch", "4", "--clock", "thread"]) == 0
    out = capsys.readouterr().out
    assert "[prefill-hit]" in out and "[decode]" in out


def test_benchmark_runs_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from hscache.__main__ import main

    argv = "bench --hidden-states --steps 3 --warmup 1 --width 8 --keys 2 --batch 2 --prefix 32"
    assert main([*argv.split(), "--new", "8", "--decode-batch", "4", "--clock", "thread"]) == 0
    out = capsys.readouterr().out
    assert "| prefill-hit |" in out and "| decode |" in out
