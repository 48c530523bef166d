"""The two ways a differential trace stops: the candidate diverged, or the harness erred."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import TraceConfig


class Divergence(AssertionError):
    """The candidate answered or behaved differently from vLLM's manager."""

    def __init__(
        self,
        message: str,
        *,
        seed: Any,
        call_index: int,
        action_index: int,
        call: str,
        check: str,
        ref: Any,
        cand: Any,
        signature: tuple,
    ):
        super().__init__(message)
        self.seed = seed
        self.call_index = call_index
        self.action_index = action_index
        self.call = call
        self.check = check
        self.ref = ref
        self.cand = cand
        self.signature = signature
        self.actions: list | None = None
        self.outcomes: list | None = None
        self.config: TraceConfig | None = None


class HarnessError(RuntimeError):
    """The reference itself failed on an action the generator thought valid (a harness bug,
    or an invalid action sequence during shrinking)."""
