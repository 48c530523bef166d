"""``hscache.stats()``: what the drop-in reports about itself.

Owns the one function that gathers it: the core's per-operation latency counters
(``hscache._core.stats``, on with ``enable_stats()`` or ``HSCACHE_STATS=1``) and, when a
live manager has explain mode on, its summary under ``"explain"``
(:func:`hscache.explanations.summary`: explained lookups by reason, remembered
requests; each request's own record is ``hscache.explain(request_id)``).
"""

from __future__ import annotations

from typing import Any

from hscache._core import stats as _core_stats
from hscache.explanations import summary

__all__ = ["stats"]


def stats() -> dict[str, dict[str, Any]]:
    """Per-operation call counts, total time and p50/p90/p99 latencies of the drop-in
    (empty unless ``enable_stats()``), plus ``"explain"`` when explain mode is on
    somewhere: ``{"lookups": {reason: count}, "requests": n}``."""
    out: dict[str, dict[str, Any]] = dict(_core_stats())
    explained = summary()
    if explained is not None:
        out["explain"] = explained
    return out
