"""Differential: hscache's ``OmniHiddenStateCache`` against vllm-omni 0.30's own
``OmniPrefixCacheManager`` (the reference), step by step, and both against an exact toy
oracle. vLLM 0.30's real ``Scheduler`` produces the ``SchedulerOutput``s (``steps.py``).

- ``test_matches_vllm_omni``: every materialized request's hidden states and per-token
  multimodal outputs (an immediate and a deferred key) are identical across the two caches
  and equal the oracle, and every pass-through output (not one row per token) is identical
  across the two, over sequences with same-step hits, block reuse in a small pool,
  aborts, discarded steps, preemption and resumption, chunked prefill and materialize one
  step late; neither cache refuses anything.
- ``test_unsaved_steps``: beyond vllm-omni's runners (which save every step): steps whose
  outputs are never saved leave hashed blocks without rows. hscache (recomputation on, as
  hscache's switch runs it) sends those hits back: their first unwritten block reaches
  vLLM's scheduler as ``invalid_block_ids`` with the step's output, the scheduler rolls the
  request back and drops that output, and the request's next step is served from position
  0; no refusal is raised and every row it serves equals the oracle (vllm-omni 0.30 serves
  a previous tenant's rows for some of them: printed, not asserted).
  ``test_unsaved_steps_cover_the_recomputation``: over the seeds, hits were sent back and
  served again after the rollback. ``test_unsaved_steps_without_the_report``: with
  recomputation off the same hits are refused (``UnservableHitError``), never served.
- ``test_hybrid_layout_against_recomputation``: beyond vllm-omni (one KV-cache group
  only), a sliding-window + full-attention layout, against the recomputed oracle.
- ``test_preempted_requests_deliver_each_row_once``: in pools that preempt, each request's
  rows appended materialize after materialize (as vllm-omni's runner builds the next
  stage's payload) are the oracle's positions ``0 .. n`` once, in order, with hscache's
  delivery watermark; vllm-omni's cache and a runner with no cache repeat a resumed
  request's recomputed rows (counted, asserted to happen). hscache's side expects rows
  from its watermark on in every test here (``Side(deliver_once=True)``).
- ``test_rule_mutants_are_caught``: each broken rule of hscache's slot mirror and of its
  omni rules (``OmniStepRules``: first hits, refused hits, the spans' order) makes one of
  the two comparisons fail (the continuation rule's mutant: ``test_bad_inputs.py``).

Needs vllm-omni 0.30 on vLLM 0.30 (``scripts/vllm030_env.sh``); skipped elsewhere.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest

pytest.importorskip(
    "vllm_omni.core.prefix_cache",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

from hscache.omni import OmniHiddenStateCache, OmniSettings

from tests.omni.steps import DEFERRED_KEYS, BatchView, Counts, Params, Side, run_sequence

# HSCACHE_OMNI_DIFF_SEEDS=<n> runs more sequences (a deeper run than the default).
SEEDS = range(int(os.environ.get("HSCACHE_OMNI_DIFF_SEEDS", "24")))


def _omni_side(view: BatchView, p: Params) -> Side:
    from vllm_omni.core.prefix_cache import (
        ModelCachePolicy,
        OmniPrefixCacheManager,
        PrefixCacheConfig,
    )

    cfg = PrefixCacheConfig(
        num_blocks=p.num_blocks,
        block_size=p.block_size,
        staging_capacity_tokens=p.max_num_batched_tokens,
    )
    manager = OmniPrefixCacheManager(cfg, view)
    manager.register_policy(ModelCachePolicy(deferred_keys=DEFERRED_KEYS))
    return Side("vllm-omni", manager)


def _hscache_side(view: BatchView, p: Params, recompute: bool = True) -> Side:
    from vllm_omni.core.prefix_cache import ModelCachePolicy, PrefixCacheConfig

    cfg = PrefixCacheConfig(num_blocks=p.num_blocks, block_size=p.block_size)
    cache = OmniHiddenStateCache(
        cfg,
        view,
        settings=OmniSettings(storage="cpu"),
        kv_cache_group=1 if p.window else 0,
        recompute_refused=recompute,
    )
    cache.register_policy(ModelCachePolicy(deferred_keys=DEFERRED_KEYS))
    return Side("hscache", cache, deliver_once=True)


def _params(seed: int, **kw: Any) -> Params:
    # Alternate pool shapes: a roomy pool and one small enough to preempt and reuse.
    if seed % 2:
        kw.setdefault("num_blocks", 14)
        kw.setdefault("max_num_seqs", 5)
    return Params(seed=seed, **kw)


def _summary(c: Counts) -> str:
    return (
        f"steps={c.steps} saved={c.saved} materialized={c.materialized} late={c.late} "
        f"discarded={c.discarded} requests={c.requests_compared} rows={c.rows_compared} "
        f"hits={c.hit_requests} same_step_hits={c.same_step_hits} chunked={c.chunked} "
        f"preemptions={c.preemptions} resumptions={c.resumptions} aborts={c.aborts} "
        f"recomputed={c.recomputed} recomputed_served={c.recomputed_served} "
        f"refused={c.refused} mismatches={len(c.mismatches)}"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_matches_vllm_omni(seed: int) -> None:
    p = _params(seed)
    counts = run_sequence(p, lambda v: [_omni_side(v, p), _hscache_side(v, p)])
    print(_summary(counts))
    assert not counts.mismatches, "\n".join(counts.mismatches[:10])
    assert not counts.refused, counts.refused
    assert counts.rows_compared > 0 and counts.hit_requests > 0


def test_sequences_cover_the_hard_cases() -> None:
    """The seeds together exercise every case the differential claims to cover."""
    total = Counts()
    for seed in SEEDS:
        p = _params(seed, steps=25)
        c = run_sequence(p, lambda v, p=p: [_hscache_side(v, p)])
        for name in (
            "same_step_hits",
            "preemptions",
            "resumptions",
            "aborts",
            "chunked",
            "late",
            "discarded",
            "hit_requests",
        ):
            setattr(total, name, getattr(total, name) + getattr(c, name))
    print(_summary(total))
    for name in ("same_step_hits", "preemptions", "resumptions", "aborts", "chunked", "late"):
        assert getattr(total, name) > 0, name


@pytest.mark.parametrize("seed", range(4))
def test_unsaved_steps(seed: int) -> None:
    """hscache serves no wrong row; vllm-omni's wrong rows are reported, not asserted."""
    p = _params(seed, unsaved=0.3, late=0.0)
    counts = run_sequence(p, lambda v: [_omni_side(v, p), _hscache_side(v, p)])
    ours = [m for m in counts.mismatches if " hscache " in m]
    print(_summary(counts), "vllm-omni wrong:", len(counts.mismatches) - len(ours))
    assert not ours, "\n".join(ours[:10])
    assert not counts.refused.get("hscache"), counts.refused


