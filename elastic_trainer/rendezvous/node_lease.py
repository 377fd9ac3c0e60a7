"""One etcd lease per node under live recovery: the agent's, shared by the node's workers.

A lease costs etcd one renewal per ``keep_alive_interval``. With a lease per worker, a node of 8
GPUs renewed 9 leases a second (its agent's and each worker's); at 1,000 nodes that is 9,000
requests a second for nothing but liveness. Under live recovery the workers attach their
``live/alive/<id>`` keys (and their ``join/``, ``busy/``, ``report/`` keys) to the agent's lease,
whose id the handler exports as ``ELASTIC_TRAINER_RDZV_LEASE``: one renewal a second per node.

This module is the agent's side of that and the contract between the agent and its workers:

- The agent's ``LeaseKeeper`` (``rendezvous/lease.py``) renews the lease every interval and, through
  ``AgentRecord``, records each renewal in a small file beside it (``RenewalRecord``: the time the
  renewal was sent, on the machine's monotonic clock, which every process of a machine shares).
- The node's workers (``live/worker_lease.py``) read that record; only when the last renewal is
  older than one and a half intervals (the agent is paused, busy or dead while its workers train)
  does a worker renew the lease itself, the first to take the record's lock (``claim``).
- ``node_dir``: beside the record, a directory the node's workers share (their one etcd watch,
  ``live/node_share.py``, and their one report per re-form, ``live/node_report.py``), removed
  with the record when the agent is done with the lease. An agent that is killed cannot remove
  them: the next agent of the user on the machine removes records untouched for an hour (``sweep``).

So in steady state the node sends one renewal per interval, the agent's
(``benchmarks/etcd_load.py``); an agent paused alone costs nothing (its workers keep the node's
lease); a node paused or cut off whole loses the lease ``lease_ttl`` after its last renewal, and
etcd deletes every key of the node at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import struct
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

_STAMP = struct.Struct("<d")


STALE_AFTER = 3600.0
"""Seconds after its last write that a record (and the node directory beside it) is stale: a live
lease's record is written every renewal interval (seconds), so one untouched for an hour belongs to
a lease etcd has long deleted, its agent killed before it could remove it (``sweep``)."""


def _prefix() -> str:
    return f"elastic-trainer-{os.getuid()}-lease-"


def record_path(lease_id: int) -> str:
    """Where the node's renewal record for ``lease_id`` lives: the temp dir that the agent and its
    workers share (torch's agent does not change it), named by user and lease."""
    return os.path.join(tempfile.gettempdir(), f"{_prefix()}{lease_id:x}")


def node_dir(lease_id: int) -> str:
    """The directory the workers on the node's lease ``lease_id`` share (made by the first that
    needs it: mode 0700; removed with the record by the agent)."""
    return record_path(lease_id) + ".d"


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
        """Close it; ``remove`` (the agent, done with the lease) also deletes it and the node's
        directory beside it (``node_dir``)."""
        os.close(self._fd)
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            shutil.rmtree(self.path + ".d", ignore_errors=True)


def sweep(older_than: float = STALE_AFTER) -> list[str]:
    """Remove this user's records and node directories (``node_dir``) in the temp dir that were not
    written for ``older_than`` seconds: what agents killed before they could remove theirs left
    (``RenewalRecord.close(remove=True)``; a node that restarts after every kill would otherwise gather
    them). Only the user's own plain files and directories, never a link. Returns the names removed."""
    folder, prefix, now = tempfile.gettempdir(), _prefix(), time.time()
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
        except OSError:  # removed meanwhile
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < older_than:
            continue
        if name.endswith(".d") and stat.S_ISDIR(st.st_mode):
            if os.path.exists(path[:-2]):  # its record is alive, or is removed with it
                continue
            shutil.rmtree(path, ignore_errors=True)
        elif stat.S_ISREG(st.st_mode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            shutil.rmtree(path + ".d", ignore_errors=True)
        else:
            continue
        removed.append(name)
    return removed


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
                    else:  # this agent's first: clear what killed agents left
                        if swept := sweep():
                            logger.info("removed %d stale lease records of killed agents from %s", len(swept),
                                        tempfile.gettempdir())
                    self._record, self._lease_id = RenewalRecord(lease_id), lease_id
                self._record.renewed(sent)
            except OSError as exc:  # the workers renew the lease themselves then: more requests, same safety
                logger.warning("could not record the node's lease renewal for its workers: %s", exc)

    def close(self) -> None:
        with self._lock:
            if self._record is not None:
                self._record.close(remove=True)
            self._record = self._lease_id = None


__all__ = ["STALE_AFTER", "AgentRecord", "RenewalRecord", "node_dir", "record_path", "sweep"]
