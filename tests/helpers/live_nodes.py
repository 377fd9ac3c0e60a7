"""Live groups built as ``elastic-train`` runs them: each node an agent that keeps the node's etcd
lease and records its renewals, and the node's workers (``LiveGroup``s) with their keys on it.

    with live_nodes(etcd, run_id, nodes=3) as nodes:         # 3 nodes of 1 worker, joined, watching
        q = nodes.groups[0].reform(7, "test")

``NodeAgent`` is the agent's side as ``rendezvous/handler.py`` builds it (a ``LeaseKeeper`` with
an ``AgentRecord``); ``pause()`` stops its renewals as SIGSTOP would. Everything made is closed at
the end, also on failure.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from elastic_trainer.env import LiveSettings
from elastic_trainer.live.group import LiveGroup
from elastic_trainer.live.threads import start_in_runtime
from elastic_trainer.rendezvous.lease import LeaseKeeper
from elastic_trainer.rendezvous.node_lease import AgentRecord
from tests.helpers.common import etcd_conn, holds_within


class NodeAgent:
    """A node's agent: its lease (``ttl``, renewed every ``interval``) with the renewal record its workers read."""

    def __init__(self, etcd, run_id: str, node: str, ttl: int = 3, interval: float = 1.0) -> None:
        self.conn = etcd_conn(etcd)
        self.record = AgentRecord()
        self.keeper = LeaseKeeper(self.conn, f"/{run_id}/alive/{node}", ttl=ttl, interval=interval,
                                  on_renewed=self.record)
        self.keeper.ensure()
        self.lease_id: int = self.keeper.lease_id

    def pause(self) -> None:
        """What SIGSTOP does to its renewals: they stop, and the lease is left to expire."""
        self.keeper.close(revoke=False)

    def close(self) -> None:
        self.keeper.close(revoke=True)
        self.record.close()
        self.conn.close()


class Threads:
    """A ``start_thread`` that keeps each thread's ``stop`` by name, as a worker's runtime does, so
    that a test can stop a group's threads (``stop``) the way its runtime would at exit."""

    def __init__(self) -> None:
        self.stops: dict[str, list] = {}

    def __call__(self, name: str, target, *args, stop=None) -> threading.Thread:
        self.stops.setdefault(name, []).append(stop)
        return start_in_runtime(name, target, *args, stop=stop)

    def stop(self, *names: str) -> None:
        for name in names:
            for stop in self.stops.get(name, ()):
                if stop is not None:
                    stop()


def settings(**overrides) -> LiveSettings:
    """Live settings for a few in-process nodes: admitted at once, a 3 s lease."""
    return LiveSettings(**{"min_nodes": 1, "max_nodes": 3, "last_call": 0.0, "join_timeout": 20, "lease_ttl": 3,
                           "keep_alive_interval": 1.0, **overrides})


def group(etcd, run_id: str, agent: NodeAgent, node: str, local_rank: int = 0, nproc: int = 1,
          live: LiveSettings | None = None, **options) -> LiveGroup:
    """Worker ``local_rank`` of ``nproc`` on ``node``, its keys on ``agent``'s lease (its own
    connection); ``options``: ``LiveGroup.make``'s (``start_thread``, the callbacks)."""
    return LiveGroup.make(etcd_conn(etcd), f"/{run_id}/", node, local_rank, nproc, "127.0.0.1",
                          live or settings(), agent.lease_id, **options)


def join_and_watch(groups: list[LiveGroup], timeout: float = 10.0) -> list[LiveGroup]:
    """``groups`` join one quorum of them all at once (``join`` starts their watchers); returned in
    member order once every watcher has its first view (read, or loaded from its node's)."""
    threads = [threading.Thread(target=g.join, daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g.quorum is not None and g.quorum.world_size == len(groups) for g in groups), \
        "every group must join one quorum of them all"
    assert holds_within(lambda: all(g.watcher.keeper.reads + g.watcher.keeper.loads >= 1 for g in groups), timeout), \
        "every watcher's first view"
    order = [m.id for m in groups[0].quorum.members]
    return sorted(groups, key=lambda g: order.index(g.id))


class Nodes:
    """What ``live_nodes`` made: ``groups`` (in member order once joined), each node's ``agents``,
    and each group's ``threads`` (by member id)."""

    def __init__(self) -> None:
        self.groups: list[LiveGroup] = []
        self.agents: dict[str, NodeAgent] = {}
        self.threads: dict[str, Threads] = {}

    def agent_of(self, g: LiveGroup) -> NodeAgent:
        return self.agents[g.me.node]

    def freeze(self, g: LiveGroup) -> None:
        """``g``'s node stops as under SIGSTOP: its agent's renewals, the worker's stand-in renewal
        and its watcher stop; its keys stay until the node's lease expires; its probe port accepts."""
        self.agent_of(g).pause()
        self.threads[g.id].stop("node-lease", "live-watch")

    def kill(self, g: LiveGroup) -> None:
        """``g``'s process is gone, its node's agent alive: its watcher stops, its probe port refuses,
        its keys stay on the node's lease."""
        self.threads[g.id].stop("live-watch", "live-probe")

    def close(self) -> None:
        for g in self.groups:
            with contextlib.suppress(Exception):  # a group a test broke on purpose
                g.close()
            g.conn.close()
        for agent in self.agents.values():
            with contextlib.suppress(Exception):
                agent.close()


@contextlib.contextmanager
def live_nodes(etcd, run_id: str, nodes: int = 3, workers: int = 1, join: bool = True, callbacks: dict | None = None,
               **overrides) -> Iterator[Nodes]:
    """``nodes`` nodes of ``workers`` workers each (``node0``, ``node1``, ...), each node on its
    agent's lease; with ``join``, joined into one quorum (formed once every node is in) and watching.
    ``callbacks``: ``LiveGroup.make``'s (``on_member_lost``, ...); ``overrides``: ``LiveSettings`` fields."""
    callbacks = callbacks or {}
    live = settings(**{"max_nodes": nodes, "last_call": 10.0, **overrides})
    made = Nodes()
    try:
        for n in range(nodes):
            node = f"node{n}"
            agent = made.agents[node] = NodeAgent(etcd, run_id, node, ttl=int(live.lease_ttl),
                                                  interval=live.keep_alive_interval)
            for r in range(workers):
                threads = Threads()
                g = group(etcd, run_id, agent, node, r, workers, live, start_thread=threads, **callbacks)
                made.groups.append(g)
                made.threads[g.id] = threads
        if join:
            made.groups = join_and_watch(made.groups)
        yield made
    finally:
        made.close()


class CutProxy:
    """A loopback TCP proxy to ``host:port`` whose ``cut()`` ends the connections open through it
    (as a network cut or a restart of the server's side does; new ones go through again): a watch
    stream on it fails and is opened again. ``endpoint``: its ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="cut-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self._target)
            except OSError:
                return
            with self._lock:
                self._open += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            cut, self._open = self._open, []
        for sock in cut:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        self.cut()
