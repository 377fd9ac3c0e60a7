"""The Manager: a worker's process group under live recovery, for any data-parallel training loop.

Under ``elastic-train`` (live recovery, the default) a lost or added node does not restart the
workers: the survivors keep their processes and their state, re-form the process group at the
new world size, and a newcomer receives the training state from a live peer. Which workers
train together is the live quorum's business (``rendezvous/quorum.py``: membership in etcd); the
Manager is what a training loop sees of it, and it owns:

- the **process group**: ``start()`` joins the quorum and builds the group on the quorum's store
  in etcd (no process hosts it); ``reform()`` leaves (aborts, destroys) it and builds the next;
- the **re-form**: after a failed collective (``run()`` tells it from other errors) or, planned,
  at an agreed step when a node asks to join;
- the **state transfer**: the ranks behind the quorum's step and the newcomers get the state of
  one rank that completed it, point to point (``send_state``), never from storage;
- the **step agreement**: ``agree(values)``, one small all-reduce of the loop's own values plus
  the "re-form pending" flag, every few steps (``agree_due()``: about 0.2 s of steps).

Outside live recovery (plain torchrun, ``--recovery restart``) it is a plain manager:
``start()`` joins the group torchrun's environment describes, nothing re-forms, ``run()``
re-raises every error, and a lost node restarts the workers as torchrun does. So a loop written
against it runs unchanged in both modes (TorchFT's Manager and torchtitan's no-op FT manager are
the models; this one is simpler: one quorum per re-form, not per step). Sharded states (HSDP:
``training/hsdp.py``) pass ``donors`` to ``reform``/``receive_state``: each rank then gets its
part from the rank that holds the same part (``send_states``).

This module is the Manager itself; its parts live beside it, one idea each, and their public
names are importable from here as before: ``training/process_group.py`` (join, leave, tell a
failed collective), ``training/state_transfer.py`` (``send_state``, ``send_states``: the state
from a peer), ``training/agreement.py`` (``Agreement``, the step agreement's layout and cadence)
and ``training/uses_manager.py`` (``script_uses_manager``: the launcher's test for a script).

Usage (``examples/own_loop.py`` is the whole program)::

    from elastic_trainer import Manager

    def state() -> dict:                                # what a newcomer must receive
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}

    with Manager(device) as manager:                    # joins the quorum and its process group
        got = manager.receive_state()                   # a newcomer: the state of a live peer
        ...load got...
        ddp = DDP(model)
        while step < max_steps:
            manager.before_step()                       # a worker paused past its lease ends here
            out, failed = manager.run(lambda: train_step(ddp))   # (result, None) or (None, cause)
            if failed is None and manager.agree_due():
                agreed = manager.agree([loss, stop])    # summed over ranks, + the re-form flag
            if failed is not None or agreed.reform:
                ddp = None                              # nothing may hold the old group
                got = manager.reform(step, failed or "planned", state).state
                ...load got (ranks behind, newcomers)...; ddp = DDP(model)

The NCCL group is made with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only: an error or a
timeout aborts the communicators and reaches the training thread instead of ending the process)
unless the user set it, bound to its device so that its communicators are made during the
re-form. A collective blocked on a peer that stopped answering (frozen, cut off, hung) is ended
by the quorum's watcher, which abandons the group (``on_member_lost``: ``training/abandon.py``)
when the peer's lease expires or the ranks agree it is hung (``slow()`` marks what is not a hang). Anything the Manager cannot handle (an error while re-forming, a
worker left out of the quorum: ``LiveExcluded``) ends the worker; its agent restarts it, and it
joins as a newcomer. Design and numbers: docs/trainer.md, "Live recovery".
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic_trainer.env import EXIT_EXCLUDED, EXIT_OK, WorkerEnv
from elastic_trainer.live.group import LiveGroup
from elastic_trainer.live.quorum import LiveExcluded, Quorum, RunFinished
from elastic_trainer.training.abandon import GroupAbandon
from elastic_trainer.training.agreement import Agreement, Cadence, agree_interval, shared_values
from elastic_trainer.training.process_group import (collective_failed, etcd_addresses, host_step_is_device_state,
                                                    init_from_env, install_debug_hang, leave_process_group,
                                                    nccl_error_handling, run_or_failed_collective, warm_up_ddp)
from elastic_trainer.runtime import die_with_parent, runtime
from elastic_trainer.training.state_transfer import send_state, send_states, transfer
from elastic_trainer.training.uses_manager import script_uses_manager

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    """Ranks whose state no live rank holds (``reform(donors=...)``): every rank loads a checkpoint."""

    def timings(self, started: float, done: float) -> dict[str, float]:
        """Seconds of each phase from ``started`` (the caller's teardown began) to ``done``."""
        return {"teardown_s": self.torn - started, "agree_s": self.agreed - self.torn,
                "group_s": self.grouped - self.agreed, "state_s": done - self.grouped, "total_s": done - started}


class Manager:
    """A worker's process group, its re-form, the state transfer and the step agreement (see the
    module docstring). ``device``: this rank's device (gloo on the CPU, NCCL on CUDA)."""

    def __init__(self, device: torch.device | None = None, *, collective_timeout: float = 300.0,
                 env: WorkerEnv | None = None) -> None:
        self.env = WorkerEnv.from_environ() if env is None else env
        if self.env.restart_count is not None:  # started by torchrun's agent, which gives each worker a
            die_with_parent()                   # session of its own: go when the agent goes (a killed node)
        self.device = device if device is not None else torch.device("cpu")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.collective_timeout = collective_timeout
        rt = runtime()
        self.group: LiveGroup | None = LiveGroup.from_env(self.env, start_thread=rt.start_thread,
                                                          on_lease_lost=self._lease_lost)
        """The live quorum's membership (None in plain mode); also the checkpoint commit's fence."""
        self.abandon = GroupAbandon(self.backend, etcd_addresses(self.group))
        """Makes the group's collectives in flight fail now (the watcher calls it on a silent loss)."""
        if self.group is not None:
            self.group.on_member_lost = self.abandon.abandon
            self.group.probe_peers = self.device.type == "cuda"  # an NCCL collective may hang on a dead peer
            self.group.on_hung = lambda reason: runtime().exit(EXIT_EXCLUDED, reason, run_hooks=False)
            install_debug_hang(self.env)
        self.rank, self.world_size = self.env.rank or 0, self.env.world_size or 1
        self.round = self.env.rdzv_round
        """The quorum number under live recovery (the rendezvous round otherwise)."""
        self.distributed = False
        self._cadence = Cadence()  # when the next agreement is due, and the measured step cycle
        self._subgroups = False  # groups beside the default one were made (subgroups())

    @property
    def live(self) -> bool:
        """Whether this worker is under live recovery (else: plain mode, nothing re-forms)."""
        return self.group is not None

    @property
    def quorum(self) -> Quorum | None:
        return self.group.quorum if self.group is not None else None

    @property
    def fence(self) -> LiveGroup | None:
        """What fences a checkpoint commit under live recovery (``CheckpointManager(fence=...)``):
        the quorum number and this worker's lease; None in plain mode."""
        return self.group

    @property
    def newcomer(self) -> bool:
        """Joined a group that was already training: ``receive_state()`` gives its state."""
        return self.group is not None and self.group.quorum is not None and not self.group.quorum.cold

    # ---- start and stop ----------------------------------------------------------------------------
    def start(self) -> None:
        """Join the process group: the live quorum's (waiting until it admits this worker; call it
        once the model is built, so that the others never wait for this worker's start-up), or in
        plain mode torchrun's. Raises ``RunFinished`` for a spare the run never needed."""
        if self.group is None:
            self.distributed = init_from_env(self.env, self.device, self.collective_timeout)
            if self.distributed:
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            return
        warm_up_ddp()
        t0 = time.perf_counter()
        quorum = self.group.join()
        t1 = time.perf_counter()
        self._init_group()
        logger.info("live: admitted to quorum %d as rank %d of %d after %.3fs (%s); group in %.3fs", quorum.q,
                    self.rank, quorum.world_size, t1 - t0, "cold start" if quorum.cold else "newcomer",
                    time.perf_counter() - t1)
        self.group.start_watching()

    def _init_group(self) -> None:
        """The default group of the current quorum, on a fresh store in etcd."""
        q = self.group.quorum
        extra: dict[str, Any] = {}
        if self.backend == "nccl":
            nccl_error_handling()
            extra["device_id"] = self.device
        # kept: the store is a Python subclass of torch's Store, and the groups made later from the
        # default one (new_group: a DeviceMesh, the checkpoint's group) call it through C++, which finds
        # no Python half once the object is gone ("Not implemented.")
        self._store = self.group.store()
        with self.abandon.recording():  # gloo: the connections it opens are the ones to shut on a silent loss
            dist.init_process_group(self.backend, store=self._store, rank=q.rank_of(self.group.id),
                                    world_size=q.world_size,
                                    timeout=datetime.timedelta(seconds=self.collective_timeout), **extra)
        self.group.forget_old()
        self.rank, self.world_size, self.round, self.distributed = dist.get_rank(), q.world_size, q.q, True

    def receive_state(self, donors: Callable[[Quorum], dict[int, int | None]] | None = None) -> dict | None:
        """A newcomer's training state, sent by a live rank (call it once, right after ``start()``:
        that rank waits for it); None on a cold start and in plain mode (load a checkpoint then).
        ``donors``: as in ``reform`` (None: no live rank holds this rank's state either)."""
        if not self.newcomer:
            return None
        q = self.group.quorum
        if donors is not None:
            plan = donors(q)
            if any(d is None for d in plan.values()):
                return None
            return send_states(None, plan, self.device)
        return send_state(None, q.source, q.receivers, self.device)

    def close(self, *, finished: bool = False) -> None:
        """Leave the quorum (its lease is revoked, so the others see at once that this worker is
        gone); with ``finished`` rank 0 marks the run finished first, so that waiting spares exit 0.
        The process group stays (destroy it when done with it)."""
        if self.group is not None:
            if finished and self.rank == 0:
                self.group.finish()
            self.group.close()

    def __enter__(self) -> Manager:
        self.start()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        """The loop's end: leave the quorum and the group. A spare that was not needed exits 0, a
        worker left out of the quorum exits ``EXIT_EXCLUDED`` (its agent starts a newcomer); other
        errors propagate (the agent restarts the worker)."""
        self.close()
        if isinstance(exc, RunFinished):
            runtime().exit(EXIT_OK, "live: the run finished before this worker was admitted")
        if isinstance(exc, LiveExcluded):
            runtime().exit(EXIT_EXCLUDED, f"live: {exc}; its agent starts this worker again as a newcomer")
        if exc is None and self.distributed and dist.is_initialized():
            dist.destroy_process_group()
        return False

    def _lease_lost(self, reason: str) -> None:
        runtime().exit(EXIT_EXCLUDED, reason, run_hooks=False)

    # ---- while training ----------------------------------------------------------------------------
    def before_step(self) -> None:
        """Call before each step: a worker paused past its lease never starts a step in the old group."""
        if self.group is not None:
            self.group.check_lease()

    def run(self, step: Callable[[], T]) -> tuple[T | None, str | None]:
        """``(step(), None)``, or under live recovery ``(None, cause)`` when a collective failed in it
        (then ``reform``); other errors, and every error in plain mode, propagate.

        Under live recovery its duration is the step time the hang detection measures: a rank
        whose ``run`` lasts past ``max(hang_min, hang_factor x median)`` while no peer is busy
        declares the group stalled (docs/trainer.md, "Silent failures")."""
        if self.group is None:
            return run_or_failed_collective(step, recover=False)
        progress = self.group.progress
        progress.enter()
        out: tuple[T | None, str | None] = (None, "the step raised")
        try:
            out = run_or_failed_collective(step, recover=True)
        finally:
            progress.leave(measured=out[1] is None)
        return out

    @contextlib.contextmanager
    def slow(self, what: str, limit: float | None = None) -> Iterator[None]:
        """A phase that may take far longer than a step (a checkpoint save, a compile, an
        evaluation): while in it, the peers that wait for this rank do not take it for a hung one
        (its ``busy/`` key in etcd says so). With ``limit`` it counts as busy for that many seconds
        at most (a hang inside it is then found); without, a hang inside it waits for the
        collective timeout. Outside live recovery it does nothing."""
        if self.group is None:
            yield
            return
        with self.group.progress.slow(what, limit):
            self.group.wake()
            yield

    def commit_point(self) -> None:
        """Call between a step's gradient reduction and its optimizer step when the ranks hold
        different parts of the state (HSDP): one all-reduce of one number over the whole group, so
        that a collective that failed anywhere in the step (the gradient reductions of the
        shard indices are separate collectives) fails here on every rank, before any optimizer
        step, and the survivors re-form at one step (TorchFT's ``should_commit`` is the model).
        A node lost during this very all-reduce may still leave them a step apart: then the
        shards come from the ranks that hold the step every shard index has (``hsdp.shard_donors``)."""
        if self.distributed and self.world_size > 1:
            dist.all_reduce(torch.zeros(1, device=self.device))

    @contextlib.contextmanager
    def subgroups(self, groups: Callable[[], Sequence] | None = None) -> Iterator[None]:
        """Wrap the making of process groups beside the default one (a DeviceMesh's for HSDP, a
        checkpoint's): a silent loss abandons their collectives too, and ``reform`` shuts their
        connections (NCCL: aborts ``groups()``, called once they are made) before it leaves, so that
        a peer blocked on this rank in one of them fails at once (an FSDP module holds its groups
        in reference cycles: they outlive the default group)."""
        if self.group is None:
            yield
            return
        self._subgroups = True
        with self.abandon.recording(add=True):
            yield
        if groups is not None and self.backend != "gloo":
            self.abandon.groups += list(groups())

    @property
    def reform_pending(self) -> bool:
        """This rank's quorum asks to re-form (shared with the others by the next ``agree``)."""
        return self.group is not None and self.group.change_pending.is_set()

    @property
    def reform_reason(self) -> str:
        return self.group.change_reason if self.group is not None else ""

    def agree_due(self) -> bool:
        """Count a step's end; True when the ranks agree after it (every ``Agreement.next_in`` steps)."""
        return self._cadence.due()

    def agree(self, values: Sequence[float] | torch.Tensor, *, interval: int | None = None) -> Agreement:
        """One small all-reduce: ``values`` summed over the ranks, and whether to re-form now.

        ``interval`` (rank 0's is used): steps until the next agreement; by default about 0.2 s of
        steps at the cycle ``agree_due`` measured. Every rank must call it at the same steps."""
        if interval is None:
            interval = agree_interval(self._cadence.cycle_s or 0.0)
        shared = shared_values(values, self.reform_pending, interval, self.rank, self.device)
        if self.distributed and self.world_size > 1:
            if self.group is not None:  # a wait for a hung peer here is a stalled step too
                self.group.progress.enter()
                try:
                    dist.all_reduce(shared)
                finally:
                    self.group.progress.leave(measured=False)
            else:
                dist.all_reduce(shared)
        agreed = Agreement.read(shared)
        self._cadence.next_in = agreed.next_in
        return agreed

    def reform(self, step: int, cause: str, state_dict: Callable[[], dict] | None = None, *,
               step_seconds: float | None = None,
               donors: Callable[[Quorum], dict[int, int | None]] | None = None) -> Reform:
        """Re-form the group in place: same process, same state, a new group at the new world size.

        Call it after ``run`` returned a failure, or at an agreed step whose ``Agreement.reform``
        is set, with nothing referring to the old group any more (drop DDP first). ``step`` is the
        last step this rank completed; the quorum continues at the highest step any survivor
        reported, and the ranks behind it and the newcomers receive ``state_dict()`` of a rank
        that completed it (``Reform.state``). Raises ``LiveExcluded`` when the quorum formed
        without this worker. ``step_seconds`` (default: the measured cycle) stretches the wait for
        a slow member's report to three steps.

        ``donors(quorum)`` (sharded states, HSDP): who sends to whom, receiver rank -> donor rank,
        None where no live rank holds that receiver's state; each donor sends its own
        ``state_dict()`` (``send_states``). When any receiver has no donor nothing is sent and
        ``Reform.missing`` names them, on every rank alike: the caller loads a checkpoint."""
        if self.group is None:
            raise RuntimeError("Manager.reform needs live recovery (elastic-train's etcd-v3 rendezvous with "
                               "--recovery live); in plain mode a failure ends the worker and torchrun restarts it")
        old_rank, old_world = self.rank, self.world_size
        self.group.progress.reform_started()
        try:
            if self._subgroups:  # gloo: a peer blocked on this rank in a subgroup fails now, as on a death
                self.abandon.abandon("this rank re-forms")
            leave_process_group()
            torn = time.perf_counter()
            cycle = self._cadence.cycle_s if step_seconds is None else step_seconds
            quorum = self.group.reform(step, cause, report_timeout=max(self.group.settings.report_timeout,
                                                                        3 * (cycle or 0.0)))
            agreed = time.perf_counter()
            self._init_group()
            grouped = time.perf_counter()
        finally:
            self.group.progress.reform_ended()
        state, missing = transfer(quorum, self.rank, state_dict, self.device, donors)
        self._cadence.next_in = 1
        return Reform(quorum, state, old_rank, old_world, torn, agreed, grouped, missing)


__all__ = ["Agreement", "LiveExcluded", "Manager", "Reform", "RunFinished", "agree_interval", "collective_failed",
           "host_step_is_device_state", "leave_process_group", "nccl_error_handling", "run_or_failed_collective",
           "script_uses_manager", "send_state", "send_states", "warm_up_ddp"]

