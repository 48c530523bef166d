"""The errors :class:`hscache.omni.OmniHiddenStateCache` raises beyond hscache's own.

Each is raised before anything changes: after catching one, the cache is as it was.
"""

from __future__ import annotations

from hscache.exceptions import InvalidArgumentError

__all__ = ["StepIdError", "UnservableHitError", "UnsupportedOutputError"]


class StepIdError(InvalidArgumentError):
    """A step id that is not an unconsumed step of this cache: consumed already, never
    saved, issued by another cache, or one too many steps left unconsumed."""


class UnservableHitError(RuntimeError):
    """A request's prefix hit whose cached rows the slot mirror could not validate (never
    written in the blocks' current versions). vllm-omni's contract makes this fatal (its
    ``OmniPrefixCacheUnmatchError``): serving only the step's rows would hand the next
    stage a truncated prompt."""


class UnsupportedOutputError(InvalidArgumentError):
    """A per-token output the cache was not built for (a key first seen after the first
    saved step, or one whose width or dtype changed)."""
