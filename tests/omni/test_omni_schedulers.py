"""Differential: vllm-omni 0.30's AR schedulers on hscache's KV-cache manager against the
same schedulers on vLLM's (``sched_pair.py`` drives the two in lockstep).

- ``test_same_decisions_as_vllms_manager``: ``OmniARScheduler`` and ``OmniARAsyncScheduler``,
  switched to hscache by ``HSCACHE=1`` (the plugin) or by ``scheduler_cls:
  hscache.omni.OmniAR*Scheduler``, make every decision vLLM's manager makes (every step's
  ``SchedulerOutput``, engine outputs, prefix-cache stats, KV events, the managers' whole
  state) over streams with prefix hits, preemption, aborts, async placeholders, KV transfer
  to the next stage and the physical-order and deferred frees; the calls vllm-omni adds
  (``get_block_ids``, ``estimate_cached_tokens``, ``pop_blocks_for_free``,
  ``block_pool.free_blocks``) reach hscache's manager, counted.
- ``test_generation_scheduler_under_the_plugin``: vllm-omni's ``OmniGenerationScheduler``
  (its non-AR stages), switched by ``HSCACHE=1``, the same comparison.
- ``test_both_switches_build_hscaches_manager``: the manager is hscache's own class and its
  answers come from the Rust core (no fallback, no vLLM Python), for both switches and
  both schedulers; vllm-omni's own classes stay untouched.
- ``test_a_wrong_answer_is_caught``: a manager answer changed behind the scheduler's back
  fails the comparison (the harness can see what it claims to compare).
- ``test_talker_stage_is_served_by_the_fast_path``: a talker-like stage (short prompts,
  long decodes, 16 seats and a queue), sync and async, on ``scheduler_cls:
  hscache.omni.OmniAR*Scheduler``: the same comparison with every ``OmniEngineCoreOutput``
  field, and a floor per phase on what the fast path served (a silent decline fails);
  ``test_an_omni_mutant_is_caught``: each rule of ``hscache.omni.fast`` broken alone fails.
  The random streams above run with the fast path on too (``scheduler_cls`` seeds).

Needs vllm-omni 0.30 on vLLM 0.30 (``scripts/vllm030_env.sh``); skipped elsewhere.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip(
    "vllm_omni.core.sched.omni_ar_scheduler",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

import hscache.omni
from hscache._core import KVCacheCore
from hscache.vllm.kv_cache_manager import KVCacheManager
from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler

from tests.omni.sched_pair import (
    PairConfig,
    PairDivergence,
    build_pair,
    config_for_seed,
    run_pair,
    talker_config,
)

# HSCACHE_OMNI_SCHED_SEEDS=<n> runs more streams (a deeper run than the default).
SEEDS = range(int(os.environ.get("HSCACHE_OMNI_SCHED_SEEDS", "16")))


@pytest.mark.parametrize("seed", SEEDS)
def test_same_decisions_as_vllms_manager(seed: int) -> None:
    cfg = config_for_seed(seed)
    counts = run_pair(cfg)
    assert counts.comparisons >= 2 * cfg.steps
    if cfg.switch == "scheduler_cls":  # hscache's class: the fast path was on
        assert counts.fast["schedule_steps"] >= cfg.steps
        if cfg.kv_transfer != "prefill_finished" and not cfg.defer_block_free:
            assert counts.fast["update_served"] > 0, counts.fast
    assert counts.calls.get("estimate_cached_tokens", 0) > 0
    if cfg.kv_transfer is not None:
        assert counts.transfers > 0 and counts.acks > 0
        assert counts.calls.get("get_block_ids", 0) > 0
    if cfg.mooncake and not cfg.enable_caching:  # every free is the physical-order one
        assert counts.calls.get("pop_blocks_for_free", 0) > 0
        assert counts.calls.get("block_pool.free_blocks", 0) > 0


@pytest.mark.parametrize("seed", [1, 2])
def test_generation_scheduler_under_the_plugin(seed: int) -> None:
    from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler

    cfg = PairConfig(seed=seed, generation=True, switch="plugin", num_blocks=(18, 60)[seed % 2])
    reference, ours = build_pair(cfg)
    assert type(ours) is type(reference) is OmniGenerationScheduler
    assert type(ours.kv_cache_manager) is KVCacheManager
    counts = run_pair(cfg)
    assert counts.comparisons >= 2 * cfg.steps and counts.events > 0


def test_streams_cover_what_vllm_omni_adds() -> None:
    """Across the default seeds: hits, preemptions, aborts and each omni path happen."""
    cfgs = [config_for_seed(s) for s in range(16)]
    assert {c.kv_transfer for c in cfgs} == {None, "on_finish", "prefill_finished"}
    assert {c.switch for c in cfgs} == {"plugin", "scheduler_cls"}
    assert {c.async_scheduling for c in cfgs} == {True, False}
    assert any(c.mooncake and not c.enable_caching for c in cfgs)
    assert any(c.defer_block_free and c.enable_caching for c in cfgs)
    totals = [run_pair(c) for c in (cfgs[3], cfgs[6], cfgs[8])]
    # the deferred free pops a request's blocks when it ends with a step in flight
    assert cfgs[6].defer_block_free and cfgs[6].enable_caching
    assert totals[1].calls.get("pop_blocks_for_free", 0) > 0
    assert sum(t.preemptions for t in totals) > 0
    assert sum(t.hit_tokens for t in totals) > 0
    assert sum(t.aborts for t in totals) > 0
    assert sum(t.events for t in totals) > 0


@pytest.mark.parametrize("switch", ["plugin", "scheduler_cls"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_both_switches_build_hscaches_manager(switch: str, async_scheduling: bool) -> None:
    cfg = PairConfig(seed=0, switch=switch, async_scheduling=async_scheduling)
    reference, ours = build_pair(cfg)
    stock = OmniARAsyncScheduler if async_scheduling else OmniARScheduler
    assert isinstance(ours, stock)
    assert type(reference) is stock
    assert type(reference.kv_cache_manager).__module__ == "vllm.v1.core.kv_cache_manager"
    mgr = ours.kv_cache_manager
    assert type(mgr) is KVCacheManager
    # What vllm-omni calls beyond vLLM's Scheduler is the Rust core's, not Python glue.
    for name in ("get_block_ids", "estimate_cached_tokens", "pop_blocks_for_free", "free"):
        assert getattr(type(mgr), name) is getattr(KVCacheCore, name), name
    assert mgr.enable_caching is True
    assert type(mgr.block_pool).__module__.startswith("hscache")
    if switch == "scheduler_cls":
        ours_cls = (
            hscache.omni.OmniARAsyncScheduler if async_scheduling else hscache.omni.OmniARScheduler
        )
        assert type(ours) is ours_cls
    else:
        assert type(ours) is stock  # vllm-omni's own class, switched by the plugin


def test_plugin_switch_is_undone_after_the_build() -> None:
    import vllm.v1.core.sched.scheduler as scheduler_module

    before = scheduler_module.KVCacheManager
    build_pair(PairConfig(seed=0, switch="plugin"))
    assert scheduler_module.KVCacheManager is before
    assert before.__module__ == "vllm.v1.core.kv_cache_manager"


@pytest.mark.parametrize(
    "method", ["estimate_cached_tokens", "get_block_ids", "pop_blocks_for_free"]
)
def test_a_wrong_answer_is_caught(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.omni.sched_pair as sched_pair

    real_build = sched_pair.build_pair

    def broken_build(cfg: PairConfig) -> tuple[Any, Any]:
        reference, ours = real_build(cfg)
        mgr = ours.kv_cache_manager
        right = getattr(mgr, method)

        def wrong(*a: Any, **kw: Any) -> Any:
            answer = right(*a, **kw)
            if method == "estimate_cached_tokens":
                return answer + 1
            if method == "get_block_ids":
                return tuple(list(reversed(g)) for g in answer)
            return list(answer)[:-1]  # (vllm-omni sorts them: an order change is moot)

        setattr(mgr, method, wrong)
        return reference, ours

    monkeypatch.setattr(sched_pair, "build_pair", broken_build)
    # seeds whose streams call the method: estimate (all), get_block_ids (transfer),
    # pop_blocks_for_free (physical-order free without caching)
    seed = {"estimate_cached_tokens": 3, "get_block_ids": 7, "pop_blocks_for_free": 9}[method]
    with pytest.raises(PairDivergence):
        run_pair(config_for_seed(seed))


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_talker_stage_is_served_by_the_fast_path(seed: int, async_scheduling: bool) -> None:
    cfg = talker_config(seed, async_scheduling)
    counts = run_pair(cfg)
    fast = counts.fast
    assert counts.comparisons >= 2 * cfg.steps and counts.requests >= 100
    # Measured: 120-134 of 166 schedule() calls, 86-95 % of the requests' updates (the
    # rest: admissions, prefills, finishes, steps with an abort).
    assert fast["schedule_steps"] == cfg.steps + 6
    assert fast["schedule_served"] >= 0.65 * fast["schedule_steps"], fast
    assert fast["update_served"] >= 0.8 * fast["update_requests"], fast


@pytest.mark.parametrize(
    ("rule", "cfg"),
    [
        ("generation_tokens", talker_config(1, False, steps=40)),
        ("merge_order", talker_config(1, True, steps=60)),
        ("kv_criteria", config_for_seed(2)),
    ],
)
def test_an_omni_mutant_is_caught(
    rule: str, cfg: PairConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hscache.omni import fast

    monkeypatch.setattr(fast, "BROKEN", frozenset({rule}))
    with pytest.raises(PairDivergence):
        run_pair(cfg)
