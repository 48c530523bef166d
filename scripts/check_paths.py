"""Fail when a repository path that the docs or a source file's header names does not exist.

    python scripts/check_paths.py          # run by scripts/test.sh (step "paths")

Reads ``docs/architecture.md`` (the concept map), ``CONTRIBUTING.md`` and ``README.md``
whole, and the header of every source file: the leading ``//!`` lines of each Rust file
(``src``, ``tests``, ``benches``, ``fuzz``, ``examples``) and the module docstring of
each Python file (``python``, ``tests``, ``scripts``, ``benches``, ``examples``).

A repository path is a word that starts with one of the repository's top-level folders
(``src/pool/mod.rs``, ``tests/vllm_diff/``, ``scripts/test.sh:12``) or with ``hscache/``
(the package, under ``python/``); in a Rust header, also a bare ``name.rs`` or
``folder/name.rs`` next to the file or under ``src/`` (``coordinator.rs`` in
``src/manager/``). ``{a,b}`` is expanded; a word with a glob or a placeholder (``*``,
``<type>``, ``...``), a URL and a path outside the repository (``../shared/DESIGN.md``)
are skipped, as are vLLM's own paths that ``EXTERNAL`` lists (``tests/v1/`` in vLLM's
sdist). ``:line`` and ``::name`` suffixes are dropped. Prints every missing path with
where it is named.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/architecture.md", "CONTRIBUTING.md", "README.md")
RUST_DIRS = ("src", "tests", "benches", "fuzz", "examples")
PYTHON_DIRS = ("python", "tests", "scripts", "benches", "examples")
SKIP_DIRS = ("target", "vllm_upstream_sdist")
# Top-level folders whose paths are checked; `hscache/` is the package's own shorthand.
TOP = ("src", "python", "tests", "docs", "scripts", "benches", "examples", "fuzz", "requirements")
PACKAGE = "hscache/"
# Paths with these prefixes are vLLM's (its sdist's test tree), not this repository's.
EXTERNAL = ("tests/v1/", "tests/v1")

_WORD = re.compile(r"(?<![\w./~-])((?:\.\./)?[\w.-]+/[\w./{},*<>-]*|[\w-]+\.rs)(?=[^\w]|$)")
_BRACES = re.compile(r"\{([^{}]*)\}")


def _expand(word: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``."""
    m = _BRACES.search(word)
    if m is None:
        return [word]
    return [
        out
        for alt in m.group(1).split(",")
        for out in _expand(word[: m.start()] + alt.strip() + word[m.end() :])
    ]


def _candidates(text: str, rust_header: bool) -> list[tuple[str, bool]]:
    """(word, bare) for every word of ``text`` that names a repository path; ``bare``:
    a Rust header's name relative to its file."""
    found: list[tuple[str, bool]] = []
    for m in _WORD.finditer(text):
        word = re.sub(r"(::[\w.]*|:\d+(-\d+)?)$", "", m.group(1)).rstrip(".,;:)")
        if any(s in word for s in ("*", "<", ">", "...", "//")) or word.startswith("../"):
            continue
        for path in _expand(word):
            first = path.split("/", 1)[0]
            if first in TOP or path.startswith(PACKAGE):
                if not path.startswith(EXTERNAL):
                    found.append((path, False))
            elif rust_header and path.endswith(".rs"):
                found.append((path, True))
    return found


def _exists(path: str, bare: bool, source: Path) -> bool:
    if path.startswith(PACKAGE):
        path = "python/" + path
    if not bare:
        return (ROOT / path).exists()
    folder = source.parent if source.name in ("mod.rs", "lib.rs") else source.with_suffix("")
    return any((base / path).exists() for base in (source.parent, folder, ROOT / "src"))


def _rust_header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("//!"):
            lines.append(line[3:])
        elif line.strip() and not line.startswith("#!["):
            break
    return "\n".join(lines)


def _python_header(path: Path) -> str:
    try:
        return ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    except SyntaxError:
        return ""


def _sources() -> list[tuple[Path, str, bool]]:
    """(file, the text to check, is it a Rust header)."""
    out = [(ROOT / doc, (ROOT / doc).read_text(), False) for doc in DOCS]
    for folder, suffix, header in (
        *((d, ".rs", _rust_header) for d in RUST_DIRS),
        *((d, ".py", _python_header) for d in PYTHON_DIRS),
    ):
        for path in sorted((ROOT / folder).rglob(f"*{suffix}")):
            if not any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts):
                out.append((path, header(path), suffix == ".rs"))
    return out


def main() -> int:
    missing = 0
    checked = 0
    for source, text, rust in _sources():
        for lineno, line in enumerate(text.splitlines(), 1):
            for path, bare in _candidates(line, rust):
                checked += 1
                if not _exists(path, bare, source):
                    missing += 1
                    where = source.relative_to(ROOT)
                    at = f"{where}:{lineno}" if source.suffix == ".md" else f"{where} (header)"
                    print(f"{at}: names {path}, which does not exist")
    print(f"{checked} paths named, {missing} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
