"""What a differential trace runs on: its configuration, the managers and their keywords.

:class:`TraceConfig` holds everything a trace depends on besides its seed (the KV-cache
layout and pool, model length, caching, events, EAGLE, lookaheads, speculative tokens,
budget, async scheduling, hash algorithm, retention interval, block metrics, the request mix
and how much is compared); :func:`config_for_seed` derives a deterministic mix of
configurations from a seed, every layout family of :data:`FAMILIES` in turn.
:func:`manager_kwargs` builds the keywords vLLM's Scheduler would pass for a configuration
(through :mod:`hscache_tools.testing`); :func:`load_candidate` imports the manager under test.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import os
import random
from typing import Any

from hscache.vllm.version import require
from hscache_tools.testing.kv_cache import block_sizes, kv_cache_config
from hscache_tools.testing.manager import manager_kwargs as scheduler_manager_kwargs
from vllm.v1.core import kv_cache_coordinator as _vllm_kvc
from vllm.v1.core import kv_cache_manager as _vllm_kvm
from vllm.v1.kv_cache_interface import KVCacheConfig

from .layouts import LayoutInfo, kv_cache_groups

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
# 0.32 / 0.33's Scheduler passes prefill_end to the coordinator's reservation count; 0.30's
# coordinator has no such keyword.
HAS_PREFILL_END = (
    "prefill_end"
    in inspect.signature(_vllm_kvc.KVCacheCoordinator.get_num_blocks_to_allocate).parameters
)
# hscache serves Mamba layouts on this vLLM (not 0.30: its older Mamba rules stay vLLM's).
MAMBA_SERVED = require().mamba_rules_implemented
# The manager attribute the Scheduler reads back: mamba_shared_prefix_checkpoint (0.32, 0.33)
# or mamba_fine_grained_prefix_cache (0.30).
MAMBA_PREFIX_ATTR = require().mamba_prefix_keyword.removeprefix("enable_")
HAS_SKIP_ZEROING = (
    "skip_zeroing_group_ids" in inspect.signature(ReferenceKVCacheManager.allocate_slots).parameters
)
DEFAULT_CANDIDATE = "hscache.vllm:KVCacheManager"
CANDIDATE_ENV = "HSCACHE_DIFF_CANDIDATE"


@dataclasses.dataclass
class TraceConfig:
    block_size: int = 4  # of the one full-attention group when ``layout`` is empty
    layout: str = ""  # KV-cache groups (see .layouts); "" = "fa:<block_size>"
    retention_interval: int | None = None  # KVCacheConfig.prefix_cache_retention_interval
    metrics: float = 0.0  # KVCacheMetricsCollector(sample_rate) on both sides (0: off)
    mamba_shared_checkpoint: bool = False  # enable_mamba_shared_prefix_checkpoint
    dcp: int = 1  # decode context parallel world size
    prefix_match_unit: int | None = None  # CacheConfig.prefix_match_unit (hash block size)
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
            groups = self.info.num_groups
            pool_tokens = self.sched_block * (self.num_blocks - 1) // groups
            self.max_prompt = max(2, min(self.max_model_len - 1, int(pool_tokens * 0.7)))
        self.max_prompt = min(self.max_prompt, self.max_model_len - 1)

    @property
    def layout_str(self) -> str:
        return self.layout or f"fa:{self.block_size}"

    @property
    def info(self) -> LayoutInfo:
        return _layout_info(self.layout_str)

    @property
    def sched_block(self) -> int:
        """The Scheduler's block size (the lcm of the group block sizes)."""
        return self._block_sizes()[0]

    @property
    def hash_block(self) -> int:
        """``request.block_hashes``' granularity (vLLM's ``hash_block_size``)."""
        return self._block_sizes()[1]

    def _block_sizes(self) -> tuple[int, int]:
        return _block_sizes(
            self.layout_str,
            self.enable_caching,
            self.p_external > 0,
            self.dcp,
            self.prefix_match_unit,
        )

    def short(self) -> str:
        extra = ""
        if self.layout:
            extra += f"-[{self.layout}]"
        if self.retention_interval is not None:
            extra += f"-ri{self.retention_interval}"
        if self.metrics:
            extra += f"-m{self.metrics}"
        if self.mamba_shared_checkpoint:
            extra += "-msc"
        if self.dcp > 1:
            extra += f"-dcp{self.dcp}"
        if self.prefix_match_unit:
            extra += f"-pmu{self.prefix_match_unit}"
        return (
            f"B{self.block_size}-N{self.num_blocks}-L{self.max_model_len}"
            f"-c{int(self.enable_caching)}-e{int(self.enable_events)}"
            f"-h{self.hash_lookahead}-la{self.num_lookahead_tokens}-sp{self.num_spec_tokens}"
            f"-eg{int(self.use_eagle)}-w{self.watermark}-f{int(self.full_sequence_must_fit)}"
            f"{'-z' if self.zeroing else ''}{'-async' if self.async_sched else ''}"
            f"{'' if self.hash_fn == 'sha256' else '-' + self.hash_fn}"
            f"{f'-mtp{self.num_prefill_lookahead}' if self.num_prefill_lookahead else ''}"
            f"{extra}"
        )


