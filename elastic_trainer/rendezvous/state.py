"""The rendezvous state as JSON, and a state holder whose liveness comes from etcd leases.

torch's ``_BackendRendezvousStateHolder`` pickles ``RendezvousState`` into the backend,
so anyone who can write the key can run code in every agent. Here the state is plain
JSON with a fixed schema, checked field by field when read back:

    {"version": 1, "round": 3, "complete": true, "closed": false,
     "deadline": "2026-11-23T07:30:00.123456+00:00" | null,
     "participants": [[{"addr": "h", "pid": 12, "local_id": 0}, 0], ...],
     "wait_list": [{...}], "redundancy_list": [{...}]}

Anything else raises ``RendezvousStateError``. torch's per-node heartbeat timestamps are
not stored: liveness is the lease, and the state machine only needs an entry per node
(``decode_state`` gives every node the time of reading), which halves the state's size.

Liveness: torch's holder drops a node whose heartbeat timestamp (written by that node,
read with the reader's clock) is older than a timeout, so a slow or paused reader can
declare live nodes dead. ``EtcdRendezvousStateHolder`` drops a node only when its
``alive/<node>`` key, attached to the node's etcd lease, is gone: etcd's own clock decided
that the node stopped renewing it. The alive keys are read in the same etcd transaction
as the state, and a node creates its key before it first writes itself into the state,
so a node missing its key was dead at that revision.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone

from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from elastic_trainer.torch_private import (
    NodeDesc,
    RendezvousSettings,
    RendezvousState,
    StateHolder,
    remove_participant_epilogue,
)
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MAX_INT = 2**63 - 1
"""The largest round, rank, pid or local id accepted (etcd's and torch's 64-bit integers)."""
MAX_STATE_BYTES = 4 << 20
"""The largest state accepted: etcd refuses requests over 1.5 MiB by default; a 1,000-node state is
about 53 KB."""
MAX_ADDR_CHARS = 1024
_KEYS = {"version", "round", "complete", "closed", "deadline", "participants", "wait_list",
         "redundancy_list"}


def node_name(node: NodeDesc) -> str:
    """The name of a node in etcd keys: ``<addr>_<pid>_<local_id>`` (torch's repr)."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


def parse_node_name(name: str) -> NodeDesc | None:
    """``node_name``'s inverse (the address may hold ``_``; pid and local id are integers), or None."""
    parts = name.rsplit("_", 2)
    # isascii: int() refuses some characters that str.isdigit() accepts (superscripts).
    if len(parts) != 3 or not 0 < len(parts[0]) <= MAX_ADDR_CHARS or \
            not all(p.isascii() and p.isdigit() and len(p) <= 19 for p in parts[1:]):
        return None
    pid, local_id = int(parts[1]), int(parts[2])
    return NodeDesc(parts[0], pid, local_id) if pid <= MAX_INT and local_id <= MAX_INT else None


def node_json(node: NodeDesc) -> dict:
    return {"addr": node.addr, "pid": node.pid, "local_id": node.local_id}


def _bad(what: str) -> RendezvousStateError:
    return RendezvousStateError(f"The rendezvous state in etcd is not valid elastic-trainer JSON state: "
                                f"{what}. Refusing it; delete the run's keys or use another run id.")


def _int(value, what: str) -> int:
    if type(value) is not int:
        raise _bad(f"{what} must be an integer, got {value!r:.100}")
    if not 0 <= value <= MAX_INT:
        raise _bad(f"{what} must be from 0 to 2**63-1, got {value if abs(value) < 10**30 else 'a huge number'}")
    return value


_NODES: dict[tuple[str, int, int], NodeDesc] = {}
"""Interned node descriptors: every read of a 1,000-node state decodes into the same objects
(a new descriptor per node and read was most of the decoding time)."""
_NODES_MAX = 100_000


def _node(value) -> NodeDesc:
    if type(value) is dict and len(value) == 3:
        addr, pid, local_id = value.get("addr"), value.get("pid"), value.get("local_id")
        if type(addr) is str and 0 < len(addr) <= MAX_ADDR_CHARS and type(pid) is int and 0 <= pid <= MAX_INT \
                and type(local_id) is int and 0 <= local_id <= MAX_INT:
            key = (addr, pid, local_id)
            node = _NODES.get(key)
            if node is None:
                if len(_NODES) >= _NODES_MAX:
                    _NODES.clear()
                node = _NODES.setdefault(key, NodeDesc(addr, pid, local_id))
            return node
    if not isinstance(value, dict) or set(value) != {"addr", "pid", "local_id"}:
        raise _bad(f"a node must be {{addr, pid, local_id}}, got {value!r:.200}")
    if not isinstance(value["addr"], str) or not 0 < len(value["addr"]) <= MAX_ADDR_CHARS:
        raise _bad(f"a node addr must be a string of 1 to {MAX_ADDR_CHARS} characters, got {value['addr']!r:.100}")
    _int(value["pid"], "a node pid")
    _int(value["local_id"], "a node local_id")
    raise _bad(f"a node must be {{addr, pid, local_id}}, got {value!r:.200}")


def _time(value) -> datetime:
    if not isinstance(value, str):
        raise _bad(f"a time must be an ISO string, got {value!r:.100}")
    try:
        t = datetime.fromisoformat(value)
    except ValueError as exc:
        raise _bad(f"{value!r:.100} is not an ISO time") from exc
    if t.tzinfo is None:
        raise _bad(f"time {value!r} has no time zone")
    return t


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise _bad(f"{what} must be a list, got {type(value).__name__}")
    return value


def encode_state(state: RendezvousState) -> bytes:
    """``RendezvousState`` -> JSON bytes (sorted, so equal states encode equally)."""
    doc = {
        "version": SCHEMA_VERSION,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "deadline": state.deadline.isoformat() if state.deadline is not None else None,
        "participants": [[node_json(n), r] for n, r in sorted(state.participants.items())],
        "wait_list": [node_json(n) for n in sorted(state.wait_list)],
        "redundancy_list": [node_json(n) for n in sorted(state.redundancy_list)],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def encode_summary(state: RendezvousState) -> bytes:
    """What waiting and training nodes watch instead of the whole state:
    ``b"<round> <complete> <closed> <participants> <waiting>"`` (counts of nodes).

    Written with every state write (same transaction), so a node that waits for a round to
    complete, or checks that its round still stands, polls a few bytes instead of the
    state of every node.
    """
    return (f"{state.round} {int(state.complete)} {int(state.closed)} "
            f"{len(state.participants)} {len(state.wait_list)}").encode()


def decode_summary(data: bytes | None) -> tuple[int, ...] | None:
    """``encode_summary``'s numbers, or None when missing or not a summary."""
    try:
        numbers = tuple(int(x) for x in (data or b"").split())
    except ValueError:
        return None
    return numbers if len(numbers) == 5 else None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_state(data: bytes) -> RendezvousState:
    """JSON bytes -> ``RendezvousState``; anything unexpected raises ``RendezvousStateError``."""
    if len(data) > MAX_STATE_BYTES:
        raise _bad(f"{len(data)} bytes, more than the {MAX_STATE_BYTES} a state may have")
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except RecursionError as exc:  # deep nesting: a state is 4 levels deep
        raise _bad("nested too deeply") from exc
    except ValueError as exc:  # not JSON, not UTF-8, NaN/Infinity, an integer of thousands of digits
        raise _bad(f"not JSON ({str(exc)[:200]})") from exc
    if not isinstance(doc, dict):
        raise _bad(f"the top level must be an object, got {type(doc).__name__}")
    if set(doc) != _KEYS:
        raise _bad(f"fields {sorted(set(doc) ^ _KEYS)} are missing or unexpected")
    if type(doc["version"]) is not int or doc["version"] != SCHEMA_VERSION:
        raise _bad(f"schema version {doc['version']!r:.100}, this code reads {SCHEMA_VERSION}")
    state = RendezvousState()
    state.round = _int(doc["round"], "round")
    for name in ("complete", "closed"):
        if type(doc[name]) is not bool:
            raise _bad(f"{name} must be true or false, got {doc[name]!r:.100}")
        setattr(state, name, doc[name])
    state.deadline = None if doc["deadline"] is None else _time(doc["deadline"])
    participants = state.participants
    for item in _list(doc["participants"], "participants"):
        if type(item) is not list or len(item) != 2:
            raise _bad(f"a participant must be [node, rank], got {item!r:.200}")
        rank = item[1]
        participants[_node(item[0])] = rank if type(rank) is int and 0 <= rank <= MAX_INT else _int(rank, "a rank")
    state.wait_list = {_node(n) for n in _list(doc["wait_list"], "wait_list")}
    state.redundancy_list = {_node(n) for n in _list(doc["redundancy_list"], "redundancy_list")}
    now = datetime.now(timezone.utc)
    state.last_heartbeats = {n: now for n in (*state.participants, *state.wait_list, *state.redundancy_list)}
    return state


def remove_dead_nodes(state: RendezvousState, alive: frozenset[str], settings: RendezvousSettings) -> list[NodeDesc]:
    """Drop every node whose lease key is not in ``alive``; return the dropped ones."""
    nodes = set(state.participants) | state.wait_list | state.redundancy_list | set(state.last_heartbeats)
    dead = sorted(n for n in nodes if node_name(n) not in alive)
    participant_removed = False
    for node in dead:
        state.last_heartbeats.pop(node, None)
        if state.participants.pop(node, None) is not None:
            participant_removed = True
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
    if participant_removed:
        remove_participant_epilogue(state, settings)
    return dead


def _copy(state: RendezvousState) -> RendezvousState:
    """A copy that the state machine may change (node descriptors are immutable)."""
    new = RendezvousState()
    new.round, new.complete, new.deadline, new.closed = state.round, state.complete, state.deadline, state.closed
    new.participants = dict(state.participants)
    new.wait_list = set(state.wait_list)
    new.redundancy_list = set(state.redundancy_list)
    new.last_heartbeats = dict(state.last_heartbeats)
    return new


class EtcdRendezvousStateHolder(StateHolder):
    """Keeps the local copy of the rendezvous state in sync with etcd, as JSON.

    Args:
        backend: the etcd backend.
        settings: the rendezvous settings.
        cache_duration: seconds a plain ``sync()`` (no local changes) may serve the last
            state without asking etcd; ``sync(use_cache=False)`` always asks.
    """

    def __init__(self, backend: EtcdRendezvousBackend, settings: RendezvousSettings,
                 cache_duration: float = 1.0) -> None:
        self._backend = backend
        self._settings = settings
        self._cache_duration = cache_duration
        self._state = RendezvousState()
        self._token = None
        self._dirty = False
        self._last_sync_time = -1.0
        self._pristine: tuple[object, RendezvousState] | None = None  # decoded state by token
        self.alive: frozenset[str] = frozenset()
        """Names of the nodes with a live lease key, as of the last sync."""
        self.joining: list[NodeDesc] = []
        """Live nodes that wait to join a round (their ``joining/`` keys), as of the last sync."""
        self._joining_parsed: dict[str, NodeDesc | None] = {}
        self._sources: tuple = (None, None)  # the backend objects alive and joining were made from
        self.exact_joining = True
        """Whether syncs must read ``joining`` exactly; when False it may keep nodes whose
        joining keys were deleted (cheaper; see ``etcd_backend._Members``)."""
        self.light = False
        """Whether plain syncs may be *light*: the state without the member lists (see ``sync``)."""
        self.last_light = False
        """Whether the last sync was light: ``alive`` and ``joining`` are then as an earlier sync
        left them, and ``alive_count`` and ``first_joining`` are current."""
        self.alive_count = 0
        """How many nodes held a live lease key at the last sync."""
        self.first_joining: str | None = None
        """After a light sync: the smallest name waiting to join (None when none)."""
        self.tolerate_short = False
        """Whether a light sync of an open round stands although fewer nodes are alive than the state
        names (``light_short``): a node that waits to be admitted leaves the dead to the admitter,
        which syncs exactly, and reads exactly only before it writes (``admission.py``)."""
        self.light_short = False
        """After a light sync: fewer nodes were alive than the state names (one of them is dead)."""

    @property
    def backend(self) -> EtcdRendezvousBackend:
        """The etcd backend this holder syncs through (the operation loop publishes ranks with it)."""
        return self._backend

    @property
    def joining_exact(self) -> bool:
        """Whether ``joining`` is exactly the joining keys etcd held at the last sync."""
        return self._backend.joining_exact

    @property
    def state(self) -> RendezvousState:
        return self._state

    def mark_dirty(self) -> None:
        self._dirty = True

    def sync(self, use_cache: bool = True) -> bool | None:
        """Write the local state if it changed (compare-and-swap), else read it; then drop the
        nodes whose lease keys are gone.

        A *light* sync (``light`` set, nothing to write) reads the state with the number of live
        nodes and the smallest name waiting to join instead of both member lists: a few bytes
        instead of O(nodes), so N waiting nodes no longer read O(N^2) in all. It is what the nodes
        that do not admit need (the admitter is the smallest name waiting; ``handler.py``). Its
        check of the state's nodes is by count: when fewer nodes are alive than the state names,
        one of them is dead and the sync reads both lists whole, exactly as a plain sync (a dead
        node is removed where it matters: by the admitter, which always syncs exactly, and by any
        node that can count the loss). A loss hidden by a newcomer's lease in the same count is
        left to the admitter and to the membership watchdog. With ``tolerate_short`` an open round's
        light sync stands even then (``light_short`` says so): the node only waits to be admitted,
        and N waiting nodes each reading both lists at every lost lease was the O(N^2) that turned
        a few lost leases into hundreds at 1,000 agents."""
        if self.light and not self._dirty and not (
                use_cache and self._cache_duration > 0 and
                self._last_sync_time >= max(time.monotonic() - self._cache_duration, 0)):
            if self._sync_light():
                return None
        self.last_light = False
        state_bits = None
        token = None
        if self._dirty:
            has_set: bool | None = False
            response = self._backend.set_state(encode_state(self._state), self._token,
                                               summary=encode_summary(self._state),
                                               exact_joining=self.exact_joining)
            if response is not None:
                state_bits, token, has_set = response
        else:
            has_set = None
            if use_cache and self._cache_duration > 0 and \
                    self._last_sync_time >= max(time.monotonic() - self._cache_duration, 0):
                return None
            response = self._backend.get_state(self.exact_joining)
            if response is not None:
                state_bits, token = response
        if state_bits is None:
            self._state = RendezvousState()
        else:
            if self._pristine is None or self._pristine[0] != token:
                self._pristine = (token, decode_state(state_bits))
            self._state = _copy(self._pristine[1])
        self._token = token
        self._dirty = False
        self._last_sync_time = time.monotonic()
        self.refresh_membership()
        self.alive_count = len(self.alive)
        dead = remove_dead_nodes(self._state, self.alive, self._settings)
        if dead:
            logger.info("rendezvous %r: removing node(s) %s, their etcd leases ended",
                        self._settings.run_id, ", ".join(map(node_name, dead)))
        return has_set

    def _sync_light(self) -> bool:
        """A light read (see ``sync``); False when its count says a node of the state is dead."""
        response = self._backend.get_state(self.exact_joining, light=True)
        if response is None:
            state, token = RendezvousState(), None
        else:
            state_bits, token = response
            if self._pristine is None or self._pristine[0] != token:
                self._pristine = (token, decode_state(state_bits))
            state = self._pristine[1]
        count = self._backend.light_alive_count
        self.light_short = count < len(state.participants) + len(state.wait_list) + len(state.redundancy_list)
        if self.light_short and not (self.tolerate_short and not state.complete and not state.closed):
            return False
        self._state = _copy(state) if response is not None else state
        self._token = token
        self._last_sync_time = time.monotonic()
        self.alive_count, self.first_joining, self.last_light = count, self._backend.light_first_joining, True
        return True

    def refresh_membership(self) -> None:
        """``alive`` and ``joining`` from the backend's last read (the state is left as it is)."""
        sources = (self._backend.last_alive, self._backend.last_joining)
        if sources[0] is self._sources[0] and sources[1] is self._sources[1]:
            return  # nothing new was read (the backend keeps the same objects)
        self._sources = sources
        self.alive = self._backend.last_alive or frozenset()
        self.joining = []
        parsed = {}
        for name in sorted(self._backend.last_joining):
            node = self._joining_parsed.get(name, False)  # parsed once per key, not per poll
            if node is False:
                node = parse_node_name(name)
                if node is None:
                    logger.warning("ignoring the malformed joining key of %r in etcd", name)
            parsed[name] = node
            if node is not None and name in self.alive:
                self.joining.append(node)
        self._joining_parsed = parsed
