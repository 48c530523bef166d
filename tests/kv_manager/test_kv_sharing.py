"""KV-sharing fast prefill end to end (``examples/kv_sharing_fast_prefill.py``).

A toy YOCO-style thinker (self layers with paged KV, cross layers reusing the last self
layer's KV) under vLLM's real Scheduler with hscache's manager: every step the cross layers
run on the reduced batch from ``plan.prefill_skip`` and on the full batch; the kept rows and
the sampled tokens must agree, and every row the hidden-state cache returns must equal a
dense recomputation (it never serves a cross-layer row that was not computed). Randomized
traces with prefix hits, chunked prefill and steps with and without fast prefill. A cache
that is not told which keys the skip layers produce serves wrong rows and is caught.
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from tests.fixtures import load_example

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def toy() -> ModuleType:
    return load_example("kv_sharing_fast_prefill")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_prefill_only(toy: ModuleType, seed: int) -> None:
    stats = toy.run(num_requests=24, seed=seed)
    assert stats["kept_rows"] < stats["rows"] // 2
    assert stats["hits"] > 5 and stats["partial_hits"] == stats["hits"]
    assert stats["mirror_skipped_rows"] == stats["rows"] - stats["kept_rows"]


def test_mixed_steps_serve_the_skip_key_where_it_was_computed(toy: ModuleType) -> None:
    hits = partial = 0
    for seed in range(4):
        stats = toy.run(num_requests=32, seed=seed, fast_prefill_rate=0.5)
        assert stats["mirror_read_misses"] == 0
        hits += stats["hits"]
        partial += stats["partial_hits"]
    # Hits on blocks computed without fast prefill serve the cross layers' rows too.
    assert 0 < partial < hits


def test_merged_output_is_accepted_when_the_skip_key_is_declared(toy: ModuleType) -> None:
    thinker = toy.build(64, 4, seed=7, max_num_batched_tokens=24, max_num_seqs=6)
    thinker.merged_output = True
    _drive(toy, thinker, random.Random(7))
    assert thinker.cache.stats()["partial_reads"] > 0


def test_undeclared_skip_key_serves_uncomputed_rows_and_is_caught(toy: ModuleType) -> None:
    from hscache.hidden_states import HiddenStateCache

    thinker = toy.build(64, 4, seed=7, max_num_batched_tokens=24, max_num_seqs=6)
    thinker.merged_output = True
    thinker.cache = HiddenStateCache(64, 4, toy.KEYS)  # "hidden" not declared a skip key
    with pytest.raises(AssertionError, match="'hidden'"):
        _drive(toy, thinker, random.Random(7))


def _drive(toy: ModuleType, thinker: object, rng: random.Random) -> None:
    prefix = [rng.randrange(toy.VOCAB) for _ in range(12)]
    for i in range(6):
        thinker.add(toy.make_request(f"r{i}", [*prefix, i], 2, 4))  # type: ignore[attr-defined]
    for _ in range(200):
        if not thinker.scheduler.has_unfinished_requests():  # type: ignore[attr-defined]
            return
        thinker.step()  # type: ignore[attr-defined]
