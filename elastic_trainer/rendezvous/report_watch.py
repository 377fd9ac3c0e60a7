"""The proposer's watch on the reports of a live re-form.

The proposer of a live re-form (``rendezvous/live_reform.py``) used to read every report and
alive key again and again until every survivor had reported: at 1,000 nodes of 8 a read took
0.03 s quiet and up to 0.3 s under load, and the quorum was written 0.11-0.26 s after the last report (a look every read's
time, ``benchmarks/results/live_sim_thin_1000x8.txt``). Now it reads once, then follows the
reports with a watch on ``report/<q>/`` and the quorum, the leases, the joiners and a declared stall
with its own watcher's view: the last report wakes it, and the compare-and-swap follows at once.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING

from elastic_trainer.rendezvous.live_watch import KeysWatch
from elastic_trainer.rendezvous.members import Change
from elastic_trainer.rendezvous.node_report import NODE_MARK

if TYPE_CHECKING:
    from elastic_trainer.rendezvous.live_reform import LiveReform


class ReportsWatch:
    """The proposer's watch on ``report/<q>/`` (``live_watch.KeysWatch``): the reports as they are
    put, so that its looks read nothing once the watch is established and was read
    (``ready``): each report wakes the proposer, and the last one is followed by the quorum's
    compare-and-swap at once, not by the next whole read (0.1-0.26 s at 1,000 nodes of 8).

    ``stale`` says a whole read is due: the stream was (re-)established or lost, or a
    compare-and-swap found the quorum moved. ``begin_read()`` clears it before that read (a change
    of the stream during the read sets it again); the read's report keys and the events make the
    whole set (a report put before the stream was established is in the read, one after it is an
    event; reports are only put during a round, so their union is exact)."""

    def __init__(self, group: LiveReform, target: int) -> None:
        self._group, self._target = group, target
        self.opened = time.monotonic()
        self.members = 0
        """The members the reports so far stand for (a member in its node's report and its own counts twice)."""
        prefix = group._key(f"report/{target}/")
        self._n = len(prefix)
        self._keys: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._wake = group._seen_event
        self._read = False
        self.stale = True
        self._watch = KeysWatch(group.conn, [prefix], self._changed, on_events=self._events)
        group._start_thread("live-report-watch", self._watch.run, stop=self._watch.close)

    def _changed(self) -> None:
        self.stale, self._read = True, False
        self._wake.set()

    def _events(self, changes: list[Change]) -> None:
        with self._lock:
            for change in changes:
                sub = change.key[self._n:]
                if change.value is None:
                    self._set(sub, None)
                    continue
                try:
                    value = json.loads(change.value)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    self._set(sub, value)
        self._wake.set()

    def _set(self, sub: str, value: dict | None) -> None:
        """Key ``sub`` is ``value`` now (None: deleted); ``members`` follows. Under ``_lock``."""
        old = self._keys.pop(sub, None)
        if old is not None:
            self.members -= _covers(sub, old)
        if value is not None:
            self._keys[sub] = value
            self.members += _covers(sub, value)

    def begin_read(self) -> bool:
        """Before a whole read: whether the stream is established (then the read completes it)."""
        self.stale = False
        return self._watch.established.is_set()

    def read(self, keys: dict[str, dict], watched: bool) -> None:
        """The report keys of the whole read begun with ``begin_read()`` (which returned ``watched``)."""
        with self._lock:
            for sub, value in keys.items():
                if sub not in self._keys:
                    self._set(sub, value)
        self._read = watched and not self.stale

    @property
    def ready(self) -> bool:
        """Established, read since, and no read due: the reports are all here."""
        return self._read and not self.stale

    def catch_up(self, wait: float) -> None:
        """Once the stream is established (waiting ``wait`` seconds at most for it), read the
        reports put before it (``ready`` after); a stream not established yet: nothing (the
        proposer reads everything, as without a watch)."""
        if not self._watch.established.wait(max(0.0, wait)):
            return
        watched = self.begin_read()
        self.read(self._group._read_reports(self._target), watched)

    def reports(self) -> dict[str, dict]:
        with self._lock:
            return dict(self._keys)

    def close(self) -> None:
        self._watch.close()


def _covers(sub: str, value: dict) -> int:
    """How many members' reports key ``sub`` holds: a node's (``node_report``) all of its members'."""
    if sub.startswith(NODE_MARK):
        members = value.get("members")
        return len(members) if isinstance(members, dict) else 0
    return 1


__all__ = ["ReportsWatch"]
