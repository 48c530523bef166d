"""Smoke test of an installed hscache wheel (run by scripts/wheel_smoke.sh).

Checks that ``hscache`` is imported from the wheel's install location (not the source
tree), that the compiled core is a release build, that the vLLM plugin entry point is
registered, that the wheel holds the product only (no ``hscache_tools``, no benchmark or
fixture modules under ``hscache``) and ``python -m hscache`` says so for a tool command,
and that vLLM's real ``Scheduler`` runs a few steps on hscache's manager. Everything it
builds it builds from vLLM and the wheel alone (a config-only model directory, one
full-attention group): hscache's tools are not installed here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Modules that are hscache's tools (tools/hscache_tools in the repository), not the product.
NOT_SHIPPED = ("hscache_tools", "hscache.bench", "hscache.testing", "hscache.soak")
# A config-only stand-in for a small decoder: vLLM's Scheduler reads lengths, no weights.
MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "word_embed_proj_dim": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 4096,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
}


def _scheduler(cls: type, num_blocks: int, block_size: int = 16) -> Any:
    """``cls`` (a vLLM ``Scheduler``) over one full-attention group, built offline."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = Path(tempfile.mkdtemp(prefix="hscache-wheel-smoke-"))
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=ModelConfig(
            model=str(model), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=4096
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=True,
        ),
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)  # type: ignore[no-untyped-call]
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def _requests(steps: int, block_size: int) -> list[list[Any]]:
    """Per step, one or two new requests sharing system prompts (prefix-cache hits)."""
    import hscache.vllm
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = hscache.vllm.get_request_block_hasher(block_size, hash_fn)
    rng = random.Random(0)
    prefixes = [[rng.randrange(50000) for _ in range(128)] for _ in range(4)]
    out: list[list[Any]] = []
    n = 0
    for _ in range(steps):
        batch = []
        for _ in range(rng.randint(1, 2)):
            prompt = rng.choice(prefixes) + [rng.randrange(50000) for _ in range(64)]
            batch.append(
                Request(
                    request_id=f"r{n}",
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(
                        max_tokens=rng.randrange(8, 64), ignore_eos=True
                    ),
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
            n += 1
        out.append(batch)
    return out


def _runner_output(out: Any, step: int) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[(step * 31 + i) % 50000] for i in range(len(req_ids))],
    )


def main() -> int:
    expected_root = Path(sys.argv[1]).resolve()
    import hscache
    import hscache._core

    core_path = Path(hscache._core.__file__).resolve()
    if expected_root not in core_path.parents:
        print(f"FAIL: hscache._core imported from {core_path}, not from {expected_root}")
        return 1
    if hscache.build_profile != "release":
        print(f"FAIL: the wheel holds a {hscache.build_profile} build")
        return 1
    plugins = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "hscache" not in plugins:
        print("FAIL: the vllm.general_plugins entry point is missing")
        return 1
    for name in NOT_SHIPPED:
        if importlib.util.find_spec(name) is not None:
            print(f"FAIL: {name} is importable beside the wheel (a tool, not the product)")
            return 1
    bench = subprocess.run(
        [sys.executable, "-m", "hscache", "bench", "--quick"],
        capture_output=True,
        text=True,
        check=False,
    )
    if bench.returncode != 2 or "scripts/env.sh" not in bench.stderr:
        print(
            f"FAIL: `python -m hscache bench` without tools: {bench.returncode}, {bench.stderr!r}"
        )
        return 1
    info = subprocess.run(
        [sys.executable, "-m", "hscache", "info"], capture_output=True, text=True, check=False
    )
    if info.returncode != 0 or "build profile: release" not in info.stdout:
        print(
            f"FAIL: `python -m hscache info`: {info.returncode}, {info.stdout!r}, {info.stderr!r}"
        )
        return 1

    import hscache.vllm

    sched = _scheduler(hscache.vllm.Scheduler, 512)
    assert isinstance(sched.kv_cache_manager, hscache.vllm.KVCacheManager)
    scheduled = 0
    for step, new in enumerate(_requests(20, 16)):
        for req in new:
            sched.add_request(req)
        out = sched.schedule()
        scheduled += out.total_num_scheduled_tokens
        sched.update_from_output(out, _runner_output(out, step))
    if scheduled == 0:
        print("FAIL: the scheduler scheduled nothing in 20 steps")
        return 1
    print(f"wheel smoke: ok (hscache {hscache.__version__} from {core_path.parent})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
