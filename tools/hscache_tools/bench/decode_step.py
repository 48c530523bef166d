"""Whole-step benchmark of the steady decode step: stock vLLM vs hscache, fast path off / on.

vLLM's real ``Scheduler`` (built offline, :mod:`hscache_tools.testing.offline_scheduler`) with
``running`` requests decoding, stub model outputs, side by side in one process on the same
requests and tokens: stock vLLM (its own manager), ``hscache.vllm.Scheduler`` with the fast
path off (hscache's manager only, ``HSCACHE_FAST_STEP=0``) and on
(:mod:`hscache.vllm.step`). Reported per configuration: the median
``schedule() + update_from_output()`` time per step over the timed steps of every repeat,
as CPU time of the stepping thread (``time.thread_time_ns``): on a shared machine a
millisecond-long step is often descheduled, which wall time would count (and count more
for the longer side). Every step's decisions and sampled outputs are compared across the
three sides (as digests: keeping every step's objects alive would grow the timed garbage
collections with the run).

Workloads: ``steady`` (every running request decodes; nothing arrives) and ``mixed`` (a
quarter of the requests ask for logprobs, which vLLM's code serves in
``update_from_output``, and a request arrives every eighth step, which vLLM's code
schedules): only part of the batch, and only some steps, are steady.

``async_scheduling``: vLLM's ``AsyncScheduler`` against ``hscache.vllm.AsyncScheduler``,
driven as vLLM's engine drives it (a batch queue of two: step N+1 is scheduled before
step N's ``update_from_output``); a timed step is one ``schedule()`` and the
``update_from_output()`` of the step before it.
"""

from __future__ import annotations

import gc
import hashlib
import statistics
import time
from collections import deque
from typing import Any

import hscache_tools.testing  # noqa: F401 (vLLM's CPU / offline environment defaults)

__all__ = ["SIDES", "bench_decode", "fast_path_off_reason", "run_decode"]

SIDES = ("vllm", "hscache", "hscache+fast")
_PROMPT = 64


