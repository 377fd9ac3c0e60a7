"""The live quorum's watcher: one thread per worker that looks at etcd while the worker trains.

It keeps a view of the live keys (``rendezvous/watcher_view.py``: read whole only when its etcd
watch, ``rendezvous/live_watch.py``, is (re-)established, then kept by the changes the watch
delivers, or loaded from the node's watching worker), looks at it at each change, and every
``poll`` (0.1 s) makes the checks that need no etcd (the hang bound, the probes, a stuck training
thread). From
what it knows it decides whether the group must change (``LiveGroup.change_pending``, shared with the
others at the next step-end agreement) or, for a silent loss, whether the group's collectives in
flight must fail now (``LiveGroup.on_member_lost``: the Manager abandons the process group):

- a member's lease expired (a node frozen or cut off), the quorum moved on, or (``probe_peers``,
  NCCL) a member's process is gone: lost;
- a stall declared for this quorum (``stall/<q>``), or this rank's own step past the hang bound
  (``rendezvous/progress.py``) with no member busy (nor busy within the last bound): lost, and
  this rank's training thread must come out of its step within half a second, or it is the hung
  one and ends its process (``LiveGroup.on_hung``);
- a node waits to join: a planned re-form;
- this worker's own ``alive`` key gone (on the node's lease, ``rendezvous/node_lease.py``): the
  node's lease expired, and the worker leaves (``LiveGroup.on_view``).

It also keeps this rank's ``busy/<id>`` key while the rank is in a slow phase or warming up
(written on transitions only). Design and numbers: docs/trainer.md, "Silent failures" and
"Watching etcd".
"""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Callable

from elastic_trainer.rendezvous.members import Quorum, View, complete_nodes, probe_dead
from elastic_trainer.rendezvous.watcher_view import WatcherView

if TYPE_CHECKING:
    from elastic_trainer.rendezvous.quorum import LiveGroup

logger = logging.getLogger("elastic_trainer.rendezvous.quorum")


