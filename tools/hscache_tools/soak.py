"""The soak test: millions of scheduler-like operations on one ``hscache.vllm.KVCacheManager``
(``python -m hscache soak``; the slow test ``tests/robustness/test_soak.py`` runs a short one).

One manager (full attention, prefix caching and KV events on) serves an endless stream of
requests as vLLM's Scheduler would: admission with a prefix-cache lookup and
``allocate_slots`` with the hit, chunked prefills, decode steps, finishes, preemption when
the pool is full (free, then re-admission with a fresh lookup), ``take_events`` and
``make_prefix_cache_stats`` every step, and now and then ``reset_prefix_cache`` (sometimes
preempting everything first) and ``evict_blocks``. Prompts share system prefixes, so hits,
evictions of cached blocks and KV events are common. Every manager call counts as one
operation.

Along the way it samples the process's resident set size (``/proc/self/statm``, else
``psutil``) and the number of live Python objects the run created (``gc.get_objects()``
after a ``gc.freeze()`` of everything alive at the start), and calls
``check_invariants()`` every ``check_every`` operations. After a warm-up (the first tenth
of the run) the RSS must stay within ``max_rss_growth_mib`` of its post-warm-up value and
the object count within ``max_object_growth`` objects; a breach (or a broken invariant)
fails the run. ``tracemalloc=True`` adds the Python allocations' growth (slower).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import time
import tracemalloc as _tracemalloc
from collections import deque
from typing import Any

__all__ = ["SoakResult", "plot", "rss_bytes", "run_soak"]


def rss_bytes() -> int:
    """The process's resident set size in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


@dataclasses.dataclass
class SoakResult:
    ops: int
    seconds: float
    checks: int
    requests: int
    preemptions: int
    resets: int
    hit_tokens: int
    events: int
    # (ops done, RSS bytes, live Python objects), sampled along the way
    samples: list[tuple[int, int, int]]
    warmup_index: int
    max_rss_growth_mib: float
    max_object_growth: int
    tracemalloc_growth: int | None = None

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    @property
    def rss_growth(self) -> int:
        """Largest RSS above the post-warm-up sample (bytes)."""
        base = self.samples[self.warmup_index][1]
        return max(s[1] for s in self.samples[self.warmup_index :]) - base

    @property
    def object_growth(self) -> int:
        """Live Python objects at the end minus after warm-up."""
        return self.samples[-1][2] - self.samples[self.warmup_index][2]

    def failures(self) -> list[str]:
        out = []
        if self.rss_growth > self.max_rss_growth_mib * 2**20:
            out.append(
                f"RSS grew {self.rss_growth / 2**20:.1f} MiB after warm-up "
                f"(bound {self.max_rss_growth_mib} MiB)"
            )
        if self.object_growth > self.max_object_growth:
            out.append(
                f"{self.object_growth} more live Python objects after warm-up "
                f"(bound {self.max_object_growth})"
            )
        return out

    def summary(self) -> str:
        mib = 2**20
        start, warm, end = self.samples[0], self.samples[self.warmup_index], self.samples[-1]
        lines = [
            f"soak: {self.ops:,} ops in {self.seconds:.1f} s = {self.ops_per_s:,.0f} ops/s",
            f"  requests {self.requests:,}, preemptions {self.preemptions:,}, "
            f"prefix-cache resets {self.resets:,}, hit tokens {self.hit_tokens:,}, "
            f"KV events {self.events:,}",
            f"  check_invariants() passed {self.checks:,} times",
            f"  RSS: start {start[1] / mib:.1f} MiB, after warm-up ({warm[0]:,} ops) "
            f"{warm[1] / mib:.1f} MiB, end {end[1] / mib:.1f} MiB, "
            f"max growth after warm-up {self.rss_growth / mib:.2f} MiB "
            f"(bound {self.max_rss_growth_mib} MiB)",
            f"  live Python objects: after warm-up {warm[2]:,}, end {end[2]:,} "
            f"(growth {self.object_growth:+,}, bound {self.max_object_growth:,})",
        ]
        if self.tracemalloc_growth is not None:
            lines.append(
                f"  tracemalloc: Python allocations grew {self.tracemalloc_growth / 1024:.1f} KiB "
                "after warm-up"
            )
        return "\n".join(lines)


