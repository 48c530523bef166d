"""vllm-omni's AR schedulers twice in lockstep: on vLLM's KV-cache manager and on hscache's.

Both schedulers are vllm-omni 0.30's own ``OmniARScheduler`` / ``OmniARAsyncScheduler`` on
vLLM 0.30, built offline (:mod:`hscache_tools.testing.offline_scheduler`) on one configuration:
one keeps vLLM's Python ``KVCacheManager``, the other gets hscache's the way a vllm-omni
user switches it on (``HSCACHE=1`` through hscache's vLLM plugin, or
``scheduler_cls: hscache.omni.OmniARScheduler``); or its ``OmniGenerationScheduler`` (non-AR
stages), switched by the plugin. The same seeded stream drives both:
prompts with shared prefixes and exact repeats, aborts, preemption under a small pool,
async scheduling with two batches in flight (output placeholders), and what vllm-omni adds
on the manager: KV transfer to the next stage (``omni_kv_config.need_send_cache``: block
ids read with ``get_block_ids`` at the trigger, the blocks held until the runner acks the
extraction, then freed), the physical-order free of its native Mooncake path
(``pop_blocks_for_free`` + ``block_pool.free_blocks``, with and without the deferred-free
fence) and ``estimate_cached_tokens`` in the prefill stats.

After every ``schedule()`` and every ``update_from_output()`` the two are compared: the
``SchedulerOutput`` (new requests' block ids and computed tokens, running requests' new
block ids, finishes, preemptions, resumptions, vllm-omni's KV-transfer metadata), the
engine outputs (tokens, finish reasons, KV-transfer parameters, prefill stats, the
scheduler stats: usage and prefix-cache stats), the KV events published, and the two
managers' whole state (``tests/vllm_diff/side.py``'s ``observe_manager``: every table,
the free queue order, every block, the prefix-cache index). vllm-omni swallows exceptions
of its transfer-free path into its log; any error logged fails the run.

Emulated, not configured (no connector or next stage offline): ``omni_kv_config`` is set
on the built scheduler, the Mooncake connector's presence by its one predicate
(``_uses_native_mooncake_connector``), a KV consumer's deferred free by the Scheduler's
``defer_block_free`` flag, the runner's extraction acks by ``kv_extracted_req_ids``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

from hscache_tools.testing.offline_scheduler import make_scheduler, summarize_output
from hscache_tools.testing.requests import init_none_hash, make_request
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from tests.vllm_diff.side import observe_manager

SWITCHES = ("plugin", "scheduler_cls")


@dataclasses.dataclass
class PairConfig:
    """One stream's shape."""

    seed: int
    async_scheduling: bool = False
    switch: str = "scheduler_cls"
    num_blocks: int = 40
    block_size: int = 4
    token_budget: int = 24
    max_num_seqs: int = 6
    enable_caching: bool = True
    kv_transfer: str | None = None
    """``omni_kv_config.kv_transfer_criteria.type``: None (no transfer),
    ``"on_finish"`` (``need_send_cache`` only) or ``"prefill_finished"``."""
    stop_after_transfer: bool = True
    mooncake: bool = False
    defer_block_free: bool = False
    kv_cache_events: bool = True
    generation: bool = False
    """vllm-omni's ``OmniGenerationScheduler`` (non-AR stages) instead of the AR ones;
    switched by the plugin only (hscache names no class for it)."""
    steps: int = 80
    talker: bool = False
    """A talker-like stage: short prompts, long decodes, many concurrent requests and a
    queue behind them (:func:`talker_config`)."""

    def short(self) -> str:
        return (
            f"seed{self.seed}-{'talker-' if self.talker else ''}"
            f"{'generation-' if self.generation else ''}{self.switch}"
            f"-{'async' if self.async_scheduling else 'sync'}"
            f"-N{self.num_blocks}-c{int(self.enable_caching)}-xfer:{self.kv_transfer}"
            f"{'-mooncake' if self.mooncake else ''}{'-defer' if self.defer_block_free else ''}"
        )


