"""The next quorum's process group, formed beside the one the members train in (a join).

A node that joins used to stop the whole world for its group: at the agreed step every member left
its group, and the new one (members and newcomer) formed while nobody trained; 25-30 ms of each
join's pause here, more at scale (docs/trainer.md, "A join's critical path"). When the next quorum
only adds ranks (every member survives, in its place), nothing of the group in use has to go first.
So the members agree on that quorum at a step's end as before (``LiveGroup.reform``: the newcomer
learns it and forms its group at once) and then go on training, while a thread of each member's
forms the next group with the newcomer (``GroupAhead``). Once every member's is up and every
newcomer waits for its state (``ready_key``: it says so in the group's store; the step-end
agreement asks, every step meanwhile), they switch at that agreed step: the formed group becomes the
default (``torch_private.install_default_group``), the old one is destroyed, the state goes to the
newcomer, DDP is made again. What remains of the pause is the state's transfer and DDP's construction.

Every rank, newcomer or member, makes a quorum's default group the same way
(``torch_private.new_default_group`` under ``group_name(q)``, on the quorum's store in etcd), so a
group made ahead on the members meets the one a newcomer makes in its ``join``; so are the loop's
groups beside it that it planned (``Manager.plan_groups``: a DeviceMesh's, a checkpoint's; each made
by its own ranks, ``torch_private.new_subgroup``, under ``group_name(q)/kind/index``), which form
ahead with it, after which the loop makes what else it can for the new world on the same thread
(``Recovery.ahead``: the built-in trainer wraps its HSDP model on the new mesh). gloo only: NCCL's
communicators are made from the default group's (``ncclCommSplit`` when a device is bound); a loop
that makes groups of its own (``Manager.subgroups``) re-forms as before, whole.

What can go wrong meanwhile goes the usual way: a member or the newcomer lost while the group forms
ends its store's waits (``MemberGone``: ``failed``), and the watcher abandons the group in use and
the one ahead (``GroupAbandon.recording(ahead=True)``); the next collective fails and the members
re-form from the quorum they agreed, leaving the group ahead unused (``discard``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from elastic_trainer.live.quorum import Quorum

logger = logging.getLogger(__name__)


def ready_key(rank: int) -> str:
    """The key a newcomer of rank ``rank`` sets in its group's store when it waits for the state: the
    members switch once every newcomer's came (through their standing watch on the stores: no
    request), so that the state's sender never waits for a newcomer still making its loop."""
    return f"newcomer-ready/{rank}"


def group_name(q: int) -> str:
    """The name of quorum ``q``'s default group on every rank (it prefixes the group's keys in its store)."""
    return f"live-{q}"


def only_adds(old: Quorum, new: Quorum) -> bool:
    """Whether ``new`` keeps every member of ``old`` in its place and adds ranks after them, with
    only the added ranks to receive the state: the group in use may then train on until the next
    one is formed beside it."""
    n = old.world_size
    return (new.world_size > n and new.members[:n] == old.members
            and tuple(new.receivers) == tuple(range(n, new.world_size)) and new.source < n)


class GroupAhead:
    """Quorum ``quorum``'s default group, made by ``make()`` on a ``live-form-ahead`` thread
    (``start_thread``'s) while the current group trains. ``ready``: made; ``failed``: its making
    raised; ``take()`` hands the group over once; ``discard()`` ends it unused (also when it is
    still forming: the thread then ends it when its making returns). ``drop(box)`` ends the group
    that the list ``box`` holds, the only reference to it (from either thread)."""

    def __init__(self, quorum: Quorum, cause: str, make: Callable[[], dist.ProcessGroup],
                 drop: Callable[[list], None], start_thread: Callable[..., object]) -> None:
        self.quorum, self.cause = quorum, cause
        self._drop = drop
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._box: list = []  # the group, once made: its only reference
        self._error: BaseException | None = None
        self._discarded = False
        start_thread("live-form-ahead", self._make, make)

    def _make(self, make: Callable[[], dist.ProcessGroup]) -> None:
        box: list = []
        try:
            box.append(make())
        except BaseException as exc:  # noqa: BLE001 - a member lost meanwhile: the re-form that follows handles it
            self._error = exc
            logger.warning("live: the group of quorum %d could not form ahead (%s); the members re-form instead",
                           self.quorum.q, exc)
        with self._lock:
            if self._discarded and box:
                self._drop(box)
            else:
                self._box = box
        self._done.set()

    @property
    def ready(self) -> bool:
        """The group is made (this rank's side; the step-end agreement asks every rank's)."""
        return self._done.is_set() and bool(self._box)

    @property
    def failed(self) -> bool:
        """Its making raised: the members must re-form instead (this rank asks at the next agreement)."""
        return self._done.is_set() and self._error is not None

    def take(self) -> dist.ProcessGroup:
        """The group, once made (it waits for the thread); its making's error when it failed."""
        self._done.wait()
        with self._lock:
            if not self._box:
                raise RuntimeError(f"the group of quorum {self.quorum.q} was not formed ahead") from self._error
            return self._box.pop()

    def discard(self) -> None:
        """End the group unused (now, or when its making returns)."""
        with self._lock:
            self._discarded = True
            box, self._box = self._box, []
        if box:
            self._drop(box)


__all__ = ["GroupAhead", "group_name", "only_adds", "ready_key"]
