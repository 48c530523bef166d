"""The router check's verdict and table (``tests/e2e/router.py``): every difference from
the expectations and between the arms, and the README's Markdown table. ``dense`` names
the workers of the dense model (``"dense"`` in the indexer), whose scores have exact
expectations; worker 2 is the one with the small pool and the reset, as the scenario
(``Arm.run``) has it."""

from __future__ import annotations

import re
from typing import Any

HSCACHE_MANAGER = "hscache.vllm.kv_cache_manager.KVCacheManager"
HSCACHE_PUBLISHER = "hscache.vllm.publisher.NonBlockingPublisher"


def judge(arms: dict[str, dict[str, Any]], dense: tuple[int, ...]) -> list[str]:
    """Every difference: from the expectations (dense workers), between the arms (all)."""
    problems: list[str] = []
    base_name = next(iter(arms))
    base = arms[base_name]
    for name, r in arms.items():
        for point in r["syncs"]:
            for probe, d in point["probes"].items():
                if not probe.startswith("dense/"):
                    continue  # the hybrid's scores are reported, and compared across arms
                exp = {int(k): v for k, v in d["expected"].items()}
                got = {int(k): v for k, v in d["scores"].items()}
                if got != exp:
                    problems.append(
                        f"{name}/{point['label']}/{probe}: scores {got}, expected {exp}"
                    )
        for key, ref in (("dump", "reference"), ("dump_after_replay", "reference_after_replay")):
            for w in dense:
                if not dump_matches(r[key], r[ref], w):
                    problems.append(f"{name}: {key}, worker {w}: not the engine's event state")
        dense_bad = [
            x for x in r["bad_lines"] if any(re.search(rf"worker_id={w}\b", x) for w in dense)
        ]
        if dense_bad:
            problems.append(f"{name}: indexer log: {dense_bad[:3]}")
        if any("Gap detected" in x or "parent" in x for x in r["bad_lines"]):
            problems.append(f"{name}: indexer log has gap or missing-parent lines")
        if r["replay"]["bad_lines"] != r["bad_lines"]:
            problems.append(
                f"{name}: the restarted indexer's log differs: {r['replay']['bad_lines'][:3]}"
            )
        if r["replay"]["replays"] < len(r["engines"]):
            problems.append(f"{name}: the restarted indexer replayed {r['replay']}")
        if r["stream_problems"]:
            problems.append(f"{name}: event stream: {r['stream_problems'][:3]}")
        s2 = r["stream"]["2"]
        if s2["removed"] == 0 or s2["cleared"] == 0:
            problems.append(f"{name}: worker 2 saw no eviction or no clear ({s2})")
        preempt = r["phases"]["pressure"]["2"]["counters"].get("vllm:num_preemptions", 0)
        if preempt <= 0:
            problems.append(f"{name}: the pressure phase preempted nothing")
        if not r["phases"]["reset"]["reset"]:
            problems.append(f"{name}: reset_prefix_cache failed")
        for w, e in r["engines"].items():
            hscache_arm = name != "stock"
            manager = HSCACHE_MANAGER if hscache_arm else "vllm.v1.core.kv_cache_manager."
            if not e["manager"].startswith(manager):
                problems.append(f"{name}/worker {w}: served by {e['manager']}")
            if hscache_arm and e["publisher"] != HSCACHE_PUBLISHER:
                problems.append(f"{name}/worker {w}: publisher {e['publisher']}")
            if hscache_arm and e.get("hscache_calls", {}).get("allocate_slots", 0) <= 0:
                problems.append(f"{name}/worker {w}: hscache counted no allocate_slots call")
        if name == base_name:
            continue
        for a, b in zip(r["syncs"], base["syncs"], strict=True):
            for probe in a["probes"]:
                x, y = a["probes"][probe], b["probes"][probe]
                if (x["scores"], x["pick"]) != (y["scores"], y["pick"]):
                    problems.append(f"{name}/{a['label']}/{probe}: differs from {base_name}")
        for key in ("dump", "dump_after_replay", "reference", "reference_after_replay"):
            if r[key] != base[key]:
                problems.append(f"{name}: {key} differs from {base_name}")
        if len(r["bad_lines"]) != len(base["bad_lines"]):
            problems.append(f"{name}: the indexer's log differs from {base_name}'s")
        for phase, d in r["phases"].items():
            if phase == "reset":
                continue
            for w, x in d.items():
                y = base["phases"][phase][w]
                if [q["output"] for q in x["requests"]] != [q["output"] for q in y["requests"]]:
                    problems.append(f"{name}/{phase}/worker {w}: output tokens differ")
                if [q["num_cached_tokens"] for q in x["requests"]] != [
                    q["num_cached_tokens"] for q in y["requests"]
                ]:
                    problems.append(f"{name}/{phase}/worker {w}: num_cached_tokens differ")
                if x["counters"] != y["counters"]:
                    problems.append(f"{name}/{phase}/worker {w}: prefix-cache counters differ")
        if name != "compact" and r["trace"] != base["trace"]:
            problems.append(f"{name}: the KV event stream differs from {base_name}'s")
    return problems


def dump_matches(
    dump: dict[str, Any], ref: dict[Any, Any], worker: int, model_name: str = "dense"
) -> bool:
    """The indexer holds, for the worker, one node per distinct token path its events
    left stored, each under one of the hashes stored there."""
    per = dump.get(model_name, {})
    blocks = per.get(str(worker), per.get(worker, []))
    want = ref.get(str(worker), ref.get(worker))
    hashes = {b[0] for b in blocks}
    return len(blocks) == want["nodes"] and hashes <= set(want["hashes"])


def table(arms: dict[str, dict[str, Any]], problems: list[str], dense: tuple[int, ...]) -> str:
    """The README's table: one row per arm."""
    rows = [
        "| arm | sync points | dense probes = expected | picks (per sync point) | "
        "`/dump` = events | restart: replays, `/dump` before -> after | "
        "unknown-removal lines (hybrid) | "
        "events w1/w2/w3 | stalled round | engines start | scenario | arm total |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in arms.items():
        n = ok = 0
        picks = []
        for point in r["syncs"]:
            for probe, d in point["probes"].items():
                if probe.startswith("dense/"):
                    n += 1
                    exp = {int(k): v for k, v in d["expected"].items()}
                    ok += {int(k): v for k, v in d["scores"].items()} == exp
            picks.append(
                "".join(str(d["pick"]) for k, d in point["probes"].items() if k.startswith("d"))
            )
        dump_ok = all(dump_matches(r["dump"], r["reference"], w) for w in dense)
        nodes = [
            sum(len(per.get(str(w), per.get(w, []))) for per in r[key].values())
            for key in ("dump", "dump_after_replay")
            for w in (1, 2, 3)
        ]
        stalled = max(x["wall_s"] for x in r["phases"]["stalled"].values())
        events = "/".join(str(r["stream"][w]["events"]) for w in ("1", "2", "3"))
        rows.append(
            f"| {name} | {len(r['syncs'])} | {ok}/{n} | {' '.join(picks)} | "
            f"{'yes' if dump_ok else 'NO'} | {r['replay']['replays']}, "
            f"{sum(nodes[:3])} -> {sum(nodes[3:])} blocks | {len(r['bad_lines'])} | {events} | "
            f"{stalled:.2f} s | {r['engines_start_s']:.0f} s | {r['scenario_s']:.1f} s | "
            f"{r['total_s']:.0f} s |"
        )
    rows.append("")
    rows.append("PASS" if not problems else "FAIL")
    return "\n".join(rows)
