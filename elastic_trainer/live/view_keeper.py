"""Where a live watcher's view of etcd comes from: its own watch stream, or its node's.

The watcher (``live/watcher.py``) decides from a ``Mirror`` of the live keys (``live/mirror.py``).
``ViewKeeper`` keeps that mirror current, reading etcd as little as it can:

- the keys are read whole (one transaction, ``LiveKeys.read_watched``) only when the etcd watch
  stream (``live/stream.py``) is (re-)established or lost, or after a pause longer than a lease;
- between, the changes the stream delivers are applied to that read in order, one message per
  change (the stream's thread hands them over, the watcher's applies them);
- with one etcd watch per node (``live/node_share.py``: on a node's lease, its workers share a
  directory), the worker that keeps the node's stream publishes what it knows after each update,
  and its siblings load that instead of watching etcd themselves. A sibling waits up to a lease for
  the node's first view, and reads etcd itself when the view it holds stays older than its quorum
  past ``BEHIND_READ``.

``view_for(q)`` returns the current view for quorum ``q`` and whether this worker knows it from
etcd itself. Design and numbers: docs/trainer.md, "Watching etcd", and docs/rendezvous.md (the
live path at scale).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from elastic_trainer.env import LiveSettings
from elastic_trainer.live.keys import WATCHED, Change, LiveKeys, View
from elastic_trainer.live.mirror import Mirror
from elastic_trainer.live.node_share import NodeShare
from elastic_trainer.live.quorum import Quorum
from elastic_trainer.live.stream import StreamFactory, WatchStream
from elastic_trainer.live.threads import StartThread

logger = logging.getLogger(__name__)

BEHIND_READ = 1.0
"""Seconds (or 10 polls, if longer) a sibling waits for a published view as new as its quorum
before it reads etcd itself (for the node's first view: a lease)."""


class ViewKeeper:
    """The watcher's view of the live keys (see the module docstring). ``on_wake()`` is called
    (from a stream's or the node's thread) when there is something to look at; ``node_dir``: the
    node's shared directory (None: this worker keeps a stream of its own)."""

    def __init__(self, keys: LiveKeys, settings: LiveSettings, start_thread: StartThread, on_wake: Callable[[], None],
                 node_dir: str | None = None, stream_factory: StreamFactory = WatchStream) -> None:
        self._keys, self._settings, self._start_thread = keys, settings, start_thread
        self._on_wake = on_wake
        self._node_dir = node_dir
        self._stream_factory = stream_factory
        self.mirror = Mirror(keys.prefix, self._fetch_members)
        """The last whole read, with the stream's changes applied (the watcher thread's own)."""
        self._dirty = threading.Event()  # the stream was (re-)established or lost: read everything again
        self._loaded = False
        self._changes: deque[Change] = deque()  # from the stream's thread, applied by the watcher's
        self.stream: WatchStream | None = None
        """This worker's etcd watch stream (None: it loads its node's published views)."""
        self.share: NodeShare | None = None
        """This worker's part in its node's one watch (None: a stream of its own)."""
        self.reads = 0
        """Whole reads of the live keys (one per stream established, and after an etcd failure)."""
        self.applied = 0
        """Changes applied from the stream's events."""
        self.loads = 0
        """Views loaded from the node's watching worker (a sibling's)."""
        self._sibling_loaded = False  # a sibling: the mirror holds a published view (or its own read)
        self.behind = False
        """A sibling's view predates its quorum (it tells nothing of that quorum's members)."""
        self._behind_since: float | None = None
        self._first_wait: float | None = None  # a sibling: since when it waits for its node's first view
        self._unpublished: list[Change] | None = None  # changes applied since the last publish (None: read whole)

    def open(self) -> NodeShare | None:
        """Take part in the node's watch: keep the stream (the node's first worker, or one without
        a node directory), or be a sibling: then its ``NodeShare`` is returned, whose ``run`` the
        owner starts (or whose socket it serves)."""
        if self._node_dir is not None:
            try:
                self.share = NodeShare(self._node_dir, self._settings.poll, self.stale, self.open_stream)
            except OSError as exc:
                logger.warning("live: this worker keeps an etcd watch of its own (no node directory: %s)", exc)
        if self.share is None or self.share.try_lead():
            self.open_stream()
            return None
        return self.share

    def open_stream(self) -> None:
        """Keep the etcd watch stream (at the start, or as a sibling promoted when the last keeper died)."""
        stream = self._stream_factory(self._keys.conn, [self._keys.key(k) for k in WATCHED], self.stale,
                                      on_events=self.events)
        self._start_thread("live-watch-stream", stream.run, stop=stream.close)
        self.stream = stream

    @property
    def current(self) -> bool:
        """This worker's own stream is established and nothing of it is unread."""
        return self.stream is not None and self.stream.established.is_set() and not self._dirty.is_set()

    def stale(self) -> None:
        """The stream was (re-)established or lost, or the node published a view: look again (from any thread)."""
        self._dirty.set()
        self._on_wake()

    def invalidate(self) -> None:
        """Read (or load) everything again at the next look (after a pause: events may be on their way)."""
        self._dirty.set()

    def events(self, changes: list[Change]) -> None:
        """From the stream's thread: live keys changed; the watcher thread applies them in order."""
        self._changes.extend(changes)
        self._on_wake()

    def view_for(self, q: Quorum) -> tuple[View, bool] | None:
        """The current view for quorum ``q``, and whether this worker knows it from etcd itself
        (None when etcd could not be read: the next wake tries again). The worker that keeps the
        stream follows it and publishes what it knows, whenever that changed, for its siblings."""
        share = self.share
        self.mirror.hint = q  # a quorum record that is a change from q is decoded without a read
        if share is not None and not share.leader:
            return self._load_published(share, q)
        self.behind = False
        if not self._update():
            return None
        self.mirror.track(q)
        if share is not None and share.leader and (self._unpublished is None or self._unpublished):
            try:
                share.publish(self.mirror, self._unpublished)
                self._unpublished = []
            except OSError as exc:  # the siblings read etcd themselves when they find nothing
                self._unpublished = None  # a new snapshot next time
                logger.warning("live: could not publish the node's view to its workers: %s", exc)
        return self.mirror.view(q.q), True

    def _load_published(self, share: NodeShare, q: Quorum) -> tuple[View, bool] | None:
        """A sibling's view: what its node's watching worker published last, loaded when woken by
        a new one (the changes logged since the last load). The view holds every live key, so it
        serves whatever quorum this worker is in. Until one is published (at the start: at 1,000
        nodes every node's first read is in flight at once) the sibling waits up to a lease, then
        reads etcd itself, once. A view that predates this worker's quorum (the watching worker has
        not seen the re-form yet: it publishes within moments) tells nothing about ``q``'s members
        (``behind``), and if no newer one comes within ``BEHIND_READ``, the sibling reads etcd."""
        now = time.monotonic()
        patience = max(BEHIND_READ, 10 * self._settings.poll)
        if self._dirty.is_set() or not self._sibling_loaded:
            self._dirty.clear()
            if share.load(self.mirror):
                self.loads += 1
                self._sibling_loaded = True
            elif self._sibling_loaded:  # caught between a new epoch's two files: the next wake loads
                self._dirty.set()
            else:  # nothing published yet (the start): the watching worker's first read is on its way
                self._first_wait = self._first_wait or now
                if now - self._first_wait < max(patience, self._settings.lease_ttl) or not self._read_whole():
                    return None
        self.mirror.track(q)
        self.behind = self._behind(q)
        if not self.behind:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = now
        elif now - self._behind_since > patience and self._read_whole():
            self._behind_since = None
            self.mirror.track(q)
            self.behind = self._behind(q)
        return self.mirror.view(q.q), False

    def _behind(self, q: Quorum) -> bool:
        known = self.mirror.quorum
        return known is None or known.q < q.q

    def _read_whole(self) -> bool:
        """A sibling reads the live keys from etcd itself (False when it could not)."""
        try:
            self.mirror.load(self._keys.read_watched())
        except Exception as exc:  # noqa: BLE001 - etcd out of reach: the lease decides
            self._dirty.set()
            logger.info("live: watcher could not read etcd: %s", exc)
            return False
        self.reads += 1
        self._sibling_loaded = True
        return True

    def _fetch_members(self, q: int) -> bytes | None:
        """Quorum ``q``'s whole record, for a change record from a quorum this worker does not hold:
        a sibling takes the one its watching worker wrote beside the view, else etcd's."""
        share = self.share
        if share is not None and not share.leader and (whole := share.members(q)) is not None:
            return whole
        return self._keys.members_of(q)

    def _update(self) -> bool:
        """Bring the mirror up to date: a whole read when the stream asked for one (established, or
        lost; none before it is first established, which asks for one at once; the changes queued
        before it are in it; those that arrive during it are applied after it, again in order),
        then the queued changes. False when etcd could not be read (or a change could not be
        applied): the next wake tries again."""
        if not self._loaded and not self._dirty.is_set():
            return False  # the stream is not established yet: the read it asks for then is the first
        try:
            if self._dirty.is_set():
                self._dirty.clear()  # a stream lost during the read sets it again
                self._changes.clear()
                self.mirror.load(self._keys.read_watched())
                self._loaded = True
                self.reads += 1
                self._unpublished = None
            while self._changes:
                change = self._changes.popleft()
                self.mirror.apply(change)
                self.applied += 1
                if self._unpublished is not None and self.share is not None and self.share.leader:
                    self._unpublished.append(change)
        except Exception as exc:  # noqa: BLE001 - etcd out of reach (the lease decides), or a malformed record
            self._dirty.set()
            logger.info("live: watcher could not read etcd: %s", exc)
            return False
        return not self._dirty.is_set()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.share is not None:
            self.share.close()


__all__ = ["BEHIND_READ", "ViewKeeper"]
