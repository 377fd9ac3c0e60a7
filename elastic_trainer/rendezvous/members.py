"""What the live quorum is made of: members, the quorum record, one read of the live keys, the
live keys as a watcher keeps them from its watch's changes (``LiveKeys``), and the probe port that
tells peers a process is gone. No etcd calls here (``rendezvous/quorum.py`` makes them;
``rendezvous/watcher.py`` watches them)."""

from __future__ import annotations

import functools
import json
import socket
import threading
from dataclasses import dataclass, field, fields
from collections.abc import Iterable
from typing import Callable, NamedTuple

StartThread = Callable[..., threading.Thread]
"""``start_thread(name, target, *args, stop=callable) -> Thread``, as ``WorkerRuntime.start_thread``."""


def start_daemon_thread(name: str, target: Callable[..., object], *args: object,
                        stop: Callable[[], None] | None = None) -> threading.Thread:
    """The default ``StartThread``: a plain daemon thread (nobody joins it; ``stop`` is the caller's)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


class LiveExcluded(RuntimeError):
    """This worker is not a member of the quorum that was formed: it may not train or commit."""


class RunFinished(LiveExcluded):
    """The run finished while this worker waited to be admitted (a spare that was not needed).

    Only while a member of the finished quorum still lives: once none does, the finished quorum
    is an earlier job's, and a new launch of the same run id (say with a larger ``--max-steps``)
    starts it over with a cold quorum instead of exiting 0 without training."""


class LiveTimeout(RuntimeError):
    """No quorum could be formed in time (too few nodes, or etcd out of reach)."""


@dataclass(frozen=True)
class Member:
    id: str
    node: str
    local_rank: int
    probe: str  # host:port of the member's probe listener


@dataclass(frozen=True)
class Quorum:
    """One membership of the live group: rank ``i`` is ``members[i]``."""

    q: int
    members: tuple[Member, ...]
    step: int = -1
    source: int = 0
    """The rank whose state the receivers load (one that completed ``step``)."""
    receivers: tuple[int, ...] = ()
    cold: bool = False
    finished: bool = False
    cause: str = ""
    formed_at: float = 0.0

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(m.node for m in self.members))

    def rank_of(self, member_id: str) -> int | None:
        return self._ranks.get(member_id)

    @functools.cached_property
    def _ranks(self) -> dict[str, int]:
        """member id -> rank, built once (a watcher asks at every change; 8,000 members at 1,000 nodes)."""
        ranks: dict[str, int] = {}
        for i, m in enumerate(self.members):
            ranks.setdefault(m.id, i)
        return ranks

    def to_json(self) -> bytes:
        """The whole record (what ``from_json`` reads). Built field by field: ``dataclasses.asdict``
        took 27 ms at 800 members, on the path from a re-form to the siblings of every node; and
        once per quorum (it is immutable; ~8 ms at 8,000 members, written beside every node's view)."""
        return self._json

    @functools.cached_property
    def _json(self) -> bytes:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["members"] = [{"id": m.id, "node": m.node, "local_rank": m.local_rank, "probe": m.probe}
                        for m in self.members]
        d["receivers"] = list(self.receivers)
        return json.dumps(d).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Quorum:
        d = json.loads(data)
        if not isinstance(d, dict) or not isinstance(d.get("q"), int) or not isinstance(d.get("members"), list):
            raise ValueError("the live quorum in etcd is malformed")
        members = tuple(Member(str(m["id"]), str(m["node"]), int(m["local_rank"]), str(m["probe"]))
                        for m in d["members"])
        return cls(q=d["q"], members=members, step=int(d.get("step", -1)), source=int(d.get("source", 0)),
                   receivers=tuple(int(r) for r in d.get("receivers", ())), cold=bool(d.get("cold")),
                   finished=bool(d.get("finished")), cause=str(d.get("cause", "")),
                   formed_at=float(d.get("formed_at", 0.0)))


def probe_dead(address: str, timeout: float = 0.05) -> bool:
    """True when nothing listens at ``address`` any more (connection refused): the process is gone.

    A stopped process still accepts (the kernel completes the handshake), and an unreachable
    host times out: both count as "not provably dead"."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class ProbeListener:
    """A listening socket whose refusal tells peers that this process is gone."""

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


@dataclass
class View:
    """One read of the live keys (from ``LiveKeys.view``: ``alive`` and ``joiners`` are the
    keeper's own, changed by its next update; read them in the thread that updates it)."""

    quorum: Quorum | None
    quorum_rev: int  # mod revision of the quorum key (0: absent)
    alive: set[str]
    joiners: dict[str, tuple[dict, int]]  # id -> (value, create revision)
    reports: dict[str, dict] = field(default_factory=dict)
    stall: dict | None = None  # the stall declared for the quorum asked about, if any
    busy: dict[str, dict] = field(default_factory=dict)  # id -> {"q", "what"}: members in a slow phase
    report_keys: dict[str, dict] = field(default_factory=dict)  # the report keys as read (``reports``: expanded)


class Change(NamedTuple):
    """One change of a key, as an etcd watch delivers it: ``value`` None when it was deleted. A
    named tuple (a first read at 1,000 x 8 makes 8,000 of them per node: a third of the cost of a
    frozen dataclass's)."""

    key: str
    value: bytes | None
    create_revision: int
    mod_revision: int


class LiveKeys:
    """The live keys under ``prefix`` (``quorum``, ``alive/``, ``join/``, ``stall/``, ``busy/``) as a
    watcher knows them: ``load`` a whole read, then ``apply`` the watch's changes in order.

    Each change costs O(1): the watcher no longer reads every key after each one. It also keeps
    ``missing``, the members of the ``track``ed quorum whose alive key is gone (in the order they
    went), so that a watcher asks "is a member lost?" without walking the member list. A quorum
    record (a change from the quorum before, ``rendezvous/quorum_record.py``) that arrives again
    unchanged (the same bytes) is decoded once per process: a simulation runs a thousand watchers
    in one process.
    Not thread-safe: one thread (the watcher's) loads, applies and reads it."""

    _decoded: tuple[bytes, Quorum] | None = None  # the last quorum record decoded in this process

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.quorum: Quorum | None = None
        self.quorum_rev = 0
        self.quorum_record: bytes | None = None
        """The quorum key's value as etcd holds it (what ``node_watch`` hands the node's siblings)."""
        self.alive: set[str] = set()
        self.joiners: dict[str, tuple[dict, int]] = {}
        self.stalls: dict[int, dict] = {}
        self.busy: dict[str, dict] = {}
        self.missing: dict[str, None] = {}
        self.version = 0
        """Bumped by every load and change: what was derived from an older version is stale."""
        self._tracked: Quorum | None = None
        self._ids: dict[str, int] | frozenset[str] = frozenset()
        self._previous: Quorum | None = None  # the quorum before the last whole read
        self.hint: Quorum | None = None
        """A quorum its owner holds (its own): a change record from it is applied without a read."""
        self.fetch_members: Callable[[int], bytes | None] | None = None
        """Reads quorum ``q``'s whole record (``members/<q>``) where a change record's base is not held."""

    def load(self, kvs: Iterable[Change]) -> None:
        """Replace everything by a whole read (each key as a ``Change`` that puts it)."""
        self._previous = self.quorum  # a change record in the read may be from it
        self.quorum, self.quorum_rev, self.quorum_record = None, 0, None
        self.alive, self.joiners, self.stalls, self.busy = set(), {}, {}, {}
        for kv in kvs:
            self.apply(kv)
        self._missing_again()

    def apply(self, change: Change) -> None:
        """One change (a key outside the live keys is ignored). A malformed quorum record raises
        ``ValueError`` (the watcher then reads again, as it would after a failed read)."""
        if not change.key.startswith(self.prefix):
            return
        sub, value = change.key[len(self.prefix):], change.value
        self.version += 1
        if sub == "quorum":
            self.quorum, self.quorum_rev = (None, 0) if value is None else (self._decode(value), change.mod_revision)
            self.quorum_record = value
            return
        kind, _, name = sub.partition("/")
        if kind == "alive":  # its presence is all (no value parsed: 8,000 of them in a first read at 1,000 x 8)
            if value is None:
                self.alive.discard(name)
                if name in self._ids:
                    self.missing[name] = None
            else:
                self.alive.add(name)
                self.missing.pop(name, None)
            return
        parsed = _json_object(value)
        if kind == "join":
            if parsed is None:
                self.joiners.pop(name, None)
            else:
                self.joiners[name] = (parsed, change.create_revision)
        elif kind == "stall" and name.isdigit():
            if parsed is None:
                self.stalls.pop(int(name), None)
            else:
                self.stalls[int(name)] = parsed
        elif kind == "busy":
            if parsed is None:
                self.busy.pop(name, None)
            else:
                self.busy[name] = parsed

    def restore(self, record: bytes | None, quorum_rev: int, alive: set[str],
                joiners: dict[str, tuple[dict, int]], stalls: dict[int, dict], busy: dict[str, dict]) -> None:
        """Replace everything by what another worker kept (its node's watching worker,
        ``rendezvous/node_watch.py``); the quorum record is decoded only when its revision changed."""
        if record is None:
            self.quorum, self.quorum_rev = None, 0
        elif quorum_rev != self.quorum_rev or self.quorum is None:
            self.quorum, self.quorum_rev = self._decode(record), quorum_rev
        self.quorum_record = record
        self.alive, self.joiners, self.stalls, self.busy = alive, joiners, stalls, busy
        self.version += 1
        self._missing_again()

    def track(self, quorum: Quorum) -> None:
        """Keep ``missing`` for ``quorum``'s members (O(members) when the quorum changes, else nothing)."""
        if quorum is not self._tracked:
            self._tracked, self._ids = quorum, quorum._ranks  # its ids, built once per quorum (not per keeper)
            self._missing_again()

    def view(self, q: int) -> View:
        """A ``View`` for quorum ``q``: its stall, and the members busy in it."""
        return View(self.quorum, self.quorum_rev, self.alive, self.joiners, stall=self.stalls.get(q),
                    busy={mid: v for mid, v in self.busy.items() if v.get("q") == q})

    def _missing_again(self) -> None:
        members = self._tracked.members if self._tracked is not None else ()
        self.missing = {m.id: None for m in members if m.id not in self.alive}

    def _decode(self, value: bytes) -> Quorum:
        """The quorum record ``value`` (whole, or a change from a quorum this keeper holds, else
        built on ``fetch_members``: ``rendezvous/quorum_record.py``), decoded once per process."""
        from elastic_trainer.rendezvous.quorum_record import decode

        last = LiveKeys._decoded
        if last is not None and last[0] == value:
            return last[1]
        held = [x for x in (self.quorum, self._previous, self.hint, last[1] if last is not None else None) if x is not None]
        quorum = decode(value, lambda q: next((x for x in held if x.q == q), None), self.fetch_members)
        LiveKeys._decoded = (value, quorum)
        return quorum


def _json_object(value: bytes | None) -> dict | None:
    """``value`` as a JSON object, or None (deleted, not JSON, or not an object)."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


# ---- reading the live keys ------------------------------------------------------------------------------
def range_end(prefix: str) -> bytes:
    import etcd3.utils

    return etcd3.utils.prefix_range_end(prefix.encode())


def range_op(key: str, keys_only: bool = False):
    """etcd's own range request for ``key``, a prefix when it ends with "/" (for ``txns``, which
    sends it as it is: python3-etcd3's ``transaction`` has no ``keys_only``)."""
    from etcd3 import etcdrpc

    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
        key=key.encode(), range_end=range_end(key) if key.endswith("/") else b"", keys_only=keys_only))