@functools.cache
def _layout_info(layout: str) -> LayoutInfo:
    return LayoutInfo(layout)


@functools.cache
def _block_sizes(
    layout: str, enable_caching: bool, kv_connector: bool, dcp: int, prefix_match_unit: int | None
) -> tuple[int, int]:
    config = kv_cache_config(kv_cache_groups(layout), 2)
    return block_sizes(
        config,
        enable_caching=enable_caching,
        kv_connector=kv_connector,
        dcp_world_size=dcp,
        prefix_match_unit=prefix_match_unit,
    )


# Layout families of config_for_seed, one per seed in turn ("fa": one full-attention group,
# the common case, twice as often as each hybrid family).
FAMILIES = (
    "fa",
    "fa+swa",
    "swa",
    "fa+cl",
    "fa+mamba-align",
    "fa",
    "fa+mamba-nocache",
    "fa+cross",
    "eagle",
    "mixed",
    "mla",
    "rswa|ring",
    "fa",
    "dcp",
)


def config_for_seed(seed: int, num_ops: int = 500, **overrides) -> TraceConfig:
    """A deterministic configuration mix: the layout families of :data:`FAMILIES` in turn;
    for one full-attention group block sizes 1/4/16 in turn; tight and roomy pools,
    caching/events on and off, watermark, EAGLE, hash lookahead, spec/lookahead slots,
    retention intervals and block metrics for the hybrid layouts.

    Where hscache leaves Mamba layouts to vLLM's manager (vLLM 0.30's older Mamba rules,
    the profile's ``mamba_rules_implemented``), a seed that draws one takes the next
    seed's configuration instead: a trace of vLLM against itself proves nothing."""
    cfg = _config_for_seed(seed, num_ops)
    k = 0
    while not MAMBA_SERVED and "mamba" in cfg.layout:
        k += 1
        cfg = _config_for_seed(seed + k, num_ops)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _config_for_seed(seed: int, num_ops: int) -> TraceConfig:
    family = FAMILIES[seed % len(FAMILIES)]
    if family == "fa":
        cfg = _full_attention_config(seed, num_ops)
    else:
        cfg = _layout_config(family, seed, num_ops)
    if not HAS_HASH_LOOKAHEAD:
        cfg = dataclasses.replace(cfg, hash_lookahead=0)
    if not HAS_MAX_HIT_LEN:
        cfg = dataclasses.replace(cfg, p_max_hit_len=0.0)
    return cfg


