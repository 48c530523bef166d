"""Opt-in retention policies for ``hscache.vllm.KVCacheManager`` (glue only).

The policies live in the core (``src/pool/retention/``); this module selects one
and hands the core each request's hints when the request is freed. See
``docs/retention.md``.

Selection: the ``retention=`` keyword of ``KVCacheManager`` (a policy name, or a
dict ``{"policy": name, "default_priority": .., "ttl_s": .., "max_pinned_blocks":
.., "slru_protected_blocks": .., "manual_clock": ..}``), else ``HSCACHE_RETENTION`` (with
``HSCACHE_RETENTION_TTL_S`` / ``HSCACHE_RETENTION_MAX_PINNED``), else ``lru``
(vLLM's, bit-identical; the manager is then the plain class and pays nothing).

Per-request hints, read by the core (``core_free_retained``) from
``request.sampling_params.extra_args`` when the request is freed:
``hscache_priority`` (int 0-100), ``hscache_retention_s`` (seconds the priority,
or the TTL, holds) and ``hscache_pin`` (bool).
"""

from __future__ import annotations

import os
from typing import Any

from hscache.exceptions import InvalidArgumentError

POLICIES = ("lru", "priority", "pin", "ttl", "slru")
HINT_KEYS = ("hscache_priority", "hscache_retention_s", "hscache_pin")
_SETTINGS = (
    "default_priority",
    "ttl_s",
    "max_pinned_blocks",
    "slru_protected_blocks",
    "manual_clock",
)


def select(retention: str | dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The policy name and its settings, from the keyword or the environment."""
    if retention is None:
        name = os.environ.get("HSCACHE_RETENTION", "lru").strip().lower() or "lru"
        settings: dict[str, Any] = {}
        if (ttl := os.environ.get("HSCACHE_RETENTION_TTL_S")) is not None:
            settings["ttl_s"] = float(ttl)
        if (cap := os.environ.get("HSCACHE_RETENTION_MAX_PINNED")) is not None:
            settings["max_pinned_blocks"] = int(cap)
    elif isinstance(retention, str):
        name, settings = retention.strip().lower(), {}
    else:
        settings = dict(retention)
        name = str(settings.pop("policy", "lru")).lower()
        unknown = set(settings) - set(_SETTINGS)
        if unknown:
            raise InvalidArgumentError(f"unknown retention settings: {sorted(unknown)}")
    if name not in POLICIES:
        raise InvalidArgumentError(
            f"unknown retention policy {name!r}: expected one of {', '.join(POLICIES)}"
        )
    return name, settings


def install(manager: Any, name: str, settings: dict[str, Any]) -> None:
    """Attaches policy ``name`` to a fresh core manager."""
    manager.core_set_retention(name, **settings)
