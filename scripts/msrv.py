"""Check the crate's ``rust-version`` (its MSRV) against what its dependency graph needs.

    python3 scripts/msrv.py            # run by scripts/test.sh (step "msrv")

Only one Rust toolchain is installed on the project's machines, so the MSRV cannot be
checked by building with an older compiler here. It is checked in two halves instead:

1. this script: ``cargo metadata`` resolves the dependency graph (all features, the
   committed ``Cargo.lock``); every package reachable from ``hscache`` through normal and
   build dependencies declares its own ``rust-version``; the crate cannot build with a
   compiler older than the largest of them, so ``Cargo.toml``'s ``rust-version`` must be at
   least that. Dev-dependencies (proptest, criterion) only build the tests and benches;
   their largest ``rust-version`` is printed as the MSRV of ``cargo test``.
2. clippy's ``incompatible_msrv`` lint (on by default, ``-D warnings`` in scripts/test.sh):
   no standard-library item stabilised after ``rust-version`` is used by the crate's code.

CI's ``msrv`` job (``.github/workflows/ci.yml``) then builds the library with exactly that
toolchain. Exits 1 when ``rust-version`` is lower than the dependency graph needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _show(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def _reachable(meta: dict[str, Any], root: str, kinds: set[str | None]) -> set[str]:
    """Package ids reachable from ``root`` through dependency edges of the given kinds."""
    nodes = {node["id"]: node for node in meta["resolve"]["nodes"]}
    seen = {root}
    todo = [root]
    while todo:
        for dep in nodes[todo.pop()]["deps"]:
            if dep["pkg"] in seen:
                continue
            if any(k["kind"] in kinds for k in dep["dep_kinds"]):
                seen.add(dep["pkg"])
                todo.append(dep["pkg"])
    return seen


def _floor(meta: dict[str, Any], ids: set[str], root: str) -> tuple[tuple[int, ...], list[str]]:
    """The largest ``rust-version`` among ``ids`` (the root excluded) and who declares it."""
    best: tuple[int, ...] = (0,)
    who: list[str] = []
    for pkg in meta["packages"]:
        if pkg["id"] not in ids or pkg["id"] == root or not pkg.get("rust_version"):
            continue
        v = _version(pkg["rust_version"])[:2]
        if v > best:
            best, who = v, []
        if v == best:
            who.append(f"{pkg['name']} {pkg['version']}")
    return best, who


def main() -> int:
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--all-features", "--locked"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    meta = json.loads(out)
    root = meta["resolve"]["root"]
    claimed_text = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["rust-version"]
    claimed = _version(claimed_text)[:2]
    build_floor, build_who = _floor(meta, _reachable(meta, root, {None, "build"}), root)
    test_floor, test_who = _floor(meta, _reachable(meta, root, {None, "build", "dev"}), root)
    print(f"Cargo.toml rust-version: {claimed_text}")
    print(f"library (all features) needs >= {_show(build_floor)}: {', '.join(build_who)}")
    print(f"cargo test / bench need    >= {_show(test_floor)}: {', '.join(test_who)}")
    if claimed < build_floor:
        print(f"FAIL: rust-version {claimed_text} is below what the dependencies need")
        return 1
    if claimed > build_floor:
        print("note: rust-version is above the dependencies' floor (the crate's own code")
        print("      must need it: say why in Cargo.toml)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
