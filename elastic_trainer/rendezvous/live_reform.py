"""The live re-form's report round: every survivor reports, ONE proposer reads and writes the next quorum.

After a failure (or at an agreed step, for a join) every member of quorum ``q`` leaves its group and
calls ``LiveGroup.reform``: it puts ``live/report/<q+1>/<id>`` with the step it completed, and
then the next quorum must be written once (a compare-and-swap on the quorum key: one quorum at a
time, ``rendezvous/live_etcd.py``) and learnt by all. It used to be that every survivor read every
report and alive key every 3 ms until all were in and raced to write it: a round of N survivors
cost etcd N reads of O(N) keys every 3 ms, O(N^2) (~1.6 MB a read at 1,000 nodes of 8).

Now the round has **one proposer**, the first member (in the old quorum's order) of the first node
not known to be gone: it alone reads the reports (``_propose_once``: until every member
reported or is provably gone, or ``report_timeout`` passed) and writes the quorum. In a group of
``WATCH_FROM`` members or more, where its watcher looks, it reads them once and then follows them
with a watch on ``report/<q>/`` (``rendezvous/report_watch.py``): the last report wakes it, and
the quorum is written at once. Every other survivor is a **follower**: it reported, and it learns
the new quorum from the watch its watcher already keeps (``rendezvous/watcher.py``: the watcher
hands each view it looks at to ``seen``), so it reads nothing. Only the first ``BACKUPS`` followers
in line do anything more:

- **take-over**: a backup probes the candidates ahead of it (their probe port,
  ``members.probe_dead``: a killed process's port refuses at once) every ``PROBE_EVERY``; every
  follower drops a node whose ``alive`` key its watch shows gone (a node frozen or cut off, its
  lease expired). Either way the next in line becomes the proposer, so a dead proposer never
  blocks a re-form;
- **a silent proposer** (alive, but not writing: its training thread hung, or it is late to the
  round itself): the backups also read and propose once ``report_timeout`` passed, as every
  survivor did before, and every follower does past ``report_timeout + FOLLOW_GRACE``.

A follower whose watcher does not look (none started: a ``LiveGroup`` used alone; its thread gone)
proposes as every survivor did before.

**One report per node.** Where a node's workers share a directory (the node's one etcd watch),
each writes its report there and the node's first member puts one key for them all
(``rendezvous/node_report.py``): 1,000 puts per loss at 1,000 nodes of 8, not 8,000, and the
proposer's looks read 1,000 report keys back. A member its node's report did not cover within
``node_report.GRACE`` puts its own. The fence is unchanged: whoever writes, the quorum key's
mod revision is compared, so a proposer that was taken over and writes late fails its
compare-and-swap and adopts the quorum it then reads. Design and numbers: docs/rendezvous.md,
"At 1,000 and 10,000 nodes"; docs/trainer.md, "Live recovery".
"""

from __future__ import annotations

import json
import logging
import threading
import time

from elastic_trainer.rendezvous import node_report
from elastic_trainer.rendezvous.live_lease import LiveLease
from elastic_trainer.rendezvous.node_report import GRACE as NODE_REPORT_GRACE, NodeReport
from elastic_trainer.rendezvous.report_watch import ReportsWatch
from elastic_trainer.rendezvous.members import (LiveExcluded, LiveTimeout, Member, Quorum, View,
                                                complete_nodes, probe_dead)

logger = logging.getLogger("elastic_trainer.rendezvous.quorum")

PROBE_EVERY = 0.02
"""Seconds between two probes of the candidates ahead, by a backup (and of the silent members, by the proposer)."""
BACKUPS = 2
"""Followers next in line after the proposer that probe the candidates ahead of them (and propose
after ``report_timeout``): the first ``BACKUPS + 1`` nodes of a group lost at once leave the round
to ``FOLLOW_GRACE``."""
FOLLOW_GRACE = 1.0
"""Seconds past ``report_timeout`` after which every follower proposes too (a proposer alive but silent)."""
WATCH_FROM = 64
"""Members in the old quorum from which the proposer follows the reports with a watch; below, a
whole read takes a millisecond or two and opening the watch (a thread, a stream) costs as much."""
WATCH_WAIT = 1.0
"""Seconds after its report watch was opened that the proposer waits for it to be established
(one round trip) before it reads everything instead, as without a watch."""
PROBES_PER_LOOK = 64
"""Silent members the proposer probes per look, in turn."""
NODE_REPORT_EVERY = 0.002
"""Seconds between two looks of a node's reporter at the reports its node's members wrote."""


