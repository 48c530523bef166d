"""Hit-path explanations: why a request's last prefix-cache lookup stopped where it did.

This module owns the typed result (:class:`Explanation`), the registry of live
managers built with explain mode on, and the module-level :func:`explain` that asks
them. The logic (records, eviction history, fingerprints, the reason) lives in the
Rust core (``src/explain.rs``); see ``docs/explain.md``.

Explain mode is opt-in: ``KVCacheManager(..., explain=True)`` or ``HSCACHE_EXPLAIN=1``
for managers vLLM's Scheduler builds. Off, it costs one predictable branch per call.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from hscache.exceptions import UnknownRequestError, UnsupportedError

Reason = Literal[
    "lookup_skipped",
    "hit_capped",
    "block_alignment",
    "evicted",
    "extra_keys_differ",
    "never_cached",
]

__all__ = ["Explanation", "Reason", "enabled_from_env", "explain", "register", "summary"]


class _Explaining(Protocol):
    def core_explain(self, request_id: str) -> dict[str, Any]: ...

    def core_explain_summary(self) -> dict[str, Any]: ...

    @property
    def explain_enabled(self) -> bool: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def enabled_from_env() -> bool:
    """Whether ``HSCACHE_EXPLAIN`` asks for explain mode (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get("HSCACHE_EXPLAIN", "0").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
        "off",
    )


def register(manager: _Explaining) -> None:
    """Lets :func:`explain` find ``manager`` while it lives."""
    _LIVE.add(manager)


def _sentence(reason: str, hit_blocks: int, n: int, detail: dict[str, Any]) -> str:
    hit = f"{hit_blocks} of {n} full blocks hit"
    if reason == "lookup_skipped":
        cause = detail.get("skip_reason") or detail.get("cause", "")
        return f"no lookup: the prefix cache was not read ({cause})"
    if reason == "hit_capped":
        return (
            f"{hit}; the next block was not used because the hit is capped at "
            f"{detail.get('max_hit_tokens')} tokens (num_tokens - 1 or max_cache_hit_length): "
            "the last token is always recomputed"
        )
    if reason == "block_alignment":
        align = detail.get("alignment_tokens")
        if "missing_in_groups" in detail:
            return (
                f"{hit}; block {detail.get('first_missing_block')} is cached in groups "
                f"{detail.get('cached_in_groups')} but not in groups "
                f"{detail.get('missing_in_groups')}, and a hit needs every group "
                f"(alignment {align} tokens)"
            )
        if "cause" in detail and "partial_tokens" in detail:
            return (
                f"{hit}; the remaining {detail.get('partial_tokens')} tokens do not fill "
                f"one aligned unit of {align} tokens ({detail.get('cause')}), so nothing "
                "more can hit"
            )
        if "cause" in detail:
            return (
                f"{hit}; every group holds the next {align}-token unit, but a group's own "
                "rule (sliding window, Mamba state) cut the hit"
            )
        return (
            f"{hit}; nothing more to look up: the remaining {detail.get('partial_tokens')} "
            "tokens do not fill a block, and partial blocks are never cached"
        )
    block = detail.get("first_missing_block")
    if reason == "evicted":
        return (
            f"{hit}; block {block} was cached and evicted by the {detail.get('policy')} "
            f"policy (eviction #{detail.get('eviction_seq')}, "
            f"{detail.get('evictions_since')} evictions ago)"
        )
    if reason == "extra_keys_differ":
        differs = ", ".join(detail.get("differs", []))
        return (
            f"{hit}; block {block} has the same tokens as a cached block but a different "
            f"hash because the {differs} differ"
        )
    return f"{hit}; block {block} was never cached"


@dataclass(frozen=True)
class Explanation:
    """The record of a request's last prefix-cache lookup."""

    request_id: str
    hit_blocks: int
    """Hit length in hash blocks."""
    hit_tokens: int
    num_full_blocks: int
    """Full blocks the request had hashes for at the lookup."""
    num_tokens: int
    reason: Reason
    """Why the hit stopped there (see ``docs/explain.md``)."""
    detail: dict[str, Any] = field(default_factory=dict)
    """Reason-specific facts: ``cause``, ``first_missing_block``, ``policy``,
    ``eviction_seq``, ``evictions_since``, ``differs``, ``max_hit_tokens``, ..."""
    lookup_seq: int = 0
    """The manager's explained-lookup counter at this lookup."""

    @classmethod
    def from_core(cls, request_id: str, record: dict[str, Any]) -> Explanation:
        return cls(request_id=request_id, **record)

    def __str__(self) -> str:
        return f"request {self.request_id}: " + _sentence(
            self.reason, self.hit_blocks, self.num_full_blocks, self.detail
        )


def summary() -> dict[str, Any] | None:
    """Explain mode over every live manager that has it on: ``{"lookups": {reason:
    count}, "requests": n}`` (explained lookups since explain mode was turned on, by
    reason; requests whose last lookup is remembered), or None when no such manager
    lives. ``hscache.stats()`` reports it as ``"explain"``."""
    managers = [m for m in list(_LIVE) if m.explain_enabled]
    if not managers:
        return None
    lookups: dict[str, int] = {}
    requests = 0
    for manager in managers:
        one = manager.core_explain_summary()
        for reason, n in one["lookups"].items():
            lookups[reason] = lookups.get(reason, 0) + n
        requests += one["requests"]
    return {"lookups": lookups, "requests": requests}


def explain(request_id: str) -> Explanation:
    """The last lookup of ``request_id`` in any live manager built with explain mode on.

    ``UnsupportedError`` (a ``RuntimeError``) if no such manager lives (turn it on with
    ``explain=True`` or ``HSCACHE_EXPLAIN=1``); ``UnknownRequestError`` (a ``KeyError``)
    if none of them explained a lookup of it.
    """
    managers = [m for m in list(_LIVE) if m.explain_enabled]
    if not managers:
        raise UnsupportedError(
            "no KV-cache manager with explain mode is alive: build it with "
            "KVCacheManager(..., explain=True) or set HSCACHE_EXPLAIN=1"
        )
    best: Explanation | None = None
    for manager in managers:
        try:
            found = Explanation.from_core(request_id, manager.core_explain(request_id))
        except KeyError:
            continue
        if best is None or found.lookup_seq > best.lookup_seq:
            best = found
    if best is None:
        raise UnknownRequestError(f"no explained lookup of request {request_id!r}")
    return best
