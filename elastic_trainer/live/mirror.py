"""The live keys as a watcher knows them: a whole read, then every change its watch delivers.

A live worker's watcher (``live/watcher.py``) decides from a view of the keys it follows
(``quorum``, ``alive/``, ``join/``, ``stall/``, ``busy/``: ``live/keys.py``). Reading them whole
after every event cost etcd one transaction per worker per change (at 100 x 8, every loss woke
800 reads at once), so a ``Mirror`` keeps them: ``load`` a whole read (when the watch is
(re-)established), then ``apply`` each change in order, O(1) each; or ``restore`` what another
worker of the node kept (``live/node_share.py``).

Beside the keys it keeps ``missing``: the members of the ``track``ed quorum whose ``alive`` key is
gone, in the order they went, so that "is a member lost?" needs no walk over 8,000 members; and
``left``: the workers whose ``alive`` key said they left cleanly before it went (a departure, not
a loss). Not thread-safe: one thread (the watcher's) loads, applies and reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from elastic_trainer.live.keys import LEFT_MARK, Change, View
from elastic_trainer.live.quorum import Quorum, decode, held_by


class Mirror:
    """The followed live keys under ``prefix`` (see the module docstring).

    ``fetch_members(q)`` reads quorum ``q``'s whole record where a change record's base is not held."""

    def __init__(self, prefix: str, fetch_members: Callable[[int], bytes | None] | None = None) -> None:
        self.prefix = prefix
        self.fetch_members = fetch_members
        self.decode: Callable[[bytes, Callable[[int], Quorum | None], Callable[[int], bytes | None] | None],
                              Quorum] = decode
        """How a quorum record is decoded (``live/quorum.decode``): a process that mirrors the keys
        for many workers (``benchmarks/live_sim.py``) may give them one that shares what it decoded."""
        self.quorum: Quorum | None = None
        self.quorum_rev = 0
        self.quorum_record: bytes | None = None
        """The quorum key's value as etcd holds it (what ``node_share`` hands the node's siblings)."""
        self.alive: set[str] = set()
        self.left: set[str] = set()
        self.joiners: dict[str, tuple[dict, int]] = {}
        self.stalls: dict[int, dict] = {}
        self.busy: dict[str, dict] = {}
        self.missing: dict[str, None] = {}
        self.version = 0
        """Bumped by every load and change: what was derived from an older version is stale."""
        self.hint: Quorum | None = None
        """A quorum its owner holds (its own): a change record from it is decoded without a read."""
        self._tracked: Quorum | None = None
        self._ids: dict[str, int] | frozenset[str] = frozenset()
        self._previous: Quorum | None = None  # the quorum before the last whole read

    def load(self, kvs: Iterable[Change]) -> None:
        """Replace everything by a whole read (each key as a ``Change`` that puts it)."""
        self._previous = self.quorum  # a change record in the read may be from it
        self.quorum, self.quorum_rev, self.quorum_record = None, 0, None
        self.alive, self.left, self.joiners, self.stalls, self.busy = set(), set(), {}, {}, {}
        for kv in kvs:
            self.apply(kv)
        self._missing_again()

    def apply(self, change: Change) -> None:
        """One change (a key outside the followed ones is ignored). A malformed quorum record
        raises ``ValueError`` (the watcher then reads again, as after a failed read)."""
        if not change.key.startswith(self.prefix):
            return
        sub, value = change.key[len(self.prefix):], change.value
        self.version += 1
        if sub == "quorum":
            self.quorum, self.quorum_rev = (None, 0) if value is None else (self._decode(value), change.mod_revision)
            self.quorum_record = value
            return
        kind, _, name = sub.partition("/")
        if kind == "alive":  # presence is all, and a departure's mark (no JSON parsed: 8,000 in a first read)
            if value is None:
                self.alive.discard(name)
                if name in self._ids:
                    self.missing[name] = None
            else:
                self.alive.add(name)
                self.missing.pop(name, None)
                if LEFT_MARK in value:
                    self.left.add(name)
            return
        parsed = _json_object(value)
        if kind == "join":
            _set(self.joiners, name, None if parsed is None else (parsed, change.create_revision))
        elif kind == "stall" and name.isdigit():
            _set(self.stalls, int(name), parsed)
        elif kind == "busy":
            _set(self.busy, name, parsed)

    def restore(self, record: bytes | None, quorum_rev: int, alive: set[str], left: set[str],
                joiners: dict[str, tuple[dict, int]], stalls: dict[int, dict], busy: dict[str, dict]) -> None:
        """Replace everything by what another worker kept (its node's watching worker,
        ``live/node_share.py``); the quorum record is decoded only when its revision changed."""
        if record is None:
            self.quorum, self.quorum_rev = None, 0
        elif quorum_rev != self.quorum_rev or self.quorum is None:
            self._previous = self.quorum
            self.quorum, self.quorum_rev = self._decode(record), quorum_rev
        self.quorum_record = record
        self.alive, self.left, self.joiners, self.stalls, self.busy = alive, left, joiners, stalls, busy
        self.version += 1
        self._missing_again()

    def track(self, quorum: Quorum) -> None:
        """Keep ``missing`` for ``quorum``'s members (O(members) when the quorum changes, else nothing)."""
        if quorum is not self._tracked:
            self._tracked, self._ids = quorum, quorum.ranks  # its ids, built once per quorum
            self._missing_again()

    def view(self, q: int) -> View:
        """A ``View`` for quorum ``q``: its stall, and the members busy in it."""
        return View(self.quorum, self.quorum_rev, self.alive, self.joiners, stall=self.stalls.get(q),
                    busy={mid: v for mid, v in self.busy.items() if v.get("q") == q}, left=self.left)

    def _missing_again(self) -> None:
        members = self._tracked.members if self._tracked is not None else ()
        self.missing = {m.id: None for m in members if m.id not in self.alive}

    def _decode(self, value: bytes) -> Quorum:
        """The quorum record ``value``: whole, or a change from a quorum this mirror holds, else
        built on ``fetch_members`` (``live/quorum.py``)."""
        return self.decode(value, held_by(self.quorum, self._previous, self.hint), self.fetch_members)


def _set(d: dict, key, value) -> None:
    """``d[key] = value``, or with None the key removed."""
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value


def _json_object(value: bytes | None) -> dict | None:
    """``value`` as a JSON object, or None (deleted, not JSON, or not an object)."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


__all__ = ["Mirror"]
