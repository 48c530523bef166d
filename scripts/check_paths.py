"""Fail when a repository path that a doc, a script or a source file's header names does not
exist, or when a shell script calls a project function that nothing it sources defines.

    python scripts/check_paths.py          # run by scripts/test.sh (step "paths")

Reads every Markdown file of the repository whole (``README.md``, ``CONTRIBUTING.md``,
``docs/*.md``, ``tests/vllm_upstream/README.md``, ...; of ``CHANGELOG.md`` the
``[Unreleased]`` section only: a released entry records the tree of its release), every
shell script whole (``scripts/*.sh``, ``tests/**/*.sh``, ``.ci/run``), and the header of
every source file: the leading ``//!`` lines of each Rust file (``src``, ``tests``,
``benches``, ``fuzz``, ``examples``) and the module docstring of each Python file
(``python``, ``tools``, ``tests``, ``scripts``, ``benches``, ``examples``).

A repository path is a word that starts with one of the repository's top-level folders
(``src/pool/mod.rs``, ``tests/vllm_diff/``, ``scripts/test.sh:12``) or with ``hscache/``
(the package, under ``python/``) or ``hscache_tools/`` (the tools, under ``tools/``); in a
Rust header, also a bare ``name.rs`` or ``folder/name.rs`` next to the file or under
``src/`` (``coordinator.rs`` in ``src/manager/``). ``{a,b}`` is expanded; a word with a glob,
a placeholder or a shell expansion (``*``, ``<type>``, ``...``, ``$``), a URL and a path
outside the repository (``../shared/DESIGN.md``) are skipped, as are vLLM's own paths that
``EXTERNAL`` lists (``tests/v1/`` in vLLM's sdist). ``:line`` and ``::name`` suffixes are
dropped. Prints every missing path with where it is named.

Shell functions: in each shell script, a command whose name is a function defined in some
script of the repository, or is named like the project's functions (``_hs_*``, ``_hv_*``,
``hscache_*``), must be defined in that script or in a file it sources (``source FILE`` /
``. FILE``, followed through ``$HSCACHE_ROOT`` and ``$(dirname "${BASH_SOURCE[0]}")``, and
on into what those source) -- the bug of a script calling a function that moved away
(``scripts/bench.sh`` called ``_hs_quiet`` after the quiet runner moved to
``scripts/quiet.sh``, and exited 127 on the one branch that called it). A sourced file
that does not exist is reported too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUST_DIRS = ("src", "tests", "benches", "fuzz", "examples")
PYTHON_DIRS = ("python", "tools", "tests", "scripts", "benches", "examples")
SHELL_DIRS = ("scripts", "tests", ".ci")
SKIP_DIRS = ("target", "vllm_upstream_sdist", ".git", "node_modules", ".venv")
# Top-level folders whose paths are checked; `hscache/` and `hscache_tools/` are the
# packages' own shorthands.
TOP = (
    "src",
    "python",
    "tools",
    "tests",
    "docs",
    "scripts",
    "benches",
    "examples",
    "fuzz",
    "requirements",
)
PACKAGES = {"hscache/": "python/", "hscache_tools/": "tools/"}
# Project shell functions by name: a call of one must find its definition.
_PROJECT_FUNCTION = re.compile(r"^(_hs_|_hv_|hscache_)\w+$")
# Paths with these prefixes are vLLM's (its sdist's test tree), not this repository's.
EXTERNAL = ("tests/v1/", "tests/v1")

_WORD = re.compile(r"(?<![\w./~$}-])((?:\.\./)?[\w.-]+/[\w./{},*<>-]*|[\w-]+\.rs)(?=[^\w]|$)")
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
        if any(s in word for s in ("*", "<", ">", "...", "//", "$")) or word.startswith("../"):
            continue
        for path in _expand(word):
            first = path.split("/", 1)[0]
            if first in TOP or path.startswith(tuple(PACKAGES)):
                if not path.startswith(EXTERNAL):
                    found.append((path, False))
            elif rust_header and path.endswith(".rs"):
                found.append((path, True))
    return found


def _build_output(path: str) -> bool:
    """A path git ignores (``*.so``, ``target/``): a build output, which a fresh clone has
    only once it is built, so it need not exist for a doc to name it."""
    ignored = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", path], check=False
    )
    return ignored.returncode == 0


def _exists(path: str, bare: bool, source: Path) -> bool:
    for package, folder in PACKAGES.items():
        if path.startswith(package):
            path = folder + path
            break
    if not bare:
        return (ROOT / path).exists() or _build_output(path)
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


def _skipped(path: Path) -> bool:
    return any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts)


def _docs() -> list[Path]:
    """Every Markdown file of the repository."""
    return [p for p in sorted(ROOT.rglob("*.md")) if not _skipped(p)]


def _doc_text(path: Path) -> str:
    """A doc's text to check; of the changelog, the unreleased section (released entries
    name the tree of their release). Lines keep their numbers."""
    text = path.read_text()
    if path.name != "CHANGELOG.md":
        return text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^## \[\d", line):
            return "\n".join(lines[:i])
    return text


def _shell_scripts() -> list[Path]:
    """Every shell script: ``*.sh`` under the script folders, and ``.ci/run``."""
    found = [p for d in SHELL_DIRS for p in sorted((ROOT / d).rglob("*.sh")) if not _skipped(p)]
    run = ROOT / ".ci" / "run"
    if run.is_file():
        found.append(run)
    return found


def _sources() -> list[tuple[Path, str, bool]]:
    """(file, the text to check, is it a Rust header)."""
    out = [(doc, _doc_text(doc), False) for doc in _docs()]
    out += [(script, script.read_text(), False) for script in _shell_scripts()]
    for folder, suffix, header in (
        *((d, ".rs", _rust_header) for d in RUST_DIRS),
        *((d, ".py", _python_header) for d in PYTHON_DIRS),
    ):
        for path in sorted((ROOT / folder).rglob(f"*{suffix}")):
            if not _skipped(path):
                out.append((path, header(path), suffix == ".rs"))
    return out


_DEFINITION = re.compile(r"^\s*(?:function\s+)?([A-Za-z_][\w-]*)\s*\(\)\s*\{?", re.M)
_SOURCE = re.compile(r"(?:^|[\s;&|(])(?:source|\.)\s+(\"[^\"]+\"|'[^']+'|[^\s;&|)]+)")
# What separates commands on a line; the word after one is at command position.
_SEPARATORS = re.compile(r"&&|\|\||[;|&(){}`!]|\$\(|\b(?:then|do|else|if|elif|while|until)\b")
# Words that run the next word as the command.
_PREFIXES = {"exec", "command", "builtin", "nice", "time", "env", "timeout", "xargs"}


def _code_lines(text: str, script: Path | None = None) -> list[str]:
    """The script's lines without comments (a ``#`` at a word's start), single-quoted text
    and fd redirections (``{fd}>``); with ``script``, its folder for
    ``$(dirname "${BASH_SOURCE[0]}")``."""
    out = []
    for line in text.splitlines():
        if script is not None:
            line = line.replace('$(dirname "${BASH_SOURCE[0]}")', str(script.parent))
        line = re.sub(r"\{\w+\}[<>]", "", line)
        line = re.sub(r"'[^']*'", "''", line)
        line = re.sub(r"(^|\s)#.*$", "", line)
        out.append(line)
    return out


def _resolve_source(word: str, script: Path) -> Path | None:
    """The file a ``source`` word names (relative to the repository root, where the
    scripts ``cd``, or to the script), or None for one built at run time."""
    word = word.strip("\"'")
    word = re.sub(r"\$\{?HSCACHE_ROOT\}?", str(ROOT), word)
    word = re.sub(r'\$\(dirname "?\$\{BASH_SOURCE\[0\]\}"?\)', str(script.parent), word)
    word = word.replace('"', "")
    if "$" in word or "*" in word:
        return None
    path = Path(word)
    if path.is_absolute():
        return path
    for base in (ROOT, script.parent):
        if (base / path).is_file():
            return base / path
    return ROOT / path


def _called(text: str) -> set[str]:
    """The words at command position of a script's code."""
    called = set()
    for line in _code_lines(text):
        for segment in _SEPARATORS.split(line):
            words = segment.split()
            while words and (
                re.match(r"^\w+=", words[0]) or words[0] in _PREFIXES or words[0].isdigit()
            ):
                words = words[1:]
            if words and re.match(r"^[A-Za-z_][\w-]*$", words[0]):
                called.add(words[0])
    return called


