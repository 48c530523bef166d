"""Both sides of a differential trace in lock-step: every action executed on each, every
answer and the observable state compared, the first difference raised as a ``Divergence``.

After every manager call :class:`Pair` compares the return values and the observable state
(free-block count, usage, free-queue order, block tables of live requests, KV events,
periodically every block's ref count / hash and the running prefix-cache stats). The
reference's answers steer the generator only after they were found equal to the candidate's;
the reference's decisions are recorded per action (:func:`outcome`) so that a replay can
check it still follows the same path (shrinking keeps only realistic traces).
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.request import Request

from . import exceptions
from .actions import render_action
from .config import MAMBA_PREFIX_ATTR, ReferenceKVCacheManager, TraceConfig
from .errors import Divergence, HarnessError
from .side import Side


def outcome(method: str, raw: Any) -> Any:
    """The part of a reference answer that steers the generator's later decisions."""
    if method == "allocate_slots":
        return raw is None
    if method in ("get_computed_blocks", "get_computed_blocks_for_connector"):
        return raw[1]
    if method == "reset_prefix_cache":
        return raw
    return None


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


class Pair:
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
                if raw[1] % self.cfg.sched_block:
                    self._bump("partial_hit")  # ends inside a scheduler block
            else:
                self._bump("lookup_miss")
            if raw[2]:
                self._bump("shared_prefix_boundary")
            if method == "get_computed_blocks_for_connector" and raw[3]:
                self._bump("hit_diverged")
        elif method == "take_boundary_state_offloads" and raw:
            self._bump("boundary_offloads", sum(len(v) for v in raw.values()))
        elif method == "finalize_partial_tail_offloads" and raw:
            self._bump("partial_tail_offloads", len(raw))
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
            # vLLM's KVCacheMetricsCollector samples blocks with the global `random`:
            # both sides draw from the same stream
            random.seed(len(self.actions))
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
        decision = outcome(method, raws[0]) if ref_out[0] == "ok" else "raise"
        self.outcomes.append(decision)
        if self.expect is not None and self.expect[len(self.actions) - 1] != decision:
            raise HarnessError(
                f"replay deviates from the recorded trace at action#{len(self.actions) - 1}"
            )
        if ref_out[0] == "raise" and not expect_raise:
            exc = raws[0]
            bug = exceptions.match(action, exc, self)
            if bug is not None:
                self._bump(f"vllm_exception:{bug.name}")
                where = (
                    f"vLLM raised {exc!r} on action#{len(self.actions) - 1} "
                    f"{render_action(action)} (seed={self.seed}): known vLLM bug {bug.name!r}"
                )
                if tuple(cand_out[: len(bug.candidate_outcome)]) != bug.candidate_outcome:
                    self._diverge(
                        f"hscache's documented behaviour in vLLM bug {bug.name!r}",
                        bug.candidate_outcome,
                        cand_out,
                    )
                raise exceptions.KnownVllmException(bug, where)
            raise HarnessError(
                f"reference raised on action#{len(self.actions) - 1} "
                f"{render_action(action)} (seed={self.seed}): {exc!r}\n"
                f"  candidate: {_fmt(cand_out, 600)}\n"
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
            (MAMBA_PREFIX_ATTR, lambda m: getattr(m, MAMBA_PREFIX_ATTR)),
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
            ("coordinator.scheduler_block_size", lambda m: m.coordinator.scheduler_block_size),
            (
                "coordinator.hash_block_size (hybrid)",
                lambda m: (
                    m.coordinator.hash_block_size
                    if type(m.coordinator).__name__ == "HybridKVCacheCoordinator"
                    else "<not hybrid>"
                ),
            ),
            ("coordinator.retention_interval", lambda m: m.coordinator.retention_interval),
            ("type(coordinator).__name__", lambda m: type(m.coordinator).__name__),
            (
                "coordinator.full_attention_group_id",
                lambda m: getattr(m.coordinator, "full_attention_group_id", "<none>"),
            ),
            (
                "coordinator.attention_groups",
                lambda m: [
                    (g.group_ids, g.manager_cls.__name__, g.use_eagle)
                    for g in getattr(m.coordinator, "attention_groups", ())
                ],
            ),
            (
                "coordinator.single_type_managers[*].(class, block_size, spec, group id, "
                "records_new_block_ids, use_eagle, cache_hit_alignment_tokens)",
                lambda m: [
                    (
                        type(stm).__name__,
                        stm.block_size,
                        stm.kv_cache_spec,
                        stm.kv_cache_group_id,
                        stm.records_new_block_ids,
                        stm.use_eagle,
                        stm.cache_hit_alignment_tokens,
                    )
                    for stm in m.coordinator.single_type_managers
                ],
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
