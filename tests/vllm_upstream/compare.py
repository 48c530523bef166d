"""Judge a run of vLLM's upstream tests (the JSON written by the ``hscache_swap`` plugin).

    python compare.py RESULTS.json [--swap] [--vllm 0.33|0.32|0.30] [--write-known]

Prints per-file counts, then every failure that is not expected:

* ``known_failures.txt`` (vLLM 0.33.0's tests; ``known_failures_vllm032.txt`` for 0.32's,
  ``known_failures_vllm030.txt`` for 0.30's):
  node ids that fail *without* the swap, for reasons of this environment (no Hugging Face
  Hub, no GPU ...), each with its reason after ``#``;
* ``swap_known_failures.txt`` (``swap_known_failures_vllm03x.txt``; with ``--swap`` only):
  node ids that are expected to fail *with* hscache's manager, each with its reason (a
  test of vLLM's internals that hscache deliberately does not mirror). Keep it short;
  every line is a debt.

With ``--swap`` it also prints the *census*: every KV-cache manager the tests built, by
layout, and whether hscache served it or fell back to vLLM's manager (and why). A fallback
whose reason matches no regex of ``census_allowlist.txt`` fails the run: hscache promises
to serve every layout except those listed there.

Exits 1 if any test failed (or errored) unexpectedly, 0 otherwise. Expected failures that
pass are reported, not fatal: delete their lines. ``--write-known`` rewrites
known_failures.txt from a run without the swap, classifying each failure by its message.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (known failures without the swap, allowed failures with it) per vLLM series
LISTS = {
    "0.33": (HERE / "known_failures.txt", HERE / "swap_known_failures.txt"),
    "0.32": (HERE / "known_failures_vllm032.txt", HERE / "swap_known_failures_vllm032.txt"),
    "0.30": (HERE / "known_failures_vllm030.txt", HERE / "swap_known_failures_vllm030.txt"),
}
VERSION = {"0.33": "0.33.0", "0.32": "0.32.0", "0.30": "0.30.0"}
CENSUS_ALLOWLIST = HERE / "census_allowlist.txt"

# (reason, pattern over the node id), tried first: failures whose message says little.
NODE_CLASSES = [
    (
        "device: worker-side KV transfer asserts CUDA/XPU tensors",
        r"^tests/v1/kv_offload/cpu/test_gpu_worker\.py::",
    ),
]
# (reason, pattern over the failure message), first match wins.
CLASSES = [
    ("conftest: fixture of vLLM's root conftest (not loaded)", r"fixture '[^']+' not found"),
    (
        "tokenizer: skip_tokenizer_init offline, no structured-output executor",
        r"StructuredOutputManager' object has no attribute 'executor'",
    ),
    (
        "platform: CPU runs model runner V1, which rejects async scheduling + PP",
        r"Async scheduling is not supported by the V1 model runner",
    ),
    (
        "hf-hub: model config not available offline",
        r"(?i)huggingface|hf_hub|offline|repo(sitory)?[ _]?(id|not found)|"
        r"LocalEntryNotFound|Can't load|couldn't connect|is not a local folder|"
        r"Invalid repository ID|No such file or directory: .*config",
    ),
    ("tokenizer: not available offline", r"(?i)tokeni[sz]er"),
    ("device: no GPU / platform", r"(?i)cuda|device type|gpu|nccl|triton"),
]


def read_list(path: Path) -> dict[str, str]:
    """node id -> reason, from a list file (``node_id  # reason`` lines, ``#`` comments)."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        node, _, reason = line.partition(" #")
        out[node.strip()] = reason.strip()
    return out


def classify(node_id: str, message: str) -> str:
    for reason, pattern in NODE_CLASSES:
        if re.search(pattern, node_id):
            return reason
    for reason, pattern in CLASSES:
        if re.search(pattern, message):
            return reason
    return "other"


def file_of(node_id: str) -> str:
    return node_id.split("::", 1)[0]


def read_allowlist(path: Path) -> list[re.Pattern[str]]:
    """Regexes (one per line, ``#`` comments) over fallback reasons that are expected."""
    if not path.exists():
        return []
    lines = (raw.split(" #", 1)[0].strip() for raw in path.read_text().splitlines())
    return [re.compile(line) for line in lines if line and not line.startswith("#")]


def report_census(census: dict[str, int], allowlist: list[re.Pattern[str]]) -> list[str]:
    """Print the census; return the fallback reasons that no allowlist regex matches."""
    if not census:
        return []
    total = sum(census.values())
    served = sum(n for key, n in census.items() if key.startswith("served"))
    print(
        f"\ncensus: {total} KV-cache managers built, {served} served by hscache "
        f"({100.0 * served / total:.1f} %)"
    )
    width = max(len(key) for key in census)
    for key, n in sorted(census.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {key:<{width}}  {n:>6}")
    reasons = {
        key.split(" | ", 1)[0].removeprefix("fallback: ")
        for key in census
        if key.startswith("fallback")
    }
    return sorted(r for r in reasons if not any(p.search(r) for p in allowlist))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--swap", action="store_true", help="the run had hscache swapped in")
    ap.add_argument("--write-known", action="store_true", help="rewrite known_failures.txt")
    ap.add_argument("--failed-out", type=Path, help="write unexpected failures' ids here")
    ap.add_argument("--vllm", choices=sorted(LISTS), default="0.33", help="vLLM series")
    args = ap.parse_args()
    known_path, swap_known_path = LISTS[args.vllm]

    doc = json.loads(args.results.read_text())
    results: dict[str, str] = doc["results"]
    messages: dict[str, str] = doc.get("messages", {})
    bad = {"failed", "error"}
    if not results:
        print("no test results: nothing was run")
        return 1

    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    for node, outcome in results.items():
        per_file[file_of(node)][outcome] += 1
    kinds = ["passed", "failed", "error", "skipped", "xfailed"]
    width = max((len(f) for f in per_file), default=10)
    print(f"{'file':<{width}}  " + " ".join(f"{k:>7}" for k in kinds))
    for f in sorted(per_file):
        print(f"{f:<{width}}  " + " ".join(f"{per_file[f][k]:>7}" for k in kinds))

    if args.write_known:
        if args.swap:
            sys.exit("--write-known takes a run WITHOUT the swap")
        failing = sorted(n for n, o in results.items() if o in bad)
        by_reason: dict[str, list[str]] = defaultdict(list)
        for n in failing:
            by_reason[classify(n, messages.get(n, ""))].append(n)
        vllm_flag = "" if args.vllm == "0.33" else f" --vllm {args.vllm}"
        lines = [
            f"# vLLM {VERSION[args.vllm]} upstream tests that fail WITHOUT hscache's swap in "
            "this environment",
            "# (CPU only, no Hugging Face Hub). Generated by",
            f"# `tests/vllm_upstream/run.sh{vllm_flag} --write-known`; grouped by reason.",
        ]
        for reason in sorted(by_reason):
            lines += ["", f"# {reason} ({len(by_reason[reason])})"]
            lines += [f"{n}  # {reason}" for n in by_reason[reason]]
        known_path.write_text("\n".join(lines) + "\n")
        print(f"wrote {len(failing)} node ids to {known_path}")
        return 0

    expected = read_list(known_path)
    if args.swap:
        expected.update(read_list(swap_known_path))
    unexpected = sorted(n for n, o in results.items() if o in bad and n not in expected)
    fixed = sorted(n for n, o in results.items() if o == "passed" and n in expected)
    failing_expected = sum(1 for n, o in results.items() if o in bad and n in expected)

    unallowed = report_census(doc.get("census", {}), read_allowlist(CENSUS_ALLOWLIST))
    for reason in unallowed:
        print(f"UNEXPECTED FALLBACK to vLLM's manager: {reason}")

    for n in fixed:
        print(f"expected to fail but passed (remove from the list): {n}")
    for n in unexpected:
        print(f"UNEXPECTED {results[n].upper()}: {n}\n    {messages.get(n, '')}")
    if args.failed_out:
        args.failed_out.write_text("".join(f"{n}\n" for n in unexpected))
    total = Counter(results.values())
    swap = "ON" if args.swap else "OFF"
    print(
        f"vLLM {VERSION[args.vllm]} upstream tests (swap {swap}): {total['passed']} passed, "
        f"{failing_expected} failed as expected, {len(unexpected)} failed unexpectedly, "
        f"{total['skipped']} skipped"
    )
    return 1 if unexpected or unallowed else 0


if __name__ == "__main__":
    sys.exit(main())