def test_unsaved_steps_cover_the_recomputation() -> None:
    """Over the seeds: hits on unsaved rows were sent back, and the requests were served
    from position 0 after the scheduler's rollback (the case the test above proves)."""
    recomputed = served = 0
    for seed in range(8):
        p = _params(seed, unsaved=0.3, late=0.0)
        c = run_sequence(p, lambda v, p=p: [_hscache_side(v, p)])
        assert not c.mismatches, "\n".join(c.mismatches[:10])
        assert not c.refused, c.refused
        recomputed += c.recomputed
        served += c.recomputed_served
    print(f"recomputed={recomputed} served again={served}")
    assert recomputed > 0 and served > 0


def test_unsaved_steps_without_the_report() -> None:
    """Recomputation off (no runner hook to carry the blocks): the same hits are refused
    with ``UnservableHitError``, never served short or wrong."""
    refused = 0
    for seed in range(4):
        p = _params(seed, unsaved=0.3, late=0.0)
        c = run_sequence(p, lambda v, p=p: [_hscache_side(v, p, recompute=False)])
        assert not c.mismatches, "\n".join(c.mismatches[:10])
        assert c.recomputed == 0
        refused += c.refused.get("hscache", 0)
    assert refused > 0


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_layout_against_recomputation(seed: int) -> None:
    """Beyond vllm-omni (it refuses more than one KV-cache group): a sliding-window group
    beside the full-attention one; hscache follows the full-attention group's tables and
    every materialized row equals the recomputed oracle."""
    from hscache_tools.testing.kv_cache import full_attention, group, sliding_window
    from vllm_omni.core.prefix_cache import (
        OmniPrefixCacheUnmatchError,
        check_prefix_cache_kv_groups,
    )

    with pytest.raises(OmniPrefixCacheUnmatchError):
        check_prefix_cache_kv_groups([group(sliding_window(4, 8)), group(full_attention(4))])
    p = _params(seed, window=8, num_blocks=20 if seed % 2 else 32)
    counts = run_sequence(p, lambda v: [_hscache_side(v, p)])
    print(_summary(counts))
    assert not counts.mismatches, "\n".join(counts.mismatches[:10])
    assert not counts.refused, counts.refused
    assert counts.hit_requests > 0


