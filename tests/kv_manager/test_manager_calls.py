"""The per-step calls besides the allocations, against vLLM's own manager: a refused
admission (decided before its caching plan and event check), ``record_prefix_cache_stats``
(counted into vLLM's ``PrefixCacheStats`` in place, in Rust) and ``take_events`` (the
queue handed over and annotated in Rust), with the pool's ``kv_event_queue`` read and
replaced in between as vLLM's tests do.

``take_events`` hands over events annotated when they were built (the spec table in force,
``src/python/events/spec.rs``): across steps, after the live queue was read (un-annotated,
as vLLM's pool's), after a pool-level take, with ``kv_cache_event_metadata`` replaced (by
another tuple, a short one, a list), in compact mode and for events of the pure-Python
fallback, every taken batch equals vLLM's, annotations and warnings included."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache import exceptions
from hscache._core import coalesce_kv_events
from hscache.vllm import KVCacheManager
from hscache_tools.testing.kv_cache import (
    full_attention,
    full_attention_config,
    group,
    kv_cache_config,
    sliding_window,
)
from hscache_tools.testing.manager import build_manager, manager_kwargs
from hscache_tools.testing.requests import lora, make_request
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.metrics.stats import PrefixCacheStats

BOTH = (VllmKVCacheManager, KVCacheManager)


def _stats(s: Any) -> tuple[Any, ...]:
    return (
        s.reset,
        s.requests,
        s.queries,
        s.hits,
        s.preempted_requests,
        s.preempted_queries,
        s.preempted_hits,
    )


def _encoded(events: list[Any]) -> list[bytes]:
    return [msgspec.msgpack.encode(e) for e in events]


def _tight(cls: type, num_blocks: int = 12, config: Any = None) -> Any:
    return build_manager(
        cls,
        config if config is not None else full_attention_config(num_blocks),
        max_model_len=1024,
        enable_kv_cache_events=True,
        log_stats=True,
    )


def _fill(m: Any, prefix: list[int]) -> Any:
    """Caches ``prefix`` (freed: its blocks wait in the free queue), then holds every
    other free block with a running request; returns the running request."""
    first = make_request("first", [*prefix, 1])
    blocks, hit, _ = m.get_computed_blocks(first)
    assert m.allocate_slots(first, first.num_tokens - hit, hit, blocks) is not None
    m.free(first)
    free = m.block_pool.get_num_free_blocks()
    cached = len(prefix) // 16
    groups = len(m.kv_cache_config.kv_cache_groups)  # each group takes its own blocks
    num_hog = (free - groups * (cached + 1)) // groups
    hog = make_request("hog", [50_000 + i for i in range(num_hog * 16)])
    assert m.allocate_slots(hog, hog.num_tokens) is not None
    return hog


@pytest.mark.parametrize("layout", ["full", "full+swa"])
def test_refused_admission_matches_vllm(layout: str) -> None:
    """An admission whose hit sits in the free queue and whose new blocks do not fit:
    None on both managers, nothing changed, no event, at every retry; once a block is
    freed, it fits on both, with the same blocks and events."""
    outs = []
    for cls in BOTH:
        config = (
            kv_cache_config(
                [
                    group(full_attention(16), "model.layers.0.self_attn"),
                    group(sliding_window(16, 32), "model.layers.1.self_attn"),
                ],
                40,
            )
            if layout == "full+swa"
            else None
        )
        m = _tight(cls, 24 if config is None else 40, config)
        prefix = list(range(64))
        hog = _fill(m, prefix)
        m.take_events()
        req = make_request("late", prefix + list(range(500, 548)))
        seen = []
        for _ in range(3):
            blocks, hit, _ = m.get_computed_blocks(req)
            got = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            seen.append((got, hit, m.block_pool.get_num_free_blocks(), _encoded(m.take_events())))
        m.free(hog)
        blocks, hit, _ = m.get_computed_blocks(req)
        got = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        assert got is not None
        seen.append((got.get_block_ids(), hit, m.usage, _encoded(m.take_events())))
        outs.append(seen)
    assert outs[0] == outs[1]
    assert outs[1][0][0] is None and outs[1][0][1] == 64


def test_refused_admission_skips_the_event_check() -> None:
    """A request the event builder cannot describe (a LoRA request without
    ``adapter_id``): refused for lack of blocks, it returns None as vLLM's manager does
    (vLLM builds events only for blocks it caches); once it fits, hscache raises with
    the manager unchanged instead of failing after its blocks were cached."""
    results = []
    for cls in BOTH:
        m = _tight(cls)
        hog = _fill(m, list(range(32)))
        tokens = list(range(32)) + list(range(900, 940))
        req = make_request("a", tokens, lora_request=lora("x", 1, "/p"))
        req.lora_request = SimpleNamespace(lora_name="x", lora_path="/p", lora_int_id=1, name="x")  # type: ignore[assignment]
        blocks, hit, _ = m.get_computed_blocks(req)
        results.append(m.allocate_slots(req, req.num_tokens - hit, hit, blocks))
        if cls is KVCacheManager:
            m.free(hog)
            before = m.state_digest()
            blocks, hit, _ = m.get_computed_blocks(req)
            with pytest.raises(exceptions.InvalidArgumentError, match="nothing was allocated"):
                m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            assert m.state_digest() == before
    assert results == [None, None]


def test_record_prefix_cache_stats_matches_vllm_at_every_read() -> None:
    """New and preempted requests, a request that skips the lookup, a reset and a
    ``make_prefix_cache_stats``: the ``prefix_cache_stats`` object reads as vLLM's after
    every call, and stays the object vLLM's tests hold."""
    managers = [_tight(cls, 64) for cls in BOTH]
    reqs = [
        make_request("n", list(range(40))),
        make_request("p", list(range(70))),
        make_request("skip", list(range(33)), prompt_logprobs=1),
    ]
    reqs[1].num_preemptions = 2
    held = [m.prefix_cache_stats for m in managers]
    for req, hits in zip(reqs * 2, (16, 32, 0, 0, 48, 0), strict=True):
        for m in managers:
            m.record_prefix_cache_stats(req, hits)
        assert _stats(managers[0].prefix_cache_stats) == _stats(managers[1].prefix_cache_stats)
    assert [m.prefix_cache_stats for m in managers] == held
    assert managers[1].prefix_cache_stats is held[1]
    assert _stats(held[1]) == (False, 2, 80, 16, 2, 140, 80)
    taken = [m.make_prefix_cache_stats() for m in managers]
    assert _stats(taken[0]) == _stats(taken[1])
    for m in managers:
        m.record_prefix_cache_stats(reqs[0], 8)
    assert _stats(managers[0].prefix_cache_stats) == _stats(managers[1].prefix_cache_stats)