class LiveReform(LiveLease):
    """The re-form of one live worker (a base of ``LiveGroup``, ``rendezvous/quorum.py``)."""

    quorum: Quorum | None
    change_reason: str
    _seen: View | None = None
    """The last view this worker's watcher looked at (set from the watcher thread, ``seen``)."""
    _seen_event: threading.Event
    _seen_at: float = float("-inf")

    def seen(self, view: View) -> None:
        """From the watcher thread, each view it looks at: what a follower of a re-form knows.

        A follower reads ``view.quorum`` and membership in ``view.alive`` only (one lookup of a
        set the watcher thread changes: atomic in CPython), never iterates it."""
        self._seen, self._seen_at = view, time.monotonic()
        self._seen_event.set()

    def _following(self) -> bool:
        """True while this worker's watcher looks (at least every poll): it will show the new quorum."""
        return time.monotonic() - self._seen_at < max(1.0, 5 * self.settings.poll)

    def reform(self, step: int, cause: str, report_timeout: float | None = None) -> Quorum:
        """After a failure (or at an agreed step, for a join): the next quorum with this worker in it.

        Raises ``LiveExcluded`` when the quorum formed without this worker."""
        old = self.quorum
        assert old is not None
        target = old.q + 1
        if self.change_reason and self.change_reason not in cause:
            cause = f"{cause}: {self.change_reason}"
        record = {"step": step, "cause": cause}
        timeout = self.settings.report_timeout if report_timeout is None else report_timeout
        entered = time.monotonic()
        rnd = _Round(old, target, cause, timeout, entered, entered + self.settings.join_timeout)
        rnd.own_report = json.dumps(record).encode()
        rnd.node_report = self._node_report(rnd)
        if rnd.node_report is not None:  # to the node's directory; its reporter puts one for all
            try:
                rnd.node_report.write(record)
            except OSError as exc:  # the directory is gone or full: report as a worker of its own
                logger.warning("live: could not write the report to the node's directory (%s); putting it", exc)
                rnd.node_report = None
        if len(old.members) >= WATCH_FROM and self._following() and self._line(rnd)[0] == 0:
            rnd.watch = ReportsWatch(self, target)  # the proposer: its watch opens meanwhile
        if rnd.node_report is None:
            self._put_report(f"report/{target}/{self.id}", rnd.own_report)
        try:
            return self._round(rnd)
        finally:
            if rnd.watch is not None:
                rnd.watch.close()

    def _round(self, rnd: _Round) -> Quorum:
        """``reform``'s loop, until the new quorum is known (or this worker is out of it)."""
        target, timeout, entered = rnd.target, rnd.timeout, rnd.entered
        while True:
            if rnd.node_report is not None and not rnd.node_report.done:
                self._send_node_report(rnd)
            now = time.monotonic()
            place, ahead = 0, []
            if self._following() and now < entered + timeout + FOLLOW_GRACE:
                place, ahead = self._line(rnd)
            if place > 0:  # a follower: the quorum comes through the watch
                q = self._seen.quorum if self._seen is not None else None
                if q is not None and q.q >= target:
                    return self._adopt_formed(q)
                if place <= BACKUPS:
                    if now > rnd.deadline:  # the proposer is silent past report_timeout: propose too
                        place = 0
                    elif now - rnd.probed_ahead >= PROBE_EVERY:
                        rnd.probed_ahead = now
                        dead = {m.id for m in ahead if probe_dead(m.probe)}
                        if dead:
                            rnd.dead |= dead
                            continue
                if place > 0:
                    wait = PROBE_EVERY if place <= BACKUPS else self.settings.poll
                    if rnd.node_report is not None and not rnd.node_report.done:  # its node's report is due
                        wait = min(wait, NODE_REPORT_EVERY if rnd.node_report.reporter else PROBE_EVERY)
                    self._seen_event.wait(wait)
                    self._seen_event.clear()
                    continue
            if rnd.node_report is not None and not rnd.node_report.done:
                time.sleep(NODE_REPORT_EVERY)  # its own node's report first: the look would wait for it
                continue
            following = self._following()
            if rnd.watch is None and following and len(rnd.old.members) >= WATCH_FROM:  # through a watch
                rnd.watch = ReportsWatch(self, target)
            if rnd.watch is not None and following and not rnd.watch.ready:
                rnd.watch.catch_up(rnd.watch.opened + WATCH_WAIT - time.monotonic())  # the reports put before it
            if rnd.watch is not None and rnd.watch.ready and following:
                self._seen_event.clear()
                formed = self._propose_watched(rnd)
                if formed is not None:
                    return formed
                self._seen_event.wait(PROBE_EVERY)  # a report, or a change its watcher saw
                continue
            formed = self._propose_once(rnd)
            if formed is not None:
                return formed
            # 3 ms between looks, or as long as a look took (O(N): ~0.1 s at 1,000 nodes of 8)
            time.sleep(max(0.003, rnd.read_s))

    def _put_report(self, sub: str, value: bytes) -> None:
        try:
            self._lease.put(self._key(sub), value)
        except Exception as exc:
            if self._lease.lost or "lease not found" in str(exc).lower():
                raise LiveExcluded(f"this worker's etcd lease expired before it could report ({exc})") from exc
            raise

    def _node_report(self, rnd: _Round) -> NodeReport | None:
        """This worker's part in its node's one report (``rendezvous/node_report.py``), where its
        node has several members in the old quorum and a directory (the node's one watch); None:
        it puts its own report."""
        node_watch = getattr(getattr(self, "watcher", None), "_node", None)
        mine = [m.id for m in rnd.by_node.get(self.node, ())]
        if node_watch is None or len(mine) < 2 or self.id not in mine:
            return None
        return NodeReport(node_watch.dir, rnd.target, self.node, mine, self.id)

    def _send_node_report(self, rnd: _Round) -> None:
        """The reporter: its node's report, once every member of the node wrote its own or
        ``node_report.GRACE`` passed; another member: its own report, at once if the node's went
        without it (it came late), or when the node's is not in ``GRACE`` after it reported."""
        nr = rnd.node_report
        late = time.monotonic() - rnd.entered > NODE_REPORT_GRACE
        if nr.reporter:
            got = nr.gathered()
            if len(got) == len(nr.members) or late:
                self._put_report(nr.key, nr.value(got))
                nr.mark(list(got))
        else:
            covered = nr.covered()  # None: the node's report is not in yet
            if covered is False or (covered is None and late):  # False: it went without this one
                self._put_report(f"report/{rnd.target}/{self.id}", rnd.own_report)
                nr.done = True

    def _line(self, rnd: _Round) -> tuple[int, list[Member]]:
        """This worker's place in line (0: the proposer) among the candidates its watcher's view
        and its probes leave, with the candidates ahead of it. A worker that is no candidate (not
        its node's first member, or its node gone) or is past the backups gets ``BACKUPS + 1``."""
        view = self._seen
        ahead: list[Member] = []
        for node, members in rnd.by_node.items():  # the candidates: each node's first member, in member order
            m = members[0]
            if m.id in rnd.dead or (view is not None and any(x.id not in view.alive for x in members)):
                continue  # gone: a member's process refused a probe, or its lease expired
            if node == self.node:
                return (len(ahead), ahead) if m.id == self.id else (BACKUPS + 1, ahead)
            ahead.append(m)
            if len(ahead) > BACKUPS:
                break
        return BACKUPS + 1, ahead

    def _adopt_formed(self, q: Quorum) -> Quorum:
        if q.rank_of(self.id) is None:
            raise LiveExcluded(f"quorum {q.q} formed without this worker ({q.cause})")
        return self._adopt(q)

    def _propose_once(self, rnd: _Round) -> Quorum | None:
        """The proposer's look (every survivor's, before): one read of the reports and alive keys;
        the quorum written when every member reported or is provably gone, or past the deadline.
        The new quorum once it is formed with this worker in it; None: look again."""
        began = time.monotonic()
        watched = rnd.watch.begin_read() if rnd.watch is not None else False
        view = self._read(report_q=rnd.target, stall_q=rnd.old.q)
        rnd.read_s = time.monotonic() - began
        if rnd.watch is not None:  # the reports read: the watch adds what is put from now on
            rnd.watch.read(view.report_keys, watched)
        return self._decide(rnd, view)

    def _propose_watched(self, rnd: _Round) -> Quorum | None:
        """The proposer's look while its report watch is established and was read once: the
        reports from the watch, the quorum, leases, joiners and stall from its watcher's view (no
        read). A compare-and-swap that fails (the quorum moved since that view) reads again."""
        seen = self._seen
        if seen is None or seen.quorum is None or seen.quorum.q < rnd.old.q:  # its watcher lags: read
            return self._propose_once(rnd)
        began = time.monotonic()
        changed = (seen.quorum_rev, len(seen.alive), len(seen.joiners), seen.stall is None)
        if (changed == rnd.looked_at and rnd.watch.members < len(rnd.old.members) - rnd.gone
                and began - rnd.look_began < max(PROBE_EVERY, 10 * rnd.look_s)):
            return None  # reports missing, nobody lost or added since the last look, no probe due: wait
        rnd.looked_at, rnd.look_began = changed, began
        view = View(seen.quorum, seen.quorum_rev, set(seen.alive), dict(seen.joiners),
                    reports=node_report.expand(rnd.watch.reports()), stall=seen.stall)
        try:
            formed = self._decide(rnd, view)
        finally:  # ~5 ms at 1,000 nodes of 8 (the alive set copied, the reports expanded, the members walked)
            rnd.look_s = time.monotonic() - began
        if formed is None and rnd.watch.stale:  # its compare-and-swap failed: read the quorum that won
            return self._propose_once(rnd)
        return formed

    def _decide(self, rnd: _Round, view: View) -> Quorum | None:
        """One look's decision on ``view`` (see ``_propose_once``)."""
        old, target, timeout = rnd.old, rnd.target, rnd.timeout
        if view.stall is not None:  # the ranks that waited come out within a poll; the hung one ends itself
            rnd.deadline = min(rnd.deadline, rnd.entered + self.settings.poll * 3 + 1.0)
        q = view.quorum
        if q is not None and q.q >= target:
            return self._adopt_formed(q)
        if q is None or q.q != old.q:
            raise LiveExcluded(f"the quorum moved from {old.q} to {q.q if q else None} without this worker")
        now = time.monotonic()
        # a node is kept or dropped whole: once one of its members is gone, nobody waits for the others
        gone_nodes = {m.node for m in old.members if m.id not in view.alive or m.id in rnd.dead}
        pending = [m for m in old.members if m.id not in view.reports and m.node not in gone_nodes]
        if pending and now - rnd.last_probe > PROBE_EVERY:
            rnd.last_probe = now
            rnd.dead |= self._probe_some(pending, rnd)
            gone_nodes |= {m.node for m in old.members if m.id in rnd.dead}
            pending = [m for m in pending if m.node not in gone_nodes]
        rnd.gone = sum(len(rnd.by_node.get(node, ())) for node in gone_nodes)
        if now > rnd.next_say:  # a long wait says what it waits for
            rnd.next_say = now + 5.0
            logger.warning("live: quorum %d not formed after %.0fs: reported %s; silent %s; min_nodes %d",
                           target, now - rnd.entered, sorted(view.reports),
                           sorted(m.id for m in pending), self.settings.min_nodes)
        if not pending or now > rnd.deadline:
            new = self._propose(old, view, target, rnd.cause, rnd.by_node)
            if new is None:
                if now > rnd.min_deadline:
                    raise LiveTimeout(f"fewer than min_nodes={self.settings.min_nodes} nodes within "
                                      f"join_timeout {self.settings.join_timeout:g}s")
            elif self._cas_quorum(new, view.quorum_rev, base=old):
                logger.info("live: quorum %d formed (%s) after %.3fs: %d ranks, step %d; %s", new.q, rnd.cause,
                            now - rnd.entered, new.world_size, new.step,
                            "all reported" if not pending else f"{len(pending)} silent past {timeout:g}s")
                return self._adopt_formed(new)
            elif rnd.watch is not None:  # the quorum moved since this view: read it
                rnd.watch.stale = True
        return None

    @staticmethod
    def _probe_some(pending: list[Member], rnd: _Round) -> set[str]:
        """The ids among ``pending`` whose probe port refuses: at most ``PROBES_PER_LOOK`` of them
        a look, the next ones at the next look (all of them at a few nodes, as before; at 1,000
        nodes of 8 a look would otherwise open 8,000 connections every 20 ms)."""
        start = rnd.probe_turn % len(pending)
        batch = (pending[start:] + pending[:start])[:PROBES_PER_LOOK]
        rnd.probe_turn = start + len(batch)
        return {m.id for m in batch if probe_dead(m.probe)}

    def _propose(self, old: Quorum, view: View, target: int, cause: str,
                 by_node: dict[str, list[Member]] | None = None) -> Quorum | None:
        """The next quorum from what ``view`` shows, or None while there are too few nodes."""
        by_node = by_node if by_node is not None else _by_node(old)
        survivors = [m for node, ms in by_node.items() for m in ms
                     if all(x.id in view.reports for x in ms)]
        nodes = list(dict.fromkeys(m.node for m in survivors))
        room = self.settings.max_nodes - len(nodes)
        joiners = [(n, ms) for n, ms in complete_nodes(view) if n not in nodes][:max(0, room)]
        if len(nodes) + len(joiners) < self.settings.min_nodes or not survivors:
            return None
        members = tuple(survivors) + tuple(m for _, ms in joiners for m in ms)
        steps = [int(view.reports[m.id].get("step", -1)) for m in survivors]
        top = max(steps)
        source = steps.index(top)
        receivers = tuple(i for i, s in enumerate(steps) if s < top) + tuple(range(len(survivors), len(members)))
        lost = sorted(set(by_node) - set(nodes))
        why = cause + (f"; lost {', '.join(lost)}" if lost else "") + (
            f"; added {', '.join(n for n, _ in joiners)}" if joiners else "")
        return Quorum(q=target, members=members, step=top, source=source, receivers=receivers,
                      cause=why, formed_at=time.time())


