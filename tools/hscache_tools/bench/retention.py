"""``python -m hscache bench --retention``: the retention policies side by side.

Replays one seeded multi-tenant trace through ``hscache.vllm.KVCacheManager`` under
each policy (``lru``, ``priority``, ``pin``, ``ttl``, ``slru``) and prints the
prefix-cache hit rate and the median per-step time of the manager calls. The trace:
tenants share system prompts with Zipf popularity (each request adds a unique user
suffix), one rarely used tenant's prompt is pinned (``hscache_pin``, priority 90),
and periodic bursts of long one-off batch requests (priority 10, no TTL protection)
sweep the cache. Every request carries all hints; each policy reads its own keys
(``docs/retention.md``). ``--events`` also times ``lru`` with KV events on vs off.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("lru", "priority", "pin", "ttl", "slru")


@dataclass
class TraceConfig:
    """The trace's shape (defaults: a run of a few seconds per policy)."""

    steps: int = 400
    num_blocks: int = 640
    block_size: int = 16
    tenants: int = 8
    prompt_blocks: int = 24
    zipf_s: float = 1.1
    pinned_tenant: int = 6
    arrivals_per_step: int = 2
    burst_every: int = 40
    burst_requests: int = 10
    burst_blocks: int = 40
    life_steps: int = 3
    step_seconds: float = 0.05
    seed: int = 0


@dataclass
class Arrival:
    """One request of the trace."""

    step: int
    prompt: list[int]
    hints: dict[str, Any]
    shared: bool


@dataclass
class PolicyResult:
    """One policy's outcome."""

    policy: str
    hit_rate: float
    shared_hit_rate: float
    pinned_hit_rate: float
    step_us: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def median_step_us(self) -> float:
        return statistics.median(self.step_us) if self.step_us else 0.0


def make_trace(cfg: TraceConfig) -> list[Arrival]:
    """The seeded arrivals of every step."""
    rng = random.Random(cfg.seed)
    bs = cfg.block_size
    prompts = [
        [t * 1_000_000 + i for i in range(cfg.prompt_blocks * bs)] for t in range(cfg.tenants)
    ]
    weights = [1.0 / (rank + 1) ** cfg.zipf_s for rank in range(cfg.tenants)]
    weights[cfg.pinned_tenant] = min(weights) / 2
    out: list[Arrival] = []
    fresh = 10**8
    for step in range(cfg.steps):
        for _ in range(cfg.arrivals_per_step):
            t = rng.choices(range(cfg.tenants), weights)[0]
            suffix = [fresh + i for i in range(rng.randrange(1, 3 * bs))]
            fresh += len(suffix)
            pinned = t == cfg.pinned_tenant
            hints: dict[str, Any] = {"hscache_priority": 90 if pinned else 60}
            if pinned:
                hints["hscache_pin"] = True
            out.append(Arrival(step, prompts[t] + suffix, hints, True))
        if step % cfg.burst_every == cfg.burst_every // 2:
            for _ in range(cfg.burst_requests):
                n = cfg.burst_blocks * bs + rng.randrange(bs)
                prompt = [fresh + i for i in range(n)]
                fresh += n
                hints = {"hscache_priority": 10, "hscache_retention_s": 0}
                out.append(Arrival(step, prompt, hints, False))
    return out


def _manager(cfg: TraceConfig, policy: str, events: bool) -> Any:
    from hscache.vllm import KVCacheManager

    from hscache_tools.testing.kv_cache import full_attention_config
    from hscache_tools.testing.manager import manager_kwargs

    kwargs = manager_kwargs(
        full_attention_config(cfg.num_blocks, block_size=cfg.block_size),
        enable_kv_cache_events=events,
        log_stats=False,
    )
    settings: dict[str, Any] = {"policy": policy, "manual_clock": True}
    if policy == "pin":
        settings["max_pinned_blocks"] = cfg.prompt_blocks
    if policy == "ttl":
        settings["ttl_s"] = 4.0
    if policy == "slru":
        settings["slru_protected_blocks"] = cfg.num_blocks // 2
    return KVCacheManager(**kwargs, retention=settings if policy != "lru" else "lru")


