"""A KV-event publisher that never blocks the scheduler step (glue only).

vLLM's ``ZmqEventPublisher.publish()`` puts each step's ``KVEventBatch`` on a bounded
``queue.Queue`` with a blocking ``put``: when its sending thread falls behind (a stalled
subscriber, a slow network) the queue fills and the engine's scheduler step waits on it,
possibly for good (vLLM issue #53859). ``hscache.vllm.Scheduler`` / ``AsyncScheduler``
wrap such a publisher in :class:`NonBlockingPublisher`: a batch goes to the queue only
when the queue has room (the scheduler's thread is its only producer, so a put after
that check cannot block); otherwise it is held here, merged with the batches held
before it (one ``KVEventBatch`` per data-parallel rank, events in order; in compact mode
coalesced by the core's rule, ``hscache._core.coalesce_kv_events``), and handed over on
a later step, when there is room. Nothing is dropped while the engine runs; the first
time a backlog forms, one warning says how large it is; ``deferred_batches`` counts the
batches that could not be handed over at once.

Only publishers whose queue can be checked safely are wrapped: exactly vLLM's
``ZmqEventPublisher`` (0.32 and 0.33) with its ``queue.Queue``. Any other publisher
(``NullEventPublisher``, a registered or patched one) is left as it is.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from typing import Any

from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventBatch, EventPublisher, ZmqEventPublisher

from hscache._core import coalesce_kv_events

logger = logging.getLogger(__name__)


class NonBlockingPublisher(EventPublisher):
    """Wraps a ``ZmqEventPublisher`` so that ``publish`` never waits on its queue."""

    def __init__(self, inner: ZmqEventPublisher, *, compact: bool = False) -> None:
        super().__init__(getattr(inner, "_data_parallel_rank", 0))
        self.inner = inner
        self._queue: queue.Queue[Any] = inner._event_queue
        self._compact = compact
        self._held: deque[EventBatch] = deque()
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
        if not self._held and not self._queue.full():
            self.inner.publish(events)  # room: the put cannot block
            return
        self._hold(events)
        self.flush()

    def flush(self) -> None:
        """Hands held batches over, in order, while the queue has room."""
        held = self._held
        while held and not self._queue.full():
            self.inner.publish(held.popleft())

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
