"""One etcd lease per node under live recovery: the agent's, shared by the node's workers.

A lease costs etcd one renewal per ``keep_alive_interval``. With a lease per worker, a node of 8
GPUs renewed 9 leases a second (its agent's and each worker's); at 1,000 nodes that is 9,000
requests a second for nothing but liveness. Under live recovery the workers now attach their
``live/alive/<id>`` keys (and their ``join/``, ``busy/``, ``report/`` keys) to the agent's lease,
whose id the handler exports as ``ELASTIC_TRAINER_RDZV_LEASE``: one renewal a second per node.

Who renews it. The agent's ``LeaseKeeper`` does, every interval, and records each renewal in a
small file beside it (``RenewalRecord``: the time the renewal was sent, on the machine's monotonic
clock, which every process of a machine shares). Each worker (``NodeLease``) looks at that record
every quarter interval, and only when the last renewal is older than one and a half intervals (the
agent is paused, busy or dead while its workers train) does a worker renew the lease itself: the
first to take the record's lock claims the renewal, so siblings do not all send one. So:

- in steady state the node sends one renewal per interval, the agent's (``benchmarks/etcd_load.py``);
- an agent paused alone (SIGSTOP, a slow host process) costs nothing: its workers keep the
  node's lease and train on, and the agent finds its lease alive when it resumes;
- a node paused or cut off whole loses the lease ``lease_ttl`` after its last renewal: etcd deletes
  every key of the node at once, each worker's watch shows its own ``alive`` key gone and the
  worker leaves (``LiveGroup.on_view``), and the survivors' watches show the node gone.

A worker killed alone leaves its keys on the node's lease; the next worker at that local rank
deletes them (``LiveGroup`` on start), and the survivors' re-form never waits for them (a killed
worker's collectives fail loudly; its node restarts as a whole). A worker started without an
exported lease (tests that build a ``LiveGroup`` directly) keeps a ``LeaseKeeper`` of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable

import grpc

from elastic_trainer.etcd.client import EtcdConnection
from elastic_trainer.rendezvous.members import LiveExcluded, StartThread

logger = logging.getLogger(__name__)

_STAMP = struct.Struct("<d")


def record_path(lease_id: int) -> str:
    """Where the node's renewal record for ``lease_id`` lives: the temp dir that the agent and its
    workers share (torch's agent does not change it), named by user and lease."""
    return os.path.join(tempfile.gettempdir(), f"elastic-trainer-{os.getuid()}-lease-{lease_id:x}")


class RenewalRecord:
    """The time (``time.monotonic()``) of the node's last accepted lease renewal, in an 8-byte file.

    Written with one ``pwrite`` (atomic for 8 bytes), read with one ``pread``; ``claim`` holds the
    file's ``flock`` only while it checks and writes, so a renewer that freezes holds nothing. The
    file is the user's own (``O_NOFOLLOW``, mode 0600, owner checked): another user cannot plant it."""

    def __init__(self, lease_id: int) -> None:
        self.path = record_path(lease_id)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if os.fstat(self._fd).st_uid != os.getuid():
            os.close(self._fd)
            raise PermissionError(f"{self.path} belongs to another user; remove it or set TMPDIR")

    def last(self) -> float:
        """When the last renewal was sent (0.0 when none was recorded)."""
        data = os.pread(self._fd, _STAMP.size, 0)
        return _STAMP.unpack(data)[0] if len(data) == _STAMP.size else 0.0

    def renewed(self, sent: float) -> None:
        os.pwrite(self._fd, _STAMP.pack(sent), 0)

    def claim(self, due: float) -> float | None:
        """Claim the next renewal if the last is ``due`` seconds old and no sibling is claiming it
        now: the record then says now (so siblings wait) and the previous time is returned (to put
        back if the renewal fails); None when it is not this process's turn."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        try:
            last, now = self.last(), time.monotonic()
            if now - last < due:
                return None
            self.renewed(now)
            return last
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self, remove: bool = False) -> None:
        """Close it; ``remove`` (the agent, done with the lease) also deletes it and the directory
        of the node's shared watch beside it (``rendezvous/node_watch.py``)."""
        os.close(self._fd)
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            shutil.rmtree(self.path + ".d", ignore_errors=True)


class AgentRecord:
    """The agent's side: ``LeaseKeeper(on_renewed=AgentRecord())`` records each renewal of the
    node's lease for its workers, and removes the record of a lease it no longer holds."""

    def __init__(self) -> None:
        self._record: RenewalRecord | None = None
        self._lease_id: int | None = None
        self._lock = threading.Lock()

    def __call__(self, lease_id: int | None, sent: float) -> None:
        if lease_id is None:
            return
        with self._lock:
            try:
                if lease_id != self._lease_id:
                    if self._record is not None:
                        self._record.close(remove=True)
                    self._record, self._lease_id = RenewalRecord(lease_id), lease_id
                self._record.renewed(sent)
            except OSError as exc:  # the workers renew the lease themselves then: more requests, same safety
                logger.warning("could not record the node's lease renewal for its workers: %s", exc)

    def close(self) -> None:
        with self._lock:
            if self._record is not None:
                self._record.close(remove=True)
            self._record = self._lease_id = None


class NodeLease:
    """A worker's keys on its node's lease: the calls ``LiveGroup`` makes of a ``LeaseKeeper``,
    and a stand-in renewal when the agent's is late (see the module docstring).

    - ``ensure()`` writes ``key`` on the lease; a lease etcd no longer knows raises ``LiveExcluded``.
    - ``start(start_thread)`` starts the stand-in renewal thread (``node-lease``), owned by whoever
      owns ``start_thread`` (the worker runtime); ``close()`` stops it and deletes this worker's key.
      It never revokes the lease: the node's agent and siblings hold it too.
    - The lease is *lost* when this worker's own ``alive`` key is gone from a current view of its
      watch (``mark_lost()``), when a stand-in renewal finds it gone, or when ``expired_at_etcd``
      does; ``on_lost`` is then called once.
    - ``seconds_since_renewal()``: since the node's last renewal (the record) or the last time this
      worker's watch showed its key, whichever is later: a process paused past the lease sees it
      old and asks etcd before its next step, as with a lease of its own."""

    def __init__(self, conn: EtcdConnection, key: str, lease_id: int, ttl: float, interval: float,
                 on_lost: Callable[[], None] | None = None) -> None:
        self._conn = conn
        self._key = key
        self._lease_id = lease_id
        self._ttl, self._interval = ttl, interval
        self._on_lost = on_lost
        self._lost = False
        self._confirmed = time.monotonic()
        self._since = json.dumps({"since": time.time()}).encode()
        self._stop = threading.Event()
        self._record: RenewalRecord | None = None
        self._started = False
        self._last_own = float("-inf")  # this worker's last stand-in renewal
        try:
            self._record = RenewalRecord(lease_id)
        except OSError as exc:
            logger.warning("no renewal record for the node's lease (%s): this worker renews it too", exc)
        self.requests = 0
        self.renewals = 0

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def lease_id(self) -> int:
        return self._lease_id

    def ensure(self) -> None:
        try:
            self.put(self._key, self._since)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._lost = True
            raise LiveExcluded(f"the node's etcd lease {self._lease_id:x} is gone (its agent lost it); "
                               f"this worker exits and its agent starts a newcomer") from exc
        self._confirmed = time.monotonic()

    def start(self, start_thread: StartThread) -> None:
        self._started = True
        start_thread("node-lease", self._stand_in, stop=self._stop.set)

    def put(self, key: str, value: bytes) -> None:
        """Write ``key`` attached to the node's lease (it vanishes with the lease)."""
        self._conn.call(lambda c: c.put(key, value, lease=self._lease_id), "put")
        self.requests += 1

    def delete(self, key: str) -> None:
        self._conn.call(lambda c: c.delete(key), "delete")
        self.requests += 1

    def confirm(self) -> None:
        """This worker's key is known to live now (a current view of its watch shows it)."""
        self._confirmed = time.monotonic()

    def mark_lost(self) -> None:
        if self._lost:
            return
        self._lost = True
        logger.warning("%s is gone from etcd: the node's lease expired (the node was paused or cut off)", self._key)

    def seconds_since_renewal(self) -> float:
        last = self._record.last() if self._record is not None else 0.0
        return time.monotonic() - max(self._confirmed, last)

    def _stand_in(self) -> None:
        """Every quarter interval: renew the node's lease if the agent's renewal is late."""
        try:
            self._stand_in_loop()
        finally:
            if self._record is not None:
                self._record.close()

    def _stand_in_loop(self) -> None:
        due = 1.5 * self._interval
        while not self._stop.wait(self._interval / 4):
            if self._lost:
                return
            if self._record is None:
                previous: float | None = 0.0 if self.seconds_since_renewal() >= self._interval else None
            else:
                previous = self._record.claim(due)
            if previous is None:
                continue
            sent = time.monotonic()
            try:
                ttl = self._conn.call(lambda c: self._conn.renew_lease(
                    self._lease_id, failover_after=max(0.5, self._ttl - 2 * self._interval)),
                    "lease keep-alive", retry_timeout=0)
                self.requests += 1
                self.renewals += 1
            except Exception as exc:  # noqa: BLE001 - the next tick (or a sibling) tries again
                logger.warning("could not renew the node's etcd lease %x: %s", self._lease_id, exc)
                if self._record is not None:
                    self._record.renewed(previous)  # not renewed: let the next tick try again
                continue
            if ttl <= 0:
                self.mark_lost()
                if self._on_lost is not None:
                    self._on_lost()
                return
            self._confirmed = max(self._confirmed, sent)
            first, self._last_own = sent - self._last_own > 4 * self._interval, sent
            if first:  # the first of a series (the agent's renewals stopped): said once
                logger.warning("the agent's renewal of the node's etcd lease %x is late; this worker renews it for "
                               "its agent meanwhile", self._lease_id)

    def expired_at_etcd(self, timeout: float) -> bool | None:
        """Ask etcd now whether this worker's key is gone: True (it is then marked lost), False
        when it lives, None when etcd did not answer within ``timeout``."""
        if self._lost:
            return True
        from etcd3.etcdrpc import RangeRequest

        def ask(c):
            return c.kvstub.Range(RangeRequest(key=self._key.encode(), count_only=True), timeout,
                                  credentials=c.call_credentials, metadata=c.metadata)

        try:
            found = self._conn.call(ask, "alive key read", retry_timeout=0).count > 0
            self.requests += 1
        except Exception as exc:  # noqa: BLE001 - no answer: not proof of anything
            logger.info("could not read %s from etcd: %s", self._key, exc)
            return None
        if found:
            self._confirmed = time.monotonic()
            return False
        self.mark_lost()
        return True

    def close(self, revoke: bool = True) -> None:
        """Stop the stand-in renewal and delete this worker's key (never the node's lease)."""
        self._stop.set()
        if self._record is not None and not self._started:
            self._record.close()
        if self._lost:
            return
        try:
            self._conn.call(lambda c: c.delete(self._key), "alive key delete", retry_timeout=2)
        except Exception as exc:  # noqa: BLE001 - best effort; it goes with the node's lease
            logger.info("could not delete %s (%s); it goes with the node's lease", self._key, exc)


__all__ = ["AgentRecord", "NodeLease", "RenewalRecord", "record_path"]