def json_values(responses, prefix: str) -> dict[str, dict]:
    """key (less ``prefix``) -> its JSON object, for the values of one range read (others skipped)."""
    out = {}
    for value, meta in responses:
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            out[meta.key.decode()[len(prefix):]] = parsed
    return out


def complete_nodes(view: View) -> list[tuple[str, list[Member]]]:
    """Joiners grouped by node, nodes with all their workers registered, first come first."""
    by_node: dict[str, list[tuple[int, Member]]] = {}
    nproc: dict[str, int] = {}
    for mid, (value, rev) in view.joiners.items():
        if mid not in view.alive:
            continue
        node = str(value.get("node"))
        nproc[node] = int(value.get("nproc", 1))
        by_node.setdefault(node, []).append((rev, Member(mid, node, int(value.get("local_rank", 0)),
                                                         str(value.get("probe", "")))))
    out = []
    for node, items in by_node.items():
        ranks = {m.local_rank for _, m in items}
        if len(items) == nproc[node] and ranks == set(range(nproc[node])):
            out.append((min(r for r, _ in items), node, sorted((m for _, m in items), key=lambda m: m.local_rank)))
    out.sort()
    return [(node, ms) for _, node, ms in out]


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


__all__ = ["Change", "LiveExcluded", "LiveKeys", "LiveTimeout", "Member", "ProbeListener", "Quorum", "RunFinished", "StartThread", "View",
           "complete_nodes", "json_values", "probe_dead", "range_end", "resolvable", "start_daemon_thread"]
