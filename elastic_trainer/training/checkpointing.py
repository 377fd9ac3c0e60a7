"""The trainer's checkpoints: what a checkpoint holds, when it is saved, and how a run resumes.

``Checkpointing`` stands between the training loop and ``elastic_trainer.checkpoint`` (whose
``CheckpointManager`` writes, commits, verifies and prunes, and whose ``ShardedSaver`` writes
``--fsdp`` shards). It reads and writes the trainer's state through ``TrainingState``:

- **capture** (``capture``): model, optimizer, scheduler, grad scaler, every rank's RNG, sampler
  position and ``meta`` (step, epoch, world size, W&B run id, global batch, round, fsdp, amp).
  Under FSDP it is a collective; with ``--fsdp`` the model and optimizer go as shards instead.
- **save** (``save``): rank 0 saves the whole state, or (``--fsdp``) every rank writes its shards
  and rank 0 commits the manifest, fenced. One path for both: the previous save is waited for
  and reported first, then this one starts (asynchronous unless ``blocking``); each commit gets
  one line, the status and an event (``note_commit``).
- **load and resume** (``load``, ``resume``): rank 0 picks the newest checkpoint that verifies and
  every rank loads that step (a sharded one: each rank verifies a share of the shard files);
  ``restore`` puts it back at the current world size, ``resume`` also says so; without one,
  ``init_from`` starts from a weights file (``--init-from``).
- **the end** (``finish``): a final blocking save unless this step is saved already; and after a
  failure (``abort``): rank 0 saves the last completed step when a peer was lost, else an async
  save under way gets a bounded chance to commit.

The fence (who may commit) is the rendezvous round or the live group, given by the caller.
Threads: the save after a failure and the bounded wait run on worker-runtime threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any, ContextManager, Protocol

import torch
import torch.distributed as dist

from elastic_trainer import storage
from elastic_trainer.observability import metrics
from elastic_trainer.config import TrainConfig
from elastic_trainer.training.parallel import Parallel
from elastic_trainer.training.reporting import Reporter
from elastic_trainer.runtime import runtime
from elastic_trainer.training.worker import DistInfo, broadcast_object, round_fence

logger = logging.getLogger(__name__)


class TrainingState(Protocol):
    """What a checkpoint is made of, as the trainer holds it (``Trainer`` is one)."""

    module: torch.nn.Module  # the bare model
    par: Parallel  # its data-parallel wrapper
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LR scheduler, or None
    scaler: torch.amp.GradScaler | None
    sampler: Any  # the ElasticSampler, or a stream's StreamSampler (feed.make_feed)
    step: int  # optimizer steps done (restore sets it)
    run_id: str | None  # the W&B run id (restore sets it)
    gbs: int  # samples per step


def checkpoint_manager(config: TrainConfig, dinfo: DistInfo, live: Any = None):
    """The ``CheckpointManager`` of ``--checkpoint-dir`` (None without one). Its commits are fenced
    by the ``live`` group under live recovery, else by the rendezvous round (so every rank loads
    what the commit record names); its writer id names this host, process and round."""
    if not config.checkpoint_dir:
        return None
    from elastic_trainer.checkpoint import CheckpointManager

    tag = "live" if live is not None else f"r{dinfo.round if dinfo.round is not None else 'x'}"
    fence = live if live is not None else round_fence()
    writer = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{socket.gethostname()}-{os.getpid()}-{tag}")
    return CheckpointManager(config.checkpoint_dir, keep_checkpoints=config.keep_checkpoints,
                             async_checkpoint=config.async_checkpoint, fence=fence, writer_id=writer[:64])


class Checkpointing:
    """Capture, save, load and restore the trainer's state; see the module docstring."""

    def __init__(self, manager, config: TrainConfig, dinfo: DistInfo, state: TrainingState,
                 report: Reporter, slow: Callable[[str], ContextManager] | None = None,
                 group: Callable[[], Any] | None = None) -> None:
        self.manager = manager  # the CheckpointManager, None without --checkpoint-dir
        self.slow = slow or (lambda what: contextlib.nullcontext())
        """``Manager.slow``: marks this rank's local waits (the previous upload, the snapshot) so
        that peers waiting for it do not take it for hung; never a collective (a hang there is one)."""
        self.group = group
        """Gives the sharded saves' gloo group of the current world (the training Manager's
        ``group("checkpoint")``; None: the saver makes one)."""
        self.config, self.dinfo, self.state, self.report = config, dinfo, state, report
        self.last_save_step: int | None = None  # the step saved (or resumed from) last
        self.saving_after_failure = False  # rank 0 saves alone after a lost peer: no RNG gather
        self._sharded_saver = None  # checkpoint.sharded.ShardedSaver of --fsdp, made at the first save
        self._staged = False  # the host memory of the saves to come is made (prepare)
        self._logged_save_step: int | None = None

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are sharded: with ``--fsdp``, on every store (``checkpoint/sharded.py``)."""
        return self.state.par.fsdp and self.manager is not None

    def _fsdp(self) -> bool:
        return self.config.fsdp and self.dinfo.distributed

    # ---- capture and restore ------------------------------------------------------------------
    def capture(self, any_rank: bool = False, whole: bool = True) -> dict | None:
        """The checkpoint's content (collective under FSDP; None on ranks other than 0 unless ``any_rank``).
        ``whole`` False: without model and optimizer (a live HSDP donor sends its own shards instead)."""
        from elastic_trainer.training.rng import gather_rng_states

        s, d = self.state, self.dinfo
        sharded = (self.sharded and not any_rank) or not whole  # each rank saves its own shards (sharded.py)
        model_state = {} if sharded else s.par.model_state()
        optim_state = {} if sharded else s.par.optimizer_state(s.optimizer)
        # every rank's own generators (a collective), unless this rank saves alone (a live peer's
        # state, or rank 0 after a lost peer): then its own only (training/rng.py)
        rng = gather_rng_states(d.device, gather=not any_rank and not self.saving_after_failure)
        if not d.is_main and not any_rank:
            return None
        parts = {} if sharded else {"model": model_state, "optimizer": optim_state}
        return {
            **parts,
            "scheduler": s.scheduler.state_dict() if s.scheduler is not None else {},
            "scaler": s.scaler.state_dict() if s.scaler is not None else {},
            "rng": rng,
            "sampler": s.sampler.state_dict(),
            "meta": {"step": s.step, "epoch": s.sampler.epoch, "offset": s.sampler.offset,
                     "world_size": d.world_size, "wandb_run_id": s.run_id,
                     "lr_world_size": d.world_size if self.config.scale_lr else 1,
                     "global_batch_size": s.gbs, "round": d.round, "time": time.time(),
                     "fsdp": s.par.fsdp, "amp": self.config.amp},
        }

    def restore(self, step: int, state: dict) -> None:
        """Put a loaded checkpoint back, but for a whole model (loaded by the caller, see
        ``load_model``): optimizer (or the shards), scheduler, scaler, RNG, sampler, step, run id."""
        from elastic_trainer.checkpoint import restore_rng_state
        from elastic_trainer.checkpoint.sharded import is_sharded, load_sharded
        from elastic_trainer.training.rng import rng_state_for_rank

        s, d = self.state, self.dinfo
        meta = state.get("meta", {})
        if bool(meta.get("fsdp", False)) != s.par.fsdp:
            raise ValueError(f"checkpoint step-{step} was written {'with' if meta.get('fsdp') else 'without'} --fsdp "
                             f"and its optimizer state is keyed accordingly; resume {'with' if meta.get('fsdp') else 'without'} "
                             "--fsdp, or start over with --no-resume")
        if is_sharded(state):  # every rank reads its part of the shards, resharded to this world size
            load_sharded(self.manager, step, state, s.module, s.optimizer)
        elif "shards" in state or ("optimizer" in state and state["optimizer"] is None):
            pass  # a live HSDP peer's own shards, or a live peer's state whose bulk comes later: the caller's
        else:  # under FSDP rank 0's, broadcast (the others hold none: load)
            s.par.load_optimizer_state(s.optimizer, state.get("optimizer", {}))
        if s.scheduler is not None and state.get("scheduler"):
            s.scheduler.load_state_dict(state["scheduler"])
        if s.scaler is not None and state.get("scaler"):
            s.scaler.load_state_dict(state["scaler"])
        if self.config.scale_lr:  # the saved learning rate was scaled for the saver's world size
            ratio = d.world_size / int(meta.get("lr_world_size", 1))
            for group in s.optimizer.param_groups:
                group["lr"] *= ratio
            if s.scheduler is not None and hasattr(s.scheduler, "base_lrs"):
                s.scheduler.base_lrs = [lr * ratio for lr in s.scheduler.base_lrs]
        restore_rng_state(rng_state_for_rank(state["rng"], d.rank), d.device)
        s.sampler.load_state_dict(state["sampler"])
        s.step = int(meta.get("step", step))
        s.run_id = meta.get("wandb_run_id")

    def regrouped(self, keep: bool = False) -> None:
        """After a live re-form: the sharded saver's group went with the old process group; the next
        save makes a new one (an async save in flight on the old group has failed with it). ``keep``
        (a join that kept this rank's shards, its save in flight settled): the saver and its staging
        buffer stay, and only the group and folder are asked again (``prepare``)."""
        if keep and self._sharded_saver is not None:
            self._sharded_saver.regroup()
        else:
            self._sharded_saver, self._staged = None, False

    def load_model(self, state: dict) -> None:
        """A loaded checkpoint's whole model into the wrapped one: under DDP every rank loads it into
        the bare module (its parameters are the wrapper's); under FSDP rank 0's is broadcast into
        the shards (the others pass none). A sharded checkpoint's shards come with ``restore``."""
        from elastic_trainer.checkpoint.sharded import is_sharded

        if is_sharded(state):
            return
        if self.state.par.fsdp:
            self.state.par.load_model_state(state.get("model", {}))
        elif "model" in state:
            self.state.module.load_state_dict(state["model"])

    def init_from(self, path: str) -> None:
        """``--init-from`` (no checkpoint to resume): a safetensors file's weights into the model
        (FSDP: rank 0 alone reads the file, checked against the model, and it is broadcast into the
        shards one tensor at a time: no whole copy on every rank)."""
        from elastic_trainer.checkpoint.weights import load_weights, read_weights

        par = self.state.par
        if par.fsdp:
            par.load_model_state(read_weights(self.state.module, path) if self.dinfo.rank == 0 else {})
            self.report.print0(f"initialized the model from {path} (read by rank 0, broadcast into the shards)")
        else:
            load_weights(self.state.module, path)
            self.report.print0(f"initialized the model from {path}")

    # ---- load --------------------------------------------------------------------------------
    def load(self) -> tuple[int, dict] | None:
        """Rank 0 picks the newest valid checkpoint; every rank loads that same step.

        Under FSDP a whole-state checkpoint (one written to a store that takes no sharded saves)
        is read by rank 0 alone, which broadcasts all but its model and optimizer; those follow
        tensor by tensor from rank 0 (``load_model``, ``Parallel.load_model_state``), so no other
        rank holds a full copy."""
        from elastic_trainer.checkpoint.sharded import is_sharded

        d = self.dinfo
        if self.manager is None or not self.config.resume:
            return None
        # Of a sharded checkpoint each rank verifies a share of the shard files (no rank reads
        # them all), and the step is trusted only when every rank found its share sound; else
        # every rank moves on to an older one together.
        share = (d.rank, d.world_size) if self._fsdp() else None
        skip: set[int] = set()
        while True:
            found = self.manager.load(share=share, skip=skip) if d.is_main else None
            step, sharded = broadcast_object((found[0], is_sharded(found[1])) if found else (None, False), d)
            if step is None:
                return None
            if self._fsdp() and not sharded:
                rest = {k: v for k, v in found[1].items() if k not in ("model", "optimizer")} if found else None
                rest = broadcast_object(rest, d)
                return found if d.is_main else (step, rest)
            if not d.is_main:
                found = self.manager.load(step, share=share)
            if share is None or not sharded:
                if found is None:
                    raise RuntimeError(f"rank {d.rank} could not load checkpoint step-{step} that rank 0 "
                                       f"loaded from {storage.redact(self.config.checkpoint_dir)}; is the storage "
                                       "shared by all nodes?")
                return found
            sound = [None] * d.world_size
            dist.all_gather_object(sound, found is not None)
            if all(sound):
                return found
            if d.is_main:
                logger.warning("checkpoint step-%d: rank(s) %s found their share of its shards damaged or missing "
                               "(their warnings say which file); every rank tries an older one", step,
                               ", ".join(str(r) for r, ok in enumerate(sound) if not ok))
            skip.add(step)

    def resume(self, step: int, state: dict) -> None:
        """Restore a loaded checkpoint (its model included) and say so: lines, status, events; a
        position past where the flags stop is an error naming the flag."""
        c, d, s, say = self.config, self.dinfo, self.state, self.report.print0
        self.load_model(state)
        self.restore(step, state)
        meta = state.get("meta", {})
        prev_world = int(meta.get("world_size", d.world_size))
        self.last_save_step = s.step
        self.report.publish_checkpoint(s.step, float(meta.get("time") or time.time()))
        if d.is_main:
            metrics.checkpoint_loaded(float(meta.get("time") or time.time()))
        say(f"resumed from checkpoint step-{s.step} (epoch {s.sampler.epoch}, sample offset "
            f"{s.sampler.offset}) of {storage.redact(c.checkpoint_dir)}")
        self.report.event("checkpoint_loaded", step=s.step, epoch=s.sampler.epoch, offset=s.sampler.offset,
                          world_size=d.world_size, saved_world_size=prev_world)
        self.report.event("resume", step=s.step, world_size=d.world_size, restart=d.restart, round=d.round)
        self._check_resume_flags(step)
        saved_amp = meta.get("amp")
        if saved_amp is not None and saved_amp != c.amp:
            say(f"--amp changed: {saved_amp} -> {c.amp}" + ("; the grad scaler starts fresh" if s.scaler is not None else ""))
        saved_gbs = meta.get("global_batch_size")
        if saved_gbs is not None and int(saved_gbs) != s.gbs:
            say(f"global batch changed: {saved_gbs} -> {s.gbs} samples; epoch {s.sampler.epoch} continues at "
                f"sample offset {s.sampler.offset} in steps of {s.gbs} ({s.sampler.remaining_steps} left in "
                f"it); the step count goes on from {s.step} (a step is one optimizer step, whatever its batch)")
        if prev_world != d.world_size:
            say(f"world size changed: {prev_world} -> {d.world_size} ranks; global batch stays "
                f"{s.gbs}, {s.sampler.micro_batches_per_step} micro-batch(es) per step on rank 0"
                if not c.scale_lr else
                f"world size changed: {prev_world} -> {d.world_size} ranks; global batch now {s.gbs}, "
                f"learning rate scaled by {d.world_size}/{prev_world}")
            self.report.event("world_size_changed", old=prev_world, new=d.world_size, step=s.step)

    def _check_resume_flags(self, step: int) -> None:
        """A resumed position past where these flags stop is an error naming the flag, never a
        silent "finished" (a run resumed exactly where it stopped is finished, and says so)."""
        c, s = self.config, self.state.sampler
        at = self.state.step
        if c.max_steps is not None and at > c.max_steps:
            raise ValueError(f"checkpoint step-{step} of {c.checkpoint_dir} is already {at - c.max_steps} "
                             f"steps past --max-steps {c.max_steps}; raise --max-steps to train on, or start over "
                             "with --no-resume (or another --checkpoint-dir)")
        if c.epochs is not None and (s.epoch > c.epochs or (s.epoch == c.epochs and s.offset > 0)):
            raise ValueError(f"checkpoint step-{step} of {c.checkpoint_dir} is in epoch {s.epoch + 1} (sample offset "
                             f"{s.offset}), past --epochs {c.epochs}; raise --epochs to train on, or start over with "
                             "--no-resume (or another --checkpoint-dir)")

    # ---- save --------------------------------------------------------------------------------
    def note_commit(self) -> dict | None:
        """Once per committed save: one line for people, the status in etcd; returns its stats."""
        st = self.manager.last_save_stats if self.manager is not None else None
        if not st or not st.get("committed") or st.get("step") == self._logged_save_step:
            return None
        self._logged_save_step = st.get("step")
        self.report.publish_checkpoint(int(st["step"]), time.time())
        metrics.checkpoint_committed(float(st.get("blocked_s", 0.0)))  # the node's /metrics (rank 0: the committer)
        self.report.print0(f"checkpoint step-{st['step']} committed ({st.get('bytes', 0) / 1e6:.1f} MB, blocked "
                           f"{st.get('blocked_s', 0.0) * 1000:.0f} ms, "
                           f"{st.get('serialize_s', 0.0) + st.get('upload_s', 0.0):.2f}s "
                           f"in all) to {storage.redact(str(self.config.checkpoint_dir))}")
        return st

    def prepare(self, staging: bool = True) -> None:
        """After the first step, on every rank: have the host memory of the saves to come made
        beside the next steps (``checkpoint.sharded.prepare_saves``: page-locked for a GPU state,
        on a thread of the worker runtime), so that the first save blocks no longer than the later
        ones; once. Under ``--fsdp`` this also makes the ``ShardedSaver`` the saves use and asks for
        its folder's name (every rank at once: a live re-form's ranks call it there, ``staging``
        False for a newcomer, whose first step makes its memory as a cold start's does)."""
        if self.manager is None or (self._staged and not self.sharded):
            return
        s = self.state
        if self.sharded and self._sharded_saver is not None:  # kept, or made without staging
            self._sharded_saver.prepare(s.module, s.optimizer, staging=staging and not self._staged)
            self._staged = self._staged or staging
            return
        from elastic_trainer.checkpoint.sharded import prepare_saves

        saver = prepare_saves(self.manager, s.module, s.optimizer, sharded=self.sharded, main=self.dinfo.is_main,
                              timeout=self.config.collective_timeout, group=self.group, staging=staging)
        self._staged = staging
        if saver is not None:
            self._sharded_saver = saver

    def save(self, *, blocking: bool) -> None:
        """Save this step: capture (all ranks under FSDP), wait for the previous save and report it,
        then start this one: rank 0 the whole state, or (``--fsdp``) every rank copies its shards to
        CPU memory and writes them (DCP) in the background and rank 0 commits the manifest, fenced
        (``checkpoint/sharded.py``). ``blocking`` (always with ``--no-async-checkpoint`` when
        sharded) waits until it committed; ``finish`` waits for the last one."""
        s, d, sharded = self.state, self.dinfo, self.sharded
        blocking = blocking or (sharded and not self.config.async_checkpoint)
        t0 = time.perf_counter()
        if sharded and self._sharded_saver is None:
            from elastic_trainer.checkpoint.sharded import ShardedSaver

            self._sharded_saver = ShardedSaver(self.manager, timeout=self.config.collective_timeout, group=self.group)
        state = self.capture()
        self.last_save_step = s.step
        if self.manager is None or (state is None and not sharded):
            return
        with self.slow("checkpoint"):  # this rank alone: the previous upload may still run
            self.manager.wait()  # save() waits for the previous save anyway; say first whether it committed
        self.note_commit()
        if sharded:
            self._sharded_saver.save(s.step, s.module, s.optimizer, state, blocking=blocking)
            blocked = time.perf_counter() - t0
        else:
            with self.slow("checkpoint"):  # rank 0's snapshot (and with blocking, its upload)
                blocked = self.manager.save(s.step, state, blocking=blocking)
                if blocking:
                    self.manager.wait()
        committed = bool(self.manager.last_save_stats.get("committed")) if blocking and d.is_main else None
        if committed is False:  # a committed save gets its one line from note_commit
            self.report.print0(f"checkpoint step-{s.step} NOT saved to {storage.redact(self.config.checkpoint_dir)}")
        self.note_commit()
        self.report.event("checkpoint_saved", step=s.step, blocked_s=blocked, blocking=blocking,
                          committed=committed, epoch=s.sampler.epoch, offset=s.sampler.offset,
                          world_size=d.world_size)

    def settle(self) -> None:
        """Before a planned re-form (a node joins, a member leaves on its own: every rank of the old
        group is alive): wait for the save in flight to commit. Its collectives run on a subgroup of
        the old group, which the re-form tears down: a save cut there is lost, and a node lost after
        the join would find no checkpoint to reload (the flaky late-join test: its survivors
        restarted). Costs the join the rest of that save, and nothing when none is in flight. Only
        sharded saves (``--fsdp``) use the group: a whole-state save in flight writes on from rank 0's
        thread, and a join does not wait for it (a multi-GB upload would be its pause)."""
        if self.manager is None or self._sharded_saver is None:
            return
        with self.slow("checkpoint"):  # this rank's wait: not a hang
            self.manager.wait()
        self.note_commit()

    def finish(self) -> None:
        """The end of training: a final blocking save unless this step is saved already (the same
        decision on every rank: FSDP gathers), then the savers close."""
        if self.manager is None:
            return
        self.manager.wait()
        self.note_commit()  # an async save that committed after the last step's line
        if self.state.step != self.last_save_step:
            self.save(blocking=True)
        if self._sharded_saver is not None:
            self._sharded_saver.close()
        self.manager.close()

    def abort(self, peer_lost: BaseException | None, *, device_state: bool) -> None:
        """After an error: save the last completed step if it can be, and give an in-flight async
        save a bounded chance (``--grace-seconds``) to commit.

        ``peer_lost``: the failed collective, when a peer was lost (None for any other error, and
        on a live rank: its state lives on in the other members, and it is fenced or recovered).
        Under DDP a collective fails either inside backward (the parameters are still those of
        the last completed step) or in the step-end agreement (that step is complete on every
        rank), so rank 0 holds a consistent state it can save without its peers: the work since
        the last periodic checkpoint is kept. The commit is fenced by the rendezvous round.
        FSDP cannot gather its shards without the lost peer, so it falls back to the last save, and
        so does CUDA, where the GPU may have run past the failed collective (``device_state``
        False: the host's step says nothing about the state on the device).
        """
        if self.manager is None:
            return
        step = self.state.step
        if peer_lost is not None and not device_state:
            logger.warning("a collective failed (%s) on %s: not saving step %d after it (the GPU may have run the "
                           "steps queued behind the failed collective); the newest checkpoint stays",
                           type(peer_lost).__name__, self.dinfo.device, step)
            peer_lost = None
        # Every rank wrote the ledger line of this step before its gradient all-reduce, which
        # completed here, so a save of it is accounted for (a peer killed right after that
        # all-reduce included; the drill catalogue once caught a ledger written after it).
        if peer_lost is not None and not self.state.par.fsdp and self.dinfo.is_main and step > (self.last_save_step or 0):
            logger.warning("a collective failed (%s); saving the last completed step %d before exiting",
                           type(peer_lost).__name__, step)
            runtime().start_thread("checkpoint-after-failure", self._save_after_failure).join(
                timeout=self.config.grace_seconds)
            return
        runtime().start_thread("checkpoint-wait", self.manager.wait).join(timeout=self.config.grace_seconds)

    def _save_after_failure(self) -> None:
        self.saving_after_failure = True  # the hung-step watchdog leaves this save to the grace timer
        try:
            self.manager.wait()
            self.save(blocking=True)
        except Exception:  # noqa: BLE001 - the worker is exiting with the original error anyway
            logger.exception("could not save step %d after the collective failure", self.state.step)