def test_record_prefix_cache_stats_calls_record_of_other_stats_objects() -> None:
    """A ``PrefixCacheStats`` subclass (or any stats object) gets its own ``record``
    call, with vLLM's keywords; stats off or caching off records nothing; bad hit
    counts are typed errors with the stats unchanged."""
    calls: list[dict[str, Any]] = []

    class Spy(PrefixCacheStats):
        def record(self, **kwargs: Any) -> None:  # type: ignore[override]
            calls.append(kwargs)

    m = _tight(KVCacheManager, 64)
    req = make_request("a", list(range(40)))
    m.prefix_cache_stats = Spy()
    m.record_prefix_cache_stats(req, 16)
    assert calls == [{"num_tokens": 40, "num_hits": 16, "preempted": False}]
    m.prefix_cache_stats = PrefixCacheStats()
    for bad, error in ((1.0, TypeError), (True, TypeError), (-1, exceptions.InvalidArgumentError)):
        with pytest.raises(error):
            m.record_prefix_cache_stats(req, bad)  # type: ignore[arg-type]
    assert _stats(m.prefix_cache_stats) == _stats(PrefixCacheStats())
    m.prefix_cache_stats = None
    with pytest.raises(exceptions.InvalidArgumentError):
        m.record_prefix_cache_stats(req, 0)
    off = build_manager(KVCacheManager, full_attention_config(64), log_stats=False)
    off.record_prefix_cache_stats(req, 16)
    assert off.prefix_cache_stats is None


