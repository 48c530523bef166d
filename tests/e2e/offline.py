"""One arm of the end-to-end check: vLLM's offline ``LLM`` on CPU, real forward passes.

    python tests/e2e/offline.py --arm stock|scheduler-cls|plugin|parity --model DIR --out FILE

Run by ``tests/e2e/run.py`` once per arm, each in a fresh process (``HSCACHE=1`` for the
plugin arm, ``HSCACHE_PARITY=1`` for the parity arm are set by the caller). The engine
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the arm can look at the
scheduler vLLM built and prove which KV-cache manager and block hasher served.

Two engines, one after the other, KV events on in both (published by vLLM's ZMQ
publisher on a loopback endpoint this process binds, read back by a subscriber thread):

- ``prefix``: a roomy pool; two rounds of prompts sharing three system prefixes, exact
  repeats, and continuations of round-1 conversations (hits reaching into blocks of
  generated tokens);
- ``pressure``: a pool of a few blocks (``num_gpu_blocks_override``), so that the
  scheduler preempts; two rounds.

Per scenario it records every request's output tokens and ``num_cached_tokens``, the
deltas of vLLM's prefix-cache and preemption counters, the KV events received, and the
wall time of the generate calls. Prompts are token ids (deterministic, seeded), so the
tokenizer only detokenizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

ARMS = ("stock", "scheduler-cls", "plugin", "parity")
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
MAX_MODEL_LEN = 512
PRESSURE_BLOCKS = 24
FIRST_TOKEN = 3  # ids 0..2 are the tokenizer's special tokens
SCENARIOS = ("prefix", "pressure")


# ---------------------------------------------------------------------------- prompts


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def prefix_round(rnd: int, vocab: int, previous: list[dict[str, Any]]) -> list[list[int]]:
    """Round ``rnd`` (1 or 2) of the prefix scenario: three system prefixes (not block
    aligned) with fresh user suffixes, plus in round 1 an exact duplicate, and in round 2
    two exact repeats of round-1 prompts and two continuations of round-1 conversations."""
    systems = [_tokens(random.Random(100 + k), n, vocab) for k, n in enumerate((101, 150, 70))]
    rng = random.Random(1000 + rnd)
    prompts = [s + _tokens(rng, rng.randint(10, 40), vocab) for s in systems for _ in range(3)]
    if rnd == 1:
        prompts.append(list(prompts[0]))
        prompts.append(_tokens(rng, 60, vocab))  # shares nothing
        return prompts
    firsts = [r["prompt"] for r in previous]
    prompts += [list(firsts[1]), list(firsts[5])]
    for r in (previous[2], previous[7]):
        prompts.append(r["prompt"] + r["output"] + _tokens(rng, 20, vocab))
    return prompts


def pressure_round(rnd: int, vocab: int) -> list[list[int]]:
    """16 prompts of 60-140 tokens over two shared prefixes: far more than the pool."""
    systems = [_tokens(random.Random(200 + k), 70, vocab) for k in range(2)]
    rng = random.Random(2000 + rnd)
    return [systems[i % 2] + _tokens(rng, rng.randint(12, 90), vocab) for i in range(16)]


# ----------------------------------------------------------------------------- events


class EventSubscriber:
    """Binds a SUB socket on a loopback port (vLLM's publisher connects to a
    ``tcp://127.0.0.1:PORT`` endpoint) and collects every ``KVEventBatch`` in a thread."""

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.batches: list[tuple[int, bytes]] = []
        self.last_arrival = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            _topic, seq, payload = self._sock.recv_multipart()
            with self._lock:
                self.batches.append((int.from_bytes(seq, "big", signed=True), payload))
                self.last_arrival = time.monotonic()

    def drain(self, quiet: float = 1.0, timeout: float = 30.0) -> list[tuple[int, bytes]]:
        """The batches received since the last drain, once none arrived for ``quiet`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if time.monotonic() - self.last_arrival >= quiet:
                    out, self.batches = self.batches, []
                    return out
            time.sleep(0.05)
        raise TimeoutError("KV events kept arriving for 30 s after the generate call")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def decode_events(batches: list[tuple[int, bytes]]) -> list[list[Any]]:
    """Each event as a comparable list: its type name and msgpack fields (no timestamps)."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    out: list[list[Any]] = []
    for _seq, payload in sorted(batches):
        batch = decoder.decode(payload)
        for ev in batch.events:
            fields = json.loads(msgspec.json.encode(ev))
            out.append([type(ev).__name__, fields])
    return out


def check_sequence(batches: list[tuple[int, bytes]], first: int) -> int:
    """Batches must be numbered ``first, first + 1, ...`` (no gap, nothing dropped)."""
    seqs = sorted(s for s, _ in batches)
    if seqs != list(range(first, first + len(seqs))):
        raise RuntimeError(f"KV event batches lost: sequence numbers {seqs[:20]}...")
    return first + len(seqs)


# ----------------------------------------------------------------------------- engine


def counters(llm: Any) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in wanted}


