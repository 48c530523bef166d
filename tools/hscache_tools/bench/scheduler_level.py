"""Scheduler-level benchmark: vLLM's real ``Scheduler`` stepping, stock vs hscache's manager.

Owns a seeded request stream (shared system prompts, chunked prefill under a token budget,
decode, finishes, admissions) and a loop that calls ``schedule()`` and
``update_from_output()`` with stub model outputs, on schedulers built offline by
:mod:`hscache_tools.testing.offline_scheduler` over one of the layouts of
:mod:`hscache_tools.bench.layouts` (one
full-attention group, or the hybrids most models served in 2026 use: full attention with
sliding window, with Mamba in ``align`` mode, with chunked local attention). Both schedulers
get the same stream; every step's ``SchedulerOutput`` is compared. Reported per step
(medians): the whole ``schedule() + update_from_output()`` time, and the time spent inside
the KV-cache manager's calls (every method the Scheduler calls on it, timed around the
call), which is the bookkeeping hscache replaces. Because vLLM's own Scheduler makes the
calls (its Mamba chunk splitting, copy-on-write hand-offs, skipped-block frees ...), no
emulation of its rules is involved.
"""

from __future__ import annotations

import functools
import gc
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import hscache_tools.testing  # noqa: F401 (vLLM's CPU / offline environment defaults)

__all__ = ["TIMED_METHODS", "ManagerTimer", "bench_scheduler", "request_stream", "run_scheduler"]

# The manager methods vLLM 0.33's Scheduler calls (attributes such as ``usage`` and
# ``block_pool`` are read, not timed).
TIMED_METHODS = (
    "allocate_slots",
    "get_computed_blocks",
    "get_computed_blocks_for_connector",
    "free",
    "cache_blocks",
    "new_step_starts",
    "take_events",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "take_new_block_ids",
    "get_blocks",
    "get_block_ids",
    "get_block_ids_for_computed_tokens",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "remove_skipped_blocks",
    "pop_blocks_for_free",
    "truncate_computed_blocks",
    "estimate_cached_tokens",
    "finalize_partial_tail_offloads",
    "record_blocks_for_zeroing",
)


class ManagerTimer:
    """Accumulates the time spent in a manager's methods, wrapped on the instance (calls
    that a timed method makes to another are counted once). ``record(name, ns)``, when
    given, also receives every outermost call."""

    def __init__(self, manager: Any, record: Any = None, overhead_ns: int = 0) -> None:
        self.ns = 0
        self._depth = 0
        self._record = record
        self._overhead = overhead_ns
        for name in TIMED_METHODS:
            method = getattr(manager, name, None)
            if callable(method):
                setattr(manager, name, self._timed(name, method))

    def _timed(self, name: str, method: Any) -> Any:
        pc = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth = 1
            # The timed call is the Scheduler's own call expression for its common
            # shapes (up to two positional arguments, or a running request's
            # `allocate_slots(request, n, num_lookahead_tokens=k)`): re-spreading
            # `*args, **kwargs` would time a dict-to-keywords conversion that neither
            # manager pays under the real Scheduler (~100 ns a call, most of a decode
            # step's cost in hscache). Other shapes (admissions) are forwarded as is.
            n = len(args)
            try:
                if not kwargs and n == 0:
                    t0 = pc()
                    r = method()
                    t1 = pc()
                elif not kwargs and n == 1:
                    a0 = args[0]
                    t0 = pc()
                    r = method(a0)
                    t1 = pc()
                elif not kwargs and n == 2:
                    a0, a1 = args
                    t0 = pc()
                    r = method(a0, a1)
                    t1 = pc()
                elif n == 2 and len(kwargs) == 1 and "num_lookahead_tokens" in kwargs:
                    a0, a1 = args
                    k = kwargs["num_lookahead_tokens"]
                    t0 = pc()
                    r = method(a0, a1, num_lookahead_tokens=k)
                    t1 = pc()
                else:
                    t0 = pc()
                    r = method(*args, **kwargs)
                    t1 = pc()
            finally:
                self._depth = 0
            dt = max(0, t1 - t0 - self._overhead)
            self.ns += dt
            if self._record is not None:
                self._record(name, args, dt)
            return r

        return timed

    def take(self) -> int:
        ns, self.ns = self.ns, 0
        return ns


