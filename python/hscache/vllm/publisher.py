"""A KV-event publisher that never blocks the scheduler step (glue only).

vLLM's ``ZmqEventPublisher.publish()`` puts each step's ``KVEventBatch`` on a bounded
``queue.Queue`` with a blocking ``put``: when its sending thread falls behind (a stalled
subscriber, a slow network) the queue fills and the engine's scheduler step waits on it,
possibly for good (vLLM issue #53859). ``hscache.vllm.Scheduler`` / ``AsyncScheduler``
wrap such a publisher in :class:`NonBlockingPublisher`: a batch goes to the queue only
when the queue has room (the scheduler's thread is its only producer, so a put after
that check cannot block); otherwise it is held here, merged with the batches held
before it (one ``KVEventBatch`` per data-parallel rank, events in order; in compact mode
coalesced by the core's rule, ``hscache._core.coalesce_kv_events``), and handed over
as soon as there is room: by the next ``publish``, or by a short-lived flusher thread
that runs only while a backlog exists (so a backlog also drains on steps that publish
nothing). The two producers take one lock around a check-then-put that cannot block, so
the step waits at most for one ``put`` into a queue with room. Nothing is dropped while
the engine runs; the first time a backlog forms, one warning says how large it is;
``deferred_batches`` counts the batches that could not be handed over at once.

Only publishers whose queue can be checked safely are wrapped: exactly vLLM's
``ZmqEventPublisher`` (0.32 and 0.33) with its ``queue.Queue``. Any other publisher
(``NullEventPublisher``, a registered or patched one) is left as it is.
:class:`NonBlockingEventPublisherFactory` stands in for vLLM's ``EventPublisherFactory``
in the scheduler module (``plugin.scheduler_bindings``), so the scheduler gets a wrapped
publisher on both switch-on paths (``--scheduler-cls`` and ``HSCACHE=1``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import (
    EventBatch,
    EventPublisher,
    EventPublisherFactory,
    ZmqEventPublisher,
)

from hscache._core import coalesce_kv_events
from hscache.vllm.events import select_mode

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.005
"""How often the flusher thread retries while a backlog exists."""


class NonBlockingPublisher(EventPublisher):
    """Wraps a ``ZmqEventPublisher`` so that ``publish`` never waits on its queue."""

    def __init__(self, inner: ZmqEventPublisher, *, compact: bool = False) -> None:
        super().__init__(getattr(inner, "_data_parallel_rank", 0))
        self.inner = inner
        self._queue: queue.Queue[Any] = inner._event_queue
        self._compact = compact
        self._held: deque[EventBatch] = deque()
        # Serializes the two producers (the scheduler's thread and the flusher) around
        # the check-then-put; held only for puts into a queue with room.
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._closing = False
        self._warned = False
        self.deferred_batches = 0
        """Batches ``publish`` could not hand over at once (held, then merged)."""
        self.max_held_events = 0
        """The largest backlog so far, in events."""

    @staticmethod
    def wraps(publisher: Any) -> bool:
        """Whether ``publisher`` is one this class can wrap safely."""
        return type(publisher) is ZmqEventPublisher and isinstance(
            getattr(publisher, "_event_queue", None), queue.Queue
        )

    @property
    def held_events(self) -> int:
        """Events held here, waiting for room in the publisher's queue."""
        return sum(len(b.events) for b in self._held)

    def publish(self, events: EventBatch) -> None:
        with self._lock:
            if not self._held and not self._queue.full():
                self.inner.publish(events)  # room: the put cannot block
                return
            self._hold(events)
            self._flush_locked()
            if self._held and self._flusher is None and not self._closing:
                self._flusher = threading.Thread(
                    target=self._drain, name="hscache-kv-event-flusher", daemon=True
                )
                self._flusher.start()

    def flush(self) -> None:
        """Hands held batches over, in order, while the queue has room."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        held = self._held
        while held and not self._queue.full():
            self.inner.publish(held[0])  # a batch it refuses stays held
            held.popleft()

    def _drain(self) -> None:
        """The flusher thread: hands the backlog over as room appears, then ends (also
        when the inner publisher refuses a batch: the backlog stays held, and the next
        ``publish`` raises the publisher's error in the scheduler's thread)."""
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            with self._lock:
                try:
                    if not self._closing:
                        self._flush_locked()
                except Exception:
                    logger.exception("hscache: the KV-event publisher refused a held batch")
                    self._flusher = None
                    return
                if self._closing or not self._held:
                    self._flusher = None
                    return

    def _hold(self, batch: EventBatch) -> None:
        self.deferred_batches += 1
        last = self._held[-1] if self._held else None
        if last is not None and last.data_parallel_rank == batch.data_parallel_rank:
            events = list(last.events) + list(batch.events)
            if self._compact:
                events = coalesce_kv_events(events)
            # The merged batch carries the newest batch's timestamp.
            self._held[-1] = type(last)(
                ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank
            )
        else:
            self._held.append(batch)
        size = self.held_events
        self.max_held_events = max(self.max_held_events, size)
        if not self._warned:
            self._warned = True
            logger.warning(
                "hscache: the KV-event publisher's queue is full (%d batches); holding "
                "%d events so that the scheduler step does not block, handed over when "
                "there is room (this warning is shown once; see deferred_batches)",
                self._queue.maxsize,
                size,
            )

    def shutdown(self) -> None:
        """Hands what is held over and leaves room for the publisher's end marker
        (waiting up to its shutdown timeout), then shuts the publisher down."""
        with self._lock:
            self._closing = True
            flusher = self._flusher
        if flusher is not None:
            flusher.join()
        deadline = time.monotonic() + float(getattr(self.inner, "SHUTDOWN_TIMEOUT", 1.0))
        while (self._held or self._queue.full()) and time.monotonic() < deadline:
            self.flush()
            if self._held or self._queue.full():
                time.sleep(0.01)
        if self._held:
            logger.warning(
                "hscache: %d KV events were still held at shutdown (publisher queue full)",
                self.held_events,
            )
            with self._lock:
                self._held.clear()
        self.inner.shutdown()

    def get_publisher_config(self) -> KVEventsConfig | None:
        config: KVEventsConfig | None = self.inner.get_publisher_config()
        return config


def make_nonblocking(publisher: Any, *, compact: bool = False) -> Any:
    """``publisher`` wrapped in :class:`NonBlockingPublisher` if it can be, else itself."""
    if NonBlockingPublisher.wraps(publisher):
        return NonBlockingPublisher(publisher, compact=compact)
    return publisher


class NonBlockingEventPublisherFactory(EventPublisherFactory):
    """vLLM's ``EventPublisherFactory`` (same registry, same ``create``) whose
    ``ZmqEventPublisher`` comes wrapped in :class:`NonBlockingPublisher`, compact when
    ``HSCACHE_KV_EVENTS=compact`` selects compact events (the mode the scheduler's
    hscache manager is built with)."""

    @classmethod
    def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        publisher = super().create(config, data_parallel_rank)
        wrapped: EventPublisher = make_nonblocking(
            publisher, compact=select_mode(None) == "compact"
        )
        return wrapped
