"""The bad-input matrix: every public method of ``hscache.vllm.KVCacheManager``, its
``BlockPool`` view, the encoder-cache managers, the block hasher and the hidden-state
mirror, called with malformed arguments or in a state that refuses the call, must raise a
typed exception with a message and change nothing.

The rows live in ``tests/robustness/bad_inputs/`` (one module per target, each with its
``ROWS``, its ``ACCEPTED`` inputs and its ``SURFACE``). Each row builds a fresh target in a
known state, takes its fingerprint (the manager's ``state_digest()``; a snapshot of every
public field for the other targets), makes the bad call, asserts the exception type, and
asserts the fingerprint did not move. ``test_every_public_method_has_a_row`` fails when a
public method has neither a row nor a written exemption. The rows are the single source of
``docs/bad_inputs.md``: regenerate it with ``python -m tests.robustness.test_bad_inputs
--write-doc``; ``test_doc_is_up_to_date`` fails when it is stale."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)

from tests.robustness.bad_inputs import (
    HOOK_BUILDS,
    Accepted,
    Row,
    Surface,
    encoder,
    hasher,
    hidden,
    manager,
    omni,
    pool,
    step_schedule,
    step_update,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"
MODULES = (manager, pool, encoder, hasher, hidden, omni, step_schedule, step_update)
ROWS: list[Row] = [r for m in MODULES for r in m.ROWS]
ACCEPTED: list[Accepted] = [a for m in MODULES for a in m.ACCEPTED]
SURFACES: list[Surface] = [s for m in MODULES for s in m.SURFACES]


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(r, id=r.id, marks=[pytest.mark.hooks] if r.build in HOOK_BUILDS else [])
        for r in ROWS
    ],
)
def test_bad_input_raises_typed_and_changes_nothing(row: Row) -> None:
    ctx = row.build()
    before = ctx.fingerprint()
    with pytest.raises(row.raises) as info:
        row.run(ctx)
    error = info.value
    # A builtin only where the row names one (TypeError for a wrong Python type, ...);
    # never an AttributeError, AssertionError or pyo3's PanicException.
    assert type(error).__module__ != "builtins" or row.raises.__module__ == "builtins"
    assert not isinstance(error, AttributeError), "untyped error"
    assert type(error).__name__ != "PanicException"
    assert str(error), "an exception without a message"
    assert ctx.fingerprint() == before, "state changed"


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(a, id=a.id, marks=[pytest.mark.hooks] if a.build in HOOK_BUILDS else [])
        for a in ACCEPTED
    ],
)
def test_accepted_input_does_not_raise(row: Accepted) -> None:
    ctx = row.build()
    try:
        row.run(ctx)
    except Exception as exc:  # the claim under test: this input is taken
        pytest.fail(f"{row.id} raised {type(exc).__name__}: {exc} (taken because: {row.why})")


def test_row_ids_are_unique() -> None:
    ids = [r.id for r in ROWS] + [a.id for a in ACCEPTED]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("surface", SURFACES, ids=[s.target for s in SURFACES])
def test_every_public_method_has_a_row(surface: Surface) -> None:
    methods = surface.methods()
    covered = {r.method for r in ROWS if r.target == surface.target}
    missing = methods - covered - set(surface.exempt)
    assert not missing, f"{surface.target}: no row and no exemption for {sorted(missing)}"
    assert covered <= methods, f"rows name unknown methods {sorted(covered - methods)}"
    stale = set(surface.exempt) - (methods - covered)
    assert not stale, f"exemptions of methods with rows or without a method: {sorted(stale)}"
    accepted = {a.method for a in ACCEPTED if a.target == surface.target}
    assert accepted <= methods, f"accepted rows name unknown methods {sorted(accepted - methods)}"


def _coverage(surface: Surface) -> str:
    rows = [r for r in ROWS if r.target == surface.target]
    return (
        f"| {surface.target} | {len(surface.methods()) - len(surface.exempt)} | "
        f"{len(surface.exempt)} | {len(rows)} |"
    )


def render_doc() -> str:
    """The markdown of ``docs/bad_inputs.md``."""
    lines = [
        "# The bad-input matrix",
        "",
        "Generated from `tests/robustness/test_bad_inputs.py` and `tests/robustness/bad_inputs/` "
        "(`python -m tests.robustness.test_bad_inputs --write-doc`); a test fails when this "
        "file is stale. Every "
        "row calls the method on a fresh target in a known state, asserts the exception "
        "type and a message, and asserts the target's fingerprint (`state_digest()` for the "
        "KV-cache manager and its `BlockPool` view, a snapshot of every public field "
        "otherwise) is unchanged.",
        "",
        "**Which methods.** A target's public surface is the public callables of its classes "
        "(no leading `_`; the Rust base class's included) plus the constructor `__init__`, "
        "its module functions, and the names vLLM's callers use though private by name "
        "(`BlockPool._insert_block_hash`). `core_*` bindings are internal (the Python views "
        "call them). `test_every_public_method_has_a_row` fails when a public method has "
        "neither a row nor an exemption below. Properties are fields, not methods.",
        "",
        "**Integers.** An integer argument beyond 64 bits is `InvalidArgumentError` "
        "(`BlockIdError` for a block id), never the builtin `OverflowError`, even where "
        "vLLM's Python would take it (a hit cap of `2**70`).",
        "",
        f"{len(ROWS)} rows over {len(SURFACES)} targets; {len(ACCEPTED)} accepted inputs.",
        "",
        "| target | public methods with rows | exempt | rows |",
        "|---|---|---|---|",
        *[_coverage(s) for s in SURFACES],
        "",
        "## Rows",
        "",
        "| target | method | malformed input | raises |",
        "|---|---|---|---|",
        *[f"| {r.target} | `{r.method}` | {r.case} | `{r.raises.__name__}` |" for r in ROWS],
        "",
        "## Exempt methods",
        "",
        "| target | method | why no row |",
        "|---|---|---|",
        *[
            f"| {s.target} | `{m}` | {why} |"
            for s in SURFACES
            for m, why in sorted(s.exempt.items())
        ],
        "",
        "Internal by prefix: "
        + "; ".join(f"{s.target} `{p}*`: {why}" for s in SURFACES for p, why in s.internal.items())
        + ".",
        "",
        "## Accepted inputs",
        "",
        "Inputs that look malformed but are taken, as vLLM takes them or by design; each "
        "must not raise.",
        "",
        "| target | method | input | why |",
        "|---|---|---|---|",
        *[f"| {a.target} | `{a.method}` | {a.case} | {a.why} |" for a in ACCEPTED],
    ]
    return "\n".join(lines) + "\n"


def test_doc_is_up_to_date() -> None:
    assert DOC.read_text() == render_doc(), (
        "run: python -m tests.robustness.test_bad_inputs --write-doc"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-doc"]:
        DOC.write_text(render_doc())
        print(f"wrote {DOC}")
    else:
        sys.exit("usage: python -m tests.robustness.test_bad_inputs --write-doc")
