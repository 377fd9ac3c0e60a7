"""Make the collectives in flight on a process group fail now, from another thread.

A survivor blocked in a collective with a peer that stopped answering (frozen, cut off, hung)
waits for the collective timeout (300 s by default): nothing closes the connection. The live
quorum knows sooner (the peer's lease expired, or the ranks agreed it is hung), and its watcher
calls ``GroupAbandon.abandon()``, after which the blocked collective fails as it does when a peer
dies loudly, and the training thread re-forms.

- **NCCL**: ``ProcessGroup.abort()`` (its communicators are aborted; the kernels in flight end
  and the wait raises), what torch's own watchdog does on a timeout.
- **gloo**: ``abort()`` does nothing there (checked on torch 2.13: a blocked all-reduce waited out
  its timeout after it), and a gloo collective cannot be cancelled. But it fails at once when its
  TCP connections close. So the sockets the group opened are recorded while it is made
  (``recording()``: the socket inodes in ``/proc/self/fd`` that appear during
  ``init_process_group``, minus those to etcd) and ``abandon()`` shuts them down
  (``shutdown(SHUT_RDWR)`` on a duplicate of each descriptor: the connection ends, gloo's
  descriptor stays its own to close). The blocked collective then raises "Connection closed by
  peer", the error of a killed peer, and everything after is the loud path. TorchFT instead runs
  its process group in a child process it can kill (``ProcessGroupBaby``): every collective then
  crosses a process boundary; this costs nothing until it is used.

Linux only (``/proc``); elsewhere ``abandon()`` on gloo logs that it cannot and the collective
timeout stays the bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterable, Iterator

import torch.distributed as dist

logger = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> set[int]:
    """The inodes of this process's sockets (empty where ``/proc`` is missing)."""
    out: set[int] = set()
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"{_FD_DIR}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def shut_sockets(inodes: set[int], keep_peers: Iterable[tuple[str, int]] = ()) -> int:
    """Shut down (both directions) this process's TCP connections whose inode is in ``inodes``,
    except those to ``keep_peers``; returns how many. Each descriptor is duplicated first and its
    inode checked on the duplicate, so that a descriptor closed and reused meanwhile is left alone."""
    keep = {(h, int(p)) for h, p in keep_peers}
    done = 0
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return 0
    for fd in fds:
        try:
            dup = os.dup(int(fd))
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino not in inodes:
                os.close(dup)
                continue
            sock = socket.socket(fileno=dup)  # owns dup from here
        except OSError:
            os.close(dup)
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM:
                    continue
                peer = sock.getpeername()
                if (peer[0], peer[1]) in keep:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:  # a listening socket (no peer) or one already closed
                continue
    return done


class GroupAbandon:
    """Abandon the default process group's collectives in flight (see the module docstring).

    ``keep_peers``: (host, port) pairs never shut down (etcd's endpoints: the group's store and
    the quorum's keys go there)."""

    def __init__(self, backend: str, keep_peers: Iterable[tuple[str, int]] = ()) -> None:
        self.backend = backend
        self.keep_peers = tuple(keep_peers)
        self._inodes: set[int] = set()
        self._ahead: set[int] = set()  # the next group's, formed beside this one (a join: group_ahead.py)
        self.groups: list = []
        """NCCL: more groups of the same ranks to abort with the default one (a DeviceMesh's; on gloo
        their sockets are recorded instead: ``recording(add=True)``)."""

    @contextlib.contextmanager
    def recording(self, add: bool = False, ahead: bool = False) -> Iterator[None]:
        """Wrap the group's making: the sockets that appear meanwhile are the group's. ``add``: the
        making of more groups of the same ranks (a DeviceMesh's, a checkpoint's) whose sockets are
        abandoned with the default group's. ``ahead``: the next default group's, made on another
        thread while this one trains (``group_ahead.py``): abandoned with it until ``promote()``
        makes them the group's own, or ``drop_ahead()`` forgets them."""
        before = socket_inodes() if self.backend == "gloo" else set()
        if not add and not ahead:
            self.groups = []  # a new default group: the groups made from the old one are gone
            self._ahead = set()
        try:
            yield
        finally:
            if self.backend == "gloo":
                made = socket_inodes() - before
                if ahead:
                    self._ahead = made
                else:
                    self._inodes = self._inodes | made if add else made

    def promote(self) -> None:
        """The group made ``ahead`` is the default one now: its sockets are the ones to shut."""
        self._inodes, self._ahead, self.groups = self._ahead, set(), []

    def drop_ahead(self) -> None:
        """The group made ``ahead`` is gone unused."""
        self._ahead = set()

    def abandon(self, why: str = "") -> None:
        """From any thread: make the group's collectives in flight fail now."""
        if not dist.is_initialized():
            return
        if self.backend != "gloo":
            for group in [dist.group.WORLD, *self.groups]:
                try:
                    group.abort()
                except Exception as exc:  # noqa: BLE001 - the group may be gone already (re-formed meanwhile)
                    logger.info("live: abort of a process group: %s", exc)
            return
        if not self._inodes:
            logger.warning("live: the gloo group's connections are unknown here (no /proc?); its collectives "
                           "in flight end at --collective-timeout (%s)", why)
            return
        shut = shut_sockets(self._inodes | self._ahead, self.keep_peers)
        logger.info("live: shut %d connection(s) of the gloo group (%s)", shut, why)


__all__ = ["GroupAbandon", "shut_sockets", "socket_inodes"]
