"""An etcd watch stream on some of the live keys: it tells its owner what changed, and when to read again.

The live watcher (``live/watcher.py``) used to read the live keys in one transaction every
``poll`` (0.1 s): ten requests a second per worker, whatever happened. Then it read them whole
each time a watch said that one of them changed: at 1,000 nodes of 8 workers, one lost node
made 8,000 workers read ~8,000 keys each. Now it reads them whole only when its stream is
(re-)established, and otherwise applies the changes the stream delivers (``on_events``: the key,
its new value or its deletion), so a lost node costs etcd one message per stream
(docs/rendezvous.md, "At 1,000 and 10,000 nodes"). The re-form's candidates keep one on the
reports the same way (``live/report_feed.py``).

``WatchStream`` keeps one gRPC ``Watch`` stream to etcd, on the connection the worker already has
(the same HTTP/2 connection as its lease renewals), carrying one watch per key or prefix. It
calls ``on_events(changes)`` with each response's changes in revision order (without
``on_events``: ``on_change()``), and ``on_change()`` when the watcher must read everything
again. That makes every failure of the stream simple to recover from without missing a change:

1. **Established, then read.** ``on_change()`` is called once every watch of a new stream is
   created (etcd answered ``created``). A change before that point is in the read that follows;
   a change after it is an event on the stream. Nothing falls between, so the watch needs no
   start revision, and a compacted history cannot break it. (An event that arrives while that
   read is in flight may already be in it: applying it again in order gives the same state,
   since every later change of the same key follows it on the stream.)
2. **Cancelled or compacted.** etcd cancels a watch (``canceled``, or ``compact_revision`` set on
   a watcher that fell behind the compaction): the stream is closed and opened again, and 1.
   applies.
3. **etcd restarted or out of reach.** The stream fails (gRPC ``UNAVAILABLE``); ``on_change()``
   is called at once (the watcher's next read fails until etcd answers, and it keeps trying),
   and the stream is opened again after 0.1 s, doubling up to ``retry_max`` seconds; once it is
   established, 1. applies.

The watch costs etcd one request per watch created (five for the live watcher) each time the
stream opens, and nothing in steady state. A stream that dies without a word (a half-open TCP
connection) would also stall the lease renewals, which travel on the same connection: the
lease, not this watch, says whether this worker is alive.

**Threads.** ``run()`` is the stream's thread body; its owner starts it (the live watcher or the
report feed, through the worker runtime's ``start_thread``) and ends it with ``close()``, which
cancels the stream. ``on_change`` and ``on_events`` are called from that thread: they hand over
and return. Its owners make it through a ``StreamFactory`` (``WatchStream`` itself by default), the
seam through which a simulation watches the product's watcher's stream (``benchmarks/live_sim.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import etcd3.utils
import grpc
from etcd3 import etcdrpc

from elastic_trainer.live.keys import Change

logger = logging.getLogger(__name__)


def watch_request(key: str) -> etcdrpc.WatchRequest:
    """A watch on ``key``, or on every key under it when it ends with ``/``."""
    create = etcdrpc.WatchCreateRequest(key=key.encode())
    if key.endswith("/"):
        create.range_end = etcd3.utils.prefix_range_end(key.encode())
    return etcdrpc.WatchRequest(create_request=create)


StreamFactory = Callable[..., "WatchStream"]
"""``factory(conn, keys, on_change, on_events=...) -> WatchStream``: how a stream's owner makes it."""


def _changes(events) -> list[Change]:
    """The events of one watch response, as ``Change``s (a deletion has no value)."""
    return [Change(e.kv.key.decode(), e.kv.value if e.type == e.PUT else None, e.kv.create_revision,
                   e.kv.mod_revision) for e in events]


class WatchStream:
    """One watch stream on ``keys`` (see the module docstring): ``on_events(changes)`` for every
    response's changes (without ``on_events``: ``on_change()``), and ``on_change()`` every time
    the stream is (re-)established or lost (read everything again)."""

    def __init__(self, conn, keys: Sequence[str], on_change: Callable[[], None], retry_max: float = 1.0,
                 on_events: Callable[[list[Change]], None] | None = None) -> None:
        self._conn = conn
        self._keys = tuple(keys)
        self._on_change = on_change
        self._on_events = on_events
        self._retry_max = retry_max
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self.established = threading.Event()
        """Set while every watch of the current stream is created."""
        self.opened = 0
        """Streams established so far (1 in a run where etcd never failed)."""
        self.events = 0

    def run(self) -> None:
        """The stream's thread: watch, and open the stream again whenever it ends."""
        delay = 0.1
        while not self._stop.is_set():
            try:
                if self._stream():
                    delay = 0.1
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                logger.info("live: the etcd watch failed (%s); opening it again in %.1fs",
                            exc.code() if hasattr(exc, "code") else exc, delay)
            self.established.clear()
            if self._stop.is_set():
                return
            self._on_change()  # the view may be stale: the watcher reads again (and keeps trying)
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, self._retry_max)

    def _stream(self) -> bool:
        """One stream, until it ends; True when it was established."""
        requests: queue.SimpleQueue = queue.SimpleQueue()
        for key in self._keys:
            requests.put(watch_request(key))

        def feed() -> Iterator[etcdrpc.WatchRequest]:
            while (request := requests.get()) is not None:
                yield request

        client = self._conn.client
        client.next_endpoint()  # fail over first when the endpoint in use failed
        call = etcdrpc.WatchStub(client.channel).Watch(feed(), credentials=client.call_credentials,
                                                       metadata=client.metadata)
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
        created = 0
        try:
            for response in call:
                if response.canceled or response.compact_revision:
                    logger.info("live: etcd cancelled a watch (%s); opening the stream again",
                                response.cancel_reason or f"compacted at {response.compact_revision}")
                    return created >= len(self._keys)
                if response.created:
                    created += 1
                    if created == len(self._keys):
                        self.opened += 1
                        self.established.set()
                        self._on_change()  # changes before this point: in the read this asks for
                    continue
                if response.events:
                    self.events += len(response.events)
                    if self._on_events is None:
                        self._on_change()
                    else:
                        self._on_events(_changes(response.events))
            return created >= len(self._keys)  # etcd closed the stream
        finally:
            requests.put(None)
            call.cancel()

    def close(self) -> None:
        """End the stream and the thread (it returns within a moment)."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()


__all__ = ["StreamFactory", "WatchStream", "watch_request"]
