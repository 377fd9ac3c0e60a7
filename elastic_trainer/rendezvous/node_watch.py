"""One etcd watch per node: the first worker of a node to lock it keeps the watch, its siblings read its views.

Each worker's live watcher (``rendezvous/watcher.py``) needs a current view of the live keys (the
quorum, who is alive, who waits to join, a declared stall, who is busy). With a watch stream per
worker, a node of 8 GPUs held 8 streams and, after every change, made 8 identical reads. Under one
lease per node (``rendezvous/node_lease.py``) the node's workers also share a directory beside the
lease's renewal record, and through it one watch:

- **The watching worker** is the one that holds ``watch.lock`` (``flock``, held for the life of the
  process: the kernel releases it when the process dies, however it dies). Its watcher keeps the
  etcd watch and reads on each change as before, then ``publish``es the view: ``view.json``
  written whole and renamed into place, and one datagram to each sibling's socket in the directory.
- **A sibling** keeps no stream. Its ``run`` thread waits on its own datagram socket: each datagram
  calls ``on_change``, and the sibling's watcher loads the published view (``load``) instead of reading etcd. It tries the lock at every
  poll: when the watching worker is gone, a sibling takes the lock within a poll and ``on_promote``
  makes its watcher open the watch and read (the read after the watch is established sees every
  change, as ``live_watch.py`` explains).
- What is published is every live key the watching worker knows (``keys_to_bytes``: one JSON line,
  then the quorum record as etcd holds it), not a view for its own quorum: a sibling that re-formed
  a moment before it serves itself from it, and decodes the quorum record only when it changed. No
  view published yet (the start), or none as new as the sibling's quorum within a second, makes the
  sibling read etcd itself once (as every worker did before): correct, only dearer. (A view for the
  publisher's quorum used to send every sibling of a re-form to etcd: the watching worker adopts
  the new quorum a moment after its siblings, and 100 nodes x 8 made ~700 whole reads per re-form.)

A sibling never concludes from a published view that its own key is gone (the view may predate its
key); the watching worker's own reads, the node's lease record and ``LiveGroup.check_lease`` say that.
The directory is the user's own (mode 0700, owner checked); where it cannot be made, every worker
keeps its own watch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
from collections.abc import Callable

from elastic_trainer.rendezvous.members import LiveKeys

logger = logging.getLogger(__name__)


def keys_to_bytes(keys: LiveKeys) -> bytes:
    """What the watching worker knows (``keys``), as the bytes a sibling's ``keys_from_bytes``
    loads: one JSON line (everything but the quorum), then the quorum record as etcd holds it."""
    header = json.dumps({
        "version": keys.version, "quorum_rev": keys.quorum_rev, "alive": sorted(keys.alive),
        "joiners": {k: [v, rev] for k, (v, rev) in keys.joiners.items()},
        "stalls": {str(q): v for q, v in keys.stalls.items()}, "busy": keys.busy}).encode()
    return header + b"\n" + (keys.quorum_record or b"")


def keys_from_bytes(keys: LiveKeys, data: bytes) -> None:
    """Make ``keys`` what ``keys_to_bytes`` wrote (the quorum record is decoded only when its
    revision is not the one ``keys`` has: once per re-form, not once per view). ``ValueError``
    when the bytes are not such a view."""
    header, _, record = data.partition(b"\n")
    try:
        d = json.loads(header)
        keys.restore(record or None, int(d["quorum_rev"]), set(d["alive"]),
                     {k: (v, int(rev)) for k, (v, rev) in d["joiners"].items()},
                     {int(q): v for q, v in d["stalls"].items()}, dict(d["busy"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"the node's published view is malformed ({exc!r})") from exc


class NodeWatch:
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
    def publish(self, keys: LiveKeys) -> None:
        """Make what ``keys`` holds the node's current view and wake the siblings (with its
        quorum's whole record beside it, once per quorum, for a sibling that does not hold the
        quorum the record is a change from: ``members``)."""
        if keys.quorum is not None and keys.quorum.q != self._members_q:
            self._write(f"members-{keys.quorum.q}.json", keys.quorum.to_json())
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.dir, f"members-{self._members_q}.json"))
            self._members_q = keys.quorum.q
        self._write("view.json", keys_to_bytes(keys))
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
    def load(self, keys: LiveKeys) -> bool:
        """Make ``keys`` the view the watching worker published last; False when there is none
        (or it cannot be read: ``keys`` is then unchanged or, if it was malformed, emptied)."""
        try:
            with open(os.path.join(self.dir, "view.json"), "rb") as f:
                data = f.read()
            keys_from_bytes(keys, data)
            return True
        except (OSError, ValueError) as exc:
            logger.debug("live: no published view (%s)", exc)
            return False

    def members(self, q: int) -> bytes | None:
        """Quorum ``q``'s whole record as the watching worker wrote it beside its view, or None."""
        try:
            with open(os.path.join(self.dir, f"members-{q}.json"), "rb") as f:
                return f.read()
        except OSError:
            return None

    def run(self) -> None:
        """A sibling's thread: wake the watcher on each published view; take the watch when free."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._sock_path)
        self._sock.bind(self._sock_path)
        self._sock.settimeout(self._poll)
        try:
            while not self._stop.is_set():
                try:
                    self._sock.recv(16)
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
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._sock_path)

    def close(self) -> None:
        """Stop ``run`` and give up the watch (a sibling takes it within a poll)."""
        with self._closing:  # the watcher and the runtime may both close it
            if self._stop.is_set():
                return
            self._stop.set()
            os.close(self._lock_fd)
            self.leader = False


__all__ = ["NodeWatch", "keys_from_bytes", "keys_to_bytes"]