def test_prefix_cache_stats_counted_in_rust_read_as_vllms() -> None:
    """Between two ``make_prefix_cache_stats`` calls the stats object is hidden, and
    admissions are counted in Rust: every way of reading it (the getter, a reference held
    from it, the object ``make_prefix_cache_stats`` returns, the object a setter replaces,
    a ``record`` patched on the class, hit counts beyond 64 bits) reads vLLM's values."""
    managers = [_tight(cls, 64) for cls in BOTH]
    new, preempted = make_request("n", list(range(40))), make_request("p", list(range(70)))
    preempted.num_preemptions = 1

    def record(req: Any, hits: int) -> None:
        for m in managers:
            m.record_prefix_cache_stats(req, hits)

    def same(a: Any, b: Any) -> None:
        assert _stats(a) == _stats(b)

    for m in managers:
        m.make_prefix_cache_stats()  # the object is now hidden: counted in Rust
    record(new, 16)
    record(preempted, 32)
    taken = [m.make_prefix_cache_stats() for m in managers]
    same(*taken)
    assert _stats(taken[1]) == (False, 1, 40, 16, 1, 70, 32)
    record(new, 48)
    held = [m.prefix_cache_stats for m in managers]  # handed out: counted into it now
    same(*held)
    record(preempted, 0)
    same(*held)
    record(new, 2**70)  # beyond a u64: Python ints, as vLLM's
    same(*held)
    for m in managers:
        m.make_prefix_cache_stats()
    record(new, 4)  # hidden counts of an object the setter then replaces
    replaced = [PrefixCacheStats() for _ in managers]
    for m, r in zip(managers, replaced, strict=True):
        m.prefix_cache_stats = r
    record(new, 2)
    same(*replaced)
    assert _stats(replaced[1]) == (False, 1, 40, 2, 0, 0, 0)
    for m in managers:
        m.make_prefix_cache_stats()
    calls: list[Any] = []
    original = PrefixCacheStats.record
    PrefixCacheStats.record = lambda self, **kw: calls.append(kw)  # type: ignore[method-assign]
    try:
        record(new, 1)
    finally:
        PrefixCacheStats.record = original  # type: ignore[method-assign]
    assert calls == [{"num_tokens": 40, "num_hits": 1, "preempted": False}] * 2
    same(*(m.make_prefix_cache_stats() for m in managers))


def test_log_stats_switched_off_and_on() -> None:
    """``log_stats`` is the core's: switched off, nothing is counted and
    ``make_prefix_cache_stats`` is None; switched on again, vLLM's values; a non-bool is a
    ``TypeError``."""
    managers = [_tight(cls, 64) for cls in BOTH]
    req = make_request("n", list(range(40)))
    for m in managers:
        m.make_prefix_cache_stats()
        m.log_stats = False
        m.record_prefix_cache_stats(req, 16)
        assert m.make_prefix_cache_stats() is None
        m.log_stats = True
        m.record_prefix_cache_stats(req, 32)
    assert _stats(managers[0].make_prefix_cache_stats()) == _stats(
        managers[1].make_prefix_cache_stats()
    )
    with pytest.raises(TypeError):
        managers[1].log_stats = "yes"  # type: ignore[assignment]
    assert managers[1].log_stats is True


def test_take_events_matches_vllm_with_queue_reads_in_between() -> None:
    """Events taken through the manager (annotated) and through the pool (not), the
    pool's ``kv_event_queue`` read (the same list, growing) and replaced in between, and
    a group index outside the metadata (vLLM's warning, the event left unannotated)."""
    outs = []
    for cls in BOTH:
        m = _tight(cls, 64)
        seen: list[Any] = []
        a = make_request("a", list(range(40)))
        assert m.allocate_slots(a, 40) is not None
        queue = m.block_pool.kv_event_queue
        seen.append(_encoded(queue))
        b = make_request("b", list(range(100, 140)))
        assert m.allocate_slots(b, 40) is not None
        seen.append((len(queue), _encoded(m.take_events())))
        assert m.block_pool.kv_event_queue == []
        c = make_request("c", list(range(200, 240)))
        assert m.allocate_slots(c, 40) is not None
        seen.append(_encoded(m.block_pool.take_events()))
        m.block_pool.kv_event_queue = []
        b_ids = set(m.get_block_ids("b")[0])
        m.free(a)
        m.free(b)
        m.block_pool.evict_blocks(b_ids)
        seen.append(_encoded(m.take_events()))
        d = make_request("d", list(range(300, 340)))
        assert m.allocate_slots(d, 40) is not None
        m.kv_cache_event_metadata = ()
        seen.append(_encoded(m.take_events()))
        seen.append(m.take_events())
        outs.append(seen)
    assert outs[0] == outs[1]
    assert outs[1][1][1] and outs[1][4]


