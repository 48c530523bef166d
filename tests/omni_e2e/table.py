"""Prints the table of hscache's vllm-omni end-to-end run from its JSONs (``scripts/omni_e2e.sh``).

One row per arm: requests served, the thinker's and the talker's cached tokens (all
rounds), how many requests' talker tokens equal the cold run's, the thinker's preemptions,
the most identical prompts it scheduled in one step (and how many hit a twin's blocks
then), the requests it aborted (and the KV blocks they held), stage-engine start and
per-round wall times. The ``hybrid`` arm's row counts its warm requests (rounds ``seed`` and
``hits``), compared with their cold references in its ``reference`` round.
Usage: ``python tests/omni_e2e/table.py RESULTS_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _talker(arm: dict[str, Any]) -> dict[tuple[int, str], list[int]]:
    return {
        (i, name): rec["talker_token_ids"]
        for i, rnd in enumerate(arm["rounds"])
        for name, rec in rnd["requests"].items()
        if "talker_token_ids" in rec  # not the aborted request
    }


def rows(results: Path) -> list[list[str]]:
    out = []
    # The default (async) scheduler's arms first, then the "-sync" ones.
    for cold_path in sorted(results.glob("cold*.json"), key=lambda p: (p.stem != "cold", p.stem)):
        suffix = cold_path.stem.removeprefix("cold")
        cold = _talker(json.loads(cold_path.read_text()))
        for name in ("cold", "omni", "hscache", "talker_pc", "talker_pc_fixed"):
            path = results / f"{name}{suffix}.json"
            if not path.exists():
                continue
            arm = json.loads(path.read_text())
            reqs = [
                r
                for rnd in arm["rounds"]
                for r in rnd["requests"].values()
                if "talker_token_ids" in r
            ]
            thinker = arm["rounds"][-1].get("thinker", {})
            talker = _talker(arm)
            same = sum(talker[k] == cold.get(k) for k in talker)
            out.append(
                [
                    name + suffix,
                    "sync" if not arm["async_scheduling"] else "async",
                    str(len(reqs)),
                    str(sum(int(r["thinker_num_cached_tokens"] or 0) for r in reqs)),
                    str(sum(int(r.get("talker_num_cached_tokens") or 0) for r in reqs)),
                    f"{same}/{len(talker)}",
                    str(
                        sum(
                            s.get("preemptions", 0)
                            for p in arm.get("probes", [])
                            for s in p["schedulers"]
                            if s["stage"] == "thinker"
                        )
                    ),
                    f"{thinker.get('same_step_max', 0)} ({thinker.get('same_step_hits', 0)})",
                    f"{thinker.get('aborted', 0)} ({thinker.get('aborted_blocks', 0)})",
                    f"{arm['start_s']:.0f} s",
                    " / ".join(f"{r['wall_s']:.2f} s" for r in arm["rounds"]),
                ]
            )
    hybrid = results / "hybrid.json"
    if hybrid.exists():
        out.append(_hybrid_row(json.loads(hybrid.read_text())))
    return out


def _hybrid_row(arm: dict[str, Any]) -> list[str]:
    rounds = {rnd["kind"]: rnd for rnd in arm["rounds"]}
    reference = rounds["reference"]["requests"]
    warm = {
        f"{kind}/{name}": rec
        for kind in ("seed", "hits")
        for name, rec in rounds[kind]["requests"].items()
    }
    same = sum(
        rec["talker_token_ids"] == reference.get(key, {}).get("talker_token_ids")
        for key, rec in warm.items()
    )
    thinker = rounds["reference"].get("thinker", {})
    return [
        "hybrid",
        "sync" if not arm["async_scheduling"] else "async",
        str(len(warm)),
        str(sum(int(r["thinker_num_cached_tokens"] or 0) for r in warm.values())),
        str(sum(int(r.get("talker_num_cached_tokens") or 0) for r in warm.values())),
        f"{same}/{len(warm)} (reference)",
        str(thinker.get("preemptions", 0)),
        f"{thinker.get('same_step_max', 0)} ({thinker.get('same_step_hits', 0)})",
        f"{thinker.get('aborted', 0)} ({thinker.get('aborted_blocks', 0)})",
        f"{arm['start_s']:.0f} s",
        " / ".join(f"{r['wall_s']:.2f} s" for r in arm["rounds"]),
    ]


def main(argv: list[str]) -> int:
    head = [
        "arm",
        "scheduler",
        "requests",
        "thinker cached tokens",
        "talker cached tokens",
        "talker tokens = cold",
        "thinker preemptions",
        "same-step twins (hits)",
        "aborted (blocks held)",
        "stage start",
        "wall per round",
    ]
    table = [head, *rows(Path(argv[0]))]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for n, row in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
