"""Fail when a Python test function has no assertion of its own.

    python scripts/check_test_asserts.py   # run by scripts/test.sh (step "test-asserts")

A test that only runs code passes whenever that code does not raise, which proves little:
this reads every ``test_*.py`` under ``tests/`` (ast only, nothing is imported) and, for
each test function (``test_*`` at module level or in a ``Test*`` class), requires that its
body checks something itself: an ``assert`` statement, ``pytest.raises`` / ``pytest.warns``
/ ``pytest.fail`` / ``pytest.approx``, an explicit ``raise``, a call whose name says it
checks (``assert_*``, ``check_*``, ``expect_*``, ``verify_*``, ``check``; e.g. a manager's
``check_invariants()``), Hypothesis's ``run_state_machine_as_test`` (whose rules assert), or
a call of a helper of ``tests/`` or ``tools/hscache_tools/testing/`` that checks (an assert, a
raised ``AssertionError`` or subclass such as the differential harness's ``Divergence``, or
a call of another such helper, followed to a fixed point). A call reaches a helper only
through what the module names: ``h(...)`` defined or imported there (re-exports followed),
``module.h(...)``, ``self.h(...)``, or a method of a class of the module (building one
reaches its methods); never ``obj.h(...)`` on an arbitrary object, whose method of that name
proves nothing.

A test that legitimately asserts nothing itself (its checks live in a fixture) is listed
in ``EXEMPT`` with its reason. Prints every offender as ``path:line: name`` and exits 1.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_ROOT = ROOT / "tests"
HELPER_ROOTS = (ROOT / "tests", ROOT / "python" / "hscache" / "testing")
CHECKING_ATTRS = {"raises", "warns", "fail", "approx", "deprecated_call"}
CHECKING_NAME = re.compile(r"^_*(assert|check|expect|verify)_|^_*check$")
CHECKING_CALLS = {"run_state_machine_as_test"}
# "path::name": why the test asserts nothing in its own body.
EXEMPT: dict[str, str] = {}


_FUNCTION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)


class _Module:
    """One scanned file: its functions (methods too, by name), the names it imports from
    other scanned files and the scanned modules it imports under a name."""

    def __init__(self, path: Path, tree: ast.Module) -> None:
        self.path = path
        self.tree = tree
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.classes: set[str] = set()
        self.methods_of: dict[str, set[str]] = {}
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module key, name)
        self.modules: dict[str, str] = {}  # local name -> module key
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ClassDef):
                self.classes.add(node.name)
                # A class reaches its methods: building one (or calling one of its
                # methods) counts as what they check.
                self.methods_of[node.name] = {
                    n.name for n in node.body if isinstance(n, _FUNCTION_TYPES)
                }


def _key(path: Path) -> str:
    """``tests.vllm_diff.trace`` for tests/vllm_diff/trace.py (a package: its folder)."""
    rel = path.relative_to(ROOT / "python" if path.is_relative_to(ROOT / "python") else ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_imports(modules: dict[str, _Module]) -> None:
    for key, mod in modules.items():
        package = key if mod.path.name == "__init__.py" else key.rpartition(".")[0]
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        mod.modules[a.asname or a.name.split(".")[-1]] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        mod.modules[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in modules:
                        mod.imported[a.asname or a.name] = (base, a.name)


def _targets(mod: _Module, node: ast.Call, modules: dict[str, _Module]) -> list[tuple[str, str]]:
    """The scanned functions a call can reach, as (module key, name): ``h(...)`` (defined
    here or imported from a scanned module), ``self.h(...)`` / ``cls.h(...)`` and
    ``Local(...).h(...)`` (a method of this module), ``module.h(...)``; never a method
    called on some other object (a manager's ``allocate_slots`` proves nothing)."""
    f = node.func
    here = _key(mod.path)
    if isinstance(f, ast.Name):
        if f.id in mod.functions or f.id in mod.classes:
            return [(here, f.id)]
        if f.id in mod.imported:
            return [mod.imported[f.id]]
        return []
    if not isinstance(f, ast.Attribute):
        return []
    recv = f.value
    if isinstance(recv, ast.Name):
        if recv.id in ("self", "cls"):
            return [(here, f.attr)]
        if recv.id in mod.modules:
            return [(mod.modules[recv.id], f.attr)]
    if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name):
        if recv.func.id in mod.classes:
            return [(here, f.attr)]
    return []


def _checks_itself(fn: ast.AST, assertion_classes: set[str], *, in_test: bool) -> bool:
    """True if ``fn``'s body (nested functions included) checks by itself; in a test, any
    ``raise`` counts, in a helper only a raised ``AssertionError`` (or a subclass)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", "")
            if in_test or name in assertion_classes:
                return True
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in CHECKING_ATTRS:
                if isinstance(f.value, ast.Name) and f.value.id == "pytest":
                    return True
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            if name and (name in CHECKING_CALLS or CHECKING_NAME.search(name)):
                return True
    return False


def _tests(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    out: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name.startswith("test"):
                out.append(node)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            out += [
                n
                for n in node.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name.startswith("test")
            ]
    return out


def main() -> int:
    modules: dict[str, _Module] = {}
    for root in HELPER_ROOTS:
        for path in sorted(root.rglob("*.py")):
            modules[_key(path)] = _Module(path, ast.parse(path.read_text(), filename=str(path)))
    _resolve_imports(modules)
    assertion_classes = {"AssertionError", "Failed"}
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id in ("AssertionError", "Divergence")
                for b in node.bases
            ):
                assertion_classes.add(node.name)
    # Helpers that check, as (module key, name): direct ones, then whatever calls one (to a
    # fixed point). A class "checks" when one of its methods does (its construction or a
    # method call on it is followed no further than the module).
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    checking: set[tuple[str, str]] = set()
    for key, mod in modules.items():
        for name, fns in mod.functions.items():
            out = edges.setdefault((key, name), set())
            for fn in fns:
                out.update(
                    t
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Call)
                    for t in _targets(mod, node, modules)
                )
                if _checks_itself(fn, assertion_classes, in_test=False):
                    checking.add((key, name))
        for cls, methods in mod.methods_of.items():
            edges.setdefault((key, cls), set()).update((key, m) for m in methods)
        for local, target in mod.imported.items():  # a re-export reaches what it names
            edges.setdefault((key, local), set()).add(target)
    changed = True
    while changed:
        changed = False
        for node_key, callees in edges.items():
            if node_key not in checking and callees & checking:
                checking.add(node_key)
                changed = True

    offenders = []
    n_tests = 0
    for mod in modules.values():
        if not mod.path.is_relative_to(TEST_ROOT) or not mod.path.name.startswith("test_"):
            continue
        rel = mod.path.relative_to(ROOT).as_posix()
        for fn in _tests(mod.tree):
            n_tests += 1
            if f"{rel}::{fn.name}" in EXEMPT:
                continue
            if _checks_itself(fn, assertion_classes, in_test=True):
                continue
            reached = {
                t
                for node in ast.walk(fn)
                if isinstance(node, ast.Call)
                for t in _targets(mod, node, modules)
            }
            if reached & checking:
                continue
            offenders.append(f"{rel}:{fn.lineno}: {fn.name}")
    for line in offenders:
        print(f"{line}: no assertion of its own (assert, pytest.raises, a checking helper)")
    if n_tests == 0:
        print("no test function found under tests/: failing")
        return 1
    print(f"{n_tests} test functions read, {len(offenders)} without an assertion of their own")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
