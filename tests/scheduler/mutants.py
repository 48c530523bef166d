"""The fast path's mutants (test only; the wheel carries no way to arm them): each rule of
``hscache.vllm.step.RULES`` broken alone, for the differential to catch.

A glue rule (``step.rules.GLUE_RULES``) is broken by rebinding ``step.rules.BROKEN``; a
core rule (``StepSchedule.RULES``, ``StepUpdate.RULES``) by ``_core._break_step_rules``,
which only an extension built with the ``mutants`` cargo feature has
(``scripts/panic_python.sh`` builds it for ``scripts/test.sh``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hscache import _core
from hscache.vllm.step import rules

__all__ = ["armed", "has_core_mutants"]


def has_core_mutants() -> bool:
    """Whether this extension can break core rules (a ``mutants`` build)."""
    return hasattr(_core, "_break_step_rules")


@contextlib.contextmanager
def armed(rule: str) -> Iterator[None]:
    """``rule`` broken for the duration of the block."""
    if rule in rules.GLUE_RULES:
        saved = rules.BROKEN
        rules.BROKEN = frozenset({rule})
        try:
            yield
        finally:
            rules.BROKEN = saved
        return
    if rule not in rules.CORE_RULES:
        raise ValueError(f"no fast-path rule {rule!r}")
    _core._break_step_rules([rule])
    try:
        yield
    finally:
        _core._break_step_rules([])
