"""A member's probe port: a listening socket whose refusal tells its peers that its process is gone.

etcd's lease says a node is gone only ``lease_ttl`` after its last renewal, and a worker killed
alone leaves its keys on its node's lease until its agent starts the next one. A killed process's
listening socket, though, is closed by the kernel at once: a connection to it is refused. So every
member listens on a port of its own (``ProbeListener``; the address is in its ``Member`` record)
and its peers ask (``probe_dead``) where waiting costs: a re-form's backups probe the proposer
ahead of them, the proposer the members that have not reported, the group's store the members of
a group being formed (``live/group_store.py``), and on NCCL the watcher one member per node.

A stopped process still accepts (the kernel completes the handshake) and an unreachable host times
out: both count as "not provably dead", and the lease decides. ``Prober`` spreads the probes of
a long list over several looks (``limit`` per look, in turn): at 1,000 nodes of 8 a look would
otherwise open 8,000 connections.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from elastic_trainer.live.quorum import Member
from elastic_trainer.live.threads import StartThread


def probe_dead(address: str, timeout: float = 0.05) -> bool:
    """True when nothing listens at ``address`` any more (connection refused): the process is gone."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class ProbeListener:
    """This process's probe port on ``host`` (an ephemeral port), accepting and closing at once
    in the ``live-probe`` thread; ``close()`` ends it."""

    def __init__(self, host: str, start_thread: StartThread) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self._closed = False
        start_thread("live-probe", self._run, stop=self.close)

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Prober:
    """Probes the members of a list in turn, ``limit`` a look (all of them where there are fewer)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._turn = 0

    def dead(self, members: Sequence[Member]) -> set[str]:
        """The ids among the next ``limit`` of ``members`` (from where the last look stopped)
        whose probe port refuses."""
        if not members:
            return set()
        start = self._turn % len(members)
        batch = (list(members[start:]) + list(members[:start]))[:self.limit]
        self._turn = start + len(batch)
        return {m.id for m in batch if probe_dead(m.probe)}


def resolvable(host: str) -> str:
    """An address this host can bind to for the probe listener (the node's address, else loopback)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return "127.0.0.1"
    for family, *_rest, sockaddr in infos:
        addr = sockaddr[0]
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            continue
    return "127.0.0.1"


__all__ = ["ProbeListener", "Prober", "probe_dead", "resolvable"]
