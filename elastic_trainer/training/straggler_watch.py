"""Stragglers found and left out live: the Manager's part of ``observability/stragglers.py``.

A node that is slow but alive (thermal throttling, a degraded link, a noisy neighbour) slows every
step of a synchronous job to its pace. Each rank times its **own** part of each step (``StepClock``:
from the end of the step before, when every rank left the same all-reduce, to its last gradient
bucket; data loading included, the wait for the others excluded), keeps the last ``window`` of them
(``OwnTimes``) and, about every ``summary_every_s`` (2 s), puts its median into the step agreement
the ranks run anyway (``Manager.agree``): one slot per rank, summed, so that every rank holds every
rank's median. When: each agreement carries rank 0's flag "the next agreement carries the
summary" (one float), raised once ``summary_every_s`` passed on rank 0's clock, so every rank knows
it at the same agreement, whatever the step time. No etcd traffic, no extra collective; one float
more in every agreement and ``world_size`` floats more in one every ~2 s.

Every rank then runs the same ``EvictionPolicy.decide`` on the same numbers (rank 0's clock and
step period ride along), so every rank reaches the same decision at the same step with no second
round: the ranks of an evicted node raise ``Evicted`` (their node is held out: the launcher waits
``hold_out_s``, checks the node, ``observability/health.py``, and lets it rejoin); the others
re-form without it at that same step, as after a preemption (``Manager.request_reform``). The policy
keeps at least ``--min-nodes``.

Each rank's score (its own time over its peers' median) goes to its node's ``/metrics``; rank 0 logs
the ranks it names (once per change of the named set), and its records get a ``straggler`` event.

Usage (what ``Manager`` does)::

    watch = StragglerWatch(StragglerConfig(), device, min_nodes=1, rejoined=newcomer)
    watch.time_steps(ddp)                       # after each wrap (DDP's comm hook)
    watch.step_began()                          # the previous step ended
    ... fn(*batch) ...; watch.step_ended()      # this step's own time, into the window
    extra = watch.payload(rank, world_size)     # at an agreement: [] or the summary's slots
    decision = watch.read(agreed_extra, quorum) # the same Decision on every rank
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
import os
import time
from collections.abc import Callable, Sequence

import torch

from elastic_trainer.env import ENV_STRAGGLERS
from elastic_trainer.live.quorum import LiveExcluded, Quorum
from elastic_trainer.observability import metrics
from elastic_trainer.observability.step_clock import StepClock
from elastic_trainer.observability.stragglers import Decision, EvictionPolicy, OwnTimes, StragglerConfig, Summary
from elastic_trainer.training.agreement import Agreement

logger = logging.getLogger(__name__)

class Evicted(LiveExcluded):
    """This worker's node was left out as a straggler (``str``: why, in one line). Uncaught, it ends
    the worker and tells its launcher, which holds the node out, checks it and lets it rejoin."""


def config_from_environ(live: bool = True) -> StragglerConfig:
    """The launcher's straggler settings (``ENV_STRAGGLERS``); the defaults without a launcher; off
    outside live recovery (nothing re-forms there)."""
    if not live:
        return StragglerConfig(policy="off")
    text = os.environ.get(ENV_STRAGGLERS)
    return StragglerConfig.from_json(text) if text else StragglerConfig()


def event_fields(decision: Decision) -> dict:
    """A decision as the ``stragglers`` event's fields (``records.EVENT_KEYS``), but ``step``."""
    return {"named": list(decision.named), "scores": [round(s, 3) for s in decision.scores],
            "evict": list(decision.evict), "reason": decision.reason}