class Watcher(WatcherView):
    """Watches the live keys for ``group`` while its worker trains (see the module docstring)."""

    def __init__(self, group: LiveGroup) -> None:
        super().__init__(group)
        self._busy_shown: tuple[int, str] | None = None  # (quorum, what) of the busy key this worker wrote
        self._waiting_on = ""
        self._trouble: tuple[int, float, int, str] | None = None  # (quorum, when, moves, why): the thread must move
        self._excluded_since: float | None = None  # when this worker was first seen left out of a newer quorum
        self.on_view: Callable[[View], None] | None = None
        """Called from the watcher thread with the view after each update (a read, or changes
        applied), before it is acted on; it must not keep the view (``benchmarks/live_sim.py``)."""
        self._last_look = time.monotonic()
        self._busy_seen = float("-inf")  # when a peer was last seen busy (_declare_stall)

    def run(self) -> None:
        # One etcd watch per node (rendezvous/node_watch.py): the worker that locks it keeps the
        # stream and publishes its views; a sibling is woken by each and takes over if it dies.
        self._node = self.group.node_watch(self._changed, self._open_watch)
        if self._node is None or self._node.try_lead():
            self._open_watch()
        else:
            self.group._start_thread("live-node-watch", self._node.run, stop=self._node.close)
        try:
            self._loop()
        finally:
            if self._watch is not None:
                self._watch.close()
            if self._node is not None:
                self._node.close()

    def _loop(self) -> None:
        while not self.group.stopped:
            self._wake.wait(self.group.settings.poll)
            self._wake.clear()
            self.look()

    def look(self) -> None:
        """One look (what the thread does at each wake-up): the view, what it says, what to do."""
        now = time.monotonic()
        if now - self._last_look > self.group.settings.lease_ttl:  # paused: events may be on their way
            self._dirty.set()
        self._last_look = now
        q = self.group.quorum
        if q is None or self.group.stopped:
            return
        self._show_busy(q)
        got = self._look(q)
        if got is None:
            return
        view, own = got
        if self.on_view is not None:
            self.on_view(view)
        self.group.seen(view)  # a follower of a re-form learns the new quorum from it (live_reform.py)
        self.group.on_view(view, current=self._watch is not None and self._watch.established.is_set()
                           and not self._dirty.is_set(), authoritative=own)
        self._check_stuck(q, view)
        if self.group.change_pending.is_set():
            return
        lost, must_move = self._lost(q, view), False
        if not lost and view.stall is not None:
            lost, must_move = f"{view.stall.get('by')} saw no progress for {view.stall.get('waited', 0):.1f}s", True
        if not lost and (lasted := self.group.progress.stalled()) is not None and self._declare_stall(q, view, lasted):
            lost, must_move = f"no progress for {lasted:.1f}s (a rank is hung)", True
        reason = lost
        if not lost and view.joiners and (waiting := complete_nodes(view)):  # q.nodes: O(members)
            nodes = q.nodes
            if len(nodes) < self.group.settings.max_nodes and any(n not in nodes for n, _ in waiting):
                reason = "a node asks to join"
        if reason:
            with self.group._adopt_lock:
                if self.group.quorum is not q:  # re-formed while this view was read: it is stale
                    return
                self.group.change_reason = reason
                self.group.change_pending.set()
        if lost:
            if must_move:  # the training thread must come out of its step now, or it is the hung one
                self._trouble = (q.q, time.monotonic(), self.group.progress.moves,
                                 f"its training thread made no progress while its peers waited ({lost}) and "
                                 f"did not come out of its step once the group was abandoned: it is the hung rank")
            if self.group.on_member_lost is not None:
                logger.warning("live: %s in quorum %d: abandoning the process group's collectives", lost, q.q)
                self.group.on_member_lost(lost)

    def _lost(self, q: Quorum, view: View) -> str:
        """Why the quorum ``q`` lost a member (moved on, a lease expired, a process gone), or ""."""
        if view.quorum is not None and view.quorum.q > q.q:
            return f"the quorum moved to {view.quorum.q}"
        # Kept by LiveKeys for q (tracked): no walk over the members (none for a sibling's view
        # that predates q, ``_load_published``).
        missing = {} if self._behind else self._keys.missing
        if missing:
            return f"the etcd lease of {next(iter(missing))} expired (stopped or cut off)"
        if self.group.probe_peers and (gone := self._probe_other_nodes(q)):
            return f"the process of {gone} is gone"
        return ""

    def _declare_stall(self, q: Quorum, view: View, lasted: float) -> bool:
        """This rank waited past the hang bound: unless a peer is busy (a checkpoint, a warm-up),
        declare quorum ``q`` stalled in etcd (one key, first writer wins), so that every rank
        abandons its collectives and the hung one is found. True when the stall is declared."""
        busy = {mid: v for mid, v in view.busy.items() if q.rank_of(mid) is not None and mid != self.group.id}
        now = time.monotonic()
        if busy:
            self._busy_seen = now
            waiting_on = ", ".join(f"{mid} ({v.get('what')})" for mid, v in sorted(busy.items()))
            if waiting_on != self._waiting_on:
                self._waiting_on = waiting_on
                logger.info("live: step running %.1fs, past the hang bound; not a hang: busy %s", lasted, waiting_on)
            return False
        # A peer just out of its slow phase deletes its busy key on its way to the collective this
        # rank waits in: the watch says so at once, before that collective completes. The bound
        # counts again from when a peer was last seen busy.
        if now - self._busy_seen < (self.group.progress.bound() or self.group.settings.hang_min):
            return False
        key = self.group._key(f"stall/{q.q}")
        record = json.dumps({"by": self.group.id, "waited": lasted, "bound": self.group.progress.bound(),
                             "median_step": self.group.progress.median_step(), "at": time.time()}).encode()

        def txn(c):
            t = c.transactions
            return c.transaction(compare=[t.create(key) == 0], success=[t.put(key, record)], failure=[])

        try:
            self.group._call(txn, "stall declaration")
        except Exception as exc:  # noqa: BLE001 - etcd out of reach: try again at the next poll
            logger.info("live: could not declare the stall: %s", exc)
            return False
        logger.warning("live: no progress for %.1fs in a step (bound %.1fs = max(hang_min %g s, hang_factor %g x "
                       "median step %.3fs)) and no peer is busy: quorum %d is stalled", lasted,
                       self.group.progress.bound() or 0.0, self.group.settings.hang_min, self.group.settings.hang_factor,
                       self.group.progress.median_step() or 0.0, q.q)
        return True

    def _show_busy(self, q: Quorum) -> None:
        """Keep ``busy/<id>`` in etcd while this rank is in a slow phase (or warming up past half a
        second), so that its peers do not take their wait for it as a hang."""
        busy = self.group.progress.busy()
        if busy == "warm-up" and (self.group.progress.in_step() or 0.0) < 0.5:
            busy = None if self._busy_shown is None else self._busy_shown[1]
        want = (q.q, busy) if busy is not None else None
        if want == self._busy_shown:
            return
        try:
            if want is None:
                self.group._lease.delete(self.group._key("busy/" + self.group.id))
            else:
                self.group._lease.put(self.group._key("busy/" + self.group.id), json.dumps({"q": q.q, "what": busy}).encode())
            self._busy_shown = want
        except Exception as exc:  # noqa: BLE001 - tried again at the next poll
            logger.info("live: could not update the busy key: %s", exc)

    def wake(self) -> None:
        """Look now (a slow phase began, or the group closes)."""
        self._wake.set()

    def _check_stuck(self, q: Quorum, view: View) -> None:
        """End this worker when its training thread is stuck while the others go on:

        - it did not come out of its step within ``come_back`` seconds of a declared stall (and is
          not in a slow phase it announced): it is the hung rank;
        - the quorum formed without it and the thread has not started re-forming (which would
          raise ``LiveExcluded`` and exit cleanly) within ``come_back``, or ``report_timeout`` when
          it is in a slow phase: it would never learn, or never get there (a save that hangs)."""
        progress = self.group.progress
        now = time.monotonic()
        come_back = max(0.5, 3 * self.group.settings.poll)
        why = ""
        if self._trouble is not None:
            tq, since, seen_moves, what = self._trouble
            if tq != q.q or progress.moves != seen_moves or progress.reforming \
                    or progress.busy() not in (None, "warm-up"):
                self._trouble = None
            elif now - since > come_back:
                why = what
        moved = view.quorum
        if moved is not None and moved.q > q.q and moved.rank_of(self.group.id) is None and not progress.reforming:
            if self._excluded_since is None:
                self._excluded_since = now
            grace = come_back if progress.busy() is None else max(come_back, self.group.settings.report_timeout)
            if not why and now - self._excluded_since > grace:
                why = (f"quorum {moved.q} formed without it ({moved.cause}) and its training thread did not "
                       f"start re-forming within {grace:g}s")
        else:
            self._excluded_since = None
        if why:
            reason = f"live: this worker leaves the group: {why}; its agent starts a newcomer"
            logger.error("%s", reason)
            self._trouble = self._excluded_since = None
            if self.group.on_hung is not None:
                self.group.on_hung(reason)

    def _probe_other_nodes(self, q: Quorum) -> str | None:
        """The id of a member of another node whose probe port refuses connections, if any (one
        member per node is probed: a node is kept or dropped whole)."""
        seen = {self.group.node}
        for m in q.members:
            if m.node not in seen:
                seen.add(m.node)
                if probe_dead(m.probe):
                    return m.id
        return None


__all__ = ["Watcher"]
