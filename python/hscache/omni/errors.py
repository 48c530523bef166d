"""The errors :class:`hscache.omni.OmniHiddenStateCache` raises beyond hscache's own (the
first two come from the Rust rules, ``hscache._core``).

Each is raised before anything changes: after catching one, the cache is as it was.
"""

from __future__ import annotations

from hscache._core import StepIdError, UnservableHitError
from hscache.exceptions import InvalidArgumentError

__all__ = ["StepIdError", "UnservableHitError", "UnsupportedOutputError"]

# StepIdError (an InvalidArgumentError): a step id that is not an unconsumed step of this
# cache: consumed already, never saved, issued by another cache, or one too many steps
# left unconsumed. UnservableHitError (a RuntimeError): a request's prefix hit whose
# cached rows the slot mirror could not validate and that is not recomputed (recomputation
# off, or no block to report: hscache.omni.refusals); vllm-omni's runner makes it fatal.
# Both are raised by the Rust rules (src/slots/omni_rules.rs), documented there.


class UnsupportedOutputError(InvalidArgumentError):
    """A per-token output the cache was not built for (a key first seen after the first
    saved step, or one whose width or dtype changed)."""
