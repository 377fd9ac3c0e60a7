"""The torch ``Store`` a quorum's process group is made on: in etcd, and it gives up on a member that is gone.

Every quorum's process group is built on a fresh store under ``live/store/<q>/`` in etcd
(``rendezvous/etcd_store.EtcdStore``: no process hosts a single point of failure). While the group
forms, ``init_process_group`` waits in that store for every member's keys (gloo: each rank's
address), for as long as the group's timeout (300 s by default). A member killed or frozen while
the group forms never writes them, and its peers used to wait the whole timeout
(``LookupError: keys [...] were not all set in the etcd store .../live/store/9/ within 300s``)
although its lease had expired after 3 s.

``GroupStore`` is that store with waits that end once a member of the quorum is gone: a wait is
made of ``SLICE``-long waits of the ``EtcdStore`` it wraps, and between two it asks

- the watcher, which runs from the moment the worker joined (``Watcher.loss_of``): a member's
  lease expired (a node frozen or cut off), or the quorum moved on;
- the members' probe ports (``live/probe.py``, ``PROBES_PER_LOOK`` at a time): a killed process's
  port refuses at once, while its lease lives on its node's agent.

Then the wait raises ``MemberGone`` (a ``LookupError``, what a store's wait raises on a timeout),
and ``init_process_group`` with it, within about a lease of a freeze and a ``SLICE`` of a kill.
The state transfer that follows runs on the group's collectives: a killed peer's sockets close at
once, and a frozen one's are shut by the watcher (``on_member_lost``), as during training.

With ``watched`` (``StoreWatch``: what the worker's standing watch on ``live/store/`` delivered,
``LiveGroup.store``) the members learn each other's keys from the watch's events: a wait whose
keys came answers without a request (gloo's connection asks for every peer's address, one etcd
round trip each), and one that waits wakes when its key is set, not at its next poll (10 ms,
doubling to 250 ms). A join's group forms once the newcomer is there.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from torch.distributed import Store

from elastic_trainer.live.keys import Change, LiveKeys
from elastic_trainer.live.probe import Prober
from elastic_trainer.live.quorum import Quorum
from elastic_trainer.etcd.store import EtcdStore

SLICE = 0.5
"""Seconds a wait lasts before the store asks again whether a member is gone."""
PROBES_PER_LOOK = 64
"""Members probed between two slices of a wait, in turn (all of them at a few nodes)."""


class StoreWatch:
    """What a worker's standing watch on every quorum's store (``live/store/``) delivered: the keys'
    values (``seen``, full key -> value) and ``woken``, set at each change. ``LiveGroup`` feeds it
    from its watch stream (``changed``; ``reset`` when the stream is (re-)established: what it
    missed meanwhile is read from etcd) from before the worker is admitted, so that a quorum's
    members find each other's addresses in it when their group forms, some before they look."""

    def __init__(self) -> None:
        self.seen: dict[bytes, bytes] = {}
        self.woken = threading.Event()

    def changed(self, changes: list[Change]) -> None:
        """From the watch's thread: keys set or deleted under ``live/store/``, in order."""
        for c in changes:
            if c.value is None:
                self.seen.pop(c.key.encode(), None)
            else:
                self.seen[c.key.encode()] = c.value
        self.woken.set()

    def reset(self) -> None:
        """The stream is (re-)established: forget what may be stale (an etcd that lost its data)."""
        self.seen.clear()
        self.woken.set()


class MemberGone(LookupError):
    """A member of the quorum whose process group forms is gone: the group cannot form."""


class GroupStore(Store):
    """Quorum ``quorum``'s store, for member ``member_id`` (see the module docstring). ``loss()``
    says why a member of the quorum is gone (its watcher's finding), or "". ``timeout``: its
    waits' (``init_process_group`` sets the group's)."""

    def __init__(self, keys: LiveKeys, quorum: Quorum, member_id: str, loss: Callable[[], str],
                 timeout: datetime.timedelta, watched: StoreWatch | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self.prefix = keys.key(f"store/{quorum.q}/")
        self.quorum = quorum
        self._store = EtcdStore(keys.conn, self.prefix, timeout=datetime.timedelta(seconds=SLICE))
        if watched is not None:  # a wait answers from the keys the watch delivered, or looks again when one comes
            self._store.woken, self._store.seen = watched.woken, watched.seen
        self._others = [m for m in quorum.members if m.id != member_id]
        self._loss = loss
        self._prober = Prober(PROBES_PER_LOOK)
        self.set_timeout(timeout)

    # ---- c10d's API: writes go through, waits give up on a member that is gone --------------------
    def set(self, key, value) -> None:
        self._store.set(key, value)

    def get(self, key) -> bytes:
        return self._waiting(lambda: self._store.get(key), [key], self.timeout)

    def multi_set(self, keys, values) -> None:
        self._store.multi_set(keys, values)

    def multi_get(self, keys) -> list[bytes]:
        return self._waiting(lambda: self._store.multi_get(keys), keys, self.timeout)

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        self._waiting(lambda: self._store.wait(keys, datetime.timedelta(seconds=SLICE)), keys,
                      self.timeout if timeout is None else timeout)

    def check(self, keys) -> bool:
        return self._store.check(keys)

    def delivered(self, keys) -> bool:
        """Whether the standing watch (``watched``) delivered every key of ``keys``: no request."""
        return self._store.delivered(keys)

    def add(self, key, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key, expected, desired) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    @property
    def requests(self) -> int:
        return self._store.requests

    def _waiting(self, attempt: Callable, keys, timeout: datetime.timedelta):
        """``attempt()`` (a wait of one ``SLICE`` for ``keys``) again until it succeeds, a member is
        gone (``MemberGone``) or ``timeout`` passed (``LookupError``, as ``EtcdStore``'s)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                return attempt()
            except MemberGone:
                raise
            except LookupError as exc:
                gone = self.gone()
                if gone:
                    raise MemberGone(f"the process group of quorum {self.quorum.q} cannot form: {gone}; "
                                     f"its members re-form without it") from exc
                if time.monotonic() >= deadline:
                    names = [k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in keys]
                    raise LookupError(f"keys {names} were not all set in the etcd store {self.prefix} within "
                                      f"{timeout.total_seconds():g}s, and every member of quorum "
                                      f"{self.quorum.q} looks alive") from exc

    def gone(self) -> str:
        """Why a member of the quorum is gone (its lease, as the watcher saw; its probe port
        refusing), or ""."""
        loss = self._loss()
        if loss:
            return loss
        dead = self._prober.dead(self._others)
        if dead:
            return f"the process of {sorted(dead)[0]} is gone (its probe port refuses connections)"
        return ""


__all__ = ["GroupStore", "MemberGone", "PROBES_PER_LOOK", "SLICE", "StoreWatch"]