def check_shell_functions() -> list[str]:
    """One message per call of a project function that the calling script neither defines
    nor sources, and per sourced file that does not exist."""
    scripts = _shell_scripts()
    defined = {p: set(_DEFINITION.findall(p.read_text())) for p in scripts}
    anywhere = set().union(*defined.values()) if defined else set()
    problems = []
    for script in scripts:
        seen: set[Path] = set()
        todo = [script]
        names: set[str] = set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            text = current.read_text()
            names |= set(_DEFINITION.findall(text))
            for word in _SOURCE.findall("\n".join(_code_lines(text, current))):
                target = _resolve_source(word, current)
                if target is None:
                    continue
                if not target.is_file():
                    where = current.relative_to(ROOT)
                    problems.append(f"{where}: sources {word.strip(chr(34))}, which does not exist")
                    continue
                todo.append(target)
        for name in sorted(_called(script.read_text())):
            if (name in anywhere or _PROJECT_FUNCTION.match(name)) and name not in names:
                problems.append(
                    f"{script.relative_to(ROOT)}: calls {name}, which neither it nor a file "
                    "it sources defines"
                )
    return problems


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
                    whole = source.suffix in (".md", ".sh") or source.parent.name == ".ci"
                    at = f"{where}:{lineno}" if whole else f"{where} (header)"
                    print(f"{at}: names {path}, which does not exist")
    print(f"{checked} paths named, {missing} missing")
    problems = check_shell_functions()
    for problem in problems:
        print(problem)
    print(f"{len(_shell_scripts())} shell scripts' function calls checked, {len(problems)} wrong")
    return 1 if missing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
