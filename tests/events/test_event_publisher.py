"""KV-event publishing never blocks the scheduler step (``hscache.vllm.publisher``).

vLLM's ``ZmqEventPublisher`` is real here (an ``inproc://`` endpoint, its own sending
thread), with a two-batch queue and a stalled consumer: its socket's ``send_multipart``
waits on a gate. Every ``publish`` returns at once while the queue is full; what the
queue cannot take is held, merged, handed over on later steps when there is room, and
after the gate opens every event arrives, in order, in batches with consecutive sequence
numbers; a backlog drains even when nothing more is published. Under
``hscache.vllm.Scheduler``, ``AsyncScheduler`` and vLLM's stock ``Scheduler`` switched by
the ``HSCACHE=1`` plugin, the same holds for the scheduler's own steps, and a publisher
that cannot be checked safely is left alone.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import hscache.vllm
import msgspec
import pytest
import vllm.v1.core.sched.scheduler as scheduler_module
from hscache.vllm import plugin
from hscache.vllm.block_hasher import uninstall_block_hasher
from hscache.vllm.plugin import scheduler_bindings
from hscache.vllm.publisher import NonBlockingPublisher, make_nonblocking
from hscache_tools.testing.offline_scheduler import make_scheduler, stub_runner_output
from hscache_tools.testing.requests import make_request
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    NullEventPublisher,
    ZmqEventPublisher,
)

QUEUE = 2  # batches the publisher's queue holds


class GatedSocket:
    """Stands in for the publisher's PUB socket: sends wait until the gate opens."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.gate = threading.Event()
        self.sent: list[tuple[int, KVEventBatch]] = []
        self.lock = threading.Lock()

    def send_multipart(self, parts: tuple[bytes, bytes, bytes]) -> None:
        self.gate.wait()
        _topic, seq, payload = parts
        with self.lock:
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            self.sent.append((int.from_bytes(seq, "big"), batch))

    def close(self, linger: int = 0) -> None:
        self.real.close(linger=linger)


def _stalled_publisher() -> tuple[ZmqEventPublisher, GatedSocket]:
    pub = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"inproc://hscache-test-{uuid.uuid4().hex}",
        max_queue_size=QUEUE,
    )
    sock = GatedSocket(pub._pub)
    pub._pub = sock  # type: ignore[assignment]
    return pub, sock


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(
        ts=float(i), events=[BlockRemoved(block_hashes=[i], medium=MEDIUM_GPU, group_idx=0)]
    )


