"""The training loop: data-parallel steps that resume exactly after any restart, at any world size.

``Trainer(TrainConfig(...), task).train()`` is the whole program that torchrun's workers run
(``python -m elastic_trainer.train`` parses flags into a ``TrainConfig``). In one screen:

1. **Build**: join the process group (gloo on CPU, NCCL on GPU), seed every RNG, build the task
   (model, dataset, loss), and an ``ElasticSampler`` whose position is a global sample offset.
2. **Resume**: rank 0 finds the newest checkpoint that verifies and every rank loads that step:
   model, optimizer, scheduler, grad scaler, RNG, sampler position, epoch, step, W&B run id.
   The sampler splits the rest of the epoch over the *new* ranks, and the global batch stays
   the same (``--scale-lr`` instead keeps the per-rank batch and scales the learning rate).
3. **Step**: each rank runs its micro-batches (``no_sync`` on all but the last), each weighted by
   ``sampler.loss_weight`` so the all-reduced gradient is the mean over the global batch
   whatever the world size; then the optimizer steps and the sampler commits the step. One small
   all-reduce per step shares the loss and the stop/save decisions, so every rank stops and
   saves at the same step.
4. **Save**: rank 0 saves every ``--checkpoint-every`` steps and/or ``--checkpoint-every-seconds``,
   at the end, and at the step boundary after SIGTERM (then it exits 0 within ``--grace-seconds``).
   Saves are asynchronous except the last one.

Logs (contract with the drills, defined in ``elastic_trainer.records``): a step log (one line per
step, every rank), events (rank 0) and the sample ledger (with ``--sample-ledger``), under
``--log-dir``. See docs/trainer.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from elastic_trainer import config as cfgmod
from elastic_trainer import devices
from elastic_trainer import records
from elastic_trainer.checkpoint import storage
from elastic_trainer.checkpoint.sharded import prepare_saves
from elastic_trainer.records import Event, EventRecord, JsonLines, LedgerRecord, StepRecord
from elastic_trainer.training import metrics
from elastic_trainer.config import TrainConfig
from elastic_trainer.training.metrics import print0
from elastic_trainer.training.live import LiveExcluded, LiveGroup, send_state
from elastic_trainer.training.parallel import Parallel
from elastic_trainer.tasks import Task, as_task, load_builder
from elastic_trainer.training.worker import (
    DistInfo,
    broadcast_object,
    round_fence,
    join_live,
    MicroBatches,
    SignalWatcher,
    seed_everything,
    setup_distributed,
    warm_up_ddp,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

PEER_STOPPED = "a peer was stopped by a signal"
"""Why a rank stops when another node was preempted: it saves with the others, then exits with
``EXIT_PEER_STOPPED`` so that its agent restarts it into a round without the preempted node."""
from elastic_trainer.env import EXIT_PEER_STOPPED, EXIT_PREEMPTED  # noqa: E402 - defined once, in env.py
from elastic_trainer.training.runtime import runtime  # noqa: E402


WANDB_FINISH_S = 3.0
"""At most this long for the W&B run's final flush on a forced exit or an error (offline: milliseconds)."""


def wandb_exit_code(stopped_by: str | None) -> int:
    """The exit code the W&B run ends with: 0 when training finished or reached ``--max-seconds``;
    preempted (143) after this rank's SIGTERM; ``EXIT_PEER_STOPPED`` when another node's was."""
    if stopped_by in ("done", "max-seconds"):
        return 0
    if stopped_by == PEER_STOPPED:
        return EXIT_PEER_STOPPED
    return metrics.PREEMPTED_EXIT_CODE


def collective_failed(exc: BaseException) -> bool:
    """A collective with a peer failed (the peer died, or its group was torn down), on any backend:
    torch raises ``DistError`` subclasses (``DistBackendError`` for NCCL's errors and timeouts), and
    plain ``RuntimeError``s whose text names the backend (gloo, NCCL) or the connection."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(k in text for k in ("gloo", "nccl", "connection", "peer"))


def agree_interval(host_cycle_s: float, device_step_s: float | None = None) -> int:
    """Steps between two step-end agreements: about 0.2 s of steps, 1 to 32. A step takes the
    longer of the host's cycle (start to start) and the device's own time for it (CUDA), since the
    host only queues the GPU's work and runs ahead of it until a synchronisation point."""
    cycle = max(host_cycle_s, device_step_s or 0.0)
    return max(1, min(32, int(0.2 / cycle))) if cycle > 0 else 1


def _abort_world_group() -> None:
    """Abort the default group from another thread (NCCL: ends its collectives in flight with an
    error, which the training thread takes as a failed collective and re-forms)."""
    try:
        if dist.is_initialized():
            dist.group.WORLD.abort()
    except Exception as exc:  # noqa: BLE001 - the group may already be gone (re-formed meanwhile)
        logger.info("live: abort of the process group from the watcher: %s", exc)


def host_step_is_device_state(device: torch.device) -> bool:
    """Whether, when a collective fails, the model and optimizer on ``device`` are those of the last
    step the host completed (so rank 0 may save them without its peers).

    On the CPU (gloo) a collective returns only once it is done, so a failure stops the host before
    the optimizer step. On CUDA (NCCL) ``work.wait()`` only makes the compute stream wait: the host
    queues the optimizer step, and further steps, behind an all-reduce that may never finish, and
    when the group is aborted (watchdog, ``--collective-timeout``) those kernels run on a partial
    result. The host's step then says nothing about the state on the GPU: no save after a failure."""
    return device.type != "cuda"


def run_or_failed_collective(step: Callable[[], T], recover: bool) -> tuple[T | None, str | None]:
    """``(step(), None)``, or ``(None, cause)`` when ``recover`` and a collective failed in it.

    The failure is returned, not handled inside the ``except`` block, so that the re-form runs
    with the failed step's frames (its traceback) released: while anything refers to the broken
    process group its gloo connections stay open (checked: a peer blocked on this process then
    waits until it exits), and a survivor blocked on this one, not on the dead peer, would report
    late and be left out of the next quorum."""
    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001 - only a failed collective is recovered; the rest re-raises
        if not recover or not collective_failed(exc):
            raise
        return None, f"a collective failed ({type(exc).__name__})"


def leave_process_group() -> None:
    """Abort (NCCL: tear the communicators down, unblocking queued work) and destroy the default group.

    What still refers to the group keeps its connections open after ``destroy_process_group``
    (peers blocked on this process then wait until it exits): the caller drops DDP first. (No
    ``gc.collect()`` here: under load it took 0.3-0.4 s of every re-form, and the group goes by
    reference counting once DDP and the failed step's frames are gone.)"""
    if not dist.is_initialized():
        return
    try:
        dist.group.WORLD.abort()
    except Exception as exc:  # noqa: BLE001 - gloo has little to abort; destroy below frees it
        logger.debug("abort of the process group: %s", exc)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may fail to destroy cleanly
        logger.info("destroying the broken process group: %s", exc)


