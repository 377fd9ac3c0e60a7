"""The live watcher: one thread per worker that looks at etcd while the worker is a member.

It runs from the moment the worker joined a quorum (``LiveGroup.join``: also while a process group
forms and the state is sent) until it leaves. It keeps a view of the live keys
(``live/view_keeper.py``: read whole only when its etcd watch is (re-)established, then kept by
the changes the watch delivers, or loaded from the node's watching worker), looks at it at each
change, and every ``poll`` (0.1 s) makes the checks that need no etcd (the hang bound, the probes,
a stuck training thread). Each view goes to its subscribers (the re-form's followers learn the
next quorum from it: ``live/reform.py``) and to the worker's lease (its own ``alive`` key:
``live/worker_lease.py``). From what it sees it decides whether the group must change
(``Membership.flag_change``, shared with the others at the next step-end agreement) or, for a
silent loss, whether the group's collectives in flight must fail now (``on_member_lost``: the
Manager abandons the process group):

- a member's lease expired (a node frozen or cut off), the quorum moved on, or (``probe_peers``,
  NCCL) a member's process is gone: lost, with a warning;
- a member left cleanly (its ``alive`` key said so before it went): lost as well (the group cannot
  go on without it), said without a warning; once the quorum is marked finished (the run's
  normal end) members leave and nothing is lost;
- a stall declared for this quorum (``stall/<q>``), or this rank's own step past the hang bound
  (``live/progress.py``) with no member busy (nor busy within the last bound): lost, and this
  rank's training thread must come out of its step within half a second, or it is the hung one
  and ends its process (``on_hung``);
- a node waits to join: a planned re-form.

The last loss it found for the quorum it holds is ``loss_of(q)``: the group's store fails its
waits on it while that quorum's group forms (``live/group_store.py``). It also keeps this rank's
``busy/<id>`` key while the rank is in a slow phase or warming up (written on transitions only).
Design and numbers: docs/trainer.md, "Silent failures" and "Watching etcd".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from elastic_trainer.env import LiveSettings
from elastic_trainer.live.keys import LiveKeys, View
from elastic_trainer.live.membership import Membership
from elastic_trainer.live.probe import Prober, probe_dead
from elastic_trainer.live.progress import Progress
from elastic_trainer.live.quorum import Quorum
from elastic_trainer.live.stream import StreamFactory, WatchStream
from elastic_trainer.live.threads import StartThread
from elastic_trainer.live.view_keeper import ViewKeeper
from elastic_trainer.live.worker_lease import WorkerLease

logger = logging.getLogger(__name__)

FORMING_PROBES = 64
"""Nodes probed per look (in turn: all of them at a few nodes) while the training thread forms a gloo group."""
FORMING_GRACE = 1.0
"""Seconds (past half a second) a process group of a quorum that lost a member may go on forming
before the worker counts as stuck (``Watcher``'s stuck check): its store's waits end within a poll."""


class Watcher:
    """Watches the live keys for ``membership``'s worker (see the module docstring).

    ``on_member_lost(reason)``: the group's collectives in flight must fail now (from the watcher
    thread); ``on_hung(reason)``: this worker's training thread is stuck while its peers go on (it
    must end the process); ``probe_peers``: also probe one member of every other node each poll
    (NCCL: a collective may hang on a dead peer instead of failing)."""

    def __init__(self, keys: LiveKeys, membership: Membership, lease: WorkerLease, progress: Progress,
                 settings: LiveSettings, start_thread: StartThread, *,
                 on_member_lost: Callable[[str], None] | None = None, on_hung: Callable[[str], None] | None = None,
                 probe_peers: bool = False, stream_factory: StreamFactory = WatchStream) -> None:
        self._keys, self._membership, self._lease, self._progress = keys, membership, lease, progress
        self._settings, self._start_thread = settings, start_thread
        self._on_member_lost, self._on_hung = on_member_lost, on_hung
        self.probe_peers = probe_peers
        """Also probe one member of every other node each poll (set before ``start``)."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.keeper = ViewKeeper(keys, settings, start_thread, self._wake.set, node_dir=lease.directory,
                                 stream_factory=stream_factory)
        """Where its view comes from (its counters: ``reads``, ``applied``, ``loads``)."""
        self._subscribers: list[Callable[[View], None]] = []
        self._loss: tuple[Quorum, str] | None = None
        self._loss_at = 0.0  # when the loss was seen
        self._forming_prober = Prober(FORMING_PROBES)  # gloo: the other nodes, while the training thread forms a group
        self._busy_shown: tuple[int, str] | None = None  # (quorum, what) of the busy key this worker wrote
        self._waiting_on = ""
        self._trouble: tuple[int, float, int, str] | None = None  # (quorum, when, moves, why): the thread must move
        self._excluded_since: float | None = None  # when this worker was first seen left out of a newer quorum
        self._last_look = time.monotonic()
        self._busy_seen = float("-inf")  # when a peer was last seen busy (_declare_stall)

    def subscribe(self, on_view: Callable[[View], None]) -> None:
        """Call ``on_view(view)`` from the watcher thread with each view it looks at, before it acts
        on it. ``view.alive`` is the watcher's own set: look up members in it, never iterate it."""
        self._subscribers.append(on_view)

    # ---- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching (once): the ``live-watch`` thread, which takes its part in the node's
        watch (or a stream of its own) first, off its starter's way (a newcomer's group forms meanwhile)."""
        if self._thread is None:
            self._thread = self._start_thread("live-watch", self._run, stop=self.close)

    def _run(self) -> None:
        try:
            share = self.keeper.open()
            if share is not None:  # a sibling: woken by each view its node's watching worker publishes
                self._start_thread("live-node-watch", share.run, stop=share.close)
            while not self._stop.is_set():
                self._wake.wait(self._settings.poll)
                self._wake.clear()
                self.look()
        finally:
            self.keeper.close()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Look now (a slow phase began, or the group closes)."""
        self._wake.set()

    def close(self) -> None:
        """Stop the thread (it closes the stream and the node's watch on its way out) and wait for it."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None:
            self.keeper.close()
        elif thread is not threading.current_thread():
            thread.join(timeout=2)

    # ---- one look ------------------------------------------------------------------------------
    def look(self) -> None:
        """One look (what the thread does at each wake-up): the view, what it says, what to do."""
        now = time.monotonic()
        if now - self._last_look > self._settings.lease_ttl:  # paused: events may be on their way
            self.keeper.invalidate()
        self._last_look = now
        q = self._membership.quorum
        if q is None or self._stop.is_set():
            return
        self._show_busy(q)
        got = self.keeper.view_for(q)
        if got is None:
            return
        view, own = got
        for on_view in self._subscribers:
            on_view(view)
        self._lease.saw_view(self._membership.id in view.alive, current=self.keeper.current, authoritative=own)
        self._check_stuck(q, view)
        if self._loss is not None and self._loss[0] is q:
            return  # this quorum's loss is known and was acted on
        pending = self._membership.change_pending.is_set()  # a re-form is asked already (a node to admit)
        (lost, departed), must_move = self._lost(q, view), False
        if not lost and not pending and view.stall is not None:
            lost, must_move = f"{view.stall.get('by')} saw no progress for {view.stall.get('waited', 0):.1f}s", True
        if not lost and not pending and (lasted := self._progress.stalled()) is not None \
                and self._declare_stall(q, view, lasted):
            lost, must_move = f"no progress for {lasted:.1f}s (a rank is hung)", True
        if lost:
            if not self._membership.flag_change(q, lost):
                return  # re-formed while this view was read: it is stale
            self._loss, self._loss_at = (q, lost), time.monotonic()
            if must_move:  # the training thread must come out of its step now, or it is the hung one
                self._trouble = (q.q, time.monotonic(), self._progress.moves,
                                 f"its training thread made no progress while its peers waited ({lost}) and "
                                 f"did not come out of its step once the group was abandoned: it is the hung rank")
            if self._on_member_lost is not None:
                logger.log(logging.INFO if departed else logging.WARNING,
                           "live: %s in quorum %d: abandoning the process group's collectives", lost, q.q)
                self._on_member_lost(lost)
        elif not pending and view.joiners and (waiting := view.complete_nodes()):  # q.nodes: O(members)
            nodes = q.nodes
            if len(nodes) < self._settings.max_nodes and any(n not in nodes for n, _ in waiting):
                self._membership.flag_change(q, "a node asks to join")

    def loss_of(self, q: Quorum) -> str:
        """Why quorum ``q`` lost a member, as the last look found (lease, departure, probe, stall), or ""."""
        loss = self._loss
        return loss[1] if loss is not None and loss[0] is q else ""

    def _lost(self, q: Quorum, view: View) -> tuple[str, bool]:
        """Why the quorum ``q`` lost a member (moved on, a lease expired, a member left, a process
        gone), or "", and whether that member left cleanly (not a failure)."""
        current = view.quorum
        if current is not None and current.q > q.q:  # in a round, this worker left its group already
            return ("", False) if self._membership.reforming else (f"the quorum moved to {current.q}", False)
        if current is not None and current.q == q.q and current.finished:
            return "", False  # the run's normal end: its members leave
        # The mirror keeps the missing members of q (tracked): no walk over the members (none for
        # a sibling's view that predates q: it tells nothing of q's members).
        missing = {} if self.keeper.behind else self.keeper.mirror.missing
        if missing:
            gone = next(iter(missing))
            if gone in view.left:
                return f"{gone} left the group", True
            return f"the etcd lease of {gone} expired (stopped or cut off)", False
        if self.probe_peers and (dead := self._probe_other_nodes(q)):  # NCCL: a collective may hang on a dead peer
            return f"the process of {dead} is gone", False
        if not self.probe_peers and self._progress.forming_since is not None:  # gloo, while its group forms: a
            me = self._membership.me.node  # connection to a peer that died after writing its address is retried
            gone = self._forming_prober.dead([ms[0] for node, ms in q.by_node().items() if node != me])
            if gone:  # (FORMING_PROBES nodes a look, in turn)
                return f"the process of {sorted(gone)[0]} is gone", False
        return "", False

    def _declare_stall(self, q: Quorum, view: View, lasted: float) -> bool:
        """This rank waited past the hang bound: unless a peer is busy (a checkpoint, a warm-up),
        declare quorum ``q`` stalled in etcd (one key, first writer wins), so that every rank
        abandons its collectives and the hung one is found. True when the stall is declared."""
        busy = {mid: v for mid, v in view.busy.items() if q.rank_of(mid) is not None and mid != self._membership.id}
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
        progress = self._progress
        if now - self._busy_seen < (progress.bound() or self._settings.hang_min):
            return False
        record = json.dumps({"by": self._membership.id, "waited": lasted, "bound": progress.bound(),
                             "median_step": progress.median_step(), "at": time.time()}).encode()
        try:
            self._keys.declare_stall(q.q, record)
        except Exception as exc:  # noqa: BLE001 - etcd out of reach: try again at the next poll
            logger.info("live: could not declare the stall: %s", exc)
            return False
        logger.warning("live: no progress for %.1fs in a step (bound %.1fs = max(hang_min %g s, hang_factor %g x "
                       "median step %.3fs)) and no peer is busy: quorum %d is stalled", lasted,
                       progress.bound() or 0.0, self._settings.hang_min, self._settings.hang_factor,
                       progress.median_step() or 0.0, q.q)
        return True

    def _show_busy(self, q: Quorum) -> None:
        """Keep ``busy/<id>`` in etcd while this rank is in a slow phase (or warming up past half a
        second), so that its peers do not take their wait for it as a hang."""
        busy = self._progress.busy()
        if busy == "warm-up" and (self._progress.in_step() or 0.0) < 0.5:
            busy = None if self._busy_shown is None else self._busy_shown[1]
        want = (q.q, busy) if busy is not None else None
        if want == self._busy_shown:
            return
        key = self._keys.key("busy/" + self._membership.id)
        try:
            if want is None:
                self._lease.delete(key)
            else:
                self._lease.put(key, json.dumps({"q": q.q, "what": busy}).encode())
            self._busy_shown = want
        except Exception as exc:  # noqa: BLE001 - tried again at the next poll
            logger.info("live: could not update the busy key: %s", exc)

    def _check_stuck(self, q: Quorum, view: View) -> None:
        """End this worker when its training thread is stuck while the others go on:

        - it did not come out of its step within ``come_back`` seconds of a declared stall (and is
          not in a slow phase it announced): it is the hung rank;
        - the quorum formed without it and the thread has not started re-forming (which would
          raise ``LiveExcluded`` and exit cleanly) within ``come_back``, or ``report_timeout`` when
          it is in a slow phase: it would never learn, or never get there (a save that hangs);
        - it makes the process group of a quorum that lost a member, still ``FORMING_GRACE`` after
          the loss (the group's store ends its waits at once: ``MemberGone``; but gloo retries a
          connection to a peer that died after it wrote its address until the group's timeout,
          300 s by default): the group can never form."""
        progress = self._progress
        now = time.monotonic()
        come_back = max(0.5, 3 * self._settings.poll)
        why = ""
        if self._trouble is not None:
            tq, since, seen_moves, what = self._trouble
            if tq != q.q or progress.moves != seen_moves or progress.reforming \
                    or progress.busy() not in (None, "warm-up"):
                self._trouble = None
            elif now - since > come_back:
                why = what
        forming = progress.forming_since
        if not why and forming is not None and self._loss is not None and self._loss[0] is q \
                and now - max(forming, self._loss_at) > come_back + FORMING_GRACE:
            why = (f"its process group for quorum {q.q} was still forming {now - self._loss_at:.1f}s after a member "
                   f"was lost ({self._loss[1]}): gloo retries a connection to a lost member until its timeout")
        moved = view.quorum
        reforming = progress.reforming or self._membership.reforming
        if moved is not None and moved.q > q.q and moved.rank_of(self._membership.id) is None and not reforming:
            if self._excluded_since is None:
                self._excluded_since = now
            grace = come_back if progress.busy() is None else max(come_back, self._settings.report_timeout)
            if not why and now - self._excluded_since > grace:
                why = (f"quorum {moved.q} formed without it ({moved.cause}) and its training thread did not "
                       f"start re-forming within {grace:g}s")
        else:
            self._excluded_since = None
        if why:
            reason = f"live: this worker leaves the group: {why}; its agent starts a newcomer"
            logger.error("%s", reason)
            self._trouble = self._excluded_since = None
            if self._on_hung is not None:
                self._on_hung(reason)

    def _probe_other_nodes(self, q: Quorum) -> str | None:
        """The id of a member of another node whose probe port refuses connections, if any (one
        member per node is probed: a node is kept or dropped whole)."""
        seen = {self._membership.me.node}
        for m in q.members:
            if m.node not in seen:
                seen.add(m.node)
                if probe_dead(m.probe):
                    return m.id
        return None


__all__ = ["FORMING_GRACE", "FORMING_PROBES", "Watcher"]
