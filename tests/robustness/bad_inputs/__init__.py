"""The bad-input matrix, one module per target (``tests/robustness/test_bad_inputs.py`` runs it).

A **row** calls one public method of a fresh target in a known state with one malformed
input and names the exception it must raise; the runner asserts the type, a message, and
that the target's fingerprint did not move. An **accepted** row is the opposite: an input
that looks malformed but that vLLM takes (an unknown request id in ``free``) or that is
valid by design (a non-contiguous array); it must not raise.

A **surface** says what "every public method" of a target is: the public callables of its
classes (names without a leading ``_``, inherited Rust methods included, plus the
constructor ``__init__``), its module functions, and the extra names vLLM's callers use;
minus the internal bindings it names (with why) and the exemptions it lists (with why).
``test_every_public_method_has_a_row`` fails when a method of a surface has neither a row
nor an exemption.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Ctx:
    """One fresh target (``t``) and what the rows need beside it (``x``)."""

    t: Any
    fingerprint: Callable[[], Any]
    x: dict[str, Any] = field(default_factory=dict)


HOOK_BUILDS: set[Callable[[], Ctx]] = set()
"""The builds that arm a test-only switch (a broken invariant to poison a manager): their
rows run only with the test-hooks extension (the ``hooks`` marker, ``tests/conftest.py``)."""


def needs_hooks(build: Callable[[], Ctx]) -> Callable[[], Ctx]:
    """Registers ``build`` in :data:`HOOK_BUILDS`."""
    HOOK_BUILDS.add(build)
    return build


Call = Callable[[Any, Ctx], Any]
"""A row's call: ``call(f, ctx)``, ``f`` being ``getattr(ctx.t, method)`` (None for a
module function or a constructor, which the call names itself)."""


class _Case:
    """What a row and an accepted input share: an id and a way to make the call."""

    target: str
    method: str
    case: str
    call: Call

    @property
    def id(self) -> str:
        return f"{self.target}.{self.method}: {self.case}"

    def run(self, ctx: Ctx) -> Any:
        return self.call(getattr(ctx.t, self.method, None), ctx)


@dataclass(frozen=True)
class Row(_Case):
    """One malformed call and the exception it raises."""

    target: str
    method: str
    case: str
    raises: type[BaseException]
    call: Call
    build: Callable[[], Ctx]


@dataclass(frozen=True)
class Accepted(_Case):
    """An input that looks malformed but is taken, as vLLM takes it or by design."""

    target: str
    method: str
    case: str
    why: str
    call: Call
    build: Callable[[], Ctx]


def makers(
    target: str, build: Callable[[], Ctx]
) -> tuple[Callable[..., Row], Callable[..., Accepted]]:
    """The row factories of one target: ``R(method, case, raises, call, build=None)``
    and ``A(method, case, why, call, build=None)``; ``build`` defaults to the target's."""

    def row(
        method: str,
        case: str,
        raises: type[BaseException],
        call: Call,
        build_: Callable[[], Ctx] | None = None,
    ) -> Row:
        return Row(target, method, case, raises, call, build_ or build)

    def accepted(
        method: str, case: str, why: str, call: Call, build_: Callable[[], Ctx] | None = None
    ) -> Accepted:
        return Accepted(target, method, case, why, call, build_ or build)

    return row, accepted


@dataclass(frozen=True)
class Surface:
    """The public methods of one target (see the module docs)."""

    target: str
    classes: tuple[type, ...] = ()
    functions: tuple[Callable[..., Any], ...] = ()
    extra: tuple[str, ...] = ()
    """Public in practice though not by name (``BlockPool._insert_block_hash``, which
    vLLM's connectors call; the callable a factory returns)."""
    internal: Mapping[str, str] = field(default_factory=dict)
    """Name prefix -> why names with it are not public."""
    exempt: Mapping[str, str] = field(default_factory=dict)
    """Method -> why it has no row."""

    def methods(self) -> set[str]:
        names = {"__init__"} if self.classes else set()
        for cls in self.classes:
            for name in dir(cls):
                if name.startswith("_") or name.startswith(tuple(self.internal)):
                    continue
                if inspect.isdatadescriptor(inspect.getattr_static(cls, name)):
                    continue  # a property (fields are not methods)
                if callable(getattr(cls, name)):
                    names.add(name)
        names.update(f.__name__ for f in self.functions)
        names.update(self.extra)
        return names
