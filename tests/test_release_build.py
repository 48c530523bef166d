"""The release extension carries no test-only switch: the mutants (the fast path's broken
rules, the manager's invariant mutants, the slot mirror's and omni rules' mutants) and the
armed faults exist only in the test-hooks extension that ``scripts/panic_python.sh`` builds
(cargo features ``mutants`` and ``fault-injection``), and the wheel is built without them.

Run with the release extension (``maturin develop``, what ``scripts/test.sh`` tests), this
finds none of the switches; run by ``panic_python.sh`` against the test-hooks extension, it
finds every one (so the names it looks for are the right ones).
"""

from __future__ import annotations

import re
from pathlib import Path

from hscache import _core

ROOT = Path(__file__).resolve().parents[1]

# Where each switch lives: the module itself or a class of it.
SWITCHES = {
    "": {"_break_step_rules", "_arm_fault"},
    "KVCacheCore": {"_break_invariant", "_invariant_mutants"},
    "SlotMirror": {"_break_rule", "_rule_mutants"},
    "OmniStepRules": {"_break_rule", "_rule_mutants"},
}
PREFIXES = ("_break", "_arm", "_rule_mutants", "_invariant_mutants")


def _found() -> set[str]:
    """Every switch-like name the extension has (``owner.name``)."""
    found = set()
    owners = {
        "": _core,
        **{n: getattr(_core, n) for n in dir(_core) if isinstance(getattr(_core, n), type)},
    }
    for owner, obj in owners.items():
        for name in dir(obj):
            if name.startswith(PREFIXES):
                found.add(f"{owner}.{name}")
    return found


def test_switches_exist_only_in_the_test_hooks_build() -> None:
    expected = {f"{owner}.{name}" for owner, names in SWITCHES.items() for name in names}
    if _core.TEST_HOOKS:
        assert _found() == expected
    else:
        assert _found() == set()


def _section(path: Path, name: str) -> str:
    """The body of TOML section ``[name]`` (up to the next section)."""
    text = path.read_text()
    match = re.search(rf"^\[{re.escape(name)}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert match is not None, f"no [{name}] in {path.name}"
    return match.group(1)


def test_the_wheel_is_built_without_test_features() -> None:
    maturin = _section(ROOT / "pyproject.toml", "tool.maturin")
    assert re.search(r'^features = \["python"\]$', maturin, re.M), maturin
    features = _section(ROOT / "Cargo.toml", "features")
    assert re.search(r"^default = \[\]$", features, re.M), features
    for name in ("mutants", "fault-injection"):
        assert re.search(rf"^{name} = \[\]$", features, re.M), name


def test_the_package_has_no_hook() -> None:
    """The Python hooks that arm the switches are the tests' (``tests/scheduler/mutants.py``),
    not the package's."""
    for path in (ROOT / "python" / "hscache").rglob("*.py"):
        text = path.read_text()
        for name in ("_break_step_rules", "_break_invariant", "_break_rule", "_arm_fault"):
            assert name not in text, f"{path.relative_to(ROOT)} names {name}"