def _full_attention_config(seed: int, num_ops: int) -> TraceConfig:
    rng = random.Random(seed * 7919 + 17)
    B = (1, 4, 16)[(seed // len(FAMILIES)) % 3]
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
        metrics=rng.choice((0.0,) * 8 + (1.0, 0.5)),
    )
    if B >= 4 and rng.random() < 0.12:
        # multi-module MTP (needs scheduler_block_size >= lookahead with EAGLE + caching)
        cfg = dataclasses.replace(cfg, num_prefill_lookahead=rng.choice((2, 3, 4)))
    return _variant(cfg, rng)


def _variant(cfg: TraceConfig, rng: random.Random) -> TraceConfig:
    """A few corner-case mixes."""
    variant = rng.random()
    if variant < 0.04:  # (almost) no usable blocks
        return dataclasses.replace(
            cfg, num_blocks=rng.randint(2, 2 + 2 * cfg.info.num_groups), max_prompt=0
        )
    if variant < 0.08:  # tiny chunks
        return dataclasses.replace(cfg, token_budget=rng.choice((1, 2, cfg.sched_block)))
    if variant < 0.12:  # heavy sharing
        return dataclasses.replace(cfg, p_dup=0.6, p_conv=0.3)
    if variant < 0.15:  # one request at a time
        return dataclasses.replace(cfg, max_running=1)
    return cfg


def _window(rng: random.Random, b: int) -> int:
    """A sliding window smaller than, about, or far larger than a block."""
    return rng.choice((max(1, b // 2), b, b + 1, 3 * b, 8 * b, 32 * b))


def _layout_config(family: str, seed: int, num_ops: int) -> TraceConfig:
    """A hybrid (or non-full-attention) layout of ``family`` with a matching Scheduler
    configuration: what vLLM's engine would run such a model with."""
    rng = random.Random(seed * 104729 + 3)
    b = rng.choice((2, 4, 4, 8, 16))
    caching = rng.random() < 0.85
    use_eagle = False
    hash_lookahead = 0
    dcp = 1
    prefix_match_unit: int | None = None
    num_spec = rng.choice((0, 0, 0, 1, 2))
    p_external = rng.choice((0.0, 0.08, 0.2))
    if family == "fa+swa":
        windows = [_window(rng, b)] * rng.choice((1, 3))
        if rng.random() < 0.25:
            windows.append(_window(rng, b))  # a second window size: another spec group
        layout = "+".join([f"fa:{b}"] + [f"swa:{b}:w={w}" for w in windows])
    elif family == "swa":
        layout = f"swa:{b}:w={_window(rng, b)}"
    elif family == "fa+cl":
        chunk = b * rng.choice((1, 2, 4, 8))
        layout = "+".join([f"fa:{b}"] + [f"cl:{b}:c={chunk}"] * rng.choice((1, 3)))
        if rng.random() < 0.15:
            layout = f"cl:{b}:c={chunk}"  # chunked local alone
    elif family == "fa+mamba-align":
        a = rng.choice((2, 4, 8))
        m = a * rng.choice((1, 2, 4, 4))
        opts = ["mode=align"]
        if num_spec:
            opts.append(f"s={num_spec}")
        if rng.random() < 0.3:
            opts += ["ck=1", f"al={a}"]
        attn = [f"fa:{a}"] * rng.choice((1, 1, 2))
        layout = "+".join([*attn, f"mamba:{m}:" + ":".join(opts)])
        b = a
        if a >= 4 and rng.random() < 0.25:
            prefix_match_unit = a // 2  # hashes finer than the attention block
        use_eagle = rng.random() < 0.2
        hash_lookahead = 1 if (not use_eagle and rng.random() < 0.1) else 0
    elif family == "fa+mamba-nocache":
        mode = rng.choice(("none", "none", "all"))
        m = b * rng.choice((1, 2, 4))
        spec = f":s={num_spec}" if num_spec else ""
        layout = f"fa:{b}+mamba:{m}:mode={mode}{spec}"
        caching = False
    elif family == "fa+cross":
        layout = f"fa:{b}+cross:{b}"
        caching, num_spec, p_external = False, 0, 0.0
    elif family == "eagle":
        layout = rng.choice(
            (
                f"fa:{b}+fa:{b}:eagle",
                f"fa:{b}+swa:{b}:w={_window(rng, b)}+fa:{b}:eagle",
                f"fa:{b}+swa:{b}:w={_window(rng, b)}",  # every group drops (none flagged)
            )
        )
        use_eagle = True
    elif family == "dcp":
        # vLLM: DCP hybrids take full attention, Mamba (no hit search) and draft groups
        dcp = rng.choice((2, 4))
        layout = rng.choice((f"fa:{b}", f"mla:{b}", f"fa:{b}+mamba:{b}:mode=none"))
        if "mamba" in layout:
            caching = False
    elif family == "mixed":
        w = _window(rng, b)
        if b >= 4 and rng.random() < 0.25:
            prefix_match_unit = b // 2
        layout = rng.choice(
            (
                f"fa:{2 * b}+swa:{b}:w={w}",
                f"fa:{b}+swa:{2 * b}:w={w}",
                f"fa:{b}+cl:{2 * b}:c={4 * b}",
            )
        )
    elif family == "mla":
        layout = rng.choice((f"mla:{b}", f"mla:{b}+swa:{b}:w={_window(rng, b)}:mla"))
    elif family == "rswa|ring":
        layout = rng.choice((f"rswa:{b}:w={_window(rng, b)}", f"fa:{b}+ring:{b}"))
    else:
        raise ValueError(f"unknown layout family {family!r}")
    info = LayoutInfo(layout)
    groups = info.num_groups
    sched = math.lcm(*(g.block_size for g in info.groups)) * dcp
    tight = rng.random() < 0.4
    per_group = rng.randint(6, 16) if tight else rng.randint(20, 60)
    if sched > b:
        per_group = max(per_group, 3 * sched // b)
    num_blocks = 1 + per_group * groups
    usable = b * per_group
    max_model_len = max(2 * sched + 2, int(usable * rng.choice((0.5, 1.0, 1.5))))
    retention: int | None = None
    if caching and info.needs_sparse_caching_groups:
        retention = rng.choice((None, None, 0, sched, 2 * sched, 4 * sched))
    num_la = num_spec if rng.random() < 0.7 else rng.randint(0, 2)
    cfg = TraceConfig(
        block_size=b,
        layout=layout,
        num_blocks=num_blocks,
        max_model_len=min(max_model_len, 1200),
        enable_caching=caching,
        enable_events=rng.random() < 0.8,
        watermark=rng.choice((0.0, 0.0, 0.0, 0.01, 0.05)),
        use_eagle=use_eagle,
        hash_lookahead=hash_lookahead,
        num_lookahead_tokens=num_la,
        num_spec_tokens=num_spec,
        token_budget=rng.choice((sched + 3, 2 * sched + 1, 16, 48, 128, 512)),
        max_running=rng.randint(1, 8),
        full_sequence_must_fit=rng.random() < 0.15,
        max_in_flight_tokens=rng.choice((None, 512, 4096)),
        num_ops=num_ops,
        max_out=rng.choice((4, 16, 48)),
        events_every_call=rng.random() < 0.6,
        p_external=p_external,
        p_deferred_free=rng.choice((0.0, 0.25, 0.6)),
        zeroing=rng.random() < 0.1,
        async_sched=rng.random() < 0.3,
        hash_fn=rng.choice(("sha256",) * 7 + ("sha256_cbor", "xxhash", "xxhash_cbor")),
        retention_interval=retention,
        metrics=rng.choice((0.0, 0.0, 0.0, 1.0, 0.5)),
        mamba_shared_checkpoint=info.mamba_align and rng.random() < 0.3,
        dcp=dcp,
        prefix_match_unit=prefix_match_unit,
    )
    if dcp > 1:
        # under DCP every report_full hit crashes vLLM (exceptions.KNOWN): keep it rare
        cfg = dataclasses.replace(cfg, p_report_full=0.005)
    return _variant(cfg, rng)


def make_kv_cache_config(cfg: TraceConfig) -> KVCacheConfig:
    """The layout's groups in one pool (new blocks zeroed with ``cfg.zeroing``)."""
    return kv_cache_config(
        kv_cache_groups(cfg.layout_str),
        cfg.num_blocks,
        needs_zeroing=cfg.zeroing,
        retention_interval=cfg.retention_interval,
    )


def manager_kwargs(cfg: TraceConfig) -> dict:
    """Keyword arguments exactly as vLLM's Scheduler passes them (the metrics collector is
    each side's own: see ``side.Side``)."""
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
        enable_mamba_shared_prefix_checkpoint=cfg.mamba_shared_checkpoint,
        kv_connector=cfg.p_external > 0,
        dcp_world_size=cfg.dcp,
        prefix_match_unit=cfg.prefix_match_unit,
    )


def load_candidate(spec: str | None = None) -> type:
    """``module:attr`` (default: ``$HSCACHE_DIFF_CANDIDATE`` or hscache.vllm:KVCacheManager)."""
    spec = spec or os.environ.get(CANDIDATE_ENV) or DEFAULT_CANDIDATE
    mod, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in (attr or "KVCacheManager").split("."):
        obj = getattr(obj, part)
    return obj
