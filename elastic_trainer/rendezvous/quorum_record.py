"""The quorum key's record: the member list whole once, then each re-form as the change it makes.

The live quorum (``rendezvous/quorum.py``) is one etcd key, and every watcher of the live keys
gets every value it takes. Written whole, it lists every member (~90 bytes each: ~730 kB at
1,000 nodes of 8 workers), so each re-form sent that to every watch: ~730 MB with one watch per
node, ~5.8 GB with one per worker, for a change of one node (docs/rendezvous.md, "At 1,000 and
10,000 nodes"). Now a re-form writes, in its one compare-and-swap transaction:

- the quorum key: the change from the quorum it replaces, ``{"q", "base": its number, "drop": the
  nodes left out, "add": the members appended, ...}`` with every other field of the ``Quorum``
  (step, source, receivers, cause, ...): a few hundred bytes however large the group;
- ``members/<q>``: the whole record, which nobody watches.

A re-form keeps the survivors in their order and appends the newcomers (``LiveGroup._propose``),
so the change rebuilds the list exactly; ``encode`` writes the whole record in the key when it
would not (a cold start, which has no base). A reader that holds quorum ``base`` (every survivor:
it is the quorum it trained in) rebuilds the new list from it without a request; one that does not
(a newcomer, a watch re-established after it missed a re-form, ``elastic-train status``) reads
``members/<q>``, one key (``decode``'s ``fetch``).

**What stays safe.** The quorum key is still the one compare-and-swap that orders quorums, and
fencing (``LiveGroup.guard``) still compares its mod revision: a change record fences as the whole
one did. A quorum number names one member list (the compare-and-swap writes each ``q`` once;
``finish`` rewrites ``q`` with its members unchanged, as a change with ``base`` = ``q``), so
"apply to ``base``" is unambiguous, and a reader that does not hold ``base`` never guesses: it
reads the whole list, or, when that key is gone (two quorums later ``forget_old`` deletes it), fails
(``ValueError``) and reads everything again, as a watcher does after any failed read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields

from elastic_trainer.rendezvous.members import Member, Quorum

MEMBERS = "members/"
"""Under the live prefix: ``members/<q>``, quorum ``q``'s whole record (written with it)."""


def encode(new: Quorum, base: Quorum | None) -> tuple[bytes, bytes | None]:
    """What a compare-and-swap writes for ``new``: the quorum key's value, and ``members/<q>``'s
    (None: not written). The change from ``base`` (the quorum it replaces) with the whole record
    beside it; the whole record in the key alone where there is no base, or ``new`` is not
    ``base`` less some nodes plus members appended."""
    whole = new.to_json()
    if base is None:
        return whole, None
    kept_nodes = {m.node for m in new.members}
    kept = tuple(m for m in base.members if m.node in kept_nodes)
    if new.members[:len(kept)] != kept:
        return whole, None
    record = {f.name: getattr(new, f.name) for f in fields(Quorum) if f.name != "members"}
    record["receivers"] = list(new.receivers)
    record.update(base=base.q, drop=sorted({m.node for m in base.members} - kept_nodes),
                  add=[{"id": m.id, "node": m.node, "local_rank": m.local_rank, "probe": m.probe}
                       for m in new.members[len(kept):]])
    return json.dumps(record).encode(), whole


def record_q(value: bytes) -> int:
    """The quorum number a record (whole or a change) is for, without its member list."""
    d = json.loads(value)
    if not isinstance(d, dict) or not isinstance(d.get("q"), int):
        raise ValueError("the live quorum in etcd is malformed")
    return d["q"]


def decode(value: bytes, known: Callable[[int], Quorum | None],
           fetch: Callable[[int], bytes | None] | None) -> Quorum:
    """The ``Quorum`` the quorum key's ``value`` is: a whole record as it is; a change applied to
    ``known(base)`` (the quorum of that number this reader holds, or None), else built on the whole
    record ``fetch(q)`` reads (``members/<q>``; None when it is gone). ``ValueError`` when neither
    can be had, or the record is malformed."""
    d = json.loads(value)
    if not isinstance(d, dict) or not isinstance(d.get("q"), int):
        raise ValueError("the live quorum in etcd is malformed")
    if "base" not in d:
        return Quorum.from_json(value)
    q = d["q"]
    try:
        base, drop = int(d["base"]), set(d["drop"])
        add = tuple(Member(str(m["id"]), str(m["node"]), int(m["local_rank"]), str(m["probe"])) for m in d["add"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the live quorum {q}'s change record is malformed ({exc!r})") from exc
    have = known(base)
    if have is not None and have.q == base:
        members = tuple(m for m in have.members if m.node not in drop) + add
    else:
        whole = fetch(q) if fetch is not None else None
        if whole is None:
            raise ValueError(f"quorum {q} is a change from quorum {base}, which this worker does not hold, "
                             f"and its whole record ({MEMBERS}{q}) is not in etcd")
        members = Quorum.from_json(whole).members
    return Quorum(q=q, members=members, step=int(d.get("step", -1)), source=int(d.get("source", 0)),
                  receivers=tuple(int(r) for r in d.get("receivers", ())), cold=bool(d.get("cold")),
                  finished=bool(d.get("finished")), cause=str(d.get("cause", "")),
                  formed_at=float(d.get("formed_at", 0.0)))


__all__ = ["MEMBERS", "decode", "encode", "record_q"]
