"""The Manager: a data-parallel training loop under live recovery, in a few lines of that loop.

Under ``elastic-train`` (live recovery, the default for a script that uses it) a lost or added
node does not restart the workers: the survivors keep their processes and their state, re-form the
process group at the new world size, and a newcomer receives the training state from a live peer.
Which workers train together is the live quorum's business (``live/group.py``: membership
in etcd); the Manager is what a training loop sees of it. A loop hands it what it needs once and
calls it once per step (``examples/own_loop.py`` is the whole program; docs/manager.md the
reference)::

    manager = Manager()
    sampler = ElasticSampler(len(data), global_batch, manager.rank, manager.world_size, seed=0)
    loader = manager.loader(DataLoader(data, batch_sampler=sampler))  # re-split at each new world
    ddp = manager.start(model, DDP, optimizer=opt)   # join; a newcomer loads a live peer's state
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = manager.step(train_step, x, y)    # train_step(x, y) uses ddp and opt as usual
    manager.finish()

``step`` runs the step and, every few steps, the agreement (one small all-reduce: a node waits to
join, a stop). When a collective failed in it, or at an agreed step, it re-forms the group in place
(``recover``): DDP dropped, the group formed again at the new world size, the state sent point to
point to the ranks that need it (never from storage), DDP made again, the sampler split over the
new world; a step lost to the failure runs again on the new world's batch before ``step`` returns.
What a re-form asks of the loop is a ``Recovery`` (``recovery.py``): ``start`` and ``loader`` build
it for a plain loop (``loop.py``, records in ``loop_records.py``); the built-in trainer brings its
own (``trainer_live.py``). The process group is ``worker_group.py``'s; the low-level calls
(``run``, ``agree``, ``reform``, ``receive_state``) stay public for loops that drive the re-form.
Outside live recovery (plain torchrun) the same loop runs on torchrun's group and nothing re-forms.
TorchFT's Manager is the model; this one re-forms once per fault, not per step.

The Manager never ends the process: ``LiveExcluded`` (the quorum formed without this worker) and
``RunFinished`` (a spare the run never needed) are raised; once they leave the program uncaught
they end it with ``EXIT_EXCLUDED`` (its agent starts a newcomer) or 0
(``WorkerRuntime.exit_on_uncaught``). Only a lost lease or a hung training thread, noticed on
another thread, exits through the runtime at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic_trainer.env import WorkerEnv
from elastic_trainer.records import Event
from elastic_trainer.live.group import LiveGroup
from elastic_trainer.live.quorum import LiveExcluded, Quorum, RunFinished
from elastic_trainer.observability import crash_loop, metrics
from elastic_trainer.training.agreement import Agreement, Cadence, agree_interval, shared_values
from elastic_trainer.training.loop import ElasticLoader, LoopRecovery, Rewrapped
from elastic_trainer.training.loop_records import LoopRecords
from elastic_trainer.training.process_group import (collective_failed, host_step_is_device_state, install_debug_slow,
                                                    leave_process_group, nccl_error_handling, run_or_failed_collective,
                                                    warm_up_ddp)
from elastic_trainer.training.recovery import Donors, GroupPlan, Recovery, Reform, Subgroups
from elastic_trainer.training.state_transfer import send_state, send_states
from elastic_trainer.training.straggler_watch import Evicted, StragglerWatch, config_from_environ, event_fields
from elastic_trainer.training.uses_manager import script_uses_manager
from elastic_trainer.training.worker_group import WorkerGroup

logger = logging.getLogger(__name__)
T = TypeVar("T")


def recovery_kind(cause: str, old_world: int, new_world: int) -> str:
    """The ``kind`` label of a re-form for the node's ``/metrics`` (``metrics.RECOVERY_KINDS``), from
    its cause and the world before and after: a larger world is a join; a preempted peer, a hang
    or an expired lease say so in the cause; any other loss is a kill."""
    text = cause.lower()
    if new_world > old_world:
        return "join"
    if "straggler" in text:
        return "straggler"
    if "preempt" in text or "sigterm" in text:
        return "preemption"
    if "hung" in text or "no progress" in text or "stall" in text:
        return "hang"
    if "lease" in text or "froze" in text or "frozen" in text or "cut off" in text:
        return "freeze"
    return "kill"


class Manager:
    """A worker's training loop under live recovery (see the module docstring). ``device``: this
    rank's device (gloo on the CPU, NCCL on CUDA); ``max_seconds``: a time budget on rank 0's clock,
    after which every rank stops at the same step (``stopped``); ``log_dir``: where the loop's
    records go (default: the launcher's ``--log-dir``)."""

    def __init__(self, device: torch.device | None = None, *, collective_timeout: float = 300.0,
                 max_seconds: float | None = None, log_dir: str | None = None, env: WorkerEnv | None = None,
                 samples_per_step: int | None = None) -> None:
        self.env = WorkerEnv.from_environ() if env is None else env
        self.samples_per_step = samples_per_step
        """The global batch, for the node's ``/metrics`` (``loader()`` takes it from its sampler)."""
        self.device = device if device is not None else torch.device("cpu")
        self.max_seconds = max_seconds
        self._pg = WorkerGroup(self.env, self.device, collective_timeout)  # the process group and membership
        self._live = self._pg.live
        self._loop = LoopRecovery(self, LoopRecords(self, self.env.restart_count or 0, log_dir))
        self._recovery: Recovery = self._loop  # what a re-form asks of the loop (start(recovery=...))
        self._cadence = Cadence()  # when the next agreement is due, and the measured step cycle
        self._agreed = False  # the current step agreed already (agree())
        self._requested: str | None = None  # a re-form the loop asked for at this step's end
        self._stop_vote = False
        self._stopped = False
        self._started_at: float | None = None
        self._progress_marked = False  # this worker told the crash-loop policy it completed a step
        self._last_step_end: float | None = None  # for the step period rank 0 records in the metrics
        self._stragglers = StragglerWatch(  # own step times scored at agreements, a slow node evicted (live)
            config_from_environ(self._live is not None), self.device,
            min_nodes=self._live.settings.min_nodes if self._live is not None else 1)
        self._evicted: str | None = None  # this rank's node was evicted at this step's agreement (why)
        self._debug_slow = install_debug_slow(self.env, lambda: self._stragglers.own.median() or self._cadence.cycle_s)
        crash_loop.mark_managed()

    # ---- where this worker sits (it changes at every re-form) ----------------------------------------
    @property
    def rank(self) -> int:
        return self._pg.rank

    @property
    def world_size(self) -> int:
        return self._pg.world_size

    @property
    def round(self) -> int | None:
        """The quorum number under live recovery (the rendezvous round otherwise)."""
        return self._pg.round

    @property
    def distributed(self) -> bool:
        """Whether a process group is up (False when not launched, or after ``finish``)."""
        return self._pg.distributed

    @property
    def live(self) -> bool:
        """Whether this worker is under live recovery (else: plain mode, nothing re-forms)."""
        return self._live is not None

    @property
    def quorum(self) -> Quorum | None:
        return self._pg.quorum

    @property
    def fence(self) -> LiveGroup | None:
        """What fences a checkpoint commit under live recovery (``CheckpointManager(fence=...)``):
        the quorum number and this worker's lease; None in plain mode."""
        return self._live

    @property
    def newcomer(self) -> bool:
        """Joined a group that was already training: ``receive_state()`` gives its state."""
        return self._pg.newcomer

    @property
    def host(self) -> str | None:
        """The address this worker's peers reach it at (live recovery, once started), else None."""
        return self._pg.host

    @property
    def steps(self) -> int:
        """Steps this rank completed (a newcomer's count goes on from the state it received)."""
        return self._recovery.step

    @property
    def stopped(self) -> bool:
        """The ranks agreed to stop (``stop()``, ``max_seconds``): a ``loader`` yields no more batches."""
        return self._stopped

    # ---- the loop --------------------------------------------------------------------------------------
    def start(self, model: torch.nn.Module | None = None, wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
              *, optimizer: torch.optim.Optimizer | None = None, state: Callable[[], dict] | None = None,
              load_state: Callable[[dict], None] | None = None, recovery: Recovery | None = None) -> Rewrapped | None:
        """Join the process group (live: wait until the quorum admits this worker; call it once the
        model is built, so that the others never wait for this worker's start-up). A newcomer then
        loads the state a live peer sends (``model``'s, ``optimizer``'s, ``state()`` of the loop's
        own extras through ``load_state``, and each ``loader``'s position). Returns ``model`` wrapped
        for the group (``wrap(model)``, e.g. DDP; made again after every re-form), None without one.

        ``recovery``: a loop that re-forms its own way (the built-in trainer, HSDP) instead; it then
        takes a newcomer's state itself (``receive_state``), as does a loop that passes nothing.
        Raises ``RunFinished`` for a spare the run never needed."""
        if (state is None) != (load_state is None):
            raise ValueError("Manager.start: pass state and load_state together (what a newcomer receives "
                             "from the loop, and how the loop loads it)")
        loop = self._loop
        if recovery is not None:
            self._recovery = recovery
        else:
            loop.model = Rewrapped(model, wrap) if model is not None else None
            loop.optimizer, loop.extra = optimizer, (state, load_state) if state is not None else None
        self._pg.join()
        self._started_at = time.monotonic()
        self._record_world()
        if self.newcomer:
            self._stragglers.world_changed()  # joined a world that changed: the cool-down applies
        if self._recovery is loop:
            loop.joined(self.receive_state if self.newcomer else None, self.quorum.source if self.newcomer else None)
        self._stragglers.step_began()
        return loop.model if self._recovery is loop else None

    def loader(self, dataloader: torch.utils.data.DataLoader) -> ElasticLoader:
        """``dataloader`` (its ``batch_sampler`` an ``ElasticSampler``, one batch per step) as the loop
        iterates it: its sampler is split over each new world, its position goes with the state and
        its steps are committed by ``step``; after a re-form the batches not yet trained come again,
        cut for the new world (``training/loop.py``). Call it before or after ``start``."""
        loader = ElasticLoader(dataloader, lambda: self._stopped)
        self._loop.add_loader(loader)
        if self.samples_per_step is None:
            self.samples_per_step = loader.sampler.global_batch_size
        return loader

    def step(self, fn: Callable[..., T], *batch: Any) -> T | None:
        """Run one training step, ``fn(*batch)``, and what comes with it: the agreement every few
        steps (``stop``, ``max_seconds``, a node that waits to join) and, when a collective failed
        in it or at an agreed step, the re-form (``recover``). Returns ``fn``'s result; when the
        step was lost to a re-form, the result of the step run again on the batch the new world
        gives this rank (``batch`` from a ``loader``), or None when there is none (no loader, or
        the epoch is over: the loop goes on with its next batch). Errors other than a failed
        collective propagate (plain mode: every error)."""
        while True:
            self.before_step()
            out, failed = self.run(lambda: self._one_step(fn, batch))
            if self._evicted is not None:  # this rank's node was evicted at this step's agreement: leave now
                self.close()
                raise Evicted(f"evicted as a straggler: {self._evicted}")
            if failed is None:
                self._step_recorded()
            if failed is None and self._requested is None:
                return out
            cause, self._requested = failed or self._requested, None
            if failed is None and self._form_ahead(cause):  # a join: its group forms beside this one
                return out
            self.recover(cause, planned=failed is None)
            if failed is None:
                return out
            batch = self._loop.redo() if batch and self._recovery is self._loop else None
            if batch is None:
                return None

    def _form_ahead(self, cause: str) -> bool:
        """A planned re-form, first half (``WorkerGroup.form_ahead``): True when the next quorum only
        adds ranks and its group now forms beside this one (the ranks agree every step until every
        rank's is up, then switch: ``agree``); False: ``recover`` re-forms now."""
        if not self._pg.can_form_ahead:
            return False
        try:
            ahead = self._pg.form_ahead(self._recovery.step, cause, self._cadence.cycle_s,
                                        getattr(self._recovery, "ahead", None))  # optional
        except LiveExcluded as exc:
            self._excluded(exc)
            raise
        if ahead:
            self._cadence.next_in = 1
        return ahead

    def _excluded(self, exc: LiveExcluded) -> None:
        logger.error("live: %s; this worker ends, and its agent starts it again as a newcomer", exc)
        if self._recovery is self._loop:
            self._loop.records.event(Event.LIVE_EXCLUDED, step=self._recovery.step, reason=str(exc))

    def _one_step(self, fn: Callable[..., T], batch: tuple) -> T:
        if self._debug_slow is not None:  # the drill's slow fault: this rank's own work, longer
            self._debug_slow.pause()
        result = fn(*batch)
        self._stragglers.step_ended()
        self._recovery.step_done(result)
        if not self._agreed and self._cadence.due:  # unless the loop agreed in this step itself
            out_of_time = (self.rank == 0 and self.max_seconds is not None and self._started_at is not None
                           and time.monotonic() - self._started_at >= self.max_seconds)
            agreed = self.agree([float(self._stop_vote), float(out_of_time)])
            self._stopped = self._stopped or agreed.values[0] > 0 or agreed.values[1] > 0
            if agreed.reform and not self._stopped:
                self.request_reform(f"planned: {self.reform_reason or 'a member asked'}")
        self._stragglers.step_began()
        return result

    def time_steps(self, ddp: torch.nn.Module | None) -> bool:
        """Time this rank's own part of each step of ``ddp``, which names a straggler (docs/operations.md):
        call it after each wrap, unless ``start`` got ``model`` and ``wrap``. False: not timed."""
        return self._stragglers.time_steps(ddp)

    def stop(self) -> None:
        """Vote to stop: at the next agreement every rank stops at the same step (``stopped``)."""
        self._stop_vote = True

    def request_reform(self, cause: str) -> None:
        """Re-form at the end of this step (``step`` does it); every rank must ask at the same step,
        so ask from agreed values (the built-in trainer: a peer was preempted, a member asked). The
        first cause asked at a step is the one kept."""
        if self._requested is None:
            self._requested = cause

    def recover(self, cause: str, *, planned: bool = False) -> Reform:
        """Re-form in place with the loop's ``Recovery``: release (drop DDP), ``reform``, then
        ``reformed`` (load the state that came, wrap again, split the data). ``step`` calls it;
        ``planned``: at an agreed step, every rank of the old group alive."""
        rec = self._recovery
        started, failed_at = time.perf_counter(), time.time()
        why = f"{cause}; {self.reform_reason or ''}"  # what the watcher saw (a lease expired, a hang), for /metrics
        rec.release(cause, planned)
        try:
            reformed = self.reform(rec.step, cause, rec.state_dict, donors=rec.donors, started=(started, failed_at),
                                   planned=planned, late=getattr(rec, "late", ()))
        except LiveExcluded as exc:
            self._excluded(exc)
            raise
        rec.reformed(reformed)
        self._stragglers.world_changed()
        self._stragglers.step_began()
        took = time.perf_counter() - started
        logger.info("live: rank %d -> %d of %d in quorum %d (%s) in %.3fs", reformed.old_rank, self.rank,
                    self.world_size, self.round, cause, took)
        self._record_world()
        if self.rank == 0:
            metrics.recovered(recovery_kind(why, reformed.old_world_size, self.world_size), took)
        self._last_step_end = None  # the next step's period is not the re-form's
        return reformed

    # ---- what this worker tells its node (the crash-loop policy, /metrics): no etcd, no collective ---------
    def _record_world(self) -> None:
        q = self.quorum
        nodes = len({m.node for m in q.members}) if q is not None else \
            max(1, self.world_size // max(1, self.env.local_world_size or 1))
        metrics.world(self.world_size, nodes)

    def _step_recorded(self) -> None:
        if not self._progress_marked:
            self._progress_marked = True
            crash_loop.mark_progress()  # once: a step completed, so this node is not in a crash loop
        if self.rank == 0:
            now = time.monotonic()
            if self._last_step_end is not None:
                metrics.step_done(now - self._last_step_end, self.samples_per_step or 0)
            self._last_step_end = now

    def finish(self, *, done: bool = True) -> None:
        """The loop is over: the last record, this worker leaves the quorum and the process group
        is destroyed. ``done`` (its last step, or ``stopped``): rank 0 first marks the run finished,
        so that waiting spares exit 0 instead of starting it again; False: this worker stops but
        the run is not over (a preempted node). The process goes on (its ``finally`` blocks, its exit)."""
        if self._recovery is self._loop:
            self._loop.records.close("stopped" if self._stopped or not done else "finished", self._loop.steps)
            self._loop.release("finished", planned=True)
        self.close(finished=done)
        self._pg.destroy()

    def close(self, *, finished: bool = False) -> None:
        """Leave the quorum (its lease is revoked, so the others see at once that this worker is
        gone); with ``finished`` rank 0 marks the run finished first. The process group stays."""
        self._pg.close(finished=finished)

    def __enter__(self) -> Manager:
        self.start()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        """Leave the quorum, and the group after a clean end; an exception goes on up (the process
        never ends here: see the module docstring)."""
        self.close()
        if exc is None:
            self._pg.destroy()
        return False

    # ---- the low-level calls (``step`` and ``recover`` are made of them) ---------------------------------
    def receive_state(self, donors: Donors | None = None) -> dict | None:
        """A newcomer's training state, sent by a live rank (call it once, right after ``start()``:
        that rank waits for it); None on a cold start and in plain mode (load a checkpoint then).
        ``donors``: as in ``reform`` (None: no live rank holds this rank's state either). A member
        lost while it waits makes it re-form with the others first: read ``rank`` and
        ``world_size`` after it. When the donors send some keys late (``Recovery.late``) the state
        holds a ``state_transfer.LateState`` under ``state_transfer.LATE`` in their place."""
        return self._pg.receive_state(donors)

    def peer_lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a failed collective that ends this worker: in plain mode (torchrun
        restarts the workers; rank 0 may save the last completed step first), never under live
        recovery (the survivors re-form instead)."""
        return self._live is None and collective_failed(exc)

    def before_step(self) -> None:
        """Before each step: a worker paused past its lease never starts a step in the old group."""
        if self._live is not None:
            self._live.check_lease()

    def run(self, step: Callable[[], T]) -> tuple[T | None, str | None]:
        """Count a step and run it: ``(step(), None)``, or under live recovery ``(None, cause)`` when
        a collective failed in it (then ``reform``); other errors, and every error in plain mode,
        propagate. Its duration is the step time the hang detection measures: a rank whose ``run``
        lasts past ``max(hang_min, hang_factor x median)`` while no peer is busy declares the group
        stalled (docs/trainer.md, "Silent failures")."""
        self._cadence.count()
        self._agreed = False
        if self._live is None:
            return run_or_failed_collective(step, recover=False)
        progress = self._live.progress
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
        evaluation): while in it, the peers that wait for this rank do not take it for a hung one.
        With ``limit`` it counts as busy for that many seconds at most. Outside live recovery it
        does nothing."""
        if self._live is None:
            yield
            return
        with self._live.progress.slow(what, limit):
            self._live.wake()
            yield

    def commit_point(self) -> None:
        """HSDP, between the gradient reductions and the optimizer step: one all-reduce, so that a
        collective that failed anywhere in the step fails here on every rank (TorchFT's
        ``should_commit``; a loss during it is ``hsdp.shard_donors``'s). A donor of a join's late
        keys (``Recovery.late``) first waits until its receivers have them (``late_sent``)."""
        self.late_sent()
        if self.distributed and self.world_size > 1:
            dist.all_reduce(torch.zeros(1, device=self.device))

    def late_sent(self) -> None:
        """Before the optimizer step: a sender of a join's late keys (``Recovery.late``) waits until
        its receivers have them, since the step changes what it sends (they moved while the step's
        forward and backward ran); nothing otherwise. No collective (``commit_point`` calls it)."""
        self._pg.sent_late()

    def plan_groups(self, plan: GroupPlan) -> None:
        """The process groups beside the default one that the loop uses in every world (a
        DeviceMesh's dimensions, a checkpoint's group): ``plan(world_size)`` -> by name, a
        ``Subgroups`` (the ranks of each group of that kind). Call it before ``start``. Under live
        recovery on gloo the Manager makes this rank's group of each kind with every default group,
        ahead of a join as that group is (``group_ahead.py``), so a join whose loop has such groups
        still costs the members only the switch; elsewhere ``group`` makes them when first asked."""
        self._pg.plan_groups(plan)

    @property
    def groups_ahead(self) -> bool:
        """Whether the plan's groups are made with every default group (live recovery on gloo), so
        that asking for one (``group``) is no collective; else the first ask makes it, on every rank."""
        return self._pg.groups_ahead

    def group(self, name: str) -> dist.ProcessGroup | None:
        """This rank's group ``name`` of the plan (``plan_groups``) in the current world (None: it is
        in no group of that kind). When it was not made with the default group (plain mode, NCCL)
        it is made now with ``dist.new_group``: every rank must then ask at the same point. A
        re-form makes new ones: ask again after it (``Recovery.reformed``)."""
        return self._pg.group(name)

    @contextlib.contextmanager
    def subgroups(self, groups: Callable[[], Sequence] | None = None) -> Iterator[None]:
        """Wrap the making of process groups beside the default one (a DeviceMesh's, a checkpoint's):
        a silent loss abandons their collectives too, and ``reform`` shuts their connections (NCCL:
        aborts ``groups()``, called once they are made) before it leaves."""
        with self._pg.subgroups(groups):
            yield

    @property
    def straggler_news(self):
        """The last agreement's straggler ``Decision`` when the ranks it names changed or it evicts a
        node, else None: for a loop with records of its own (the built-in trainer's events, W&B)."""
        return self._stragglers.news

    @property
    def reform_pending(self) -> bool:
        """This rank's quorum asks to re-form (shared with the others by the next ``agree``)."""
        return self._live is not None and self._live.change_pending.is_set()

    @property
    def reform_reason(self) -> str:
        return self._live.change_reason if self._live is not None else ""

    def agree_due(self) -> bool:
        """Whether the ranks agree at the end of this step (every ``Agreement.next_in`` steps; ``run``
        counts them). A question: it changes nothing."""
        return self._cadence.due

    def agree(self, values: Sequence[float] | torch.Tensor, *, interval: int | None = None) -> Agreement:
        """A collective: one small all-reduce of ``values`` (summed over the ranks) and of whether
        any rank's quorum asks to re-form now. ``interval`` (rank 0's is used): steps until the next
        agreement; by default about 0.2 s of steps. Every rank must call it at the same steps."""
        if interval is None:
            interval = agree_interval(self._cadence.cycle_s or 0.0)
        ahead = self._pg.ahead  # a join's group forming beside this one: agree every step until it is up
        if ahead is not None:
            interval = 1
        values, added = self._stragglers.add_to(values, self.rank, self.world_size)  # every ~2 s: its summary
        pending = self.reform_pending or (ahead is not None and ahead.failed)  # failed: re-form instead
        shared = shared_values(values, pending, interval, self.rank, self.device, ahead=self._pg.ahead_ready)
        if self.distributed and self.world_size > 1:
            if self._live is not None:  # a wait for a hung peer here is a stalled step too
                self._live.progress.enter()
                try:
                    dist.all_reduce(shared)
                finally:
                    self._live.progress.leave(measured=False)
            else:
                dist.all_reduce(shared)
            self._stragglers.collective_done()
        agreed = Agreement.read(shared)
        self._cadence.next_in = agreed.next_in
        self._agreed = True
        if ahead is not None and agreed.ahead == self.world_size and not agreed.reform:
            self._pg.switch_due = True  # every rank's is up: switch at this step's end (step -> recover)
            self.request_reform(ahead.cause)
        agreed, decision = self._stragglers.take_from(agreed, added, self.quorum, self.rank)
        self._act_on(decision)
        return agreed

    def _act_on(self, decision) -> None:
        """Every rank reaches the same straggler decision from the same summary: the evicted node's
        ranks leave at the end of this step, the others re-form without them at this same step."""
        if (news := self._stragglers.news) is not None and self._recovery is self._loop:
            self._loop.records.event(Event.STRAGGLERS, step=self._loop.step, **event_fields(news))
        if decision is not None and decision.evict and self.quorum.members[self.rank].node in decision.evict:
            self._evicted = decision.reason
        elif decision is not None and decision.evict:
            self.request_reform(f"planned: straggler eviction: {decision.reason}")

    def reform(self, step: int, cause: str, state_dict: Callable[[], dict] | None = None, *,
               step_seconds: float | None = None, donors: Donors | None = None,
               started: tuple[float, float] | None = None, planned: bool = False,
               late: Sequence[str] = ()) -> Reform:
        """Re-form the group in place (after ``run`` returned a failure, or at an agreed step whose
        ``Agreement.reform`` is set; nothing may refer to the old group: drop DDP first). ``step``:
        the last step this rank completed; the quorum goes on from the highest any survivor
        reported, and the ranks behind it and the newcomers receive ``state_dict()`` of a rank that
        completed it (``Reform.state``). Raises ``LiveExcluded`` when the quorum formed without
        this worker. ``step_seconds`` (default: the measured cycle) stretches the wait for a slow
        member's report to three steps; ``donors(quorum)`` (sharded states): who sends to whom
        (``Reform.missing``: receivers without one); ``started``: (perf counter, unix time);
        ``planned``: at an agreed step, no collective failed (a join whose group formed ahead
        switches to it then); ``late``: keys of the donors' states that reach the receivers of
        such a switch in the background (``Recovery.late``, ``Reform.late``)."""
        cycle = self._cadence.cycle_s if step_seconds is None else step_seconds
        reformed = self._pg.reform(step, cause, state_dict, cycle_s=cycle, donors=donors,
                                   started=started or (time.perf_counter(), time.time()), planned=planned,
                                   late=late)
        self._cadence.next_in = 1
        return reformed


__all__ = ["Agreement", "ElasticLoader", "Evicted", "GroupPlan", "LiveExcluded", "Manager", "Recovery", "Reform", "Rewrapped",
           "RunFinished", "Subgroups",
           "agree_interval", "collective_failed", "host_step_is_device_state", "leave_process_group",
           "nccl_error_handling", "run_or_failed_collective", "script_uses_manager", "send_state", "send_states",
           "warm_up_ddp"]
