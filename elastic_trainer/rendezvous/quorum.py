"""The live quorum: which workers train together, agreed by the workers themselves through etcd.

Under ``--recovery live`` (the default) every agent's rendezvous is a world of its own node
(``rendezvous/handler.py``, live mode): torchrun still starts, supervises and restarts the
workers, but *which workers train together* is decided here. This module is membership only
(``LiveGroup``: join, re-form, leave); its keys in etcd and the transactions on them are
``rendezvous/live_etcd.py``, its lease ``rendezvous/live_lease.py``, what a quorum is made of
``rendezvous/members.py``, what watches it while training ``rendezvous/watcher.py``; the
process group built on it, the state transfer and the step agreement are the training side's
``Manager`` (``training/manager.py``), which is what a training loop uses.

The **quorum** is one etcd key, ``<run prefix>live/quorum``: a number ``q`` and the members in
rank order. Every change of it is a compare-and-swap on that key, so there is one quorum at a
time, and every process group is built on a fresh store under ``live/store/<q>/`` in etcd (no
process hosts a single point of failure). Each worker keeps ``live/alive/<id>`` on its node's
lease (the agent's, ``lease_ttl``; ``rendezvous/node_lease.py``): etcd's lease, not a
peer's clock, says who is alive, and a node costs etcd one renewal per interval however many
workers it runs. The watcher learns of changes from an etcd watch (``rendezvous/live_watch.py``),
so a steady run reads nothing.

- **Cold start** (no quorum with a live member): workers register ``live/join/<id>``; once
  ``min_nodes`` whole nodes registered and ``last_call`` passed (or ``max_nodes`` registered),
  one of them writes quorum ``q+1`` with ``cold: true``; its ranks load the newest checkpoint.
- **Node lost**: a collective fails on the survivors (a dead peer's sockets close at once; a silent
  one's are shut by the watcher, below). Each
  survivor destroys its group and reports ``live/report/<q+1>/<id>`` with the step it completed
  (a node's workers sharing a directory send one report for the node, ``rendezvous/node_report.py``);
  one of them, the proposer, reads the reports and writes the next quorum, the others learn it
  through their watch (``rendezvous/live_reform.py``: the take-over when the proposer is gone).
  The quorum closes when every old member reported, or is provably dead (its lease is gone, or
  its probe port refuses connections: a killed process's listening socket is closed by the
  kernel), or after ``report_timeout`` (a member alive but late). Whole nodes only: a node missing a worker is dropped
  (its agent restarts them all). The new quorum continues at the highest reported step, from a
  survivor that completed it; survivors behind it (at most one step, under DDP) receive its state.
- **Node added**: a newcomer starts, builds its model and registers ``live/join/<id>`` while the
  others train. A member's watcher sees it; at the next step-end agreement all members re-form at
  once (planned, nothing fails), and the newcomer receives the full training state from a live
  rank over the new group. Storage is read only by a cold quorum.
- **Fencing**: a worker not in the quorum that was formed (paused past its lease, too slow to
  report, cut off) raises ``LiveExcluded``: it exits, and its agent starts a new worker that joins
  as a newcomer. A worker whose lease is lost (its ``alive`` key gone: the node's lease expired)
  is ended through ``on_lease_lost`` (the Manager passes one that exits with ``EXIT_EXCLUDED``).
  A worker fenced alone keeps the node's lease: the quorum key fences it. Checkpoint commits check the quorum number and
  the lease (``fence_check``).

**Silent failures.** A node that freezes or is cut off closes no socket: the survivors' collective
would wait for the collective timeout. The watcher's etcd watch reports its lease's expiry
(``lease_ttl`` after its last renewal) at once, and the watcher calls ``on_member_lost``: the Manager abandons the group (gloo: shuts the
group's connections; NCCL: aborts it, ``training/abandon.py``), the blocked collective fails as on
a dead peer, and the re-form proceeds without waiting for that node (whole nodes: once one member
is gone nobody waits for the others). A worker whose training thread hangs while its lease lives
is found by its lack of progress (``rendezvous/progress.py``): a rank whose step lasts past
``max(hang_min, hang_factor x median step)``, while no member shows a ``busy/<id>`` key (a
checkpoint, a warm-up), declares ``stall/<q>`` (compare-and-swap, once); every rank abandons its
group, the waiting ranks re-form, and the rank whose training thread does not come out of its
step within half a second is the hung one: its watcher ends the process (``on_hung``; its agent
starts a newcomer). A worker left out of a quorum while its thread is stuck is ended the same way.
On NCCL (``probe_peers``) the watcher also probes one member of every other node each ``poll`` (no
etcd request): a
collective may hang on a dead peer there, and the abort ends it.

**Threads.** The probe listener and the watcher are started through ``start_thread(name, target,
*args, stop=...)`` (a worker passes ``runtime().start_thread``, so that its runtime owns them; the
default starts plain daemon threads), so this module depends on nothing in ``training/``.
Design and numbers: docs/trainer.md, "Live recovery".
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from typing import Callable

from elastic_trainer.env import LiveSettings, WorkerEnv
from elastic_trainer.rendezvous.members import (LiveExcluded, LiveTimeout, Member, ProbeListener, Quorum, RunFinished,
                                                StartThread, complete_nodes, resolvable, start_daemon_thread)
from elastic_trainer.rendezvous import quorum_record
from elastic_trainer.rendezvous.live_reform import LiveReform
from elastic_trainer.rendezvous.progress import Progress
from elastic_trainer.rendezvous.watcher import Watcher

logger = logging.getLogger(__name__)

class LiveGroup(LiveReform):
    """This worker's membership in the live quorum of its run (see the module docstring).

    ``start_thread`` starts the probe listener and the watcher (default: plain daemon threads);
    ``on_lease_lost(reason)`` is called, from the lease's renewal thread or from ``check_lease``,
    when etcd no longer knows this worker's lease: the others may already train without it, so
    it must end the worker (default: ``check_lease`` raises ``LiveExcluded``)."""

    def __init__(self, conn, prefix: str, node: str, local_rank: int, nproc: int, host: str,
                 settings: LiveSettings, *, start_thread: StartThread = start_daemon_thread,
                 on_lease_lost: Callable[[str], None] | None = None, node_lease: int | None = None) -> None:
        from elastic_trainer.rendezvous.lease import LeaseKeeper
        from elastic_trainer.rendezvous.node_lease import NodeLease

        self.conn = conn
        self.prefix = prefix.rstrip("/") + "/live/"
        self.node, self.local_rank, self.nproc = node, local_rank, nproc
        self.settings = settings
        self.id = f"{node}-{local_rank}-{os.getpid()}"
        self._start_thread = start_thread
        self._on_lease_lost = on_lease_lost
        self._probe = ProbeListener(host, start_thread)
        self.me = Member(self.id, node, local_rank, self._probe.address)
        self.quorum: Quorum | None = None
        self.change_pending = threading.Event()
        self.change_reason = ""
        self.on_member_lost: Callable[[str], None] | None = None
        """Called from the watcher thread when the group's collectives in flight must fail now (a
        member's lease expired, a stall was declared, a member's process is gone): the Manager
        abandons its process group (gloo: shuts its connections; NCCL: aborts it)."""
        self.probe_peers = False
        """Also probe one member of every other node each poll (NCCL: a collective may hang on a
        dead peer instead of failing; gloo's fail when the peer's sockets close)."""
        self.on_hung: Callable[[str], None] | None = None
        """Called from the watcher when this worker's training thread is stuck while its peers
        re-form without it (it must end the process: the Manager exits; its agent starts a newcomer)."""
        self.progress = Progress(settings.hang_min, settings.hang_factor)
        """The training thread's step clock (the Manager marks it); the watcher judges hangs by it."""
        self._adopt_lock = threading.Lock()
        self._seen_event = threading.Event()  # the watcher looked (rendezvous/live_reform.py)
        self.requests = 0
        if node_lease is not None:  # the agent's lease, shared by the node's workers (rendezvous/node_lease.py)
            self._lease: LeaseKeeper | NodeLease = NodeLease(
                conn, self._key("alive/" + self.id), node_lease, settings.lease_ttl, settings.keep_alive_interval,
                self._on_lease_tick)
            self._forget_earlier_selves()
        else:
            self._lease = LeaseKeeper(conn, self._key("alive/" + self.id), settings.lease_ttl,
                                      settings.keep_alive_interval, self._on_lease_tick, self._on_lease_tick)
        self._lease_asked = 0.0
        self._last_quorum: tuple[int, Quorum] | None = None  # (mod revision, quorum) of the last record decoded
        self._lease.ensure()
        if isinstance(self._lease, NodeLease):
            self._lease.start(start_thread)
        self._stop = threading.Event()
        self.watcher = Watcher(self)
        self._watcher: threading.Thread | None = None

    @classmethod
    def from_env(cls, env: WorkerEnv, *, start_thread: StartThread = start_daemon_thread,
                 on_lease_lost: Callable[[str], None] | None = None) -> LiveGroup | None:
        """The live group of this worker when its agent runs the etcd-v3 rendezvous in live mode
        (``env.live`` set), else None."""
        if env.live is None:
            return None
        if not (env.rdzv_conn and env.rdzv_node and env.rdzv_prefix):
            raise ValueError("the live settings are in the environment but not the rendezvous's etcd connection, "
                             "node and prefix; start workers through `elastic-train` (the etcd-v3 handler sets them)")
        from elastic_trainer.etcd.client import EtcdConnection, options_from_export

        # The password is not in the environment: the export names the 0600 file that holds it.
        options = options_from_export(env.rdzv_conn, retry_timeout=15.0)
        node = env.rdzv_node
        host = node.rsplit("_", 2)[0] if node.count("_") >= 2 else "127.0.0.1"
        host = resolvable(host)
        return cls(EtcdConnection(options), env.rdzv_prefix, node, env.local_rank or 0,
                   env.local_world_size or 1, host, env.live, start_thread=start_thread,
                   on_lease_lost=on_lease_lost, node_lease=env.rdzv_lease)

    # ---- joining -------------------------------------------------------------------------------
    def join(self) -> Quorum:
        """Wait until a quorum includes this worker (as a newcomer, or in a cold start)."""
        value = json.dumps({"node": self.node, "local_rank": self.local_rank, "nproc": self.nproc,
                            "probe": self.me.probe, "since": time.time()}).encode()
        self._lease.put(self._key("join/" + self.id), value)
        deadline = time.monotonic() + self.settings.join_timeout
        enough_since: float | None = None
        try:
            while True:
                view = self._read()
                q = view.quorum
                if q is not None and q.finished and any(m.id in view.alive for m in q.members):
                    raise RunFinished("the run finished before this worker was admitted")
                # a finished quorum with no live member is an earlier job of this run id (the
                # embedded etcd keeps its data): this launch starts it over, cold, from storage
                if q is not None and q.rank_of(self.id) is not None:
                    return self._adopt(q)
                live_quorum = q is not None and any(m.id in view.alive for m in q.members)
                if not live_quorum:
                    nodes = complete_nodes(view)
                    if len(nodes) >= self.settings.min_nodes:
                        enough_since = enough_since or time.monotonic()
                        if (len(nodes) >= self.settings.max_nodes
                                or time.monotonic() - enough_since >= self.settings.last_call):
                            chosen = nodes[:self.settings.max_nodes]
                            members = tuple(m for n in chosen for m in n[1])
                            new = Quorum(q=(q.q if q else 0) + 1, members=members, step=-1, cold=True,
                                         cause="cold start", formed_at=time.time())
                            self._cas_quorum(new, view.quorum_rev)
                            continue
                    else:
                        enough_since = None
                if time.monotonic() > deadline:
                    raise LiveTimeout(f"not admitted to the run within join_timeout "
                                      f"{self.settings.join_timeout:g}s")
                time.sleep(0.02)
        finally:
            try:
                self._call(lambda c: c.delete(self._key("join/" + self.id)), "join key delete")
            except Exception as exc:  # noqa: BLE001 - it goes with the lease
                logger.info("live: could not delete the join key (%s); it goes with the lease", exc)

    def _adopt(self, q: Quorum) -> Quorum:
        with self._adopt_lock:  # the watcher must not flag a change against the quorum left behind
            self.quorum = q
            self.change_pending.clear()
            self.change_reason = ""
        return q

    # ---- the process group's store --------------------------------------------------------------
    def store(self):
        """A fresh torch ``Store`` in etcd for the current quorum's process group (no process hosts it)."""
        from elastic_trainer.etcd.store import EtcdStore

        q = self.quorum
        assert q is not None
        return EtcdStore(self.conn, self._key(f"store/{q.q}/"),
                         timeout=datetime.timedelta(seconds=max(5.0, self.settings.report_timeout * 3)))

    def forget_old(self) -> None:
        """Rank 0, once its group is up: delete what no one reads any more (the store and the
        reports of two quorums ago)."""
        q = self.quorum
        if q is None or q.rank_of(self.id) != 0 or q.q < 3:
            return
        for sub in (f"store/{q.q - 2}/", f"report/{q.q - 1}/", f"stall/{q.q - 2}",
                    f"{quorum_record.MEMBERS}{q.q - 2}"):
            try:
                self._call(lambda c, s=sub: c.delete_prefix(self._key(s)) if s.endswith("/")
                           else c.delete(self._key(s)), "cleanup")
            except Exception as exc:  # noqa: BLE001 - leftovers only cost etcd space
                logger.info("live: could not delete %s: %s", sub, exc)

    # ---- while training --------------------------------------------------------------------------
    def start_watching(self) -> None:
        """Watch joiners, leases and (with ``on_member_lost``) the other nodes' probes while training."""
        if self._watcher is None:
            self._watcher = self._start_thread("live-watch", self.watcher.run, stop=self._stop_watching)

    def _stop_watching(self) -> None:
        self._stop.set()
        self.watcher.wake()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Make the watcher look now (a slow phase began)."""
        self.watcher.wake()

    def finish(self) -> None:
        """Rank 0 at the end of training: mark the run finished, so that waiting newcomers exit 0."""
        view = self._read()
        q = view.quorum
        if q is not None and self.quorum is not None and q.q == self.quorum.q and not q.finished:
            done = Quorum(**{**{f: getattr(q, f) for f in q.__dataclass_fields__}, "finished": True})
            self._cas_quorum(done, view.quorum_rev, base=q)

    def close(self) -> None:
        """Leave: the lease is revoked, so the others see at once that this worker is gone (also
        when the watcher was stopped first: a runtime that stops its threads before the group
        closes used to leave the lease to expire, and its keeper renewing)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._stop_watching()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2)
        self._probe.close()
        self._lease.close(revoke=True)


__all__ = ["LiveExcluded", "LiveGroup", "LiveTimeout", "Member", "Quorum", "RunFinished", "StartThread",
           "start_daemon_thread"]
