"""Whole-step benchmark of a loaded server: stock vLLM vs ``hscache.vllm.Scheduler``.

A server that is CPU-bound on its scheduler is a loaded one: ``max_num_seqs`` requests run
most of the time, a queue waits, requests finish and arrive every few steps, admissions
prefill in chunks under the token budget while the others decode. This module drives vLLM's
real ``Scheduler`` (built offline, :mod:`hscache_tools.testing.offline_scheduler`) through such a
seeded trace, stock (vLLM's own manager) and ``hscache.vllm.Scheduler`` (hscache's manager
and its fast path, :mod:`hscache.vllm.step`), side by side in one process on the same
requests and sampled tokens:

- ``running`` requests at most (``max_num_seqs``); before every step the queue is topped
  up to ``max(8, running // 8)`` waiting requests, so every finish is followed by an
  admission as soon as the budget allows;
- prompts share one of eight 128-token system prompts (prefix-cache hits) and add 32 to 896
  tokens of their own; output lengths are geometric with mean ``2 * running`` (a finish
  every other step on average at every size, from the first step on, since the
  distribution is memoryless); the first ``running`` requests carry short prompts so that
  the batch fills in a few steps;
- the token budget (``max_num_batched_tokens``) is ``running + 512`` (plus the drafts'
  room for ``spec``): the decodes always fit, an admission's prefill is chunked when it
  does not, so the budget binds on some steps.

Variants (separate, because each of speculative decoding and LoRA turns the fast path off
for every step today, and one configuration holding both would hide the other's effect):

- ``base``: the above;
- ``spec``: an ngram ``SpeculativeConfig`` with ``num_speculative_tokens=3``; half the
  requests draft (0 to 3 tokens a step, fed back with ``update_draft_token_ids`` after the
  update as vLLM's engine does), a seeded random number of drafts accepted;
- ``lora``: a ``LoRAConfig`` with ``max_loras=4``; a third of the requests use one of four
  adapters (the ``max_loras`` rule is checked at every admission; with as many adapters as
  slots it never refuses one, which would starve the adapter left out).

Block hashing: each side's requests are hashed by the hasher its engine builds, as in a
server: vLLM's ``get_request_block_hasher`` for stock vLLM, and for hscache the one that
``hscache.vllm.Scheduler`` installs in its place (``hscache.vllm.get_request_block_hasher``,
the same hashes computed natively). A request hashes its new full blocks when its tokens
are appended in ``update_from_output()``, so this is part of the timed step.
``hasher="vllm"`` hashes both sides with vLLM's (the measurement before 2026-12-02).

Timed per step: ``schedule()`` + ``update_from_output()`` (a stub ``ModelRunnerOutput``
built in between, the drafts' hand-over after, neither timed), as CPU time of the stepping
thread (``time.thread_time_ns``; on a shared machine a millisecond-long step is often
descheduled, which wall time would count). After every step the sides' decisions and
outputs are compared, as digests (``SchedulerOutput`` decisions, drafts scheduled, and per
``EngineCoreOutput`` the request, its new tokens and its finish reason); the first
difference raises. ``hscache.vllm.Scheduler.fast_path_counts`` over the timed steps gives
the share each phase of the fast path served.

``talker`` (vLLM 0.30 + vllm-omni 0.30's environment): a vllm-omni talker-like stage,
vllm-omni's own ``OmniARScheduler`` on vLLM's manager against ``hscache.omni.OmniARScheduler``
(hscache's manager; the fast path where hscache's omni schedulers have it: their
``fast_path_counts`` are reported when they exist). Short prompts (16 to 64 tokens, no
shared prefix), long decodes (geometric, mean ``4 * running``), the same queue and budget.

``async_scheduling``: vLLM's ``AsyncScheduler`` against ``hscache.vllm.AsyncScheduler``
(``talker``: vllm-omni's ``OmniARAsyncScheduler``, its default for AR stages, against
``hscache.omni.OmniARAsyncScheduler``), driven with a batch queue of two (step N+1
scheduled before step N's update), for every variant but ``spec`` (the CPU ngram drafter
is synchronous only).
"""

from __future__ import annotations

import gc
import hashlib
import math
import random
import statistics
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import hscache_tools.testing  # noqa: F401 (vLLM's CPU / offline environment defaults)

__all__ = ["HASHERS", "OMNI_VARIANTS", "SIDES", "VARIANTS", "bench_loaded", "run_loaded"]

