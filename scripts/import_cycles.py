"""Fail on any import circle among the project's own modules, Python and Rust.

    python scripts/import_cycles.py        # run by scripts/test.sh (step "import-cycles")

Python: reads every ``import`` / ``from ... import`` statement (module level and inside
functions alike: a lazy import still makes a circle, it only hides it until run time) of
the package (``python/hscache``), its tools (``tools/hscache_tools``), the tests (``tests``,
``tests/vllm_diff``), ``examples`` and ``scripts``, keeps the edges between the project's own
modules, and prints every strongly connected component of more than one module. An edge
goes to the module named (``from a.b import c`` names ``a.b.c`` when that is a module, else
``a.b``); the implicit import of a parent package is not an edge. A compiled module is
known by its stub (``_core.pyi``), so importing it is an edge to it, not to its package.

Rust: the crate's modules are found from ``src/lib.rs``'s ``mod`` declarations down (a file
is a module; ``mod.rs`` and ``lib.rs`` are their folder's; an inline ``mod tests { }`` is a
module of its own, so test-only code makes no circle of the code it tests). An edge is any
path that lands in another of the crate's modules, in a ``use`` tree or in code
(``crate::pool::BlockPool``, ``super::batch::free_batch``, ``coordinator::X`` from the
folder that declares ``coordinator``, a name imported earlier); a name a module only
re-exports (``pub use``) is followed to the module that defines it. ``mod`` declarations
are not edges, and neither is a path from a module into a folder that contains it (a child
of ``manager/`` naming ``super::KVCacheManager``): a child sees its parent's private items
and may implement the parent's types, it is part of the folder, as the implicit import of
a parent package is not an edge in Python. Comments, doc comments and string literals are
skipped.

``KNOWN`` lists the circles that exist today, each with why and who removes it: the check
fails on any other circle, and on a listed one that is gone (delete its line then).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (directory whose children are top-level names, the files under it to read)
SOURCES = (
    (ROOT / "python", ROOT / "python" / "hscache"),
    (ROOT / "tools", ROOT / "tools" / "hscache_tools"),
    (ROOT, ROOT / "tests"),
    (ROOT / "tests", ROOT / "tests" / "vllm_diff"),
    (ROOT / "examples", ROOT / "examples"),
    (ROOT / "scripts", ROOT / "scripts"),
)
SKIP = ("vllm_upstream",)  # vLLM's own tests' plugin: runs inside vLLM's tree

KNOWN: dict[frozenset[str], str] = {}

CRATE = ROOT / "src"
# The bindings' one circle, named in docs/architecture.md's concept map.
_BINDINGS = (
    "the bindings' handles point at their owner: KVCacheBlock / KVCacheBlocks and the view "
    "classes (BlockPoolCore, KVCacheCoordinatorCore, HiSparseCore) hold their KVCacheCore and "
    "borrow it per call; the core creates the handles; batch and convert/blocks are "
    "KVCacheCore's calls written in their own files. Inherent to the handles (DESIGN.md "
    "section 2: bindings mirror the core class by class)"
)
RUST_KNOWN: dict[frozenset[str], str] = {
    frozenset(
        f"crate::python::{m}"
        for m in (
            "batch",
            "block",
            "blocks",
            "convert::blocks",
            "manager",
        )
    ): _BINDINGS,
}


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


Mod = tuple[str, ...]  # a Rust module's path below the crate root: () is lib.rs

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_TOKEN = re.compile(
    rf"(?P<mod>\bmod\s+(?P<name>{_IDENT})\s*(?P<end>[;{{]))"
    r"|(?P<use>\buse\s+(?P<tree>[^;]+);)"
    rf"|(?P<path>(?<![\w$])(?:{_IDENT}\s*::\s*)+{_IDENT})"
    r"|(?P<brace>[{}])"
)
_PATH_ATTR = re.compile(
    rf'#\[path\s*=\s*"([^"]+)"\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+({_IDENT})\s*;'
)
_RAW_STRING = re.compile(r'b?r(#*)"')
_CHAR = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'")


def _strip_rust(text: str) -> str:
    """The code with comments (doc comments too), string and char literals blanked."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                step = 2 if text.startswith(("/*", "*/"), j) else 1
                depth += (text.startswith("/*", j)) - (text.startswith("*/", j))
                j += step
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        raw = _RAW_STRING.match(text, i)
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find('"' + raw.group(1), raw.end())
            j = n if end < 0 else end + 1 + len(raw.group(1))
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
            continue
        char = _CHAR.match(text, i) if text[i] == "'" else None
        if char:
            out.append("' '")
            i = char.end()
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _use_paths(tree: str) -> list[tuple[list[str], str | None]]:
    """``a::{b, c::d as e, f::*}`` -> ``([a, b], "b"), ([a, c, d], "e"), ([a, f], None)``
    (None: a glob)."""
    out: list[tuple[list[str], str | None]] = []

    def split_top(body: str) -> list[str]:
        parts, depth, cur = [], 0, ""
        for ch in body:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += (ch == "{") - (ch == "}")
            cur += ch
        return [p.strip() for p in [*parts, cur] if p.strip()]

    def walk(prefix: list[str], item: str) -> None:
        if "{" in item:
            head, _, body = item.partition("{")
            for part in split_top(body.rstrip().removesuffix("}")):
                walk(prefix + [x for x in head.replace(" ", "").split("::") if x], part)
            return
        name, _, alias = item.partition(" as ")
        segs = prefix + [x for x in name.replace(" ", "").split("::") if x]
        if segs[-1:] == ["*"]:
            out.append((segs[:-1], None))
        elif segs[-1:] == ["self"] and len(segs) > 1:
            out.append((segs[:-1], alias.strip() or segs[-2]))
        elif segs:
            out.append((segs, alias.strip() or segs[-1]))

    walk([], re.sub(r"\s+", " ", tree).strip().removeprefix("::"))
    return out


