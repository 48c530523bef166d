"""One side of a differential trace: a manager, its own ``Request`` objects, and how an
action is executed on it, its answers normalised and its state observed.

:class:`Side` turns each action (see :mod:`.actions`) into the calls vLLM's Scheduler, its
connectors or ``EngineCore`` would make, on one manager (vLLM's reference or the candidate),
with that side's own ``Request`` objects (built by :func:`build_request` from the trace's
request specs through :mod:`hscache_tools.testing.requests`). :meth:`Side.norm_result` reduces an
answer to plain comparable data (block ids, identities, stats fields, msgpack-encoded
events); :meth:`Side.observe` reads the state compared after every call: pool, free queue,
every group's block tables and cached-block counts, and periodically every block, the
prefix-cache index, each group's Mamba bookkeeping and the block-metrics calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
from hscache_tools.testing.requests import lora, make_request, mm_feature
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from .config import (
    HAS_HASH_LOOKAHEAD,
    HAS_PREFILL_END,
    HAS_SKIP_ZEROING,
    ReferenceKVCacheManager,
    TraceConfig,
    manager_kwargs,
)
from .errors import HarnessError

_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(PrefixCacheStats))


def build_request(spec: dict, hasher: Callable | None) -> Request:
    """A side's own ``Request`` for a trace's request spec (the ``"new"`` action)."""
    prompt: list[int] | None = list(spec["prompt"])
    embeds = None
    if spec.get("embeds_seed") is not None:
        gen = torch.Generator().manual_seed(spec["embeds_seed"])
        embeds = torch.randn(len(spec["prompt"]), 2, generator=gen)
        prompt = None
    return make_request(
        spec["rid"],
        prompt,
        max_tokens=spec["max_tokens"],
        block_hasher=hasher,
        mm_features=[
            mm_feature(ident, offset, length, modality)
            for modality, ident, offset, length in spec.get("mm") or ()
        ],
        lora_request=lora(*spec["lora"]) if spec.get("lora") else None,
        cache_salt=spec.get("salt"),
        prompt_logprobs=1 if spec.get("logprobs") else None,
        kv_cache_report_full=bool(spec.get("report_full")),
        prompt_embeds=embeds,
        arrival_time=float(spec.get("arrival", 0.0)),
        resumable=bool(spec.get("resumable")),
        session_id=spec.get("session"),
    )


class RecordingMetricsCollector(KVCacheMetricsCollector):
    """vLLM's ``KVCacheMetricsCollector`` that also records every call it gets, in order:
    the two sides' records must be equal (residency times are wall-clock, so only the
    calls, the sampled blocks and the shape of the drained events are compared)."""

    def __init__(self, sample_rate: float):
        super().__init__(sample_rate)
        self.calls: list[tuple[str, int]] = []

    def on_block_allocated(self, block: Any) -> None:
        self.calls.append(("allocated", block.block_id))
        super().on_block_allocated(block)

    def on_block_accessed(self, block: Any) -> None:
        self.calls.append(("accessed", block.block_id))
        super().on_block_accessed(block)

    def on_block_evicted(self, block: Any) -> None:
        self.calls.append(("evicted", block.block_id))
        super().on_block_evicted(block)

    def reset(self) -> None:
        self.calls.append(("reset", -1))
        super().reset()

    def observe(self) -> tuple:
        calls, self.calls = self.calls, []
        events = self.drain_events()
        return (
            tuple(calls),
            tuple(sorted((k, len(v.access_history)) for k, v in self.block_metrics.items())),
            tuple(len(e.reuse_gaps_seconds) for e in events),
        )


def _norm_stats(x: Any) -> Any:
    if x is None:
        return None
    return ("PrefixCacheStats", tuple((f, getattr(x, f, "<missing>")) for f in _STATS_FIELDS))


def _index(pool: Any) -> list:
    """The prefix-cache index: key -> its blocks in insertion order (the first is what a
    lookup returns). Whether vLLM's dict holds one block bare or in a one-entry dict is
    not compared: vLLM keeps a key promoted to a dict after its duplicates are evicted,
    hscache's view shows a single block bare (no decision depends on it)."""
    out = []
    for key, value in pool.cached_block_hash_to_block._cache.items():
        blocks = value.values() if isinstance(value, dict) else (value,)
        out.append((key, tuple(b.block_id for b in blocks)))
    return sorted(out)