def config_for_seed(seed: int, steps: int = 80) -> PairConfig:
    """Seeds cycle through the features; the pool is small enough to preempt on odd seeds."""
    rng = random.Random(seed * 13 + 5)
    async_scheduling = seed % 2 == 0
    kv_transfer = (None, "on_finish", "prefill_finished")[seed % 3]
    mooncake = seed % 4 in (1, 2)
    return PairConfig(
        seed=seed,
        async_scheduling=async_scheduling,
        switch=SWITCHES[(seed // 2) % 2],
        num_blocks=rng.choice((14, 18, 40)) if seed % 2 else rng.choice((24, 60)),
        block_size=rng.choice((4, 8)),
        token_budget=rng.choice((16, 24, 48)),
        max_num_seqs=rng.randint(3, 8),
        enable_caching=not mooncake or rng.random() < 0.5,
        kv_transfer=kv_transfer,
        stop_after_transfer=rng.random() < 0.5,
        mooncake=mooncake,
        defer_block_free=mooncake and async_scheduling and rng.random() < 0.7,
        kv_cache_events=rng.random() < 0.8,
        steps=steps,
    )


def talker_config(seed: int, async_scheduling: bool, steps: int = 160) -> PairConfig:
    """A talker-like stage (hscache's own class, so the fast path may serve): prompts of
    3-12 tokens, 40-120 output tokens each, 16 seats and arrivals that keep a queue."""
    return PairConfig(
        seed=seed,
        async_scheduling=async_scheduling,
        switch="scheduler_cls",
        num_blocks=160,
        block_size=8,
        token_budget=64,
        max_num_seqs=16,
        kv_cache_events=seed % 2 == 0,
        steps=steps,
        talker=True,
    )


class PairDivergence(AssertionError):
    """The two schedulers decided differently, or their managers' states differ."""


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@contextlib.contextmanager
def _watch_errors() -> Iterator[_ErrorLog]:
    handler = _ErrorLog()
    loggers = [logging.getLogger(n) for n in ("vllm_omni", "vllm", "hscache")]
    loggers += [logging.getLogger("vllm_omni.core.sched.omni_ar_scheduler")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@contextlib.contextmanager
def plugin_switched_on() -> Iterator[None]:
    """``HSCACHE=1`` and hscache's vLLM plugin entry point, as ``EngineCore`` loads it in
    every engine process; vLLM's scheduler module and hasher are restored afterwards."""
    import vllm.v1.core.sched.scheduler as scheduler_module
    from hscache.vllm import plugin
    from hscache.vllm.block_hasher import uninstall_block_hasher

    saved_env = os.environ.get("HSCACHE")
    saved = {name: getattr(scheduler_module, name) for name in plugin.scheduler_bindings()}
    os.environ["HSCACHE"] = "1"
    try:
        plugin.register()
        yield
    finally:
        for name, obj in saved.items():
            setattr(scheduler_module, name, obj)
        uninstall_block_hasher()
        if saved_env is None:
            del os.environ["HSCACHE"]
        else:
            os.environ["HSCACHE"] = saved_env


def _build(cfg: PairConfig, cls: type) -> Any:
    sched = make_scheduler(
        cls,
        cfg.num_blocks,
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=max(cfg.token_budget, cfg.block_size),
        max_model_len=512,
        async_scheduling=cfg.async_scheduling,
        enable_prefix_caching=cfg.enable_caching,
        kv_cache_events=cfg.kv_cache_events,
    )
    if cfg.kv_transfer is not None:
        omni_kv: dict[str, Any] = {"need_send_cache": True}
        if cfg.kv_transfer != "on_finish":
            omni_kv["kv_transfer_criteria"] = {
                "type": cfg.kv_transfer,
                "stop_after_transfer": cfg.stop_after_transfer,
            }
        sched._omni_kv_config = omni_kv
        sched.kv_transfer_criteria = sched._get_kv_transfer_criteria()
    if cfg.mooncake:
        sched._uses_native_mooncake_connector = lambda: True
    if cfg.defer_block_free:
        sched.defer_block_free = True
    return sched


def build_pair(cfg: PairConfig) -> tuple[Any, Any]:
    """(vLLM's manager, hscache's manager): the same vllm-omni scheduler class twice."""
    import hscache.omni
    from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler

    stock = OmniARAsyncScheduler if cfg.async_scheduling else OmniARScheduler
    if cfg.generation:
        from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler

        stock = OmniGenerationScheduler
    reference = _build(cfg, stock)
    if cfg.switch == "plugin" or cfg.generation:
        with plugin_switched_on():
            ours = _build(cfg, stock)
    else:
        cls = (
            hscache.omni.OmniARAsyncScheduler
            if cfg.async_scheduling
            else hscache.omni.OmniARScheduler
        )
        ours = _build(cfg, cls)
    return reference, ours


class _Recorder:
    """Records the KV-event batches a scheduler publishes (its publisher is vLLM's null one)."""

    def __init__(self, sched: Any) -> None:
        self.batches: list[Any] = []
        publisher = sched.kv_event_publisher
        original = publisher.publish

        def publish(batch: Any) -> None:
            self.batches.append(list(batch.events))
            original(batch)

        publisher.publish = publish

    def take(self) -> list[Any]:
        out, self.batches = self.batches, []
        return out


def _engine_outputs(outputs: dict[int, Any]) -> list[Any]:
    """What two schedulers must agree on in ``update_from_output``'s result (no timestamps)."""
    summary: list[Any] = []
    for client, eco in sorted(outputs.items()):
        for o in eco.outputs:
            ps = o.prefill_stats
            summary.append(
                (
                    client,
                    type(o).__qualname__,
                    o.request_id,
                    list(o.new_token_ids),
                    str(o.finish_reason),
                    o.stop_reason,
                    o.num_nans_in_logits,
                    o.trace_headers,
                    None if o.events is None else [(e.type, e.timestamp > 0) for e in o.events],
                    _untimed(o.kv_transfer_params),
                    None if ps is None else dataclasses.astuple(ps),
                    # OmniEngineCoreOutput's own fields
                    tuple(getattr(o, f, "-") for f in _OMNI_FIELDS),
                )
            )
        st = eco.scheduler_stats
        if st is not None:
            pcs = st.prefix_cache_stats
            summary.append(
                (
                    "stats",
                    st.num_running_reqs,
                    st.num_waiting_reqs,
                    round(st.kv_cache_usage, 12),
                    None
                    if pcs is None
                    else (
                        pcs.requests,
                        pcs.queries,
                        pcs.hits,
                        pcs.preempted_requests,
                        pcs.preempted_queries,
                        pcs.preempted_hits,
                    ),
                )
            )
        summary.append(("finished", sorted(eco.finished_requests or ())))
    return summary


_OMNI_FIELDS = (
    "multimodal_output",
    "pooling_output_payload",
    "is_segment_finished",
    "new_prompt_len_snapshot",
    "num_generation_tokens",
)


def _untimed(params: Any) -> Any:
    """KV-transfer parameters without vllm-omni's wall-clock wait (``kv_wait_s``)."""
    if isinstance(params, dict) and "kv_wait_s" in params:
        return {**params, "kv_wait_s": "<seconds>"}
    return params


def _schedule_summary(so: Any) -> tuple[Any, ...]:
    xfer = getattr(so, "finished_requests_needing_kv_transfer", None) or {}
    return (
        summarize_output(so),
        so.total_num_scheduled_tokens,
        list(so.num_common_prefix_blocks),
        sorted((r, d["seq_len"], list(d["block_ids"])) for r, d in xfer.items()),
    )


@dataclasses.dataclass
class PairCounts:
    steps: int = 0
    requests: int = 0
    aborts: int = 0
    preemptions: int = 0
    hit_tokens: int = 0
    transfers: int = 0
    acks: int = 0
    events: int = 0
    comparisons: int = 0
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    fast: dict[str, int] = dataclasses.field(default_factory=dict)
    """hscache's scheduler's ``fast_path_counts`` at the end (empty: vllm-omni's class)."""


_COUNTED = ("get_block_ids", "estimate_cached_tokens", "pop_blocks_for_free", "free")


class _CallCounter:
    """Counts the manager calls the scheduler makes (not the comparison's own reads, made
    while ``paused``); the bound methods stay the manager's own: for hscache's, the Rust
    ``KVCacheCore`` methods."""

    def __init__(self, sched: Any) -> None:
        self.calls: dict[str, int] = {}
        self.paused = False
        mgr = sched.kv_cache_manager
        for name in _COUNTED:
            setattr(mgr, name, self._wrap(name, getattr(mgr, name)))
        mgr.block_pool.free_blocks = self._wrap(
            "block_pool.free_blocks", mgr.block_pool.free_blocks
        )

    def _wrap(self, name: str, method: Any) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            if not self.paused:
                self.calls[name] = self.calls.get(name, 0) + 1
            return method(*a, **kw)

        return counted


def run_pair(cfg: PairConfig) -> PairCounts:
    """One seeded stream; raises :class:`PairDivergence` on the first difference."""
    for name in ("vllm", "hscache", "vllm_omni"):
        logging.getLogger(name).setLevel(logging.ERROR)
    init_none_hash("sha256")
    rng = random.Random(cfg.seed)
    reference, ours = build_pair(cfg)
    sides = (reference, ours)
    recorders = [_Recorder(s) for s in sides]
    counts = PairCounts()
    counter = _CallCounter(ours)
    counts.calls = counter.calls
    bs = cfg.block_size
    prefixes = [[rng.randrange(1, 900) for _ in range(rng.randint(1, 5) * bs)] for _ in range(3)]
    recent: list[list[int]] = []
    in_flight: list[tuple[Any, Any, list[bool], list[bool], int]] = []
    pending_acks: list[tuple[int, list[str]]] = []
    next_id = 0

    def fail(step: int, what: str, want: Any, got: Any) -> None:
        raise PairDivergence(
            f"{cfg.short()} step {step}: {what}\n  vLLM:    {want!r}"[:3000]
            + f"\n  hscache: {got!r}"[:3000]
        )

    def compare_managers(step: int, when: str) -> None:
        counter.paused = True
        try:
            compare_states(step, when)
        finally:
            counter.paused = False

    def compare_states(step: int, when: str) -> None:
        live = sorted(set(reference.requests) | set(ours.requests))
        want = observe_manager(
            reference.kv_cache_manager, live=live, deep=True, requests=reference.requests
        )
        got = observe_manager(ours.kv_cache_manager, live=live, deep=True, requests=ours.requests)
        for (label, v), (_, h) in zip(want, got, strict=True):
            if label.startswith("internal invariants"):
                if h is not None:
                    fail(step, f"{when}: hscache invariants", None, h)
                continue
            if label.startswith("estimate_cached_tokens") and isinstance(v, tuple):
                continue  # a request vLLM's manager no longer knows
            if v != h:
                fail(step, f"{when}: {label}", v, h)
        counts.comparisons += 1
        ev = [r.take() for r in recorders]
        if ev[0] != ev[1]:
            fail(step, f"{when}: KV events", ev[0], ev[1])
        counts.events += sum(len(b) for b in ev[0])

    def samples(sched: Any, so: Any) -> list[bool]:
        # A request whose prefill is still partial samples nothing (vLLM's runner).
        return [
            sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
            for r in so.num_scheduled_tokens
        ]

    def update(step: int) -> None:
        so_ref, so_ours, s_ref, s_ours, sched_step = in_flight.pop(0)
        acks: list[str] = []
        while pending_acks and pending_acks[0][0] <= step:
            acks.extend(pending_acks.pop(0)[1])
        results = []
        for sched, so, sampled in ((reference, so_ref, s_ref), (ours, so_ours, s_ours)):
            req_ids = list(so.num_scheduled_tokens)
            mro = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[
                    [(sched_step * 31 + i * 7) % 899 + 1] if sampled[i] else []
                    for i in range(len(req_ids))
                ],
            )
            mro.kv_extracted_req_ids = list(acks) or None  # type: ignore[attr-defined]
            # vllm-omni rate-limits scheduler stats by wall clock: every step's, here.
            sched._last_stats_time = float("-inf")
            results.append(_engine_outputs(sched.update_from_output(so, mro)))
        counts.acks += len(acks)
        if results[0] != results[1]:
            fail(step, "update_from_output", results[0], results[1])
        for o in results[0]:
            if o[0] == "stats" and o[4] is not None:
                counts.hit_tokens += o[4][2]
        compare_managers(step, "after update_from_output")

    with _watch_errors() as errors:
        for step in range(cfg.steps):
            counts.steps += 1
            arrivals = rng.choice((0, 1, 1, 2))
            if cfg.talker:
                arrivals = 24 if step == 0 else rng.choice((0, 0, 0, 1, 1, 2))
            for _ in range(arrivals):
                if cfg.talker:
                    prompt = [rng.randrange(1, 900) for _ in range(rng.randint(3, 12))]
                    max_tokens = rng.randint(40, 120)
                    for sched in sides:
                        sched.add_request(
                            make_request(
                                f"r{next_id}",
                                prompt,
                                max_tokens=max_tokens,
                                hash_block_size=bs,
                                ignore_eos=True,
                            )
                        )
                    next_id += 1
                    counts.requests += 1
                    continue
                if recent and rng.random() < 0.25:
                    prompt = list(rng.choice(recent))
                else:
                    prompt = list(rng.choice(prefixes)) if rng.random() < 0.75 else []
                    prompt += [rng.randrange(1, 900) for _ in range(rng.randint(1, 3 * bs + 3))]
                recent = [*recent, prompt][-5:]
                max_tokens = rng.randint(1, 10)
                for sched in sides:
                    sched.add_request(
                        make_request(
                            f"r{next_id}",
                            prompt,
                            max_tokens=max_tokens,
                            hash_block_size=bs,
                            ignore_eos=True,
                        )
                    )
                next_id += 1
                counts.requests += 1
            live = [r for r in reference.requests if not reference.requests[r].is_finished()]
            if live and rng.random() < (0.02 if cfg.talker else 0.06):
                victim = rng.choice(sorted(live))
                for sched in sides:
                    sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
                counts.aborts += 1
            outs = [s.schedule() for s in sides]
            want, got = (_schedule_summary(o) for o in outs)
            if want != got:
                fail(step, "schedule()", want, got)
            counts.preemptions += len(outs[0].preempted_req_ids or ())
            xfer = getattr(outs[0], "finished_requests_needing_kv_transfer", None) or {}
            if xfer:
                counts.transfers += len(xfer)
                pending_acks.append((step + rng.choice((0, 1, 2)), sorted(xfer)))
            compare_managers(step, "after schedule()")
            in_flight.append(
                (outs[0], outs[1], samples(reference, outs[0]), samples(ours, outs[1]), step)
            )
            # Async scheduling: the engine schedules the next batch while one is in flight.
            depth = 2 if cfg.async_scheduling and rng.random() < 0.7 else 1
            while len(in_flight) >= depth:
                update(step)
        # Drain: acknowledge every transfer, abort everything, run out the queue.
        for sched in sides:
            sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
        for step in range(cfg.steps, cfg.steps + 6):
            while in_flight:
                update(step)
            pending_acks[:] = [(step, [r for _, rs in pending_acks for r in rs])]
            outs = [s.schedule() for s in sides]
            if _schedule_summary(outs[0]) != _schedule_summary(outs[1]):
                fail(step, "schedule() (drain)", *map(_schedule_summary, outs))
            xfer = getattr(outs[0], "finished_requests_needing_kv_transfer", None) or {}
            if xfer:
                pending_acks.append((step, sorted(xfer)))
            in_flight.append(
                (outs[0], outs[1], samples(reference, outs[0]), samples(ours, outs[1]), step)
            )
        while in_flight:
            update(cfg.steps + 6)
    if errors.records:
        raise PairDivergence(f"{cfg.short()}: errors logged: {errors.records[:3]}")
    counts.fast = dict(getattr(ours, "fast_path_counts", {}))
    return counts
