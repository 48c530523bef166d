"""Fail on any import circle among the project's own Python modules.

    python scripts/import_cycles.py        # run by scripts/test.sh (step "import-cycles")

Reads every ``import`` / ``from ... import`` statement (module level and inside functions
alike: a lazy import still makes a circle, it only hides it until run time) of the package
(``python/hscache``), the tests (``tests``, ``tests/vllm_diff``), ``examples`` and
``scripts``, keeps the edges between the project's own modules, and prints every strongly
connected component of more than one module. An edge goes to the module named (``from a.b
import c`` names ``a.b.c`` when that is a module, else ``a.b``); the implicit import of a
parent package is not an edge. A compiled module is known by its stub (``_core.pyi``), so
importing it is an edge to it, not to its package.

``KNOWN`` lists the circles that exist today, each with why and who removes it: the check
fails on any other circle, and on a listed one that is gone (delete its line then).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (directory whose children are top-level names, the files under it to read)
SOURCES = (
    (ROOT / "python", ROOT / "python" / "hscache"),
    (ROOT, ROOT / "tests"),
    (ROOT / "tests", ROOT / "tests" / "vllm_diff"),
    (ROOT / "examples", ROOT / "examples"),
    (ROOT / "scripts", ROOT / "scripts"),
)
SKIP = ("vllm_upstream",)  # vLLM's own tests' plugin: runs inside vLLM's tree

KNOWN: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for base, tree in SOURCES:
        stubs = [p for p in tree.rglob("*.pyi") if not p.with_suffix(".py").exists()]
        for path in sorted([*tree.rglob("*.py"), *stubs]):
            rel = path.relative_to(base).with_suffix("")
            if any(part in SKIP for part in rel.parts):
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join(parts), path)
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".") if package else []
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
            targets = [t if t in modules else base for t in targets]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    edges = sum(len(v) for v in graph.values())
    print(f"{len(modules)} modules, {edges} imports between them")
    failed = False
    for component in cycles:
        why = KNOWN.get(frozenset(component))
        print(("known" if why else "NEW") + " import circle: " + " <-> ".join(component))
        for a in component:
            for b in sorted(graph[a] & set(component)):
                print(f"    {a} imports {b}")
        if why:
            print(f"    ({why})")
        failed |= why is None
    gone = set(KNOWN) - {frozenset(c) for c in cycles}
    for component in sorted(sorted(c) for c in gone):
        print("listed in KNOWN but gone (delete its line): " + " <-> ".join(component))
    return 1 if failed or gone else 0


if __name__ == "__main__":
    sys.exit(main())
