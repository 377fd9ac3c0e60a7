"""The built-in trainer under live recovery: its ``Recovery`` (``training/recovery.py``), beside the
plain path.

The ``Trainer`` (``training/trainer.py``) is a client of the same Manager as a user's loop: it
runs each step through ``Manager.step``, and the Manager re-forms the group when a collective fails
or at an agreed step. What the trainer must do around a re-form is here, so that its loop has no
live or sharded branch (torchtitan keeps its fault tolerance beside the plain path the same way):

- **a newcomer** (``receive``, ``wrapped``, ``resume``): the state a live rank sends, its model
  loaded before DDP wraps it (DDP broadcasts rank 0's), then everything else where the trainer
  would load a checkpoint;
- **a re-form** (``release``, ``state_dict``, ``reformed``): DDP dropped, the state the ranks
  behind and the newcomers receive (the trainer's checkpoint content), then the model wrapped
  again on the new group, the received state loaded, the sampler split over the new world, the
  data loader made again, one line and a ``live_reform`` event;
- **HSDP** (``--fsdp`` on several nodes: ``sharded_live.py``): the shards kept in memory across
  the re-form, who sends which shard (``donors``), the model wrapped again around them, peer
  copies every K steps (``after_step``) and the commit point before the optimizer step; a join's
  shards sent while every rank takes the next step (``late``: the newcomer sits out its samples,
  takes it at weight zero and loads them at ``commit_point``).

In plain mode (``--recovery restart``) nothing re-forms: only ``receive``/``resume`` are asked, and
find nothing to do.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from elastic_trainer.training import hsdp
from elastic_trainer.training.parallel import Parallel
from elastic_trainer.training.recovery import Donors, Reform
from elastic_trainer.training.sharded_live import ShardedLive
from elastic_trainer.training.state_transfer import LATE, LateState

logger = logging.getLogger(__name__)


class TrainerRecovery:
    """The trainer ``t``'s part of live recovery (see the module docstring)."""

    def __init__(self, t: Any) -> None:
        self.t = t
        self.sharded: ShardedLive | None = None
        """Live ``--fsdp``: its shards, peer copies and re-wrap (made once the group is up: ``started``)."""
        self.donors: Donors | None = None
        """HSDP at a re-form: who sends which rank its shards (set by ``release``)."""
        self._peer: tuple[int, dict] | None = None  # a newcomer's received (step, state), restored by resume()
        self._peer_s = 0.0
        self._kept: hsdp.Shards | None = None  # HSDP: this rank's shards across a re-form
        self._next: tuple[int, Parallel] | None = None  # HSDP: (quorum, its model) made ahead of a join
        self._late: LateState | None = None  # a newcomer's bulk, coming while its first step runs (commit_point)

    @property
    def late(self) -> tuple[str, ...]:
        """``Recovery.late``: a join's bulk (DDP: the model and the optimizer; ``--fsdp``: the shards)
        reaches its newcomers while every rank takes the step after the switch (live recovery on
        gloo, where the groups form ahead; the sampler leaves the newcomers out of that step:
        ``ElasticSampler.sit_out``, ``StreamSampler.sit_out``); else it comes with the rest."""
        if not self.t.manager.groups_ahead:
            return ()
        if self.sharded is not None:
            return ("shards",) if self._wrap_first else ()
        return ("model", "optimizer")

    @property
    def receiving(self) -> bool:
        """A newcomer whose bulk is still coming (``late``): its model is wrapped without taking
        rank 0's parameters (they come with the rest of it), its first step is at weight zero."""
        return self._late is not None

    def started(self) -> None:
        """The process group is up: HSDP's part when this is a live ``--fsdp`` run on a group."""
        t = self.t
        if t.manager.live and t.config.fsdp and t.dinfo.distributed:
            self.sharded = ShardedLive(t)

    # ---- a newcomer ----------------------------------------------------------------------------
    def receive(self) -> None:
        """A newcomer: the state a live rank sends, before the wrap (DDP: its model loaded now;
        ``--fsdp`` whose mesh groups the wrap makes with the members, NCCL: loaded by ``wrapped``)."""
        if not self._wrap_first:
            self._receive()

    @property
    def _wrap_first(self) -> bool:
        # --fsdp with the mesh's groups made with the default group (gloo): the wrap is no
        # collective, so a newcomer wraps first and waits for its shards ready to train
        return self.sharded is not None and self.t.manager.groups_ahead

    def wrapped(self) -> None:
        """After the model is wrapped and the optimizer made: a newcomer under ``--fsdp`` on gloo
        takes its optimizer's first step's own cost (``ShardedLive.warm_up``) and receives its
        state now, ready to train (the members switch to the larger world once it waits for them,
        and stop for the rest of the state and their own re-wrap: the shards come while the first
        step runs, ``commit_point``); shards received with the rest are loaded."""
        if self._wrap_first:
            if self.t.manager.newcomer:
                self.sharded.warm_up()  # its first optimizer step's own cost, before the members wait for it
            self._receive()
        if self._peer is not None and self.sharded is not None and self._late is None:
            hsdp.Shards.from_state(self._peer[1]["shards"]).load_into(self.t.module, self.t.optimizer)

    def _receive(self) -> None:
        t = self.t
        if not t.manager.newcomer:
            return
        t0 = time.perf_counter()
        state = t.manager.receive_state((lambda q: self.sharded.donors(q, -1)) if self.sharded else None)
        if state is None:  # live --fsdp: no live replica holds this rank's shards (resume() rebuilds them)
            logger.info("live: no live replica holds this rank's shards; rebuilding them in _resume")
            return
        self._late = state.pop(LATE, None)
        if self._late is not None:  # they come while the first step runs (commit_point loads them)
            state.update(dict.fromkeys(("shards",) if self.sharded is not None else ("model", "optimizer")))
        self._peer, self._peer_s = (int(state["meta"]["step"]), state), time.perf_counter() - t0
        if self._late is not None:
            what = (f"its {'shards' if self.sharded is not None else 'model and optimizer'}, {self._late.nbytes} "
                    "bytes, come while its first step runs")
        elif self.sharded is not None:
            self.sharded.received = hsdp.Shards.from_state(state["shards"]).nbytes
            what = f"shards: {self.sharded.received} bytes"
        else:
            t.module.load_state_dict(state["model"])  # before DDP, as the members that sent it
            what = f"from rank {t.manager.quorum.source}"
        logger.info("live: received the training state of step %d (%s) in %.3fs", self._peer[0], what, self._peer_s)

    def resume(self) -> bool:
        """Where the trainer would load a checkpoint: a newcomer restores the state a peer sent
        (HSDP: rebuilds it when no replica held its shards). False: not a newcomer."""
        t = self.t
        if self._peer is not None:
            t.checkpoints.restore(*self._peer)
            self._peer = None
            if self._late is not None:  # its first step at weight zero, without samples (commit_point)
                t.sampler.sit_out(t.manager.quorum.receivers)
            t.report.joined_live(t.step, t.sampler, source=t.manager.quorum.source, seconds=self._peer_s)
        elif self.sharded is not None and t.manager.newcomer:
            if not self.sharded.recover(None, None):
                d = t.dinfo
                t.report.event("start", world_size=d.world_size, restart=d.restart, round=d.round)
        else:
            return False
        if self.sharded is not None:
            self.sharded.moved()  # the bytes the re-form moved (with the survivors' reformed())
            t.checkpoints.prepare(staging=False)  # the saver's folder, with the survivors (its memory: at the
                                                  # first step, as a cold start's)
        return True

    # ---- in the loop ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The trainer's step; -1 while a newcomer's shards are still coming (it holds no state)."""
        return -1 if self._late is not None else self.t.step

    def step_done(self, result: Any) -> None:
        """The trainer counts, commits and logs its steps itself."""

    def after_step(self) -> None:
        """HSDP, every K-th step: this rank's shards to a peer's host memory (``peer_copy.py``)."""
        if self.sharded is not None:
            self.sharded.copy()

    def commit_point(self) -> None:
        """Before the optimizer step. HSDP: no rank steps its optimizer unless every rank's reductions
        completed (``Manager.commit_point``); DDP: no vote, but a sender of a join's late state
        waits for its sends (``Manager.late_sent``). A newcomer whose bulk comes late then loads it
        (after its vote: the members go on to their optimizer step and their next forward
        meanwhile): its first step ran at weight zero on its own initial weights, so the gradients it
        holds now are the members' alone, which its optimizer then applies to the members' state, as
        theirs do (TorchFT's healing)."""
        t = self.t
        if self.sharded is not None:
            t.manager.commit_point()  # first: the members never wait for this rank's shards
        else:
            t.manager.late_sent()  # DDP: no vote; a sender of late state waits for its sends
        if self._late is None:
            return
        t0 = time.perf_counter()
        got, nbytes = self._late.result(), self._late.nbytes
        if self.sharded is not None:
            hsdp.Shards.from_state(got["shards"]).load_into(t.module, t.optimizer)
        else:
            t.module.load_state_dict(got["model"])  # in place: DDP's parameters
            t.par.load_optimizer_state(t.optimizer, got["optimizer"])
        self._late = None
        del got
        logger.info("live: this rank's %s (%d bytes) came while its first step ran; loaded before its optimizer "
                    "step after a wait of %.3fs", "shards" if self.sharded is not None else "model and optimizer",
                    nbytes, time.perf_counter() - t0)

    def without_stopped_peer(self) -> bool:
        """A peer got SIGTERM (and not this rank): under live recovery it leaves and the others
        re-form without it (True); on the restart path all stop (False)."""
        if not self.t.manager.live:
            return False
        self.t.manager.request_reform("planned: a peer was preempted")
        return True

    def close(self) -> None:
        if self.sharded is not None:
            self.sharded.close()

    # ---- a re-form -----------------------------------------------------------------------------
    def release(self, cause: str, planned: bool) -> None:
        t = self.t
        if planned:  # the save in flight commits on the old group first
            t.checkpoints.settle()
        t.report.unagreed_steps(t.pending)
        t.pending.clear()
        t.par = t.par.unwrap()  # DDP goes before its process group
        t.model = None
        t.optimizer.zero_grad(set_to_none=True)
        if self.sharded is not None:
            kept = self._kept = hsdp.Shards.take(t.module, t.optimizer)
            step = self.step  # -1: a newcomer whose shards had not come (a receiver again)
            self.donors = lambda q: self.sharded.donors(q, step, kept)

    def state_dict(self) -> dict:
        capture = self.t.checkpoints.capture
        if self._kept is not None:
            return {**capture(any_rank=True, whole=False), "shards": self._kept.to_state()}
        return capture(any_rank=True)

    def ahead(self, quorum, group) -> None:
        """A join's groups are up beside the training: HSDP's model on the new mesh, made now
        (``ShardedLive.wrap_ahead``: on the Manager's thread) so that the switch only loads the shards."""
        if self.sharded is not None:
            made = self.sharded.wrap_ahead(quorum.world_size, group)
            self._next = (quorum.q, made) if made is not None else None

    def reformed(self, r: Reform) -> None:
        """The step that failed (if any) did not change the parameters under DDP: a collective fails
        inside backward, before the optimizer step, or in the step-end agreement, after it. So this
        rank held the state of ``t.step``; the ranks behind the quorum's step loaded a peer's."""
        t, c, d = self.t, self.t.config, self.t.dinfo
        kept, self._kept, self.donors = self._kept, None, None
        self._late = None  # (still coming when a collective failed: it failed with the old group)
        q, state = r.quorum, r.state
        d.rank, d.world_size, d.round = t.manager.rank, t.manager.world_size, t.manager.round
        made, self._next = self._next, None
        if kept is not None:  # live --fsdp: the same shards (kept, or a peer's) in a model on the new mesh
            moved = self.sharded.rewrap(kept, state, r.missing,
                                        made[1] if made is not None and made[0] == q.q and r.ahead else None, r.ahead)
        else:
            if state is not None:
                t.module.load_state_dict(state["model"])
            t.par = Parallel.wrap(t.module, c, d, init_sync=not r.late)  # late: the newcomers' come later
        t.model = t.par.model
        t.manager.time_steps(t.par.ddp)
        t.model.train()
        position = t.sampler.state_dict()  # the rest of the epoch, split over the new world
        t.sampler, t.batches = t.new_feed()
        t.sampler.load_state_dict(position)
        if r.late:  # the newcomers take this step at weight zero while their shards come
            t.sampler.sit_out(q.receivers)
        if kept is not None and r.missing:  # no live replica holds some shard: live shards, copies, checkpoint
            self.sharded.recover(kept, (r.old_round, r.old_rank, r.old_world_size))
        elif state is not None:
            t.checkpoints.restore(q.step, state)
        extra: dict = {}
        if kept is not None:
            sent, received = self.sharded.moved()  # with the newcomers' resume()
            t.checkpoints.prepare()  # the saver's folder, asked by every rank (a newcomer: in resume())
            extra = {"extra": {"shard_bytes": moved, "moved_bytes": sent if r.late else received, "sent_bytes": sent,
                               "reloaded": bool(r.missing),
                               "state_from": self.sharded.source if r.missing else "replica"}}
        state = kept = None
        t.report.print0(f"world size changed: {r.old_world_size} -> {d.world_size} ranks without a restart "
                        f"({q.cause}); step {t.step}, global batch stays {t.gbs}"
                        + (f"; {extra['extra']['moved_bytes']} bytes of shards moved point to point" if extra else ""))
        t.report.event("live_reform", step=t.step, old=r.old_world_size, new=d.world_size, round=q.q,
                       old_round=r.old_round, cause=q.cause, failed_at=r.failed_at, receivers=list(q.receivers),
                       ahead=r.ahead, late=r.late, **r.timings(), **extra)
        if r.old_world_size != d.world_size:
            t.report.event("world_size_changed", old=r.old_world_size, new=d.world_size, step=t.step)


__all__ = ["TrainerRecovery"]