def test_take_events_warns_in_vllms_words(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _tight(KVCacheManager, 64)
    assert m.allocate_slots(make_request("a", list(range(40))), 40) is not None
    m.kv_cache_event_metadata = ()
    # vLLM's logger does not propagate; for this test only (restored after it)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.WARNING):
        (event,) = m.take_events()
    assert event.kv_cache_spec_kind is None
    assert any("not in KV cache metadata" in r.getMessage() for r in caplog.records)


def test_events_off_queue_and_take() -> None:
    m = build_manager(KVCacheManager, full_attention_config(64), enable_kv_cache_events=False)
    assert m.allocate_slots(make_request("a", list(range(40))), 40) is not None
    assert m.take_events() == [] and m.block_pool.take_events() == []
    assert m.block_pool.kv_event_queue == []


_LAYOUTS = {
    "full": lambda: full_attention_config(24),
    "full+swa": lambda: kv_cache_config(
        [
            group(full_attention(16), "model.layers.0.self_attn"),
            group(sliding_window(16, 32), "model.layers.1.self_attn"),
        ],
        48,
    ),
}


def _events_manager(cls: type, layout: str, **kwargs: Any) -> Any:
    return build_manager(
        cls, _LAYOUTS[layout](), max_model_len=1024, enable_kv_cache_events=True, **kwargs
    )


class _Steps:
    """A seeded stream of admissions (shared prefixes, so hits and chains) and frees
    under pressure (so evictions): the same calls on each manager it drives."""

    def __init__(self, m: Any, seed: int, fallback_every: int = 0) -> None:
        self.m, self.rng, self.held, self.n = m, random.Random(seed), [], 0
        self.fallback_every = fallback_every

    def step(self) -> None:
        m, rng = self.m, self.rng
        self.n += 1
        if self.held and (rng.random() < 0.45 or len(self.held) > 3):
            m.free(self.held.pop(rng.randrange(len(self.held))))
            return
        prefix = [rng.randrange(3) * 1000 + t for t in range(16 * rng.randrange(1, 4))]
        tail = [100_000 + 100 * self.n + t for t in range(rng.randrange(0, 40))]
        req = make_request(f"r{self.n}", prefix + tail)
        if self.fallback_every and self.n % self.fallback_every == 0:
            # A token list the core does not slice: the pure-Python fallback builds it.
            req.all_token_ids = tuple(req._all_token_ids)  # type: ignore[assignment]
        blocks, hit, _ = m.get_computed_blocks(req)
        if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
            self.held.append(req)


def _annotations(events: list[Any]) -> list[tuple[Any, Any]]:
    return [
        (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
        for e in events
        if isinstance(e, BlockStored)
    ]


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("fallback_every", [0, 3])
def test_take_events_matches_vllm_across_steps(layout: str, fallback_every: int) -> None:
    """Every step's ``take_events`` equals vLLM's, annotations included: the first take
    runs vLLM's loop, the later ones hand over events annotated as they were built
    (events of the pure-Python fallback too)."""
    outs = []
    for cls in BOTH:
        m = _events_manager(cls, layout)
        steps = _Steps(m, seed=7, fallback_every=fallback_every)
        seen = []
        for _ in range(60):
            steps.step()
            seen.append(_encoded(m.take_events()))
        outs.append(seen)
        if cls is KVCacheManager:
            kinds = {a for a in _annotations(m.take_events())}
            assert None not in {k for k, _ in kinds}
    assert outs[0] == outs[1]
    assert sum(map(len, outs[1])) > 60


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_events_read_from_the_queue_are_unannotated_and_taken_annotated(layout: str) -> None:
    """After a take (the table in force), the live ``kv_event_queue`` shows vLLM's pool's
    events, un-annotated; the next take annotates them, and the one after (the table
    back in force) too."""
    outs = []
    for cls in BOTH:
        m = _events_manager(cls, layout)
        steps = _Steps(m, seed=11)
        seen: list[Any] = []
        for _ in range(3):
            steps.step()
            seen.append(_encoded(m.take_events()))
        for _ in range(3):
            steps.step()
        queue = m.block_pool.kv_event_queue
        seen.append(("queue", _encoded(queue), _annotations(queue)))
        steps.step()
        seen.append(("taken", _encoded(m.take_events())))
        for _ in range(3):
            steps.step()
            seen.append(_encoded(m.take_events()))
        outs.append(seen)
    assert outs[0] == outs[1]
    _, encoded, annotations = outs[1][3]
    assert encoded and annotations and set(annotations) == {(None, None)}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_pool_take_is_unannotated_and_a_later_manager_take_annotates(layout: str) -> None:
    """``block_pool.take_events()`` returns vLLM's pool's events, un-annotated, with the
    table kept for the new queue: the manager's next take annotates its events."""
    outs = []
    for cls in BOTH:
        m = _events_manager(cls, layout)
        steps = _Steps(m, seed=3)
        seen: list[Any] = []
        for _ in range(4):
            steps.step()
            seen.append(_encoded(m.take_events()))
            for _ in range(2):
                steps.step()
            pooled = m.block_pool.take_events()
            seen.append(("pool", _encoded(pooled), _annotations(pooled)))
            steps.step()
            seen.append(_encoded(m.take_events()))
        outs.append(seen)
    assert outs[0] == outs[1]
    pooled_annotations = [
        a for entry in outs[1] if isinstance(entry, tuple) and entry[0] == "pool" for a in entry[2]
    ]
    assert pooled_annotations and set(pooled_annotations) == {(None, None)}


def test_replaced_event_metadata_gives_vllms_takes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kv_cache_event_metadata`` replaced between takes, after events were built
    (another tuple, one too short, a list, back to a good tuple): each take equals
    vLLM's, warnings included (for a group outside the metadata: logged, the event
    un-annotated)."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    other = (("custom_kind", 7), ("other_kind", None))
    replacements: list[Any] = [None, other, None, other[:1], None, (), [("listed", 3)] * 2]
    replacements += [None, (("back", 1), ("again", 2)), None]
    outs = []
    for cls in BOTH:
        m = _events_manager(cls, "full+swa")
        steps = _Steps(m, seed=5)
        seen: list[Any] = []
        for new in replacements:
            # Events built under the table of the metadata before: replaced, then taken.
            for _ in range(3):
                steps.step()
            if new is not None:
                m.kv_cache_event_metadata = new
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="vllm"):
                taken = m.take_events()
            warned = sum("not in KV cache metadata" in r.getMessage() for r in caplog.records)
            seen.append((_encoded(taken), warned, _annotations(taken)))
        outs.append(seen)
    assert outs[0] == outs[1]
    assert any(warned for _, warned, _ in outs[1])
    kinds = {kind for _, _, annotations in outs[1] for kind, _ in annotations}
    assert {"custom_kind", "listed", "back", None} <= kinds


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("fallback_every", [0, 3])
def test_compact_takes_are_vllms_takes_coalesced(layout: str, fallback_every: int) -> None:
    """In compact mode each taken batch is ``coalesce_kv_events`` of vLLM's batch: the
    events a merge joins carry one annotation, vLLM's."""
    batches: dict[type, list[list[Any]]] = {}
    for cls, extra in ((VllmKVCacheManager, {}), (KVCacheManager, {"kv_events_mode": "compact"})):
        kwargs = manager_kwargs(_LAYOUTS[layout](), max_model_len=1024, enable_kv_cache_events=True)
        m = cls(**kwargs, **extra)
        steps = _Steps(m, seed=9, fallback_every=fallback_every)
        batches[cls] = []
        for _ in range(50):
            steps.step()
            batches[cls].append(m.take_events())
    want = [_encoded(coalesce_kv_events(b)) for b in batches[VllmKVCacheManager]]
    got = [_encoded(b) for b in batches[KVCacheManager]]
    assert got == want
    assert sum(map(len, got)) < sum(map(len, batches[VllmKVCacheManager]))
