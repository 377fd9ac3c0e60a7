"""What a live quorum is: its members in rank order, and the record of it that etcd holds.

A **quorum** is one membership of a run's live group: a number ``q`` and the members in rank
order (rank ``i`` is ``members[i]``), with what the next group needs to know: the step it
continues at, the rank whose state the others load (``source``), the ranks that must receive it
(``receivers``), whether it starts cold from a checkpoint, and whether the run is finished. The
quorum of a run is one etcd key (``live/keys.py``), changed only by compare-and-swap, so there is
one quorum at a time.

**Its record.** Every watcher of the live keys gets every value the quorum key takes. Written
whole, the record lists every member (~90 bytes each: ~730 kB at 1,000 nodes of 8 workers), so
each re-form sent that to every watch: ~730 MB with one watch per node, for a change of one node
(docs/rendezvous.md, "At 1,000 and 10,000 nodes"). So a re-form writes, in its one
compare-and-swap transaction:

- the quorum key: the change from the quorum it replaces, ``{"q", "base": its number, "drop": the
  nodes left out, "add": the members appended, ...}`` with every other field of the ``Quorum``:
  a few hundred bytes however large the group (``encode``);
- ``members/<q>``: the whole record, which nobody watches.

A re-form keeps the survivors in their order and appends the newcomers (``live/reform.py``), so
the change rebuilds the list exactly; ``encode`` writes the whole record in the key when it would
not (a cold start has no base). A reader that holds quorum ``base`` (every survivor: it is the
quorum it trained in) rebuilds the new list from it without a request; one that does not (a
newcomer, a watch re-established after it missed a re-form, ``elastic-train status``) reads
``members/<q>`` (``decode``'s ``fetch``).

**What stays safe.** The quorum key is still the one compare-and-swap that orders quorums, and
the fencing token still compares its mod revision: a change record fences as the whole one did.
A quorum number names one member list (the compare-and-swap writes each ``q`` once; a finished
run rewrites ``q`` with its members unchanged, as a change with ``base`` = ``q``), so "apply to
``base``" is unambiguous, and a reader that does not hold ``base`` never guesses: it reads the
whole list, or, when that key is gone (two quorums later it is deleted), fails (``ValueError``)
and reads everything again, as a watcher does after any failed read.

The errors a member of the live group meets are here too: ``LiveExcluded`` (not in the quorum
that was formed), ``RunFinished`` and ``LiveTimeout``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, fields

MEMBERS = "members/"
"""Under the live prefix: ``members/<q>``, quorum ``q``'s whole record (written with it)."""


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
    """One worker of the live group."""

    id: str
    """``<node>-<local rank>-<pid>``: a new process is a new member."""
    node: str
    """The node (its agent's rendezvous name): nodes are kept or dropped whole."""
    local_rank: int
    probe: str
    """``host:port`` of the member's probe listener (``live/probe.py``): refused once its process is gone."""

    def to_dict(self) -> dict:
        return {"id": self.id, "node": self.node, "local_rank": self.local_rank, "probe": self.probe}

    @functools.cached_property
    def json_bytes(self) -> bytes:
        """``to_dict()`` as JSON, built once: a quorum's whole record joins its members' (a re-form
        keeps the survivors' ``Member`` objects, so the proposer's record of 8,000 members costs a
        join, not 8,000 encodings: 21-28 ms a re-form at 1,000 nodes of 8)."""
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, d: dict) -> Member:
        return cls(str(d["id"]), str(d["node"]), int(d["local_rank"]), str(d["probe"]))


@dataclass(frozen=True)
class Quorum:
    """One membership of the live group: rank ``i`` is ``members[i]``."""

    q: int
    members: tuple[Member, ...]
    step: int = -1
    """The step the group continues after (the highest a survivor completed; -1: none yet)."""
    source: int = 0
    """The rank whose state the receivers load (one that completed ``step``)."""
    receivers: tuple[int, ...] = ()
    """The ranks that load ``source``'s state: survivors behind ``step`` and newcomers."""
    cold: bool = False
    """Formed by a cold start: every rank loads the newest checkpoint."""
    finished: bool = False
    """The run is over: waiting newcomers exit 0, and a member's leaving is no loss."""
    cause: str = ""
    formed_at: float = 0.0

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(m.node for m in self.members))

    def rank_of(self, member_id: str) -> int | None:
        return self.ranks.get(member_id)

    @functools.cached_property
    def ranks(self) -> dict[str, int]:
        """member id -> rank, built once (a watcher asks at every change; 8,000 members at 1,000 nodes)."""
        ranks: dict[str, int] = {}
        for i, m in enumerate(self.members):
            ranks.setdefault(m.id, i)
        return ranks

    def by_node(self) -> dict[str, list[Member]]:
        """The members by node, the nodes in member order."""
        out: dict[str, list[Member]] = {}
        for m in self.members:
            out.setdefault(m.node, []).append(m)
        return out

    def marked_finished(self) -> Quorum:
        """This quorum with ``finished`` set (the same number and members)."""
        return dataclasses.replace(self, finished=True)

    def to_json(self) -> bytes:
        """The whole record (what ``from_json`` reads), built once per quorum (it is immutable;
        ``dataclasses.asdict`` took 27 ms at 800 members, on the path from a re-form to the
        siblings of every node)."""
        return self._json

    @functools.cached_property
    def _json(self) -> bytes:
        head = json.dumps(_fields_but_members(self)).encode()  # "{...}": the members go before its "}"
        return head[:-1] + b', "members": [' + b", ".join(m.json_bytes for m in self.members) + b"]}"

    @classmethod
    def from_json(cls, data: bytes) -> Quorum:
        d = json.loads(data)
        if not isinstance(d, dict) or not isinstance(d.get("q"), int) or not isinstance(d.get("members"), list):
            raise ValueError("the live quorum in etcd is malformed")
        return _from_fields(d, tuple(Member.from_dict(m) for m in d["members"]))


def _fields_but_members(q: Quorum) -> dict:
    d = {f.name: getattr(q, f.name) for f in fields(Quorum) if f.name != "members"}
    d["receivers"] = list(q.receivers)
    return d


def _from_fields(d: dict, members: tuple[Member, ...]) -> Quorum:
    return Quorum(q=d["q"], members=members, step=int(d.get("step", -1)), source=int(d.get("source", 0)),
                  receivers=tuple(int(r) for r in d.get("receivers", ())), cold=bool(d.get("cold")),
                  finished=bool(d.get("finished")), cause=str(d.get("cause", "")),
                  formed_at=float(d.get("formed_at", 0.0)))


# ---- the record in etcd ------------------------------------------------------------------------------
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
    record = _fields_but_members(new)
    record.update(base=base.q, drop=sorted({m.node for m in base.members} - kept_nodes),
                  add=[m.to_dict() for m in new.members[len(kept):]])
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
        add = tuple(Member.from_dict(m) for m in d["add"])
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
    return _from_fields(d, members)


def held_by(*quorums: Quorum | None) -> Callable[[int], Quorum | None]:
    """``decode``'s ``known`` for the quorums a reader holds (None entries skipped)."""
    held = [x for x in quorums if x is not None]
    return lambda q: next((x for x in held if x.q == q), None)


__all__ = ["LiveExcluded", "LiveTimeout", "MEMBERS", "Member", "Quorum", "RunFinished", "decode", "encode",
           "held_by", "record_q"]
