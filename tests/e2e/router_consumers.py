"""The router check's consumers of the engines' KV events (``tests/e2e/router.py``).

- :class:`Indexer`: NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``,
  from ``ai-dynamo-runtime``) in its own process group, on a free loopback port: it
  subscribes to each registered engine's ZMQ publisher, asks its replay socket for what a
  gap lost, and answers ``/query`` and ``/dump``; its log tells what it skipped.
- :class:`Reference`: a second subscriber of every engine's publisher, in this process:
  the batches must come without a gap, and the events give the state a consumer reaches
  after them (the expectation once an engine has evicted, and what ``/dump`` must hold).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import offline

BLOCK = offline.BLOCK_SIZE
POLL_S = 0.02
# Lines of the indexer's log that mean a consumer lost track of an engine.
BAD_LINES = re.compile(r"Failed to find parent block|Failed to find block to remove|Gap detected")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    def register(self, worker: int, model_name: str, pub: str, replay: str) -> None:
        self.http(
            "/register",
            {
                "instance_id": worker,
                "endpoint": pub,
                "replay_endpoint": replay,
                "model_name": model_name,
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


# ------------------------------------------------------------------ reference state


class Reference:
    """A second subscriber of every engine's publisher (this process): the sequence must
    have no gap, and the events give the state a consumer reaches after them, per
    worker: each stored block's parent and tokens, removals, clears; per KV-cache group
    too (the hybrid finding)."""

    def __init__(self, publishers: dict[int, str]) -> None:
        """``publishers``: each worker's KV-event PUB endpoint."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context()
        self._socks: dict[Any, int] = {}
        for worker, pub in publishers.items():
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(pub)
            self._socks[s] = worker
        self.next_seq = dict.fromkeys(publishers, 0)
        # hash -> (parent hash, the block's tokens, the LoRA name of a first block)
        self.blocks: dict[int, dict[int, tuple[int | None, tuple[int, ...], str | None]]] = {
            w: {} for w in publishers
        }
        self.group_blocks: dict[int, dict[int | None, set[int]]] = {w: {} for w in publishers}
        self.removed = dict.fromkeys(publishers, 0)
        self.cleared = dict.fromkeys(publishers, 0)
        self.events = dict.fromkeys(publishers, 0)
        # Removals of a hash another group of the same worker still holds.
        self.removed_held_elsewhere = dict.fromkeys(publishers, 0)
        # Removals of a hash the worker's stream no longer holds (a consumer's
        # "unknown block" line), and every event in short form.
        self.unknown_removed = dict.fromkeys(publishers, 0)
        self.trace: dict[int, list[list[Any]]] = {w: [] for w in publishers}
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