def test_hybrid_layout_wrong_group_is_caught() -> None:
    """Following the sliding-window group (vllm-omni's group 0) instead: its tables put the
    null block where the window dropped positions; hscache refuses those hits (the test
    above would fail) and still serves no wrong row."""
    from vllm_omni.core.prefix_cache import PrefixCacheConfig

    p = _params(0, window=8, num_blocks=32)

    def wrong(view: BatchView) -> list[Side]:
        cfg = PrefixCacheConfig(num_blocks=p.num_blocks, block_size=p.block_size)
        cache = OmniHiddenStateCache(cfg, view, settings=OmniSettings(storage="cpu"))
        return [Side("hscache", cache, deliver_once=True)]

    counts = run_sequence(p, wrong)
    assert counts.refused.get("hscache", 0) > 0
    assert not counts.mismatches, "\n".join(counts.mismatches[:10])


def _mutant_side(name: str):
    """Breaks rule ``name`` of hscache's side after its first save: a slot-mirror rule
    (``SlotMirror._rule_mutants()``) or one of the omni rules (``OmniStepRules``)."""
    from hscache._core import SlotMirror

    def after_first_save(sides: list[Side]) -> None:
        for side in sides:
            if side.name != "hscache":
                continue
            if name in SlotMirror._rule_mutants():
                side.cache.cache.mirror._break_rule(name)
            else:
                side.cache.rules._break_rule(name)

    return after_first_save


MUTANTS = [
    # The slot mirror's rules.
    ("reads_before_writes", 0.0),
    ("no_bump", 0.3),
    ("uncommitted_written", 0.3),
    # The omni rules (src/slots/omni_rules.rs).
    ("no_first_hit", 0.0),
    ("unservable_as_plain", 0.3),
    ("spans_in_scheduled_order", 0.0),
    ("recompute_as_plain", 0.3),
]


@pytest.mark.hooks
@pytest.mark.parametrize(("mutant", "unsaved"), MUTANTS)
def test_rule_mutants_are_caught(mutant: str, unsaved: float) -> None:
    caught = 0
    for seed in range(4):
        p = _params(seed, unsaved=unsaved, late=0.0)
        # The refusal mutant breaks the rule that applies with recomputation off.
        recompute = mutant != "unservable_as_plain"
        make = (
            (lambda v, p=p: [_omni_side(v, p), _hscache_side(v, p)])
            if not unsaved
            else (lambda v, p=p, rc=recompute: [_hscache_side(v, p, rc)])
        )
        counts = run_sequence(p, make, after_first_save=_mutant_side(mutant))
        caught += len(counts.mismatches) + counts.refused.get("hscache", 0) * (not unsaved)
    assert caught > 0, f"mutant {mutant} went unnoticed"


