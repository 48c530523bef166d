"""Test scaffolding (not shipped with hscache): who served the caches, from each engine process.

A ``vllm.general_plugins`` entry point, so it runs in every vLLM process, spawned stage
engines included. With ``HSCACHE_E2E_PROBE_DIR`` set it records each vLLM ``Scheduler``
and each hidden-state prefix cache (vllm-omni's ``OmniPrefixCacheManager`` or hscache's
``OmniHiddenStateCache``) built in the process, and a daemon thread rewrites
``<dir>/<pid>.json`` a few times a second: per scheduler its stage, class and KV-cache
manager class, how many requests it preempted, the most requests with one same prompt
it scheduled for the first time in one step and how many of those hit blocks (a
same-step twin's), the requests it aborted and the KV blocks they held then, its running
requests' computed tokens, unfinished requests and KV usage, its KV-cache groups and
vllm-omni's own prefix cache's verdict on them, and per request the wall-clock time
(``time.time()``, one clock for every process of the machine) it reached the scheduler
and the time of the ``update_from_output`` that gave it its first output token (what
``python -m hscache bench-omni-e2e`` reads as each stage's time to first token); per
prefix cache its class, KV-cache group and counters; and ``hscache.stats()``
(``HSCACHE_STATS=1``). Per scheduler also its speculative method and scheduling mode, and
the drafts it scheduled, accepted and rejected (:func:`_count_drafts`); for hscache's
schedulers whether the fast path is on and its ``fast_path_counts``. The ``schedule`` and
``update_from_output`` it watches are wrapped on each instance, so no class runs other
code than the code hscache's fast path checks it mirrors (a class-level wrapper would turn
the path off); with
``HSCACHE_E2E_ROWS_DIR`` set, the thinker rows each request hands the talker
(:func:`_watch_rows`). Stage processes end by
signal, so a periodic file is the record that survives them; the driver reads it after a
short wait.

It also *gates* arrivals, to make same-step cases deterministic: a prompt whose first
token is :data:`GATE_TOKEN` and second a count ``k`` is held back from the scheduler until
``k`` such prompts have arrived, then all are added at once (so they are scheduled in the
same step whatever the timing of their arrival; ``run_pipeline.py`` sends such groups).
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

INTERVAL_S = 0.2
_schedulers: list[weakref.ref[Any]] = []
_caches: list[weakref.ref[Any]] = []
_started = False
_preemptions: dict[int, int] = {}  # id(scheduler) -> requests it preempted
GATE_TOKEN = 999  # a gated prompt: [GATE_TOKEN, k, ...] (ids below make_model's fillers)
_gated: dict[tuple[int, int], list[Any]] = {}  # (id(scheduler), k) -> held requests
# id(scheduler) -> counters: same_step_max, same_step_hits, aborted, aborted_blocks
_counters: dict[int, dict[str, int]] = {}
_layouts: dict[int, dict[str, Any]] = {}  # id(scheduler) -> _kv_layout, made once
# id(scheduler) -> {request id: time.time()} at arrival / at its first output token
_arrived: dict[int, dict[str, float]] = {}
_first_token: dict[int, dict[str, float]] = {}


def _count(sched: Any, key: str, add: int = 0, at_least: int | None = None) -> None:
    counters = _counters.setdefault(id(sched), {})
    counters[key] = counters.get(key, 0) + add
    if at_least is not None:
        counters[key] = max(counters[key], at_least)


def _gate_arrivals(cls: type) -> None:
    original = cls.add_request
    if getattr(original, "hscache_probe", False):
        return

    def add_request(self: Any, request: Any) -> None:
        ids = list(getattr(request, "prompt_token_ids", None) or [])[:2]
        if len(ids) < 2 or ids[0] != GATE_TOKEN:
            return original(self, request)
        held = _gated.setdefault((id(self), ids[1]), [])
        held.append(request)
        if len(held) < ids[1]:
            return None
        del _gated[(id(self), ids[1])]
        for req in held:
            original(self, req)
        return None

    add_request.hscache_probe = True  # type: ignore[attr-defined]
    cls.add_request = add_request  # type: ignore[attr-defined]


def _watch_steps(sched: Any) -> None:
    """Counts same-prompt admissions from each step's output. On the instance, not the
    class: hscache's fast path checks that the scheduler's classes run the ``schedule``
    it mirrors (``hscache.vllm.mirror``), and a class-level wrapper would turn it off."""
    original = sched.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        groups: dict[tuple[int, ...], list[Any]] = {}
        for new in getattr(out, "scheduled_new_reqs", None) or []:
            if new.prompt_token_ids is not None:
                groups.setdefault(tuple(new.prompt_token_ids), []).append(new)
        for group in groups.values():
            _count(sched, "same_step_max", at_least=len(group))
            if len(group) > 1:
                _count(sched, "same_step_hits", sum(g.num_computed_tokens > 0 for g in group))
        return out

    sched.schedule = schedule


def _watch_arrivals(cls: type) -> None:
    """Records when each request reached the scheduler (``add_request``, after the gate
    let it through)."""
    original = cls.add_request

    def add_request(self: Any, request: Any) -> Any:
        _arrived.setdefault(id(self), {}).setdefault(str(request.request_id), time.time())
        return original(self, request)

    # Not marked ``hscache_probe``: the gate wraps this add_request in turn.
    cls.add_request = add_request  # type: ignore[attr-defined]


def _count_drafts(sched: Any, scheduler_output: Any, runner_output: Any) -> None:
    """Speculative decoding, read from a step's ``SchedulerOutput`` (the drafts scheduled)
    and its ``ModelRunnerOutput`` (the tokens sampled: one more than the drafts accepted):
    ``draft_tokens``, ``drafts_accepted``, ``drafts_rejected`` and ``draft_steps_with_
    rejection`` (requests' steps that rolled back over a rejected draft)."""
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    index = getattr(runner_output, "req_id_to_index", None) or {}
    sampled = getattr(runner_output, "sampled_token_ids", None) or []
    for req_id, tokens in drafts.items():
        i = index.get(req_id)
        if not tokens or i is None or i >= len(sampled) or not len(sampled[i]):
            continue
        accepted = min(len(sampled[i]) - 1, len(tokens))
        _count(sched, "draft_tokens", len(tokens))
        _count(sched, "drafts_accepted", accepted)
        _count(sched, "drafts_rejected", len(tokens) - accepted)
        _count(sched, "draft_steps_with_rejection", int(accepted < len(tokens)))


def _count_update_outputs(sched: Any, runner_output: Any) -> None:
    """``update_steps``: the ``update_from_output`` calls whose runner output sampled a
    token for some request; ``update_steps_stage_outputs``: those of them that also carry
    per-request multimodal or inter-stage outputs (vllm-omni's ``OmniModelRunnerOutput``:
    a stage handing hidden states on), steps hscache's omni update fast path leaves to
    vllm-omni's loop whole (``hscache.omni.fast``)."""
    sampled = getattr(runner_output, "sampled_token_ids", None) or []
    if not any(len(tokens) for tokens in sampled):
        return
    _count(sched, "update_steps", 1)
    if getattr(runner_output, "multimodal_outputs", None) or getattr(
        runner_output, "inter_stage_outputs", None
    ):
        _count(sched, "update_steps_stage_outputs", 1)
    if getattr(sched, "fast_step", False):
        # hscache's own step-level verdicts, taken before the call changes the state
        from hscache.omni import fast as omni_fast
        from hscache.vllm.step import update as vllm_update

        if not vllm_update._update_applies(sched, runner_output):
            _count(sched, "update_steps_declined_vllm", 1)
        elif type(sched).__module__ == "hscache.omni.scheduler" and not (
            omni_fast._omni_applies(sched, runner_output)
        ):
            _count(sched, "update_steps_declined_omni", 1)


def safe_name(request_id: str) -> str:
    """A request id as a file name (vLLM's engine may add a suffix to the driver's id:
    the driver matches by prefix)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in request_id)


def _watch_rows(directory: Path) -> None:
    """Keeps the thinker rows handed to the talker: vllm-omni's producer-side payload builder
    for qwen2_5_omni (``thinker2talker_full_payload``) gets each finished request's
    accumulated rows (``pooling_output["hidden"]``, prompt and decode steps in order, before
    the builder trims what exceeds the request's token count); each
    is saved as ``<directory>/<request id>.pt`` (float32, on the host; the request's
    external id where it has one)."""
    try:
        from vllm_omni.model_executor.stage_input_processors import qwen2_5_omni
    except ImportError:
        return
    original = qwen2_5_omni.thinker2talker_full_payload
    if getattr(original, "hscache_probe", False):
        return

    def thinker2talker_full_payload(
        transfer_manager: Any, pooling_output: Any, request: Any
    ) -> Any:
        hidden = pooling_output.get("hidden") if isinstance(pooling_output, dict) else None
        # The runner's CachedRequestState names its request ``req_id``.
        rid = str(
            getattr(request, "external_req_id", None)
            or getattr(request, "req_id", None)
            or getattr(request, "request_id", None)
            or ""
        )
        if hidden is not None and rid:
            import torch

            directory.mkdir(parents=True, exist_ok=True)
            torch.save(
                hidden.detach().to("cpu", torch.float32).clone(), directory / f"{safe_name(rid)}.pt"
            )
        return original(transfer_manager, pooling_output, request)

    thinker2talker_full_payload.hscache_probe = True  # type: ignore[attr-defined]
    qwen2_5_omni.thinker2talker_full_payload = thinker2talker_full_payload


def _watch_first_tokens(sched: Any) -> None:
    """Records when an ``update_from_output`` first gave a request an output token (read
    from the request objects before and after the call: a request finished by that very
    token has left ``self.requests`` by then), and counts the step's drafts. One wrapper
    on the instance, around whatever class's ``update_from_output`` the engine calls
    (vllm-omni's ``OmniARScheduler`` defines its own without calling vLLM's): a
    class-level one would replace the code hscache's fast path checks it mirrors
    (``hscache.vllm.mirror``, ``hscache.omni.mirror``) and turn the path off."""
    original = sched.update_from_output

    def update_from_output(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        seen = _first_token.setdefault(id(sched), {})
        waiting = [
            req
            for req_id in getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            if req_id not in seen and (req := sched.requests.get(req_id)) is not None
        ]
        runner_output = args[0] if args else kwargs.get("model_runner_output")
        if runner_output is not None:
            _count_drafts(sched, scheduler_output, runner_output)
            _count_update_outputs(sched, runner_output)
        out = original(scheduler_output, *args, **kwargs)
        now = time.time()
        for req in waiting:
            if req.num_output_tokens > 0:
                seen.setdefault(str(req.request_id), now)
        return out

    sched.update_from_output = update_from_output


def _watch_aborts(cls: type) -> None:
    original = cls.finish_requests
    if getattr(original, "hscache_probe", False):
        return

    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        aborted = getattr(finished_status, "name", "") == "FINISHED_ABORTED"
        if aborted and request_ids is not None:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            for req_id in ids:
                request = self.requests.get(req_id)
                if request is None or request.is_finished():
                    continue
                _count(self, "aborted", 1)
                if request in self.running:
                    blocks = self.kv_cache_manager.get_block_ids(req_id)
                    _count(self, "aborted_blocks", sum(len(b) for b in blocks))
            return original(self, ids, finished_status)
        return original(self, request_ids, finished_status)

    finish_requests.hscache_probe = True  # type: ignore[attr-defined]
    cls.finish_requests = finish_requests  # type: ignore[attr-defined]


def _record_instances(cls: type, into: list[weakref.ref[Any]]) -> None:
    original = cls.__init__
    if getattr(original, "hscache_probe", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        into.append(weakref.ref(self))
        if into is _schedulers:
            _watch_steps(self)
            _watch_first_tokens(self)

    init.hscache_probe = True  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[misc]


def _count_preemptions(cls: type) -> None:
    original = getattr(cls, "_preempt_request", None)
    if original is None or getattr(original, "hscache_probe", False):
        return

    def preempt(self: Any, *args: Any, **kwargs: Any) -> Any:
        _preemptions[id(self)] = _preemptions.get(id(self), 0) + 1
        return original(self, *args, **kwargs)

    preempt.hscache_probe = True  # type: ignore[attr-defined]
    cls._preempt_request = preempt  # type: ignore[attr-defined]


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _kv_layout(sched: Any) -> dict[str, Any]:
    """The scheduler's KV-cache groups (spec class, block size, window) and what vllm-omni's
    own prefix cache says of them: its check at KV-cache init
    (``check_prefix_cache_kv_groups``, the original where hscache's switch replaced it),
    ``"accepted"`` or the refusal's message."""
    groups = list(getattr(getattr(sched, "kv_cache_config", None), "kv_cache_groups", ()))
    out: dict[str, Any] = {
        "kv_cache_groups": [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": int(g.kv_cache_spec.block_size),
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                "layers": list(g.layer_names),
            }
            for g in groups
        ]
    }
    try:
        from vllm_omni.core.prefix_cache import group_view
    except ImportError:
        return out
    check = group_view.check_prefix_cache_kv_groups
    check = getattr(check, "hscache_original", check)
    try:
        check(groups)
        out["omni_prefix_cache_check"] = "accepted"
    except Exception as exc:  # vllm-omni's refusal is the record
        out["omni_prefix_cache_check"] = f"{type(exc).__name__}: {exc}"
    return out


def _cache_report(cache: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": _name(cache)}
    if hasattr(cache, "_kv_cache_group"):  # hscache's: the group whose tables it follows
        out["kv_cache_group"] = int(cache._kv_cache_group)
    inner = getattr(cache, "cache", None)  # hscache's HiddenStateCache, once built
    if inner is not None and callable(getattr(inner, "stats", None)):
        out["stats"] = {k: int(v) for k, v in inner.stats().items()}
    return out


def snapshot() -> dict[str, Any]:
    """This process's record (what the daemon thread writes)."""
    schedulers = []
    for ref in list(_schedulers):
        sched = ref()
        if sched is None:
            continue
        model_config = sched.vllm_config.model_config
        manager = sched.kv_cache_manager
        schedulers.append(
            {
                "stage": getattr(model_config, "model_stage", None),
                "scheduler": _name(sched),
                "kv_cache_manager": _name(manager),
                "enable_caching": bool(getattr(manager, "enable_caching", False)),
                "preemptions": _preemptions.get(id(sched), 0),
                **_counters.get(id(sched), {}),
                "running": {r.request_id: r.num_computed_tokens for r in list(sched.running)},
                "unfinished": sched.get_num_unfinished_requests(),
                "kv_usage": float(getattr(manager, "usage", -1.0)),
                "speculative_method": getattr(sched.vllm_config.speculative_config, "method", None),
                "async_scheduling": bool(
                    getattr(sched.vllm_config.scheduler_config, "async_scheduling", False)
                ),
                # hscache's schedulers: whether the fast path is on, and what it served
                "fast_step": getattr(sched, "fast_step", None),
                "fast_path_counts": dict(getattr(sched, "fast_path_counts", None) or {}),
                "kv_transfer_criteria": bool(getattr(sched, "kv_transfer_criteria", None)),
                "arrived_at": dict(_arrived.get(id(sched), {})),
                "first_token_at": dict(_first_token.get(id(sched), {})),
                **_layouts.setdefault(id(sched), _kv_layout(sched)),
            }
        )
    caches = [_cache_report(c) for c in (r() for r in list(_caches)) if c is not None]
    out: dict[str, Any] = {"pid": os.getpid(), "schedulers": schedulers, "prefix_caches": caches}
    try:
        import hscache

        out["hscache_stats"] = {
            op: {k: float(v) for k, v in vals.items() if isinstance(v, (int, float))}
            for op, vals in hscache.stats().items()
        }
    except Exception as exc:  # hscache absent or not built: say so in the record
        out["hscache_stats_error"] = repr(exc)
    return out


def _write_forever(directory: Path) -> None:
    path = directory / f"{os.getpid()}.json"
    tmp = directory / f".{os.getpid()}.json.tmp"
    while True:
        time.sleep(INTERVAL_S)
        record = snapshot()
        if not record["schedulers"] and not record["prefix_caches"]:
            continue
        tmp.write_text(json.dumps(record, sort_keys=True))
        tmp.replace(path)


def register() -> None:
    """The plugin: with ``HSCACHE_OMNI_CPU=1``, Qwen2 layers get their own sliding window
    (:mod:`hscache_omni_cpu.hybrid`); with ``HSCACHE_E2E_THINKER_SPEC``, the thinker drafts
    (:mod:`hscache_omni_cpu.drafting`); the probe does nothing unless ``HSCACHE_E2E_PROBE_DIR``
    is set; idempotent."""
    global _started
    if os.environ.get("HSCACHE_OMNI_CPU") == "1":
        from hscache_omni_cpu import hybrid

        hybrid.install()
    if os.environ.get("HSCACHE_E2E_THINKER_SPEC"):
        from hscache_omni_cpu import drafting

        drafting.install()
    directory = os.environ.get("HSCACHE_E2E_PROBE_DIR")
    if not directory or _started:
        return
    _started = True
    rows = os.environ.get("HSCACHE_E2E_ROWS_DIR")
    if rows:
        _watch_rows(Path(rows))
    from vllm.v1.core.sched.scheduler import Scheduler

    _record_instances(Scheduler, _schedulers)
    _count_preemptions(Scheduler)
    _watch_arrivals(Scheduler)  # inside the gate: arrival is when the gate lets it in
    _gate_arrivals(Scheduler)
    _watch_aborts(Scheduler)
    try:
        from vllm_omni.core.prefix_cache.manager import OmniPrefixCacheManager

        _record_instances(OmniPrefixCacheManager, _caches)
    except ImportError:
        pass
    try:
        from hscache.omni.prefix_cache import OmniHiddenStateCache

        _record_instances(OmniHiddenStateCache, _caches)
    except ImportError:
        pass
    Path(directory).mkdir(parents=True, exist_ok=True)
    threading.Thread(
        target=_write_forever, args=(Path(directory),), name="hscache-e2e-probe", daemon=True
    ).start()
