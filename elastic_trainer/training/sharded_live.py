"""The built-in trainer's live ``--fsdp``: what it does at a re-form, and its peer copies.

``training/hsdp.py`` holds the pieces (the mesh, a rank's shards, who sends which shard);
``training/reshard.py`` cuts a new layout from an old one's shards; ``training/peer_copy.py`` keeps
each rank's shard in a peer's host memory. This module is where the ``Trainer`` uses them, in the
order every rank takes (survivor and newcomer alike, so that their collectives pair up):

1. after the new group is made: every rank's step (``donors``; one all-gather), and who sends
   which shard; every rank "missing" when the shard size changes with the world
   (``--fsdp-shard-all``) or no live replica holds some shard;
2. the model wrapped again on the new mesh around this rank's kept shards, or a peer's
   (``rewrap``), or none yet (missing);
3. missing: ``recover``: the newest complete set of shards, live (a join: the survivors hold every
   old shard) or from peer copies (a lost node), each rank sent its rows of the new layout point to
   point (``reshard.gather``), else the newest checkpoint, resharded by DCP. Either way in the same
   processes.
4. ``moved``: the bytes of shards the re-form sent, summed over the ranks (the ``live_reform``
   event's ``moved_bytes``: what a join or a reshard costs the network).

And in the loop, every K-th step: ``copy`` (``peer_copy.PeerCopies.snapshot``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.training import hsdp, reshard
from elastic_trainer.training.parallel import Parallel

logger = logging.getLogger(__name__)


class ShardedLive:
    """Live ``--fsdp`` for a ``Trainer`` ``t`` (its module, optimizer, checkpoints, manager, config)."""

    def __init__(self, t: Any) -> None:
        self.t = t
        self.skeleton = hsdp.meta_skeleton(t.module)
        """A meta copy of the bare model, wrapped again on each re-form's mesh."""
        c, d = t.config, t.dinfo
        self.copies = None
        if c.fsdp_peer_copy_every:
            from elastic_trainer.training.peer_copy import PeerCopies

            self.copies = PeerCopies(c.fsdp_peer_copy_every, t.manager.host, d.local_world_size)
        self.source = ""
        """Where the last recovery's state came from: "live shards", "peer copies", "checkpoint"."""
        self.sent = self.received = 0
        """Bytes of shards this rank sent and received in the current re-form (``moved`` sums them)."""

    # ---- 1. who sends which shard ----------------------------------------------------------------
    def donors(self, quorum, step: int, kept: hsdp.Shards | None = None) -> dict[int, int | None]:
        """Right after the new group is made (every rank; a newcomer with ``step`` -1): who sends each
        rank its shards (``hsdp.shard_donors``, from every rank's step: one small all-gather); every
        rank is "missing" when the shards' size changes with the world (sharded over all ranks of
        several nodes: ``--fsdp-shard-all``), or a rank needs shards of such a layout. A donor counts
        the bytes of its ``kept`` shards once per receiver (``sent``)."""
        c, d = self.t.config, self.t.dinfo
        self.sent = self.received = 0
        nproc = d.local_world_size
        hsdp.check_layout(quorum.members, nproc)
        steps: list = [None] * quorum.world_size
        dist.all_gather_object(steps, step)
        shape = hsdp.mesh_shape(quorum.world_size, nproc, c.fsdp_shard_all)
        resized = shape[-1] != hsdp.mesh_shape(d.world_size, nproc, c.fsdp_shard_all)[-1]  # the old world's
        if resized or (shape[-1] > nproc and len(set(steps)) > 1):  # no rank holds another's shards
            return {r: None for r in range(quorum.world_size)}
        plan = hsdp.shard_donors(steps, nproc)
        if kept is not None and None not in plan.values():
            self.sent = kept.nbytes * sum(donor == dist.get_rank() for donor in plan.values())
        return plan

    # ---- 2. the model on the new mesh ------------------------------------------------------------
    def wrap_ahead(self, world_size: int, group) -> Parallel | None:
        """A join's model, made beside the training once its groups are (``TrainerRecovery.ahead``, on
        the Manager's thread): the skeleton wrapped on the next world's HSDP mesh, its shards
        allocated, nothing loaded. None when that world's mesh is not HSDP's (its shards change:
        the switch reshards)."""
        t, d = self.t, self.t.dinfo
        new = hsdp.mesh_shape(world_size, d.local_world_size, t.config.fsdp_shard_all)
        if len(new) != 2 or new[-1] != hsdp.mesh_shape(d.world_size, d.local_world_size, t.config.fsdp_shard_all)[-1]:
            return None
        t0 = time.perf_counter()
        made = Parallel.rewrap(self.skeleton, t.config, dataclasses.replace(d, world_size=world_size),
                               blocks=t.task.fsdp_blocks, group=group)
        logger.info("live --fsdp: the model on the mesh of %d ranks made ahead in %.3fs", world_size,
                    time.perf_counter() - t0)
        return made

    def warm_up(self) -> None:
        """A newcomer, its model wrapped, before it says it waits for its shards: its optimizer's
        first step taken now, changing nothing (``hsdp.warm_up_optimizer``), not in its first step
        in the world, which the members' next reductions wait for."""
        t0 = time.perf_counter()
        if hsdp.warm_up_optimizer(self.t.optimizer):
            logger.info("live --fsdp: the optimizer's first step warmed up in %.3fs", time.perf_counter() - t0)

    def rewrap(self, kept: hsdp.Shards, state: dict | None, missing: tuple[int, ...],
               made: Parallel | None = None, join: bool = False) -> int:
        """The model wrapped again on the new group's mesh (``made``: ahead, ``wrap_ahead``), holding
        this rank's kept shards, or those a peer of the same shard index sent (``state``), or none
        yet (``missing``: ``recover`` follows). ``join``: a join switched to beside the training (its
        save in flight settled), whose shards keep their layout: the saver keeps its staging
        buffer. Returns the bytes received (0 when kept)."""
        t = self.t
        old = t.module
        t.par = made if made is not None else Parallel.rewrap(  # the new mesh: its groups came with the default one
            self.skeleton, t.config, t.dinfo, blocks=t.task.fsdp_blocks, group=t.manager.group)
        t.module = t.task.model = t.par.module  # nothing of ours holds the old one (FSDP's own
        hsdp.rebind_optimizer(t.optimizer, old, t.module)  # reference cycles: freed at the next gc)
        t.checkpoints.regrouped(keep=join and not missing)
        if missing:
            return 0
        got = hsdp.Shards.from_state(state["shards"]) if state is not None else kept
        got.load_into(t.module, t.optimizer)
        self.received = got.nbytes if state is not None else 0
        return self.received

    # ---- 3. no live replica holds some shard ---------------------------------------------------------
    def recover(self, kept: hsdp.Shards | None, old: tuple[int, int, int] | None) -> bool:
        """Every rank of the new group (a survivor with its ``kept`` shards and its ``old`` (quorum,
        rank, world); a newcomer with None): the newest complete set of shards, live or from peer
        copies, cut to this rank's new shard; else the newest checkpoint. Returns False when there
        is none (a newcomer then starts as a cold rank would; a survivor raises)."""
        t = self.t
        t0 = time.perf_counter()
        before = t.step
        mine: dict = dict(self.copies.store.items()) if self.copies is not None else {}
        if kept is not None and old is not None:
            q, rank, world = old
            count = hsdp.mesh_shape(world, t.dinfo.local_world_size, t.config.fsdp_shard_all)[-1]
            mine[reshard.Held(q, count, rank % count, t.step, "live")] = kept
        trainer = t.checkpoints.capture(any_rank=True, whole=False) if kept is not None else None
        got = reshard.gather(mine, trainer, t.module, t.dinfo.device)  # this rank's rows, point to point
        if got is not None:
            held = got.used[0]
            got.shards.load_into(t.module, t.optimizer)
            self.sent, self.received = self.sent + got.sent, self.received + got.received
            if held.step != t.step or kept is None:  # a survivor's own sampler, step and RNG are current
                t.checkpoints.restore(held.step, {**got.trainer, "shards": None})
            copied = sum(h.source == "copy" for h in got.used)
            del got
            self.source = "peer copies" if copied else "live shards"
            t.report.print0(f"no live replica holds every shard: rebuilt step {t.step} from {self.source} "
                            f"of {held.shards} shard(s) in {time.perf_counter() - t0:.3f}s, no storage read"
                            + (f" ({before - t.step} steps to redo)" if kept is not None else ""))
            logger.info("live --fsdp: the state of step %d rebuilt from %s (quorum %d, %d shards, %d of them "
                        "copies) in %.3fs", t.step, self.source, held.q, held.shards, copied,
                        time.perf_counter() - t0)
            return True
        loaded = t.checkpoints.load()
        if loaded is None:
            if kept is None:
                return False
            raise RuntimeError(f"live --fsdp: no live replica or peer copy holds every shard and "
                               f"{t.config.checkpoint_dir or 'no --checkpoint-dir'} holds no checkpoint; "
                               "the workers restart")
        t.checkpoints.resume(*loaded)
        self.source = "checkpoint"
        t.report.print0(f"no live replica holds every shard: reloaded checkpoint step-{t.step} in place"
                        + (f" ({before - t.step} steps to redo)" if kept is not None else ""))
        return True

    # ---- 4. what the re-form moved --------------------------------------------------------------------
    def moved(self) -> tuple[int, int]:
        """Every rank of the new group, after its state arrived (one small all-reduce): the bytes of
        shards sent and received by all ranks in this re-form (``Shards.nbytes`` for a replica's
        shards, serialized rows for a reshard), logged per rank."""
        d = self.t.dinfo
        mine = torch.tensor([self.sent, self.received], dtype=torch.int64, device=d.device)
        total = mine.clone()
        dist.all_reduce(total)
        sent, received = (int(x) for x in total.tolist())
        logger.info("live --fsdp: this rank sent %d and received %d bytes of shards; all ranks: %d sent, %d received",
                    self.sent, self.received, sent, received)
        self.sent = self.received = 0
        return sent, received

    # ---- in the loop -----------------------------------------------------------------------------------
    def copy(self) -> None:
        """At every K-th step and the first in a new quorum (all ranks at once): this rank's shards
        to its peer's host memory."""
        t, d = self.t, self.t.dinfo
        if self.copies is None or not self.copies.due(t.step, d.world_size, d.round):
            return
        count = hsdp.mesh_shape(d.world_size, d.local_world_size, t.config.fsdp_shard_all)[-1]
        shards = hsdp.Shards.take(t.module, t.optimizer, settle=False)
        took = self.copies.snapshot(d.round, d.rank, d.world_size, count, t.step, shards,
                                    t.checkpoints.capture(any_rank=True, whole=False))
        logger.debug("peer copy of step %d handed to the sender in %.4fs", t.step, took)

    def close(self) -> None:
        """Stop the peer copies' threads (their summary to the log)."""
        if self.copies is not None:
            logger.info("%s", self.copies.summary())
            self.copies.close()


__all__ = ["ShardedLive"]