# ---------------------------------------------------------------------------------- trainer


def wandb_config(c: TrainConfig) -> dict[str, Any]:
    """The run config W&B records (and uploads): every flag, credentials in URLs redacted."""
    return {k: storage.redact(v) if isinstance(v, str) else v for k, v in asdict(c).items() if k != "task_args"}

class Trainer:
    """Runs a ``Task`` data-parallel, elastic and resumable; see the module docstring."""

    def __init__(self, config: TrainConfig, task: Task | None = None) -> None:
        self.config = config
        self._task = task
        self._stop_signal: int | None = None
        self._grace_timer: threading.Timer | None = None
        self._boundaries = 0  # step boundaries passed: a SIGTERM watchdog tells a hung step by it
        self._signal_lock = threading.Lock()
        self._saving_after_failure = False
        self._pending: list[tuple] = []  # (step, epoch, offset, loss sum, StepTime, end time) not in the step log yet
        self._boundary_at: float | None = None  # perf_counter at the end of the last step
        self._cycle_s: float | None = None  # seconds from one step's end to the next's
        self._last_step_s: float | None = None
        self.dinfo = DistInfo()
        self.step = 0
        self.run_id: str | None = None
        self.last_loss: float = float("nan")
        self.first_loss: tuple[int, float] | None = None  # (step, loss) of this process's first agreed step
        self._last_save_step: int | None = None
        self._sharded_saver = None  # checkpoint.sharded.ShardedSaver of --fsdp, made at the first save
        self._logged_save_step: int | None = None
        self._status = None  # StatusPublisher of rank 0 (`elastic-train status`), made on first use
        self._status_tried = False

    # ---- build -----------------------------------------------------------------------
    def _build(self) -> None:
        c = self.config
        self.live = LiveGroup.from_env()
        if self.live is not None and (c.fsdp or c.scale_lr):
            raise ValueError(f"live recovery works with DDP and a constant global batch; {'--fsdp' if c.fsdp else '--scale-lr'} "
                             "needs `elastic-train --recovery restart`")
        self.dinfo = d = setup_distributed(c, self.live)
        seed_everything(c.seed)
        task = self._task if self._task is not None else load_builder(c.task)(c.task_args)
        self.task = as_task(task)
        # under FSDP fully_shard moves the model to the device block by block, already sharded
        self.module = self.task.model if self._fsdp() else self.task.model.to(d.device)
        self.log_dir = Path(c.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.node = socket.gethostname()
        pid = os.getpid()
        self.ckpt = None
        if c.checkpoint_dir:
            from elastic_trainer.checkpoint import CheckpointManager

            tag = "live" if self.live is not None else f"r{d.round if d.round is not None else 'x'}"
            writer = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{self.node}-{pid}-{tag}")
            fence = self.live if self.live is not None else round_fence()  # every rank loads what the record names
            self.ckpt = CheckpointManager(c.checkpoint_dir, keep_checkpoints=c.keep_checkpoints,
                                          async_checkpoint=c.async_checkpoint, fence=fence, writer_id=writer[:64])
        if self.live is not None:  # ready to train: only now ask the live group to admit us
            import elastic_trainer.sampler  # noqa: F401 - imported before the others wait for us

            warm_up_ddp()
            if d.device.type == "cuda":  # an NCCL collective may hang on a lost peer instead of failing
                self.live.on_member_lost = lambda why: _abort_world_group()
            join_live(d, c, self.live)
        metrics.set_rank(d.rank)
        self.amp = devices.amp_plan(c.amp, d.device, bf16_supported=d.device.type != "cuda"
                                    or torch.cuda.is_bf16_supported(including_emulation=False))
        devices.set_tf32(d.device, c.tf32)
        self.timer = devices.step_timer(d.device)
        # The run's first line: where it trains, over what, with which build (never CPU by surprise).
        print0(devices.describe(d.device, dist.get_backend() if d.distributed else "none (single process)")
               + f", amp {c.amp}" + (f", tf32 {'on' if c.tf32 else 'off'}" if d.device.type == "cuda" else ""))
        self.gbs = c.global_batch_size * (d.world_size if c.scale_lr else 1)
        self.events = JsonLines(records.events_path(self.log_dir) if d.is_main or self.live else None)
        self.step_log = JsonLines(records.steps_path(self.log_dir, d.rank, pid) if c.step_log else None)
        self.ledger = JsonLines(records.ledger_path(self.log_dir, d.rank, pid) if c.sample_ledger else None)

    def _event(self, event: str, **fields: Any) -> None:
        if self.dinfo.is_main:  # rank 0 of the current world (live recovery changes who that is)
            record = EventRecord(time=time.time(), event=Event(event), **fields)
            self.events.write(record)
            publisher = self._publisher()
            if publisher is not None and record.event != Event.CHECKPOINT_SAVED:  # status shows the newest
                publisher.event(record.to_json())

    def _publisher(self):
        """Rank 0's ``StatusPublisher`` (None elsewhere, or without the etcd-v3 rendezvous)."""
        if not self.dinfo.is_main:
            return None
        if not self._status_tried:
            self._status_tried = True
            from elastic_trainer.training.status import StatusPublisher

            try:
                self._status = StatusPublisher.from_env()
            except Exception as exc:  # noqa: BLE001 - the status is for people; training goes on without it
                logger.warning("status: not publishing to etcd (%s)", exc)
        return self._status

    def _publish_checkpoint(self, step: int, saved_at: float) -> None:
        publisher = self._publisher()
        if publisher is not None:
            publisher.update(checkpoint={"step": step, "time": saved_at,
                                         "url": storage.redact(str(self.config.checkpoint_dir))})

    def _fsdp(self) -> bool:
        return self.config.fsdp and self.dinfo.distributed

    def _load_checkpoint(self) -> tuple[int, dict] | None:
        """Rank 0 picks the newest valid checkpoint; every rank loads that same step.

        Under FSDP a whole-state checkpoint (one written to a store that takes no sharded saves)
        is read by rank 0 alone, which broadcasts all but its model and optimizer; those follow
        after the wrap, tensor by tensor from rank 0 (``Parallel.load_model_state``), so no other
        rank holds a full copy."""
        from elastic_trainer.checkpoint.sharded import is_sharded

        if self.ckpt is None or not self.config.resume:
            return None
        # Of a sharded checkpoint each rank verifies a share of the shard files (no rank reads
        # them all), and the step is trusted only when every rank found its share sound; else
        # every rank moves on to an older one together.
        share = (self.dinfo.rank, self.dinfo.world_size) if self._fsdp() else None
        skip: set[int] = set()
        while True:
            found = self.ckpt.load(share=share, skip=skip) if self.dinfo.is_main else None
            step, sharded = broadcast_object((found[0], is_sharded(found[1])) if found else (None, False), self.dinfo)
            if step is None:
                return None
            if self._fsdp() and not sharded:
                rest = {k: v for k, v in found[1].items() if k not in ("model", "optimizer")} if found else None
                rest = broadcast_object(rest, self.dinfo)
                return found if self.dinfo.is_main else (step, rest)
            if not self.dinfo.is_main:
                found = self.ckpt.load(step, share=share)
            if share is None or not sharded:
                if found is None:
                    raise RuntimeError(f"rank {self.dinfo.rank} could not load checkpoint step-{step} that rank 0 "
                                       f"loaded from {storage.redact(self.config.checkpoint_dir)}; is the storage "
                                       "shared by all nodes?")
                return found
            sound = [None] * self.dinfo.world_size
            dist.all_gather_object(sound, found is not None)
            if all(sound):
                return found
            if self.dinfo.is_main:
                logger.warning("checkpoint step-%d: rank(s) %s found their share of its shards damaged or missing "
                            "(their warnings say which file); every rank tries an older one", step,
                            ", ".join(str(r) for r, ok in enumerate(sound) if not ok))
            skip.add(step)

    def _autocast(self):
        if self.amp.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dinfo.device.type, dtype=self.amp.dtype)

    def _make_optimizer(self) -> None:
        c = self.config
        params = self.model.parameters()
        self.optimizer = (self.task.optimizer_fn(params) if self.task.optimizer_fn is not None
                          else torch.optim.Adam(params, lr=c.lr))
        if c.scale_lr:
            for group in self.optimizer.param_groups:
                group["lr"] *= self.dinfo.world_size
        self.scheduler = self.task.scheduler_fn(self.optimizer) if self.task.scheduler_fn is not None else None
        self.scaler = torch.amp.GradScaler("cuda") if self.amp.scaler else None

    # ---- state -----------------------------------------------------------------------
    def _capture_state(self, any_rank: bool = False) -> dict | None:
        """The checkpoint's content (collective under FSDP; None on ranks other than 0 unless ``any_rank``)."""
        from elastic_trainer.training.rng import gather_rng_states

        sharded = self._sharded() and not any_rank  # each rank saves its own shards (sharded.py)
        model_state = {} if sharded else self.par.model_state()
        optim_state = {} if sharded else self.par.optimizer_state(self.optimizer)
        # every rank's own generators (a collective), unless this rank saves alone (a live peer's
        # state, or rank 0 after a lost peer): then its own only (training/rng.py)
        rng = gather_rng_states(self.dinfo.device, gather=not any_rank and not self._saving_after_failure)
        if not self.dinfo.is_main and not any_rank:
            return None
        parts = {} if sharded else {"model": model_state, "optimizer": optim_state}
        return {
            **parts,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "rng": rng,
            "sampler": self.sampler.state_dict(),
            "meta": {"step": self.step, "epoch": self.sampler.epoch, "offset": self.sampler.offset,
                     "world_size": self.dinfo.world_size, "wandb_run_id": self.run_id,
                     "lr_world_size": self.dinfo.world_size if self.config.scale_lr else 1,
                     "global_batch_size": self.gbs, "round": self.dinfo.round, "time": time.time(),
                     "fsdp": self.par.fsdp, "amp": self.config.amp},
        }

    def _sharded(self) -> bool:
        """Whether checkpoints are sharded: with ``--fsdp``, on every store (``checkpoint/sharded.py``)."""
        return self.par.fsdp and self.ckpt is not None

    def _restore(self, step: int, state: dict) -> None:
        """Put a loaded checkpoint back (model before wrapping; the rest after)."""
        from elastic_trainer.checkpoint import restore_rng_state
        from elastic_trainer.training.rng import rng_state_for_rank

        meta = state.get("meta", {})
        if bool(meta.get("fsdp", False)) != self.par.fsdp:
            raise ValueError(f"checkpoint step-{step} was written {'with' if meta.get('fsdp') else 'without'} --fsdp "
                             f"and its optimizer state is keyed accordingly; resume {'with' if meta.get('fsdp') else 'without'} "
                             "--fsdp, or start over with --no-resume")
        from elastic_trainer.checkpoint.sharded import is_sharded, load_sharded

        if is_sharded(state):  # every rank reads its part of the shards, resharded to this world size
            load_sharded(self.ckpt, step, state, self.module, self.optimizer)
        else:  # under FSDP rank 0's, broadcast (the others hold none: _load_checkpoint)
            self.par.load_optimizer_state(self.optimizer, state.get("optimizer", {}))
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.config.scale_lr:  # the saved learning rate was scaled for the saver's world size
            ratio = self.dinfo.world_size / int(meta.get("lr_world_size", 1))
            for group in self.optimizer.param_groups:
                group["lr"] *= ratio
            if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
                self.scheduler.base_lrs = [lr * ratio for lr in self.scheduler.base_lrs]
        restore_rng_state(rng_state_for_rank(state["rng"], self.dinfo.rank), self.dinfo.device)
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(meta.get("step", step))
        self.run_id = meta.get("wandb_run_id")

    def _resume(self, step: int, state: dict, from_peer: bool = False) -> None:
        """Restore a loaded checkpoint (or a live peer's state) and say so (stdout, events)."""
        c, d = self.config, self.dinfo
        self._restore(step, state)
        prev_world = int(state.get("meta", {}).get("world_size", d.world_size))
        if from_peer:
            print0(f"joined the live group at step {self.step} (state from rank {self.live.quorum.source}, "
                   f"{self._peer_state_s:.3f}s); world size {d.world_size}")
            self._event("peer_state_loaded", step=self.step, epoch=self.sampler.epoch, offset=self.sampler.offset,
                        world_size=d.world_size, source=self.live.quorum.source, seconds=self._peer_state_s,
                        round=d.round)
            return
        self._last_save_step = self.step
        self._publish_checkpoint(self.step, float(state.get("meta", {}).get("time") or time.time()))
        print0(f"resumed from checkpoint step-{self.step} (epoch {self.sampler.epoch}, sample offset "
               f"{self.sampler.offset}) of {storage.redact(c.checkpoint_dir)}")
        self._event("checkpoint_loaded", step=self.step, epoch=self.sampler.epoch, offset=self.sampler.offset,
                    world_size=d.world_size, saved_world_size=prev_world)
        self._event("resume", step=self.step, world_size=d.world_size, restart=d.restart, round=d.round)
        self._check_resume_flags(step)
        saved_amp = state.get("meta", {}).get("amp")
        if saved_amp is not None and saved_amp != c.amp:
            print0(f"--amp changed: {saved_amp} -> {c.amp}"
                   + ("; the grad scaler starts fresh" if self.scaler is not None else ""))
        saved_gbs = state.get("meta", {}).get("global_batch_size")
        if saved_gbs is not None and int(saved_gbs) != self.gbs:
            print0(f"global batch changed: {saved_gbs} -> {self.gbs} samples; epoch {self.sampler.epoch} continues at "
                   f"sample offset {self.sampler.offset} in steps of {self.gbs} ({self.sampler.remaining_steps} left in "
                   f"it); the step count goes on from {self.step} (a step is one optimizer step, whatever its batch)")
        if prev_world != d.world_size:
            print0(f"world size changed: {prev_world} -> {d.world_size} ranks; global batch stays "
                   f"{self.gbs}, {self.sampler.micro_batches_per_step} micro-batch(es) per step on rank 0"
                   if not c.scale_lr else
                   f"world size changed: {prev_world} -> {d.world_size} ranks; global batch now {self.gbs}, "
                   f"learning rate scaled by {d.world_size}/{prev_world}")
            self._event("world_size_changed", old=prev_world, new=d.world_size, step=self.step)

    def _check_resume_flags(self, step: int) -> None:
        """A resumed position past where these flags stop is an error naming the flag, never a
        silent "finished" (a run resumed exactly where it stopped is finished, and says so)."""
        c, s = self.config, self.sampler
        if c.max_steps is not None and self.step > c.max_steps:
            raise ValueError(f"checkpoint step-{step} of {c.checkpoint_dir} is already {self.step - c.max_steps} "
                             f"steps past --max-steps {c.max_steps}; raise --max-steps to train on, or start over "
                             "with --no-resume (or another --checkpoint-dir)")
        if c.epochs is not None and (s.epoch > c.epochs or (s.epoch == c.epochs and s.offset > 0)):
            raise ValueError(f"checkpoint step-{step} of {c.checkpoint_dir} is in epoch {s.epoch + 1} (sample offset "
                             f"{s.offset}), past --epochs {c.epochs}; raise --epochs to train on, or start over with "
                             "--no-resume (or another --checkpoint-dir)")

    def _total_steps(self) -> int:
        """The step to stop at: ``--max-steps`` and/or ``--epochs`` (10**18 when only the sampler can tell).

        With ``--epochs`` it is counted from where the sampler is: the steps left in this epoch from
        its sample offset at the current global batch, plus whole epochs, so a resume with another
        ``--global-batch-size`` trains exactly the samples that are left (a step is one optimizer
        step, whatever its batch, and ``--max-steps`` counts those)."""
        c, s = self.config, self.sampler
        if c.epochs is None:
            return c.max_steps
        if c.scale_lr:  # steps per epoch follow the world size: only the sampler's epoch can tell the end
            return c.max_steps or 10**18
        to_end = 0 if s.epoch >= c.epochs else s.remaining_steps + (c.epochs - s.epoch - 1) * s.steps_per_epoch
        return min(c.max_steps or 10**18, self.step + to_end)

    # ---- the loop ----------------------------------------------------------------------
    def train(self) -> dict:
        """Build, resume, train until done (or stopped), save. Returns a summary dict."""
        old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)  # acted on at the first step boundary
        watcher = SignalWatcher(self._on_sigterm)
        try:
            return self._train()
        finally:
            watcher.close()
            signal.signal(signal.SIGTERM, old_handler)

    def _train(self) -> dict:
        c = self.config
        self._build()
        d = self.dinfo
        from elastic_trainer.sampler import ElasticSampler

        from_peer = self.live is not None and not self.live.quorum.cold
        if from_peer:  # a newcomer: the state comes from a live rank over the new group, not storage
            t0 = time.perf_counter()
            q = self.live.quorum
            state = send_state(None, q.source, q.receivers, d.device)
            loaded = (int(state["meta"]["step"]), state)
            self._peer_state_s = time.perf_counter() - t0
            logger.info("live: received the training state of step %d from rank %d in %.3fs", loaded[0],
                        self.live.quorum.source, self._peer_state_s)
        else:
            loaded = self._load_checkpoint()
        from elastic_trainer.checkpoint.sharded import is_sharded

        full_fsdp = loaded is not None and self._fsdp() and not is_sharded(loaded[1])
        if loaded is not None and "model" in loaded[1] and not full_fsdp:  # into the bare module, before
            self.module.load_state_dict(loaded[1]["model"])  # DDP (a sharded one is loaded after: _restore)
        elif c.init_from is not None and not from_peer and loaded is None and not self._fsdp():
            from elastic_trainer.checkpoint.weights import load_weights

            load_weights(self.module, c.init_from)
            print0(f"initialized the model from {c.init_from}")
        init_shards = None
        if c.init_from is not None and not from_peer and loaded is None and self._fsdp():
            # FSDP: rank 0 alone reads the file (checked against the model); it is broadcast
            # into the shards below, one tensor at a time: no whole copy on every rank
            from elastic_trainer.checkpoint.weights import read_weights

            init_shards = read_weights(self.module, c.init_from) if d.rank == 0 else {}
        self.sampler = self._new_sampler()
        blocks = self.task.fsdp_blocks(self.module) if self.task.fsdp_blocks is not None else None
        self.par = Parallel.wrap(self.module, c, d, blocks=blocks)
        self.model = self.par.model
        if full_fsdp:  # rank 0's whole model, broadcast into the shards
            self.par.load_model_state(loaded[1].get("model", {}))
        elif init_shards is not None:
            self.par.load_model_state(init_shards)
            del init_shards
            print0(f"initialized the model from {c.init_from} (read by rank 0, broadcast into the shards)")
        self._make_optimizer()
        if loaded is not None:
            self._resume(*loaded, from_peer=from_peer)
            del loaded
        else:
            self._event("start", world_size=d.world_size, restart=d.restart, round=d.round)
        if self.run_id is None and d.is_main:  # fixed at the first start: restarts before a checkpoint resume it
            self.run_id = (metrics.fixed_run_id(c.checkpoint_dir or str(self.log_dir), fresh=not c.resume)
                           if c.wandb else metrics.new_run_id())

        spe = self.sampler.steps_per_epoch
        total = self._total_steps()
        until = [f"step {total}"] if total < 10**18 else []
        until += [f"{c.max_seconds:g}s"] if c.max_seconds is not None else []
        print0(f"training from step {self.step} until {' or '.join(until) or 'the sampler ends'}, world size {d.world_size} "
               f"({'distributed ' + dist.get_backend() if d.distributed else 'single process'}, {d.device}), "
               f"global batch {self.gbs}, {spe} steps/epoch, restart {d.restart}, round {d.round}")
        self.wandb = metrics.init_wandb(enabled=c.wandb, run_id=self.run_id, log_dir=str(self.log_dir),
                                        project=c.wandb_project, group=os.environ.get(cfgmod.ENV_RUN_ID),
                                        config=wandb_config(c))
        if self._stop_signal is not None:  # a SIGTERM came before the W&B run existed
            self._mark_preempting()
        self.progress = metrics.Progress(total=total if total < 10**18 else None, initial=self.step,
                                         enabled=c.progress,
                                         seconds=c.max_seconds if c.max_seconds is not None and c.max_steps is None
                                         else None)
        profiler = self._start_profiler()
        stopped_by = None
        try:
            stopped_by = self._loop(total, profiler)
        except BaseException as exc:
            self._abort(exc)
            self.wandb.finish_within(1, WANDB_FINISH_S)  # failed (W&B: not a success); a restart resumes it
            raise
        finally:
            if profiler is not None:
                profiler.stop()
            self.progress.close()
        self._finish(stopped_by)
        return {"step": self.step, "epoch": self.sampler.epoch, "offset": self.sampler.offset,
                "loss": self.last_loss, "stopped_by": stopped_by, "world_size": d.world_size, "run_id": self.run_id}

    def _loop(self, total: int, profiler) -> str:
        """Steps until done or stopped; returns why it ended ("done", "max-seconds", "signal SIGTERM")."""
        c = self.config
        self.batches = MicroBatches(self.task, self.sampler, c.num_workers, c.seed, self.dinfo.device)
        started = last_save = time.monotonic()
        self._agree_in = 1  # steps until the ranks next agree (the first step does)
        self.model.train()
        if self.live is not None:
            self.live.start_watching()
        while not self._done(total):
            reason, failed = run_or_failed_collective(
                lambda: self._loop_step(total, profiler, started, last_save), recover=self.live is not None)
            if failed is not None:  # re-form outside the except block: see run_or_failed_collective
                self._live_reform(failed)
                continue
            if reason == "saved":
                last_save = time.monotonic()
            elif reason == "reform":
                self._live_reform(f"planned: {self.live.change_reason or 'a member asked'}")
            elif reason is not None:
                return reason
        return "done"

    def _loop_step(self, total: int, profiler, started: float, last_save: float) -> str | None:
        """One step, and the agreement when one is due. Returns None to go on, "saved" after a
        periodic save, "reform" when the live group re-forms now, or why training stops."""
        c = self.config
        if self.live is not None:
            self.live.check_lease()  # a worker paused past its lease never starts a step in the old group
        self.timer.start()
        loss_sum = self._train_step(self.batches)
        self._boundaries += 1
        if self._boundaries == 1 and self.ckpt is not None:  # the saves' host memory, made beside the next steps
            self._sharded_saver = prepare_saves(self.ckpt, self.module, self.optimizer, sharded=self._sharded(),
                                                main=self.dinfo.is_main, timeout=self.config.collective_timeout)
        took = self.timer.stop()  # CUDA: known once the GPU ran the step (at the agreement at the latest)
        if took.ready():
            self._last_step_s = took.seconds()
        self._pending.append((self.step, self.sampler.epoch, self.sampler.offset, loss_sum, took, time.time()))
        self._agree_in -= 1
        every_n = c.checkpoint_every is not None and self.step % c.checkpoint_every == 0
        if self._agree_in > 0 and not every_n and not self._done(total):
            self._after_step(profiler)
            return None
        now, main = time.monotonic(), self.dinfo.is_main  # rank 0's clock decides the timed events
        signalled, timed_out, save_due, reform, self._agree_in = self._agree(
            signalled=self._stop_signal is not None,
            timed_out=main and c.max_seconds is not None and now - started >= c.max_seconds,
            save_due=main and c.checkpoint_every_seconds is not None and now - last_save >= c.checkpoint_every_seconds,
            reform=self.live is not None and self.live.change_pending.is_set())
        self._after_step(profiler)
        if signalled and self.live is not None and self._stop_signal is None and not timed_out:
            return "reform"  # a peer was preempted: it leaves, the others go on without it
        if signalled or timed_out:
            if self._stop_signal is not None:
                reason = f"signal {signal.Signals(self._stop_signal).name}"
            elif signalled:  # another node was preempted: save with it, then go on without it
                reason = PEER_STOPPED
            else:
                reason = "max-seconds"
            print0(f"stopping at step {self.step} ({reason})")
            self._event("stop", step=self.step, reason=reason)
            return reason  # _finish saves this step
        if self.ckpt is not None and (save_due or every_n) and not self._done(total):
            self._save(blocking=False)
            return "saved"
        if reform and not self._done(total):
            return "reform"
        return None

    # ---- live recovery (training/live.py) -------------------------------------------------
    def _new_sampler(self):
        from elastic_trainer.sampler import ElasticSampler

        d, c = self.dinfo, self.config
        return ElasticSampler(len(self.task.dataset), self.gbs, d.rank, d.world_size, seed=c.seed,
                              micro_batch_size=c.micro_batch_size)

    def _live_reform(self, cause: str) -> None:
        """Re-form the group in place: same process, same state; a new group at the new world size.

        The step that failed (if any) did not change the parameters under DDP: a collective fails
        inside backward, before the optimizer step, or in the step-end agreement, after it. So
        this rank holds the state of ``self.step``; the quorum continues at the highest step any
        survivor reported, and ranks behind it (and newcomers) load that rank's state."""
        c, d = self.config, self.dinfo
        t0 = time.perf_counter()
        failed_at = time.time()
        self._log_unagreed_steps()
        old_world, old_round, old_rank = d.world_size, d.round, d.rank
        self.par = self.par.unwrap()  # DDP goes before its process group
        self.model = None
        leave_process_group()
        self.optimizer.zero_grad(set_to_none=True)
        torn = time.perf_counter()
        step_s = self._last_step_s or 0.0
        try:
            quorum = self.live.reform(self.step, cause, report_timeout=max(self.live.settings.report_timeout,
                                                                            3 * step_s))
        except LiveExcluded as exc:
            logger.error("live: %s; exiting so that the agent starts this worker again as a newcomer", exc)
            self._event("live_excluded", step=self.step, reason=str(exc))
            raise
        agreed = time.perf_counter()
        d.rank, d.world_size, d.round = quorum.rank_of(self.live.id), quorum.world_size, quorum.q
        metrics.set_rank(d.rank)
        self.live.init_process_group(devices.backend_for(d.device), c.collective_timeout, d.device)
        grouped = time.perf_counter()
        state = None
        if quorum.receivers:
            state = send_state(self._capture_state(any_rank=True) if d.rank == quorum.source else None,
                               quorum.source, quorum.receivers, d.device)
            if state is not None:
                self.module.load_state_dict(state["model"])
        self.par = Parallel.wrap(self.module, c, d)
        self.model = self.par.model
        self.model.train()
        position = self.sampler.state_dict()
        self.sampler = self._new_sampler()
        self.sampler.load_state_dict(position)
        if state is not None:
            self._restore(quorum.step, state)
        del state
        self.batches = MicroBatches(self.task, self.sampler, c.num_workers, c.seed, d.device)
        self._agree_in = 1
        done = time.perf_counter()
        timings = {"teardown_s": torn - t0, "agree_s": agreed - torn, "group_s": grouped - agreed,
                   "state_s": done - grouped, "total_s": done - t0}
        logger.info("live: rank %d -> %d of %d in quorum %d (%s) in %.3fs", old_rank, d.rank, d.world_size,
                    quorum.q, quorum.cause, timings["total_s"])
        print0(f"world size changed: {old_world} -> {d.world_size} ranks without a restart ({quorum.cause}); "
               f"step {self.step}, global batch stays {self.gbs}")
        self._event("live_reform", step=self.step, old=old_world, new=d.world_size, round=quorum.q,
                    old_round=old_round, cause=quorum.cause, failed_at=failed_at,
                    receivers=list(quorum.receivers), **timings)
        if old_world != d.world_size:
            self._event("world_size_changed", old=old_world, new=d.world_size, step=self.step)

    def _done(self, total: int) -> bool:
        c = self.config
        return self.step >= total or (c.epochs is not None and self.sampler.epoch >= c.epochs)

    def _train_step(self, batches: "MicroBatches") -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the sum of its sample losses.

        The step's ledger line is written once its last micro-batch is fetched, before the backward
        that all-reduces the gradients: a step whose all-reduce completed anywhere was logged by
        every rank, even one killed right after it (see ``_abort``).

        Under FSDP every forward and backward is a collective, so every rank runs the same number
        of micro-batches, ``sampler.lockstep_micro_batches``: a rank with a smaller share of an
        uneven global batch (``--micro-batch-size 1``, ``B % W != 0``; any world-size change can
        make it so) runs its last micro-batch once more with weight 0, which adds nothing to the
        gradient or the loss (a model with batch norm would update its running statistics with it)."""
        from elastic_trainer.sampler import loss_weight

        d = self.dinfo
        loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)  # on the device: no sync per micro-batch
        consumed: list[int] = []
        mbps = self.sampler.micro_batches_per_step
        runs = self.sampler.lockstep_micro_batches if self.par.fsdp else mbps
        for i in range(runs):
            if i < mbps:
                epoch, indices, batch = batches.next(first_of_step=i == 0)
                consumed.extend(indices)
                weight = loss_weight(len(indices), self.gbs, d.world_size)
            else:  # padding: the same collectives as the other ranks' extra micro-batch, weight 0
                weight, indices = 0.0, []
            if i == mbps - 1:
                self._log_ledger(self.step + 1, epoch, consumed)
            with (self.par.no_sync() if i < runs - 1 else contextlib.nullcontext()):  # all-reduce on the last only
                with self._autocast():
                    loss = self.task.compute_loss(self.model, batch)
                scaled = loss.float() * weight
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            loss_sum += loss.detach().double() * len(indices)
        if self.config.clip_grad_norm:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
        skipped = False
        if self.scaler is not None:
            before = self.scaler.get_scale()  # waits for the backward, as scaler.step() does to read found_inf
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = devices.scaler_skipped_step(before, self.scaler.get_scale())
        else:
            self.optimizer.step()
        if self.scheduler is not None and not skipped:  # a skipped step leaves the schedule where it is
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sampler.commit_step()
        self.step += 1
        return loss_sum

    def _agree(self, *, signalled: bool, timed_out: bool, save_due: bool,
               reform: bool = False) -> tuple[bool, bool, bool, bool, int]:
        """One small all-reduce every few steps: the global-batch losses of the steps since the last
        one, and stop/save decisions that every rank then shares.

        Returns (some rank got SIGTERM, rank 0's --max-seconds ran out, a timed save is due, some
        rank's live group asks to re-form (a newcomer waits, a member's lease expired), steps until
        the next agreement). A stop or save request from any rank applies to all of them at
        this step, so they save together. A gloo all-reduce costs about 0.25 ms of CPU, 1-2% of a
        small CPU step, so the ranks agree every ``_agree_interval`` steps (about 0.2 s, chosen by
        rank 0 and shared in the same all-reduce), at every checkpoint step and at the last step;
        a SIGTERM is acted on at the next agreement. Then the step log gets the pending steps.
        """
        d = self.dinfo
        losses = torch.stack([p[3] for p in self._pending])
        self._last_step_s = self._pending[-1][4].seconds()  # CUDA: waits for the GPU, as the all-reduce would
        interval = float(self._agree_interval()) if d.is_main else 0.0
        flags = torch.tensor([float(signalled), float(timed_out), float(save_due), float(reform), interval],
                             dtype=torch.float64,
                             device=losses.device)  # the process group's device (NCCL needs CUDA tensors)
        shared = torch.cat([losses, flags])
        if d.distributed and d.world_size > 1:
            dist.all_reduce(shared)
        n = len(self._pending)
        values = shared.tolist()
        for (step, epoch, offset, _, took, ended), loss in zip(self._pending, values[:n]):
            self.last_loss = loss / self.gbs
            if self.first_loss is None:
                self.first_loss = (step, self.last_loss)
            self._log_step(step, epoch, offset, took.seconds(), ended)
        self._pending.clear()
        return values[n] > 0, values[n + 1] > 0, values[n + 2] > 0, values[n + 3] > 0, max(1, int(values[n + 4]))

    def _after_step(self, profiler) -> None:
        if profiler is not None:
            profiler.step()
        if self.config.sleep_per_step:  # testing and drills: a longer step, between two steps
            time.sleep(self.config.sleep_per_step)
        now = time.perf_counter()
        if self._boundary_at is not None:
            self._cycle_s = now - self._boundary_at
        self._boundary_at = now

    def _agree_interval(self) -> int:
        """Steps between agreements: about 0.2 s of steps (start to start), 1 to 32 (rank 0 decides).

        The host's cycle is how long a step took to queue; on CUDA the GPU may be far behind it, so
        the cycle is at least the last step's time on the GPU (CUDA events, ``devices.step_timer``)."""
        return agree_interval(self._cycle_s or 0.0, self._last_step_s if self.dinfo.device.type == "cuda" else None)

    def _log_ledger(self, step: int, epoch: int, consumed: list[int]) -> None:
        self.ledger.write(LedgerRecord(step=step, epoch=epoch, round=self.dinfo.round, indices=consumed))

    def _log_step(self, step: int, epoch: int, offset: int, step_time: float, ended: float) -> None:
        d = self.dinfo
        self.step_log.write(StepRecord(time=ended, step=step, epoch=epoch, offset=offset, world_size=d.world_size,
                                       rank=d.rank, round=d.round, restart=d.restart, loss=self.last_loss,
                                       node=self.node))
        samples_s = self.gbs / step_time if step_time > 0 else 0.0
        publisher = self._publisher()
        if publisher is not None:
            publisher.update(step=step, epoch=epoch, loss=self.last_loss, samples_per_s=samples_s,
                             world_size=d.world_size, round=d.round, node=self.node, state="training")
        self.progress.update(step=step, epoch=epoch, loss=self.last_loss,
                             samples_per_s=samples_s, world_size=d.world_size)
        values = {"global_step": step, "train/loss": self.last_loss, "train/epoch": epoch,
                  "train/world_size": d.world_size, "train/step_time_s": step_time,
                  "train/samples_per_s": samples_s, "train/restarts": d.restart,
                  "train/lr": self.optimizer.param_groups[0]["lr"]}
        st = self._note_commit()
        if st is not None:
            values["checkpoint/blocked_s"] = st.get("blocked_s", 0.0)
            values["checkpoint/total_s"] = (st.get("blocked_s", 0.0) + st.get("serialize_s", 0.0)
                                            + st.get("upload_s", 0.0))
            values["checkpoint/bytes"] = st.get("bytes", 0)
        self.wandb.log(values)

    def _note_commit(self) -> dict | None:
        """Once per committed save: one line for people, the status in etcd; returns its stats."""
        st = self.ckpt.last_save_stats if self.ckpt is not None else None
        if not st or not st.get("committed") or st.get("step") == self._logged_save_step:
            return None
        self._logged_save_step = st.get("step")
        self._publish_checkpoint(int(st["step"]), time.time())
        print0(f"checkpoint step-{st['step']} committed ({st.get('bytes', 0) / 1e6:.1f} MB, blocked "
               f"{st.get('blocked_s', 0.0) * 1000:.0f} ms, {st.get('serialize_s', 0.0) + st.get('upload_s', 0.0):.2f}s "
               f"in all) to {storage.redact(str(self.config.checkpoint_dir))}")
        return st

    def _log_unagreed_steps(self) -> None:
        """After a failed collective: the step log gets the steps whose global loss was never agreed,
        with this rank's loss over its own samples and ``"loss_scope": "rank"``."""
        d = self.dinfo
        share = max(1, self.gbs // max(1, d.world_size))
        for step, epoch, offset, loss_sum, _, ended in self._pending:
            self.step_log.write(StepRecord(time=ended, step=step, epoch=epoch, offset=offset,
                                           world_size=d.world_size, rank=d.rank, round=d.round,
                                           restart=d.restart, loss=float(loss_sum) / share, loss_scope="rank",
                                           node=self.node))
        self._pending.clear()

    def _save(self, *, blocking: bool) -> None:
        """Capture (all ranks under FSDP) and save on rank 0; sharded FSDP: every rank its shards."""
        if self._sharded():
            return self._save_sharded(blocking=blocking or not self.config.async_checkpoint)
        state = self._capture_state()
        self._last_save_step = self.step
        if state is None or self.ckpt is None:
            return
        self.ckpt.wait()  # save() waits for the previous save anyway; say first whether it committed
        self._note_commit()
        blocked = self.ckpt.save(self.step, state, blocking=blocking)
        if blocking:
            self.ckpt.wait()
        stats = self.ckpt.last_save_stats
        committed = stats.get("committed") if blocking else None
        if blocking and not committed:  # a committed save gets its one line from _note_commit
            print0(f"checkpoint step-{self.step} NOT saved to {storage.redact(self.config.checkpoint_dir)}")
        self._note_commit()
        self._event("checkpoint_saved", step=self.step, blocked_s=blocked, blocking=blocking,
                    committed=committed, epoch=self.sampler.epoch, offset=self.sampler.offset,
                    world_size=self.dinfo.world_size)

    def _save_sharded(self, *, blocking: bool) -> None:
        """Every rank copies its shards to CPU memory and writes them (DCP) in the background;
        rank 0 then commits the manifest, fenced (``checkpoint/sharded.py``). The previous save
        is waited for first; ``_finish`` waits for the last."""
        from elastic_trainer.checkpoint.sharded import ShardedSaver

        t0 = time.perf_counter()
        if self._sharded_saver is None:
            self._sharded_saver = ShardedSaver(self.ckpt, timeout=self.config.collective_timeout)
        rest = self._capture_state()
        self._last_save_step = self.step
        self.ckpt.wait()
        self._note_commit()  # the previous save's line
        self._sharded_saver.save(self.step, self.module, self.optimizer, rest, blocking=blocking)
        blocked = time.perf_counter() - t0
        committed = bool(self.ckpt.last_save_stats.get("committed")) if blocking and self.dinfo.is_main else None
        if committed is False:
            print0(f"checkpoint step-{self.step} NOT saved to {storage.redact(self.config.checkpoint_dir)}")
        self._note_commit()
        self._event("checkpoint_saved", step=self.step, blocked_s=blocked, blocking=blocking,
                    committed=committed, epoch=self.sampler.epoch, offset=self.sampler.offset,
                    world_size=self.dinfo.world_size)

    def _finish(self, stopped_by: str | None) -> None:
        """Final blocking save (unless this step is saved already), flush logs, leave the process group."""
        if self.ckpt is not None:
            self.ckpt.wait()
            self._note_commit()  # an async save that committed after the last step's line
            if self.step != self._last_save_step:  # the same decision on every rank (FSDP gathers)
                self._save(blocking=True)
            if self._sharded_saver is not None:
                self._sharded_saver.close()
            self.ckpt.close()
        if self.live is not None:
            if stopped_by == "done" and self.dinfo.is_main:
                self.live.finish()  # waiting newcomers exit 0 instead of starting the run again
            self.live.close()
        self._event("finished" if stopped_by == "done" else "stopped", step=self.step, reason=stopped_by)
        first = f" (step {self.first_loss[0]}: {self.first_loss[1]:.6f})" if self.first_loss else ""
        print0(f"{'finished' if stopped_by == 'done' else 'stopped'} at step {self.step}, loss {self.last_loss:.6f}{first}")
        self.wandb.finish(exit_code=wandb_exit_code(stopped_by))
        if self._status is not None:
            self._status.update(state="finished" if stopped_by == "done" else "stopped", step=self.step)
            self._status.close()
        for f in (self.events, self.step_log, self.ledger):
            f.close()
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        if self.dinfo.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def _abort(self, exc: BaseException | None = None) -> None:
        """On an error (a peer lost, ...): save the last completed step if it can be, and give an
        in-flight async save a bounded chance to commit.

        Under DDP a collective fails either inside backward (the parameters are still those of
        the last completed step) or in the step-end agreement (that step is complete on every
        rank), so rank 0 holds a consistent state it can save without its peers: the work since
        the last periodic checkpoint is kept. The commit is fenced by the rendezvous round.
        FSDP cannot gather its shards without the lost peer, so it falls back to the last save, and
        so does CUDA, where the GPU may have run past the failed collective (``host_step_is_device_state``).
        """
        self._log_unagreed_steps()
        if self.live is not None:  # the state lives on in the other members; leave now, visibly
            self.live.close()
        if self.ckpt is None:
            return
        if self.live is not None:  # a live rank never saves after a failure: it is fenced or recovered
            exc = None
        peer_lost = exc is not None and collective_failed(exc)
        if peer_lost and not host_step_is_device_state(self.dinfo.device):
            logger.warning("a collective failed (%s) on %s: not saving step %d after it (the GPU may have run the "
                           "steps queued behind the failed collective); the newest checkpoint stays",
                           type(exc).__name__, self.dinfo.device, self.step)
            peer_lost = False
        # Every rank wrote the ledger line of this step before its gradient all-reduce, which
        # completed here, so a save of it is accounted for (a peer killed right after that
        # all-reduce included; the drill catalogue once caught a ledger written after it).
        if peer_lost and not self.par.fsdp and self.dinfo.is_main and self.step > (self._last_save_step or 0):
            logger.warning("a collective failed (%s); saving the last completed step %d before exiting",
                           type(exc).__name__, self.step)
            saver = threading.Thread(target=self._save_after_failure, daemon=True)
            saver.start()
            saver.join(timeout=self.config.grace_seconds)
            return
        waiter = threading.Thread(target=self.ckpt.wait, daemon=True)
        waiter.start()
        waiter.join(timeout=self.config.grace_seconds)

    def _save_after_failure(self) -> None:
        self._saving_after_failure = True  # the hung-step watchdog leaves this save to the grace timer
        try:
            self.ckpt.wait()
            self._save(blocking=True)
        except Exception:  # noqa: BLE001 - the worker is exiting with the original error anyway
            logger.exception("could not save step %d after the collective failure", self.step)

    # ---- signals, profiler ---------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any = None) -> None:
        """SIGTERM, from the Python handler (main thread) or the ``SignalWatcher`` (at delivery)."""
        with self._signal_lock:
            if self._stop_signal is not None:
                return
            self._stop_signal = signum
        logger.warning("rank %d got %s: saving at the next step boundary, exiting within %.0fs",
                       self.dinfo.rank, signal.Signals(signum).name, self.config.grace_seconds)
        self._mark_preempting()
        self._grace_timer = threading.Timer(self.config.grace_seconds, self._grace_expired)
        self._grace_timer.daemon = True
        self._grace_timer.start()
        if self._last_step_s is not None and self.dinfo.world_size > 1:
            # A healthy step ends within about one step time. If none ends soon after the signal,
            # the step is stuck in a collective with a peer that is gone (torchrun stops us to
            # re-rendezvous): no save is possible, so do not sit out the whole grace period.
            hung_after = max(2.0, 3 * self._last_step_s)
            watchdog = threading.Timer(hung_after, self._exit_if_hung, args=(self._boundaries, hung_after))
            watchdog.daemon = True
            watchdog.start()

    def _mark_preempting(self) -> None:
        """W&B's ``mark_preempting()``, from a thread of its own: the caller may be a signal handler
        that interrupted the main thread inside a W&B call."""
        logger_ = getattr(self, "wandb", None)
        if logger_ is not None:
            threading.Thread(target=logger_.mark_preempting, name="wandb-preempting", daemon=True).start()

    def _exit_if_hung(self, boundaries_at_signal: int, waited: float) -> None:
        if self._boundaries != boundaries_at_signal or self._saving_after_failure:
            return
        logger.error("rank %d: the step in progress has not ended %.1fs after the signal (steps take %.2fs): "
                     "a peer is gone; exiting without a save (the newest checkpoint stays)",
                     self.dinfo.rank, waited, self._last_step_s or 0.0)
        if self.ckpt is not None:  # an async save already under way may still commit
            self._abort()
        self._flush_wandb_before_exit()
        runtime().exit(EXIT_PREEMPTED, run_hooks=False)

    def _grace_expired(self) -> None:
        logger.error("rank %d: grace period of %.0fs over before the step boundary save finished; exiting now",
                     self.dinfo.rank, self.config.grace_seconds)
        self._flush_wandb_before_exit()
        runtime().exit(EXIT_PREEMPTED, run_hooks=False)

    def _flush_wandb_before_exit(self) -> None:
        """A forced exit skips ``_finish``: end the W&B run as preempted, within ``WANDB_FINISH_S``."""
        logger_ = getattr(self, "wandb", None)
        if logger_ is not None:
            logger_.finish_within(metrics.PREEMPTED_EXIT_CODE, WANDB_FINISH_S)

    def _start_profiler(self):
        c = self.config
        if not c.profile:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule

        out = self.log_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        rank, cuda = self.dinfo.rank, self.dinfo.device.type == "cuda"

        def on_trace_ready(prof) -> None:
            trace = out / f"trace-rank{rank}-step{self.step}.json"
            prof.export_chrome_trace(str(trace))
            table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                              row_limit=40)
            (out / f"key_averages-rank{rank}-step{self.step}.txt").write_text(table)
            print0(f"profiler trace written to {trace}")

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities, record_shapes=True, on_trace_ready=on_trace_ready,
                       schedule=schedule(wait=c.profile_wait, warmup=c.profile_warmup, active=c.profile_active,
                                         repeat=1))
        prof.start()
        return prof
