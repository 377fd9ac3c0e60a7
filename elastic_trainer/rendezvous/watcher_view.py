"""What the live watcher knows of etcd: the live keys read whole once, then kept by their changes.

A live worker's watcher (``rendezvous/watcher.py``) decides from a view of the live keys
(``quorum``, ``alive/``, ``join/``, ``stall/``, ``busy/``: ``rendezvous/live_etcd.py``). Reading them
whole after every event cost etcd one transaction per worker per change (at 100 x 8, every loss
woke 800 reads at once), so the view is kept instead:

- the keys are read whole (one transaction, ``_read_all``) only when the etcd watch
  (``rendezvous/live_watch.py``, a stream of its own) is (re-)established or lost, or after a
  pause longer than a lease;
- between, the changes the watch delivers are applied to that read in order (``members.LiveKeys``),
  one message per change;
- with one etcd watch per node (``rendezvous/node_watch.py``), the worker that keeps the node's
  watch publishes what it knows after each update, and its siblings load that (``_load_published``)
  instead of watching etcd themselves. A sibling waits up to a lease for the node's first view, and
  reads etcd itself when the view it holds stays older than its quorum past ``BEHIND_READ``.

``WatcherView`` is that part of the ``Watcher``: ``_look(q)`` returns the current view for quorum
``q`` and whether this worker knows it from etcd itself. Design and numbers: docs/trainer.md,
"Watching etcd", and docs/rendezvous.md (the live path at scale).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from elastic_trainer.rendezvous.live_watch import KeysWatch
from elastic_trainer.rendezvous.members import Change, LiveKeys, Quorum, View, range_op
from elastic_trainer.rendezvous.node_watch import NodeWatch

if TYPE_CHECKING:
    from elastic_trainer.rendezvous.quorum import LiveGroup

logger = logging.getLogger("elastic_trainer.rendezvous.quorum")

WATCHED = ("quorum", "alive/", "join/", "stall/", "busy/")
"""The live keys the watcher reads whole when its watch is (re-)established, and then follows by their changes."""


class WatcherView:
    """The view of the live keys that ``group``'s watcher keeps (see the module docstring)."""

    BEHIND_READ = 1.0
    """Seconds (or 10 polls, if longer) a sibling waits for a published view as new as its quorum
    before it reads etcd itself (for the node's first view: a lease)."""

    reread_on_event = False
    """Read every live key again on each event, as the watcher did before it applied the events
    (``benchmarks/live_sim.py --reread``: the "before" of its numbers); never in training."""


    def __init__(self, group: LiveGroup) -> None:
        self.group = group
        self._wake = threading.Event()
        self._dirty = threading.Event()  # the watch was (re-)established or lost: read everything again
        self._keys = LiveKeys(group.prefix)  # the last whole read, with the watch's changes applied
        self._keys.fetch_members = self._fetch_members
        self._loaded = False
        self._changes: deque[Change] = deque()  # from the watch's thread, applied by the watcher's
        self._watch: KeysWatch | None = None
        self._node: NodeWatch | None = None
        self.reads = 0
        """Whole reads of the live keys (one per watch established, and after an etcd failure)."""
        self.applied = 0
        """Changes applied from the watch's events."""
        self.loads = 0
        """Views loaded from the node's watching worker (a sibling's, ``rendezvous/node_watch.py``)."""
        self._sibling_loaded = False  # a sibling: _keys holds a published view (or its own read)
        self._behind = False  # a sibling: the view it holds predates its quorum (it tells nothing of q's members)
        self._behind_since: float | None = None
        self._first_wait: float | None = None  # a sibling: since when it waits for its node's first view
        self._unpublished: list[Change] | None = None  # changes applied since the last publish (None: read whole)

    def _open_watch(self) -> None:
        """Keep the etcd watch (at the start, or as a sibling promoted when the last keeper died)."""
        watch = KeysWatch(self.group.conn, [self.group._key(k) for k in WATCHED], self._changed,
                          on_events=self._events)
        self.group._start_thread("live-watch-stream", watch.run, stop=watch.close)
        self._watch = watch

    def _look(self, q: Quorum) -> tuple[View, bool] | None:
        """The current view for quorum ``q``, and whether this worker knows it from etcd itself
        (None when etcd could not be read: the next wake tries again). The watching worker (or a
        worker with a watch of its own) follows its watch and publishes what it knows, whenever
        that changed, for its siblings (``_load_published``)."""
        node = self._node
        self._keys.hint = q  # a quorum record that is a change from q is applied without a read
        if node is not None and not node.leader:
            return self._load_published(node, q)
        self._behind = False
        if not self._update():
            return None
        self._keys.track(q)
        if node is not None and node.leader and (self._unpublished is None or self._unpublished):
            try:
                node.publish(self._keys, self._unpublished)
                self._unpublished = []
            except OSError as exc:  # the siblings read etcd themselves when they find nothing
                self._unpublished = None  # a new snapshot next time
                logger.warning("live: could not publish the node's view to its workers: %s", exc)
        return self._keys.view(q.q), True

    def _load_published(self, node: NodeWatch, q: Quorum) -> tuple[View, bool] | None:
        """A sibling's view: what its node's watching worker published last, loaded when woken
        by a new one (``NodeWatch.load``: the changes logged since the last). The view holds every
        live key, so it serves whatever quorum this worker is in. Until one is published (at the
        start: at 1,000 nodes every node's first read is in flight at once) the sibling waits up to
        a lease, then reads etcd itself, once. A view that
        predates this worker's quorum (the watching worker has not seen the re-form yet: it
        publishes within moments) tells nothing about ``q``'s members: no loss is concluded from
        it, and if no newer one comes within ``BEHIND_READ``, the sibling reads etcd itself."""
        now = time.monotonic()
        patience = max(self.BEHIND_READ, 10 * self.group.settings.poll)
        if self._dirty.is_set() or not self._sibling_loaded:
            self._dirty.clear()
            if node.load(self._keys):
                self.loads += 1
                self._sibling_loaded = True
            elif self._sibling_loaded:  # caught between a new epoch's two files: the next wake loads
                self._dirty.set()
            else:  # nothing published yet (the start): the watching worker's first read is on its way
                self._first_wait = self._first_wait or now
                if now - self._first_wait < max(patience, self.group.settings.lease_ttl) or not self._read_whole():
                    return None
        self._keys.track(q)
        known = self._keys.quorum
        self._behind = known is None or known.q < q.q
        if not self._behind:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = now
        elif now - self._behind_since > patience and self._read_whole():
            self._behind_since = None
            self._keys.track(q)
            self._behind = self._keys.quorum is None or self._keys.quorum.q < q.q
        return self._keys.view(q.q), False

    def _read_whole(self) -> bool:
        """A sibling reads the live keys from etcd itself (False when it could not)."""
        try:
            self._keys.load(self._read_all())
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
        node = self._node
        if node is not None and not node.leader and (whole := node.members(q)) is not None:
            return whole
        return self.group._members_of(q)

    def _changed(self) -> None:
        """From the watch's thread: the watch was (re-)established or lost: read everything again."""
        self._dirty.set()
        self._wake.set()

    def _events(self, changes: list[Change]) -> None:
        """From the watch's thread: live keys changed; the watcher thread applies them in order."""
        if self.reread_on_event:
            self._changed()
            return
        self._changes.extend(changes)
        self._wake.set()

    def _update(self) -> bool:
        """Bring ``_keys`` up to date: a whole read when the watch asked for one (established, or
        lost; none before it is first established, which asks for one at once; the changes
        queued before it are in it; those that arrive during it are applied after it, again in
        order), then the queued changes. False when etcd could not be read (or a change could not
        be applied): the next wake tries again."""
        if not self._loaded and not self._dirty.is_set():
            return False  # the watch is not established yet: the read it asks for then is the first
        try:
            if self._dirty.is_set():
                self._dirty.clear()  # a stream lost during the read sets it again
                self._changes.clear()
                self._keys.load(self._read_all())
                self._loaded = True
                self.reads += 1
                self._unpublished = None
            while self._changes:
                change = self._changes.popleft()
                self._keys.apply(change)
                self.applied += 1
                if self._unpublished is not None and self._node is not None and self._node.leader:
                    self._unpublished.append(change)
        except Exception as exc:  # noqa: BLE001 - etcd out of reach (the lease decides), or a malformed record
            self._dirty.set()
            logger.info("live: watcher could not read etcd: %s", exc)
            return False
        return not self._dirty.is_set()

    def _read_all(self) -> list[Change]:
        """Every watched key, in one transaction, as changes that put them. The transaction is sent
        as etcd's own request and its key-values read from the response as they are (python-etcd3's
        ``transaction`` wraps each in a metadata object: half of a first read's cost at 8,000 keys)."""
        from etcd3 import etcdrpc

        ops = [range_op(self.group._key(k)) for k in WATCHED]

        def txn(c):
            response = c.txns([etcdrpc.TxnRequest(success=ops)])[0]
            return [Change(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
                    for op in response.responses for kv in op.response_range.kvs]

        return self.group._call(txn, "read")


__all__ = ["WATCHED", "WatcherView"]