def served_by(llm: Any) -> dict[str, Any]:
    """What the engine (in this process) really used."""
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager
    info: dict[str, Any] = {
        "scheduler": f"{type(core.scheduler).__module__}.{type(core.scheduler).__qualname__}",
        "manager": f"{type(manager).__module__}.{type(manager).__qualname__}",
        "block_hasher": getattr(core.request_block_hasher, "hscache_algo", "vllm"),
    }
    if hasattr(manager, "num_calls"):  # hscache's parity manager
        info["parity_checks"] = manager.num_calls
    return info


def llm_kwargs(model: str, endpoint: str) -> dict[str, Any]:
    """``LLM(...)``'s keywords every arm shares: prefix caching, the CPU backend's block
    size, a fixed seed, stats on and KV events published to ``endpoint``."""
    from vllm.config import KVEventsConfig

    return dict(
        model=model,
        enable_prefix_caching=True,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_num_seqs=8,
        disable_log_stats=False,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
        ),
    )


def run_engine(
    arm: str, model: str, scenario: str, vocab: int, sub: EventSubscriber
) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = llm_kwargs(model, sub.endpoint)
    if scenario == "pressure":
        kwargs["num_gpu_blocks_override"] = PRESSURE_BLOCKS
    if arm in ("scheduler-cls", "parity"):
        kwargs["scheduler_cls"] = "hscache.vllm.Scheduler"
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    # Warm-up (first-call costs out of the timings): prompts shorter than a block, so
    # nothing is cached, no event is published, and both arms see the same pool after.
    warm = [TokensPrompt(prompt_token_ids=[FIRST_TOKEN + i] * (4 + 5 * i)) for i in range(4)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    if sub.drain(quiet=0.5):
        raise RuntimeError("the warm-up published KV events")
    params = SamplingParams(temperature=0.0, max_tokens=24 if scenario == "prefix" else 32)
    rounds: list[dict[str, Any]] = []
    previous: list[dict[str, Any]] = []
    seq = 0
    for rnd in (1, 2):
        if scenario == "prefix":
            prompts = prefix_round(rnd, vocab, previous)
        else:
            prompts = pressure_round(rnd, vocab)
        before = counters(llm)
        t1 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        wall = time.perf_counter() - t1
        after = counters(llm)
        batches = sub.drain()
        seq = check_sequence(batches, seq)
        requests = [
            {
                "prompt": list(o.prompt_token_ids),
                "output": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens,
            }
            for o in outs
        ]
        previous = requests
        rounds.append(
            {
                "requests": requests,
                "counters": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
                "events": decode_events(batches),
                "wall_s": wall,
            }
        )
    info = served_by(llm)
    del llm
    return {"start_s": start_s, "rounds": rounds, "served": info}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()

    import vllm
    from transformers import AutoTokenizer

    hscache_stats = args.arm != "stock"
    if hscache_stats:
        import hscache

        hscache.enable_stats()
        hscache.reset_stats()
    vocab = len(AutoTokenizer.from_pretrained(args.model))
    result: dict[str, Any] = {
        "arm": args.arm,
        "vllm": vllm.__version__,
        "env": {k: os.environ.get(k) for k in ("HSCACHE", "HSCACHE_PARITY")},
        "scenarios": {},
    }
    sub = EventSubscriber()
    try:
        for scenario in SCENARIOS:
            result["scenarios"][scenario] = run_engine(args.arm, args.model, scenario, vocab, sub)
    finally:
        sub.close()
    if hscache_stats:
        import hscache

        result["hscache_stats"] = {op: s["calls"] for op, s in hscache.stats().items()}
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
