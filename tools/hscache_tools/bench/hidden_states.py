"""Benchmark of the hidden-state cache against bare ``index_copy_`` / ``index_select``.

``python -m hscache_tools.bench.hidden_states [--device cuda] [--width 2048] ...``

Guards DESIGN.md section 4's performance promise: the cache's per-step write (plan in Rust
from a ``SchedulerOutput``-shaped object, one ``index_copy_`` per key, commit) and gather
(revalidation, read slots, one ``index_select`` per key) cost at most 1.2x the bare torch
index ops on the same tensors with precomputed indices. The prior art's blocking copies made
serving 7x slower; this is the number that would catch a regression of that kind.

Two workloads, each a sequence of steps prebuilt as ``SchedulerOutput``-shaped namespaces
(no vLLM import), replayed step by step; each step is timed for the cache and then for the
bare ops with the very indices the cache used:

- ``prefill-hit``: batches of requests sharing a cached prefix; every step writes the new
  rows of the batch and gathers every request's full rows (prefix + new);
- ``decode``: many running requests, one token each per step, a new block now and then;
  writes only (decode steps have no hits).

Reports medians over the steps, balanced over which side ran first in a step (the second
finds rows and slots in the CPU caches), and bytes per cached token; CUDA timings
synchronize around each measured region only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from hscache._core import build_profile
from hscache.hidden_states import HiddenStateCache, KeySpec

__all__ = ["main", "run"]


def _so(
    new: list[tuple[str, list[int], int, int]],
    running: list[tuple[str, list[int] | None, int, int]],
    finished: set[str],
) -> SimpleNamespace:
    """A ``SchedulerOutput``-shaped namespace (the attributes the cache reads)."""
    sched = {r: n for r, _, _, n in new}
    sched.update({r: n for r, _, _, n in running})
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=nc)
            for r, ids, nc, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _, _ in running],
            resumed_req_ids=set(),
            new_block_ids=[None if ids is None else (ids,) for _, ids, _, _ in running],
            num_computed_tokens=[nc for _, _, nc, _ in running],
        ),
        num_scheduled_tokens=sched,
        finished_req_ids=finished,
        preempted_req_ids=None,
        new_block_ids_to_zero=None,
    )


def prefill_hit_steps(
    *, steps: int, batch: int, prefix: int, new: int, block_size: int
) -> Iterator[Any]:
    """Step 0 computes a shared prefix; every later step admits a batch that hits it."""
    prefix_blocks = list(range(1, 1 + prefix // block_size))
    per_req = -(-new // block_size)
    yield _so([("donor", prefix_blocks, 0, prefix)], [], set())
    prev: set[str] = set()
    for s in range(steps):
        first = 1 + len(prefix_blocks)
        reqs = []
        for j in range(batch):
            own = list(range(first + j * per_req, first + (j + 1) * per_req))
            reqs.append((f"s{s}-r{j}", prefix_blocks + own, prefix, new))
        yield _so(reqs, [], prev | ({"donor"} if s == 0 else set()))
        prev = {r for r, _, _, _ in reqs}


def decode_steps(*, steps: int, batch: int, prompt: int, block_size: int) -> Iterator[Any]:
    """Step 0 prefills ``batch`` requests; every later step decodes one token for each."""
    next_block = 1
    tables: dict[str, int] = {}
    new = []
    for j in range(batch):
        n = -(-prompt // block_size)
        new.append((f"d{j}", list(range(next_block, next_block + n)), 0, prompt))
        next_block += n
        tables[f"d{j}"] = n
    yield _so(new, [], set())
    for s in range(steps):
        pos = prompt + s
        running: list[tuple[str, list[int] | None, int, int]] = []
        for r, n in tables.items():
            ids = None
            if pos >= n * block_size:
                ids = [next_block]
                next_block += 1
                tables[r] = n + 1
            running.append((r, ids, pos, 1))
        yield _so([], running, set())


def num_blocks_needed(workload: str, args: argparse.Namespace) -> int:
    bs: int = args.block_size
    if workload == "prefill-hit":
        return 2 + int(args.prefix) // bs + int(args.batch) * -(-int(args.new) // bs)
    return 2 + int(args.decode_batch) * -(-(int(args.prompt) + int(args.steps)) // bs)


@dataclass
class Timing:
    write: list[float]
    bare_write: list[float]
    gather: list[float]
    bare_gather: list[float]
    #: Per write / gather sample: whether the cache ran before the bare ops in that step.
    cache_first: list[bool]
    gather_cache_first: list[bool]

    def summary(self) -> dict[str, float]:
        """Position-balanced medians: the median of the steps where a side ran first and of
        those where it ran second, averaged. The second side of a step finds the rows and
        slots in the CPU caches, so a plain median over both positions would pick one of
        two modes; averaging the two is symmetric for both sides."""

        def balanced(values: list[float], flags: list[bool], cache_side: bool) -> float:
            first = [v for v, f in zip(values, flags, strict=True) if f == cache_side]
            second = [v for v, f in zip(values, flags, strict=True) if f != cache_side]
            meds = [statistics.median(x) for x in (first, second) if x]
            return sum(meds) / len(meds) if meds else 0.0

        med = {
            "write": balanced(self.write, self.cache_first, True),
            "bare_write": balanced(self.bare_write, self.cache_first, False),
            "gather": balanced(self.gather, self.gather_cache_first, True),
            "bare_gather": balanced(self.bare_gather, self.gather_cache_first, False),
        }
        out = dict(med)
        out["write_ratio"] = med["write"] / med["bare_write"]
        out["total_ratio"] = (med["write"] + med["gather"]) / (
            med["bare_write"] + med["bare_gather"]
        )
        if self.gather:
            out["gather_ratio"] = med["gather"] / med["bare_gather"]
        return out


def _clock(device: torch.device, kind: str) -> Callable[[], float]:
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    # "thread": CPU time of this thread, immune to a loaded machine's preemption (counts
    # only work done by this thread: use it with --threads 1).
    return time.thread_time if kind == "thread" else time.perf_counter


class _Tables:
    """The bench's own block tables, to compute the bare pass's indices untimed (and to
    cross-check the cache's slot mappings)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.tables: dict[str, list[int]] = {}

    def indices(self, so: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for r in so.finished_req_ids:
            self.tables.pop(r, None)
        bs = self.bs
        write: list[int] = []
        read: list[int] = []
        for nr in so.scheduled_new_reqs:
            table = self.tables[nr.req_id] = list(nr.block_ids[0])
            start, end = (
                nr.num_computed_tokens,
                nr.num_computed_tokens + (so.num_scheduled_tokens[nr.req_id]),
            )
            write += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if start:
                read += [table[p // bs] * bs + p % bs for p in range(end)]
        c = so.scheduled_cached_reqs
        for r, ids, start in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True):
            table = self.tables[r]
            if ids is not None:
                table += ids[0]
            end = start + so.num_scheduled_tokens[r]
            write += [table[p // bs] * bs + p % bs for p in range(start, end)]
        return torch.tensor(write, dtype=torch.int64), torch.tensor(read, dtype=torch.int64)


def _bare(
    now: Callable[[], float],
    tensors: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
    w_idx: torch.Tensor,
    r_idx: torch.Tensor,
) -> tuple[float, float, list[torch.Tensor]]:
    """The bare torch ops of a step: (write seconds, gather seconds, gathered rows)."""
    t0 = now()
    for k, tensor in tensors.items():
        tensor.index_copy_(0, w_idx, outputs[k])
    t1 = now()
    gathered = []
    if r_idx.numel():
        gathered = [torch.index_select(tensor, 0, r_idx) for tensor in tensors.values()]
    return t1 - t0, now() - t1, gathered


def run_workload(
    steps: Iterator[Any], cache: HiddenStateCache, warmup: int, clock: str
) -> tuple[Timing, int, int]:
    """Replays ``steps``; returns the timings and the rows written and gathered per step.

    Each step runs the cache and the bare ops on the same rows and slots, alternating which
    goes first (the second finds rows and slots in the CPU caches). Both keep their gathered
    rows until the end of the step, so both allocate their outputs alike."""
    now = _clock(cache.device, clock)
    t = Timing([], [], [], [], [], [])
    tensors = {k: cache.tensor(k) for k in cache.keys}
    tables = _Tables(cache.block_size)
    rows_w = rows_g = 0
    for i, so in enumerate(steps):
        # `so` is built outside the timed region, as the Scheduler builds it; the forward
        # pass's outputs and the bare pass's indices are made here, untimed.
        num_rows = sum(so.num_scheduled_tokens.values())
        outputs = {
            k: torch.randn((num_rows, w), device=cache.device).to(d)
            for k, (w, d) in cache.keys.items()
        }
        w_idx, r_idx = (x.to(cache.device) for x in tables.indices(so))
        if i % 2:
            bare_times = _bare(now, tensors, outputs, w_idx, r_idx)
        t0 = now()
        plan = cache.update_from_scheduler_output(so)
        reads = cache.write(plan, outputs)
        t1 = now()
        rows = cache.gather(plan, reads, outputs)
        t2 = now()
        if not i % 2:
            bare_times = _bare(now, tensors, outputs, w_idx, r_idx)
        if rows.misses:
            raise RuntimeError(f"step {i}: unexpected misses {rows.misses}")
        if not torch.equal(plan.write_slots, w_idx.cpu()) or reads.num_rows != r_idx.numel():
            raise RuntimeError(f"step {i}: the cache's slot mapping differs from the bench's")
        del rows, bare_times[2][:]  # a step's rows are consumed within the step
        if i <= warmup:  # step 0 sets the workload up
            continue
        rows_w, rows_g = num_rows, reads.num_rows
        t.write.append(t1 - t0)
        t.bare_write.append(bare_times[0])
        t.cache_first.append(not i % 2)
        if r_idx.numel():
            t.gather.append(t2 - t1)
            t.bare_gather.append(bare_times[1])
            t.gather_cache_first.append(not i % 2)
    return t, rows_w, rows_g


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    dtype = getattr(torch, args.dtype)
    keys: dict[str, KeySpec] = {
        ("hidden" if i == 0 else f"layer{i}"): (args.width, dtype) for i in range(args.keys)
    }
    results = []
    for workload in args.workloads:
        cache = HiddenStateCache(
            num_blocks_needed(workload, args), args.block_size, keys, args.device
        )
        if workload == "prefill-hit":
            steps = prefill_hit_steps(
                steps=args.steps,
                batch=args.batch,
                prefix=args.prefix,
                new=args.new,
                block_size=args.block_size,
            )
        else:
            steps = decode_steps(
                steps=args.steps,
                batch=args.decode_batch,
                prompt=args.prompt,
                block_size=args.block_size,
            )
        timing, rows_w, rows_g = run_workload(steps, cache, args.warmup, args.clock)
        results.append(
            {
                "workload": workload,
                "rows_written": rows_w,
                "rows_gathered": rows_g,
                "requests": args.batch if workload == "prefill-hit" else args.decode_batch,
                "bytes_per_token": cache.bytes_per_token(),
                "memory_bytes": sum(cache.memory_bytes().values()),
                **timing.summary(),
            }
        )
        del cache
    return results


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f} us"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=2048, help="row width of every key")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--keys", type=int, default=3, help="number of cached keys (Qwen3-Omni's thinker: 3)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=60, help="measured steps per workload")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="prefill-hit: requests per step")
    p.add_argument("--prefix", type=int, default=384, help="prefill-hit: cached tokens")
    p.add_argument("--new", type=int, default=128, help="prefill-hit: new tokens per request")
    p.add_argument("--decode-batch", type=int, default=128, help="decode: running requests")
    p.add_argument("--prompt", type=int, default=32, help="decode: prompt length")
    p.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="CPU only: 'thread' measures this thread's CPU time (immune to a loaded "
        "machine; pair it with --threads 1)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["prefill-hit", "decode"],
        choices=["prefill-hit", "decode"],
    )
    args = p.parse_args(argv)
    args.steps += args.warmup
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefix % args.block_size:
        p.error("--prefix must be a multiple of --block-size (vLLM's hits are block aligned)")
    if "debug" in build_profile:
        print("WARNING: hscache._core is a debug build; numbers are not representative")
    print(
        f"hidden-state cache vs bare torch index ops: device={args.device} "
        f"keys={args.keys}x({args.width}, {args.dtype}) block_size={args.block_size} "
        f"torch threads={torch.get_num_threads()} clock={args.clock} core={build_profile}"
    )
    results = run(args)
    for r in results:
        print(
            f"\n[{r['workload']}] {r['rows_written']} rows written, {r['rows_gathered']} "
            f"gathered per step; {r['bytes_per_token']} bytes per cached token; "
            f"storage {r['memory_bytes'] / 2**20:.0f} MiB (medians of {args.steps - args.warmup})"
        )
        print(f"  write   cache {_us(r['write'])}   bare {_us(r['bare_write'])}   ", end="")
        print(f"{r['write_ratio']:.2f}x")
        if "gather_ratio" in r:
            print(f"  gather  cache {_us(r['gather'])}   bare {_us(r['bare_gather'])}   ", end="")
            print(f"{r['gather_ratio']:.2f}x")
        extra = r["write"] + r["gather"] - r["bare_write"] - r["bare_gather"]
        print(
            f"  step total: {r['total_ratio']:.2f}x of bare (goal <= 1.20x); "
            f"bookkeeping {extra * 1e6:.1f} us per step, "
            f"{extra * 1e6 / r['requests']:.2f} us per scheduled request"
        )
    print("\n| workload | cache us/step | bare torch us/step | ratio (goal <= 1.20x) |")
    print("|---|---|---|---|")
    for r in results:
        cache_us = (r["write"] + r["gather"]) * 1e6
        bare_us = (r["bare_write"] + r["bare_gather"]) * 1e6
        print(f"| {r['workload']} | {cache_us:.0f} | {bare_us:.0f} | {r['total_ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
