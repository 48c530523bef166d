"""CONTRIBUTING.md names every step of ``scripts/test.sh``, so that its list of what the
suite runs stays the suite's: a step added to the script and not to the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_contributing_names_every_test_step() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    steps = re.findall(r"^step(?:_after \S+)? (\S+)", script, re.M)
    assert len(steps) >= 25, steps
    page = (ROOT / "CONTRIBUTING.md").read_text()
    named = set(re.findall(r"`([\w-]+)`", page))
    missing = [s for s in steps if s not in named]
    assert not missing, f"scripts/test.sh steps CONTRIBUTING.md does not name: {missing}"
