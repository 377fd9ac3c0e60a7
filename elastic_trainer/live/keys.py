"""The live keys of a run in etcd, and the transactions that read, change and fence them.

Every live worker of a run keeps its state under ``<run prefix>live/``, in one etcd, and nowhere
else (no process hosts a single point of failure):

- ``quorum``: the current quorum, written as the change from the quorum it replaces, with the
  whole record beside it in ``members/<q>`` (``live/quorum.py``); it changes only by
  compare-and-swap on its mod revision (``cas_quorum``), so there is one quorum at a time;
- ``alive/<id>``: a worker is alive while this key lives, on its node's lease
  (``live/worker_lease.py``); a worker that leaves cleanly writes ``{"left": ...}`` into it before
  it deletes it, so that the others tell a departure from a loss;
- ``join/<id>``: a worker that waits to be admitted (a newcomer, or a cold start);
- ``report/<q>/<id>``: a member's report for the re-form into quorum ``q`` (the step it completed),
  or ``report/<q>/@<node>``: a node's, for all its members (``live/node_report.py``);
- ``stall/<q>`` and ``busy/<id>``: a declared hang of quorum ``q``, and the members in a slow phase;
- ``store/<q>/``: the torch ``Store`` of quorum ``q``'s process group (``live/group_store.py``).

``LiveKeys`` makes every request on them, and counts it (``requests``): one transaction reads what
a re-form needs (``read``, a ``View``), one reads what a watcher follows (``read_watched``), one
compare-and-swap writes the next quorum, and ``guard`` returns the fencing token a checkpoint
commit is written under (the quorum key unchanged, the member's ``alive`` key the same key).
The watcher follows the same keys by their changes (``Change``, ``live/mirror.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import etcd3.utils
from etcd3 import etcdrpc

from elastic_trainer.live import node_report
from elastic_trainer.live.quorum import MEMBERS, Member, Quorum, decode, encode, held_by, record_q

if TYPE_CHECKING:
    from elastic_trainer.etcd.client import EtcdConnection
    from elastic_trainer.rendezvous.round_fence import Guard

WATCHED = ("quorum", "alive/", "join/", "stall/", "busy/")
"""The live keys a watcher follows (read whole when its watch is established, then by their changes)."""

LEFT_MARK = b'"left"'
"""In an ``alive/<id>`` value: the worker left cleanly (``WorkerLease.close``), its key goes next."""


class Change(NamedTuple):
    """One change of a key, as an etcd watch delivers it: ``value`` None when it was deleted. A
    named tuple (a first read at 1,000 x 8 makes 8,000 of them per node: a third of the cost of a
    frozen dataclass's)."""

    key: str
    value: bytes | None
    create_revision: int
    mod_revision: int


@dataclass
class View:
    """One look at the live keys (a read, or ``Mirror.view``: then ``alive`` and ``joiners`` are
    the mirror's own, changed by its next update; read them in the thread that updates it)."""

    quorum: Quorum | None
    quorum_rev: int  # mod revision of the quorum key (0: absent)
    alive: set[str]
    joiners: dict[str, tuple[dict, int]]  # id -> (value, create revision)
    reports: dict[str, dict] = field(default_factory=dict)  # by member id (a node's report expanded)
    stall: dict | None = None  # the stall declared for the quorum asked about, if any
    busy: dict[str, dict] = field(default_factory=dict)  # id -> {"q", "what"}: members in a slow phase
    left: frozenset[str] | set[str] = frozenset()  # ids whose alive key said they left cleanly

    def complete_nodes(self) -> list[tuple[str, list[Member]]]:
        """Joiners grouped by node, nodes with all their workers registered and alive, first come first."""
        by_node: dict[str, list[tuple[int, Member]]] = {}
        nproc: dict[str, int] = {}
        for mid, (value, rev) in self.joiners.items():
            if mid not in self.alive:
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


def range_op(key: str, keys_only: bool = False) -> etcdrpc.RequestOp:
    """etcd's own range request for ``key``, a prefix when it ends with "/" (for ``txns``, which
    sends it as it is: python3-etcd3's ``transaction`` has no ``keys_only``)."""
    end = etcd3.utils.prefix_range_end(key.encode()) if key.endswith("/") else b""
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key.encode(), range_end=end, keys_only=keys_only))


