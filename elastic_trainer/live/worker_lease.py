"""A live worker's keys on its node's lease: while etcd keeps the lease, the worker is a member.

Under live recovery a worker's keys (``live/alive/<id>``, its ``join/``, ``busy/`` and
``report/`` keys) ride on its node's lease, the agent's (``rendezvous/node_lease.py``): etcd, not a
peer's clock, says who is alive, and a node costs etcd one renewal per interval however many
workers it runs. ``WorkerLease`` is one worker's part in that:

- **Its keys.** ``ensure()`` writes ``alive/<id>`` on the lease (a lease etcd no longer knows
  raises ``LiveExcluded``: the agent lost it), after deleting what this node's earlier worker at
  the same local rank left on it (``forget_earlier_selves``: a worker killed alone, or a group its
  agent restarted; on the node's lease its keys would outlive it). ``put``/``delete`` write the
  others. ``close()`` marks ``alive/<id>`` as left (``{"left": ...}``), then deletes it: the others
  see a departure, not a loss (``live/watcher.py``). It never revokes the node's lease.
- **The stand-in renewal** (``start``: the ``node-lease`` thread): every quarter interval it reads
  the agent's renewal record, and renews the lease itself when the agent's renewal is late (paused,
  busy or dead while its workers train); the first of the node's workers to claim the record
  renews, the others wait.
- **Leaving when it is gone.** When etcd deleted the lease (the node was paused or cut off past
  ``lease_ttl``), the others may already train without this worker, and it must not touch the old
  group again. It learns so in three ways, each ending it through ``on_lost(reason)`` (the Manager
  exits with ``EXIT_EXCLUDED``; its agent starts a newcomer):

  - a stand-in renewal finds the lease gone;
  - the watcher's view no longer holds this worker's own ``alive`` key (``saw_view``; a view its
    node's watching worker published may predate the key, so etcd is asked first);
  - before a step, the last renewal is older than the lease (``check``: a process paused past its
    lease resumes all its threads at once, and the training thread must not start a step first).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable

import grpc
from etcd3.etcdrpc import RangeRequest

from elastic_trainer.live.keys import LiveKeys
from elastic_trainer.live.quorum import LiveExcluded
from elastic_trainer.live.threads import StartThread
from elastic_trainer.observability import metrics
from elastic_trainer.rendezvous.node_lease import RenewalRecord, node_dir

logger = logging.getLogger(__name__)


class WorkerLease:
    """Member ``member_id``'s keys on its node's lease ``lease_id`` (see the module docstring).
    ``on_lost(reason)`` is called once the lease is found gone (None: ``check`` raises
    ``LiveExcluded`` in the main thread instead)."""

    def __init__(self, keys: LiveKeys, member_id: str, lease_id: int, ttl: float, interval: float,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self._keys = keys
        self.member_id = member_id
        self.key = keys.key("alive/" + member_id)
        self.lease_id = lease_id
        self._ttl, self._interval = ttl, interval
        self._on_lost = on_lost
        self._lost = False
        self._told = False
        self._closed = threading.Event()  # the worker left
        self._stop_renewal = threading.Event()  # the stand-in renewal stops (its thread's stop)
        self._confirmed = time.monotonic()
        self._asked = 0.0  # when etcd was last asked whether the key lives
        self._last_own = float("-inf")  # this worker's last stand-in renewal
        self._started = False
        self._record: RenewalRecord | None = None
        try:
            self._record = RenewalRecord(lease_id)
        except OSError as exc:
            logger.warning("no renewal record for the node's lease (%s): this worker renews it too", exc)
        self.renewals = 0
        """Stand-in renewals this worker sent (the agent's were late)."""

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def directory(self) -> str:
        """The directory this node's workers share (``rendezvous/node_lease.node_dir``; made by its users)."""
        return node_dir(self.lease_id)

    # ---- the worker's keys ----------------------------------------------------------------------
    def ensure(self) -> None:
        """Clear this local rank's earlier keys, then write ``alive/<id>`` on the node's lease."""
        self.forget_earlier_selves()
        try:
            self.put(self.key, json.dumps({"since": time.time()}).encode())
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._lost = True
            raise LiveExcluded(f"the node's etcd lease {self.lease_id:x} is gone (its agent lost it); "
                               f"this worker exits and its agent starts a newcomer") from exc
        self._confirmed = time.monotonic()

    def forget_earlier_selves(self) -> None:
        """Delete the live keys of this node's earlier workers at this local rank: on the node's lease
        they would outlive the process, and a stale ``join/`` key would keep the node from looking
        complete. One worker per node and local rank lives at a time (torch's agent restarts the
        whole group). ``<node>-<local rank>-<pid>`` is a member id."""
        mine = self.member_id.rsplit("-", 1)[0]
        for sub in ("alive/", "join/", "busy/"):
            prefix = self._keys.key(sub + mine + "-")
            try:
                found = self._keys.call(lambda c, p=prefix: list(c.get_prefix(p, keys_only=True)), "earlier keys")
                for _, meta in found:
                    key = meta.key.decode()
                    if key[len(self._keys.key(sub)):].rsplit("-", 1)[0] == mine and key != self._keys.key(sub + self.member_id):
                        self._keys.call(lambda c, k=key: c.delete(k), "earlier key delete")
            except Exception as exc:  # noqa: BLE001 - they go with the node's lease at the latest
                logger.info("live: could not delete the keys of earlier workers at %s: %s", mine, exc)

    def put(self, key: str, value: bytes, retry_timeout: float | None = None) -> None:
        """Write ``key`` attached to the node's lease (it vanishes with the lease)."""
        self._keys.call(lambda c: c.put(key, value, lease=self.lease_id), "put", retry_timeout=retry_timeout)

    def delete(self, key: str, retry_timeout: float | None = None) -> None:
        self._keys.call(lambda c: c.delete(key), "delete", retry_timeout=retry_timeout)

    # ---- the stand-in renewal -------------------------------------------------------------------
    def start(self, start_thread: StartThread) -> None:
        """Start the ``node-lease`` thread (owned by whoever owns ``start_thread``)."""
        self._started = True
        start_thread("node-lease", self._stand_in, stop=self._stop_renewal.set)

    def _stand_in(self) -> None:
        """Every quarter interval: renew the node's lease if the agent's renewal is late."""
        try:
            due = 1.5 * self._interval
            while not self._stop_renewal.wait(self._interval / 4) and not self._lost:
                if self._record is None:
                    previous: float | None = 0.0 if self.seconds_since_renewal() >= self._interval else None
                else:
                    previous = self._record.claim(due)
                if previous is not None:
                    self._renew(previous)
        finally:
            if self._record is not None:
                self._record.close()

    def _renew(self, previous: float) -> None:
        sent = time.monotonic()
        try:
            ttl = self._keys.call(lambda c: self._keys.conn.renew_lease(
                self.lease_id, failover_after=max(0.5, self._ttl - 2 * self._interval)),
                "lease keep-alive", retry_timeout=0)
            self.renewals += 1
            metrics.lease_renewed(time.monotonic() - sent)  # /metrics: the renewal's round trip, sent when due
        except Exception as exc:  # noqa: BLE001 - the next tick (or a sibling) tries again
            logger.warning("could not renew the node's etcd lease %x: %s", self.lease_id, exc)
            if self._record is not None:
                self._record.renewed(previous)  # not renewed: let the next tick try again
            return
        if ttl <= 0:
            self._gone()
            return
        self._confirmed = max(self._confirmed, sent)
        first, self._last_own = sent - self._last_own > 4 * self._interval, sent
        if first:  # the first of a series (the agent's renewals stopped): said once
            logger.warning("the agent's renewal of the node's etcd lease %x is late; this worker renews it for "
                           "its agent meanwhile", self.lease_id)

    # ---- is it gone? ----------------------------------------------------------------------------
    def seconds_since_renewal(self) -> float:
        """Since the node's last renewal (the record) or the last time this worker's key was seen
        to live, whichever is later."""
        last = self._record.last() if self._record is not None else 0.0
        return time.monotonic() - max(self._confirmed, last)

    def saw_view(self, present: bool, current: bool, authoritative: bool) -> None:
        """The watcher's look at a view of the live keys: this worker's own ``alive`` key
        ``present`` in a ``current`` view (its watch established, nothing unread) proves the lease
        lives; its absence from a view this worker read itself (``authoritative``) means the node's
        lease expired; from its node's published view (which may predate the key) etcd is asked
        first, at most once a second."""
        if self._closed.is_set():
            return
        if present:
            if current:
                self._confirmed = time.monotonic()
        elif authoritative:
            self._gone()
        else:
            self._ask_etcd()

    def check(self) -> None:
        """Before a step: end this worker (``on_lost``) when its lease is gone. The stand-in and the
        watcher notice a lost lease soon, but a process paused past its lease resumes all its
        threads at once; so when the last renewal is older than the lease's TTL, etcd is asked
        directly (at most once a second, 0.5 s at most each: an etcd that is restarting does not
        end the worker, its lease lives on in etcd)."""
        if self._lost:
            self._tell()
        elif self.seconds_since_renewal() > self._ttl:
            self._ask_etcd()

    def _ask_etcd(self) -> None:
        now = time.monotonic()
        if now - self._asked < 1.0:
            return
        self._asked = now

        def ask(c):
            return c.kvstub.Range(RangeRequest(key=self.key.encode(), count_only=True), 0.5,
                                  credentials=c.call_credentials, metadata=c.metadata)

        try:
            found = self._keys.call(ask, "alive key read", retry_timeout=0).count > 0
        except Exception as exc:  # noqa: BLE001 - no answer: not proof of anything
            logger.info("could not read %s from etcd: %s", self.key, exc)
            return
        if found:
            self._confirmed = time.monotonic()
        else:
            self._gone()

    def _gone(self) -> None:
        if not self._lost:
            self._lost = True
            logger.warning("%s is gone from etcd: the node's lease expired (the node was paused or cut off)", self.key)
        self._tell()

    def _tell(self) -> None:
        """The lease is gone: the others may already train without this worker."""
        if self._closed.is_set():
            return
        reason = ("live: this worker's etcd lease expired; it was left out of the group and exits "
                  "(its agent starts a newcomer)")
        if self._on_lost is not None:
            if not self._told:
                self._told = True
                self._on_lost(reason)
        elif threading.current_thread() is threading.main_thread():
            raise LiveExcluded(reason)

    # ---- leaving --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the stand-in renewal, and leave: ``alive/<id>`` marked as left, then deleted (never
        the node's lease)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._stop_renewal.set()
        if self._record is not None and not self._started:
            self._record.close()
        if self._lost:
            return
        try:
            self.put(self.key, json.dumps({"left": time.time(), "pid": os.getpid()}).encode(), retry_timeout=2)
            self.delete(self.key, retry_timeout=2)
        except Exception as exc:  # noqa: BLE001 - best effort; it goes with the node's lease
            logger.info("could not delete %s (%s); it goes with the node's lease", self.key, exc)


__all__ = ["WorkerLease"]
