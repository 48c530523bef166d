"""Test scaffolding (not shipped with hscache): who served the caches, from each engine process.

A ``vllm.general_plugins`` entry point, so it runs in every vLLM process, spawned stage
engines included. With ``HSCACHE_E2E_PROBE_DIR`` set it records each vLLM ``Scheduler``
and each hidden-state prefix cache (vllm-omni's ``OmniPrefixCacheManager`` or hscache's
``OmniHiddenStateCache``) built in the process, and a daemon thread rewrites
``<dir>/<pid>.json`` a few times a second: per scheduler its stage, class and KV-cache
manager class and how many requests it preempted; per prefix cache its class and
counters; and ``hscache.stats()``
(``HSCACHE_STATS=1``). Stage processes end by signal, so a periodic file is the record
that survives them; the driver reads it after a short wait.
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


def _record_instances(cls: type, into: list[weakref.ref[Any]]) -> None:
    original = cls.__init__
    if getattr(original, "hscache_probe", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        into.append(weakref.ref(self))

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


def _cache_report(cache: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": _name(cache)}
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
    """The plugin: does nothing unless ``HSCACHE_E2E_PROBE_DIR`` is set; idempotent."""
    global _started
    directory = os.environ.get("HSCACHE_E2E_PROBE_DIR")
    if not directory or _started:
        return
    _started = True
    from vllm.v1.core.sched.scheduler import Scheduler

    _record_instances(Scheduler, _schedulers)
    _count_preemptions(Scheduler)
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