class _Round:
    """What one call of ``reform`` knows so far."""

    def __init__(self, old: Quorum, target: int, cause: str, timeout: float, entered: float,
                 min_deadline: float) -> None:
        self.old, self.target, self.cause, self.timeout = old, target, cause, timeout
        self.entered, self.deadline, self.min_deadline = entered, entered + timeout, min_deadline
        self.dead: set[str] = set()  # members whose probe port refused: their process is gone
        self.last_probe = self.probed_ahead = 0.0
        self.probe_turn = 0  # where the proposer's next probes of the silent members start
        self.read_s = 0.0  # how long the proposer's last read took
        self.next_say = entered + 5.0
        self.by_node = _by_node(old)
        self.node_report: NodeReport | None = None  # this worker's part in its node's one report
        self.watch: ReportsWatch | None = None  # the proposer's watch on the reports
        self.looked_at: tuple = ()  # the quorum, leases, joiners and stall the proposer's last look saw
        self.gone = 0  # the members of nodes its last look found gone
        self.look_began = self.look_s = 0.0  # when that look began, and how long it took
        self.own_report = b""


def _by_node(q: Quorum) -> dict[str, list[Member]]:
    """``q``'s members by node, the nodes in member order."""
    by_node: dict[str, list[Member]] = {}
    for m in q.members:
        by_node.setdefault(m.node, []).append(m)
    return by_node


__all__ = ["BACKUPS", "FOLLOW_GRACE", "LiveReform", "NODE_REPORT_EVERY", "PROBES_PER_LOOK", "PROBE_EVERY", "WATCH_FROM", "WATCH_WAIT"]
