"""A worker's default process group under the Manager: joined, formed, left and formed again.

In plain mode (plain torchrun, ``--recovery restart``) it is the group torchrun's environment
describes (``join``), never re-formed. Under live recovery it belongs to the live quorum
(``live/group.py``: who trains together, agreed in etcd), and its life is:

1. **join**: wait until a quorum admits this worker (a cold start, or a newcomer), then **form**;
2. **form**: the quorum's watcher first (a member lost from now on is noticed within a lease, also
   while the group forms), then ``init_process_group`` on a fresh store in etcd (no process hosts
   it), NCCL asked to raise its errors instead of ending the process, its sockets recorded so that a
   silent loss can shut them (``abandon.py``); a member lost while the group forms ends the store's
   waits (``live/group_store.MemberGone``), and the survivors re-form without it and form again;
3. **reform** (after a failed collective, or at an agreed step): the subgroups' connections shut,
   the group aborted and destroyed, the next quorum agreed (``LiveGroup.reform``: the step every
   survivor completed), **form** again, and the state sent point to point to the ranks behind the
   quorum's step and the newcomers (``state_transfer.py``; its source serializes it before the
   group forms, while it waits for the others anyway);
4. **a join, ahead** (a planned re-form whose quorum only adds ranks: ``form_ahead``): the quorum is
   agreed at the step as in 3, but the group in use stays and the next one forms beside it on a
   thread (``group_ahead.py``); once every member's is up, at an agreed step, ``reform(planned=True)``
   switches to it and sends the state: the members' only stop;
5. **close**: leave the quorum (the lease is revoked; rank 0 marks a finished run first).

Every live group is made by ``torch_private.new_default_group`` under its quorum's name
(``group_ahead.group_name``), so that a group one rank makes ahead meets the one another makes in
its ``form``; the loop's planned groups beside it (``plan_groups``: ``torch_private.new_subgroup``,
by their own ranks) are made with it, ahead too (gloo), and handed out by ``group(name)``.

The Manager (``training/manager.py``) owns one and is what a training loop calls.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from elastic_trainer.env import EXIT_EVICTED, EXIT_EXCLUDED, EXIT_OK, WorkerEnv
from elastic_trainer.live.group import LiveGroup
from elastic_trainer.live.group_store import MemberGone
from elastic_trainer.live.quorum import LiveExcluded, Quorum, RunFinished
from elastic_trainer.torch_private import install_default_group, new_default_group, new_subgroup
from elastic_trainer.training import state_codec
from elastic_trainer.training.abandon import GroupAbandon
from elastic_trainer.training.group_ahead import GroupAhead, group_name, only_adds, ready_key
from elastic_trainer.training.process_group import (collective_failed, drop_group, etcd_addresses, init_from_env,
                                                    install_debug_hang, leave_process_group, nccl_error_handling,
                                                    warm_up_ddp)
from elastic_trainer.training.recovery import Donors, GroupPlan, Reform
from elastic_trainer.runtime import die_with_parent, process_age, runtime
from elastic_trainer.training.state_transfer import LateSend, early_state, send_state, send_states, transfer
from elastic_trainer.training.straggler_watch import Evicted

logger = logging.getLogger(__name__)


class WorkerGroup:
    """This worker's default process group and its membership (see the module docstring)."""

    def __init__(self, env: WorkerEnv, device: torch.device, collective_timeout: float) -> None:
        self.env, self.device, self.collective_timeout = env, device, collective_timeout
        if env.restart_count is not None:  # started by torchrun's agent, which gives each worker a
            die_with_parent()              # session of its own: go when the agent goes (a killed node)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.live: LiveGroup | None = LiveGroup.from_env(
            env, start_thread=runtime().start_thread, on_lease_lost=self._lease_lost,
            on_member_lost=self._member_lost, on_hung=self._lease_lost,
            probe_peers=device.type == "cuda")  # an NCCL collective may hang on a dead peer
        """The live quorum's membership (None in plain mode); also the checkpoint commit's fence."""
        self.abandon = GroupAbandon(self.backend, etcd_addresses(self.live))
        """Makes the group's collectives in flight fail now (the watcher calls it on a silent loss)."""
        if self.live is not None:
            install_debug_hang(env)
        self.rank, self.world_size = env.rank or 0, env.world_size or 1
        self.round = env.rdzv_round
        """The quorum number under live recovery (the rendezvous round otherwise)."""
        self.distributed = False
        self._subgroups = False  # groups beside the default one were made (subgroups())
        self._formed: Quorum | None = None  # the quorum of the group in use
        self.ahead: GroupAhead | None = None
        """The next quorum's group, forming beside this one (``form_ahead``), until the switch."""
        self.switch_due = False
        """Every rank's group ahead is up (the step-end agreement said so): ``reform(planned=True)`` switches."""
        self._agreed: Quorum | None = None  # agreed by form_ahead, formed by the reform that follows
        self._plan: GroupPlan | None = None  # the loop's groups beside the default one (plan_groups)
        self._extras: dict[str, dist.ProcessGroup] = {}  # this rank's groups of the plan, in the group in use
        self._ahead_store = None
        self._ahead_checked = 0.0  # when ahead_ready last asked etcd
        self._late: LateSend | None = None  # a switch's late keys on their way to the newcomers (sent_late)

    @property
    def quorum(self) -> Quorum | None:
        """The quorum of the group in use (while a group forms ahead, the live quorum is the next one)."""
        if self.live is None:
            return None
        return self._formed if self._formed is not None else self.live.quorum

    @property
    def newcomer(self) -> bool:
        """Joined a group that was already training: ``receive_state()`` gives its state."""
        q = self.quorum
        return q is not None and not q.cold

    @property
    def host(self) -> str | None:
        """The address this worker's peers reach it at (live recovery, once formed), else None."""
        q = self.quorum
        return q.members[self.rank].probe.rsplit(":", 1)[0] if q is not None and self.distributed else None

    def join(self) -> None:
        """Plain mode: torchrun's group. Live: the quorum's admission, then ``form``. Raises
        ``RunFinished`` for a spare the run never needed. Under live recovery it also has the runtime
        end the process on an uncaught ``LiveExcluded`` (``EXIT_EXCLUDED``: the agent starts a
        newcomer) or ``RunFinished`` (0)."""
        if self.live is None:
            self.distributed = init_from_env(self.env, self.device, self.collective_timeout)
            if self.distributed:
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            return
        runtime().exit_on_uncaught(LiveExcluded, EXIT_EXCLUDED)
        runtime().exit_on_uncaught(Evicted, EXIT_EVICTED, node=True)  # the launcher holds the node out
        runtime().exit_on_uncaught(RunFinished, EXIT_OK)
        t0 = time.perf_counter()
        warm_up_ddp()  # DDP's first construction's imports: not while the quorum waits for this worker
        state_codec.warm_up()  # the state it sends or receives at a re-form: its first encoding costs more
        t1 = time.perf_counter()
        age = process_age()
        logger.info("live: asking to be admitted (after a warm-up of %.3fs; this process started %s ago)", t1 - t0,
                    "?" if age is None else f"{age:.2f}s")
        quorum = self.live.join()
        t2 = time.perf_counter()
        quorum = self._form_until_whole(-1)  # a newcomer's (or a cold start's) step: none yet
        self.live.forget_old()
        logger.info("live: admitted to quorum %d as rank %d of %d after %.3fs (%s); group in %.3fs", quorum.q,
                    self.rank, quorum.world_size, t2 - t1, "cold start" if quorum.cold else "newcomer",
                    time.perf_counter() - t2)

    def form(self) -> None:
        """The default group of the current quorum, on a fresh store in etcd (the watcher first)."""
        self.live.start_watching()  # at once when it runs already (a re-form)
        q = self.live.quorum
        if dist.is_initialized():
            raise RuntimeError("WorkerGroup.form: the default process group is still up (leave it first)")
        # kept: the store is a Python subclass of torch's Store, and the groups made later from the
        # default one (new_group: a DeviceMesh, the checkpoint's group) call it through C++, which finds
        # no Python half once the object is gone ("Not implemented.")
        self._store = self.live.store()
        self._extras = {}
        with self.abandon.recording(), self.live.progress.forming():  # gloo: the connections they open are the
            install_default_group(self._make_group(q, self._store))     # ones to shut on a silent loss
            self._extras = self._make_extras(q, self._store)
        self._formed = q
        self.rank, self.world_size, self.round, self.distributed = dist.get_rank(), q.world_size, q.q, True

    def _make_group(self, q: Quorum, store) -> dist.ProcessGroup:
        """Quorum ``q``'s default group on ``store``, as every rank makes it (not made the default here)."""
        device_id = None
        if self.backend == "nccl":
            nccl_error_handling()
            device_id = self.device
        return new_default_group(self.backend, store, q.rank_of(self.live.id), q.world_size,
                                 datetime.timedelta(seconds=self.collective_timeout), group_name(q.q), device_id)

    def _make_extras(self, q: Quorum, store, only: str | None = None) -> dict[str, dist.ProcessGroup]:
        """This rank's groups of the loop's plan in quorum ``q`` (each kind's, or ``only`` that one),
        named after the quorum (``group_name(q)/kind/index``) on its ``store``: made by their own ranks
        alone (``torch_private.new_subgroup``), so that the members make them ahead as they make the
        default group, and a newcomer meets them in its ``form``. Live recovery on gloo only (else
        ``group`` makes them with ``dist.new_group``, all ranks together, when the loop asks)."""
        if self._plan is None or not self.groups_ahead:
            return {}
        rank, out = q.rank_of(self.live.id), {}
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        for name, kind in self._plan(q.world_size).items():
            mine = kind.of(rank) if only in (None, name) else None
            if mine is not None and (kind.backend or "gloo") == "gloo":
                out[name] = new_subgroup("gloo", store, list(mine[1]), rank, timeout,
                                         f"{group_name(q.q)}/{name}/{mine[0]}")
        return out

    @property
    def groups_ahead(self) -> bool:
        """The plan's groups are made with every default group (live recovery on gloo): asking for
        one (``group``) is no collective."""
        return self.live is not None and self.backend == "gloo"

    def plan_groups(self, plan: GroupPlan) -> None:
        """The loop's groups beside the default one (``Manager.plan_groups``)."""
        self._plan = plan

    def group(self, name: str) -> dist.ProcessGroup | None:
        """This rank's group ``name`` of the plan in the group in use (None: this rank is in none of
        that kind); see ``Manager.group``."""
        if name in self._extras:
            return self._extras[name]
        kind = self._plan(self.world_size).get(name) if self._plan is not None else None
        if kind is None:
            raise KeyError(f"no process group {name!r} in the loop's plan (Manager.plan_groups)")
        if self.groups_ahead and (kind.backend or "gloo") == "gloo":
            with self.abandon.recording(add=True):  # planned after the group formed: made now
                self._extras.update(self._make_extras(self._formed, self._store, only=name))
            return self._extras.get(name)
        made: list = []
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        with self.subgroups(lambda: [g for g in made if g is not None]):
            for ranks in kind.ranks:  # every rank makes every group, in order (dist.new_group's contract)
                g = dist.new_group(list(ranks), backend=kind.backend, timeout=timeout)
                made.append(g if self.rank in ranks else None)
        self._extras[name] = next((g for g in made if g is not None), None)
        return self._extras[name]

    def _form_until_whole(self, step: int, cycle_s: float | None = None) -> Quorum:
        """``form`` the current quorum's group; while a member is lost as it forms (its store's waits
        end, ``MemberGone``: within about a lease of a freeze, at once for a kill), leave what was
        made and re-form without that member, reporting ``step``. The quorum the group formed for."""
        while True:
            try:
                self.form()
                return self.live.quorum
            except MemberGone as exc:
                q = self.live.quorum
                logger.warning("live: %s while quorum %d formed its group; re-forming without it", exc, q.q)
                leave_process_group(runtime().start_thread)
                self.live.reform(step, f"a member was lost while quorum {q.q} formed its group",
                                 report_timeout=self._report_timeout(cycle_s))

    # ---- a join, ahead (group_ahead.py) ------------------------------------------------------------
    @property
    def can_form_ahead(self) -> bool:
        """A planned re-form may form the next group beside this one (``form_ahead``): live
        recovery, gloo, no groups beside the default one, none forming ahead already."""
        return (self.live is not None and self.distributed and self.backend == "gloo" and not self._subgroups
                and self.ahead is None)

    def form_ahead(self, step: int, cause: str, cycle_s: float | None,
                   prepare: Callable[[Quorum, Callable[[str], dist.ProcessGroup | None]], None] | None = None) -> bool:
        """A planned re-form's round at ``step``, the group kept: agree on the next quorum (its
        newcomers learn it and form their group). True when it only adds ranks: its group now forms
        beside this one (``ahead``), and training goes on until every rank's is up (``switch_due``);
        False: ``reform`` forms the agreed quorum now. Raises ``LiveExcluded`` as ``reform`` does."""
        self.live.progress.reform_started()
        try:
            q = self.live.reform(step, cause, report_timeout=self._report_timeout(cycle_s))
        finally:
            self.live.progress.reform_ended()
        if not only_adds(self._formed, q):
            self._agreed = q
            return False
        store = self._ahead_store = self.live.store()

        def make() -> tuple[dist.ProcessGroup, dict]:
            with self.abandon.recording(ahead=True):
                made = self._make_group(q, store), self._make_extras(q, store)
            if prepare is not None:  # the loop's own part ahead (Recovery.ahead); the switch does it if this fails
                try:
                    prepare(q, made[1].get)
                except Exception:  # noqa: BLE001 - logged; the switch makes it instead
                    logger.exception("live: the loop's preparation for quorum %d failed; the switch makes it", q.q)
            return made

        self.ahead = GroupAhead(q, cause, make, self._drop_ahead, runtime().start_thread)
        logger.info("live: quorum %d agreed at step %d (%s); its group forms beside quorum %d's", q.q, step, cause,
                    self.round)
        return True

    @property
    def ahead_ready(self) -> bool:
        """This rank's group ahead is up, and every newcomer of it waits for its state (``ready_key``:
        from the standing watch; from etcd every half second while the watch shows it not, which
        may be a stream re-established after the key was set)."""
        ahead = self.ahead
        if ahead is None or not ahead.ready:
            return False
        keys = [ready_key(r) for r in ahead.quorum.receivers]
        if self._ahead_store.delivered(keys):
            return True
        now = time.monotonic()
        if now - self._ahead_checked < 0.5:
            return False
        self._ahead_checked = now
        return self._ahead_store.check(keys)

    def _drop_ahead(self, box: list) -> None:
        self.abandon.drop_ahead()
        made = box.pop()  # (the default group, the loop's groups)
        box += [*made[1].values(), made[0]]
        del made
        drop_group(box, runtime().start_thread)

    def _discard_ahead(self) -> None:
        ahead, self.ahead, self.switch_due = self.ahead, None, False
        if ahead is not None:
            ahead.discard()

    def _switch(self, state_dict: Callable[[], dict] | None, started: tuple[float, float],
                donors: Donors | None, late: Sequence[str]) -> Reform:
        """At the agreed step: the groups formed ahead become the default one and the loop's, the old
        ones go, the state goes to the newcomers (from the donors, for a sharded state; its ``late``
        keys in the background: ``sent_late``)."""
        self.sent_late()  # the last join's (its first step waited for them: done)
        ahead, self.ahead, self.switch_due = self.ahead, None, False
        q = ahead.quorum
        old_rank, old_world, old_round = self.rank, self.world_size, self.round
        self.live.progress.reform_started()
        try:
            made = ahead.take()
            box = [install_default_group(made[0]), *self._extras.values()]
            self._extras = made[1]
            del made
            self.abandon.promote()
            self._store, self._ahead_store = self._ahead_store, None
            drop_group(box, runtime().start_thread)
            self._formed = q
            self.rank, self.world_size, self.round = dist.get_rank(), q.world_size, q.q
            grouped = time.perf_counter()
        finally:
            self.live.progress.reform_ended()
        late = tuple(late) if self.backend == "gloo" else ()
        state, missing = transfer(q, self.rank, state_dict, self.device, donors, late=late)
        if isinstance(state, LateSend):
            self._late, state = state, None
        self.live.forget_old()
        return Reform(q, state, old_rank, old_world, grouped, grouped, grouped, missing, old_round, *started,
                      ahead=True, late=bool(late) and not missing)

    def sent_late(self) -> None:
        """A donor of a switch's late keys: wait until its receivers have them (``Manager.commit_point``,
        before the optimizer step changes them); raises if a send failed (a lost receiver)."""
        late, self._late = self._late, None
        if late is not None:
            late.wait()

    def _report_timeout(self, cycle_s: float | None) -> float:
        return max(self.live.settings.report_timeout, 3 * (cycle_s or 0.0))

    def reform(self, step: int, cause: str, state_dict: Callable[[], dict] | None, *, cycle_s: float | None,
               donors: Donors | None, started: tuple[float, float], planned: bool = False,
               late: Sequence[str] = ()) -> Reform:
        """Leave, agree on the next quorum, ``form``, move the state (``Manager.reform``). ``planned``
        (at an agreed step, no collective failed) with ``switch_due``: the switch to the group formed
        ahead instead (the donors' ``late`` keys in the background); otherwise a group forming ahead
        is discarded."""
        if self.live is None:
            raise RuntimeError("Manager.reform needs live recovery (elastic-train's etcd-v3 rendezvous with "
                               "--recovery live); in plain mode a failure ends the worker and torchrun restarts it")
        if planned and self.switch_due and self.ahead is not None:
            return self._switch(state_dict, started, donors, late)
        self._discard_ahead()
        agreed_q, self._agreed = self._agreed, None
        old_rank, old_world, old_round = self.rank, self.world_size, self.round
        self.live.progress.reform_started()
        try:
            if self._subgroups or self._extras:  # gloo: a peer blocked on this rank in a subgroup fails now,
                self.abandon.abandon("this rank re-forms")  # as on a death
            self._extras = {}  # (destroyed with the default group)
            leave_process_group(runtime().start_thread)
            self._late = None  # a late transfer in flight failed with the group it was on
            torn = time.perf_counter()
            quorum = agreed_q if agreed_q is not None and planned else \
                self.live.reform(step, cause, report_timeout=self._report_timeout(cycle_s))
            agreed = time.perf_counter()
            early = early_state(quorum, self.live.id, state_dict, donors, runtime().start_thread)  # while the group forms
            quorum = self._form_until_whole(step, cycle_s)
            grouped = time.perf_counter()
        finally:
            self.live.progress.reform_ended()
        state, missing = transfer(quorum, self.rank, state_dict, self.device, donors, early)
        self.live.forget_old()  # rank 0, after the state went: the receivers do not wait for its deletes
        return Reform(quorum, state, old_rank, old_world, torn, agreed, grouped, missing, old_round, *started)

    def receive_state(self, donors: Donors | None = None) -> dict | None:
        """A newcomer's state from a live rank (``Manager.receive_state``). The members send it when
        they switch to the group (a join whose group formed ahead: a step or two after this one
        formed); a member lost meanwhile fails the wait (its connections close, or the watcher shuts
        them), and the newcomer then re-forms with the others, having no step (-1), and waits again
        (its rank and world may change: the loop reads them after this); a run that finished
        meanwhile raises ``RunFinished``. Not with ``donors`` (a sharded state): its error propagates."""
        while True:
            try:
                return self._receive(donors)
            except Exception as exc:  # noqa: BLE001 - only a failed collective is re-formed; the rest re-raises
                if self.live is None or donors is not None or not collective_failed(exc):
                    raise  # (sharded states: the loop's shards and mesh are made for the world it joined)
                cause = f"the state did not reach a newcomer ({type(exc).__name__}: {exc})"
            # outside the except block: the failed wait's frames are gone before the group is left
            logger.warning("live: %s; re-forming with the others", cause)
            self._extras = {}
            leave_process_group(runtime().start_thread)
            self.live.reform(-1, cause, report_timeout=self._report_timeout(None))
            self._form_until_whole(-1)

    def _receive(self, donors: Donors | None) -> dict | None:
        if not self.newcomer:
            return None
        q = self.live.quorum
        self._store.set(ready_key(self.rank), b"1")  # the members switch to a group formed ahead once it came
        if donors is not None:
            plan = donors(q)
            if any(d is None for d in plan.values()):
                return None
            return send_states(None, plan, self.device)
        return send_state(None, q.source, q.receivers, self.device)

    @contextlib.contextmanager
    def subgroups(self, groups: Callable[[], Sequence] | None = None) -> Iterator[None]:
        """Groups beside the default one are made inside (``Manager.subgroups``)."""
        if self.live is None:
            yield
            return
        self._subgroups = True
        with self.abandon.recording(add=True):
            yield
        if groups is not None and self.backend != "gloo":
            self.abandon.groups += list(groups())

    def close(self, *, finished: bool = False) -> None:
        """Leave the quorum (its lease is revoked); with ``finished`` rank 0 marks the run finished first."""
        if self.live is not None:
            if finished and self.rank == 0:
                self.live.finish()
            self.live.close()

    def destroy(self) -> None:
        """Destroy the default group (nothing may refer to it any more), and a group formed ahead."""
        self._discard_ahead()
        self._extras = {}
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
        self._late = None
        self.distributed = False

    def _lease_lost(self, reason: str) -> None:
        """This worker's lease is gone, or its training thread is stuck while its peers re-form without
        it: the others may already train without it, so it ends (its agent starts a newcomer)."""
        runtime().exit(EXIT_EXCLUDED, reason, run_hooks=False)

    def _member_lost(self, reason: str) -> None:
        """From the watcher: a member went silent (or the quorum moved on): the collectives in flight fail now."""
        self.abandon.abandon(reason)


__all__ = ["WorkerGroup"]
