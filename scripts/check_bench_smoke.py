"""Judge one ``bash scripts/bench.sh --quick --json FILE --plot FILE.png`` run (the
``bench-smoke`` step of scripts/test.sh, run by scripts/bench_smoke.sh).

    python scripts/check_bench_smoke.py LOG JSON PNG

Fails (exit 1, every problem printed) unless: the log says the decisions were identical at
every step and names no fallback or divergence; it holds no carriage return (redirected
to a file, the progress display is one line per scenario run, not a redrawn bar) and one
progress line per scenario run; the JSON has every quick scenario on the drop-in path and
every full-attention one on the batched path, each with a finite positive ratio, and its
candidate was hscache's own manager; the PNG is a real PNG (its signature and IHDR chunk)
of a sane size. Reads only the files; imports nothing of hscache.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from a PNG's IHDR chunk; None if ``data`` is not a PNG."""
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def check(log: str, doc: dict[str, Any], png: bytes) -> list[str]:
    problems = []
    if "decisions identical at every step." not in log:
        problems.append("the log does not say 'decisions identical at every step.'")
    for bad in ("DIVERGENCE", "a fallback to the reference manager", "Traceback"):
        if bad in log:
            problems.append(f"the log contains {bad!r}")
    if "\r" in log:
        problems.append("the log holds carriage returns (a progress bar redrawn into a file)")

    meta = doc.get("meta", {})
    if not meta.get("quick"):
        problems.append("the JSON's meta does not say --quick")
    if meta.get("candidate_fallback_scenarios"):
        problems.append(f"candidate fell back in {meta['candidate_fallback_scenarios']}")
    if "release" not in str(meta.get("build_profile", "")):
        problems.append(f"hscache._core is not a release build: {meta.get('build_profile')}")
    entries = doc.get("scenarios", [])
    by_path: dict[str, set[str]] = {}
    for e in entries:
        name, path, ratio = e.get("name"), e.get("path"), e.get("ratio")
        by_path.setdefault(str(path), set()).add(str(name))
        if not isinstance(ratio, int | float) or not math.isfinite(ratio) or ratio <= 0:
            problems.append(f"{name} ({path}): no ratio ({ratio!r})")
        elif not re.search(rf"{re.escape(str(name))}\b", log):
            problems.append(f"{name}: not in the log")
    drop_in = by_path.get("drop-in", set())
    configs = {e["name"]: e.get("config", {}) for e in entries if "name" in e}
    full = {n for n, c in configs.items() if c.get("layout", "full") == "full"}
    if len(drop_in) < 3:
        problems.append(f"drop-in path: {len(drop_in)} scenarios ({sorted(drop_in)}), want 3")
    if by_path.get("batched", set()) != full or not full:
        problems.append(
            f"batched path: {sorted(by_path.get('batched', set()))}, want the full-attention "
            f"scenarios {sorted(full)}"
        )
    progress = re.findall(r"^  \S.*: (\d+)/\1 steps in [\d.]+ s$", log, flags=re.M)
    if len(progress) != len(entries):
        problems.append(
            f"{len(progress)} one-line progress reports for {len(entries)} scenario runs"
        )

    size = png_size(png)
    if size is None:
        problems.append("the plot is not a PNG (signature / IHDR)")
    else:
        w, h = size
        if not (300 <= w <= 10_000 and 200 <= h <= 10_000) or len(png) < 5_000:
            problems.append(f"the plot's size is not sane: {w}x{h}, {len(png)} bytes")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    log_path, json_path, png_path = (Path(a) for a in argv)
    missing = [str(p) for p in (log_path, json_path, png_path) if not p.is_file()]
    if missing:
        print(f"bench-smoke: missing {', '.join(missing)}")
        return 1
    log = log_path.read_text(errors="replace")
    problems = check(log, json.loads(json_path.read_text()), png_path.read_bytes())
    for p in problems:
        print(f"bench-smoke: {p}")
    if problems:
        return 1
    doc = json.loads(json_path.read_text())
    ratios = ", ".join(f"{e['name']} ({e['path']}) {e['ratio']:.2f}x" for e in doc["scenarios"])
    print(f"bench-smoke: ok; ratios: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
