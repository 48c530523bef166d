"""What a differential trace runs on: its configuration, the managers and their keywords.

:class:`TraceConfig` holds everything a trace depends on besides its seed (pool, block size,
model length, caching, events, EAGLE, lookaheads, speculative tokens, budget, async
scheduling, hash algorithm, the request mix and how much is compared); :func:`config_for_seed`
derives a deterministic mix of configurations from a seed. :func:`manager_kwargs` builds the
keywords vLLM's Scheduler would pass for a configuration (through :mod:`hscache.testing`);
:func:`load_candidate` imports the manager under test.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import random
from typing import Any

from hscache.testing.kv_cache import full_attention, kv_cache_config
from hscache.testing.manager import manager_kwargs as scheduler_manager_kwargs
from vllm.v1.core import kv_cache_manager as _vllm_kvm
from vllm.v1.kv_cache_interface import KVCacheConfig

ReferenceKVCacheManager = _vllm_kvm.KVCacheManager
# What the installed vLLM's interface has (0.33 has both, 0.32 neither): the generator
# only makes calls the reference takes, and passes exactly what its Scheduler passes.
HAS_HASH_LOOKAHEAD = (
    "num_hash_lookahead_tokens" in inspect.signature(ReferenceKVCacheManager.__init__).parameters
)
HAS_MAX_HIT_LEN = (
    "max_cache_hit_length"
    in inspect.signature(ReferenceKVCacheManager.get_computed_blocks).parameters
)
DEFAULT_CANDIDATE = "hscache.vllm:KVCacheManager"
CANDIDATE_ENV = "HSCACHE_DIFF_CANDIDATE"


@dataclasses.dataclass
class TraceConfig:
    block_size: int = 4
    num_blocks: int = 32
    max_model_len: int = 96
    enable_caching: bool = True
    enable_events: bool = True
    log_stats: bool = True
    watermark: float = 0.0
    use_eagle: bool = False
    hash_lookahead: int = 0  # num_hash_lookahead_tokens (hasher and manager must agree)
    num_lookahead_tokens: int = 0  # slots reserved per step (EAGLE / draft model)
    num_spec_tokens: int = 0  # draft tokens scheduled per decode step
    num_prefill_lookahead: int = 0  # multi-module MTP: last L-1 computed tokens not cached
    token_budget: int = 64
    max_running: int = 4
    full_sequence_must_fit: bool = False
    async_sched: bool = False  # AsyncScheduler: outputs arrive one step late (placeholders)
    max_in_flight_tokens: int | None = None
    zeroing: bool = False  # KVCacheConfig.needs_kv_cache_zeroing forced on (new-block ids)
    hash_fn: str = "sha256"  # --prefix-caching-hash-algo (xxhash digests are 16 bytes)
    num_ops: int = 500  # manager calls generated (finalization adds a few)
    # request mix
    max_prompt: int = 0  # 0: derived from the pool and max_model_len
    max_out: int = 24
    p_mm: float = 0.15
    p_lora: float = 0.1
    p_salt: float = 0.1
    p_logprobs: float = 0.08
    p_report_full: float = 0.05
    p_session: float = 0.1
    p_embeds: float = 0.03
    p_dup: float = 0.2
    p_conv: float = 0.15
    p_external: float = 0.08
    p_async_load: float = 0.4
    p_deferred_free: float = 0.25
    p_resumable: float = 0.08  # streaming-input sessions
    p_max_hit_len: float = 0.05  # lookups with an explicit max_cache_hit_length
    # comparison
    events_every_call: bool = True
    check_free_queue: bool = True
    deep_every: int = 4  # compare every block's ref count / hash every N calls (0: never)

    def __post_init__(self):
        if not self.max_prompt:
            pool_tokens = self.block_size * (self.num_blocks - 1)
            self.max_prompt = max(2, min(self.max_model_len - 1, int(pool_tokens * 0.7)))
        self.max_prompt = min(self.max_prompt, self.max_model_len - 1)

    def short(self) -> str:
        return (
            f"B{self.block_size}-N{self.num_blocks}-L{self.max_model_len}"
            f"-c{int(self.enable_caching)}-e{int(self.enable_events)}"
            f"-h{self.hash_lookahead}-la{self.num_lookahead_tokens}-sp{self.num_spec_tokens}"
            f"-eg{int(self.use_eagle)}-w{self.watermark}-f{int(self.full_sequence_must_fit)}"
            f"{'-z' if self.zeroing else ''}{'-async' if self.async_sched else ''}"
            f"{'' if self.hash_fn == 'sha256' else '-' + self.hash_fn}"
            f"{f'-mtp{self.num_prefill_lookahead}' if self.num_prefill_lookahead else ''}"
        )


def config_for_seed(seed: int, num_ops: int = 500, **overrides) -> TraceConfig:
    """A deterministic configuration mix: block sizes 1/4/16 in turn, tight and roomy pools,
    caching/events on and off, watermark, EAGLE, hash lookahead, spec/lookahead slots."""
    rng = random.Random(seed * 7919 + 17)
    B = (1, 4, 16)[seed % 3]
    tight = rng.random() < 0.5
    if B == 1:
        N = rng.randint(10, 36) if tight else rng.randint(50, 140)
    elif B == 4:
        N = rng.randint(7, 18) if tight else rng.randint(36, 90)
    else:
        N = rng.randint(5, 12) if tight else rng.randint(20, 56)
    usable = B * (N - 1)
    max_model_len = max(8, int(usable * rng.choice((0.4, 0.8, 1.0, 1.5))))
    max_model_len = min(max_model_len, 1200)
    hash_lookahead = 1 if rng.random() < 0.15 else 0
    use_eagle = (not hash_lookahead) and rng.random() < 0.15
    num_spec = rng.choice((0, 0, 0, 1, 2, 3))
    num_la = num_spec if rng.random() < 0.7 else rng.randint(0, 3)
    cfg = TraceConfig(
        block_size=B,
        num_blocks=N,
        max_model_len=max_model_len,
        enable_caching=rng.random() < 0.85,
        enable_events=rng.random() < 0.8,
        watermark=rng.choice((0.0, 0.0, 0.0, 0.01, 0.05, 0.1)),
        use_eagle=use_eagle,
        hash_lookahead=hash_lookahead,
        num_lookahead_tokens=num_la,
        num_spec_tokens=num_spec,
        token_budget=rng.choice((2 * B + 3, 16, 48, 128, 512)),
        max_running=rng.randint(1, 8),
        full_sequence_must_fit=rng.random() < 0.2,
        max_in_flight_tokens=rng.choice((None, 512, 4096)),
        num_ops=num_ops,
        max_out=rng.choice((4, 16, 48)),
        events_every_call=rng.random() < 0.6,
        p_external=rng.choice((0.0, 0.08, 0.2)),
        p_deferred_free=rng.choice((0.0, 0.25, 0.6)),
        zeroing=rng.random() < 0.1,
        async_sched=rng.random() < 0.3,
        hash_fn=rng.choice(("sha256",) * 7 + ("sha256_cbor", "xxhash", "xxhash_cbor")),
    )
    if B >= 4 and rng.random() < 0.12:
        # multi-module MTP (needs scheduler_block_size >= lookahead with EAGLE + caching)
        cfg = dataclasses.replace(cfg, num_prefill_lookahead=rng.choice((2, 3, 4)))
    variant = rng.random()  # a few corner-case mixes
    if variant < 0.04:  # (almost) no usable blocks
        cfg = dataclasses.replace(cfg, num_blocks=rng.randint(2, 4), max_prompt=0)
    elif variant < 0.08:  # tiny chunks
        cfg = dataclasses.replace(cfg, token_budget=rng.choice((1, 2, B)))
    elif variant < 0.12:  # heavy sharing
        cfg = dataclasses.replace(cfg, p_dup=0.6, p_conv=0.3)
    elif variant < 0.15:  # one request at a time
        cfg = dataclasses.replace(cfg, max_running=1)
    if not HAS_HASH_LOOKAHEAD:
        cfg = dataclasses.replace(cfg, hash_lookahead=0)
    if not HAS_MAX_HIT_LEN:
        cfg = dataclasses.replace(cfg, p_max_hit_len=0.0)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def make_kv_cache_config(cfg: TraceConfig) -> KVCacheConfig:
    """One full-attention group (new blocks zeroed with ``cfg.zeroing``)."""
    return kv_cache_config(
        [full_attention(cfg.block_size)], cfg.num_blocks, needs_zeroing=cfg.zeroing
    )


def manager_kwargs(cfg: TraceConfig) -> dict:
    """Keyword arguments exactly as vLLM's Scheduler passes them."""
    return scheduler_manager_kwargs(
        make_kv_cache_config(cfg),
        max_model_len=cfg.max_model_len,
        max_in_flight_tokens=cfg.max_in_flight_tokens,
        enable_caching=cfg.enable_caching,
        use_eagle=cfg.use_eagle,
        num_hash_lookahead_tokens=cfg.hash_lookahead,
        num_prefill_lookahead=cfg.num_prefill_lookahead,
        log_stats=cfg.log_stats,
        enable_kv_cache_events=cfg.enable_events,
        watermark=cfg.watermark,
    )


def load_candidate(spec: str | None = None) -> type:
    """``module:attr`` (default: ``$HSCACHE_DIFF_CANDIDATE`` or hscache.vllm:KVCacheManager)."""
    spec = spec or os.environ.get(CANDIDATE_ENV) or DEFAULT_CANDIDATE
    mod, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in (attr or "KVCacheManager").split("."):
        obj = getattr(obj, part)
    return obj
