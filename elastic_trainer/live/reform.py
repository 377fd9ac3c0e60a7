"""The live re-form: every survivor reports, ONE proposer writes the next quorum, the others learn it.

After a failure (or at an agreed step, for a join) every member of quorum ``q`` leaves its group and
calls ``Reform.reform``: it reports the step it completed (``report/<q+1>/<id>``; where a node's
workers share a directory, one report for the node, ``live/node_report.py``), and then the next
quorum must be written once (a compare-and-swap on the quorum key, ``live/keys.py``) and learnt by
all. Every member runs the same round, at every size:

- **The line.** The candidates are each node's first member, in the old quorum's order, less the
  nodes known to be gone (a member's ``alive`` key gone in the watcher's view: its lease expired;
  or its probe port refused, ``live/probe.py``). The first is the **proposer**; the next
  ``BACKUPS`` are its backups; everyone else follows.
- **The proposer** looks until every old member reported or is provably gone (its node is then
  dropped whole), or ``report_timeout`` passed (a member alive but late), and writes the quorum
  (``propose``): the survivors in their order, then the nodes waiting to join. A look reads
  nothing: the quorum, leases, joiners and a declared stall come from its watcher's view
  (``live/watcher.py``), the reports from the standing report feed the first candidates keep
  (``live/report_feed.py``); each report or change wakes it, and the last report is followed by
  the compare-and-swap at once. It probes the members that have not reported, ``PROBES_PER_LOOK``
  a look, every ``PROBE_EVERY``.
- **A follower** reads nothing: it learns the new quorum from its watcher's view. A backup also
  probes the candidates ahead of it every ``PROBE_EVERY``: a killed proposer's port refuses at
  once, a frozen one's lease expires, and the next in line proposes. A proposer alive but silent
  (its training thread hung, or late to the round) is overtaken: the backups propose too once
  ``report_timeout`` passed, every follower ``FOLLOW_GRACE`` later.

Where something is missing the same look takes it from etcd: a worker whose watcher does not look
(paused, or its thread gone) reads the live keys itself; a proposer whose feed is not ready (its
stream not established) reads the reports; a compare-and-swap that failed (the quorum moved since
the view) reads the quorum that won. The fence is the quorum key's mod revision, whoever writes:
a proposer that was overtaken and writes late fails its compare-and-swap and adopts what it then
reads. Design and numbers: docs/rendezvous.md, "At 1,000 and 10,000 nodes"; docs/trainer.md,
"Live recovery".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

from elastic_trainer.env import LiveSettings
from elastic_trainer.live.keys import LiveKeys, View
from elastic_trainer.live.membership import Membership
from elastic_trainer.live.node_report import GRACE as NODE_REPORT_GRACE, NodeReport
from elastic_trainer.live.probe import Prober, probe_dead
from elastic_trainer.live.quorum import LiveExcluded, LiveTimeout, Member, Quorum, RunFinished
from elastic_trainer.live.report_feed import ReportFeed
from elastic_trainer.live.stream import StreamFactory, WatchStream
from elastic_trainer.live.threads import StartThread
from elastic_trainer.live.watcher import Watcher
from elastic_trainer.live.worker_lease import WorkerLease

logger = logging.getLogger(__name__)

PROBE_EVERY = 0.02
"""Seconds between two probes of the candidates ahead, by a backup (and of the silent members, by the proposer)."""
BACKUPS = 2
"""Candidates after the proposer that probe the ones ahead of them and propose after
``report_timeout``; they and the proposer keep the report feed."""
FOLLOW_GRACE = 1.0
"""Seconds past ``report_timeout`` after which every follower proposes too (a proposer alive but silent)."""
PROBES_PER_LOOK = 64
"""Silent members the proposer probes per look, in turn (all of them at a few nodes)."""
NODE_REPORT_EVERY = 0.002
"""Seconds between two looks of a node's reporter at the reports its node's members wrote."""


def candidates(q: Quorum, count: int) -> list[Member]:
    """The first ``count`` candidates of ``q``'s line: the first member of each of its first nodes."""
    out: list[Member] = []
    nodes: set[str] = set()
    for m in q.members:
        if m.node not in nodes:
            nodes.add(m.node)
            out.append(m)
            if len(out) == count:
                break
    return out


