"""One etcd watch per node: the first worker of a node to lock it keeps the watch, its siblings read its views.

Each worker's live watcher (``live/watcher.py``) needs a current view of the live keys (the
quorum, who is alive, who waits to join, a declared stall, who is busy). With a watch stream per
worker, a node of 8 GPUs held 8 streams and, after every change, made 8 identical reads. On a
node's lease (``rendezvous/node_lease.py``) the node's workers share a directory beside the
lease's renewal record, and through it one watch:

- **The watching worker** is the one that holds ``watch.lock`` (``flock``, held for the life of the
  process: the kernel releases it when the process dies, however it dies). Its watcher keeps the
  etcd watch and applies its changes to its ``Mirror`` (``live/mirror.py``), then ``publish``es
  them: appended to ``changes.log`` (one line each, whole lines in one write), or, after it read
  the live keys whole (or the log passed ``LOG_ROTATE``), a new epoch: a fresh log and
  ``view.json``, the snapshot the log's changes follow (each written whole and renamed into
  place); then one datagram to each sibling's socket in the directory.
- **A sibling** keeps no stream. Its ``run`` thread waits on its own datagram socket: each datagram
  calls ``on_change``, and the sibling's watcher ``load``s what was published instead of reading
  etcd: the log lines since its last load, applied to its own ``Mirror`` as the watching worker
  applied them (a few lines per event, where a snapshot is ~0.9 MB at 1,000 nodes of 8), or, when
  the epoch changed, the snapshot first. It tries the lock at every poll: when the watching
  worker is gone, a sibling takes the lock within a poll and ``on_promote`` makes its watcher open
  the watch and read (the read after the watch is established sees every change,
  ``live/stream.py``).
- What is published is every live key the watching worker knows (the snapshot: one JSON line, then
  the quorum record as etcd holds it, a change from the quorum before: ``live/quorum.py``; and that
  quorum's whole record beside it, ``members-<q>.json``, for a sibling without that one), not a
  view for its own quorum: a sibling that re-formed a moment before it serves itself from it, and
  decodes the quorum record only when it changed. No view published yet (the start), or none as
  new as the sibling's quorum within a second, makes the sibling read etcd itself once: correct,
  only dearer. (A view for the publisher's quorum used to send every sibling of a re-form to etcd:
  at 100 nodes x 8, 423 whole reads by the end of the first loss, whose next quorum was known
  everywhere after 72 s.)

A sibling never concludes from a published view that its own key is gone (the view may predate its
key); the watching worker's own reads, the node's lease record and the lease check say that
(``live/worker_lease.py``). The directory is the user's own (mode 0700, owner checked); where it
cannot be made, every worker keeps its own watch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

from elastic_trainer.live.keys import Change
from elastic_trainer.live.mirror import Mirror

logger = logging.getLogger(__name__)


LOG_ROTATE = 4 << 20
"""Bytes of ``changes.log`` after which the watching worker starts a new one from a new snapshot."""


def keys_to_bytes(keys: Mirror, epoch: int) -> bytes:
    """What the watching worker knows (``keys``), as the snapshot ``keys_from_bytes`` loads: one
    JSON line (everything but the quorum, and the ``epoch`` of the change log that follows it),
    then the quorum record as etcd holds it."""
    header = json.dumps({
        "epoch": epoch, "quorum_rev": keys.quorum_rev, "alive": sorted(keys.alive), "left": sorted(keys.left),
        "joiners": {k: [v, rev] for k, (v, rev) in keys.joiners.items()},
        "stalls": {str(q): v for q, v in keys.stalls.items()}, "busy": keys.busy}).encode()
    return header + b"\n" + (keys.quorum_record or b"")


def keys_from_bytes(keys: Mirror, data: bytes, epoch: int | None = None) -> bool:
    """Make ``keys`` the snapshot ``keys_to_bytes`` wrote (the quorum record decoded only when its
    revision is not the one ``keys`` has); False, ``keys`` untouched, when it is not of ``epoch``.
    ``ValueError`` when the bytes are not such a snapshot."""
    header, _, record = data.partition(b"\n")
    try:
        d = json.loads(header)
        if epoch is not None and d["epoch"] != epoch:
            return False
        keys.restore(record or None, int(d["quorum_rev"]), set(d["alive"]), set(d.get("left", ())),
                     {k: (v, int(rev)) for k, (v, rev) in d["joiners"].items()},
                     {int(q): v for q, v in d["stalls"].items()}, dict(d["busy"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"the node's published view is malformed ({exc!r})") from exc
    return True


def change_to_line(change: Change) -> bytes:
    """One line of ``changes.log`` (a value's bytes as latin-1 text: any bytes, back exactly)."""
    value = None if change.value is None else change.value.decode("latin-1")
    return json.dumps([change.key, value, change.create_revision, change.mod_revision]).encode() + b"\n"


def change_from_line(line: bytes) -> Change:
    try:
        key, value, create, mod = json.loads(line)
        return Change(key, None if value is None else value.encode("latin-1"), int(create), int(mod))
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"a line of the node's change log is malformed ({exc!r})") from exc


