"""Differential runs on vLLM's real ``Scheduler``: no emulation of its rules at all.

The trace generator (:mod:`.generator`) emulates the Scheduler's manager calls and covers
every corner of the manager's interface; this driver is the other half of the evidence:
vLLM 0.33.0's own ``Scheduler`` (or ``AsyncScheduler``), built offline
(:mod:`hscache_tools.testing.offline_scheduler`) over a layout of :mod:`.layouts`, schedules a
seeded stream of requests (shared prefixes, chunked prefill, preemption under a small
pool, aborts, prefix-cache resets) with stub model outputs. Its manager is a
``hscache.vllm.ParityKVCacheManager`` (``HSCACHE_PARITY=1``): every call the Scheduler
makes runs on hscache's manager and on vLLM's, and the first different answer raises
``ParityError``. After every step the two managers' whole observable state is compared
too (:func:`.side.observe_manager`: every group's tables, the free queue, every block,
the prefix-cache index, Mamba's bookkeeping).

Mamba ``align`` layouts thus meet the Scheduler's real chunk splitting, copy-on-write
hand-offs and same-step deferrals. Not driven here (the offline model is a plain
decoder): encoder-decoder cross attention, EAGLE draft groups and speculative decoding,
multimodal inputs, KV connectors; the generator covers those.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hscache.vllm import version
from hscache_tools.testing.kv_cache import kv_cache_config
from hscache_tools.testing.offline_scheduler import make_scheduler, stub_runner_output
from hscache_tools.testing.requests import init_none_hash, make_request
from vllm.v1.request import RequestStatus

from .layouts import LayoutInfo, kv_cache_groups
from .side import observe_manager

# Layout families the real Scheduler runs (see the module docs for the others).
FAMILIES = ("fa+mamba-align", "fa+swa", "fa+mamba-align", "fa+cl", "mixed", "swa|mla|rswa")


@dataclasses.dataclass
class RealConfig:
    layout: str
    num_blocks: int
    max_model_len: int
    token_budget: int
    max_num_seqs: int
    enable_caching: bool = True
    async_scheduling: bool = False
    kv_cache_events: bool = True
    prefix_match_unit: int | None = None
    retention_interval: int | None = None
    mamba_shared_checkpoint: bool = False
    steps: int = 120
    max_tokens: int = 24

    def short(self) -> str:
        return (
            f"[{self.layout}]-N{self.num_blocks}-L{self.max_model_len}-T{self.token_budget}"
            f"-S{self.max_num_seqs}-c{int(self.enable_caching)}"
            f"{'-async' if self.async_scheduling else ''}"
            f"{f'-pmu{self.prefix_match_unit}' if self.prefix_match_unit else ''}"
            f"{f'-ri{self.retention_interval}' if self.retention_interval is not None else ''}"
            f"{'-msc' if self.mamba_shared_checkpoint else ''}"
        )


class RealSchedulerDivergence(AssertionError):
    """The two managers' states differ after a step of vLLM's Scheduler."""


def real_config_for_seed(seed: int, steps: int = 120) -> RealConfig:
    rng = random.Random(seed * 7 + 11)
    family = FAMILIES[seed % len(FAMILIES)]
    b = rng.choice((4, 8, 16))
    pmu = None
    retention: int | None = None
    shared_checkpoint = False
    if family == "fa+mamba-align":
        m = b * rng.choice((1, 2, 4, 4))
        opts = ":ck=1:al=" + str(b) if rng.random() < 0.3 else ""
        layout = f"fa:{b}+mamba:{m}:mode=align{opts}"
        if b >= 8 and rng.random() < 0.3:
            pmu = b // 2
        shared_checkpoint = rng.random() < 0.3
    elif family == "fa+swa":
        w = rng.choice((b // 2, b, 3 * b, 8 * b, 32 * b))
        layout = "+".join([f"fa:{b}"] + [f"swa:{b}:w={w}"] * rng.choice((1, 3)))
    elif family == "fa+cl":
        layout = f"fa:{b}+cl:{b}:c={b * rng.choice((1, 2, 4))}"
    elif family == "mixed":
        layout = rng.choice((f"fa:{2 * b}+swa:{b}:w={4 * b}", f"fa:{b}+swa:{2 * b}:w={8 * b}"))
    else:
        layout = rng.choice(
            (f"swa:{b}:w={4 * b}", f"mla:{b}+swa:{b}:w={2 * b}:mla", f"rswa:{b}:w={2 * b}")
        )
    info = LayoutInfo(layout)
    sched = math.lcm(*(g.block_size for g in info.groups))
    if info.needs_sparse_caching_groups:
        retention = rng.choice((None, 0, sched, 4 * sched))
    per_group = rng.randint(6, 30)
    return RealConfig(
        layout=layout,
        num_blocks=1 + per_group * info.num_groups,
        max_model_len=max(4 * sched, min(1024, b * per_group * 2)),
        token_budget=rng.choice((sched, 2 * sched + 3, 64, 256)),
        max_num_seqs=rng.randint(2, 8),
        enable_caching=rng.random() < 0.9,
        async_scheduling=rng.random() < 0.3,
        kv_cache_events=rng.random() < 0.7,
        prefix_match_unit=pmu,
        retention_interval=retention,
        mamba_shared_checkpoint=shared_checkpoint,
        steps=steps,
        max_tokens=rng.choice((4, 16, 48)),
    )


@contextmanager
def _parity_mode() -> Iterator[None]:
    saved = os.environ.get("HSCACHE_PARITY")
    os.environ["HSCACHE_PARITY"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["HSCACHE_PARITY"]
        else:
            os.environ["HSCACHE_PARITY"] = saved


def build_scheduler(cfg: RealConfig) -> Any:
    """vLLM's (async) Scheduler over hscache's and vLLM's managers in parity mode."""
    import hscache.vllm

    info = LayoutInfo(cfg.layout)
    config = kv_cache_config(
        kv_cache_groups(cfg.layout), cfg.num_blocks, retention_interval=cfg.retention_interval
    )
    sched_block = math.lcm(*(g.block_size for g in info.groups))
    cache: dict[str, Any] = {}
    if info.mamba is not None:
        cache["mamba_cache_mode"] = info.mamba.mode
        cache[version.require().mamba_prefix_keyword] = cfg.mamba_shared_checkpoint
    if cfg.prefix_match_unit:
        cache["prefix_match_unit"] = cfg.prefix_match_unit
    cls = hscache.vllm.AsyncScheduler if cfg.async_scheduling else hscache.vllm.Scheduler
    with _parity_mode():
        scheduler = make_scheduler(
            cls,
            config,
            block_size=sched_block,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.token_budget, sched_block, cfg.max_num_seqs),
            max_model_len=cfg.max_model_len,
            async_scheduling=cfg.async_scheduling,
            enable_prefix_caching=cfg.enable_caching,
            cache=cache,
            kv_cache_events=cfg.kv_cache_events,
        )
    if type(scheduler.kv_cache_manager).__name__ != "ParityKVCacheManager":
        raise RuntimeError(f"no parity manager for {cfg}: {type(scheduler.kv_cache_manager)}")
    return scheduler