def propose(old: Quorum, view: View, target: int, cause: str, settings: LiveSettings,
            by_node: dict[str, list[Member]] | None = None) -> Quorum | None:
    """The quorum after ``old`` from what ``view`` shows: the nodes whose members all reported, in
    their order, then the nodes waiting to join (up to ``max_nodes``), at the highest step reported;
    None while there are fewer than ``min_nodes`` nodes (or no survivor)."""
    by_node = by_node if by_node is not None else old.by_node()
    survivors = [m for ms in by_node.values() for m in ms if all(x.id in view.reports for x in ms)]
    nodes = list(dict.fromkeys(m.node for m in survivors))
    room = settings.max_nodes - len(nodes)
    joiners = [(n, ms) for n, ms in view.complete_nodes() if n not in nodes][:max(0, room)]
    if len(nodes) + len(joiners) < settings.min_nodes or not survivors:
        return None
    members = tuple(survivors) + tuple(m for _, ms in joiners for m in ms)
    steps = [int(view.reports[m.id].get("step", -1)) for m in survivors]
    top = max(steps)
    receivers = tuple(i for i, s in enumerate(steps) if s < top) + tuple(range(len(survivors), len(members)))
    lost = sorted(set(by_node) - set(nodes))
    why = cause + (f"; lost {', '.join(lost)}" if lost else "") + (
        f"; added {', '.join(n for n, _ in joiners)}" if joiners else "")
    return Quorum(q=target, members=members, step=top, source=steps.index(top), receivers=receivers,
                  cause=why, formed_at=time.time())


@dataclass
class Round:
    """What one call of ``reform`` knows so far."""

    old: Quorum
    target: int
    cause: str
    timeout: float
    entered: float
    deadline: float
    """When the backups propose too (``report_timeout`` after entering; sooner after a declared stall)."""
    min_deadline: float
    by_node: dict[str, list[Member]]
    own_report: bytes = b""
    node_report: NodeReport | None = None  # this worker's part in its node's one report
    dead: set[str] = field(default_factory=set)  # members whose probe port refused: their process is gone
    last_probe: float = 0.0
    probed_ahead: float = 0.0
    prober: Prober = field(default_factory=lambda: Prober(PROBES_PER_LOOK))
    stale: bool = False  # a compare-and-swap failed: read the quorum that won
    gone: int = 0  # the members of nodes the last look found gone
    looked_at: tuple = ()  # the quorum, leases, joiners and stall the proposer's last look saw
    look_began: float = 0.0
    look_s: float = 0.0
    next_say: float = 0.0


