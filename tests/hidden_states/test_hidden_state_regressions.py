"""The hidden-state cache against the bugs vllm-omni's hidden-state prefix cache reported.

One test per bug (a same-step hit read zeros; an aborted request's blocks stayed hittable
though their rows were never completed; a block evicted and reused served the previous
owner's rows; connector-loaded blocks were trusted without a version check), each with real
tensors and the exact rows of a deterministic toy model. Each test also shows that the
scenario is real: a naive gather through the same slot mapping (what an unvalidated mirror
serves) returns wrong rows, which the cache refuses. The matching defects injected into the
Rust mirror itself are caught by ``src/slots/tests.rs``
(``each_reported_bug_is_caught_and_would_fail_on_a_broken_mirror``).

Also issue-15 reliability: a plan made by another cache is refused by ``write`` (two stage
caches in one process advance their step numbers together), and impossible sizes raise
``MemoryError`` instead of killing the process.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hscache.exceptions import InvalidArgumentError
from hscache.hidden_states import HiddenStateCache, KeySpec, StepPlan

from tests.fixtures import devices, load_example

KEYS: dict[str, KeySpec] = {"hidden": (16, torch.float32), "codes": (3, torch.int32)}


@pytest.fixture(scope="module")
def model() -> Any:
    return load_example("omni_two_stage", "omni_two_stage_regressions").ToyCausalModel(KEYS, seed=5)


def forward(model: Any, plan: StepPlan, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    parts = [
        model.forward(tokens[r], int(plan.compute_start[i]), int(plan.num_tokens[i]))
        for i, r in enumerate(plan.req_ids)
    ]
    return {k: torch.cat([p[k] for p in parts]) for k in KEYS}


def naive_rows(cache: HiddenStateCache, blocks: list[int], n: int) -> torch.Tensor:
    """What a mirror without versions serves: whatever the slots hold."""
    bs = cache.block_size
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
    return cache.tensor("hidden").index_select(0, slots)


def test_same_step_hit_reads_this_steps_rows_not_zeros(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    prompt = list(range(40, 49))
    tokens = {"a": prompt, "b": [*prompt[:8], 7]}
    # b is laid out first and hits the two blocks a computes in this very step.
    plan = cache.plan_step(new=[("b", [3, 4, 6], 8, 1), ("a", [3, 4, 5], 0, 9)])
    # Reading before the step's writes land (the async-write bug) gives zeros.
    assert torch.count_nonzero(naive_rows(cache, [3, 4], 8)) == 0
    rows = cache.write_and_gather(plan, forward(model, plan, tokens))
    assert rows.hits == ["b"] and rows.misses == []
    want = model.forward(tokens["b"], 0, 9)
    assert torch.equal(rows.rows("b", "hidden"), want["hidden"])
    assert torch.equal(rows.rows("b", "codes"), want["codes"])


def test_aborted_request_blocks_are_not_hittable(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    old = list(range(100, 108))
    tokens = {"z": old, "a": list(range(200, 208)), "b": [*range(200, 208), 1]}
    plan = cache.plan_step(new=[("z", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, tokens))
    # z finishes; a gets blocks 3, 4 fresh (vLLM hashes them at allocation) and is
    # aborted before its rows are written: its plan is never written.
    cache.plan_step(finished=["z"], new=[("a", [3, 4], 0, 8)])
    # b has a's prompt: vLLM reports a hit on a's blocks.
    plan = cache.plan_step(finished=["a"], new=[("b", [3, 4, 6], 8, 1)])
    rows = cache.write_and_gather(plan, forward(model, plan, tokens))
    assert rows.misses == ["b"] and rows.hits == []
    assert rows.start("b") == 8 and rows.rows("b", "hidden").shape[0] == 1
    # The slots still hold z's rows: an unvalidated mirror would serve them as a's.
    assert torch.equal(naive_rows(cache, [3, 4], 8), model.forward(old, 0, 8)["hidden"])
    assert cache.stats()["uncommitted_steps"] == 1


def test_evicted_and_reused_block_never_serves_the_previous_owner(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(8)), "c": [9, 9], "b": [*range(4), 5]}
    plan = cache.plan_step(new=[("a", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, tokens))
    # a finishes; block 3 is evicted and reused by c, whose first chunk writes 2 rows.
    plan = cache.plan_step(finished=["a"], new=[("c", [3], 0, 2)])
    cache.write_and_gather(plan, forward(model, plan, tokens))
    # A (stale) hit claim on block 3 for a's content.
    plan = cache.plan_step(new=[("b", [3, 6], 4, 1)])
    rows = cache.write_and_gather(plan, forward(model, plan, tokens))
    assert rows.misses == ["b"]
    # The slots hold c's 2 rows, then a's last 2: the previous owner's rows.
    naive = naive_rows(cache, [3], 4)
    assert torch.equal(naive[:2], model.forward(tokens["c"], 0, 2)["hidden"])
    assert torch.equal(naive[2:], model.forward(tokens["a"], 0, 4)["hidden"][2:])


def test_delayed_gather_after_reuse_is_refused(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(8)), "b": [*range(4), 5], "c": [7, 7, 7, 7]}
    plan = cache.plan_step(new=[("a", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, tokens))
    plan_b = cache.plan_step(new=[("b", [3, 6], 4, 1)])
    reads = cache.write(plan_b, forward(model, plan_b, tokens))
    assert list(reads.plan_indices) == [0]
    plan = cache.plan_step(finished=["a", "b"], new=[("c", [3], 0, 4)])
    cache.write_and_gather(plan, forward(model, plan, tokens))
    rows = cache.gather(plan_b, reads)
    assert rows.misses == ["b"] and cache.stats()["stale_reads"] == 1


def _so(new: list[Any], connector: bool) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={r.req_id: 1 for r in new},
        finished_req_ids=set(),
        preempted_req_ids=None,
        new_block_ids_to_zero=None,
        kv_connector_metadata=object() if connector else None,
    )


def test_connector_loaded_blocks_need_a_version(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(8)), "b": [*range(50, 58), 1]}
    plan = cache.plan_step(new=[("a", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, tokens))
    # b's KV (a different prompt) is loaded by a connector into blocks 3 and 4.
    plan = cache.plan_step(finished=["a"], new=[("b", [3, 4, 6], 8, 1)], external_tokens={"b": 8})
    rows = cache.write_and_gather(plan, forward(model, plan, tokens))
    assert rows.misses == ["b"]
    assert cache.stats()["untrusted_loaded_blocks"] == 2
    # The slots hold a's rows: trusting the load would serve them as b's.
    assert torch.equal(naive_rows(cache, [3, 4], 8), model.forward(tokens["a"], 0, 8)["hidden"])

    # A connector that restores the rows and knows their version gets them served.
    tokens["c"] = [*range(8), 9]
    plan = cache.plan_step(new=[("c", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, {"c": tokens["c"]}))
    versions = {b: cache.mirror.block_state(b)[0] for b in (3, 4)}
    plan = cache.plan_step(
        finished=["c"],
        new=[("d", [3, 4, 7], 8, 1)],
        external_tokens={"d": 8},
        connector_versions=versions,
    )
    rows = cache.write_and_gather(plan, forward(model, plan, {"d": tokens["c"]}))
    assert rows.hits == ["d"]
    assert torch.equal(rows.rows("d", "hidden"), model.forward(tokens["c"], 0, 9)["hidden"])


def test_scheduler_output_with_a_connector_distrusts_hits_without_counts(model: Any) -> None:
    cache = HiddenStateCache(16, 4, KEYS)
    prompt = list(range(8))
    plan = cache.plan_step(new=[("a", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, {"a": prompt}))

    def new(rid: str, blocks: list[int]) -> SimpleNamespace:
        return SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=8)

    # A local hit without a connector is served ...
    plan = cache.update_from_scheduler_output(_so([new("b", [3, 4, 6])], connector=False))
    rows = cache.write_and_gather(plan, forward(model, plan, {"b": [*prompt, 1]}))
    assert rows.hits == ["b"]
    # ... with a connector, a hit of unknown origin is distrusted, ...
    plan = cache.update_from_scheduler_output(_so([new("c", [3, 4, 7])], connector=True))
    rows = cache.write_and_gather(plan, forward(model, plan, {"c": [*prompt, 2]}))
    assert rows.misses == ["c"]
    # ... unless the counts say it is local.
    plan = cache.plan_step(new=[("e", [3, 4], 0, 8)])
    cache.write_and_gather(plan, forward(model, plan, {"e": prompt}))
    plan = cache.update_from_scheduler_output(
        _so([new("f", [3, 4, 8])], connector=True), external_tokens={"f": 0}
    )
    rows = cache.write_and_gather(plan, forward(model, plan, {"f": [*prompt, 3]}))
    assert rows.hits == ["f"]


def test_write_refuses_a_plan_of_another_cache(model: Any) -> None:
    """Two stage caches in one process advance together: their step numbers match. The old
    ``write`` took the other cache's plan, marked its own pending step written and later
    served zeros as valid rows."""
    thinker, talker = HiddenStateCache(16, 4, KEYS), HiddenStateCache(16, 4, KEYS)
    tokens = {"a": list(range(8)), "b": [*range(8), 1]}
    own = thinker.plan_step(new=[("a", [3, 4], 0, 8)])
    other = talker.plan_step(new=[("z", [5], 0, 4)])
    assert own.step_id == other.step_id
    with pytest.raises(InvalidArgumentError, match="another HiddenStateCache"):
        thinker.write(other, forward(model, other, {"z": [1, 2, 3, 4]}))
    assert thinker.mirror.pending_step == own.step_id
    assert thinker.mirror.block_state(3) == (1, 0)
    # The own plan still goes through; nothing was counted as written meanwhile.
    thinker.write_and_gather(own, forward(model, own, tokens))
    plan = thinker.plan_step(new=[("b", [3, 4, 6], 8, 1)])
    rows = thinker.write_and_gather(plan, forward(model, plan, tokens))
    assert torch.equal(rows.rows("b", "hidden"), model.forward(tokens["b"], 0, 9)["hidden"])
    reads = thinker.write(
        thinker.plan_step(running=[("b", [], 1)]),
        {"hidden": torch.zeros(1, 16), "codes": torch.zeros(1, 3, dtype=torch.int32)},
    )
    with pytest.raises(InvalidArgumentError):
        talker.gather(other, reads)


def test_impossible_sizes_raise_memory_error() -> None:
    # The tensors: torch's allocation failure becomes MemoryError.
    with pytest.raises(MemoryError):
        HiddenStateCache(2**31, 16, {"h": (8, torch.float32)})
    # The mirror: its block state (16 bytes a block) under an address-space limit, in a
    # child process; the old code aborted the process ("memory allocation ... failed").
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from hscache._core import SlotMirror\n"
        "try:\n"
        "    SlotMirror(num_blocks=2**31, block_size=16)\n"
        "except MemoryError as e:\n"
        "    print('MemoryError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MemoryError: memory allocation of"), out


DEVICES = devices()


@pytest.mark.parametrize("reduced", [True, False], ids=["reduced", "merged"])
@pytest.mark.parametrize("device", DEVICES)
def test_skip_layer_key_rows_under_fast_prefill(model: Any, device: str, reduced: bool) -> None:
    """Fast prefill: the skip-layer key is written for the kept rows only, given as the skip
    layers' own (reduced) output or merged into a full-length one; a later hit serves the
    other keys and reports the skip key partial, and never serves its unwritten rows."""
    cache = HiddenStateCache(16, 4, KEYS, device, skip_layer_keys=["hidden"])
    prompt = list(range(60, 69))
    tokens = {"a": prompt, "b": [*prompt[:8], 3], "c": list(range(70, 76))}
    plan = cache.plan_step(
        new=[("a", [3, 4, 5], 0, 9), ("c", [6, 7], 0, 4)],
        num_prompt_tokens={"a": 9, "c": 6},
        fast_prefill=True,
    )
    skip = plan.prefill_skip
    assert skip is not None and skip.reduced
    # a samples (its prompt is complete): its last row; c is a partial chunk: none.
    assert plan.kept.tolist() == [1, 0] and skip.logits_indices.tolist() == [8]
    full = forward(model, plan, tokens)
    outputs = dict(full)
    if reduced:
        outputs["hidden"] = full["hidden"][skip.logits_indices.long()]
    rows = cache.write_and_gather(plan, {k: v.to(device) for k, v in outputs.items()})
    assert rows.start("a", "hidden") == 8 and rows.start("a", "codes") == 0
    assert torch.equal(rows.rows("a", "hidden").cpu(), full["hidden"][8:9])
    assert rows.rows("c", "hidden").shape[0] == 0
    assert cache.stats()["skipped_rows"] == 12
    # b hits a's two full blocks: codes served, hidden only for b's own new row.
    plan = cache.plan_step(new=[("b", [3, 4, 8], 8, 1)])
    rows = cache.write_and_gather(
        plan, {k: v.to(device) for k, v in forward(model, plan, tokens).items()}
    )
    want = model.forward(tokens["b"], 0, 9)
    assert rows.hits == ["b"] and rows.partial == ["b"]
    assert torch.equal(rows.rows("b", "codes").cpu(), want["codes"])
    assert rows.start("b", "hidden") == 8
    assert torch.equal(rows.rows("b", "hidden").cpu(), want["hidden"][8:])
    assert cache.stats()["partial_reads"] == 1
