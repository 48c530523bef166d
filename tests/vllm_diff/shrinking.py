"""Recorded traces replayed and shrunk into short repros.

:func:`replay` re-executes recorded actions on a fresh pair; :func:`shrink` removes whole
requests and stand-alone calls (ddmin) while the candidate still diverges the same way and the
reference still decides the same way; :func:`minimize` first looks for another seed of the
same configuration that diverges earlier, then shrinks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .actions import rid_of
from .config import TraceConfig, load_candidate
from .errors import Divergence, HarnessError
from .pair import Pair
from .trace import run_trace


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
    pair = Pair(cfg, candidate, seed, cand_hasher_factory)
    pair.expect = expect
    for action in actions:
        pair.do(action)
    pair.check_state(deep=True)
    return pair.ncalls


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
            rid = rid_of(a)
            if rid is not None:
                by_rid.setdefault(rid, []).append(i)
            if (a[0] == "call" and a[1] in _DROPPABLE) or (
                a[0] == "set" and a[2] == "spec_token_ids"
            ):
                singles.append([i])
        last_rid = rid_of(actions[keep[-1]])
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