# vLLM's scheduler never resends a live request among its new ones (vllm-omni's async
# chunks and vLLM's V2 runner do), so this differential cannot reach that rule: its
# mutant is caught by tests/omni/test_bad_inputs.py.
CAUGHT_ELSEWHERE = {"continuation_hit"}


@pytest.mark.hooks
def test_every_omni_rule_mutant_is_caught_somewhere() -> None:
    from hscache._core import OmniStepRules

    listed = {m for m, _ in MUTANTS} | CAUGHT_ELSEWHERE
    assert set(OmniStepRules._rule_mutants()) <= listed


def _stream_faults(streams: dict[str, list[Any]], tokens: dict[str, list[int]]) -> list[str]:
    """The requests whose rows, appended materialize after materialize as vllm-omni's
    runner appends them for the next stage, are not exactly the oracle's rows of positions
    ``0 .. n`` (each row once, in order: what a never-preempted run hands on)."""
    import torch

    from tests.omni.steps import toy_rows

    faults = []
    for r, parts in streams.items():
        got = torch.cat(parts)
        n = got.shape[0]
        if len(tokens[r]) < n:
            faults.append(f"{r}: {n} rows for {len(tokens[r])} tokens")
            continue
        want = toy_rows("__hidden_states__", torch.tensor(tokens[r][:n]), torch.arange(n))
        if not torch.equal(got, want):
            faults.append(f"{r}: {n} rows for {len(tokens[r])} tokens")
    return faults


# Pools small enough to preempt (and resume) every sequence, every step materialized for
# all its requests (the runner's contract), at once or one step late, no aborts: each
# request's stream is then whole.
DELIVERY_SEEDS = range(int(os.environ.get("HSCACHE_OMNI_DIFF_SEEDS", "12")))


def _delivery(seed: int) -> tuple[Counts, list[Side]]:
    p = Params(
        seed=seed,
        num_blocks=12 + seed % 3,
        max_num_seqs=5,
        discard=0.0,
        subset=0.0,
        abort=0.0,
    )
    made: list[Side] = []

    def sides(view: BatchView) -> list[Side]:
        made.extend([_omni_side(view, p), _hscache_side(view, p)])
        return made

    return run_sequence(p, sides), made


def test_preempted_requests_deliver_each_row_once() -> None:
    """Preemption and resumption: every request's rows, appended step by step as vllm-omni's
    runner appends them for the next stage, are exactly the never-preempted run's (the
    oracle's rows of positions 0 .. n, once, in order) with hscache's cache (its delivery
    watermark). Over the same sequences vllm-omni's own cache, and a runner with no cache
    at all (each step's scheduled rows), hand resumed requests' recomputed rows on again
    after the ones they had delivered (counted and printed; asserted to happen)."""
    preempted = resumed = checked = 0
    omni_faults: list[str] = []
    cold_faults = 0
    for seed in DELIVERY_SEEDS:
        counts, (omni, hs) = _delivery(seed)
        assert not counts.mismatches, (seed, counts.mismatches[:5])
        assert not counts.refused, (seed, counts.refused)
        faults = _stream_faults(hs.streams, counts.tokens)
        assert not faults, (seed, faults[:5])
        checked += len(hs.streams)
        preempted += counts.preemptions
        resumed += counts.resumptions
        omni_faults += _stream_faults(omni.streams, counts.tokens)
        # With no cache, a resumed request's recomputed rows start below the end of the
        # rows it handed on before (the scheduler here caches KV blocks, so a resumption
        # starts at its hit, and a first schedule may start past 0: that is no repeat).
        for spans in counts.cold_streams.values():
            if any(s < e for (_, e), (s, _) in itertools.pairwise(spans)):
                cold_faults += 1
    print(
        f"requests={checked} preemptions={preempted} resumptions={resumed} "
        f"vllm-omni streams wrong={len(omni_faults)} no-cache streams wrong={cold_faults}"
    )
    assert preempted > 0 and resumed > 0 and checked > 0
    assert omni_faults and cold_faults > 0
