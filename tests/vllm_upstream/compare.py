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

A listed test is expected to fail *for its reason*, not by its node id alone: its failure
message must match the line's ``[message ~ REGEX]`` (required in the swap lists), else the
message pattern of its reason class (``CLASSES`` / ``NODE_CLASSES`` below, which
``--write-known`` writes). A listed test that fails with another message is an unexpected
failure, shown with both.

With ``--swap`` the run must also prove the swap was on: the results name the swapped
``KVCacheManager``, the swapped-in class was constructed at least once, the census is not
empty and hscache served at least one manager, and ``HSCACHE_DISABLE`` was not set (with it,
hscache's constructor returns vLLM's manager: vLLM would be tested against itself).

With ``--swap`` it also prints the *census*: every KV-cache manager the tests built, by
layout, and whether hscache served it or fell back to vLLM's manager (and why). A fallback
whose reason matches no regex of ``census_allowlist.txt`` fails the run: hscache promises
to serve every layout except those listed there.

Exits 1 if any test failed (or errored) unexpectedly or the swap is not proven, 0
otherwise. Expected failures that pass are reported, not fatal: delete their lines.
``--write-known`` rewrites known_failures.txt from a run without the swap, classifying each
failure by its message.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# (known failures without the swap, allowed failures with it) per vLLM series
LISTS = {
    "0.33": (HERE / "known_failures.txt", HERE / "swap_known_failures.txt"),
    "0.32": (HERE / "known_failures_vllm032.txt", HERE / "swap_known_failures_vllm032.txt"),
    "0.30": (HERE / "known_failures_vllm030.txt", HERE / "swap_known_failures_vllm030.txt"),
}
VERSION = {"0.33": "0.33.0", "0.32": "0.32.0", "0.30": "0.30.0"}
CENSUS_ALLOWLIST = HERE / "census_allowlist.txt"

# (reason, pattern over the node id, pattern its message must match), tried first:
# failures whose message says little.
NODE_CLASSES = [
    (
        "device: worker-side KV transfer asserts CUDA/XPU tensors",
        r"^tests/v1/kv_offload/cpu/test_gpu_worker\.py::",
        r"^AssertionError$",  # a bare assert on the tensors' device, nothing else
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


MESSAGE_FIELD = re.compile(r"\s*\[message ~ (?P<regex>.+)\]\s*$")


def read_list(path: Path, *, need_message: bool = False) -> dict[str, tuple[str, str]]:
    """node id -> (reason, regex its failure message must match), from a list file
    (``node_id  # reason  [message ~ REGEX]`` lines, ``#`` comments). Without a
    ``[message ~ ...]`` field the regex is the reason class's (``class_pattern``); a line
    with neither (or, with ``need_message``, without the field) is a SystemExit."""
    out: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return out
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        node, _, reason = line.partition(" #")
        m = MESSAGE_FIELD.search(reason)
        regex = m.group("regex") if m else None
        reason = (reason[: m.start()] if m else reason).strip()
        if regex is None and not need_message:
            regex = class_pattern(node.strip(), reason)
        if regex is None:
            raise SystemExit(
                f"{path}:{n}: no [message ~ REGEX] for {node.strip()}: an expected failure "
                "is matched on its failure message, not on its node id alone"
            )
        try:
            re.compile(regex)
        except re.error as exc:
            raise SystemExit(f"{path}:{n}: bad message regex {regex!r}: {exc}") from None
        out[node.strip()] = (reason, regex)
    return out


def class_pattern(node_id: str, reason: str) -> str | None:
    """The message regex of the reason class named ``reason`` (None if none is)."""
    for name, node_pattern, message_pattern in NODE_CLASSES:
        if name == reason and re.search(node_pattern, node_id):
            return message_pattern
    for name, pattern in CLASSES:
        if name == reason:
            return pattern
    return None


def classify(node_id: str, message: str) -> str:
    for reason, pattern, message_pattern in NODE_CLASSES:
        if re.search(pattern, node_id) and re.search(message_pattern, message):
            return reason
    for reason, pattern in CLASSES:
        if re.search(pattern, message):
            return reason
    return "other"


def swap_problems(doc: dict[str, Any]) -> list[str]:
    """Why a ``--swap`` run does not prove the swap was on (empty: it does)."""
    problems = []
    swapped = {name for name, *_ in doc.get("swap", [])}
    if "KVCacheManager" not in swapped:
        problems.append(
            "the swap is OFF: no KVCacheManager was swapped in (HSCACHE_SWAP not 1 in pytest?)"
        )
    constructed = doc.get("constructed")
    if not isinstance(constructed, int) or constructed <= 0:
        problems.append(
            f"the swapped-in class was constructed {constructed} times: the tests never "
            "built it (or the count is unavailable)"
        )
    env = doc.get("env", {})
    if env.get("HSCACHE_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off"):
        problems.append(
            f"HSCACHE_DISABLE={env['HSCACHE_DISABLE']} was set: hscache's constructor returned "
            "vLLM's manager, so vLLM was tested against itself"
        )
    census: dict[str, int] = doc.get("census", {})
    if not census:
        problems.append("the census is empty: no KV-cache manager construction was recorded")
    elif not any(n for key, n in census.items() if key.startswith("served")):
        problems.append("the census has no manager served by hscache")
    return problems


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
            for n in by_reason[reason]:
                # A reason without a message class: the line carries its own message.
                field = ""
                if class_pattern(n, reason) is None:
                    field = f"  [message ~ {re.escape(messages.get(n, '')[:160])}]"
                lines.append(f"{n}  # {reason}{field}")
        known_path.write_text("\n".join(lines) + "\n")
        print(f"wrote {len(failing)} node ids to {known_path}")
        return 0

    expected = read_list(known_path)
    if args.swap:
        expected.update(read_list(swap_known_path, need_message=True))
    # A listed test is expected to fail for its listed reason: its message must match.
    other_reason = sorted(
        n
        for n, o in results.items()
        if o in bad and n in expected and not re.search(expected[n][1], messages.get(n, ""))
    )
    unexpected = sorted(
        n for n, o in results.items() if o in bad and (n not in expected or n in other_reason)
    )
    fixed = sorted(n for n, o in results.items() if o == "passed" and n in expected)
    failing_expected = sum(
        1 for n, o in results.items() if o in bad and n in expected and n not in other_reason
    )
    not_swapped = swap_problems(doc) if args.swap else []
    for problem in not_swapped:
        print(f"SWAP NOT PROVEN: {problem}")

    unallowed = report_census(doc.get("census", {}), read_allowlist(CENSUS_ALLOWLIST))
    for reason in unallowed:
        print(f"UNEXPECTED FALLBACK to vLLM's manager: {reason}")

    for n in fixed:
        print(f"expected to fail but passed (remove from the list): {n}")
    for n in unexpected:
        print(f"UNEXPECTED {results[n].upper()}: {n}\n    {messages.get(n, '')}")
        if n in other_reason:
            reason, regex = expected[n]
            print(f"    (listed as failing for: {reason}; its message must match {regex!r})")
    if args.failed_out:
        args.failed_out.write_text("".join(f"{n}\n" for n in unexpected))
    total = Counter(results.values())
    swap = "ON" if args.swap else "OFF"
    print(
        f"vLLM {VERSION[args.vllm]} upstream tests (swap {swap}): {total['passed']} passed, "
        f"{failing_expected} failed as expected, {len(unexpected)} failed unexpectedly, "
        f"{total['skipped']} skipped"
    )
    return 1 if unexpected or unallowed or not_swapped else 0


if __name__ == "__main__":
    sys.exit(main())
