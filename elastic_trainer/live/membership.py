"""A worker's membership of its run's live quorum: joining it, the quorum it holds, and the change it waits for.

Under ``--recovery live`` every agent's rendezvous is a world of its own node
(``rendezvous/handler.py``, live mode): torchrun still starts, supervises and restarts the
workers, but *which workers train together* is decided by the workers, through one etcd key, the
quorum (``live/quorum.py``, ``live/keys.py``). ``Membership`` is one worker's side of it:

- **Joining** (``join``): the worker registers ``join/<id>`` on its node's lease and waits until a
  quorum includes it. With no quorum that has a live member (a cold start, or an earlier job of
  the run id, whose etcd kept its data), once ``min_nodes`` whole nodes registered and
  ``last_call`` passed (or ``max_nodes`` registered), one of them writes quorum ``q+1`` with
  ``cold: true``: its ranks load the newest checkpoint. A newcomer to a training run is admitted by
  the members' next re-form (``live/reform.py``): its watcher sees it, and the group re-forms at
  the next step-end agreement. A run that finished while a live member of it remains answers
  ``RunFinished`` (a spare that was not needed exits 0).
- **The quorum it holds** (``quorum``, ``adopt``): the one it trains in; a re-form adopts the
  next one, or raises ``LiveExcluded`` when it formed without this worker.
- **The change it waits for** (``change_pending``, ``change_reason``): set by the watcher
  (``flag_change``: a node asks to join, a member was lost) and shared with the other ranks at the
  next step-end agreement; adopting a quorum clears it. One lock orders the two, so that a change
  seen in the quorum just left behind never flags the new one.
- **The end** (``finish``): rank 0 marks the quorum finished, so that waiting newcomers exit 0 and
  the members' departures are no loss; ``forget_old`` deletes what no one reads any more.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from elastic_trainer.env import LiveSettings
from elastic_trainer.live.keys import LiveKeys
from elastic_trainer.live.quorum import LiveExcluded, LiveTimeout, Member, Quorum, RunFinished
from elastic_trainer.live.worker_lease import WorkerLease

logger = logging.getLogger(__name__)


class Membership:
    """Member ``me``'s membership (see the module docstring); ``nproc``: its node's workers."""

    def __init__(self, keys: LiveKeys, lease: WorkerLease, me: Member, nproc: int, settings: LiveSettings) -> None:
        self.keys, self.lease, self.me, self.nproc, self.settings = keys, lease, me, nproc, settings
        self.quorum: Quorum | None = None
        self.change_pending = threading.Event()
        """Set when the group must re-form (read by the Manager before each agreement)."""
        self.change_reason = ""
        self.reforming = False
        """This worker is in a re-form round (``live/reform.py``): its group is left, the next quorum comes."""
        self._lock = threading.Lock()

    @property
    def id(self) -> str:
        return self.me.id

    # ---- joining -------------------------------------------------------------------------------
    def join(self, woken: threading.Event | None = None) -> Quorum:
        """Wait until a quorum includes this worker (as a newcomer, or in a cold start). It looks
        every 20 ms, and at once when ``woken`` is set (``LiveGroup.join``: the quorum key changed)."""
        join_key = self.keys.key("join/" + self.id)
        self.lease.put(join_key, json.dumps({"node": self.me.node, "local_rank": self.me.local_rank,
                                             "nproc": self.nproc, "probe": self.me.probe,
                                             "since": time.time()}).encode())
        deadline = time.monotonic() + self.settings.join_timeout
        enough_since: float | None = None
        try:
            while True:
                view = self.keys.read(held=self.quorum)
                q = view.quorum
                live = q is not None and any(m.id in view.alive for m in q.members)
                if live and q.finished:
                    raise RunFinished("the run finished before this worker was admitted")
                # a finished quorum with no live member is an earlier job of this run id (the
                # embedded etcd keeps its data): this launch starts it over, cold, from storage
                if q is not None and q.rank_of(self.id) is not None:
                    return self.adopt(q)
                if not live:
                    nodes = view.complete_nodes()
                    if len(nodes) < self.settings.min_nodes:
                        enough_since = None
                    else:
                        enough_since = enough_since or time.monotonic()
                        if (len(nodes) >= self.settings.max_nodes
                                or time.monotonic() - enough_since >= self.settings.last_call):
                            members = tuple(m for _, ms in nodes[:self.settings.max_nodes] for m in ms)
                            cold = Quorum(q=(q.q if q else 0) + 1, members=members, step=-1, cold=True,
                                          cause="cold start", formed_at=time.time())
                            self.keys.cas_quorum(cold, view.quorum_rev)
                            continue
                if time.monotonic() > deadline:
                    raise LiveTimeout(f"not admitted to the run within join_timeout {self.settings.join_timeout:g}s")
                if woken is None:
                    time.sleep(0.02)
                elif woken.wait(0.02):
                    woken.clear()  # before the read: a change after it wakes the next wait
        finally:
            try:
                self.lease.delete(join_key)
            except Exception as exc:  # noqa: BLE001 - it goes with the lease
                logger.info("live: could not delete the join key (%s); it goes with the lease", exc)

    # ---- the quorum it holds -------------------------------------------------------------------
    def adopt(self, q: Quorum) -> Quorum:
        """Make ``q`` the quorum this worker trains in; the change it waited for is done."""
        with self._lock:
            self.quorum = q
            self.change_pending.clear()
            self.change_reason = ""
        return q

    def adopt_formed(self, q: Quorum) -> Quorum:
        """Adopt the quorum a re-form formed, or raise ``LiveExcluded`` when it formed without this worker."""
        if q.rank_of(self.id) is None:
            raise LiveExcluded(f"quorum {q.q} formed without this worker ({q.cause})")
        return self.adopt(q)

    def flag_change(self, q: Quorum, reason: str) -> bool:
        """Ask the group to re-form, for ``reason``, if ``q`` is still the quorum held (a change
        seen in a quorum just left behind is stale); True when flagged."""
        with self._lock:
            if self.quorum is not q:
                return False
            self.change_reason = reason
            self.change_pending.set()
        return True

    # ---- the end -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Rank 0 at the end of training: mark the run finished, so that waiting newcomers exit 0."""
        view = self.keys.read(held=self.quorum)
        q = view.quorum
        if q is not None and self.quorum is not None and q.q == self.quorum.q and not q.finished:
            self.keys.cas_quorum(q.marked_finished(), view.quorum_rev, base=q)

    def forget_old(self) -> None:
        """Rank 0, once its group is up: delete what no one reads any more (``LiveKeys.forgettable``)."""
        q = self.quorum
        if q is None or q.rank_of(self.id) != 0 or q.q < 3:
            return
        subs = self.keys.forgettable(q.q)
        try:
            self.keys.delete(*subs)  # one round trip: rank 0's next step waits for it
        except Exception as exc:  # noqa: BLE001 - leftovers only cost etcd space
            logger.info("live: could not delete %s: %s", subs, exc)


__all__ = ["Membership"]
