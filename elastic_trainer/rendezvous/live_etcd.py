"""The live quorum's keys in etcd, and the transactions that read, change and fence them.

Every live worker of a run keeps its state under ``<run prefix>live/``, in one etcd, and nowhere
else (no process hosts a single point of failure):

- ``quorum``: the current quorum, a number ``q`` and the members in rank order, written as the
  change from the quorum it replaces, with the whole record beside it in ``members/<q>``
  (``rendezvous/quorum_record.py``); it changes only by compare-and-swap on its mod revision, so
  there is one quorum at a time;
- ``alive/<id>``: a worker is alive while this key lives, on its node's lease (or its own);
- ``join/<id>``: a worker that waits to be admitted (a newcomer, or a cold start);
- ``report/<q>/<id>``: a member's report for the re-form into quorum ``q`` (the step it completed),
  or ``report/<q>/@<node>``: a node's, for all its members (``rendezvous/node_report.py``);
- ``stall/<q>`` and ``busy/<id>``: a declared hang of quorum ``q``, and the members in a slow phase;
- ``store/<q>/``: the torch ``Store`` of quorum ``q``'s process group.

``LiveEtcd`` is the part of ``LiveGroup`` (``rendezvous/quorum.py``) that talks to etcd: one
transaction reads what a re-form needs (``_read``, a ``View``), one compare-and-swap writes the
next quorum (``_cas_quorum``), and ``guard()`` returns the fencing token a checkpoint commit is
written under (the quorum key unchanged, this worker's ``alive`` key the same key). Every request
is counted in ``requests``. The watcher reads the same keys by their changes instead
(``rendezvous/watcher_view.py``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from elastic_trainer.rendezvous import node_report, quorum_record
from elastic_trainer.rendezvous.members import Quorum, View, json_values, range_op

if TYPE_CHECKING:
    from elastic_trainer.etcd.client import EtcdConnection


class LiveEtcd:
    """The live keys of one worker's run (a base of ``LiveGroup``, which sets the attributes below)."""

    conn: EtcdConnection
    prefix: str
    """``<run prefix>live/``."""
    id: str
    quorum: Quorum | None
    requests: int
    _last_quorum: tuple[int, Quorum] | None

    def _key(self, sub: str) -> str:
        return self.prefix + sub

    def _call(self, fn, what: str):
        self.requests += 1
        return self.conn.call(fn, f"live {what}")

    def _read(self, report_q: int | None = None, stall_q: int | None = None) -> View:
        """One transaction: the quorum, the leases, the joiners, and (when asked) the reports for
        quorum ``report_q``, and the stall declared for quorum ``stall_q`` with the busy members.
        Sent as etcd's own request (``txns``): the ``alive`` keys come without their values (a
        proposer's look at 1,000 nodes of 8 reads 8,000 of them), and no key is wrapped in a
        Python object of python3-etcd3's."""
        from etcd3 import etcdrpc

        p = self.prefix
        ops = [range_op(p + "quorum"), range_op(p + "alive/", keys_only=True), range_op(p + "join/")]
        if report_q is not None:
            ops.append(range_op(f"{p}report/{report_q}/"))
        if stall_q is not None:
            ops += [range_op(f"{p}stall/{stall_q}"), range_op(p + "busy/")]
        request = etcdrpc.TxnRequest(success=ops)
        response = self._call(lambda c: c.txns([request])[0], "read")
        ranges = [op.response_range.kvs for op in response.responses]
        quorum, rev = None, 0
        if ranges[0]:
            kv = ranges[0][0]
            quorum, rev = self._decode_quorum(kv.value, kv.mod_revision), kv.mod_revision
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
            view.report_keys = _json_values(rest[0], f"{p}report/{report_q}/")
            view.reports = node_report.expand(view.report_keys)
            rest = rest[1:]
        if stall_q is not None:
            view.stall = next(iter(_json_values(rest[0], f"{p}stall/").values()), None)
            view.busy = {mid: v for mid, v in _json_values(rest[1], p + "busy/").items() if v.get("q") == stall_q}
        return view

    def _read_reports(self, q: int) -> dict[str, dict]:
        """The report keys for quorum ``q`` (less their prefix) alone, as read (not expanded)."""
        from etcd3 import etcdrpc

        prefix = f"{self.prefix}report/{q}/"
        request = etcdrpc.TxnRequest(success=[range_op(prefix)])
        response = self._call(lambda c: c.txns([request])[0], "report read")
        return _json_values(response.responses[0].response_range.kvs, prefix)

    def _decode_quorum(self, value: bytes, rev: int) -> Quorum:
        """The quorum key's record read at mod revision ``rev`` (a change from this worker's quorum,
        or built on ``members/<q>``: ``rendezvous/quorum_record.py``), decoded once per revision."""
        if self._last_quorum is not None and self._last_quorum[0] == rev:
            return self._last_quorum[1]
        held = [x for x in (self.quorum, self._last_quorum[1] if self._last_quorum else None) if x is not None]
        quorum = quorum_record.decode(value, lambda q: next((x for x in held if x.q == q), None), self._members_of)
        self._last_quorum = (rev, quorum)
        return quorum

    def _members_of(self, q: int) -> bytes | None:
        """Quorum ``q``'s whole record (``members/<q>``), or None when it is gone."""
        got, _ = self._call(lambda c: c.get(self._key(f"{quorum_record.MEMBERS}{q}")), "quorum members read")
        return got

    def _cas_quorum(self, new: Quorum, expected_rev: int, base: Quorum | None = None) -> bool:
        """Write ``new`` if the quorum key is still at ``expected_rev``: as the change from ``base``
        (the quorum it replaces) with the whole record beside it, or whole (``quorum_record``)."""
        key = self._key("quorum")
        value, whole = quorum_record.encode(new, base)
        puts = [(key, value)] + ([(self._key(f"{quorum_record.MEMBERS}{new.q}"), whole)] if whole else [])

        def txn(c):
            t = c.transactions
            compare = [t.create(key) == 0] if expected_rev == 0 else [t.mod(key) == expected_rev]
            return c.transaction(compare=compare, success=[t.put(k, v) for k, v in puts], failure=[])

        ok, _ = self._call(txn, "quorum compare-and-swap")
        return bool(ok)

    def fence_check(self) -> None:
        """Raise ``FencedError`` unless this worker's quorum is still the current one and its lease lives."""
        self.guard()

    @property
    def etcd(self):
        """The ``EtcdConnection`` of the live group (for writes guarded by ``guard()``)."""
        return self.conn

    def guard(self):
        """``fence_check()``, returning the fencing token (``rendezvous.fence.Guard``): the quorum
        key unchanged since this read and this worker's alive key the same key (its lease lives)."""
        from elastic_trainer.fence import FencedError, Guard

        q = self.quorum
        quorum_key, alive_key = self._key("quorum"), self._key("alive/" + self.id)

        def txn(c):
            t = c.transactions
            return c.transaction(compare=[], success=[t.get(quorum_key), t.get(alive_key)], failure=[])

        try:
            _, responses = self._call(txn, "fence check")
            current = quorum_record.record_q(responses[0][0][0]) if responses[0] else None
        except Exception as exc:  # noqa: BLE001 - cannot prove the quorum current: fail safe
            raise FencedError(f"live quorum cannot be read: {exc}") from exc
        if q is None or current is None or current != q.q or not responses[1]:
            raise FencedError(f"live quorum {q.q if q else None} is over (etcd has "
                              f"{current}{'' if responses[1] else ', and this lease is gone'})")
        return Guard(self.token, ((quorum_key, "mod", responses[0][0][1].mod_revision),
                                  (alive_key, "create", responses[1][0][1].create_revision)))

    @property
    def token(self) -> str:
        return f"quorum-{self.quorum.q if self.quorum else 0}"

def _json_values(kvs, prefix: str) -> dict[str, dict]:
    """key (less ``prefix``) -> its JSON object, for the key-values of one raw range answer (others skipped)."""
    return json_values(((kv.value, kv) for kv in kvs), prefix)


__all__ = ["LiveEtcd"]
