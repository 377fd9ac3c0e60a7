"""The re-form's first candidates follow the reports through a standing watch, so no round opens one.

A live re-form has one proposer, the first candidate in line (``live/reform.py``), and it waits for
every survivor's report (``report/<q>/<id>``, or a node's ``report/<q>/@<node>``). Reading them
again and again until all are in cost etcd O(N) keys a look (at 1,000 nodes of 8: 0.03 s a read
quiet, up to 0.3 s under load, the quorum written 0.11-0.26 s after the last report). Following
them with a watch opened at the start of the round paid for the watch in every round (a thread, a
stream, a first read: ~3 ms of a 4 ms re-form at 3 single-worker nodes), so it was only done from
64 members on, and only ran in a simulation.

Now the first ``BACKUPS + 1`` candidates of a quorum (each node's first member, of the first
nodes in member order: whoever may have to propose without a node lost first) keep a
``ReportFeed`` from the moment they adopt the quorum: one ``WatchStream`` on ``report/``
(``live/stream.py``), read whole once each time it is established, then kept by its events. The
same path at 3 nodes as at 1,000: a proposer's look reads nothing, each report wakes it, and the
last one is followed by the compare-and-swap at once. Between re-forms the stream carries nothing
(reports are put only during a round; their deletion two quorums later is one event per key).

``ready`` says the feed holds every report key (its stream established and read since); when it
is not (etcd restarting, a candidate promoted past the first ones), the proposer reads the
reports itself, as it did before. The stream's thread makes the read and applies the events, in
order, so a report put before the stream was established is in the read and one after it is an
event (their union is exact).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable

from elastic_trainer.live.keys import Change, LiveKeys
from elastic_trainer.live.node_report import NODE_MARK, expand
from elastic_trainer.live.stream import StreamFactory, WatchStream
from elastic_trainer.live.threads import StartThread

logger = logging.getLogger(__name__)


class ReportFeed:
    """The report keys of the run as a standing watch keeps them (see the module docstring);
    ``on_wake()`` is called from the stream's thread after every change it applied."""

    def __init__(self, keys: LiveKeys, start_thread: StartThread, on_wake: Callable[[], None],
                 stream_factory: StreamFactory = WatchStream) -> None:
        self._keys = keys
        self._on_wake = on_wake
        self._prefix = keys.key("report/")
        self._lock = threading.Lock()
        self._reports: dict[str, dict] = {}  # "<q>/<id or @node>" -> the report
        self._covered: dict[int, Counter[str]] = {}  # q -> the members its reports stand for (a member in two: 2)
        self._ready = False
        self._stream = stream_factory(keys.conn, [self._prefix], self._changed, on_events=self._events)
        start_thread("live-report-watch", self._stream.run, stop=self._stream.close)

    @property
    def ready(self) -> bool:
        """The stream is established and was read since: every report key is here."""
        return self._ready

    def reports(self, q: int) -> dict[str, dict]:
        """The reports for the re-form into quorum ``q``, by member id (a node's expanded)."""
        head = f"{q}/"
        with self._lock:
            mine = {sub[len(head):]: value for sub, value in self._reports.items() if sub.startswith(head)}
        return expand(mine)

    def covered(self, q: int) -> int:
        """How many members the reports for quorum ``q`` stand for."""
        return len(self._covered.get(q, ()))

    def holds(self, q: int, member_id: str) -> bool:
        """Whether a report for quorum ``q`` stands for ``member_id`` (its own, or its node's)."""
        return member_id in self._covered.get(q, ())

    def close(self) -> None:
        self._ready = False
        self._stream.close()

    # ---- the stream's thread -------------------------------------------------------------------
    def _changed(self) -> None:
        """Established (read everything, then follow the events) or lost (not ready)."""
        self._ready = False
        if self._stream.established.is_set():
            try:
                whole = self._keys.read_reports()
            except Exception as exc:  # noqa: BLE001 - not ready: the proposer reads the reports itself
                logger.info("live: could not read the reports for the report feed: %s", exc)
            else:
                with self._lock:
                    self._reports, self._covered = {}, {}
                    for sub, value in whole.items():
                        self._set(sub, value)
                self._ready = True
        self._on_wake()

    def _events(self, changes: list[Change]) -> None:
        n = len(self._prefix)
        with self._lock:
            for change in changes:
                value = None
                if change.value is not None:
                    try:
                        value = json.loads(change.value)
                    except ValueError:
                        continue
                    if not isinstance(value, dict):
                        continue
                self._set(change.key[n:], value)
        self._on_wake()

    def _set(self, sub: str, value: dict | None) -> None:
        """Report ``sub`` is ``value`` now (None: deleted), and ``covered`` follows. Under ``_lock``."""
        q_text, _, key = sub.partition("/")
        if not q_text.isdigit():
            return
        q = int(q_text)
        counts = self._covered.setdefault(q, Counter())
        old = self._reports.pop(sub, None)
        if old is not None:
            for member in _members(key, old):
                counts[member] -= 1
                if counts[member] <= 0:
                    del counts[member]
        if value is not None:
            self._reports[sub] = value
            counts.update(_members(key, value))
        if not counts:
            del self._covered[q]


def _members(key: str, value: dict) -> list[str]:
    """The members report ``key`` (less ``report/<q>/``) stands for: a node's (``@<node>``) all of
    its members, a member's report itself."""
    if not key.startswith(NODE_MARK):
        return [key]
    members = value.get("members")
    return [str(m) for m in members] if isinstance(members, dict) else []


__all__ = ["ReportFeed"]