SIDES = ("vllm", "hscache")
HASHERS = ("engine", "vllm")
"""``engine``: each side's engine's block hasher; ``vllm``: vLLM's for both sides."""
VARIANTS = ("base", "spec", "lora")
OMNI_VARIANTS = ("talker",)
"""Variants that need vllm-omni (vLLM 0.30's environment)."""
SPEC_TOKENS = 3
MAX_LORAS = 4
_PREFIX = 128
_TAIL = (32, 896)
_TALKER_PROMPT = (16, 64)
_WARM_TAIL = 16
_VOCAB = 50_000
_MAX_MODEL_LEN = 16_384


def _geometric(rng: random.Random, mean: float) -> int:
    """A geometric draw (>= 1) of the given mean: a constant chance to finish per token
    (inverse transform: the number of trials to the first success)."""
    u = rng.random()
    if u <= 0.0:
        return 1
    return max(1, math.ceil(math.log(u) / math.log(1.0 - 1.0 / mean)))


class _Trace:
    """The seeded request specs: (request id, prompt, max_tokens, drafts, LoRA adapter)."""

    def __init__(self, seed: int, running: int, variant: str) -> None:
        self.rng = random.Random(seed)
        self.running = running
        self.variant = variant
        self.prefixes = [[self.rng.randrange(_VOCAB) for _ in range(_PREFIX)] for _ in range(8)]
        self.specs: list[tuple[str, list[int], int, bool, int]] = []

    def spec(self, i: int) -> tuple[str, list[int], int, bool, int]:
        while len(self.specs) <= i:
            n = len(self.specs)
            rng = self.rng
            if self.variant == "talker":
                prompt = [rng.randrange(_VOCAB) for _ in range(rng.randint(*_TALKER_PROMPT))]
                mean = 4.0 * self.running
            else:
                tail = _WARM_TAIL if n < self.running else rng.randint(*_TAIL)
                prompt = rng.choice(self.prefixes) + [rng.randrange(_VOCAB) for _ in range(tail)]
                mean = 2.0 * self.running
            max_tokens = min(_geometric(rng, mean), _MAX_MODEL_LEN // 2)
            drafts = self.variant == "spec" and rng.random() < 0.5
            lora = 0
            if self.variant == "lora" and rng.random() < 1 / 3:
                lora = rng.randrange(1, MAX_LORAS + 1)
            self.specs.append((f"r{n}", prompt, max_tokens, drafts, lora))
        return self.specs[i]


def _token(rid: str, position: int) -> int:
    return zlib.crc32(f"{rid}:{position}".encode()) % _VOCAB


def _runner_output(out: Any, step: int, requests: Any) -> Any:
    """The stub model: a request still prefilling samples nothing; a decode accepts a
    seeded number of its scheduled drafts (their values) and samples one more token."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    spec = out.scheduled_spec_decode_tokens
    sampled: list[list[int]] = []
    for rid in req_ids:
        r = requests[rid]
        if r.num_computed_tokens < r.num_tokens:
            sampled.append([])
            continue
        drafts = spec.get(rid)
        tokens: list[int] = []
        if drafts:
            accepted = zlib.crc32(f"accept:{step}:{rid}".encode()) % (len(drafts) + 1)
            tokens = [d for d in drafts[:accepted] if d >= 0]
        tokens.append(_token(rid, r.num_tokens + len(tokens)))
        sampled.append(tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _drafts(out: Any, step: int, requests: Any, drafting: set[str]) -> Any:
    """The drafter's proposals after a step: 0 to ``SPEC_TOKENS`` for a drafting request
    (an ngram drafter sometimes finds no match), none for the others."""
    from vllm.v1.outputs import DraftTokenIds

    req_ids = list(out.num_scheduled_tokens)
    drafts: list[list[int]] = []
    for rid in req_ids:
        if rid not in drafting or rid not in requests:
            drafts.append([])
            continue
        n = zlib.crc32(f"draft:{step}:{rid}".encode()) % (SPEC_TOKENS + 1)
        base = requests[rid].num_tokens
        drafts.append([_token(rid, base + j) for j in range(n)])
    return DraftTokenIds(req_ids, drafts)


def _digest(out: Any, eco: dict[int, Any]) -> str:
    from hscache_tools.testing.offline_scheduler import summarize_output

    spec = sorted((k, list(v)) for k, v in out.scheduled_spec_decode_tokens.items())
    outputs = [
        (o.request_id, list(o.new_token_ids), o.finish_reason)
        for e in eco.values()
        for o in e.outputs
    ]
    summary = repr((summarize_output(out), spec, out.total_num_scheduled_tokens, outputs))
    return hashlib.sha256(summary.encode()).hexdigest()


def _build(side: str, running: int, variant: str, async_scheduling: bool, blocks: int) -> Any:
    import hscache.vllm
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    from hscache_tools.testing.offline_scheduler import make_scheduler

    if variant == "talker":
        import hscache.omni
        from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler

        if async_scheduling:
            cls: type = (
                OmniARAsyncScheduler if side == "vllm" else hscache.omni.OmniARAsyncScheduler
            )
        else:
            cls = OmniARScheduler if side == "vllm" else hscache.omni.OmniARScheduler
    elif async_scheduling:
        cls = VllmAsyncScheduler if side == "vllm" else hscache.vllm.AsyncScheduler
    else:
        cls = VllmScheduler if side == "vllm" else hscache.vllm.Scheduler
    extra: dict[str, Any] = {}
    budget = running + 512
    if variant == "spec":
        from vllm.config import SpeculativeConfig

        extra["speculative_config"] = SpeculativeConfig(
            model="ngram", num_speculative_tokens=SPEC_TOKENS
        )
        budget += (running // 2 + 1) * SPEC_TOKENS
    elif variant == "lora":
        from vllm.config import LoRAConfig

        extra["lora_config"] = LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=8)
    return make_scheduler(
        cls,
        blocks,
        max_num_seqs=running,
        max_num_batched_tokens=budget,
        max_model_len=_MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
        **extra,
    )


def run_loaded(
    side: str,
    *,
    running: int,
    steps: int,
    variant: str = "base",
    seed: int = 0,
    async_scheduling: bool = False,
    check: list[str] | None = None,
    workload: dict[str, int] | None = None,
    hasher: str = "engine",
) -> tuple[list[int], dict[str, int]]:
    """Per-step ns of ``schedule() + update_from_output()`` over ``steps`` timed steps,
    after the batch filled (``running`` requests) and 16 more steps; and the
    scheduler's ``fast_path_counts`` over the timed steps (empty for stock vLLM).
    ``check`` gets every step's digest (warm-up included); ``workload`` gets counts of
    the timed steps: ``steps``, ``full`` (it ran ``max_num_seqs`` requests),
    ``queued`` (a request waited when it began), ``admitted``
    (it admitted one), ``chunked`` (it scheduled a partial prefill), ``budget_bound``
    (it used the whole token budget). ``hasher``: :data:`HASHERS`."""
    # One piece: the trace's closures (`top_up`, `one_step`) share the scheduler, the queue and
    # the counters of this run; split, each would take all of them.
    from vllm.lora.request import LoRARequest

    from hscache_tools.testing.requests import init_none_hash, make_request, request_block_hasher

    if variant not in VARIANTS + OMNI_VARIANTS:
        names = ", ".join(VARIANTS + OMNI_VARIANTS)
        raise ValueError(f"unknown variant {variant!r}: one of {names}")
    if async_scheduling and variant == "spec":
        raise ValueError("the spec variant runs synchronously only (the CPU ngram drafter)")
    if hasher not in HASHERS:
        raise ValueError(f"unknown hasher {hasher!r}: one of {', '.join(HASHERS)}")
    init_none_hash("sha256")
    if side == "hscache" and hasher == "engine":
        from hscache.vllm import get_request_block_hasher
        from vllm.utils.hashing import get_hash_fn_by_name

        block_hasher = get_request_block_hasher(16, get_hash_fn_by_name("sha256"))
    else:
        block_hasher = request_block_hasher(16, "sha256")
    queue = max(8, running // 8)
    # Room for every request to grow through the whole run: the pool never binds.
    growth = (steps + 128) * (1 + SPEC_TOKENS if variant == "spec" else 1)
    blocks = (running + queue) * -(-(_PREFIX + _TAIL[1] + growth) // 16) + 8 * _PREFIX
    sched = _build(side, running, variant, async_scheduling, blocks)
    trace = _Trace(seed, running, variant)
    drafting: set[str] = set()
    loras = {k: LoRARequest(f"adapter{k}", k, f"/nonexistent/adapter{k}") for k in range(1, 5)}
    added = 0

    def top_up() -> None:
        nonlocal added
        waiting = sched.get_num_unfinished_requests() - len(sched.running)
        while waiting < queue or added < running:
            rid, prompt, max_tokens, drafts, lora = trace.spec(added)
            sched.add_request(
                make_request(
                    rid,
                    prompt,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    block_hasher=block_hasher,
                    lora_request=loras[lora] if lora else None,
                )
            )
            if drafts:
                drafting.add(rid)
            added += 1
            waiting += 1

    pending: deque[tuple[Any, Any]] = deque()
    depth = 2 if async_scheduling else 1
    step = 0
    budget = sched.max_num_scheduled_tokens
    counts: dict[str, int] | None = getattr(sched, "fast_path_counts", None)
    stats = dict.fromkeys(("steps", "full", "queued", "admitted", "chunked", "budget_bound"), 0)

    def one_step(timed: bool) -> int:
        nonlocal step
        top_up()
        queued = sched.get_num_unfinished_requests() > len(sched.running)
        t0 = time.thread_time_ns()
        out = sched.schedule()
        t1 = time.thread_time_ns()
        full = len(sched.running) >= running
        requests = sched.requests
        pending.append((out, _runner_output(out, step, requests)))
        # Read before the update appends the sampled tokens.
        chunked = any(
            r.num_computed_tokens < r.num_tokens
            for rid in out.num_scheduled_tokens
            if (r := requests.get(rid)) is not None
        )
        eco: dict[int, Any] = {}
        t2 = time.thread_time_ns()
        if len(pending) >= depth:
            done, runner = pending.popleft()
            eco = sched.update_from_output(done, runner)
        t3 = time.thread_time_ns()
        if variant == "spec":
            sched.update_draft_token_ids(_drafts(out, step, requests, drafting))
        if timed:
            stats["steps"] += 1
            stats["full"] += full
            stats["queued"] += queued
            stats["admitted"] += bool(out.scheduled_new_reqs)
            stats["budget_bound"] += out.total_num_scheduled_tokens >= budget
            stats["chunked"] += chunked
        if check is not None:
            check.append(_digest(out, eco))
        step += 1
        return (t1 - t0) + (t3 - t2)

    while len(sched.running) < running or any(r.is_prefill_chunk for r in sched.running):
        one_step(False)
        if step > 50 * running + 1000:
            raise RuntimeError(f"the batch never filled ({len(sched.running)} of {running})")
    for _ in range(16):
        one_step(False)
    start = dict(counts) if counts is not None else {}
    gc.collect()
    gc.freeze()
    try:
        times = [one_step(True) for _ in range(steps)]
    finally:
        gc.unfreeze()
    served = {k: v - start[k] for k, v in counts.items()} if counts is not None else {}
    if workload is not None:
        for k, v in stats.items():
            workload[k] = workload.get(k, 0) + v
    return times, served


def bench_loaded(
    *,
    running: int,
    steps: int = 200,
    repeat: int = 3,
    variant: str = "base",
    seed: int = 0,
    async_scheduling: bool = False,
    progress: Callable[[str], None] | None = None,
    hasher: str = "engine",
) -> dict[str, float]:
    """Median whole-step µs of each side (:data:`SIDES`, over the timed steps of every
    repeat), ``ratio`` (stock / hscache), the shares the fast path served
    (``schedule_share``: of the ``schedule()`` calls; ``update_share``: of the requests
    updated; NaN where hscache's scheduler has no ``fast_path_counts``), the workload's
    shares of timed steps (``full``, ``queued``, ``admitted``, ``chunked``,
    ``budget_bound``) and ``checked_steps`` (steps whose decisions and
    outputs were compared: a wrong block hash would change a prefix hit, which they
    compare); ``hasher``: :data:`HASHERS`. Raises ``RuntimeError`` at the first step
    where they differ."""
    per_side: dict[str, list[int]] = {s: [] for s in SIDES}
    served: dict[str, int] = {}
    workload: dict[str, int] = {}
    checked = 0
    for r in range(repeat):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        seen: dict[str, list[str]] = {}
        for side in order:
            if progress is not None:
                progress(f"{variant} {running} run {r + 1}/{repeat}: {side}")
            seen[side] = []
            times, counts = run_loaded(
                side,
                running=running,
                steps=steps,
                variant=variant,
                seed=seed + r,
                async_scheduling=async_scheduling,
                check=seen[side],
                workload=workload if side == "vllm" else None,
                hasher=hasher,
            )
            per_side[side] += times
            for k, v in counts.items():
                served[k] = served.get(k, 0) + v
        want, got = seen["vllm"], seen["hscache"]
        if got != want:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            raise RuntimeError(f"{variant} {running}: hscache diverged from vLLM at step {first}")
        checked += len(want)
    med = {s: statistics.median(v) / 1e3 for s, v in per_side.items()}
    n = max(1, workload.get("steps", 0))
    # NaN where hscache's scheduler has no counters (no fast path: the omni schedulers').
    sched_share = update_share = math.nan
    if served:
        sched_share = served["schedule_served"] / max(1, served["schedule_steps"])
        update_share = served["update_served"] / max(1, served["update_requests"])
    return {
        "vllm_us": med["vllm"],
        "hscache_us": med["hscache"],
        "ratio": med["vllm"] / med["hscache"],
        "schedule_share": sched_share,
        "update_share": update_share,
        **{
            k: workload.get(k, 0) / n
            for k in ("full", "queued", "admitted", "chunked", "budget_bound")
        },
        "checked_steps": float(checked),
    }