def json_objects(kvs: Iterable[Any], prefix: str) -> dict[str, dict]:
    """key (less ``prefix``) -> its JSON object, for the key-values of one raw range answer
    (values that are not JSON objects skipped)."""
    out = {}
    for kv in kvs:
        try:
            parsed = json.loads(kv.value)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            out[kv.key.decode()[len(prefix):]] = parsed
    return out


class LiveKeys:
    """The live keys of the run under ``run_prefix`` (see the module docstring), over ``conn``."""

    def __init__(self, conn: EtcdConnection, run_prefix: str) -> None:
        self.conn = conn
        self.prefix = run_prefix.rstrip("/") + "/live/"
        self.requests = 0
        """Requests made to etcd so far."""
        self._decoded: tuple[int, Quorum] | None = None  # (mod revision, quorum) of the last record decoded

    def key(self, sub: str) -> str:
        return self.prefix + sub

    def call(self, fn: Callable, what: str, retry_timeout: float | None = None) -> Any:
        """``conn.call(fn)``, counted (``retry_timeout``: the connection's own when None)."""
        self.requests += 1
        return self.conn.call(fn, f"live {what}", retry_timeout=retry_timeout)

    def _txn(self, ops: list, what: str) -> list:
        """One transaction of range requests sent as etcd's own request: the key-values of each."""
        request = etcdrpc.TxnRequest(success=ops)
        response = self.call(lambda c: c.txns([request])[0], what)
        return [op.response_range.kvs for op in response.responses]

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, report_q: int | None = None, stall_q: int | None = None, held: Quorum | None = None) -> View:
        """One transaction: the quorum, the leases, the joiners, and (when asked) the reports for
        quorum ``report_q``, and the stall declared for quorum ``stall_q`` with the busy members.
        The ``alive`` keys come without their values (a proposer's look at 1,000 nodes of 8 reads
        8,000 of them). ``held``: the quorum the reader holds (a change record from it is decoded
        without a request)."""
        p = self.prefix
        ops = [range_op(p + "quorum"), range_op(p + "alive/", keys_only=True), range_op(p + "join/")]
        if report_q is not None:
            ops.append(range_op(f"{p}report/{report_q}/"))
        if stall_q is not None:
            ops += [range_op(f"{p}stall/{stall_q}"), range_op(p + "busy/")]
        ranges = self._txn(ops, "read")
        quorum, rev = None, 0
        if ranges[0]:
            kv = ranges[0][0]
            quorum, rev = self.decode_quorum(kv.value, kv.mod_revision, held), kv.mod_revision
        n = len(p + "alive/")
        alive = {kv.key[n:].decode() for kv in ranges[1]}
        joiners = {}
        for kv in ranges[2]:
            try:
                joiners[kv.key.decode()[len(p + "join/"):]] = (json.loads(kv.value), kv.create_revision)
            except ValueError:
                continue
        view = View(quorum, rev, alive, joiners)
        rest = ranges[3:]
        if report_q is not None:
            view.reports = node_report.expand(json_objects(rest[0], f"{p}report/{report_q}/"))
            rest = rest[1:]
        if stall_q is not None:
            view.stall = next(iter(json_objects(rest[0], f"{p}stall/").values()), None)
            view.busy = {mid: v for mid, v in json_objects(rest[1], p + "busy/").items() if v.get("q") == stall_q}
        return view

    def read_reports(self, q: int | None = None) -> dict[str, dict]:
        """The report keys for quorum ``q`` (less ``report/<q>/``), or with None every report key
        (less ``report/``), as they are (a node's report not expanded)."""
        prefix = f"{self.prefix}report/" + ("" if q is None else f"{q}/")
        return json_objects(self._txn([range_op(prefix)], "report read")[0], prefix)

    def read_watched(self) -> list[Change]:
        """Every key a watcher follows (``WATCHED``), in one transaction, as changes that put them
        (key-values read from etcd's response as they are: python-etcd3's ``transaction`` wraps
        each in a metadata object, half of a first read's cost at 8,000 keys)."""
        ranges = self._txn([range_op(self.key(k)) for k in WATCHED], "watched read")
        return [Change(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision) for kvs in ranges for kv in kvs]

    def members_of(self, q: int) -> bytes | None:
        """Quorum ``q``'s whole record (``members/<q>``), or None when it is gone."""
        got, _ = self.call(lambda c: c.get(self.key(f"{MEMBERS}{q}")), "quorum members read")
        return got

    def decode_quorum(self, value: bytes, rev: int, held: Quorum | None = None) -> Quorum:
        """The quorum key's record read at mod revision ``rev`` (a change from ``held`` or from the
        last quorum decoded, or built on ``members/<q>``), decoded once per revision."""
        if self._decoded is not None and self._decoded[0] == rev:
            return self._decoded[1]
        last = self._decoded[1] if self._decoded is not None else None
        quorum = decode(value, held_by(held, last), self.members_of)
        self._decoded = (rev, quorum)
        return quorum

    # ---- writes --------------------------------------------------------------------------------
    def cas_quorum(self, new: Quorum, expected_rev: int, base: Quorum | None = None) -> bool:
        """Write ``new`` if the quorum key is still at ``expected_rev`` (0: absent): as the change
        from ``base`` (the quorum it replaces) with the whole record beside it, or whole."""
        key = self.key("quorum")
        value, whole = encode(new, base)
        puts = [(key, value)] + ([(self.key(f"{MEMBERS}{new.q}"), whole)] if whole else [])

        def txn(c):
            t = c.transactions
            compare = [t.create(key) == 0] if expected_rev == 0 else [t.mod(key) == expected_rev]
            return c.transaction(compare=compare, success=[t.put(k, v) for k, v in puts], failure=[])

        ok, _ = self.call(txn, "quorum compare-and-swap")
        return bool(ok)

    def declare_stall(self, q: int, record: bytes) -> bool:
        """Write ``stall/<q>`` unless it exists (the first declaration wins); True when written."""
        key = self.key(f"stall/{q}")

        def txn(c):
            t = c.transactions
            return c.transaction(compare=[t.create(key) == 0], success=[t.put(key, record)], failure=[])

        ok, _ = self.call(txn, "stall declaration")
        return bool(ok)

    def delete(self, *subs: str) -> None:
        """Delete each of ``subs`` (every key under it when it ends with "/"), in one transaction."""
        ops = []
        for sub in subs:
            key = self.key(sub)
            end = etcd3.utils.prefix_range_end(key.encode()) if sub.endswith("/") else b""
            ops.append(etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key.encode(),
                                                                                        range_end=end)))
        self.call(lambda c: c.txns([etcdrpc.TxnRequest(success=ops)]), "delete")

    def forgettable(self, q: int) -> list[str]:
        """What nobody reads once quorum ``q``'s group is up: the store and the record of quorum
        ``q - 2``, its stall, and the reports that formed ``q - 1``."""
        return [f"store/{q - 2}/", f"report/{q - 1}/", f"stall/{q - 2}", f"{MEMBERS}{q - 2}"]

    # ---- fencing -------------------------------------------------------------------------------
    def guard(self, quorum: Quorum | None, member_id: str) -> Guard:
        """Raise ``FencedError`` unless ``quorum`` is still the current one and ``member_id``'s
        ``alive`` key lives; else the fencing token: the quorum key unchanged since this read, and
        that alive key the same key (its lease lives)."""
        from elastic_trainer.rendezvous.round_fence import FencedError, Guard  # torch's import: only when fencing

        quorum_key, alive_key = self.key("quorum"), self.key("alive/" + member_id)

        def txn(c):
            t = c.transactions
            return c.transaction(compare=[], success=[t.get(quorum_key), t.get(alive_key)], failure=[])

        try:
            _, responses = self.call(txn, "fence check")
            current = record_q(responses[0][0][0]) if responses[0] else None
        except Exception as exc:  # noqa: BLE001 - cannot prove the quorum current: fail safe
            raise FencedError(f"live quorum cannot be read: {exc}") from exc
        if quorum is None or current is None or current != quorum.q or not responses[1]:
            raise FencedError(f"live quorum {quorum.q if quorum else None} is over (etcd has "
                              f"{current}{'' if responses[1] else ', and this lease is gone'})")
        return Guard(f"quorum-{quorum.q}", ((quorum_key, "mod", responses[0][0][1].mod_revision),
                                            (alive_key, "create", responses[1][0][1].create_revision)))


__all__ = ["Change", "LEFT_MARK", "LiveKeys", "View", "WATCHED", "json_objects", "range_op"]