def request_stream(
    seed: int, steps: int, hash_block_size: int, prompt_len: int, arrivals_per_step: float
) -> Iterator[list[Any]]:
    """Per step, the new requests (vLLM ``Request`` objects) of a seeded stream."""
    from hscache_tools.testing.requests import init_none_hash, make_request, request_block_hasher

    init_none_hash("sha256")
    hasher = request_block_hasher(hash_block_size, "sha256")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50000) for _ in range(prompt_len // 2)] for _ in range(8)]
    n = 0
    for _ in range(steps):
        batch = []
        k = int(arrivals_per_step) + (rng.random() < arrivals_per_step % 1)
        for _ in range(k):
            prompt = rng.choice(prefixes) + [
                rng.randrange(50000) for _ in range(rng.randrange(prompt_len // 4, prompt_len // 2))
            ]
            batch.append(
                make_request(
                    f"r{n}",
                    prompt,
                    max_tokens=rng.randrange(16, 256),
                    ignore_eos=True,
                    block_hasher=hasher,
                )
            )
            n += 1
        yield batch


def _stub_token(step: int, i: int) -> int:
    return (step + i) % 50000


def run_scheduler(
    cls: type,
    *,
    seed: int,
    steps: int,
    num_blocks: int,
    prompt_len: int,
    arrivals_per_step: float,
    layout: str = "full",
    check: list[Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Step a scheduler through the stream; returns per-step ns of schedule+update and of
    the KV-cache manager's calls within them."""
    from hscache_tools.bench.layouts import layout_config
    from hscache_tools.testing.offline_scheduler import (
        make_scheduler,
        stub_runner_output,
        summarize_output,
    )

    lc = layout_config(layout, num_blocks * len(layout.split("+")))
    sched = make_scheduler(
        cls,
        lc.kv_cache_config,
        block_size=lc.scheduler_block_size,
        cache=lc.cache,
        max_model_len=max(16384, 4 * prompt_len),
    )
    timer = ManagerTimer(sched.kv_cache_manager)
    stream = list(request_stream(seed, steps, lc.hash_block_size, prompt_len, arrivals_per_step))
    times: list[int] = []
    manager_times: list[int] = []
    gc.collect()
    gc.freeze()
    try:
        for step, new in enumerate(stream):
            for req in new:
                sched.add_request(req)
            timer.take()
            t0 = time.perf_counter_ns()
            out = sched.schedule()
            t1 = time.perf_counter_ns()
            in_schedule = timer.take()
            runner_out = stub_runner_output(out, functools.partial(_stub_token, step))
            t2 = time.perf_counter_ns()
            sched.update_from_output(out, runner_out)
            t3 = time.perf_counter_ns()
            times.append((t1 - t0) + (t3 - t2))
            manager_times.append(in_schedule + timer.take())
            if check is not None:
                check.append(summarize_output(out))
    finally:
        gc.unfreeze()
    return times, manager_times


def bench_scheduler(
    *,
    seed: int = 0,
    steps: int = 400,
    num_blocks: int = 65536,
    prompt_len: int = 1024,
    arrivals_per_step: float = 2.0,
    repeat: int = 3,
    layout: str = "full",
) -> dict[str, Any]:
    """Stock vs hscache scheduler on the same stream (medians over repeats): the whole step
    and the KV-cache manager's share of it."""
    import hscache.vllm
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    per_side: dict[str, list[int]] = {"vllm": [], "hscache": []}
    per_side_kv: dict[str, list[int]] = {"vllm": [], "hscache": []}
    for r in range(repeat):
        want: list[Any] = []
        got: list[Any] = []
        order = [("vllm", VllmScheduler, want), ("hscache", hscache.vllm.Scheduler, got)]
        if r % 2:
            order.reverse()
        for name, cls, sink in order:
            step_ns, kv_ns = run_scheduler(
                cls,
                seed=seed,
                steps=steps,
                num_blocks=num_blocks,
                prompt_len=prompt_len,
                arrivals_per_step=arrivals_per_step,
                layout=layout,
                check=sink,
            )
            per_side[name] += step_ns
            per_side_kv[name] += kv_ns
        if got != want:
            first = next(i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w)
            raise RuntimeError(f"schedulers diverged at step {first}")
    med = {k: statistics.median(v) for k, v in per_side.items()}
    kv = {k: statistics.median(v) for k, v in per_side_kv.items()}
    return {
        "layout": layout,
        "steps": steps,
        "repeat": repeat,
        "vllm_median_us": med["vllm"] / 1e3,
        "hscache_median_us": med["hscache"] / 1e3,
        "reduction": 1.0 - med["hscache"] / med["vllm"],
        "speedup": med["vllm"] / med["hscache"],
        "vllm_kv_median_us": kv["vllm"] / 1e3,
        "hscache_kv_median_us": kv["hscache"] / 1e3,
        "kv_speedup": kv["vllm"] / max(kv["hscache"], 1),
    }
