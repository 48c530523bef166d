"""Scheduler-level benchmark: vLLM's real ``Scheduler`` stepping, stock vs hscache's manager.

Owns the offline construction of a vLLM ``Scheduler`` (a generated config-only model
directory, no weights, no tokenizer), a seeded request stream (shared system prompts,
chunked prefill under a token budget, decode, finishes, admissions) and a loop that calls
``schedule()`` and ``update_from_output()`` with stub model outputs. Both schedulers get the
same stream; every step's ``SchedulerOutput`` is compared, and the whole
``schedule() + update_from_output()`` time per step is reported for both (medians).
"""

from __future__ import annotations

import functools
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A config-only stand-in for a small decoder (OPT-125m's architecture): the Scheduler
# reads the model config for lengths and modality, never weights.
_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "word_embed_proj_dim": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 16384,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
}


def model_dir() -> Path:
    """A directory holding only the stand-in ``config.json`` (made once per process)."""
    d = Path(tempfile.gettempdir()) / f"hscache-bench-model-{os.getpid()}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return d


def make_scheduler(
    cls: type,
    num_blocks: int,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 16384,
    async_scheduling: bool = False,
    long_prefill_token_threshold: int = 0,
    watermark: float | None = None,
    model_path: Path | None = None,
) -> Any:
    """A vLLM ``Scheduler`` (or subclass ``cls``) with one full-attention KV-cache group,
    built offline the way vLLM's own tests build one."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=str(model_path or model_dir()),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    extra: dict[str, Any] = {} if watermark is None else {"watermark": watermark}
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        **extra,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)  # type: ignore[no-untyped-call]
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def request_stream(
    seed: int, steps: int, block_size: int, prompt_len: int, arrivals_per_step: float
) -> Iterator[list[Any]]:
    """Per step, the new requests (vLLM ``Request`` objects) of a seeded stream."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50000) for _ in range(prompt_len // 2)] for _ in range(8)]
    n = 0
    for _ in range(steps):
        batch = []
        k = int(arrivals_per_step) + (rng.random() < arrivals_per_step % 1)
        for _ in range(k):
            prompt = rng.choice(prefixes) + [
                rng.randrange(50000) for _ in range(rng.randrange(prompt_len // 4, prompt_len // 2))
            ]
            batch.append(
                Request(
                    request_id=f"r{n}",
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(
                        max_tokens=rng.randrange(16, 256), ignore_eos=True
                    ),
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
            n += 1
        yield batch


def summarize(out: Any) -> tuple[Any, ...]:
    """The decisions of one ``SchedulerOutput`` (what both schedulers must agree on)."""
    cached = out.scheduled_cached_reqs
    return (
        sorted((r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs),
        sorted(zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)),
        sorted(out.num_scheduled_tokens.items()),
        sorted(out.finished_req_ids),
        sorted(cached.resumed_req_ids),
        sorted(out.preempted_req_ids or ()),
    )


def _stub_token(step: int, i: int) -> int:
    return (step + i) % 50000


def stub_runner_output(out: Any, token_of: Callable[[int], int]) -> Any:
    """A ``ModelRunnerOutput`` for ``out`` in which the ``i``-th scheduled request samples
    ``token_of(i)`` (the stub model of the scheduler-level benchmark and the tests)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token_of(i)] for i in range(len(req_ids))],
    )


def run_scheduler(
    cls: type,
    *,
    seed: int,
    steps: int,
    num_blocks: int,
    prompt_len: int,
    arrivals_per_step: float,
    check: list[Any] | None = None,
) -> list[int]:
    """Step a scheduler through the stream; returns per-step ns of schedule+update."""
    sched = make_scheduler(cls, num_blocks)
    stream = list(request_stream(seed, steps, 16, prompt_len, arrivals_per_step))
    times: list[int] = []
    gc.collect()
    gc.freeze()
    try:
        for step, new in enumerate(stream):
            for req in new:
                sched.add_request(req)
            t0 = time.perf_counter_ns()
            out = sched.schedule()
            t1 = time.perf_counter_ns()
            runner_out = stub_runner_output(out, functools.partial(_stub_token, step))
            t2 = time.perf_counter_ns()
            sched.update_from_output(out, runner_out)
            t3 = time.perf_counter_ns()
            times.append((t1 - t0) + (t3 - t2))
            if check is not None:
                check.append(summarize(out))
    finally:
        gc.unfreeze()
    return times


def bench_scheduler(
    *,
    seed: int = 0,
    steps: int = 400,
    num_blocks: int = 65536,
    prompt_len: int = 1024,
    arrivals_per_step: float = 2.0,
    repeat: int = 3,
) -> dict[str, Any]:
    """Stock vs hscache scheduler step time on the same stream (medians over repeats)."""
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    import hscache.vllm

    per_side: dict[str, list[int]] = {"vllm": [], "hscache": []}
    for r in range(repeat):
        want: list[Any] = []
        got: list[Any] = []
        order = [("vllm", VllmScheduler, want), ("hscache", hscache.vllm.Scheduler, got)]
        if r % 2:
            order.reverse()
        for name, cls, sink in order:
            per_side[name] += run_scheduler(
                cls,
                seed=seed,
                steps=steps,
                num_blocks=num_blocks,
                prompt_len=prompt_len,
                arrivals_per_step=arrivals_per_step,
                check=sink,
            )
        if got != want:
            first = next(i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w)
            raise RuntimeError(f"schedulers diverged at step {first}")
    med = {k: statistics.median(v) for k, v in per_side.items()}
    return {
        "steps": steps,
        "repeat": repeat,
        "vllm_median_us": med["vllm"] / 1e3,
        "hscache_median_us": med["hscache"] / 1e3,
        "reduction": 1.0 - med["hscache"] / med["vllm"],
        "speedup": med["vllm"] / med["hscache"],
    }