@dataclass
class _RustModule:
    file: Mod  # the file module it is written in: itself, unless inline
    path: Path
    children: dict[str, Mod] = field(default_factory=dict)
    uses: dict[str, list[str]] = field(default_factory=dict)  # name -> path as written
    paths: list[list[str]] = field(default_factory=list)  # every path it writes


def _rust_modules() -> dict[Mod, _RustModule]:
    """Every module of the crate, from lib.rs's ``mod`` declarations down."""
    found: dict[Mod, _RustModule] = {}

    def load(name: Mod, path: Path) -> None:
        raw = path.read_text()
        folder = path.parent if path.name in ("mod.rs", "lib.rs") else path.with_suffix("")
        attrs = {m.group(2): m.group(1) for m in _PATH_ATTR.finditer(raw)}
        found[name] = _RustModule(name, path)
        scopes: list[tuple[Mod, int]] = [(name, 0)]  # inline modules open, with their depth
        depth = 0
        files: list[tuple[Mod, Path]] = []
        for m in _TOKEN.finditer(_strip_rust(raw)):
            scope = scopes[-1][0]
            if m.group("brace") == "{":
                depth += 1
            elif m.group("brace") == "}":
                depth -= 1
                if len(scopes) > 1 and depth < scopes[-1][1]:
                    scopes.pop()
            elif m.group("mod"):
                child = (*scope, m.group("name"))
                found[scope].children[m.group("name")] = child
                if m.group("end") == "{":
                    depth += 1
                    found[child] = _RustModule(child, path)
                    scopes.append((child, depth))
                elif m.group("name") in attrs:
                    files.append((child, path.parent / attrs[m.group("name")]))
                else:
                    base = folder.joinpath(*scope[len(name) :], m.group("name"))
                    single = base.with_suffix(".rs")
                    files.append((child, single if single.exists() else base / "mod.rs"))
            elif m.group("use"):
                for segs, alias in _use_paths(m.group("tree")):
                    found[scope].paths.append(segs)
                    if alias is not None:
                        found[scope].uses[alias] = segs
            elif m.group("path"):
                found[scope].paths.append(re.sub(r"\s+", "", m.group("path")).split("::"))
        for child, file in files:
            load(child, file)

    load((), CRATE / "lib.rs")
    return found


def _rust_target(
    mods: dict[Mod, _RustModule], scope: Mod, segs: list[str], hops: int = 0
) -> Mod | None:
    """The module a path written in ``scope`` lands in (re-exports followed), or None
    when it is not the crate's (std, a dependency, a local type's associated item)."""
    head, rest = segs[0], segs[1:]
    if hops > 8:
        return None
    if head == "crate":
        base: Mod = ()
    elif head in ("self", "super"):
        base = scope
        rest = segs
        if head == "self":
            rest = segs[1:]
        while rest[:1] == ["super"]:
            base, rest = base[:-1], rest[1:]
    elif head in mods[scope].children:
        base = mods[scope].children[head]
    elif head in mods[scope].uses and mods[scope].uses[head] != [head]:
        return _rust_target(mods, scope, mods[scope].uses[head] + rest, hops + 1)
    else:
        return None
    while rest and (*base, rest[0]) in mods:
        base, rest = (*base, rest[0]), rest[1:]
    if rest and rest[0] in mods[base].uses:  # a re-export: where the name comes from
        again = _rust_target(mods, base, mods[base].uses[rest[0]] + rest[1:], hops + 1)
        if again is not None:
            return again
    return base


def _rust_name(module: Mod) -> str:
    return "::".join(("crate", *module))


def _rust_graph() -> dict[str, set[str]]:
    mods = _rust_modules()
    graph: dict[str, set[str]] = {_rust_name(m): set() for m in mods}
    for name, mod in mods.items():
        for segs in mod.paths:
            target = _rust_target(mods, name, segs)
            # a module's own folder (an ancestor) is not an edge: see the module docs
            if target is not None and target != name[: len(target)]:
                graph[_rust_name(name)].add(_rust_name(target))
    return graph


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


def _report(language: str, graph: dict[str, set[str]], known: dict[frozenset[str], str]) -> bool:
    """Prints the circles of ``graph``; True when one is not in ``known`` or one listed
    there is gone."""
    cycles = _cycles(graph)
    edges = sum(len(v) for v in graph.values())
    print(f"{language}: {len(graph)} modules, {edges} imports between them")
    failed = False
    for component in cycles:
        why = known.get(frozenset(component))
        print(("known" if why else "NEW") + " import circle: " + " <-> ".join(component))
        for a in component:
            for b in sorted(graph[a] & set(component)):
                print(f"    {a} imports {b}")
        if why:
            print(f"    ({why})")
        failed |= why is None
    gone = set(known) - {frozenset(c) for c in cycles}
    for component in sorted(sorted(c) for c in gone):
        print("listed as known but gone (delete its line): " + " <-> ".join(component))
    return failed or bool(gone)


def main() -> int:
    modules = _modules()
    python = {name: _edges(name, path, modules) for name, path in modules.items()}
    failed = _report("Python", python, KNOWN)
    failed |= _report("Rust", _rust_graph(), RUST_KNOWN)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
