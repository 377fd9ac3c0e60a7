"""A live worker's lease: while etcd keeps it, the worker is a member; once it is gone, the worker leaves.

Under live recovery a worker's keys (``live/alive/<id>``, its ``join/``, ``busy/`` and
``report/`` keys) ride on its node's lease (the agent's, ``rendezvous/node_lease.py``), or on a
lease of its own where no agent exported one (tests that build a ``LiveGroup`` directly). etcd,
not a peer's clock, says who is alive: when the lease expires (the node was paused or cut off past
``lease_ttl``), etcd deletes the keys, the others may already train without the worker, and it
must not touch the old group again. It learns so in three ways, and each ends it through
``on_lease_lost`` (the Manager exits with ``EXIT_EXCLUDED``; its agent starts a newcomer):

- the renewal thread's next renewal fails (``_on_lease_tick``);
- the watcher's view no longer holds this worker's own ``alive`` key (``on_view``; a sibling's
  published view may predate the key, so etcd is asked first);
- before a step, the last accepted renewal is older than the lease (``check_lease``: a process
  paused past its lease resumes all its threads at once).

On the node's lease, one worker per node keeps the node's etcd watch and publishes its views to
the others (``node_watch``, ``rendezvous/node_watch.py``), and a new worker first deletes the
keys its predecessor at the same local rank left on the lease (``_forget_earlier_selves``).
``LiveLease`` is that part of ``LiveGroup`` (``rendezvous/quorum.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

from elastic_trainer.env import LiveSettings
from elastic_trainer.rendezvous.live_etcd import LiveEtcd
from elastic_trainer.rendezvous.members import LiveExcluded, View
from elastic_trainer.rendezvous.node_watch import NodeWatch

if TYPE_CHECKING:
    from elastic_trainer.rendezvous.lease import LeaseKeeper
    from elastic_trainer.rendezvous.node_lease import NodeLease

logger = logging.getLogger("elastic_trainer.rendezvous.quorum")


class LiveLease(LiveEtcd):
    """The lease checks of one live worker (a base of ``LiveGroup``, which sets the attributes below)."""

    node: str
    local_rank: int
    settings: LiveSettings
    _lease: LeaseKeeper | NodeLease
    """The node's ``NodeLease``, or the worker's own ``LeaseKeeper``."""
    _lease_asked: float
    _stop: threading.Event
    _on_lease_lost: Callable[[str], None] | None

    def _forget_earlier_selves(self) -> None:
        """Delete the live keys of this node's earlier workers at this local rank (one killed alone,
        or a whole group its agent restarted): on the node's lease they would outlive the process,
        and a stale ``join/`` key would keep the node from looking complete. One worker per node
        and local rank lives at a time (torch's agent restarts the whole group)."""
        mine = f"{self.node}-{self.local_rank}"
        for sub in ("alive/", "join/", "busy/"):
            prefix = self._key(sub + mine + "-")
            try:
                found = self._call(lambda c, p=prefix: list(c.get_prefix(p, keys_only=True)), "earlier keys")
                for _, meta in found:
                    key = meta.key.decode()
                    if key[len(self._key(sub)):].rsplit("-", 1)[0] == mine and not key.endswith("-" + str(os.getpid())):
                        self._call(lambda c, k=key: c.delete(k), "earlier key delete")
            except Exception as exc:  # noqa: BLE001 - they go with the node's lease at the latest
                logger.info("live: could not delete the keys of earlier workers at %s: %s", mine, exc)

    def _on_lease_tick(self) -> None:
        if self._lease.lost and not self._stop.is_set():
            # etcd declared this worker dead (it was paused or cut off past its lease): the
            # others may already train without it. It must not touch the old group again.
            reason = ("live: this worker's etcd lease expired; it was left out of the group and exits "
                      "(its agent starts a newcomer)")
            if self._on_lease_lost is not None:
                self._on_lease_lost(reason)
            elif threading.current_thread() is threading.main_thread():
                raise LiveExcluded(reason)

    def node_watch(self, on_change: Callable[[], None], on_promote: Callable[[], None]) -> NodeWatch | None:
        """This worker's part in its node's one etcd watch (``rendezvous/node_watch.py``), on the
        node's lease only; None where every worker keeps its own watch."""
        from elastic_trainer.rendezvous.node_lease import NodeLease, record_path

        if not isinstance(self._lease, NodeLease):
            return None
        try:
            return NodeWatch(record_path(self._lease.lease_id) + ".d", self.settings.poll, on_change, on_promote)
        except OSError as exc:
            logger.warning("live: this worker keeps an etcd watch of its own (no node directory: %s)", exc)
            return None

    def on_view(self, view: View, current: bool, authoritative: bool = True) -> None:
        """The watcher's look at a view of the live keys: on the node's lease (``NodeLease``) this
        worker's own ``alive`` key in a ``current`` view (its watch established, nothing unread)
        proves the lease lives; its absence from a view this worker read itself (``authoritative``)
        means the node's lease expired (the node was paused or cut off) and the worker leaves
        (``on_lease_lost``); from a sibling's view (which may predate its key) etcd is asked first.
        A lease of its own says so by itself."""
        from elastic_trainer.rendezvous.node_lease import NodeLease

        if not isinstance(self._lease, NodeLease) or self._stop.is_set():
            return
        if self.id in view.alive:
            if current:
                self._lease.confirm()
            return
        if not authoritative:  # a sibling's view: ask etcd (at most once a second)
            now = time.monotonic()
            if now - self._lease_asked >= 1.0:
                self._lease_asked = now
                if self._lease.expired_at_etcd(timeout=0.5):
                    self._on_lease_tick()
            return
        self._lease.mark_lost()
        self._on_lease_tick()

    def check_lease(self) -> None:
        """Before a step: end this worker (as ``_on_lease_tick`` does) when its lease is gone.

        The renewal thread notices a lost lease at its next renewal, but a process that was
        paused past its lease (SIGSTOP, a frozen host) resumes all its threads at once, and the
        training thread must not start another step in the old group meanwhile. So when the last
        accepted renewal is older than the lease's TTL, etcd is asked directly (at most once a
        second, 0.5 s at most each: an etcd that is restarting does not end the worker, its lease
        lives on in etcd)."""
        if self._lease.lost:
            self._on_lease_tick()
        if self._lease.seconds_since_renewal() <= self.settings.lease_ttl:
            return
        now = time.monotonic()
        if now - self._lease_asked < 1.0:
            return
        self._lease_asked = now
        if self._lease.expired_at_etcd(timeout=0.5):
            self._on_lease_tick()

__all__ = ["LiveLease"]