def _wait_until(cond: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _delivered(sock: GatedSocket) -> list[Any]:
    with sock.lock:
        seqs = [s for s, _ in sock.sent]
        assert seqs == list(range(len(seqs))), "batches out of order"
        return [e for _, b in sock.sent for e in b.events]


def test_the_stalled_queue_would_block_vllms_publish() -> None:
    """The problem: once the queue is full, vLLM's own ``publish`` waits."""
    pub, sock = _stalled_publisher()
    try:
        for i in range(QUEUE + 1):  # one taken by the thread, QUEUE queued
            pub.publish(_batch(i))
        _wait_until(pub._event_queue.full, "a full queue")
        blocked = threading.Thread(target=pub.publish, args=(_batch(99),), daemon=True)
        blocked.start()
        blocked.join(0.2)
        assert blocked.is_alive(), "vLLM's publish returned with a full queue"
        sock.gate.set()
        blocked.join(10)
        _wait_until(pub._event_queue.empty, "the queue to drain")
    finally:
        sock.gate.set()
        pub.shutdown()


@pytest.mark.parametrize("compact", [False, True])
def test_publish_never_blocks_and_delivers_every_batch_in_order(
    compact: bool, caplog: pytest.LogCaptureFixture
) -> None:
    pub, sock = _stalled_publisher()
    wrapped = make_nonblocking(pub, compact=compact)
    assert isinstance(wrapped, NonBlockingPublisher)
    n = 40
    caplog.set_level(logging.WARNING, logger="hscache.vllm.publisher")
    try:
        wrapped.publish(_batch(0))
        # The sending thread takes it and waits on the gate: the queue then takes QUEUE.
        _wait_until(pub._event_queue.empty, "the thread to take the first batch")
        for i in range(1, n):
            t0 = time.monotonic()
            wrapped.publish(_batch(i))
            assert time.monotonic() - t0 < 0.5, f"publish {i} blocked"
        assert wrapped.deferred_batches == n - 1 - QUEUE
        # Held batches merge: one batch waits, whatever the number of steps.
        assert len(wrapped._held) == 1
        assert wrapped.held_events == (1 if compact else wrapped.deferred_batches)
        warnings = [r for r in caplog.records if "queue is full" in r.getMessage()]
        assert len(warnings) == 1, "one warning when the backlog first forms"
        # Later steps with nothing to publish still hand the backlog over.
        sock.gate.set()
        _wait_until(
            lambda: (wrapped.flush(), wrapped.held_events == 0)[1], "the backlog to be handed over"
        )
        _wait_until(lambda: sum(len(e.block_hashes) for e in _delivered(sock)) == n, "delivery")
    finally:
        sock.gate.set()
        wrapped.shutdown()
    events = _delivered(sock)
    assert [h for e in events for h in e.block_hashes] == list(range(n))
    if compact:
        assert len(events) < n
    else:
        assert len(events) == n


def test_shutdown_hands_the_backlog_over() -> None:
    pub, sock = _stalled_publisher()
    wrapped = NonBlockingPublisher(pub)
    for i in range(10):
        wrapped.publish(_batch(i))
    assert wrapped.held_events > 0
    threading.Timer(0.1, sock.gate.set).start()
    wrapped.shutdown()
    assert [h for e in _delivered(sock) for h in e.block_hashes] == list(range(10))


def test_a_refused_batch_stays_held_and_nothing_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    pub, sock = _stalled_publisher()
    wrapped = NonBlockingPublisher(pub)
    try:
        for i in range(8):
            wrapped.publish(_batch(i))
        held = wrapped.held_events
        assert held > 0

        def refuse(batch: KVEventBatch) -> None:
            raise RuntimeError("Publisher is closed")

        monkeypatch.setattr(pub, "publish", refuse)
        sock.gate.set()  # room appears: the flusher is refused and ends
        _wait_until(lambda: wrapped._flusher is None, "the flusher thread to end")
        assert wrapped.held_events == held
        with pytest.raises(RuntimeError, match="closed"):  # the step sees the error
            wrapped.publish(_batch(8))
        monkeypatch.undo()
    finally:
        sock.gate.set()
        wrapped.shutdown()
    assert [h for e in _delivered(sock) for h in e.block_hashes] == list(range(9))


def test_only_vllms_zmq_publisher_is_wrapped() -> None:
    class Custom(ZmqEventPublisher):
        pass

    null = NullEventPublisher()
    mock = Mock()
    assert make_nonblocking(null) is null
    assert make_nonblocking(mock) is mock
    custom = Custom(data_parallel_rank=0, endpoint=f"inproc://hscache-test-{uuid.uuid4().hex}")
    try:
        assert make_nonblocking(custom) is custom
    finally:
        custom.shutdown()


@pytest.mark.parametrize("path", ["Scheduler", "AsyncScheduler", "HSCACHE=1 plugin"])
def test_the_scheduler_step_does_not_block_on_a_stalled_consumer(
    path: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls: type = getattr(hscache.vllm, path, scheduler_module.Scheduler)
    if cls is scheduler_module.Scheduler:  # vLLM's own Scheduler, switched by the plugin
        for name in scheduler_bindings():  # restored afterwards
            monkeypatch.setattr(scheduler_module, name, getattr(scheduler_module, name))
        monkeypatch.setenv("HSCACHE", "1")
        plugin.register()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"inproc://hscache-test-{uuid.uuid4().hex}",
        max_queue_size=QUEUE,
    )
    sched = make_scheduler(
        cls,
        48,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=1024,
        async_scheduling=path == "AsyncScheduler",
        model_path=model_dir,
        kv_cache_events=config,
    )
    publisher = sched.kv_event_publisher
    assert isinstance(publisher, NonBlockingPublisher)
    assert isinstance(sched.kv_cache_manager, hscache.vllm.KVCacheManager)
    sock = GatedSocket(publisher.inner._pub)
    publisher.inner._pub = sock
    stored = 0
    try:
        for step in range(40):
            if step % 2 == 0:
                prompt = [step * 1000 + i for i in range(40 + step)]
                sched.add_request(make_request(f"r{step}", prompt, max_tokens=3, ignore_eos=True))
            t0 = time.monotonic()
            out = sched.schedule()
            sched.update_from_output(out, stub_runner_output(out, lambda i: 7, sched.requests))
            assert time.monotonic() - t0 < 1.0, f"step {step} blocked"
        assert publisher.deferred_batches > 0, "the queue never filled"
        sock.gate.set()  # no more steps: the held batches still go out
        _wait_until(lambda: publisher.held_events == 0, "the backlog to be handed over")
        _wait_until(lambda: publisher._flusher is None, "the flusher thread to end")
        _wait_until(lambda: publisher.inner._event_queue.empty(), "the queue to drain")
        events = _delivered(sock)
        stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    finally:
        sock.gate.set()
        sched.shutdown()
        uninstall_block_hasher()
    assert stored > 0
    assert any(isinstance(e, BlockRemoved) for e in events)
