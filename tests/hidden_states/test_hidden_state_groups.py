"""The hidden-state cache on hybrid KV-cache layouts (several KV-cache groups).

vLLM's own planner (``get_kv_cache_groups`` + ``get_kv_cache_config_from_groups``) builds the
``KVCacheConfig`` of a full + sliding-window model and of a full + Mamba model (where the
full-attention group is the last of four). ``full_attention_group`` must pick the group that
carries full-attention positions, and hand-built ``SchedulerOutput``s with one block list per
group (null blocks where the window skipped, one state block per Mamba group) must give the
exact rows of a deterministic toy model, hits included. A cache pointed at the sliding-window
group refuses the plan instead of reading the null block.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hscache.exceptions import InvalidArgumentError
from hscache.hidden_states import HiddenStateCache, KeySpec, full_attention_group

from tests.fixtures import load_example

pytestmark = pytest.mark.vllm

KEYS: dict[str, KeySpec] = {"hidden": (8, torch.float32)}


@pytest.fixture(scope="module")
def model() -> Any:
    return load_example("omni_two_stage", "omni_two_stage_groups").ToyCausalModel(KEYS, seed=9)


def vllm_config(block_size: int) -> Any:
    from hscache_tools.testing.offline_scheduler import model_dir
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    cache = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=True)
    cache.kv_cache_layout = "NHD"  # the engine core resolves it; no engine here
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir()),
            dtype="float16",
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=1024,
        ),
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
    )


def hybrid_kv_cache_config(kind: str, block_size: int = 16) -> Any:
    """A ``KVCacheConfig`` made by vLLM's planner for a 4-layer hybrid model."""
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    if kind == "swa":
        swa = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.float16,
            sliding_window=2 * block_size,
        )
        specs = {f"model.layers.{i}.attn": full if i % 2 == 0 else swa for i in range(4)}
    else:
        mamba = MambaSpec(
            block_size=block_size, shapes=((2, 64), (4, 8)), dtypes=(torch.float16,) * 2
        )
        specs = {
            "model.layers.0.mixer": mamba,
            "model.layers.1.attn": full,
            "model.layers.2.mixer": mamba,
            "model.layers.3.mixer": mamba,
        }
    cfg = vllm_config(block_size)
    return get_kv_cache_config_from_groups(cfg, get_kv_cache_groups(cfg, specs), 1 << 24)


def so(new: list[Any], cached: list[tuple[str, Any, int]], sched: dict[str, int]) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(),
            new_block_ids=[ids for _, ids, _ in cached],
            num_computed_tokens=[nc for _, _, nc in cached],
        ),
        num_scheduled_tokens=sched,
        finished_req_ids=set(),
        preempted_req_ids=None,
        new_block_ids_to_zero=None,
    )


def new_req(rid: str, block_ids: tuple[list[int], ...], nc: int) -> Any:
    return SimpleNamespace(req_id=rid, block_ids=block_ids, num_computed_tokens=nc)


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_follows_the_full_attention_group(kind: str, model: Any) -> None:
    config = hybrid_kv_cache_config(kind)
    kinds = [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
    group = full_attention_group(config)
    assert kinds[group] == "FullAttentionSpec"
    assert group == (0 if kind == "swa" else 3), kinds
    cache = HiddenStateCache.from_kv_cache_config(config, KEYS)
    assert cache.kv_cache_group == group and cache.num_blocks == config.num_blocks
    bs = cache.block_size
    assert bs == config.kv_cache_groups[group].kv_cache_spec.block_size
    n_groups = len(config.kv_cache_groups)

    def per_group(full: list[int], others: list[int]) -> tuple[list[int], ...]:
        """vLLM's tuple: the full group's list at ``group``, the others elsewhere."""
        return tuple(full if g == group else others for g in range(n_groups))

    prompt = list(range(500, 500 + 3 * bs + 5))
    tokens = {"a": prompt, "b": [*prompt[: 3 * bs], 1, 2]}
    # a: 4 full-attention blocks; the other groups hold null blocks (window skipped) or
    # one state block (Mamba).
    other_a = [0, 0, 21, 22] if kind == "swa" else [30]
    plan = cache.update_from_scheduler_output(
        so([new_req("a", per_group([1, 2, 3, 4], other_a), 0)], [], {"a": 2 * bs})
    )
    assert plan.write_slots.tolist() == list(range(bs, 3 * bs))
    cache.write_and_gather(plan, _rows(model, plan, tokens))
    plan = cache.update_from_scheduler_output(so([], [("a", None, 2 * bs)], {"a": bs + 5}))
    cache.write_and_gather(plan, _rows(model, plan, tokens))
    # b hits a's 3 full blocks; its other-group blocks are nulls or its own state.
    other_b = [0, 0, 0, 23] if kind == "swa" else [31]
    plan = cache.update_from_scheduler_output(
        so([new_req("b", per_group([1, 2, 3, 5], other_b), 3 * bs)], [], {"b": 2})
    )
    rows = cache.write_and_gather(plan, _rows(model, plan, tokens))
    assert rows.hits == ["b"]
    assert torch.equal(
        rows.rows("b", "hidden"), model.forward(tokens["b"], 0, 3 * bs + 2)["hidden"]
    )
    # Running requests extend by per-group tuples too.
    plan = cache.update_from_scheduler_output(
        so([], [("b", per_group([6], [24] if kind == "swa" else []), 3 * bs + 2)], {"b": bs})
    )
    assert cache.mirror.block_table("b") == [1, 2, 3, 5, 6]
    cache.write_and_gather(plan, _rows(model, plan, {"b": [*tokens["b"], *range(bs)]}))


def _rows(model: Any, plan: Any, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    parts = [
        model.forward(tokens[r], int(plan.compute_start[i]), int(plan.num_tokens[i]))
        for i, r in enumerate(plan.req_ids)
    ]
    return {"hidden": torch.cat([p["hidden"] for p in parts])}


def test_a_cache_on_the_window_group_never_reads_null_blocks() -> None:
    config = hybrid_kv_cache_config("swa")
    bs = config.kv_cache_groups[1].kv_cache_spec.block_size
    cache = HiddenStateCache(config.num_blocks, bs, KEYS, kv_cache_group=1)
    # A hit whose window group skipped the first blocks: the read would cover the null
    # block, so it is a miss, never rows of block 0.
    plan = cache.update_from_scheduler_output(
        so([new_req("a", ([1, 2, 3], [0, 0, 7]), 2 * bs)], [], {"a": 1})
    )
    rows = cache.write_and_gather(plan, {"hidden": torch.ones(1, 8)})
    assert rows.misses == ["a"]
    # Computing rows over the null block is refused before anything changes.
    with pytest.raises(InvalidArgumentError, match="null block"):
        cache.update_from_scheduler_output(
            so([new_req("b", ([4, 5], [0, 9]), 0)], [], {"b": bs + 1})
        )


def test_no_full_attention_group_is_an_error() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=32
    )
    config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], swa)]
    )
    with pytest.raises(InvalidArgumentError, match="full-attention"):
        full_attention_group(config)