def run_soak(
    ops: int = 10_000_000,
    *,
    check_every: int = 100_000,
    samples: int = 200,
    seed: int = 0,
    num_blocks: int = 512,
    block_size: int = 16,
    max_model_len: int = 2048,
    max_running: int = 16,
    token_budget: int = 512,
    max_rss_growth_mib: float = 32.0,
    max_object_growth: int = 5_000,
    tracemalloc: bool = False,
    progress: bool = False,
) -> SoakResult:
    """Run ``ops`` scheduler-like manager calls on one manager (see the module doc)."""
    # One piece: the soak loop and its closures share the run's state (the manager, the seeded
    # RNG, the live requests, the counters); split, each helper would take all of it.
    from hscache.vllm import KVCacheManager
    from hscache.vllm.block_hasher import get_request_block_hasher
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.request import RequestStatus

    from hscache_tools.testing.kv_cache import full_attention_config
    from hscache_tools.testing.manager import build_manager
    from hscache_tools.testing.requests import init_none_hash, make_request

    init_none_hash("sha256")
    rng = random.Random(seed)
    mgr: Any = build_manager(
        KVCacheManager,
        full_attention_config(num_blocks, block_size),
        max_model_len=max_model_len,
        enable_kv_cache_events=True,
    )
    hasher = get_request_block_hasher(block_size, get_hash_fn_by_name("sha256"))
    systems = [[rng.randrange(1, 30000) for _ in range(rng.randint(16, 300))] for _ in range(8)]
    sample_every = max(1, ops // samples)
    warmup_ops = ops // 10

    waiting: deque[Any] = deque()
    running: list[Any] = []
    n = checks = reqs = preempts = resets = hits = events = 0
    next_sample = 0
    next_check = check_every
    trace: list[tuple[int, int, int]] = []
    warmup_index = 0
    tm_base: int | None = None
    tm_growth: int | None = None
    if tracemalloc:
        _tracemalloc.start()

    # Everything alive now (vLLM, torch, the manager) moves to the permanent generation:
    # collections stay cheap and the object count sees only what the run creates.
    gc.collect()
    gc.freeze()

    def sample() -> None:
        nonlocal warmup_index, tm_base
        gc.collect()
        trace.append((n, rss_bytes(), len(gc.get_objects())))
        if n <= warmup_ops:
            warmup_index = len(trace) - 1
            if tracemalloc:
                tm_base = _tracemalloc.get_traced_memory()[0]
        if progress:
            print(f"  {n:,} ops, RSS {trace[-1][1] / 2**20:.1f} MiB", flush=True)

    def new_request() -> Any:
        nonlocal reqs
        reqs += 1
        prompt = list(rng.choice(systems)) if rng.random() < 0.8 else []
        prompt += [rng.randrange(1, 30000) for _ in range(rng.randint(1, 200))]
        prompt = prompt[: max_model_len // 2]
        return make_request(
            f"soak-{reqs}",
            prompt,
            max_tokens=rng.randint(1, 64),
            block_hasher=hasher,
            cache_salt="tenant-b" if rng.random() < 0.1 else None,
        )

    def free(req: Any, status: Any) -> None:
        nonlocal n
        req.status = status
        mgr.free(req)
        n += 1

    def preempt(req: Any) -> None:
        nonlocal preempts
        running.remove(req)
        free(req, RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        waiting.appendleft(req)
        preempts += 1

    def advance(req: Any, k: int) -> None:
        req.num_computed_tokens += k
        if req.num_computed_tokens < req.num_tokens:
            return
        req.append_output_token_ids(rng.randrange(1, 30000))
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
            running.remove(req)
            free(req, RequestStatus.FINISHED_STOPPED)

    t0 = time.perf_counter()
    sample()
    while n < ops:
        # arrivals
        while len(waiting) + len(running) < 2 * max_running and rng.random() < 0.7:
            waiting.append(new_request())
        budget = token_budget
        # running requests (decode, or their next prefill chunk)
        for req in list(running):
            if req not in running or budget <= 0:
                continue
            k = min(req.num_tokens - req.num_computed_tokens, budget)
            blocks = mgr.allocate_slots(req, k)
            n += 1
            if blocks is None:
                preempt(req)
                continue
            budget -= k
            advance(req, k)
        # admissions
        while waiting and len(running) < max_running and budget > 0:
            req = waiting[0]
            computed, hit, *rest = mgr.get_computed_blocks(req)
            n += 1
            if rest and rest[0] != req.shared_prefix_boundary:  # vLLM 0.33's third value
                req.shared_prefix_boundary = rest[0]
            k = min(req.num_tokens - hit, budget)
            blocks = mgr.allocate_slots(req, k, hit, computed)
            n += 1
            if blocks is None:
                break
            waiting.popleft()
            hits += hit
            req.num_computed_tokens = hit
            req.status = RequestStatus.RUNNING
            running.append(req)
            budget -= k
            advance(req, k)
        events += len(mgr.take_events())
        mgr.make_prefix_cache_stats()
        n += 2
        r = rng.random()
        if r < 0.002:
            if rng.random() < 0.5:  # reset_prefix_cache(reset_running_requests=True)
                for req in list(reversed(running)):
                    preempt(req)
            if mgr.reset_prefix_cache():
                resets += 1
            n += 1
        elif r < 0.02:
            mgr.evict_blocks({rng.randrange(1, num_blocks) for _ in range(rng.randint(1, 4))})
            n += 1
        elif r < 0.03 and running:
            preempt(rng.choice(running))
        if n >= next_check:
            mgr.check_invariants()
            checks += 1
            next_check += check_every
        if n >= next_sample:
            sample()
            next_sample += sample_every
    for req in list(running):
        running.remove(req)
        free(req, RequestStatus.FINISHED_ABORTED)
    events += len(mgr.take_events())
    mgr.check_invariants()
    checks += 1
    seconds = time.perf_counter() - t0
    sample()
    if tracemalloc:
        if tm_base is not None:
            tm_growth = _tracemalloc.get_traced_memory()[0] - tm_base
        _tracemalloc.stop()
    gc.unfreeze()
    if mgr.block_pool.get_num_free_blocks() != num_blocks - 1:
        raise AssertionError("blocks leaked: the pool is not whole after every request left")
    return SoakResult(
        ops=n,
        seconds=seconds,
        checks=checks,
        requests=reqs,
        preemptions=preempts,
        resets=resets,
        hit_tokens=hits,
        events=events,
        samples=trace,
        warmup_index=warmup_index,
        max_rss_growth_mib=max_rss_growth_mib,
        max_object_growth=max_object_growth,
        tracemalloc_growth=tm_growth,
    )


def plot(result: SoakResult, path: str) -> bool:
    """Save the RSS / object-count curve to ``path``; False (with a message) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install 'hscache[plot]'); no plot")
        return False
    xs = [s[0] for s in result.samples]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, [s[1] / 2**20 for s in result.samples], label="RSS (MiB)")
    ax.axvline(result.samples[result.warmup_index][0], color="grey", ls="--", label="warm-up")
    ax.set_xlabel("operations")
    ax.set_ylabel("RSS (MiB)")
    ax2 = ax.twinx()
    ax2.plot(xs, [s[2] for s in result.samples], color="tab:orange", label="Python objects")
    ax2.set_ylabel("live Python objects")
    ax.set_title(f"hscache soak: {result.ops:,} ops, {result.ops_per_s:,.0f} ops/s")
    fig.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")
    return True
