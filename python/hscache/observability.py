"""``hscache.stats()``: what the drop-in reports about itself.

Owns the one function that gathers it: the core's per-operation latency counters
(``hscache._core.stats``, on with ``enable_stats()`` or ``HSCACHE_STATS=1``) and, when a
live manager has explain mode on, its summary under ``"explain"``
(:func:`hscache.explanations.summary`: explained lookups by reason, remembered
requests; each request's own record is ``hscache.explain(request_id)``). Also the build it
runs: :func:`core_build_info` (the compiled core's version and build profile, stamped on
the benchmarks' results) and :func:`print_build_info` (``python -m hscache info``).
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

from hscache._core import stats as _core_stats
from hscache.explanations import summary

__all__ = ["core_build_info", "print_build_info", "stats"]


def stats() -> dict[str, dict[str, Any]]:
    """Per-operation call counts, total time and p50/p90/p99 latencies of the drop-in
    (empty unless ``enable_stats()``), plus ``"explain"`` when explain mode is on
    somewhere: ``{"lookups": {reason: count}, "requests": n}``."""
    out: dict[str, dict[str, Any]] = dict(_core_stats())
    explained = summary()
    if explained is not None:
        out["explain"] = explained
    return out


def core_build_info() -> dict[str, str | None]:
    """``hscache._core``'s version and build profile, each None when unavailable."""
    info: dict[str, str | None] = {"version": None, "build_profile": None, "core_error": None}
    try:
        import hscache._core as core
    except ImportError as exc:
        info["core_error"] = str(exc)
        return info
    for key, attr in (("version", "__version__"), ("build_profile", "build_profile")):
        value: Any = getattr(core, attr, None)
        if callable(value):
            value = value()
        info[key] = None if value is None else str(value)
    return info


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def print_build_info() -> int:
    """Print the version, build profile and location of hscache (and vLLM's version)."""
    core = core_build_info()
    version = core["version"] or _dist_version("hscache") or "unknown"
    print(f"hscache {version}")
    print(f"build profile: {core['build_profile'] or 'unknown'}")
    if core["core_error"]:
        print(f"hscache._core: not importable ({core['core_error']})")
    else:
        import hscache._core

        print(f"hscache._core: {getattr(hscache._core, '__file__', '?')}")
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    print(f"vllm: {_dist_version('vllm') or 'not installed'}")
    profile = core["build_profile"]
    if profile is not None and "debug" in profile.lower():
        print("WARNING: this is a DEBUG build; do not benchmark it.")
    return 0
