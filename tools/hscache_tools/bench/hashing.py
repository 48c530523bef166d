"""Block-hashing throughput, vLLM's Python hasher against hscache's, side by side.

``python -m hscache_tools.bench.hashing`` (or ``add_arguments`` + ``run`` wired into
``python -m hscache bench-hash``). Why: vLLM hashes every full prompt block of every
request in ``Request.__init__`` and every completed block during decode, on the
engine-core thread; this measures what hscache's native hasher saves there.

Method: the same seeded requests (random token ids below a 152k vocabulary) are hashed
by ``vllm.v1.core.kv_cache_utils.get_request_block_hasher`` and by
``hscache.vllm.get_request_block_hasher`` in one process, alternating, one request
call per prompt (all its blocks); the result of every call is checked equal. Reported:
tokens/s as the median over ``--repeat`` passes, and the ratio. ``blake3`` has no vLLM
counterpart: its baseline is vLLM's default ``sha256``. ``--decode`` adds the per-call
cost of the hasher during decode (one token appended per call, a block completed every
``block_size`` calls).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "blake3")


def _requests(seed: int, num_requests: int, prompt_len: int) -> list[Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1 << 20)
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[rng.randrange(152064) for _ in range(prompt_len)],
            sampling_params=params,
            pooling_params=None,
        )
        for i in range(num_requests)
    ]


#: The clock of every measurement: wall time by default; ``--clock thread`` (CPU time of
#: this thread) keeps other processes on a shared machine out of the numbers.
_clock: Callable[[], float] = time.perf_counter


def _time_prefill(
    hasher: Callable[[Any], list[Any]], requests: list[Any]
) -> tuple[float, list[Any]]:
    out: list[Any] = []
    t0 = _clock()
    for r in requests:
        out.append(hasher(r))
    return _clock() - t0, out


def _time_decode(hasher: Callable[[Any], list[Any]], requests: list[Any], steps: int) -> float:
    """Seconds for `steps` appends per request, each followed by the hasher call."""
    total = 0.0
    for r in requests:
        r.block_hashes.clear()
        r.block_hashes.extend(hasher(r))
        toks = r._all_token_ids
        base = len(toks)
        t0 = _clock()
        for i in range(steps):
            toks.append(i)
            r.block_hashes.extend(hasher(r))
        total += _clock() - t0
        del toks[base:]
        r.block_hashes.clear()
    return total


def bench_hashing(
    *,
    algos: Sequence[str] = ALGOS,
    block_size: int = 16,
    prompt_len: int = 8192,
    num_requests: int = 32,
    repeat: int = 5,
    decode_steps: int = 0,
    seed: int = 0,
    clock: str = "wall",
) -> dict[str, Any]:
    """Runs the comparison; returns per-algorithm medians (tokens/s) and ratios."""
    global _clock
    _clock = time.thread_time if clock == "thread" else time.perf_counter
    os.environ.setdefault("PYTHONHASHSEED", "0")  # reproducible NONE_HASH for xxhash
    import hscache._core
    import vllm.v1.core.kv_cache_utils as kcu
    from hscache.vllm import block_hasher as bh
    from vllm.utils import hashing

    requests = _requests(seed, num_requests, prompt_len)
    num_tokens = num_requests * (prompt_len // block_size) * block_size
    results: dict[str, Any] = {
        "block_size": block_size,
        "prompt_len": prompt_len,
        "num_requests": num_requests,
        "repeat": repeat,
        "clock": clock,
        "build_profile": hscache._core.build_profile,
        "algos": {},
    }
    for algo in algos:
        ours_fn = bh.blake3 if algo == "blake3" else hashing.get_hash_fn_by_name(algo)
        base_fn = hashing.sha256 if algo == "blake3" else ours_fn
        kcu.init_none_hash(ours_fn)
        ours = bh.get_request_block_hasher(block_size, ours_fn)
        base = kcu.get_request_block_hasher(block_size, base_fn)
        ref = kcu.get_request_block_hasher(block_size, ours_fn)
        t_ours: list[float] = []
        t_base: list[float] = []
        for _ in range(repeat):
            tb, _ = _time_prefill(base, requests)
            to, got = _time_prefill(ours, requests)
            t_base.append(tb)
            t_ours.append(to)
        if got != [ref(r) for r in requests]:
            raise AssertionError(f"{algo}: hscache's hashes differ from vLLM's")
        entry: dict[str, Any] = {
            "baseline": "vllm " + ("sha256" if algo == "blake3" else algo),
            "vllm_tokens_per_s": num_tokens / statistics.median(t_base),
            "hscache_tokens_per_s": num_tokens / statistics.median(t_ours),
        }
        entry["ratio"] = entry["hscache_tokens_per_s"] / entry["vllm_tokens_per_s"]
        if decode_steps:
            db = [_time_decode(base, requests, decode_steps) for _ in range(repeat)]
            do = [_time_decode(ours, requests, decode_steps) for _ in range(repeat)]
            calls = num_requests * decode_steps
            entry["vllm_decode_ns_per_call"] = statistics.median(db) / calls * 1e9
            entry["hscache_decode_ns_per_call"] = statistics.median(do) / calls * 1e9
        results["algos"][algo] = entry
    return results


def format_results(res: dict[str, Any]) -> str:
    lines = [
        f"block hashing: {res['num_requests']} prompts x {res['prompt_len']} tokens, "
        f"block size {res['block_size']}, median of {res['repeat']} passes, {res['clock']} clock "
        f"({res['build_profile']} build)",
        f"{'algo':<12} {'baseline':<19} {'vLLM tok/s':>12} {'hscache tok/s':>14} {'ratio':>8}",
    ]
    for algo, e in res["algos"].items():
        lines.append(
            f"{algo:<12} {e['baseline']:<19} {e['vllm_tokens_per_s']:>12.3e} "
            f"{e['hscache_tokens_per_s']:>14.3e} {e['ratio']:>7.1f}x"
        )
        if "vllm_decode_ns_per_call" in e:
            lines.append(
                f"{'':<12} decode: {e['vllm_decode_ns_per_call']:.0f} ns/call (vLLM) vs "
                f"{e['hscache_decode_ns_per_call']:.0f} ns/call (hscache)"
            )
    if "debug" in str(res["build_profile"]):
        lines.append("WARNING: debug build of hscache._core; numbers are meaningless")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algo", action="append", choices=ALGOS, help="repeatable; default all")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--decode",
        type=int,
        default=0,
        metavar="STEPS",
        help="also time STEPS one-token decode calls per request",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time, or this thread's CPU time (steadier on a shared machine)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    res = bench_hashing(
        algos=args.algo or ALGOS,
        block_size=args.block_size,
        prompt_len=args.prompt_len,
        num_requests=args.requests,
        repeat=args.repeat,
        decode_steps=args.decode,
        seed=args.seed,
        clock=args.clock,
    )
    print(json.dumps(res, indent=2) if args.json else format_results(res))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hscache_tools.bench.hashing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
