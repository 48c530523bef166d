"""Scheduler-level benchmark: vLLM's real ``Scheduler`` stepping, stock vs hscache's manager.

Owns a seeded request stream (shared system prompts, chunked prefill under a token budget,
decode, finishes, admissions) and a loop that calls ``schedule()`` and
``update_from_output()`` with stub model outputs, on schedulers built offline by
:mod:`hscache.testing.offline_scheduler`. Both schedulers get the
same stream; every step's ``SchedulerOutput`` is compared, and the whole
``schedule() + update_from_output()`` time per step is reported for both (medians).
"""

from __future__ import annotations

import functools
import gc
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import hscache.testing  # noqa: F401 (vLLM's CPU / offline environment defaults)

__all__ = ["bench_scheduler", "request_stream", "run_scheduler"]


def request_stream(
    seed: int, steps: int, block_size: int, prompt_len: int, arrivals_per_step: float
) -> Iterator[list[Any]]:
    """Per step, the new requests (vLLM ``Request`` objects) of a seeded stream."""
    from hscache.testing.requests import init_none_hash, make_request, request_block_hasher

    init_none_hash("sha256")
    hasher = request_block_hasher(block_size, "sha256")
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
    check: list[Any] | None = None,
) -> list[int]:
    """Step a scheduler through the stream; returns per-step ns of schedule+update."""
    from hscache.testing.offline_scheduler import (
        make_scheduler,
        stub_runner_output,
        summarize_output,
    )

    sched = make_scheduler(cls, num_blocks)
    stream = list(request_stream(seed, steps, 16, prompt_len, arrivals_per_step))
    times: list[int] = []
    gc.collect()
    gc.freeze()
    try:
        for step, new in enumerate(stream):
            for req in new:
                sched.add_request(req)
            t0 = time.perf_counter_ns()
            out = sched.schedule()
            t1 = time.perf_counter_ns()
            runner_out = stub_runner_output(out, functools.partial(_stub_token, step))
            t2 = time.perf_counter_ns()
            sched.update_from_output(out, runner_out)
            t3 = time.perf_counter_ns()
            times.append((t1 - t0) + (t3 - t2))
            if check is not None:
                check.append(summarize_output(out))
    finally:
        gc.unfreeze()
    return times


def bench_scheduler(
    *,
    seed: int = 0,
    steps: int = 400,
    num_blocks: int = 65536,
    prompt_len: int = 1024,
    arrivals_per_step: float = 2.0,
    repeat: int = 3,
) -> dict[str, Any]:
    """Stock vs hscache scheduler step time on the same stream (medians over repeats)."""
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    import hscache.vllm

    per_side: dict[str, list[int]] = {"vllm": [], "hscache": []}
    for r in range(repeat):
        want: list[Any] = []
        got: list[Any] = []
        order = [("vllm", VllmScheduler, want), ("hscache", hscache.vllm.Scheduler, got)]
        if r % 2:
            order.reverse()
        for name, cls, sink in order:
            per_side[name] += run_scheduler(
                cls,
                seed=seed,
                steps=steps,
                num_blocks=num_blocks,
                prompt_len=prompt_len,
                arrivals_per_step=arrivals_per_step,
                check=sink,
            )
        if got != want:
            first = next(i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w)
            raise RuntimeError(f"schedulers diverged at step {first}")
    med = {k: statistics.median(v) for k, v in per_side.items()}
    return {
        "steps": steps,
        "repeat": repeat,
        "vllm_median_us": med["vllm"] / 1e3,
        "hscache_median_us": med["hscache"] / 1e3,
        "reduction": 1.0 - med["hscache"] / med["vllm"],
        "speedup": med["vllm"] / med["hscache"],
    }