class StragglerWatch:
    """One rank's straggler bookkeeping (see the module docstring)."""

    def __init__(self, config: StragglerConfig, device: torch.device, *, min_nodes: int = 1,
                 rejoined: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = StepClock(device)
        self.own = OwnTimes(config.window)
        self.periods = OwnTimes(config.window)
        self.policy = EvictionPolicy(config, min_nodes=min_nodes)
        self._now = clock  # rank 0's: when a summary is due, and the ``now`` of every decision
        self._summary_next = False  # the agreement after this one carries the summary (rank 0 said so)
        self._carrying = False  # this agreement's payload carries it
        self._last_summary: float | None = None  # rank 0: when it last raised the flag
        self._world_changed = rejoined  # a newcomer joins a world that changed: the cool-down applies
        self._began: float | None = None
        self._named: tuple[int, ...] = ()
        self.last: Decision | None = None
        """The last decision (None before the first summary)."""
        self.news: Decision | None = None
        """The last agreement's decision when the ranks it names changed or it evicts (for the event
        log, the status and W&B), else None."""

    @property
    def on(self) -> bool:
        return self.config.policy != "off"

    def time_steps(self, ddp: torch.nn.Module | None) -> bool:
        """Time this rank's own part of each step of ``ddp`` (a ``DistributedDataParallel``; anything
        else: the whole step is its own, and nothing is named). Call it after each wrap. False: not
        timed (no DDP, the policy off, or the wrapper has a comm hook of its own)."""
        if not self.on or not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return False
        try:
            self.clock.attach(ddp)
        except RuntimeError as exc:  # DDP allows one comm hook: the loop registered its own
            logger.warning("stragglers: this rank's own step time is unknown (%s); it is never named", exc)
            return False
        return True

    def step_began(self) -> None:
        """The step before ended: this one's own time starts (from the last collective every rank
        left together, ``StepClock.start``: what a rank does after it, such as a pause, is its own)."""
        if self.on:
            now = time.perf_counter()
            if self._began is not None:
                self.periods.add(now - self._began)
            self._began = now
            self.clock.start()

    def collective_done(self) -> None:
        """Every rank left a step-end agreement together: the next step's own time starts here."""
        if self.on:
            self.clock.collective_done()

    def step_ended(self) -> None:
        """The step's own work is done: its own time goes into the window."""
        if self.on:
            for t in self.clock.stop():
                self.own.add(t.own)

    def world_changed(self) -> None:
        """A re-form: the work per rank changed, so the windows start over and the cool-down starts
        at the next summary; the agreements are counted from this world's first."""
        self.own.clear()
        self.periods.clear()
        self._summary_next = self._carrying = False
        self._last_summary = None
        self._named = ()
        self._world_changed = True
        self._began = None

    def payload(self, rank: int, world_size: int) -> list[float]:
        """What this rank adds to the agreement: nothing (off, or one rank), else rank 0's flag (1: the
        next agreement carries the summary; 0 elsewhere) and, when the agreement before raised it,
        one slot per rank (its median own time at ``rank``, NaN before ``min_samples`` of them),
        rank 0's clock and rank 0's median step period. Every rank adds as many floats."""
        if not self.on or world_size < 2:
            return []
        due = rank == 0 and (self._last_summary is None
                             or self._now() - self._last_summary >= self.config.summary_every_s)
        if due:
            self._last_summary = self._now()
        out = [1.0 if due else 0.0]
        self._carrying = self._summary_next
        if self._carrying:
            slots = [0.0] * (world_size + 2)
            slots[rank] = self.own.median() if len(self.own) >= self.config.min_samples else math.nan
            if rank == 0:
                slots[world_size] = self._now()
                slots[world_size + 1] = self.periods.median() or 0.0
            out += slots
        return out

    def add_to(self, values: Sequence[float] | torch.Tensor, rank: int, world_size: int
               ) -> tuple[Sequence[float] | torch.Tensor, int]:
        """``values`` of an agreement with this rank's ``payload`` after them, and how many it added."""
        extra = self.payload(rank, world_size)
        if not extra:
            return values, 0
        if isinstance(values, torch.Tensor):
            more = torch.tensor(extra, dtype=torch.float64, device=values.device)
            return torch.cat([values.to(torch.float64).reshape(-1), more]), len(extra)
        return [*values, *extra], len(extra)

    def take_from(self, agreed: Agreement, added: int, quorum: Quorum | None, rank: int,
                  ) -> tuple[Agreement, Decision | None]:
        """The agreement without the ``added`` floats (the loop's values alone), and what ``read``
        decided from them."""
        if not added:
            return agreed, None
        summary = agreed.values[-added:]
        return replace(agreed, values=agreed.values[:-added]), self.read(summary, quorum, rank)

    def read(self, extra: Sequence[float], quorum: Quorum | None, rank: int) -> Decision | None:
        """The summed ``payload`` of every rank: the decision, the same on every rank (None: this
        agreement carried no summary). Records this rank's score; rank 0 logs a change of the named set."""
        self.news = None
        if not extra:
            return None
        self._summary_next = extra[0] > 0
        if not self._carrying or quorum is None:
            return None
        extra = extra[1:]
        n = len(extra) - 2
        now, period = extra[n], extra[n + 1]
        if self._world_changed:
            self.policy.world_changed(now)
            self._world_changed = False
        nodes = tuple(m.node for m in quorum.members)
        decision = self.policy.decide(Summary(own=tuple(extra[:n]), nodes=nodes, period=period), now)
        self.last = decision
        if decision.scores:
            metrics.straggler_score(decision.scores[rank])
        if decision.named == self._named and not decision.evict:
            return decision
        self.news, self._named = decision, decision.named
        if nodes[rank] in decision.evict:
            logger.warning("stragglers: this node is left out (%s); its launcher holds it out, checks it, and "
                           "lets it rejoin", decision.reason)
        if rank != 0:
            return decision
        if decision.named or decision.evict:
            who = ", ".join(f"rank {i} on {nodes[i]} ({decision.scores[i]:.2f}x)" for i in decision.named)
            logger.warning("stragglers: %s%s", who or "none named", f"; {decision.reason}" if decision.reason else "")
        else:
            logger.info("stragglers: none named any more")
        return decision


__all__ = ["Evicted", "event_fields", "StragglerWatch", "config_from_environ"]
