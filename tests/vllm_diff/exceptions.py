"""Where vLLM 0.33.0's own manager crashes: the documented exceptions of the comparison.

A differential trace compares hscache's manager with vLLM's; when vLLM's raises on a call
the generator made as vLLM's Scheduler would, there is no decision to compare. Each such
case vLLM gets wrong is listed in :data:`KNOWN`, recognised by the call, the exception and
the vLLM function it escapes from, and carries what hscache does instead
(``candidate_outcome``, checked on every occurrence).

When one occurs, :meth:`vllm_diff.pair.Pair.do` raises :class:`KnownVllmException` and the
trace ends there (vLLM's state is no longer trustworthy); the trace counts as passed and its
summary counts the exception (``vllm_exception:<name>``). Anything vLLM raises that is not
listed stays a ``HarnessError``: a harness bug or a new vLLM problem to study.

``tests/differential/test_differential_layouts.py`` pins hscache's behaviour in each case.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

from .errors import HarnessError


@dataclasses.dataclass(frozen=True)
class KnownVllmBug:
    name: str
    summary: str
    methods: tuple[str, ...]  # the manager calls it happens in
    exception: type[BaseException]
    raised_in: str  # the vLLM function the exception escapes from
    candidate_outcome: tuple  # what hscache answers instead (the harness's normal form)
    applies: Callable[[list, Any], bool] = lambda action, pair: True

    def matches(self, action: list, exc: BaseException, pair: Any) -> bool:
        if action[0] != "call" or action[1] not in self.methods:
            return False
        if not isinstance(exc, self.exception):
            return False
        frames = {f.name for f in traceback.extract_tb(exc.__traceback__)}
        return self.raised_in in frames and self.applies(action, pair)


def _mamba_align(_action: list, pair: Any) -> bool:
    return bool(pair.cfg.info.mamba_align)


def _dcp(_action: list, pair: Any) -> bool:
    return pair.cfg.dcp > 1


def _mamba_align_external(action: list, pair: Any) -> bool:
    kw = action[2].get("kw", {})
    return _mamba_align(action, pair) and kw.get("num_external_computed_tokens", 0) > 0


KNOWN: tuple[KnownVllmBug, ...] = (
    KnownVllmBug(
        name="report-full-partial-hit-events",
        summary=(
            "A request with kv_cache_report_mode='full' and KV events on gets a Mamba "
            "'align' partial prefix hit (the hit ends inside a Mamba block, e.g. full "
            "attention 32 + Mamba 64, hash block 32, a 96-token hit): "
            "BlockPool.emit_cached_block_events views the hashes at the Mamba block size "
            "and indexes one past their end (IndexError inside get_computed_blocks). "
            "hscache emits the hit's BlockStored events: the full blocks', and a "
            "partial-entry event for the tail."
        ),
        methods=("get_computed_blocks", "get_computed_blocks_for_connector"),
        exception=IndexError,
        raised_in="emit_cached_block_events",
        candidate_outcome=("ok",),
        applies=_mamba_align,
    ),
    KnownVllmBug(
        name="report-full-dcp-events",
        summary=(
            "A request with kv_cache_report_mode='full' and KV events on gets a prefix "
            "hit under decode context parallelism: KVCacheCoordinator."
            "emit_cached_block_events passes the spec's block size, unscaled by DCP, "
            "which is finer than the hash block size (block size x DCP), and "
            "resolve_block_hashes fails an assertion inside get_computed_blocks. "
            "hscache reports the hit at the group's block size, as caching reports it."
        ),
        methods=("get_computed_blocks", "get_computed_blocks_for_connector"),
        exception=AssertionError,
        raised_in="emit_cached_block_events",
        candidate_outcome=("ok",),
        applies=_dcp,
    ),
    KnownVllmBug(
        name="mamba-align-external-undercount",
        summary=(
            "A Mamba 'align' group admitting a request with external (KV-connector) "
            "tokens: get_num_blocks_to_allocate caps the group's new blocks at its "
            "per-step physical cap, but allocate_external_computed_blocks (the base "
            "class's) first takes one block per block_size external tokens, so with a "
            "nearly full pool BlockPool.get_new_blocks raises ValueError inside "
            "allocate_slots, after the hits were adopted. hscache counts the same and "
            "raises InternalError at the same call (the manager is then poisoned: every "
            "later call raises), never a silent wrong allocation."
        ),
        methods=("allocate_slots",),
        exception=ValueError,
        raised_in="get_new_blocks",
        candidate_outcome=("raise", "InternalError"),
        applies=_mamba_align_external,
    ),
)


class KnownVllmException(HarnessError):
    """vLLM's manager crashed in a documented case (see :data:`KNOWN`)."""

    def __init__(self, bug: KnownVllmBug, message: str):
        super().__init__(message)
        self.bug = bug


def match(action: list, exc: BaseException, pair: Any) -> KnownVllmBug | None:
    return next((bug for bug in KNOWN if bug.matches(action, exc, pair)), None)