class Reform:
    """The re-form of one member (see the module docstring), on its watcher's views."""

    def __init__(self, keys: LiveKeys, membership: Membership, lease: WorkerLease, watcher: Watcher,
                 settings: LiveSettings, start_thread: StartThread, stream_factory: StreamFactory = WatchStream) -> None:
        self._keys, self._membership, self._lease, self._watcher = keys, membership, lease, watcher
        self._settings, self._start_thread, self._stream_factory = settings, start_thread, stream_factory
        self._wake = threading.Event()
        self._seen: View | None = None  # the last view the watcher looked at
        self._seen_at = float("-inf")
        self._feed: ReportFeed | None = None
        watcher.subscribe(self._saw)

    def _saw(self, view: View) -> None:
        """From the watcher thread, each view it looks at: what a follower knows. A follower reads
        ``view.quorum`` and membership in ``view.alive`` only (one lookup of a set the watcher
        thread changes: atomic in CPython), never iterates it."""
        self._seen, self._seen_at = view, time.monotonic()
        self._wake.set()

    def prepare(self, q: Quorum) -> None:
        """After adopting ``q``: keep the report feed if this worker is one of its first candidates."""
        keep = self._membership.me in candidates(q, BACKUPS + 1)
        if keep and self._feed is None:
            self._feed = ReportFeed(self._keys, self._start_thread, self._wake.set, self._stream_factory)
        elif not keep and self._feed is not None:
            self._feed.close()
            self._feed = None

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None

    # ---- the round -----------------------------------------------------------------------------
    def reform(self, step: int, cause: str, report_timeout: float | None = None) -> Quorum:
        """The next quorum with this worker in it, after it completed ``step``. Raises
        ``LiveExcluded`` when the quorum formed without it, ``LiveTimeout`` when too few nodes
        remain past ``join_timeout``."""
        old = self._membership.quorum
        assert old is not None, "reform before join"
        reason = self._membership.change_reason
        if reason and reason not in cause:
            cause = f"{cause}: {reason}"
        timeout = self._settings.report_timeout if report_timeout is None else report_timeout
        entered = time.monotonic()
        record = {"step": step, "cause": cause}
        rnd = Round(old, old.q + 1, cause, timeout, entered, entered + timeout,
                    entered + self._settings.join_timeout, old.by_node(), json.dumps(record).encode(),
                    next_say=entered + 5.0)
        rnd.node_report = self._node_report(rnd)
        if rnd.node_report is not None:  # to the node's directory; its reporter puts one for all
            try:
                rnd.node_report.write(record)
            except OSError as exc:  # the directory is gone or full: report as a worker of its own
                logger.warning("live: could not write the report to the node's directory (%s); putting it", exc)
                rnd.node_report = None
        self._membership.reforming = True
        try:
            if rnd.node_report is None:
                self._put_report(f"report/{rnd.target}/{self._membership.id}", rnd.own_report)
            formed = self._round(rnd)
        finally:
            self._membership.reforming = False
        self.prepare(formed)
        return formed

    def _round(self, rnd: Round) -> Quorum:
        """``reform``'s loop, until the new quorum is known (or this worker is out of it)."""
        while True:
            self._wake.clear()  # a wake from here on ends the wait below at once
            reporting = rnd.node_report is not None and not rnd.node_report.done
            if reporting:
                self._send_node_report(rnd)
                reporting = not rnd.node_report.done
            view, read = self._view(rnd)
            if view.quorum is not None and view.quorum.q >= rnd.target:
                return self._membership.adopt_formed(view.quorum)
            if view.quorum is not None and view.quorum.finished:  # the others finished: nothing to re-form
                raise RunFinished(f"the run finished at quorum {view.quorum.q} while this worker re-formed")
            place, ahead = self._line(rnd, view)
            now = time.monotonic()
            turn = rnd.entered if place == 0 else rnd.deadline if place <= BACKUPS else rnd.deadline + FOLLOW_GRACE
            wait = PROBE_EVERY if place <= BACKUPS else self._settings.poll
            if now >= turn and not reporting:  # its own node's report first: the look would wait for it
                formed = self._look(rnd, view, read)
                if formed is not None:
                    return formed
                if self._feed is None or not self._feed.ready:
                    wait = max(0.003, rnd.look_s)  # reports from reads: as often as a read takes
            elif 0 < place <= BACKUPS and now - rnd.probed_ahead >= PROBE_EVERY:
                rnd.probed_ahead = now
                dead = {m.id for m in ahead if probe_dead(m.probe)}
                if dead:
                    rnd.dead |= dead
                    continue
            if reporting:  # its node's report is due
                wait = min(wait, NODE_REPORT_EVERY if rnd.node_report.reporter else PROBE_EVERY)
            self._wake.wait(wait)

    def _view(self, rnd: Round) -> tuple[View, bool]:
        """What this worker knows now: its watcher's last view while the watcher looks (at least
        every poll) and shows the old quorum or a newer one; else one read (True)."""
        seen = self._seen
        following = time.monotonic() - self._seen_at < max(1.0, 5 * self._settings.poll)
        if following and not rnd.stale and seen is not None and seen.quorum is not None and seen.quorum.q >= rnd.old.q:
            return seen, False
        rnd.stale = False
        return self._keys.read(stall_q=rnd.old.q, held=rnd.old), True

    def _line(self, rnd: Round, view: View) -> tuple[int, list[Member]]:
        """This worker's place in line (0: the proposer) among the candidates ``view`` and its
        probes leave, with the candidates ahead of it. A worker that is no candidate (not its
        node's first member, or its node gone) or is past the backups gets ``BACKUPS + 1``."""
        me = self._membership.me
        ahead: list[Member] = []
        for node, members in rnd.by_node.items():  # each node's first member, in member order
            m = members[0]
            if m.id in rnd.dead or any(x.id not in view.alive for x in members):
                continue  # gone: a member's process refused a probe, or its lease expired
            if node == me.node:
                return (len(ahead), ahead) if m.id == me.id else (BACKUPS + 1, ahead)
            ahead.append(m)
            if len(ahead) > BACKUPS:
                break
        return BACKUPS + 1, ahead

    def _look(self, rnd: Round, view: View, read: bool) -> Quorum | None:
        """The proposer's look: the reports from its feed (or a read), the rest from ``view``; the
        new quorum once it is formed with this worker in it, None: look again."""
        began = time.monotonic()
        feed = self._feed if self._feed is not None and self._feed.ready else None
        if feed is not None and not read:
            seen = (view.quorum_rev, len(view.alive), len(view.joiners), view.stall is None)
            have = feed.covered(rnd.target) + (0 if feed.holds(rnd.target, self._membership.id) else 1)
            if (seen == rnd.looked_at and have < len(rnd.old.members) - rnd.gone
                    and began - rnd.look_began < max(PROBE_EVERY, 10 * rnd.look_s)):
                return None  # reports missing, nobody lost or added since the last look, no probe due
            rnd.looked_at = seen
        rnd.look_began = began
        if feed is not None:
            reports = feed.reports(rnd.target)
            reports.setdefault(self._membership.id, json.loads(rnd.own_report))  # its event may be on its way
        else:
            reports = self._keys.read(report_q=rnd.target, held=rnd.old).reports
        if not read:  # the watcher's sets are its own: a copy to decide on (~5 ms at 1,000 nodes of 8)
            view = View(view.quorum, view.quorum_rev, set(view.alive), dict(view.joiners), stall=view.stall)
        view.reports = reports
        try:
            return self._decide(rnd, view)
        finally:
            rnd.look_s = time.monotonic() - began

    def _decide(self, rnd: Round, view: View) -> Quorum | None:
        """One look's decision on ``view``: the quorum written when every old member reported or
        its node is gone, or past the deadline."""
        old, target = rnd.old, rnd.target
        if view.stall is not None:  # the ranks that waited come out within a poll; the hung one ends itself
            rnd.deadline = min(rnd.deadline, rnd.entered + self._settings.poll * 3 + 1.0)
        q = view.quorum
        if q is not None and q.q >= target:
            return self._membership.adopt_formed(q)
        if q is None or q.q != old.q:
            raise LiveExcluded(f"the quorum moved from {old.q} to {q.q if q else None} without this worker")
        now = time.monotonic()
        # a node is kept or dropped whole: once one of its members is gone, nobody waits for the others
        gone_nodes = {m.node for m in old.members if m.id not in view.alive or m.id in rnd.dead}
        pending = [m for m in old.members if m.id not in view.reports and m.node not in gone_nodes]
        if pending and now - rnd.last_probe > PROBE_EVERY:
            rnd.last_probe = now
            rnd.dead |= rnd.prober.dead(pending)
            gone_nodes |= {m.node for m in old.members if m.id in rnd.dead}
            pending = [m for m in pending if m.node not in gone_nodes]
        rnd.gone = sum(len(rnd.by_node.get(node, ())) for node in gone_nodes)
        if now > rnd.next_say:  # a long wait says what it waits for
            rnd.next_say = now + 5.0
            logger.warning("live: quorum %d not formed after %.0fs: reported %s; silent %s; min_nodes %d",
                           target, now - rnd.entered, sorted(view.reports), sorted(m.id for m in pending),
                           self._settings.min_nodes)
        if pending and now <= rnd.deadline:
            return None
        new = propose(old, view, target, rnd.cause, self._settings, rnd.by_node)
        if new is None:
            if now > rnd.min_deadline:
                raise LiveTimeout(f"fewer than min_nodes={self._settings.min_nodes} nodes within "
                                  f"join_timeout {self._settings.join_timeout:g}s")
        elif self._keys.cas_quorum(new, view.quorum_rev, base=old):
            logger.info("live: quorum %d formed (%s) after %.3fs: %d ranks, step %d; %s", new.q, rnd.cause,
                        now - rnd.entered, new.world_size, new.step,
                        "all reported" if not pending else f"{len(pending)} silent past {rnd.timeout:g}s")
            return self._membership.adopt_formed(new)
        else:
            rnd.stale = True  # the quorum moved since this view: read the one that won
        return None

    # ---- the reports ---------------------------------------------------------------------------
    def _put_report(self, sub: str, value: bytes) -> None:
        try:
            self._lease.put(self._keys.key(sub), value)
        except Exception as exc:
            if self._lease.lost or "lease not found" in str(exc).lower():
                raise LiveExcluded(f"this worker's etcd lease expired before it could report ({exc})") from exc
            raise

    def _node_report(self, rnd: Round) -> NodeReport | None:
        """This worker's part in its node's one report, where its node has several members in the
        old quorum and a directory (the node's one watch); None: it puts its own report."""
        share = self._watcher.keeper.share
        me = self._membership.me
        mine = [m.id for m in rnd.by_node.get(me.node, ())]
        if share is None or len(mine) < 2 or me.id not in mine:
            return None
        return NodeReport(share.dir, rnd.target, me.node, mine, me.id)

    def _send_node_report(self, rnd: Round) -> None:
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
                self._put_report(f"report/{rnd.target}/{self._membership.id}", rnd.own_report)
                nr.done = True


__all__ = ["BACKUPS", "FOLLOW_GRACE", "NODE_REPORT_EVERY", "PROBES_PER_LOOK", "PROBE_EVERY", "Reform", "Round",
           "candidates", "propose"]
