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

With ``watch`` (``LiveGroup.store``: a watch stream on the store's prefix) a wait looks again as
soon as a key is set: the members that reach the group first learn a late member's address when
it writes it, not at their next poll (10 ms, doubling to 250 ms), and a join's group forms once
the newcomer is there. Then the wait raises ``MemberGone`` (a ``LookupError``, what a store's wait raises on a timeout),
and ``init_process_group`` with it, within about a lease of a freeze and a ``SLICE`` of a kill.
The state transfer that follows runs on the group's collectives: a killed peer's sockets close at
once, and a frozen one's are shut by the watcher (``on_member_lost``), as during training.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from torch.distributed import Store

from elastic_trainer.live.keys import LiveKeys
from elastic_trainer.live.probe import Prober
from elastic_trainer.live.quorum import Quorum
from elastic_trainer.etcd.store import EtcdStore

SLICE = 0.5
"""Seconds a wait lasts before the store asks again whether a member is gone."""
PROBES_PER_LOOK = 64
"""Members probed between two slices of a wait, in turn (all of them at a few nodes)."""


Watch = Callable[[str, Callable[[], None]], Callable[[], None]]
"""``watch(prefix, on_change) -> stop``: call ``on_change()`` whenever a key under ``prefix`` changes in etcd."""


class MemberGone(LookupError):
    """A member of the quorum whose process group forms is gone: the group cannot form."""


class GroupStore(Store):
    """Quorum ``quorum``'s store, for member ``member_id`` (see the module docstring). ``loss()``
    says why a member of the quorum is gone (its watcher's finding), or "". ``timeout``: its
    waits' (``init_process_group`` sets the group's)."""

    def __init__(self, keys: LiveKeys, quorum: Quorum, member_id: str, loss: Callable[[], str],
                 timeout: datetime.timedelta, watch: Watch | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self.prefix = keys.key(f"store/{quorum.q}/")
        self.quorum = quorum
        self._store = EtcdStore(keys.conn, self.prefix, timeout=datetime.timedelta(seconds=SLICE))
        self._unwatch: Callable[[], None] | None = None
        if watch is not None:  # a wait looks again once a key under the prefix changes, not at its next poll
            self._store.woken = threading.Event()
            self._unwatch = watch(self.prefix, self._store.woken.set)
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

    def close(self) -> None:
        """Stop watching the store's keys (its group is left); a later wait polls."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

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


__all__ = ["GroupStore", "MemberGone", "PROBES_PER_LOOK", "SLICE", "Watch"]