def _requests(n: int, first: int, seed: int, hash_block_size: int, mixed: bool) -> list[Any]:
    from hscache_tools.testing.requests import make_request, request_block_hasher

    hasher = request_block_hasher(hash_block_size, "sha256")
    prefix = [(seed * 7919 + j) % 50000 for j in range(_PROMPT // 2)]
    out = []
    for i in range(first, first + n):
        extra: dict[str, Any] = {"logprobs": 1} if mixed and i % 4 == 0 else {}
        prompt = prefix + [(i * 131 + j) % 50000 for j in range(_PROMPT // 2)]
        out.append(
            make_request(
                f"r{i}", prompt, max_tokens=100_000, ignore_eos=True, block_hasher=hasher, **extra
            )
        )
    return out


def _runner_output(out: Any, step: int, requests: Any, mixed: bool) -> Any:
    import numpy as np
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for i, rid in enumerate(req_ids):
        r = requests[rid]
        sampled.append([] if r.num_computed_tokens < r.num_tokens else [(step + i) % 50000])
    logprobs = None
    if mixed and req_ids:
        n = len(req_ids)
        logprobs = LogprobsLists(
            np.zeros((n, 2), dtype=np.int64),
            np.zeros((n, 2), dtype=np.float32),
            np.zeros(n, dtype=np.int64),
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=logprobs,
    )


def run_decode(
    side: str,
    *,
    running: int,
    steps: int,
    layout: str = "full",
    kv_events: bool = False,
    mixed: bool = False,
    seed: int = 0,
    check: list[Any] | None = None,
    async_scheduling: bool = False,
    served: list[bool] | None = None,
) -> list[int]:
    """Per-step ns of ``schedule() + update_from_output()`` for ``steps`` steps after
    ``running`` requests have been admitted and prefilled (and one untimed step).
    ``served`` gets whether the fast path served that untimed step's ``schedule()``."""
    # One piece: the timed step closure shares the scheduler, the pending updates and the
    # digests of this run; split, it would take all of them.
    import hscache.vllm
    from hscache.vllm import step as fast_path
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    from hscache_tools.bench.layouts import layout_config
    from hscache_tools.testing.offline_scheduler import make_scheduler, summarize_output
    from hscache_tools.testing.requests import init_none_hash

    init_none_hash("sha256")
    groups = len(layout.split("+"))
    per_request = (_PROMPT + steps + 64) // 16 + 2
    lc = layout_config(layout, max(4096, running * per_request) * groups)
    if async_scheduling:
        cls: type = VllmAsyncScheduler if side == "vllm" else hscache.vllm.AsyncScheduler
    else:
        cls = VllmScheduler if side == "vllm" else hscache.vllm.Scheduler
    sched = make_scheduler(
        cls,
        lc.kv_cache_config,
        block_size=lc.scheduler_block_size,
        cache=lc.cache,
        enable_prefix_caching=lc.enable_prefix_caching,
        max_num_seqs=running + 8,
        max_num_batched_tokens=max(8192, 2 * running),
        max_model_len=4096,
        kv_cache_events=kv_events,
        async_scheduling=async_scheduling,
    )
    if side == "hscache":
        sched.fast_step = False
    for r in _requests(running, 0, seed, lc.hash_block_size, mixed):
        sched.add_request(r)
    step = 0
    while sched.waiting or any(r.is_prefill_chunk for r in sched.running):
        out = sched.schedule()
        sched.update_from_output(out, _runner_output(out, step, sched.requests, mixed))
        step += 1
    arrivals = iter(_requests(steps, running, seed, lc.hash_block_size, mixed))
    # Steps scheduled whose update_from_output is due (async: the engine's batch queue).
    pending: deque[tuple[Any, Any]] = deque()
    depth = 2 if async_scheduling else 1

    def one_step(k: int) -> int:
        """Steps once (an arrival first on every eighth step of ``mixed``); the ns spent
        in ``schedule()`` and ``update_from_output()``."""
        nonlocal step
        if mixed and k % 8 == 0:
            sched.add_request(next(arrivals))
        t0 = time.thread_time_ns()
        out = sched.schedule()
        t1 = time.thread_time_ns()
        pending.append((out, _runner_output(out, step, sched.requests, mixed)))
        eco: dict[int, Any] = {}
        t2 = time.thread_time_ns()
        if len(pending) >= depth:
            eco = sched.update_from_output(*pending.popleft())
        t3 = time.thread_time_ns()
        step += 1
        if check is not None:
            # A digest, not the objects: keeping every step's outputs alive would make
            # the garbage collector's passes (timed) grow with the run.
            tokens = [(o.request_id, o.new_token_ids) for e in eco.values() for o in e.outputs]
            summary = repr((summarize_output(out), tokens)).encode()
            check.append(hashlib.sha256(summary).hexdigest())
        return (t1 - t0) + (t3 - t2)

    # One untimed step on every side (the same stream): on the fast side it tells
    # whether the fast path serves this layout's steady step.
    probe = fast_path.schedule
    served_steps: list[Any] = []

    def probed(*a: Any, **kw: Any) -> Any:
        out = probe(*a, **kw)
        served_steps.append(out)
        return out

    fast_path.schedule = probed
    try:
        one_step(-1)
    finally:
        fast_path.schedule = probe
    if served is not None:
        served.append(any(o is not None for o in served_steps))
    times: list[int] = []
    gc.collect()
    gc.freeze()
    try:
        times = [one_step(k) for k in range(steps)]
        while pending:
            sched.update_from_output(*pending.popleft())
    finally:
        gc.unfreeze()
    return times


def bench_decode(
    *,
    running: int,
    steps: int = 60,
    repeat: int = 3,
    layout: str = "full",
    kv_events: bool = False,
    mixed: bool = False,
    seed: int = 0,
    async_scheduling: bool = False,
) -> dict[str, float]:
    """Median whole-step µs of each side (:data:`SIDES`), the ratios to stock vLLM and
    ``fast_served`` (1.0 when the fast path served the steady ``schedule()``, else 0.0:
    the ``+fast`` side then has only its ``update_from_output()`` split,
    :func:`fast_path_off_reason`);
    raises ``RuntimeError`` if the sides' decisions or outputs differ at any step."""
    per_side: dict[str, list[int]] = {s: [] for s in SIDES}
    served: list[bool] = []
    for r in range(repeat):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        seen: dict[str, list[Any]] = {}
        for side in order:
            seen[side] = []
            per_side[side] += run_decode(
                side,
                running=running,
                steps=steps,
                layout=layout,
                kv_events=kv_events,
                mixed=mixed,
                seed=seed,
                check=seen[side],
                async_scheduling=async_scheduling,
                served=served if side == "hscache+fast" else None,
            )
        for side in SIDES[1:]:
            if seen[side] != seen["vllm"]:
                first = next(
                    i
                    for i, (a, b) in enumerate(zip(seen[side], seen["vllm"], strict=True))
                    if a != b
                )
                raise RuntimeError(f"{side} diverged from vLLM at step {first}")
    med = {s: statistics.median(v) / 1e3 for s, v in per_side.items()}
    return {
        **{f"{s}_us": med[s] for s in SIDES},
        "manager_ratio": med["vllm"] / med["hscache"],
        "fast_ratio": med["vllm"] / med["hscache+fast"],
        "fast_served": float(all(served)),
    }


def fast_path_off_reason(layout: str) -> str:
    """Why the fast path declines ``layout``'s steady ``schedule()`` (``bench_decode``'s
    ``fast_served`` is 0): the one step condition a layout can break."""
    from hscache_tools.bench.layouts import layout_config

    if layout_config(layout, 64).cache.get("mamba_cache_mode") == "align":
        return (
            "Mamba 'align' mode: vLLM splits chunks block-aligned (need_mamba_block_aligned_split)"
        )
    return "a step condition of hscache.vllm.step.schedule failed"