def _mamba_state(stm: Any) -> tuple:
    """An align-mode Mamba manager's per-request bookkeeping."""
    return (
        sorted(stm._checkpoints.items()),
        sorted(stm.last_state_block_idx.items()),
        sorted(stm._allocated_block_reqs),
    )


def _is_kv_blocks(x: Any) -> bool:
    return hasattr(x, "blocks") and hasattr(x, "get_block_ids") and not isinstance(x, type)


class Side:
    """One manager plus its own Request objects and side-local handles."""

    def __init__(
        self, name: str, cls: type, cfg: TraceConfig, hasher_factory: Callable | None = None
    ):
        self.name = name
        self.cfg = cfg
        kwargs = manager_kwargs(cfg)
        self.metrics: RecordingMetricsCollector | None = None
        if cfg.metrics:
            self.metrics = RecordingMetricsCollector(cfg.metrics)
            kwargs["metrics_collector"] = self.metrics
        self.mgr = cls(**kwargs)
        if name == "cand" and cls is not ReferenceKVCacheManager:
            # A constructor fall-back to vLLM's manager would compare vLLM with itself.
            if type(self.mgr) is ReferenceKVCacheManager:
                raise RuntimeError(f"the candidate fell back to vLLM's manager for {cfg}")
            # hscache checks every invariant after every call (HSCACHE_CHECK_INVARIANTS):
            # a broken one raises InvariantError at the call that broke it.
            if hasattr(self.mgr, "check_invariants_after_ops"):
                self.mgr.check_invariants_after_ops = True
        factory = hasher_factory or get_request_block_hasher
        lookahead = (cfg.hash_lookahead,) if HAS_HASH_LOOKAHEAD else ()
        self.hasher = factory(cfg.hash_block, get_hash_fn_by_name(cfg.hash_fn), *lookahead)
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
            del s.block_hashes[keep_end // self.cfg.hash_block :]
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
                if HAS_SKIP_ZEROING:
                    kw["skip_zeroing_group_ids"] = tuple(kw["skip_zeroing_group_ids"])
                else:  # vLLM 0.30: no such keyword (nothing skips zeroing)
                    del kw["skip_zeroing_group_ids"]
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
            copies, retained = mgr.take_kv_cache_block_copies()
            if "key" in a:  # the Scheduler frees the retained endpoints (now or deferred)
                self.popped[a["key"]] = list(retained)
            return copies, retained
        if method == "take_boundary_state_offloads":
            return mgr.take_boundary_state_offloads()
        if method == "prefix_cache_lookup_enabled":
            return mgr.prefix_cache_lookup_enabled(req)
        if method == "block_pool.get_cached_block":
            return mgr.block_pool.get_cached_block(req.block_hashes[a["i"]], a.get("gids", [0]))
        if method == "block_pool.is_block_writable":
            return mgr.block_pool.is_block_writable(mgr.block_pool.blocks[a["id"]])
        if method == "block_pool.touch":  # a connector pins cached blocks
            pool = mgr.block_pool
            gids = a.get("gids", [0])
            blocks = [pool.get_cached_block(req.block_hashes[i], gids)[0] for i in a["idx"]]
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
                **(
                    {"prefill_end": max(req.num_prompt_tokens, req.num_tokens - 1)}
                    if HAS_PREFILL_END
                    else {}
                ),
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
        return observe_manager(
            self.mgr,
            live=live,
            deep=deep,
            requests=self.reqs,
            check_free_queue=self.cfg.check_free_queue,
            metrics=self.metrics,
        )


def observe_manager(
    mgr: Any,
    *,
    live: Sequence[str],
    deep: bool,
    requests: dict[str, Request],
    check_free_queue: bool = True,
    metrics: RecordingMetricsCollector | None = None,
) -> list[tuple[str, Any]]:
    """The state of one manager compared after every call (``deep``: periodically):
    ``(label, value)`` pairs, a raised exception standing for its value. ``live`` are the
    requests holding blocks, ``requests`` their ``Request`` objects."""
    obs: list[tuple[str, Any]] = []

    def probe(label: str, fn: Callable[[], Any]) -> None:
        try:
            obs.append((label, fn()))
        except Exception as exc:  # a missing attribute is a divergence too
            obs.append((label, ("raise", type(exc).__name__, str(exc)[:200])))

    pool = mgr.block_pool
    probe("block_pool.get_num_free_blocks()", pool.get_num_free_blocks)
    probe("usage", lambda: mgr.usage)
    if check_free_queue:
        probe(
            "free_block_queue order",
            lambda: [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        )
    for rid in live:
        probe(
            f"get_block_ids({rid!r})",
            lambda rid=rid: tuple(list(g) for g in mgr.get_block_ids(rid)),
        )
    managers = mgr.coordinator.single_type_managers
    for g, stm in enumerate(managers):
        # every group's tables (empty ones aside: vLLM's defaultdict may hold some)
        probe(
            f"coordinator.single_type_managers[{g}].req_to_blocks",
            lambda stm=stm: sorted(
                (rid, [b.block_id for b in blocks])
                for rid, blocks in stm.req_to_blocks.items()
                if blocks
            ),
        )
        probe(
            f"coordinator.single_type_managers[{g}].num_cached_block",
            lambda stm=stm: sorted(stm.num_cached_block.items()),
        )
    if metrics is not None:
        probe("metrics collector (calls, sampled blocks, drained events)", metrics.observe)
    # 0 on vLLM 0.33; vLLM 0.32's touch / free_blocks count references on it.
    probe("block_pool.null_block.ref_cnt", lambda: pool.null_block.ref_cnt)
    if deep:
        probe(
            "block_pool.blocks[*].(ref_cnt, block_hash, hash_num_tokens, is_null)",
            lambda: [
                (
                    b.block_id,
                    b.ref_cnt,  # the null block's too (vLLM 0.32 counts it)
                    b.block_hash,
                    b.block_hash_num_tokens,
                    b.is_null,
                )
                for b in pool.blocks
            ],
        )
        probe("free_block_queue.num_free_blocks", lambda: pool.free_block_queue.num_free_blocks)
        probe("prefix_cache_stats (running)", lambda: _norm_stats(mgr.prefix_cache_stats))
        for rid in live:
            probe(
                f"estimate_cached_tokens({rid!r})",
                lambda rid=rid: mgr.estimate_cached_tokens(requests[rid]),
            )
        probe("cached_block_hash_to_block._cache", lambda: _index(pool))
        probe(
            "cached_block_hashes_by_block",
            lambda: sorted(
                (bid, sorted(keys)) for bid, keys in pool.cached_block_hashes_by_block.items()
            ),
        )
        for g, stm in enumerate(managers):
            probe(
                f"coordinator.single_type_managers[{g}]._partial_hit_reqs",
                lambda stm=stm: sorted(
                    (rid, idx, b.block_id) for rid, (idx, b) in stm._partial_hit_reqs.items()
                ),
            )
            if getattr(stm.kv_cache_spec, "mamba_cache_mode", None) == "align":
                probe(f"mamba[{g}] state", lambda stm=stm: _mamba_state(stm))
            if hasattr(stm.kv_cache_spec, "mamba_cache_mode"):
                probe(
                    f"mamba[{g}].cached_blocks_this_step",
                    lambda stm=stm: sorted(stm.cached_blocks_this_step),
                )
        # hscache's core can verify its own invariants: a failure is reported as a
        # divergence (vLLM's manager has no such hook and reports None)
        check = getattr(mgr, "check_invariants", None)
        probe(
            "internal invariants (check_invariants())",
            lambda: check() if callable(check) else None,
        )
    return obs