class NodeShare:
    """This worker's part in its node's one watch (see the module docstring).

    ``on_change()`` is called from ``run``'s thread when the watching worker published a view;
    ``on_promote()`` once, from the same thread, when this
    worker takes over the watch. ``try_lead()`` is called by the owner first: True makes this
    worker the watching one (then ``run`` is not needed)."""

    def __init__(self, directory: str, poll: float, on_change: Callable[[], None],
                 on_promote: Callable[[], None]) -> None:
        self.dir = directory
        self._poll = poll
        self._on_change = on_change
        self._on_promote = on_promote
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.stat(directory).st_uid != os.getuid():
            raise PermissionError(f"{directory} belongs to another user; remove it or set TMPDIR")
        self._lock_fd = os.open(os.path.join(directory, "watch.lock"),
                                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.leader = False
        self._stop = threading.Event()
        self._closing = threading.Lock()
        self._sock: socket.socket | None = None
        self._sock_path = os.path.join(directory, f"{os.getpid()}-{id(self):x}.sock")
        self.published = 0
        self._members_q = -1  # the quorum whose whole record this worker wrote beside its views
        self._log_fd: int | None = None  # the watching worker: its change log, open for appends
        self._log_size = 0
        self._epoch = 0
        self._loaded_epoch: int | None = None  # a sibling: the epoch it loaded, and how far into its log
        self._offset = 0

    def try_lead(self) -> bool:
        """Take the node's watch if nobody holds it (kept until this process ends or ``close``)."""
        if not self.leader and not self._stop.is_set():
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.leader = True
            except BlockingIOError:
                pass
            except OSError:  # closed under it: this worker is leaving
                if not self._stop.is_set():
                    raise
        return self.leader

    # ---- the watching worker ------------------------------------------------------------------
    def publish(self, keys: Mirror, changes: Sequence[Change] | None) -> None:
        """Make what ``keys`` holds the node's current view and wake the siblings: ``changes``
        (those applied to ``keys`` since the last publish) appended to the change log, or with
        None (``keys`` was read whole) a new snapshot and log. The quorum's whole record goes
        beside them, once per quorum and after the wake-ups, for a sibling that does not hold the
        quorum the record is a change from (``members``; one that looks before it is written reads
        etcd's)."""
        if changes is None or self._log_fd is None or self._log_size > LOG_ROTATE:
            self._new_log(keys)
        elif changes:
            data = memoryview(b"".join(change_to_line(c) for c in changes))
            while data:  # O_APPEND; a sibling reads whole lines only
                written = os.write(self._log_fd, data)
                self._log_size += written
                data = data[written:]
        self.published += 1
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
            out.setblocking(False)
            for name in os.listdir(self.dir):
                if not name.endswith(".sock") or name == os.path.basename(self._sock_path):
                    continue
                try:
                    out.sendto(b"v", os.path.join(self.dir, name))
                except (ConnectionRefusedError, FileNotFoundError):  # a sibling that is gone
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.dir, name))
                except BlockingIOError:  # its queue is full: it has a wake-up pending anyway
                    pass
        if keys.quorum is not None and keys.quorum.q != self._members_q:  # after the wake-ups: off their path
            self._write(f"members-{keys.quorum.q}.json", keys.quorum.to_json())
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.dir, f"members-{self._members_q}.json"))
            self._members_q = keys.quorum.q

    def _new_log(self, keys: Mirror) -> None:
        """A new epoch: its change log (empty), then the snapshot the log's changes follow. A
        sibling that finds a log and a snapshot of different epochs (between the two renames)
        loads at the next wake-up, which the datagrams bring."""
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None
        self._epoch = int.from_bytes(os.urandom(6), "big")
        head = json.dumps({"epoch": self._epoch}).encode() + b"\n"
        self._write("changes.log", head)
        self._log_fd = os.open(os.path.join(self.dir, "changes.log"),
                               os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._log_size = len(head)
        self._write("view.json", keys_to_bytes(keys, self._epoch))

    def _write(self, name: str, data: bytes) -> None:
        """``data`` as the file ``name`` in the node's directory, whole (written aside, renamed)."""
        path = os.path.join(self.dir, name)
        tmp = f"{path}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)

    # ---- a sibling ----------------------------------------------------------------------------
    def load(self, keys: Mirror) -> bool:
        """Bring ``keys`` up to what the watching worker published: the changes logged since the
        last load, applied in order (O(changes), not O(keys)), or, in a new epoch, its snapshot and
        then its log. False when there is nothing to load (none published yet, or caught between
        the two renames of a new epoch: ``keys`` unchanged) or it cannot be read (a malformed
        snapshot or line: ``keys`` may be part-way)."""
        try:
            with open(os.path.join(self.dir, "changes.log"), "rb") as f:
                head = f.readline()
                epoch = int(json.loads(head)["epoch"])
                if epoch != self._loaded_epoch:
                    with open(os.path.join(self.dir, "view.json"), "rb") as snapshot:
                        if not keys_from_bytes(keys, snapshot.read(), epoch):
                            return False
                    self._loaded_epoch, self._offset = epoch, len(head)
                f.seek(self._offset)
                tail = f.read()
            whole = tail[:tail.rfind(b"\n") + 1]  # a line being appended is read at the next load
            for line in whole.splitlines():
                keys.apply(change_from_line(line))
            self._offset += len(whole)
            return True
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._loaded_epoch = None  # start over from the snapshot
            logger.debug("live: no published view (%s)", exc)
            return False

    def members(self, q: int) -> bytes | None:
        """Quorum ``q``'s whole record as the watching worker wrote it beside its view, or None."""
        try:
            with open(os.path.join(self.dir, f"members-{q}.json"), "rb") as f:
                return f.read()
        except OSError:
            return None

    def bind(self) -> socket.socket:
        """A sibling's datagram socket in the node's directory, where each publish sends a datagram
        (``run`` binds it and waits on it; an owner that serves several siblings from one thread
        binds each and waits on them all)."""
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._sock_path)
            sock.bind(self._sock_path)
            self._sock = sock
        return self._sock

    def run(self) -> None:
        """A sibling's thread: wake the watcher on each published view; take the watch when free."""
        sock = self.bind()
        sock.settimeout(self._poll)
        try:
            while not self._stop.is_set():
                try:
                    if not sock.recv(16) and self._stop.is_set():  # shut down by ``close``
                        return
                except TimeoutError:
                    if self.try_lead():
                        logger.info("live: this worker keeps its node's etcd watch now (the last one's is gone)")
                        self._on_promote()
                        return
                    continue
                except OSError:
                    if self._stop.is_set():
                        return
                    raise
                self._on_change()
        finally:
            self._close_socket()

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):  # a recv blocked in ``run`` returns at once
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._sock_path)

    def close(self) -> None:
        """Stop ``run`` and give up the watch (a sibling takes it within a poll)."""
        with self._closing:  # the watcher and the runtime may both close it
            if self._stop.is_set():
                return
            self._stop.set()
            self._close_socket()
            if self._log_fd is not None:
                os.close(self._log_fd)
                self._log_fd = None
            os.close(self._lock_fd)
            self.leader = False


__all__ = ["LOG_ROTATE", "NodeShare", "change_from_line", "change_to_line", "keys_from_bytes", "keys_to_bytes"]
