"""Trace driver for differential tests of a vLLM ``KVCacheManager`` replacement.

A *trace* is a list of primitive actions (plain JSON-able lists):

* ``["new", spec]``                 create a request (one ``vllm.v1.request.Request`` per side)
* ``["set", rid, attr, value]``     set a request field (``num_computed_tokens``, ``status``, ...)
* ``["append", rid, tokens]``       ``request.append_output_token_ids(tokens)`` (extends hashes)
* ``["call", method, args]``        one manager call (see ``Side._call``)
* ``["session_update", rid, toks, max_tokens]``  Scheduler._update_request_as_session
* ``["rehash", rid]``               ``block_hashes.clear(); update_block_hashes()``

A seeded generator (``_Generator``) emulates what vLLM's ``Scheduler`` / ``AsyncScheduler``
do with the manager (admission with prefix-cache lookup and chunked prefill under a token
budget, decode with spec/lookahead tokens, async-scheduling placeholders, preemption on pool
exhaustion, finish with immediate or deferred free, sync and async KV-connector loads incl.
failed loads and invalid blocks, streaming-input sessions, resets, evictions, stats and
events) and produces actions *online*: its
decisions depend on the reference manager's answers, which are only used after they were found
equal to the candidate's.  Every action is executed on both sides by ``_Pair``; after every
manager call the return values and the observable state (free-block count, usage, free-queue
order, block tables of live requests, KV events, periodically every block's
ref count / hash and the running prefix-cache stats) are compared.  The first difference raises
``Divergence`` naming the seed, the call index, the call, what differed and both values.

Recorded actions can be replayed (``replay``) and shrunk (``shrink``) into a short repro.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import random
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_manager as _vllm_kvm
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

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

_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(PrefixCacheStats))
PLACEHOLDER_TOKEN = 9999
VOCAB = 500


# Optional request features a trace's "new" action may carry (repro text, coverage).
REQUEST_FEATURES = (
    "mm",
    "lora",
    "salt",
    "logprobs",
    "report_full",
    "session",
    "embeds_seed",
    "resumable",
)


class Divergence(AssertionError):
    """The candidate answered or behaved differently from vLLM's manager."""

    def __init__(
        self,
        message: str,
        *,
        seed: Any,
        call_index: int,
        action_index: int,
        call: str,
        check: str,
        ref: Any,
        cand: Any,
        signature: tuple,
    ):
        super().__init__(message)
        self.seed = seed
        self.call_index = call_index
        self.action_index = action_index
        self.call = call
        self.check = check
        self.ref = ref
        self.cand = cand
        self.signature = signature
        self.actions: list | None = None
        self.outcomes: list | None = None
        self.config: TraceConfig | None = None


class HarnessError(RuntimeError):
    """The reference itself failed on an action the generator thought valid (a harness bug,
    or an invalid action sequence during shrinking)."""


# --------------------------------------------------------------------------------------------
# configuration


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


class _ZeroingKVCacheConfig(KVCacheConfig):
    """A one-group config whose new blocks must be zeroed (in vLLM: Mamba or mixed-precision
    caches); forces the new-block-id bookkeeping on for a plain full-attention group."""

    @property
    def needs_kv_cache_zeroing(self) -> bool:  # type: ignore[override]
        return True


def make_kv_cache_config(cfg: TraceConfig) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    cls = _ZeroingKVCacheConfig if cfg.zeroing else KVCacheConfig
    return cls(
        num_blocks=cfg.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def manager_kwargs(cfg: TraceConfig) -> dict:
    """Keyword arguments exactly as vLLM's Scheduler passes them."""
    lookahead = {"num_hash_lookahead_tokens": cfg.hash_lookahead} if HAS_HASH_LOOKAHEAD else {}
    return dict(
        **lookahead,
        kv_cache_config=make_kv_cache_config(cfg),
        max_model_len=cfg.max_model_len,
        max_in_flight_tokens=cfg.max_in_flight_tokens,
        enable_caching=cfg.enable_caching,
        use_eagle=cfg.use_eagle,
        num_prefill_lookahead=cfg.num_prefill_lookahead,
        log_stats=cfg.log_stats,
        enable_kv_cache_events=cfg.enable_events,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=cfg.block_size,
        hash_block_size=cfg.block_size,
        metrics_collector=None,
        watermark=cfg.watermark,
        enable_mamba_shared_prefix_checkpoint=False,
    )


def load_candidate(spec: str | None = None) -> type:
    """``module:attr`` (default: ``$HSCACHE_DIFF_CANDIDATE`` or hscache.vllm:KVCacheManager)."""
    spec = spec or os.environ.get(CANDIDATE_ENV) or DEFAULT_CANDIDATE
    mod, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in (attr or "KVCacheManager").split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------------------------
# requests


def build_request(spec: dict, hasher: Callable | None) -> Request:
    sp_kwargs: dict[str, Any] = {"max_tokens": spec["max_tokens"]}
    if spec.get("logprobs"):
        sp_kwargs["prompt_logprobs"] = 1
    if spec.get("report_full"):
        sp_kwargs["extra_args"] = {"kv_cache_report_mode": "full"}
    mm = [
        MultiModalFeatureSpec(
            data=None,
            modality=modality,
            identifier=ident,
            mm_position=PlaceholderRange(offset=offset, length=length),
            mm_hash=ident,
        )
        for modality, ident, offset, length in spec.get("mm") or ()
    ]
    lora = None
    if spec.get("lora"):
        name, int_id, path = spec["lora"]
        lora = LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)
    prompt: list[int] | None = list(spec["prompt"])
    embeds = None
    if spec.get("embeds_seed") is not None:
        gen = torch.Generator().manual_seed(spec["embeds_seed"])
        embeds = torch.randn(len(prompt), 2, generator=gen)
        prompt = None
    return Request(
        request_id=spec["rid"],
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**sp_kwargs),
        pooling_params=None,
        arrival_time=float(spec.get("arrival", 0.0)),
        prompt_embeds=embeds,
        mm_features=mm or None,
        lora_request=lora,
        cache_salt=spec.get("salt"),
        block_hasher=hasher,
        resumable=bool(spec.get("resumable")),
        session_id=spec.get("session"),
    )


# --------------------------------------------------------------------------------------------
# normalisation of answers


def _is_kv_blocks(x: Any) -> bool:
    return hasattr(x, "blocks") and hasattr(x, "get_block_ids") and not isinstance(x, type)