def run_policy(
    cfg: TraceConfig, trace: Sequence[Arrival], policy: str, events: bool = False
) -> PolicyResult:
    """Replays `trace` under `policy`; times only the manager calls."""
    from hscache_tools.testing.requests import init_none_hash, make_request

    init_none_hash("sha256")
    m = _manager(cfg, policy, events)
    requests = [
        (
            a,
            make_request(
                f"q{i}", a.prompt, hash_block_size=cfg.block_size, extra_args=dict(a.hints)
            ),
        )
        for i, a in enumerate(trace)
    ]
    by_step: dict[int, list[tuple[Arrival, Any]]] = {}
    for a, r in requests:
        by_step.setdefault(a.step, []).append((a, r))
    waiting: deque[tuple[Arrival, Any]] = deque()
    running: deque[tuple[int, Any]] = deque()
    tokens = hits = shared_tokens = shared_hits = pin_tokens = pin_hits = 0
    step_us: list[float] = []
    for step in range(cfg.steps + 4 * cfg.life_steps):
        waiting.extend(by_step.get(step, ()))
        t0 = time.perf_counter()
        while running and running[0][0] <= step:
            m.free(running.popleft()[1])
        admitted: list[tuple[Arrival, Any, int]] = []
        while waiting:
            a, req = waiting[0]
            blocks, hit, _ = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
                break
            waiting.popleft()
            running.append((step + cfg.life_steps, req))
            admitted.append((a, req, int(hit)))
        if events:
            m.take_events()
        step_us.append((time.perf_counter() - t0) * 1e6)
        if policy != "lru":
            m.retention_advance_clock(cfg.step_seconds)
        for a, req, hit in admitted:
            tokens += req.num_tokens
            hits += hit
            if a.shared:
                shared_tokens += req.num_tokens
                shared_hits += hit
            if "hscache_pin" in a.hints:
                pin_tokens += req.num_tokens
                pin_hits += hit
    return PolicyResult(
        policy,
        hits / max(tokens, 1),
        shared_hits / max(shared_tokens, 1),
        pin_hits / max(pin_tokens, 1),
        step_us,
        dict(m.retention_stats()),
    )


def compare(
    cfg: TraceConfig, policies: Sequence[str] = POLICIES, repeat: int = 3
) -> list[PolicyResult]:
    """Every policy on the same trace, `repeat` interleaved runs after a warm-up
    run; a policy's step times are those of its run with the lowest median."""
    trace = make_trace(cfg)
    run_policy(cfg, trace, policies[0])  # warm-up: imports, caches, allocator
    best: dict[str, PolicyResult] = {}
    for _ in range(max(repeat, 1)):
        for p in policies:
            r = run_policy(cfg, trace, p)
            if p not in best or r.median_step_us < best[p].median_step_us:
                best[p] = r
    return [best[p] for p in policies]


def report(results: Sequence[PolicyResult]) -> str:
    """The side-by-side table (ratios against the first row, lru)."""
    base = results[0]
    lines = [
        f"{'policy':<9} {'hit rate':>9} {'shared':>8} {'pinned':>8} "
        f"{'step (median)':>14} {'vs lru':>7}"
    ]
    for r in results:
        ratio = r.median_step_us / base.median_step_us if base.median_step_us else 0.0
        lines.append(
            f"{r.policy:<9} {r.hit_rate:9.1%} {r.shared_hit_rate:8.1%} {r.pinned_hit_rate:8.1%} "
            f"{r.median_step_us:11.1f} us {ratio:6.2f}x"
        )
    return "\n".join(lines)


def plot(results: Sequence[PolicyResult], path: str) -> bool:
    """A bar chart of hit rates and step times (False without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r.policy for r in results]
    a.bar(names, [100 * r.hit_rate for r in results])
    a.set_ylabel("prefix-cache hit rate (%)")
    b.bar(names, [r.median_step_us for r in results])
    b.set_ylabel("median step time (us)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hscache bench --retention", description=__doc__
    )
    d = TraceConfig()
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--num-blocks", type=int, default=d.num_blocks)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per policy")
    parser.add_argument("--plot", metavar="PNG", help="also draw a chart (needs matplotlib)")
    parser.add_argument(
        "--events", action="store_true", help="also time lru with KV events on vs off"
    )
    args = parser.parse_args(argv)
    cfg = TraceConfig(steps=args.steps, num_blocks=args.num_blocks, seed=args.seed)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if policies[0] != "lru":
        policies.insert(0, "lru")
    results = compare(cfg, policies, args.repeat)
    print(
        f"multi-tenant trace: {cfg.steps} steps, {cfg.num_blocks} blocks of {cfg.block_size}, "
        f"{cfg.tenants} tenants (prompt {cfg.prompt_blocks} blocks, Zipf {cfg.zipf_s}), "
        f"tenant {cfg.pinned_tenant} pinned, bursts of {cfg.burst_requests} x "
        f"{cfg.burst_blocks} blocks every {cfg.burst_every} steps"
    )
    print(report(results))
    if args.events:
        trace = make_trace(cfg)
        offs, ons = [], []
        for _ in range(max(args.repeat, 1)):
            offs.append(run_policy(cfg, trace, "lru", events=False).median_step_us)
            ons.append(run_policy(cfg, trace, "lru", events=True).median_step_us)
        off, on = min(offs), min(ons)
        print(f"lru, KV events off {off:.1f} us vs on {on:.1f} us per step ({on / off:.2f}x)")
    if args.plot:
        print(f"plot: {args.plot}" if plot(results, args.plot) else "plot: matplotlib missing")
    return 0
