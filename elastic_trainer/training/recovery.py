"""What a live re-form asks of the training loop, and what it tells it back: the ``Recovery`` a loop
hands the Manager once, and the ``Reform`` the Manager returns.

A live re-form (``training/manager.py``) keeps every survivor's process. The Manager does the
process group's part: leave the old group, agree on the next quorum, build the new group, move the
state from a peer to the ranks that need it. What the loop built on the old group (DDP, FSDP's
mesh, the data split) must go before the group does and come back on the new one; that is the
loop's part, and a ``Recovery`` does it, on every rank, in this order:

1. ``release(cause, planned)``: drop what refers to the old group (DDP, an FSDP module), and finish
   what must finish on it (a planned re-form: a save in flight);
2. ``state_dict()``, on the ranks that send (the quorum's source; with ``donors``, each donor):
   what a receiver needs, ``torch.save``-able. ``donors(quorum)`` (sharded states, HSDP) names
   who sends to whom; ``None`` (the attribute) means one source sends to every receiver;
3. ``reformed(reform)``: load ``reform.state`` where one came, wrap the model for the new group,
   split the data over the new world, report.

``step`` is the last step this rank completed (the quorum continues at the highest any survivor
reports) and ``step_done(result)`` hears of every step the Manager ran to its end.

Two implementations: ``loop.LoopRecovery``, which ``Manager.start(model, wrap, optimizer=...)``
and ``Manager.loader`` build for a user's own loop, and the built-in trainer's
(``trainer_live.TrainerRecovery``, HSDP's shards in ``sharded_live.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from elastic_trainer.live.quorum import Quorum


@dataclass(frozen=True)
class Reform:
    """A re-form's outcome: the new quorum, the state this rank received (None unless it was behind
    or new) and when each phase ended (``time.perf_counter``)."""

    quorum: Quorum
    state: dict | None
    old_rank: int
    old_world_size: int
    torn: float
    agreed: float
    grouped: float
    missing: tuple[int, ...] = ()
    """Ranks whose state no live rank holds (``donors``): every rank loads a checkpoint."""
    old_round: int | None = None
    """The quorum number before."""
    started: float = 0.0
    """When the teardown began (``time.perf_counter``); ``failed_at`` is the same moment in unix time."""
    failed_at: float = 0.0
    ahead: bool = False
    """A join whose group formed beside the old one while the members trained (``group_ahead.py``):
    its teardown, agreement and group phases took no time of the members' pause."""
    late: bool = False
    """The donors sent the loop's ``Recovery.late`` keys after the rest, in the background: the
    receivers take the first step in the new world at weight zero (``ElasticSampler.sit_out``,
    ``StreamSampler.sit_out``) and get them before its optimizer step (``Manager.commit_point``)."""

    def timings(self, started: float | None = None, done: float | None = None) -> dict[str, float]:
        """Seconds of each phase from ``started`` (default: the teardown began) to ``done`` (default: now)."""
        started = self.started if started is None else started
        done = time.perf_counter() if done is None else done
        return {"teardown_s": self.torn - started, "agree_s": self.agreed - self.torn,
                "group_s": self.grouped - self.agreed, "state_s": done - self.grouped, "total_s": done - started}


Donors = Callable[[Quorum], dict[int, int | None]]
"""``donors(quorum)``: receiver rank -> the rank that sends it its state (None: no live rank holds it)."""


@dataclass(frozen=True)
class Subgroups:
    """One kind of process group beside the default one that a loop uses in every world (a
    DeviceMesh dimension's, a checkpoint's): ``ranks``, the groups of this kind (ranks of the
    default group; no rank in two of them); ``backend``: theirs (None: the default group's)."""

    ranks: tuple[tuple[int, ...], ...]
    backend: str | None = None

    def of(self, rank: int) -> tuple[int, tuple[int, ...]] | None:
        """``(index, ranks)`` of the group ``rank`` is in, None when it is in none."""
        return next(((i, g) for i, g in enumerate(self.ranks) if rank in g), None)


GroupPlan = Callable[[int], dict[str, Subgroups]]
"""``plan(world_size)``: the loop's groups beside the default one in a world of that size, by name
(``Manager.plan_groups``)."""


class Recovery(Protocol):
    """The loop's part of a re-form (see the module docstring)."""

    donors: Donors | None

    @property
    def step(self) -> int:
        """The last step this rank completed."""
        ...

    def step_done(self, result: Any) -> None:
        """A step ran to its end (``Manager.step``): ``result`` is what the loop's step returned."""

    def release(self, cause: str, planned: bool) -> None:
        """Before the old group is left: nothing may refer to it afterwards."""

    def state_dict(self) -> dict:
        """What a receiver of this rank's state needs (called on the senders only)."""
        ...

    def reformed(self, reform: Reform) -> None:
        """The new group is up and the state moved: load it (``reform.state``), wrap, split the data."""

    late: tuple[str, ...]
    """Optional: keys of ``state_dict()`` that may reach the receivers of a join after its switch, in
    the background (``state_transfer.LateState``), while every rank takes the step after it. Only
    for a loop that can take that step on a receiver without them: no samples and a zero-weight
    gradient there, the late keys loaded before the optimizer step (``Reform.late``)."""

    def ahead(self, quorum: Quorum, group: Callable[[str], Any]) -> None:
        """A join's groups were made beside the training (``group_ahead.py``), ``group(name)`` giving
        quorum ``quorum``'s of the loop's plan (``Manager.plan_groups``): make now what the new world
        needs that holds no state (a sharded model's skeleton on the new mesh), so that the switch
        does not. It runs on the Manager's ``live-form-ahead`` thread while the training thread
        trains: it must not touch what the training uses. May do nothing."""


__all__ = ["Donors", "GroupPlan", "Recovery", "Reform", "Subgroups"]