class Side:
    """One manager plus its own Request objects and side-local handles."""

    def __init__(
        self, name: str, cls: type, cfg: TraceConfig, hasher_factory: Callable | None = None
    ):
        self.name = name
        self.cfg = cfg
        self.mgr = cls(**manager_kwargs(cfg))
        if name == "cand" and cls is not ReferenceKVCacheManager:
            # A constructor fall-back to vLLM's manager would compare vLLM with itself.
            if type(self.mgr) is ReferenceKVCacheManager:
                raise RuntimeError(f"the candidate fell back to vLLM's manager for {cfg}")
        factory = hasher_factory or get_request_block_hasher
        lookahead = (cfg.hash_lookahead,) if HAS_HASH_LOOKAHEAD else ()
        self.hasher = factory(cfg.block_size, get_hash_fn_by_name(cfg.hash_fn), *lookahead)
        self.reqs: dict[str, Request] = {}
        self.hits: dict[str, Any] = {}  # rid -> KVCacheBlocks of the last lookup
        self.popped: dict[str, list] = {}  # rid -> blocks of pop_blocks_for_free

    # -- normalisation ------------------------------------------------------------------
    def norm_blocks(self, x: Any) -> Any:
        if x is None:
            return None
        ids = x.get_block_ids()
        ids = tuple(list(g) for g in ids) if ids is not None else None
        pool_blocks = self.mgr.block_pool.blocks
        identity = all(b is pool_blocks[b.block_id] for g in x.blocks for b in g)
        return ("KVCacheBlocks", ids, x is self.mgr.empty_kv_cache_blocks, identity)

    def norm(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str, bytes)):
            return x
        if _is_kv_blocks(x):
            return self.norm_blocks(x)
        if isinstance(x, PrefixCacheStats) or type(x).__name__ == "PrefixCacheStats":
            return (
                "PrefixCacheStats",
                tuple((f, getattr(x, f, "<missing>")) for f in _STATS_FIELDS),
            )
        if hasattr(x, "block_id") and hasattr(x, "ref_cnt"):
            return ("block", x.block_id)
        if isinstance(x, dict):
            return ("dict", sorted((self.norm(k), self.norm(v)) for k, v in x.items()))
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(self.norm(v) for v in x))
        return ("repr", type(x).__name__, repr(x))

    def norm_events(self, events: Any) -> Any:
        out = []
        for e in events:
            try:
                enc = msgspec.msgpack.encode(e)
            except Exception as exc:  # candidate handed back something msgspec can't encode
                enc = f"<unencodable: {exc!r}>"
            out.append((type(e).__module__, type(e).__qualname__, enc, repr(e)))
        return ("events", tuple(out))

    # -- execution ----------------------------------------------------------------------
    def apply(self, action: list) -> Any:
        kind = action[0]
        if kind == "new":
            spec = action[1]
            self.reqs[spec["rid"]] = build_request(spec, self.hasher)
            return None
        if kind == "set":
            _, rid, attr, value = action
            req = self.reqs[rid]
            if attr == "status":
                value = RequestStatus[value]
            elif attr == "spec_token_ids":
                value = list(value)
            setattr(req, attr, value)
            return None
        if kind == "append":
            _, rid, toks = action
            self.reqs[rid].append_output_token_ids(list(toks))
            return None
        if kind == "rehash":  # Scheduler: resumable request re-admitted with hash lookahead
            req = self.reqs[action[1]]
            req.block_hashes.clear()
            req.update_block_hashes()
            return None
        if kind == "session_update":  # Scheduler._update_request_as_session
            _, rid, toks, max_tokens = action
            s = self.reqs[rid]
            keep_end = s.num_tokens - 1
            kept = s._all_token_ids[s.num_prompt_tokens : keep_end]
            del s._all_token_ids[keep_end:]
            del s.block_hashes[keep_end // self.cfg.block_size :]
            s._output_token_ids.clear()
            s.prompt_token_ids.extend(kept)
            s._all_token_ids.extend(toks)
            s.prompt_token_ids.extend(toks)
            s.update_block_hashes()
            s.num_prompt_tokens = len(s.prompt_token_ids)
            s.max_tokens = max_tokens
            s.status = RequestStatus.WAITING
            return None
        if kind == "call":
            return self._call(action[1], action[2])
        raise HarnessError(f"unknown action {action!r}")

    def _call(self, method: str, a: dict) -> Any:
        mgr = self.mgr
        rid = a.get("rid")
        req = self.reqs.get(rid) if rid is not None else None
        if method == "get_computed_blocks":
            if "max_len" in a:
                res = mgr.get_computed_blocks(req, a["max_len"])
            else:
                res = mgr.get_computed_blocks(req)
            self.hits[rid] = res[0]
            return res
        if method == "get_computed_blocks_for_connector":
            res = mgr.get_computed_blocks_for_connector(req)
            self.hits[rid] = res[0]
            return res
        if method == "allocate_slots":
            hit = a.get("hit", "none")
            if hit == "hit":
                ncb = self.hits[rid]
            elif hit == "empty":
                ncb = mgr.empty_kv_cache_blocks
            else:
                ncb = None
            kw = dict(a.get("kw", {}))
            if "skip_zeroing_group_ids" in kw:
                kw["skip_zeroing_group_ids"] = tuple(kw["skip_zeroing_group_ids"])
            if ncb is not None:
                kw["new_computed_blocks"] = ncb
            return mgr.allocate_slots(req, a["n"], **kw)
        if method == "record_prefix_cache_stats":
            return mgr.record_prefix_cache_stats(req, a["hits"])
        if method == "get_blocks":
            return mgr.get_blocks(rid)
        if method == "get_block_ids":
            return mgr.get_block_ids(rid)
        if method == "get_block_ids_for_computed_tokens":
            return mgr.get_block_ids_for_computed_tokens(rid, a["n"])
        if method == "free":
            return mgr.free(req)
        if method == "pop_blocks_for_free":
            blocks = mgr.pop_blocks_for_free(req)
            self.popped[a.get("key", rid)] = blocks
            return blocks
        if method == "free_popped":
            blocks = self.popped.pop(a.get("key", rid))
            return mgr.block_pool.free_blocks(reversed(blocks))
        if method == "cache_blocks":
            return mgr.cache_blocks(req, a["n"])
        if method == "estimate_cached_tokens":
            return mgr.estimate_cached_tokens(req)
        if method == "get_num_common_prefix_blocks":
            return mgr.get_num_common_prefix_blocks(rid)
        if method == "remove_skipped_blocks":
            return mgr.remove_skipped_blocks(rid, a["n"], req.num_prompt_tokens)
        if method == "truncate_computed_blocks":
            # the Scheduler passes the truncated view on to allocate_slots
            res = mgr.truncate_computed_blocks(self.hits[rid], a["n"])
            self.hits[rid] = res
            return res
        if method == "finalize_partial_tail_offloads":
            return mgr.finalize_partial_tail_offloads(req)
        if method == "evict_blocks":
            return mgr.evict_blocks(set(a["ids"]))
        if method == "reset_prefix_cache":
            return mgr.reset_prefix_cache()
        if method == "take_events":
            return mgr.take_events()
        if method == "make_prefix_cache_stats":
            return mgr.make_prefix_cache_stats()
        if method == "new_step_starts":
            return mgr.new_step_starts()
        if method == "take_new_block_ids":
            return mgr.take_new_block_ids()
        if method == "usage":
            return mgr.usage
        if method == "take_kv_cache_block_copies":
            return mgr.take_kv_cache_block_copies()
        if method == "take_boundary_state_offloads":
            return mgr.take_boundary_state_offloads()
        if method == "prefix_cache_lookup_enabled":
            return mgr.prefix_cache_lookup_enabled(req)
        if method == "block_pool.get_cached_block":
            return mgr.block_pool.get_cached_block(req.block_hashes[a["i"]], [0])
        if method == "block_pool.is_block_writable":
            return mgr.block_pool.is_block_writable(mgr.block_pool.blocks[a["id"]])
        if method == "block_pool.touch":  # a connector pins cached blocks
            pool = mgr.block_pool
            blocks = [pool.get_cached_block(req.block_hashes[i], [0])[0] for i in a["idx"]]
            pool.touch(blocks)
            self.popped[a["key"]] = blocks
            return [b.block_id for b in blocks]
        if method == "block_pool.get_new_blocks":  # a connector takes scratch blocks
            blocks = mgr.block_pool.get_new_blocks(a["n"])
            self.popped[a["key"]] = blocks
            return [b.block_id for b in blocks]
        if method == "block_pool.free_blocks":  # ... and releases them
            return mgr.block_pool.free_blocks(self.popped.pop(a["key"]))
        if method == "coordinator.get_num_blocks_to_allocate":
            # Scheduler._request_remaining_blocks (reservations for in-flight prefills)
            full = min(req.num_tokens, self.cfg.max_model_len)
            return mgr.coordinator.get_num_blocks_to_allocate(
                request_id=rid,
                num_tokens=full + a.get("extra", 0),
                new_computed_blocks=mgr.empty_kv_cache_blocks.blocks,
                num_encoder_tokens=0,
                total_computed_tokens=req.num_computed_tokens,
                num_local_computed_tokens=req.num_computed_tokens,
                num_tokens_main_model=full,
                apply_admission_cap=True,
                prefill_end=max(req.num_prompt_tokens, req.num_tokens - 1),
            )
        if method == "record_blocks_for_zeroing":
            return mgr.record_blocks_for_zeroing(rid, a["n"])
        raise HarnessError(f"unknown method {method!r}")

    def norm_result(self, method: str, raw: Any) -> Any:
        if method == "take_events":
            return self.norm_events(raw)
        if method == "pop_blocks_for_free":
            return ("blocks", tuple(b.block_id for b in raw))
        return self.norm(raw)

    # -- observation --------------------------------------------------------------------
    def observe(self, live: Sequence[str], deep: bool) -> list[tuple[str, Any]]:
        mgr = self.mgr
        obs: list[tuple[str, Any]] = []

        def probe(label: str, fn: Callable[[], Any]) -> None:
            try:
                obs.append((label, fn()))
            except Exception as exc:  # a missing attribute is a divergence too
                obs.append((label, ("raise", type(exc).__name__, str(exc)[:200])))

        pool = mgr.block_pool
        probe("block_pool.get_num_free_blocks()", pool.get_num_free_blocks)
        probe("usage", lambda: mgr.usage)
        if self.cfg.check_free_queue:
            probe(
                "free_block_queue order",
                lambda: [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            )
        for rid in live:
            probe(
                f"get_block_ids({rid!r})",
                lambda rid=rid: tuple(list(g) for g in mgr.get_block_ids(rid)),
            )
        if deep:
            probe(
                "block_pool.blocks[*].(ref_cnt, block_hash, hash_num_tokens, is_null)",
                lambda: [
                    (
                        b.block_id,
                        b.ref_cnt if not b.is_null else None,
                        b.block_hash,
                        b.block_hash_num_tokens,
                        b.is_null,
                    )
                    for b in pool.blocks
                ],
            )
            probe("free_block_queue.num_free_blocks", lambda: pool.free_block_queue.num_free_blocks)
            probe("prefix_cache_stats (running)", lambda: self.norm(mgr.prefix_cache_stats))
            for rid in live:
                probe(
                    f"estimate_cached_tokens({rid!r})",
                    lambda rid=rid: mgr.estimate_cached_tokens(self.reqs[rid]),
                )
            # hscache's core can verify its own invariants: a failure is reported as a
            # divergence (the reference side has no such hook and reports None)
            check = getattr(getattr(mgr, "_core", None), "check_invariants", None)
            probe(
                "internal invariants (_core.check_invariants())",
                lambda: check() if callable(check) else None,
            )
        return obs


# --------------------------------------------------------------------------------------------
# rendering


def _short_list(xs: Sequence, n: int = 12) -> str:
    xs = list(xs)
    if len(xs) <= n:
        return repr(xs)
    return f"[{', '.join(map(repr, xs[:n]))}, ... ({len(xs)} items)]"


def render_action(action: list) -> str:
    kind = action[0]
    if kind == "construct":
        return "KVCacheManager(**manager_kwargs(config))"
    if kind == "new":
        s = action[1]
        extras = []
        for key in REQUEST_FEATURES:
            if s.get(key):
                extras.append(f"{key}={s[key]!r}")
        return (
            f"{s['rid']} = Request(prompt={_short_list(s['prompt'], 8)} "
            f"[{len(s['prompt'])} tok], max_tokens={s['max_tokens']}"
            f"{', ' if extras else ''}{', '.join(extras)})"
        )
    if kind == "set":
        return f"{action[1]}.{action[2]} = {action[3]!r}"
    if kind == "append":
        return f"{action[1]}.append_output_token_ids({action[2]!r})"
    if kind == "rehash":
        return f"{action[1]}.block_hashes.clear(); {action[1]}.update_block_hashes()"
    if kind == "session_update":
        return (
            f"scheduler._update_request_as_session({action[1]}, "
            f"prompt_token_ids={action[2]!r}, max_tokens={action[3]})"
        )
    if kind == "call":
        method, a = action[1], dict(action[2])
        rid = a.pop("rid", None)
        args = [rid] if rid is not None else []
        if method == "allocate_slots":
            args.append(a.pop("n"))
            hit = a.pop("hit", "none")
            kw = a.pop("kw", {})
            if hit == "hit":
                kw = {"new_computed_blocks": f"<{rid} lookup result>", **kw}
            elif hit == "empty":
                kw = {"new_computed_blocks": "mgr.empty_kv_cache_blocks", **kw}
            args += [f"{k}={v}" for k, v in kw.items()]
        elif method == "free_popped":
            return f"mgr.block_pool.free_blocks(reversed(<blocks popped for {rid}>))"
        raises = a.pop("expect_raise", None)
        a.pop("key", None)
        args += [f"{k}={v!r}" for k, v in a.items()]
        if method == "usage":
            return "mgr.usage"
        return f"mgr.{method}({', '.join(map(str, args))})" + ("  # must raise" if raises else "")
    return repr(action)


def _fmt(v: Any, limit: int = 3000) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + f"... <{len(s)} chars>"


def _first_diff(a: Any, b: Any) -> str:
    """Point at the first differing element of two sequences (handy for queue orders)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f" (first difference at index {i}: {_fmt(x, 600)} != {_fmt(y, 600)})"
        if len(a) != len(b):
            return f" (lengths {len(a)} != {len(b)})"
    return ""


# --------------------------------------------------------------------------------------------
# the pair


class _Pair:
    def __init__(
        self,
        cfg: TraceConfig,
        candidate: type,
        seed: Any,
        cand_hasher_factory: Callable | None = None,
    ):
        init_none_hash(get_hash_fn_by_name(cfg.hash_fn))
        self.cfg = cfg
        self.seed = seed
        self.ref = Side("ref", ReferenceKVCacheManager, cfg)
        self.cand = Side("cand", candidate, cfg, cand_hasher_factory)
        self.actions: list[list] = []
        self.ncalls = 0
        self.live: dict[str, None] = {}  # ordered set of requests holding blocks
        self.stats: dict[str, int] = {}  # what the reference's answers exercised
        self.outcomes: list[Any] = []  # per action: the reference's decision (for shrinking)
        self.expect: Sequence[Any] | None = None  # replay: decisions the trace must repeat
        self.check_static()

    def _bump(self, key: str, k: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + k

    def _tally(self, method: str, raw: Any) -> None:
        if method == "allocate_slots":
            self._bump("alloc_none" if raw is None else "alloc_ok")
        elif method in ("get_computed_blocks", "get_computed_blocks_for_connector"):
            if raw[1]:
                self._bump("lookup_hit")
                self._bump("hit_tokens", raw[1])
            else:
                self._bump("lookup_miss")
        elif method == "take_events":
            for e in raw:
                self._bump("ev_" + type(e).__name__)
        elif method == "reset_prefix_cache":
            self._bump("reset_ok" if raw else "reset_refused")
        elif method == "take_new_block_ids" and raw:
            self._bump("new_block_ids_to_zero", len(raw))

    # -------------------------------------------------------------------------------
    def _diverge(self, check: str, ref: Any, cand: Any, extra: str = "") -> None:
        action = self.actions[-1] if self.actions else ["construct"]
        call = render_action(action)
        tail = "\n".join(
            f"  [{i}] {render_action(x)}"
            for i, x in enumerate(self.actions[-30:], start=max(0, len(self.actions) - 30))
        )
        msg = (
            f"DIVERGENCE seed={self.seed} call#{self.ncalls} action#{len(self.actions) - 1}\n"
            f"  call:  {call}\n"
            f"  check: {check}{_first_diff(ref, cand)}\n"
            f"  vLLM:  {_fmt(ref)}\n"
            f"  cand:  {_fmt(cand)}\n"
            f"{extra}"
            f"  config: {self.cfg}\n"
            f"  last actions:\n{tail}"
        )
        method = action[1] if action[0] == "call" else action[0]
        if check.startswith("after construction"):
            method = check
        err = Divergence(
            msg,
            seed=self.seed,
            call_index=self.ncalls,
            action_index=len(self.actions) - 1,
            call=call,
            check=check,
            ref=ref,
            cand=cand,
            signature=(method, check.split("(")[0]),
        )
        err.actions = list(self.actions)
        err.outcomes = list(self.outcomes)
        err.config = self.cfg
        raise err

    def do(self, action: list) -> Any:
        """Execute one action on both sides, compare, and return the reference's raw answer."""
        self.actions.append(action)
        is_call = action[0] == "call"
        method = action[1] if is_call else action[0]
        expect_raise = is_call and action[2].get("expect_raise", False)
        outs = []
        raws = []
        for side in (self.ref, self.cand):
            try:
                raw = side.apply(action)
                norm = side.norm_result(method, raw) if is_call else None
                outs.append(("ok", norm))
                raws.append(raw)
            except HarnessError:
                raise
            except Exception as exc:
                outs.append(("raise", type(exc).__name__))
                raws.append(exc)
        ref_out, cand_out = outs
        outcome = _outcome(method, raws[0]) if ref_out[0] == "ok" else "raise"
        self.outcomes.append(outcome)
        if self.expect is not None and self.expect[len(self.actions) - 1] != outcome:
            raise HarnessError(
                f"replay deviates from the recorded trace at action#{len(self.actions) - 1}"
            )
        if ref_out[0] == "raise" and not expect_raise:
            exc = raws[0]
            raise HarnessError(
                f"reference raised on action#{len(self.actions) - 1} "
                f"{render_action(action)} (seed={self.seed}): {exc!r}\n"
                + "".join(traceback.format_exception(exc)[-6:])
            ) from exc
        if ref_out[0] == cand_out[0] == "raise" and isinstance(raws[1], type(raws[0])):
            cand_out = ref_out  # a subclass of the reference's exception is compatible
        if ref_out != cand_out:
            extra = ""
            if cand_out[0] == "raise":
                extra = "  candidate traceback:\n" + "".join(
                    "    " + line
                    for line in "".join(traceback.format_exception(raws[1])[-8:]).splitlines(True)
                )
            self._diverge("return value" if is_call else "request update", ref_out, cand_out, extra)
        if not is_call:
            if ref_out[0] == "raise":
                raise HarnessError(f"request action failed: {render_action(action)}")
            return None
        self.ncalls += 1
        if ref_out[0] == "ok":
            self._tally(method, raws[0])
        # bookkeeping of which requests hold blocks (drives the block-table comparison)
        rid = action[2].get("rid")
        if method == "allocate_slots" and ref_out[0] == "ok" and raws[0] is not None:
            self.live[rid] = None
        elif method in ("free", "pop_blocks_for_free"):
            self.live.pop(rid, None)
        self.check_state(deep=bool(self.cfg.deep_every) and self.ncalls % self.cfg.deep_every == 0)
        if self.cfg.events_every_call and method != "take_events" and self.cfg.enable_events:
            self._compare_events("take_events() after the call")
        return raws[0] if ref_out[0] == "ok" else None

    def _compare_events(self, label: str) -> None:
        outs = []
        for side in (self.ref, self.cand):
            try:
                events = side.mgr.take_events()
                if side is self.ref:
                    self._tally("take_events", events)
                outs.append(side.norm_events(events))
            except Exception as exc:
                outs.append(("raise", type(exc).__name__, str(exc)[:200]))
        if outs[0] != outs[1]:
            r, c = outs
            if r[0] == "events" and c[0] == "events":
                # show the reprs; if they agree, the types or msgpack encodings differ
                rr, cr = [x[3] for x in r[1]], [x[3] for x in c[1]]
                if rr != cr:
                    r, c = rr, cr
                else:
                    r, c = [x[:3] for x in r[1]], [x[:3] for x in c[1]]
            self._diverge(label, r, c)

    def check_state(self, deep: bool = False) -> None:
        live = list(self.live)
        if deep:  # coverage only: duplicate cached blocks present in the reference
            cache = getattr(self.ref.mgr.block_pool.cached_block_hash_to_block, "_cache", {})
            dups = sum(1 for v in cache.values() if isinstance(v, dict) and len(v) > 1)
            if dups:
                self._bump("dup_keys_seen", dups)
        r = self.ref.observe(live, deep)
        c = self.cand.observe(live, deep)
        for (label, rv), (_, cv) in zip(r, c, strict=True):
            if rv != cv:
                self._diverge(label, rv, cv)

    def check_static(self) -> None:
        """Attributes the Scheduler / EngineCore / connectors read after construction."""
        probes: list[tuple[str, Callable[[Any], Any]]] = [
            (
                "type(block_pool.blocks[0]).__name__ is a block",
                lambda m: hasattr(m.block_pool.blocks[0], "block_id"),
            ),
            ("max_model_len", lambda m: m.max_model_len),
            ("enable_caching", lambda m: m.enable_caching),
            ("use_eagle", lambda m: m.use_eagle),
            ("log_stats", lambda m: m.log_stats),
            ("enable_kv_cache_events", lambda m: m.enable_kv_cache_events),
            ("watermark_blocks", lambda m: m.watermark_blocks),
            ("num_kv_cache_groups", lambda m: m.num_kv_cache_groups),
            ("mamba_shared_prefix_checkpoint", lambda m: m.mamba_shared_prefix_checkpoint),
            ("kv_cache_event_metadata", lambda m: m.kv_cache_event_metadata),
            ("kv_cache_config.num_blocks", lambda m: m.kv_cache_config.num_blocks),
            ("empty_kv_cache_blocks.blocks", lambda m: m.empty_kv_cache_blocks.blocks),
            (
                "empty_kv_cache_blocks.get_block_ids()",
                lambda m: m.empty_kv_cache_blocks.get_block_ids(),
            ),
            ("prefix_cache_stats", lambda m: self.ref.norm(m.prefix_cache_stats)),
            ("usage", lambda m: m.usage),
            ("block_pool.num_gpu_blocks", lambda m: m.block_pool.num_gpu_blocks),
            ("block_pool.hash_block_size", lambda m: m.block_pool.hash_block_size),
            ("block_pool.enable_caching", lambda m: m.block_pool.enable_caching),
            (
                "block_pool.null_block",
                lambda m: (
                    m.block_pool.null_block.block_id,
                    m.block_pool.null_block.is_null,
                    m.block_pool.null_block is m.block_pool.blocks[0],
                ),
            ),
            ("len(block_pool.blocks)", lambda m: len(m.block_pool.blocks)),
            ("block_pool.get_num_free_blocks()", lambda m: m.block_pool.get_num_free_blocks()),
            ("block_pool.get_usage()", lambda m: m.block_pool.get_usage()),
            (
                "coordinator.enable_partial_hash_hits",
                lambda m: m.coordinator.enable_partial_hash_hits,
            ),
            (
                "coordinator.num_reprefillable_tokens",
                lambda m: m.coordinator.num_reprefillable_tokens,
            ),
            (
                "len(coordinator.single_type_managers)",
                lambda m: len(m.coordinator.single_type_managers),
            ),
            (
                "coordinator.single_type_managers[0].block_size",
                lambda m: m.coordinator.single_type_managers[0].block_size,
            ),
            (
                "coordinator.single_type_managers[0].kv_cache_spec",
                lambda m: m.coordinator.single_type_managers[0].kv_cache_spec,
            ),
            (
                "coordinator.single_type_managers[0].kv_cache_group_id",
                lambda m: m.coordinator.single_type_managers[0].kv_cache_group_id,
            ),
            (
                "coordinator.single_type_managers[0].records_new_block_ids",
                lambda m: m.coordinator.single_type_managers[0].records_new_block_ids,
            ),
            ("get_num_common_prefix_blocks('x')", lambda m: m.get_num_common_prefix_blocks("x")),
        ]
        for label, fn in probes:
            vals = []
            for side in (self.ref, self.cand):
                try:
                    vals.append(fn(side.mgr))
                except Exception as exc:
                    vals.append(("raise", type(exc).__name__, str(exc)[:200]))
            if vals[0] != vals[1]:
                self._diverge(f"after construction: {label}", vals[0], vals[1])

    # convenience -------------------------------------------------------------------
    def call(self, method: str, **args) -> Any:
        return self.do(["call", method, args])

    def req(self, rid: str) -> Request:
        return self.ref.reqs[rid]


# --------------------------------------------------------------------------------------------
# the scheduler-like generator


class _Generator:
    def __init__(self, pair: _Pair, rng: random.Random):
        self.p = pair
        self.cfg = pair.cfg
        self.rng = rng
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.remote: list[str] = []  # WAITING_FOR_REMOTE_KVS (async load in flight)
        self.deferred: list[tuple[str, str]] = []  # popped blocks pending block_pool.free_blocks
        self.specs: dict[str, dict] = {}
        self.finished: list[str] = []
        self.fail_count: dict[str, int] = {}
        self.pending: list[tuple[str, int, int, bool]] = []  # async: outputs in flight
        self.epoch: dict[str, int] = {}
        self.parked: list[str] = []  # sessions waiting for their next input chunk
        self.pins: list[str] = []  # keys of blocks a "connector" holds
        self.next_id = 0
        B = self.cfg.block_size
        self.sys_prompts = [
            [rng.randint(1, VOCAB) for _ in range(rng.randint(1, 6) * B + rng.randint(0, B))]
            for _ in range(3)
        ]
        self.sys_prompts = [s[: max(1, self.cfg.max_prompt - 1)] for s in self.sys_prompts]

    # ----------------------------------------------------------------- requests
    def _tok(self) -> int:
        return self.rng.randint(1, VOCAB)

    def new_spec(self) -> dict:
        rng, cfg = self.rng, self.cfg
        rid = f"r{self.next_id}"
        self.next_id += 1
        deferred_rids = {r for r, _ in self.deferred}
        reusable = [
            r for r in self.finished[-10:] if r not in deferred_rids and r not in self.p.live
        ]
        if reusable and rng.random() < 0.05:
            rid = rng.choice(reusable)  # a client reusing a finished request id
            self.finished.remove(rid)
            self.p._bump("request_id_reused")
        r = rng.random()
        spec: dict[str, Any]
        if r < cfg.p_dup and self.specs:
            base = self.specs[rng.choice(list(self.specs))]
            spec = dict(base)
        elif r < cfg.p_dup + cfg.p_conv and self.finished:
            base_rid = rng.choice(self.finished[-8:])
            base = self.specs[base_rid]
            spec = dict(base)
            toks = list(self.p.req(base_rid).all_token_ids)
            if base.get("embeds_seed") is not None:
                toks = list(base["prompt"])
            spec["prompt"] = toks + [self._tok() for _ in range(rng.randint(0, 3))]
        else:
            prefix = list(rng.choice(self.sys_prompts)) if rng.random() < 0.7 else []
            if rng.random() < 0.3 and prefix:
                prefix = prefix[: rng.randint(1, len(prefix))]
            suffix_len = rng.randint(1, max(1, cfg.max_prompt // 2))
            spec = {"prompt": prefix + [self._tok() for _ in range(suffix_len)]}
            if rng.random() < cfg.p_lora:
                spec["lora"] = rng.choice((("loraA", 1, "/a"), ("loraB", 2, "/b")))
            if rng.random() < cfg.p_salt:
                spec["salt"] = rng.choice(("s1", "s2"))
            if rng.random() < cfg.p_logprobs:
                spec["logprobs"] = True
            if rng.random() < cfg.p_report_full:
                spec["report_full"] = True
            if rng.random() < cfg.p_session:
                spec["session"] = rng.choice(("sess1", "sess2"))
            if rng.random() < cfg.p_embeds:
                spec["embeds_seed"] = rng.randint(0, 2)
            elif rng.random() < cfg.p_resumable:
                spec["resumable"] = True
            prompt = spec["prompt"][: cfg.max_prompt]
            if rng.random() < cfg.p_mm and len(prompt) >= 2 and not spec.get("embeds_seed"):
                spec["mm"] = self._mm_items(prompt)
        prompt = spec["prompt"][: cfg.max_prompt]
        if not prompt:
            prompt = [self._tok()]
        spec["prompt"] = prompt
        if spec.get("mm"):
            # placeholders carry the image token
            prompt = list(prompt)
            for _, _, off, length in spec["mm"]:
                if off + length > len(prompt):
                    spec["mm"] = None
                    break
                prompt[off : off + length] = [PLACEHOLDER_TOKEN] * length
            spec["prompt"] = prompt
        if not spec.get("mm"):
            spec.pop("mm", None)
        room = cfg.max_model_len - len(prompt)
        if rng.random() < 0.1:
            spec["max_tokens"] = max(1, room)  # runs into max_model_len
        else:
            spec["max_tokens"] = max(1, min(room, rng.randint(1, cfg.max_out)))
        spec["rid"] = rid
        spec["arrival"] = float(self.next_id)
        return spec

    def _mm_items(self, prompt: list[int]) -> list:
        rng = self.rng
        n = len(prompt)
        items = []
        pos = rng.randint(0, max(0, n // 3))
        for _ in range(rng.randint(1, 3)):
            if pos >= n - 1:
                break
            length = rng.randint(1, max(1, min(3 * self.cfg.block_size, n - pos - 1)))
            ident = rng.choice(("img_a", "img_b", "img_c"))
            items.append(("image", ident, pos, length))
            pos += length + rng.randint(0, max(1, self.cfg.block_size))
        return items

    def add_requests(self, k: int) -> None:
        for _ in range(k):
            spec = self.new_spec()
            self.specs[spec["rid"]] = spec
            self.fail_count.pop(spec["rid"], None)
            self.p.do(["new", spec])
            self.waiting.append(spec["rid"])

    # ----------------------------------------------------------------- helpers
    def set(self, rid: str, attr: str, value: Any) -> None:
        self.p.do(["set", rid, attr, value])

    def release(self, rid: str, allow_defer: bool = True) -> None:
        """Free a request's blocks now, or pop them for a deferred free."""
        if allow_defer and self.rng.random() < self.cfg.p_deferred_free:
            key = f"{rid}@{len(self.p.actions)}"
            self.p.call("pop_blocks_for_free", rid=rid, key=key)
            self.deferred.append((rid, key))
        else:
            self.p.call("free", rid=rid)

    def preempt(self, rid: str) -> None:
        if rid in self.running:
            self.running.remove(rid)
        self._drop_in_flight(rid)
        self.release(rid)
        req = self.p.req(rid)
        self.set(rid, "status", "PREEMPTED")
        self.set(rid, "num_computed_tokens", 0)
        if req.spec_token_ids:
            self.set(rid, "spec_token_ids", [])
        self.set(rid, "num_preemptions", req.num_preemptions + 1)
        self.waiting.appendleft(rid)

    def finish(self, rid: str, status: str = "FINISHED_STOPPED") -> None:
        for q in (self.running, self.remote, self.parked):
            if rid in q:
                q.remove(rid)
        self._drop_in_flight(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)
        self.set(rid, "status", status)
        if self.rng.random() < 0.15 and rid in self.p.live:
            self.p.call("estimate_cached_tokens", rid=rid)
        self.release(rid)
        self.finished.append(rid)

    def flush_deferred(self, k: int | None = None) -> None:
        k = len(self.deferred) if k is None else k
        for _ in range(min(k, len(self.deferred))):
            rid, key = self.deferred.pop(0)
            self.p.call("free_popped", rid=rid, key=key)

    # ----------------------------------------------------------------- scheduling
    def admit(self, budget: int) -> tuple[int, list]:
        """Admit waiting requests (FIFO) like Scheduler.schedule's waiting loop."""
        cfg, rng, p = self.cfg, self.rng, self.p
        scheduled = []
        while budget > 0 and self.waiting and len(self.running) < cfg.max_running:
            rid = self.waiting[0]
            req = p.req(rid)
            N = req.num_tokens
            did_lookup = req.num_computed_tokens == 0
            if did_lookup and req.resumable and cfg.hash_lookahead:
                p.do(["rehash", rid])
            ext = 0
            load_async = False
            if did_lookup:
                if rng.random() < 0.1:
                    res = p.call("get_computed_blocks_for_connector", rid=rid)
                    _, hit, boundary, _ = res
                elif rng.random() < cfg.p_max_hit_len:
                    max_len = rng.randint(0, N - 1)
                    _, hit, boundary = p.call("get_computed_blocks", rid=rid, max_len=max_len)
                else:
                    _, hit, boundary = p.call("get_computed_blocks", rid=rid)
                if boundary != req.shared_prefix_boundary:
                    self.set(rid, "shared_prefix_boundary", boundary)
                if hit and rng.random() < 0.08:
                    # connector path: present a shorter, block-aligned local hit
                    hit = rng.randint(0, hit // cfg.block_size) * cfg.block_size
                    p.call("truncate_computed_blocks", rid=rid, n=hit)
                if rng.random() < cfg.p_external and hit < N - 1:
                    ext = rng.randint(1, N - 1 - hit)
                    load_async = rng.random() < cfg.p_async_load
                computed = hit + ext
                hit_mode = "hit"
            else:
                hit = 0
                computed = req.num_computed_tokens
                hit_mode = "empty"
            if load_async:
                n = 0
            else:
                n = min(N - computed, budget)
            kw: dict[str, Any] = {
                "num_new_computed_tokens": hit,
                "num_lookahead_tokens": 0 if load_async else cfg.num_lookahead_tokens,
                "num_external_computed_tokens": ext,
                "delay_cache_blocks": load_async,
                "full_sequence_must_fit": cfg.full_sequence_must_fit,
                "reserved_blocks": self._reserved_blocks() if load_async else 0,
                "has_scheduled_reqs": bool(self.running),
            }
            if load_async and rng.random() < 0.5:
                kw["skip_zeroing_group_ids"] = [0]
            new_blocks = p.call("allocate_slots", rid=rid, n=n, hit=hit_mode, kw=kw)
            if new_blocks is None:
                self.fail_count[rid] = self.fail_count.get(rid, 0) + 1
                if not self.running and not self.remote and self.fail_count[rid] >= 3:
                    # would never fit: the real scheduler would stall; abort it instead
                    self.finish(rid, "FINISHED_ABORTED")
                    continue
                break
            self.fail_count.pop(rid, None)
            if did_lookup:
                p.call("record_prefix_cache_stats", rid=rid, hits=hit)
            p.call("get_blocks", rid=rid)
            self.waiting.popleft()
            if load_async:
                self.set(rid, "num_computed_tokens", computed)
                self.set(rid, "status", "WAITING_FOR_REMOTE_KVS")
                self.remote.append(rid)
                continue
            if computed != req.num_computed_tokens:
                self.set(rid, "num_computed_tokens", computed)
            self.set(rid, "status", "RUNNING")
            self.running.append(rid)
            scheduled.append((rid, n))
            budget -= n
        return budget, scheduled

    def _reserved_blocks(self) -> int:
        """Scheduler._inflight_prefill_reserved_blocks() + _spec_decode_step_blocks."""
        cfg, p = self.cfg, self.p
        extra = 1 + cfg.num_spec_tokens + cfg.num_lookahead_tokens if cfg.num_spec_tokens else 0
        total = 0
        inflight = self.remote + [
            r for r in self.running if p.req(r).num_computed_tokens < p.req(r).num_tokens
        ]
        for rid in inflight:
            total += p.call("coordinator.get_num_blocks_to_allocate", rid=rid, extra=extra)
        spec_step = -(-(cfg.num_spec_tokens + cfg.num_lookahead_tokens) // cfg.block_size)
        return total + (spec_step if cfg.num_spec_tokens else 0) + self.rng.randint(0, 1)

    def schedule_step(self) -> None:
        """One Scheduler.schedule() + update_from_output() (sync), or, with
        ``async_sched``, schedule(t+1) before update_from_output(t) like AsyncScheduler."""
        cfg, rng, p = self.cfg, self.rng, self.p
        p.call("new_step_starts")
        budget = cfg.token_budget
        scheduled: list[tuple[str, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            rid = self.running[i]
            req = p.req(rid)
            if (
                req.num_output_placeholders > 0
                and req.num_computed_tokens + 2 - req.num_output_placeholders
                >= req.num_prompt_tokens + req.max_tokens
            ):
                i += 1  # async: the last step already reaches max_tokens
                continue
            n = req.num_tokens_with_spec + req.num_output_placeholders - req.num_computed_tokens
            n = min(n, budget, cfg.max_model_len - req.num_computed_tokens - 1)
            if n <= 0:
                i += 1
                continue
            new_blocks = None
            while True:
                new_blocks = p.call(
                    "allocate_slots",
                    rid=rid,
                    n=n,
                    kw={"num_lookahead_tokens": cfg.num_lookahead_tokens},
                )
                if new_blocks is not None:
                    break
                victim = self.running[-1]
                scheduled = [(r, k) for r, k in scheduled if r != victim]
                self.preempt(victim)
                preempted = True
                if victim == rid:
                    break
            if new_blocks is None:
                break
            scheduled.append((rid, n))
            budget -= n
            i += 1
        if not preempted:
            budget, admitted = self.admit(budget)
            scheduled += admitted
        if cfg.async_sched:
            self._outputs_async(scheduled)
        else:
            self._outputs_sync(scheduled)
        p.call("take_new_block_ids")
        if rng.random() < 0.2:
            p.call("make_prefix_cache_stats")
        if not cfg.events_every_call and rng.random() < 0.3:
            p.call("take_events")
        if self.deferred and rng.random() < 0.5:
            self.flush_deferred(rng.randint(1, len(self.deferred)))

    def _after_token(self, rid: str) -> bool:
        """Stop checks after new output tokens; returns True if the request left running."""
        cfg, p = self.cfg, self.p
        req = p.req(rid)
        if req.num_tokens >= cfg.max_model_len:
            self.finish(rid, "FINISHED_LENGTH_CAPPED")
            return True
        if req.num_output_tokens >= req.max_tokens:
            if self.specs[rid].get("resumable") and self.rng.random() < 0.8:
                self.park_session(rid)
            else:
                self.finish(rid, "FINISHED_LENGTH_CAPPED")
            return True
        return False

    def _outputs_sync(self, scheduled: list[tuple[str, int]]) -> None:
        """The model ran: advance computed tokens, sample outputs, accept drafts."""
        cfg, rng, p = self.cfg, self.rng, self.p
        for rid, n in scheduled:
            req = p.req(rid)
            old_c, old_n = req.num_computed_tokens, req.num_tokens
            new_c = old_c + n
            if new_c < old_n:  # a non-final prefill chunk
                self.set(rid, "num_computed_tokens", new_c)
                continue
            n_spec = max(0, new_c - old_n)
            accepted = rng.randint(0, n_spec) if n_spec else 0
            drafts = list(req.spec_token_ids)
            self.set(rid, "num_computed_tokens", new_c - (n_spec - accepted))
            if drafts:
                self.set(rid, "spec_token_ids", [])
            toks = [*drafts[:accepted], self._tok()]
            p.do(["append", rid, toks])
            if cfg.num_spec_tokens:
                # update_from_output: cache_blocks(request, C - num_in_flight_tokens)
                p.call(
                    "cache_blocks", rid=rid, n=req.num_computed_tokens - req.num_in_flight_tokens
                )
            if self._after_token(rid):
                continue
            if cfg.num_spec_tokens:
                k = min(cfg.num_spec_tokens, cfg.max_model_len - req.num_tokens - 1)
                if k > 0:
                    self.set(rid, "spec_token_ids", [self._tok() for _ in range(k)])

    def _outputs_async(self, scheduled: list[tuple[str, int]]) -> None:
        """AsyncScheduler: computed tokens advance at schedule time (placeholders for the
        tokens being sampled); the previous step's outputs arrive afterwards."""
        p = self.p
        new_pending = []
        for rid, n in scheduled:
            req = p.req(rid)
            self.set(rid, "num_computed_tokens", req.num_computed_tokens + n)
            self.set(rid, "num_in_flight_tokens", req.num_in_flight_tokens + n)
            sampled = req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders
            if sampled:
                self.set(rid, "num_output_placeholders", req.num_output_placeholders + 1)
            new_pending.append((rid, self.epoch.get(rid, 0), n, sampled))
        for rid, epoch, n, sampled in self.pending:
            if self.epoch.get(rid, 0) != epoch or rid not in self.running:
                continue  # preempted or finished since: the stale output is dropped
            req = p.req(rid)
            self.set(rid, "num_in_flight_tokens", req.num_in_flight_tokens - n)
            if not sampled:
                continue
            self.set(rid, "num_output_placeholders", req.num_output_placeholders - 1)
            p.do(["append", rid, [self._tok()]])
            p.call("cache_blocks", rid=rid, n=req.num_computed_tokens - req.num_in_flight_tokens)
            self._after_token(rid)
        self.pending = new_pending

    def _drop_in_flight(self, rid: str) -> None:
        """Forget in-flight async work of a request leaving the running set."""
        req = self.p.req(rid)
        self.epoch[rid] = self.epoch.get(rid, 0) + 1
        if req.num_in_flight_tokens:
            self.set(rid, "num_in_flight_tokens", 0)
        if req.num_output_placeholders:
            self.set(rid, "num_output_placeholders", 0)

    # ----------------------------------------------------------------- sessions
    def park_session(self, rid: str) -> None:
        """A resumable (streaming-input) request ends its turn: it keeps its blocks and waits
        for more input (Scheduler._handle_stopped_request)."""
        req = self.p.req(rid)
        frontier = req.num_computed_tokens - req.num_output_placeholders
        self.running.remove(rid)
        self._drop_in_flight(rid)
        self.set(rid, "num_computed_tokens", frontier)
        if req.spec_token_ids:
            self.set(rid, "spec_token_ids", [])
        self.set(rid, "status", "WAITING_FOR_STREAMING_REQ")
        self.parked.append(rid)

    def resume_session(self) -> None:
        """The next input chunk of a parked session arrives
        (Scheduler._update_request_as_session): the last sampled token is dropped, its block
        hashes are truncated in place, the new tokens extend the prompt."""
        rng, p, cfg = self.rng, self.p, self.cfg
        rid = rng.choice(self.parked)
        req = p.req(rid)
        room = cfg.max_model_len - req.num_tokens  # num_tokens - 1 kept, +new, +1 output
        if room < 1:
            self.parked.remove(rid)
            self.finish(rid, "FINISHED_LENGTH_CAPPED")
            return
        toks = [self._tok() for _ in range(rng.randint(1, min(room, 2 * cfg.block_size + 3)))]
        max_tokens = rng.randint(1, max(1, min(cfg.max_out, room - len(toks) + 1)))
        self.parked.remove(rid)
        p.do(["session_update", rid, toks, max_tokens])
        self.waiting.appendleft(rid)

    # ----------------------------------------------------------------- misc ops
    def complete_remote(self) -> None:
        rng, p = self.rng, self.p
        rid = rng.choice(self.remote)
        self.remote.remove(rid)
        req = p.req(rid)
        if rng.random() < 0.25:
            # load failure: only a prefix is valid; invalid blocks are evicted
            B = self.cfg.block_size
            valid = rng.randint(0, req.num_computed_tokens) // B * B
            ids = p.call("get_block_ids", rid=rid)[0]
            bad = ids[valid // B :]
            if bad:
                p.call("evict_blocks", ids=sorted(set(bad))[: rng.randint(1, len(bad))])
            self.set(rid, "num_computed_tokens", valid)
            if valid:
                p.call("cache_blocks", rid=rid, n=valid)
                if self.cfg.zeroing:
                    p.call("record_blocks_for_zeroing", rid=rid, n=valid)
            else:
                p.call("free", rid=rid)
        else:
            p.call("cache_blocks", rid=rid, n=req.num_computed_tokens)
        self.set(rid, "status", "WAITING" if req.num_preemptions == 0 else "PREEMPTED")
        self.waiting.appendleft(rid)

    def invalid_blocks(self) -> None:
        """A KV connector reports blocks of a running request as invalid (failed sync load):
        Scheduler._update_requests_with_invalid_blocks rewinds num_computed_tokens to the
        first invalid block and evicts it and everything after it."""
        rng, p, B = self.rng, self.p, self.cfg.block_size
        candidates = [
            r
            for r in self.running
            if p.req(r).num_computed_tokens >= B and not p.req(r).num_output_placeholders
        ]
        if not candidates:
            return
        rid = rng.choice(candidates)
        req = p.req(rid)
        ids = p.call("get_block_ids", rid=rid)[0]
        n_blocks = min(len(ids), -(-req.num_computed_tokens // B))
        idx = rng.randrange(n_blocks)
        self.set(rid, "num_computed_tokens", idx * B)
        if req.spec_token_ids:
            self.set(rid, "spec_token_ids", [])
        p.call("evict_blocks", ids=sorted(set(ids[idx:])))
        p._bump("invalid_blocks")

    def connector_blocks(self) -> None:
        """An offloading connector pins cached blocks (touch) or takes scratch blocks, and
        releases them later through block_pool.free_blocks."""
        rng, p = self.rng, self.p
        if self.pins and rng.random() < 0.5:
            key = self.pins.pop(rng.randrange(len(self.pins)))
            p.call("block_pool.free_blocks", key=key)
            return
        key = f"pin@{len(p.actions)}"
        ref_pool = p.ref.mgr.block_pool
        if rng.random() < 0.8:
            rids = [r for r in p.ref.reqs if p.req(r).block_hashes]
            if not rids:
                return
            rid = rng.choice(rids)
            hashes = p.req(rid).block_hashes
            idx = [
                i
                for i in range(len(hashes))
                if ref_pool.get_cached_block(hashes[i], [0]) is not None
            ]
            if not idx:
                return
            idx = sorted(rng.sample(idx, rng.randint(1, min(3, len(idx)))))
            p.call("block_pool.touch", rid=rid, idx=idx, key=key)
        else:
            n = rng.randint(1, 2)
            if ref_pool.get_num_free_blocks() < n:
                return
            p.call("block_pool.get_new_blocks", n=n, key=key)
        self.pins.append(key)

    def abort_random(self) -> None:
        pool = list(self.waiting) + self.running + self.remote + self.parked
        if pool:
            self.finish(self.rng.choice(pool), "FINISHED_ABORTED")

    def reset(self) -> None:
        if self.rng.random() < 0.3:
            # Scheduler.reset_prefix_cache(reset_running_requests=True)
            for rid in list(reversed(self.running)):
                self.preempt(rid)
            self.flush_deferred()
        self.p.call("reset_prefix_cache")

    def evict(self) -> None:
        rng, ref = self.rng, self.p.ref.mgr
        hashed = [
            b.block_id for b in ref.block_pool.blocks if b.block_hash is not None and not b.is_null
        ]
        if hashed and rng.random() < 0.8:
            ids = rng.sample(hashed, rng.randint(1, min(3, len(hashed))))
        else:
            ids = [rng.randint(1, self.cfg.num_blocks - 1) for _ in range(rng.randint(0, 2))]
        self.p.call("evict_blocks", ids=sorted(set(ids)))

    def probe(self) -> None:
        rng, p, cfg = self.rng, self.p, self.cfg
        live = list(p.live)
        r = rng.random()
        if live and r < 0.2:
            rid = rng.choice(live)
            p.call(
                rng.choice(
                    (
                        "get_block_ids",
                        "get_blocks",
                        "get_num_common_prefix_blocks",
                        "finalize_partial_tail_offloads",
                    )
                ),
                rid=rid,
            )
        elif live and r < 0.3:
            rid = rng.choice(live)
            p.call("get_block_ids_for_computed_tokens", rid=rid, n=p.req(rid).num_computed_tokens)
        elif live and r < 0.35:
            rid = rng.choice(live)
            p.call("remove_skipped_blocks", rid=rid, n=p.req(rid).num_computed_tokens)
        elif live and r < 0.45:
            rid = rng.choice([x for x in live if x in self.p.ref.reqs])
            if p.req(rid).status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                p.call("estimate_cached_tokens", rid=rid)
        elif self.running and r < 0.6:
            rid = rng.choice(self.running)
            p.call("cache_blocks", rid=rid, n=rng.randint(0, p.req(rid).num_computed_tokens))
        elif r < 0.75 and (self.waiting or self.running):
            rid = rng.choice(list(self.waiting) + self.running)
            _, hit, _ = p.call("get_computed_blocks", rid=rid)
            if hit and rng.random() < 0.5:
                B = cfg.block_size
                p.call("truncate_computed_blocks", rid=rid, n=rng.randint(0, hit // B) * B)
            if rng.random() < 0.3:
                p.call("prefix_cache_lookup_enabled", rid=rid)
            hashes = p.req(rid).block_hashes
            if hashes and rng.random() < 0.5:
                p.call("block_pool.get_cached_block", rid=rid, i=rng.randrange(len(hashes)))
            if rng.random() < 0.3:
                p.call("block_pool.is_block_writable", id=rng.randrange(cfg.num_blocks))
        elif r < 0.85:
            p.call(
                rng.choice(
                    (
                        "usage",
                        "take_kv_cache_block_copies",
                        "take_boundary_state_offloads",
                        "take_new_block_ids",
                    )
                )
            )
        elif self.running:
            # invalid call the manager must reject the same way
            p.call("allocate_slots", rid=rng.choice(self.running), n=0, expect_raise=True)

    # ----------------------------------------------------------------- main loop
    def run(self) -> None:
        cfg, rng, p = self.cfg, self.rng, self.p
        guard = 0
        while p.ncalls < cfg.num_ops:
            guard += 1
            if guard > cfg.num_ops * 50:
                raise HarnessError(f"generator made no progress (seed={p.seed})")
            active = len(self.waiting) + len(self.running) + len(self.remote)
            r = rng.random()
            if active == 0 or (r < 0.14 and len(self.waiting) < 6):
                self.add_requests(rng.randint(1, 3))
            elif r < 0.66:
                self.schedule_step()
            elif r < 0.70:
                self.abort_random()
            elif r < 0.74:
                if self.running:
                    self.preempt(rng.choice(self.running))
            elif r < 0.78:
                if self.remote and (not self.parked or rng.random() < 0.5):
                    self.complete_remote()
                elif self.parked:
                    self.resume_session()
            elif r < 0.81:
                if self.deferred:
                    self.flush_deferred(rng.randint(1, len(self.deferred)))
            elif r < 0.83:
                self.reset()
            elif r < 0.84:
                self.evict()
            elif r < 0.85:
                self.connector_blocks()
            elif r < 0.86:
                self.invalid_blocks()
            elif r < 0.96:
                self.probe()
            elif r < 0.98:
                p.call("make_prefix_cache_stats")
            else:
                p.call("take_events")
        self.finalize()

    def finalize(self) -> None:
        p = self.p
        for rid in list(self.running) + list(self.remote) + list(self.waiting) + list(self.parked):
            self.finish(rid, "FINISHED_ABORTED")
        self.flush_deferred()
        for key in self.pins:
            p.call("block_pool.free_blocks", key=key)
        self.pins.clear()
        p.check_state(deep=True)
        p.call("take_events")
        p.call("make_prefix_cache_stats")
        p.call("reset_prefix_cache")
        p.call("take_events")
        p.check_state(deep=True)


# --------------------------------------------------------------------------------------------
# public entry points


def run_trace(
    seed: int,
    cfg: TraceConfig | None = None,
    candidate: type | str | None = None,
    *,
    num_ops: int | None = None,
    cand_hasher_factory: Callable | None = None,
) -> dict:
    """Generate and run one trace; raise ``Divergence`` on the first difference.

    Returns a small summary (calls made, actions, feature counters) for coverage checks."""
    if cfg is None:
        cfg = config_for_seed(seed)
    if num_ops is not None:
        cfg = dataclasses.replace(cfg, num_ops=num_ops)
    if candidate is None or isinstance(candidate, str):
        candidate = load_candidate(candidate)
    pair = _Pair(cfg, candidate, seed, cand_hasher_factory)
    gen = _Generator(pair, random.Random(seed))
    gen.run()
    return summarize(pair.actions) | pair.stats | {"calls": pair.ncalls}


def _outcome(method: str, raw: Any) -> Any:
    """The part of a reference answer that steers the generator's later decisions."""
    if method == "allocate_slots":
        return raw is None
    if method in ("get_computed_blocks", "get_computed_blocks_for_connector"):
        return raw[1]
    if method == "reset_prefix_cache":
        return raw
    return None


def replay(
    actions: Sequence[list],
    cfg: TraceConfig,
    candidate: type | str | None = None,
    *,
    seed: Any = "replay",
    expect: Sequence[Any] | None = None,
    cand_hasher_factory: Callable | None = None,
) -> int:
    """Re-execute recorded actions on a fresh pair; raise ``Divergence`` on a difference.

    With ``expect`` (the recorded reference decisions, see ``Divergence.outcomes``) a replay
    whose reference decides differently (an allocation now fits, a hit got longer...) raises
    ``HarnessError``: shrinking uses this to keep only realistic traces."""
    if candidate is None or isinstance(candidate, str):
        candidate = load_candidate(candidate)
    pair = _Pair(cfg, candidate, seed, cand_hasher_factory)
    pair.expect = expect
    for action in actions:
        pair.do(action)
    pair.check_state(deep=True)
    return pair.ncalls


def _rid_of(action: list) -> str | None:
    if action[0] == "new":
        return action[1]["rid"]
    if action[0] in ("set", "append", "rehash", "session_update"):
        return action[1]
    return action[2].get("rid")


# calls that can be dropped on their own without making the rest of a trace unrealistic
_DROPPABLE = frozenset(
    {
        "take_events",
        "make_prefix_cache_stats",
        "new_step_starts",
        "take_new_block_ids",
        "usage",
        "take_kv_cache_block_copies",
        "take_boundary_state_offloads",
        "get_block_ids",
        "get_blocks",
        "get_block_ids_for_computed_tokens",
        "get_num_common_prefix_blocks",
        "estimate_cached_tokens",
        "prefix_cache_lookup_enabled",
        "truncate_computed_blocks",
        "remove_skipped_blocks",
        "finalize_partial_tail_offloads",
        "reset_prefix_cache",
        "evict_blocks",
        "cache_blocks",
        "record_prefix_cache_stats",
    }
)


def shrink(
    err: Divergence,
    candidate: type | str | None = None,
    *,
    cand_hasher_factory: Callable | None = None,
    max_replays: int = 300,
) -> list[list]:
    """Shrink the actions of a Divergence to a short trace that diverges the same way.

    Units removed (ddmin): whole requests, and single calls that stand alone (stats, events,
    probes, resets, evictions, cache_blocks).  A trial is kept only if the reference makes
    the same decisions as in the original trace (allocation fits or not, hit lengths, reset
    results) and the candidate diverges with the same signature (method, check)."""
    assert err.actions is not None and err.config is not None and err.outcomes is not None
    if candidate is None or isinstance(candidate, str):
        candidate = load_candidate(candidate)
    cfg = dataclasses.replace(err.config, deep_every=1)
    actions, outcomes = err.actions, err.outcomes
    budget = [max_replays]

    def attempt(keep: list[int], signature: tuple | None) -> Divergence | None:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        try:
            replay(
                [actions[i] for i in keep],
                cfg,
                candidate,
                expect=[outcomes[i] for i in keep],
                cand_hasher_factory=cand_hasher_factory,
            )
        except Divergence as d:
            if signature is None or d.signature == signature:
                return d
        except Exception:
            return None
        return None

    keep = list(range(err.action_index + 1))
    first = attempt(keep, None)  # deep checks on every call may notice it earlier
    if first is None:
        return [actions[i] for i in keep]
    signature = first.signature
    keep = keep[: first.action_index + 1]

    def units_of(keep: list[int]) -> list[list[int]]:
        by_rid: dict[str, list[int]] = {}
        singles: list[list[int]] = []
        for i in keep[:-1]:
            a = actions[i]
            rid = _rid_of(a)
            if rid is not None:
                by_rid.setdefault(rid, []).append(i)
            if (a[0] == "call" and a[1] in _DROPPABLE) or (
                a[0] == "set" and a[2] == "spec_token_ids"
            ):
                singles.append([i])
        last_rid = _rid_of(actions[keep[-1]])
        req_units = [v for k, v in by_rid.items() if k != last_rid]
        return req_units + singles

    n = 2
    while budget[0] > 0:
        units = units_of(keep)
        if not units:
            break
        n = min(n, len(units))
        chunk = -(-len(units) // n)
        progressed = False
        for start in range(0, len(units), chunk):
            drop = {i for u in units[start : start + chunk] for i in u}
            trial = [i for i in keep if i not in drop]
            d = attempt(trial, signature)
            if d is not None:
                keep = trial[: d.action_index + 1]
                n = max(n - 1, 2)
                progressed = True
                break
        if not progressed:
            if chunk == 1:
                break
            n = min(len(units), n * 2)
    return [actions[i] for i in keep]


def minimize(
    err: Divergence,
    candidate: type | str | None = None,
    *,
    search_seeds: int = 60,
    cand_hasher_factory: Callable | None = None,
) -> tuple[list[list], Divergence]:
    """Find a short trace failing like ``err``: first look for another seed with the same
    configuration that diverges with the same (method, check) signature earlier, then
    ``shrink`` the shortest one found.  Returns (actions, that divergence)."""
    if candidate is None or isinstance(candidate, str):
        candidate = load_candidate(candidate)
    best = err
    cfg = err.config
    assert cfg is not None
    for num_ops in (25, 60, 150):
        if best.action_index < 40:
            break
        for seed in range(search_seeds):
            try:
                run_trace(
                    seed + 1_000_000,
                    dataclasses.replace(cfg, num_ops=num_ops),
                    candidate,
                    cand_hasher_factory=cand_hasher_factory,
                )
            except Divergence as d:
                if d.signature == err.signature and d.action_index < best.action_index:
                    best = d
            except HarnessError:
                continue
        if best is not err:
            break
    return shrink(best, candidate, cand_hasher_factory=cand_hasher_factory), best


def format_actions(actions: Sequence[list]) -> str:
    return "\n".join(f"  {render_action(a)}" for a in actions)


def summarize(actions: Sequence[list]) -> dict:
    """Feature counters of a trace (which paths it exercised)."""
    c: dict[str, int] = {}

    def bump(k: str) -> None:
        c[k] = c.get(k, 0) + 1

    for a in actions:
        if a[0] == "new":
            s = a[1]
            bump("requests")
            for k in REQUEST_FEATURES:
                if s.get(k):
                    bump(f"req_{k}")
        elif a[0] == "call":
            bump(a[1])
            kw = a[2].get("kw", {})
            if a[1] == "allocate_slots":
                if kw.get("num_external_computed_tokens"):
                    bump("alloc_external")
                if kw.get("delay_cache_blocks"):
                    bump("alloc_delayed")
                if a[2].get("hit") == "empty":
                    bump("alloc_after_remote")
        elif a[0] == "set" and a[2] == "status":
            bump(f"status_{a[3]}")
        elif a[0] == "set" and a[2] == "num_output_placeholders" and a[3]:
            bump("async_placeholder")
        elif a[0] in ("session_update", "rehash"):
            bump(a[0])
    return c


def dump_repro(path: str, cfg: TraceConfig, actions: Sequence[list]) -> None:
    with open(path, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "actions": list(actions)}, f)


def load_repro(path: str) -> tuple[TraceConfig, list[list]]:
    with open(path) as f:
        data = json.load(f)
    return TraceConfig(**data["config"]), data["actions"]
