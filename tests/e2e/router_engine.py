"""One engine of the router check: vLLM's offline engine on CPU, driven over a pipe.

    python tests/e2e/router_engine.py --model DIR --pub ENDPOINT --replay ENDPOINT
        [--blocks N] [--hscache] [--lora NAME DIR RANK] --result-fd FD

Started by ``tests/e2e/router.py`` once per engine of an arm (``HSCACHE_STRICT=1`` and,
for the compact arm, ``HSCACHE_KV_EVENTS=compact`` come from the caller). The engine runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and publishes its KV events with
vLLM's own ``ZmqEventPublisher`` (``kv_events_config``: a PUB endpoint and a ROUTER replay
endpoint, both given by the caller), wrapped by hscache's non-blocking publisher when
``--hscache`` selects ``scheduler_cls="hscache.vllm.Scheduler"``.

Commands arrive as JSON lines on stdin; each answer is one JSON line on ``--result-fd``
(stdout and stderr carry vLLM's logs):

- ``{"op": "generate", "prompts": [{"tokens": [...], "cache_salt": ..., "lora": NAME}],
  "max_tokens": N}`` (``lora`` only with ``--lora``)
  -> per request its output tokens and ``num_cached_tokens``, the wall time of the call,
  and the deltas of vLLM's prefix-cache and preemption counters;
- ``{"op": "reset"}`` -> ``llm.reset_prefix_cache()``'s result (its ``AllBlocksCleared``
  is published with the next step's events);
- ``{"op": "info"}`` -> what served (scheduler, manager, KV-cache groups, hscache's call
  counters, the publisher's deferred batches);
- ``{"op": "quit"}``.

The first answer (``{"op": "ready"}``) comes after a warm-up that publishes nothing
(prompts shorter than a block).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import offline  # noqa: E402  (sets the CPU engine's environment defaults)


def build(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVEventsConfig

    kwargs = offline.llm_kwargs(args.model, args.pub)
    kwargs["kv_events_config"] = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=args.pub,
        replay_endpoint=args.replay,
    )
    if args.blocks:
        kwargs["num_gpu_blocks_override"] = args.blocks
    if args.hscache:
        kwargs["scheduler_cls"] = "hscache.vllm.Scheduler"
    if args.lora:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=int(args.lora[2]))
    return LLM(**kwargs)


def generate(llm: Any, cmd: dict[str, Any], lora: list[str] | None) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = []
    loras: list[LoRARequest | None] = []
    for p in cmd["prompts"]:
        tp = TokensPrompt(prompt_token_ids=p["tokens"])
        if p.get("cache_salt"):
            tp["cache_salt"] = p["cache_salt"]
        prompts.append(tp)
        if p.get("lora"):
            if lora is None or p["lora"] != lora[0]:
                raise ValueError(f"this engine does not serve LoRA {p['lora']!r}")
            loras.append(LoRARequest(lora[0], 1, lora[1]))
        else:
            loras.append(None)
    params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"])
    before = offline.counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(
        prompts, params, use_tqdm=False, lora_request=loras if lora is not None else None
    )
    wall = time.perf_counter() - t0
    after = offline.counters(llm)
    return {
        "requests": [
            {"output": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
            for o in outs
        ],
        "wall_s": wall,
        "counters": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
    }


def info(llm: Any, hscache_arm: bool) -> dict[str, Any]:
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    out = offline.served_by(llm)
    out["groups"] = [
        type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups
    ]
    publisher = scheduler.kv_event_publisher
    out["publisher"] = f"{type(publisher).__module__}.{type(publisher).__qualname__}"
    out["deferred_batches"] = getattr(publisher, "deferred_batches", None)
    if hscache_arm:
        import hscache

        out["hscache_calls"] = {op: s["calls"] for op, s in hscache.stats().items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--pub", required=True, help="the KV-event PUB endpoint (bound here)")
    ap.add_argument("--replay", required=True, help="the replay ROUTER endpoint (bound here)")
    ap.add_argument("--blocks", type=int, default=0, help="num_gpu_blocks_override")
    ap.add_argument("--hscache", action="store_true", help="--scheduler-cls hscache's")
    ap.add_argument(
        "--lora", nargs=3, metavar=("NAME", "DIR", "RANK"), help="enable LoRA, serve this one"
    )
    ap.add_argument("--result-fd", type=int, required=True)
    args = ap.parse_args()
    if args.hscache:
        import hscache

        hscache.enable_stats()
        hscache.reset_stats()
    answers = os.fdopen(args.result_fd, "w", buffering=1)

    def answer(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = build(args)
    # Warm-up: prompts shorter than a block cache nothing and publish no event.
    first = offline.FIRST_TOKEN
    warm = [TokensPrompt(prompt_token_ids=[first + i] * (4 + 5 * i)) for i in range(4)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    answer({"op": "ready", "start_s": time.perf_counter() - t0})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            answer(generate(llm, cmd, args.lora))
        elif op == "reset":
            answer({"reset": bool(llm.reset_prefix_cache())})
        elif op == "info":
            answer(info(llm, args.hscache))
        elif op == "quit":
            answer({"bye": True})
            break
        else:
            answer({"error": f"unknown op {op!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
