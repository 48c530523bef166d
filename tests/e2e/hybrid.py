"""The hybrid arm of the end-to-end check: a tiny random Gemma-3-style model (one sliding-
window and one full-attention layer) in vLLM's real engine on CPU, stock vs hscache.

    python tests/e2e/hybrid.py --arm stock|scheduler-cls --model DIR --out FILE
    python tests/e2e/hybrid.py --make DIR     # only write the model

Run by ``tests/e2e/run.py`` once per arm, each in a fresh process. The model
(``Gemma3ForCausalLM``: hidden 128, 2 layers, head size 32, ``layer_types`` sliding +
full, a 64-token window; random weights, the tokenizer of ``model.py``; nothing
downloaded) makes vLLM build a hybrid KV-cache config: a ``SlidingWindowSpec`` group and a
``FullAttentionSpec`` group, whose sliding-window tables hold the null block once a request
passes the window. The arm records what the engine built (the groups, the manager class),
two rounds of prompts sharing long prefixes (round 2 repeats and continues round 1), every
request's output tokens and ``num_cached_tokens``, vLLM's prefix-cache counters, the KV
events, and the null block's ``ref_cnt`` (vLLM 0.32 counts references on it). The
hscache arm runs with ``HSCACHE_STRICT=1``, so a fallback to vLLM's manager fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import model  # noqa: E402
import offline  # noqa: E402  (sets the CPU engine's environment defaults)

ARMS = ("stock", "scheduler-cls")
SLIDING_WINDOW = 64
BLOCK_SIZE = offline.BLOCK_SIZE
MAX_MODEL_LEN = offline.MAX_MODEL_LEN


def make(out: Path) -> Path:
    """Writes the tiny hybrid checkpoint into ``out`` (once) and returns it."""
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    model.make_tokenizer(out)
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(str(out))),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,  # the CPU attention backend's minimum
        query_pre_attn_scalar=32,
        max_position_embeddings=1024,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )
    net = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    net.save_pretrained(str(out), safe_serialization=True)
    (out / ".complete").write_text("ok\n")
    return out


def prompts_for(rnd: int, vocab: int, previous: list[dict[str, Any]]) -> list[list[int]]:
    """Round 1: two system prefixes past the window (150 and 230 tokens, not block
    aligned) with fresh suffixes, and one prompt sharing nothing; round 2: two repeats and
    two continuations of round-1 conversations."""
    systems = [offline._tokens(random.Random(300 + k), n, vocab) for k, n in enumerate((150, 230))]
    rng = random.Random(3000 + rnd)
    prompts = [
        s + offline._tokens(rng, rng.randint(10, 40), vocab) for s in systems for _ in (0, 1)
    ]
    if rnd == 1:
        prompts.append(offline._tokens(rng, 90, vocab))
        return prompts
    prompts += [list(previous[1]["prompt"]), list(previous[2]["prompt"])]
    for r in (previous[0], previous[3]):
        prompts.append(r["prompt"] + r["output"] + offline._tokens(rng, 20, vocab))
    return prompts


def run(arm: str, model_dir: str) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    sub = offline.EventSubscriber()
    try:
        kwargs = offline.llm_kwargs(model_dir, sub.endpoint)
        if arm == "scheduler-cls":
            kwargs["scheduler_cls"] = "hscache.vllm.Scheduler"
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        start_s = time.perf_counter() - t0
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        groups = [type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups]
        params = SamplingParams(temperature=0.0, max_tokens=16)
        rounds: list[dict[str, Any]] = []
        previous: list[dict[str, Any]] = []
        seq = 0
        for rnd in (1, 2):
            prompts = prompts_for(rnd, vocab, previous)
            before = offline.counters(llm)
            t1 = time.perf_counter()
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
            )
            wall = time.perf_counter() - t1
            after = offline.counters(llm)
            batches = sub.drain()
            seq = offline.check_sequence(batches, seq)
            previous = [
                {
                    "prompt": list(o.prompt_token_ids),
                    "output": list(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens,
                }
                for o in outs
            ]
            rounds.append(
                {
                    "requests": previous,
                    "counters": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
                    "events": offline.decode_events(batches),
                    "wall_s": wall,
                    "null_block_ref_cnt": scheduler.kv_cache_manager.block_pool.null_block.ref_cnt,
                }
            )
        served = offline.served_by(llm)
        del llm
    finally:
        sub.close()
    return {"start_s": start_s, "groups": groups, "rounds": rounds, "served": served}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make", type=Path, help="only write the model into this directory")
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--model")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.make is not None:
        print(make(args.make))
        return 0
    if args.arm is None or args.model is None or args.out is None:
        ap.error("--arm, --model and --out are required")
    import vllm

    hscache_arm = args.arm != "stock"
    if hscache_arm:
        os.environ["HSCACHE_STRICT"] = "1"  # a fallback to vLLM's manager fails the arm
        import hscache

        hscache.enable_stats()
        hscache.reset_stats()
    result: dict[str, Any] = {
        "arm": args.arm,
        "vllm": vllm.__version__,
        **run(args.arm, args.model),
    }
    if hscache_arm:
        import hscache

        result["hscache_stats"] = {op: s["calls"] for op, s in hscache.stats().items()}
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