def run_real_scheduler(seed: int, cfg: RealConfig | None = None) -> dict[str, int]:
    """One seeded stream; raises ``ParityError`` / :class:`RealSchedulerDivergence` on the
    first difference. Returns counters (manager calls compared, steps, preemptions...).
    vLLM's and hscache's loggers are quiet (ERROR) during the stream and restored after it,
    so that a later test in the same process (pytest-xdist mixes files) sees its warnings."""
    loggers = [logging.getLogger(name) for name in ("vllm", "hscache")]
    saved = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        return _run_real_scheduler(seed, cfg)
    finally:
        for log, level in zip(loggers, saved, strict=True):
            log.setLevel(level)


def _run_real_scheduler(seed: int, cfg: RealConfig | None) -> dict[str, int]:
    cfg = cfg or real_config_for_seed(seed)
    rng = random.Random(seed)
    init_none_hash("sha256")
    scheduler = build_scheduler(cfg)
    parity = scheduler.kv_cache_manager
    hash_block = parity.hscache.block_pool.hash_block_size
    prefixes = [
        [rng.randrange(1, 1000) for _ in range(rng.randint(1, 6) * hash_block)] for _ in range(3)
    ]
    stats = dict.fromkeys(
        ("steps", "requests", "preempted", "aborted", "resets", "hit_tokens", "cow_copies"), 0
    )
    next_id = 0

    def compare(step: int) -> None:
        live = list(scheduler.requests)
        ours = observe_manager(parity.hscache, live=live, deep=True, requests=scheduler.requests)
        theirs = observe_manager(parity.vllm, live=live, deep=True, requests=scheduler.requests)
        for (label, h), (_, v) in zip(ours, theirs, strict=True):
            if label.startswith("internal invariants"):
                if h is not None:
                    raise RealSchedulerDivergence(
                        f"seed={seed} step={step}: hscache invariants: {h} [{cfg.short()}]"
                    )
                continue
            if h != v:
                raise RealSchedulerDivergence(
                    f"seed={seed} step={step} {label}:\n  vLLM:    {v!r}"[:3000]
                    + f"\n  hscache: {h!r}"[:3000]
                    + f"\n  config: {cfg}"
                )

    for step in range(cfg.steps):
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            prompt = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
            prompt += [rng.randrange(1, 1000) for _ in range(rng.randint(1, 3 * hash_block + 5))]
            prompt = prompt[: cfg.max_model_len // 2]
            req = make_request(
                f"r{next_id}",
                prompt,
                max_tokens=rng.randint(1, cfg.max_tokens),
                hash_block_size=hash_block,
                ignore_eos=True,
                prompt_logprobs=1 if rng.random() < 0.05 else None,
            )
            next_id += 1
            stats["requests"] += 1
            scheduler.add_request(req)
        if scheduler.requests and rng.random() < 0.04:
            victim = rng.choice(list(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            stats["aborted"] += 1
        if rng.random() < 0.02:
            stats["resets"] += int(bool(scheduler.reset_prefix_cache()))
        out = scheduler.schedule()
        stats["preempted"] += len(out.preempted_req_ids or ())
        stats["cow_copies"] += len(getattr(out, "kv_cache_block_copies", None) or ())
        compare(step)
        outputs = scheduler.update_from_output(
            out,
            stub_runner_output(
                out, lambda i, step=step: (step * 31 + i) % 997 + 1, scheduler.requests
            ),
        )
        for engine_outputs in outputs.values():
            sched_stats = engine_outputs.scheduler_stats
            if sched_stats is not None and sched_stats.prefix_cache_stats is not None:
                stats["hit_tokens"] += sched_stats.prefix_cache_stats.hits
        compare(step)
        stats["steps"] += 1
    # drain: abort everything, then the pools must be whole again
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update_from_output(out, stub_runner_output(out, lambda i: 1, scheduler.requests))
    compare(cfg.steps)
    stats["calls"] = parity.num_calls
    return stats
