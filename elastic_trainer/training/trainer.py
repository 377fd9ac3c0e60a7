"""The training loop: data-parallel steps that resume exactly after any restart, at any world size.

``Trainer(TrainConfig(...), task).train()`` is the whole program that torchrun's workers run
(``python -m elastic_trainer.train`` parses flags into a ``TrainConfig``). ``Trainer.__init__``
builds; ``train()`` resumes, loops and saves:

1. **Build**: join the process group (gloo on CPU, NCCL on GPU), seed every RNG, build the task
   (model, dataset, loss), wrap the model (DDP or FSDP), make the optimizer and the
   data feed (``feed.make_feed``: an ``ElasticSampler`` whose position is a global sample offset, or
   for a streamed source its ``StreamSampler``); and the trainer's three helpers:
   ``Checkpointing`` (``training/checkpointing.py``), ``Reporter`` (``training/reporting.py``:
   lines, bar, W&B, status, records) and ``Preemption`` (``training/preemption.py``: SIGTERM).
2. **Resume**: rank 0 finds the newest checkpoint that verifies and every rank loads that step:
   model, optimizer, scheduler, grad scaler, RNG, sampler position, epoch, step, W&B run id.
   The sampler splits the rest of the epoch over the *new* ranks, and the global batch stays
   the same (``--scale-lr`` instead keeps the per-rank batch and scales the learning rate).
3. **Step**: each rank runs its micro-batches (``no_sync`` on all but the last), each weighted by
   ``sampler.loss_weight`` so the all-reduced gradient is the mean over the global batch
   whatever the world size; then the optimizer steps and the sampler commits the step. One small
   all-reduce per step shares the loss and the stop/save decisions, so every rank stops and
   saves at the same step.
4. **Save**: every ``--checkpoint-every`` steps and/or ``--checkpoint-every-seconds``, at the end,
   and at the step boundary after SIGTERM (then it exits 0 within ``--grace-seconds``). Saves
   are asynchronous except the last one.

Logs (contract with the drills, defined in ``elastic_trainer.records``): a step log (one line per
step, every rank), events (rank 0) and the sample ledger (with ``--sample-ledger``), under
``--log-dir``. See docs/trainer.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from elastic_trainer import devices
from elastic_trainer.config import TrainConfig
from elastic_trainer.tasks import Task, as_task, load_builder
from elastic_trainer.training import hsdp, metrics
from elastic_trainer.training.checkpointing import Checkpointing, checkpoint_manager
from elastic_trainer.env import WorkerEnv
from elastic_trainer.sampler import loss_weight
from elastic_trainer.training.manager import LiveExcluded, Manager, agree_interval, host_step_is_device_state
from elastic_trainer.training.parallel import Parallel
from elastic_trainer.training.preemption import Preemption
from elastic_trainer.training.reporting import Reporter, start_profiler
from elastic_trainer.training.trainer_live import TrainerRecovery
from elastic_trainer.training.feed import make_feed, prepare as prepare_data
from elastic_trainer.training.worker import seed_everything, setup_distributed

logger = logging.getLogger(__name__)


def stop_step(config: TrainConfig, sampler, step: int) -> int:
    """The step to stop at: ``--max-steps`` and/or ``--epochs`` (10**18 when only the sampler, or
    ``--max-seconds`` alone, can tell).

    With ``--epochs`` it is counted from where the sampler is: the steps left in this epoch from
    its sample offset at the current global batch, plus whole epochs, so a resume with another
    ``--global-batch-size`` trains exactly the samples that are left (a step is one optimizer
    step, whatever its batch, and ``--max-steps`` counts those)."""
    c, s = config, sampler
    if c.epochs is None:
        return c.max_steps if c.max_steps is not None else 10**18
    if c.scale_lr:  # steps per epoch follow the world size: only the sampler's epoch can tell the end
        return c.max_steps or 10**18
    to_end = 0 if s.epoch >= c.epochs else s.remaining_steps + (c.epochs - s.epoch - 1) * s.steps_per_epoch
    return min(c.max_steps or 10**18, step + to_end)


def build_optimizer(task: Task, model: torch.nn.Module, config: TrainConfig, world_size: int):
    """``(optimizer, scheduler)``: the task's (default Adam at ``--lr``; ``--scale-lr`` multiplies
    the learning rate by ``world_size``) and its LR scheduler, or None."""
    params = model.parameters()
    optimizer = task.optimizer_fn(params) if task.optimizer_fn is not None else torch.optim.Adam(params, lr=config.lr)
    if config.scale_lr:
        for group in optimizer.param_groups:
            group["lr"] *= world_size
    return optimizer, task.scheduler_fn(optimizer) if task.scheduler_fn is not None else None


# ---------------------------------------------------------------------------------- trainer


class Trainer:
    """Runs a ``Task`` data-parallel, elastic and resumable; see the module docstring."""

    def __init__(self, config: TrainConfig, task: Task | None = None) -> None:
        """Build everything: the process group (a live newcomer: its admission, and the state from
        a peer), the task, the wrapped model, optimizer, sampler, and the trainer's helpers."""
        c = self.config = config
        self.preemption = Preemption(c.grace_seconds)  # first: a SIGTERM during start-up is acted on too
        try:
            env = WorkerEnv.from_environ()
            if env.live is not None and c.scale_lr:
                raise ValueError("live recovery works with a constant global batch; --scale-lr "
                                 "needs `elastic-train --recovery restart`")
            self.dinfo = d = setup_distributed(c, env)
            self.manager = Manager(d.device, collective_timeout=c.collective_timeout, env=env,
                                   samples_per_step=c.global_batch_size)
            seed_everything(c.seed)
            self.task = as_task(task if task is not None else load_builder(c.task)(c.task_args))
            prepare_data(self.task)  # a stream's row counts, read before a live newcomer asks to be admitted
            # under FSDP fully_shard moves the model to the device block by block, already sharded
            self.module = self.task.model if c.fsdp and d.distributed else self.task.model.to(d.device)
            self.log_dir = Path(c.log_dir)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            manager = checkpoint_manager(c, d, self.manager.fence)  # before a live newcomer asks to be admitted
            self.live = TrainerRecovery(self)  # what a live re-form asks of this trainer (trainer_live.py)
            if c.fsdp:  # the mesh's groups and the saves': made with every default group (ahead of a join)
                self.manager.plan_groups(hsdp.group_plan(d.local_world_size, c.fsdp_shard_all,
                                                         checkpoint=manager is not None))
            self.manager.start(recovery=self.live)  # live: only now, ready to train, ask to be admitted
            d.distributed, d.rank, d.world_size, d.round = (self.manager.distributed, self.manager.rank,
                                                            self.manager.world_size, self.manager.round)
            self.live.started()
            self.gbs = c.global_batch_size * (d.world_size if c.scale_lr else 1)
            self.report = Reporter(c, d, self.log_dir, gbs=self.gbs, live=self.manager.live)
            self.amp = devices.amp_plan(c.amp, d.device, bf16_supported=d.device.type != "cuda"
                                        or torch.cuda.is_bf16_supported(including_emulation=False))
            devices.set_tf32(d.device, c.tf32)
            self.timer = devices.step_timer(d.device)
            self.report.device_line()  # the run's first line: where it trains (never CPU by surprise)
            # map-style or a stream, read from the position loaded later; made first: a live newcomer's
            # peer sends the state meanwhile
            self.sampler, self.batches = self.new_feed()
            self.live.receive()  # a live newcomer: the state from a peer, not storage (--fsdp on gloo: below)
            moved = (self.manager.rank, self.manager.world_size) != (d.rank, d.world_size)
            d.rank, d.world_size, d.round = self.manager.rank, self.manager.world_size, self.manager.round
            if moved:  # a member was lost while it waited: it re-formed with the others (Manager.receive_state)
                self.sampler, self.batches = self.new_feed()
            blocks = self.task.fsdp_blocks(self.module) if self.task.fsdp_blocks is not None else None
            self.par = Parallel.wrap(self.module, c, d, blocks=blocks, group=self.manager.group,
                                     init_sync=not self.live.receiving)  # (its parameters come late)
            self.model = self.par.model
            self.manager.time_steps(self.par.ddp)  # DDP: each rank's own step time, which names a straggler
            self.optimizer, self.scheduler = build_optimizer(self.task, self.model, c, d.world_size)
            self.scaler = torch.amp.GradScaler("cuda") if self.amp.scaler else None
            self.step = 0
            self.run_id: str | None = None
            self.last_loss: float = float("nan")
            self.first_loss: tuple[int, float] | None = None  # (step, loss) of this process's first agreed step
            self.checkpoints = Checkpointing(manager, c, d, self, self.report, slow=self.manager.slow,
                                             group=lambda: self.manager.group("checkpoint"))
            self.profiler = None  # torch.profiler's, with --profile (train() starts it)
            self.pending: list[tuple] = []  # (step, epoch, offset, loss sum, StepTime, end time) not in the step log yet
            self._boundary_at: float | None = None  # perf_counter at the end of the last step
            self._cycle_s: float | None = None  # seconds from one step's end to the next's
            self._last_step_s: float | None = None
            self.preemption.watch(d, step_seconds=lambda: self._last_step_s, on_signal=self.report.mark_preempting,
                                  saving=lambda: self.checkpoints.saving_after_failure,  # an async save under way
                                  on_hung=lambda: self._abort() if self.checkpoints.manager is not None else None)
            self.live.wrapped()  # a live newcomer under --fsdp: its shards loaded (on gloo received now, ready to train)
        except BaseException:
            self.preemption.close()
            raise

    # ---- train: resume, loop, save -------------------------------------------------------
    def train(self) -> dict:
        """Resume, train until done (or stopped), save. Returns a summary dict."""
        c, d = self.config, self.dinfo
        try:
            self._resume()
            total = stop_step(c, self.sampler, self.step)
            self.report.start(self.run_id, total=total if total < 10**18 else None, step=self.step,
                              steps_per_epoch=self.sampler.steps_per_epoch,
                              preempting=self.preemption.signalled)  # a SIGTERM before the W&B run existed
            self.profiler = start_profiler(c, self.log_dir, d, lambda: self.step, self.report.print0)
            try:
                stopped_by = self._loop(total)
            except BaseException as exc:
                self._abort(exc)
                self.report.failed()
                raise
            finally:
                if self.profiler is not None:
                    self.profiler.stop()
                self.report.progress.close()
            self._finish(stopped_by)
        finally:
            self.preemption.close()
        return {"step": self.step, "epoch": self.sampler.epoch, "offset": self.sampler.offset,
                "loss": self.last_loss, "stopped_by": stopped_by, "world_size": d.world_size, "run_id": self.run_id}

    def _resume(self) -> None:
        """From a live peer's state (a newcomer), else the newest checkpoint, else ``--init-from``
        or the task's own weights; then the W&B run id, fixed at the training's first start."""
        c, d = self.config, self.dinfo
        if self.live.resume():
            pass
        elif (loaded := self.checkpoints.load()) is not None:
            self.checkpoints.resume(*loaded)
            del loaded
        else:
            if c.init_from is not None:
                self.checkpoints.init_from(c.init_from)
            self.report.event("start", world_size=d.world_size, restart=d.restart, round=d.round)
        if self.run_id is None and d.is_main:  # fixed at the first start: restarts before a checkpoint resume it
            self.run_id = (metrics.fixed_run_id(c.checkpoint_dir or str(self.log_dir), fresh=not c.resume)
                           if c.wandb else metrics.new_run_id())

    def _loop(self, total: int) -> str:
        """Steps until done or stopped; returns why it ended ("done", "max-seconds", "signal SIGTERM").
        ``Manager.step`` runs each one, and re-forms the group under live recovery when a collective
        failed in it or the ranks agreed to (``trainer_live.py`` is the trainer's part of that)."""
        started = last_save = time.monotonic()
        self.model.train()
        while not self._done(total):
            done = self.step
            reason = self.manager.step(lambda: self._loop_step(total, started, last_save))
            if reason == "saved":
                last_save = time.monotonic()
            elif reason is not None:
                return reason
            if self.config.sleep_per_step and self.step > done:  # tests and drills: after what the step's
                time.sleep(self.config.sleep_per_step)  # agreement decided; a lost step runs again at once
        return "done"

    def _loop_step(self, total: int, started: float, last_save: float) -> str | None:
        """One step, and the agreement when one is due. Returns None to go on, "saved" after a
        periodic save, or why training stops."""
        c = self.config
        self.timer.start()
        loss_sum = self._train_step(self.batches)
        self.preemption.boundaries += 1
        self.live.after_step()
        if self.preemption.boundaries == 1:  # the saves' host memory, made beside the next steps
            with self.manager.slow("checkpoint host memory"):  # peers waiting meanwhile: not a hang
                self.checkpoints.prepare()  # --fsdp: also the checkpoint's folder (its group: Manager.group)
        took = self.timer.stop()  # CUDA: known once the GPU ran the step (at the agreement at the latest)
        if took.ready():
            self._last_step_s = took.seconds()
        self.pending.append((self.step, self.sampler.epoch, self.sampler.offset, loss_sum, took, time.time()))
        every_n = c.checkpoint_every is not None and self.step % c.checkpoint_every == 0
        if not self.manager.agree_due() and not every_n and not self._done(total):
            self._after_step()
            return None
        now, main = time.monotonic(), self.dinfo.is_main  # rank 0's clock decides the timed events
        signalled, timed_out, save_due, reform = self._agree(
            signalled=self.preemption.signalled,
            timed_out=main and c.max_seconds is not None and now - started >= c.max_seconds,
            save_due=main and c.save_every_seconds is not None and now - last_save >= c.save_every_seconds)
        self._after_step()
        if signalled and not self.preemption.signalled and not timed_out and self.live.without_stopped_peer():
            return None  # live: a peer was preempted; it leaves, the others re-form without it
        if signalled or timed_out:
            reason = self.preemption.stop_reason(peer_signalled=signalled)
            self.report.print0(f"stopping at step {self.step} ({reason})")
            self.report.event("stop", step=self.step, reason=reason)
            return reason  # _finish saves this step
        if self.checkpoints.manager is not None and (save_due or every_n) and not self._done(total):
            self.checkpoints.save(blocking=False)  # its local waits are Manager.slow phases, its gathers not
            return "saved"
        if reform and not self._done(total):  # a node waits to join, a member's lease expired
            self.manager.request_reform(f"planned: {self.manager.reform_reason or 'a member asked'}")
        return None

    def _finish(self, stopped_by: str | None) -> None:
        """Final blocking save (unless this step is saved already), flush logs, leave the process group
        (a finished run is marked so, for newcomers still waiting to exit 0)."""
        self.checkpoints.finish()
        self.live.close()
        self.manager.finish(done=stopped_by == "done")
        self.report.close(stopped_by, self.step, self.last_loss, self.first_loss)
        self.preemption.disarm()

    def _abort(self, exc: BaseException | None = None) -> None:
        """On an error (a peer lost, ...): the step log gets the steps never agreed, a live member
        leaves, and the checkpoints save what they can (``Checkpointing.abort``)."""
        self.report.unagreed_steps(self.pending)
        self.pending.clear()
        if isinstance(exc, LiveExcluded):
            self.report.event("live_excluded", step=self.step, reason=str(exc))
        self.manager.close()  # live: the state lives on in the other members; leave now, visibly
        lost = exc if exc is not None and self.manager.peer_lost(exc) else None  # never on a live rank
        self.checkpoints.abort(lost, device_state=host_step_is_device_state(self.dinfo.device))

    # ---- for the agreement and the step ----------------------------------------------------
    def _log_step(self, step: int, epoch: int, offset: int, step_time: float, ended: float) -> None:
        saved = self.checkpoints.note_commit()  # a save that committed since: its line, and W&B gets its stats
        self.report.step_done(step, epoch, offset, step_time, ended, loss=self.last_loss,
                              lr=self.optimizer.param_groups[0]["lr"], saved=saved)

    def _autocast(self):
        if self.amp.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dinfo.device.type, dtype=self.amp.dtype)

    def new_feed(self):
        """``(sampler, batches)`` at the current world size (``feed.make_feed``: map-style or a stream);
        the batches start reading, lazily, from whatever position the sampler then loads."""
        d, c = self.dinfo, self.config
        return make_feed(self.task, global_batch_size=self.gbs, rank=d.rank, world_size=d.world_size, seed=c.seed,
                         micro_batch_size=c.micro_batch_size, num_workers=c.num_workers, device=d.device)

    def _done(self, total: int) -> bool:
        c = self.config
        return self.step >= total or (c.epochs is not None and self.sampler.epoch >= c.epochs)

    def _train_step(self, batches) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the sum of its sample losses.

        The step's ledger line is written once its last micro-batch is fetched, before the backward
        that all-reduces the gradients: a step whose all-reduce completed anywhere was logged by
        every rank, even one killed right after it (see ``_abort``).

        Under FSDP every forward and backward is a collective, so every rank runs the same number
        of micro-batches, ``sampler.lockstep_micro_batches``: a rank with a smaller share of an
        uneven global batch (``--micro-batch-size 1``, ``B % W != 0``; any world-size change can
        make it so) runs its last micro-batch once more with weight 0, which adds nothing to the
        gradient or the loss (a model with batch norm would update its running statistics with it).
        A rank with no sample in the step (``sampler.sit_out``: a live ``--fsdp`` newcomer's first
        step, while its shards come) runs padding only, on ``batches.padding()``; its shards are
        loaded before its optimizer step (``commit_point``)."""
        d = self.dinfo
        loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)  # on the device: no sync per micro-batch
        consumed: list[int] = []
        mbps = self.sampler.micro_batches_per_step
        runs = self.sampler.lockstep_micro_batches if self.par.fsdp else max(mbps, 1)
        for i in range(runs):
            if i < mbps:
                epoch, indices, batch = batches.next(first_of_step=i == 0)
                consumed.extend(indices)
                weight = loss_weight(len(indices), self.gbs, d.world_size)
            else:  # padding: the same collectives as the other ranks' extra micro-batch, weight 0
                weight, indices = 0.0, []
                if i == 0:  # no sample of its own in this step (a live newcomer's first: ElasticSampler.sit_out)
                    batch = batches.padding()
            if i == mbps - 1:
                self.report.ledger_line(self.step + 1, epoch, consumed)
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
        self.live.commit_point()  # live --fsdp: no rank steps unless every rank's reductions completed
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

    def _agree(self, *, signalled: bool, timed_out: bool, save_due: bool) -> tuple[bool, bool, bool, bool]:
        """One small all-reduce every few steps (``Manager.agree``): the global-batch losses of the
        steps since the last one, and stop/save decisions that every rank then shares.

        Returns (some rank got SIGTERM, rank 0's --max-seconds ran out, a timed save is due, some
        rank's live group asks to re-form (a newcomer waits, a member's lease expired)); the
        Manager keeps the steps until the next agreement. A stop or save request from any rank
        applies to all of them at this step, so they save together. A gloo all-reduce costs about
        0.25 ms of CPU, 1-2% of a small CPU step, so the ranks agree every ``_agree_interval`` steps
        (about 0.2 s, chosen by rank 0 and shared in the same all-reduce), at every checkpoint step
        and at the last step; a SIGTERM is acted on at the next agreement. Then the step log gets
        the pending steps.
        """
        losses = torch.stack([p[3] for p in self.pending])
        self._last_step_s = self.pending[-1][4].seconds()  # CUDA: waits for the GPU, as the all-reduce would
        flags = torch.tensor([float(signalled), float(timed_out), float(save_due)], dtype=torch.float64,
                             device=losses.device)  # the process group's device (NCCL needs CUDA tensors)
        agreed = self.manager.agree(torch.cat([losses, flags]), interval=self._agree_interval())
        if (news := self.manager.straggler_news) is not None:  # named ranks changed, or a node evicted
            self.report.stragglers(self.step, news)
        n = len(self.pending)
        values = agreed.values
        for (step, epoch, offset, _, took, ended), loss in zip(self.pending, values[:n]):
            self.last_loss = loss / self.gbs
            if self.first_loss is None:
                self.first_loss = (step, self.last_loss)
            self._log_step(step, epoch, offset, took.seconds(), ended)
        self.pending.clear()
        return values[n] > 0, values[n + 1] > 0, values[n + 2] > 0, agreed.reform

    def _after_step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()
        now = time.perf_counter()
        if self._boundary_at is not None:
            self._cycle_s = now - self._boundary_at
        self._boundary_at = now

    def _agree_interval(self) -> int:
        """Steps between agreements: about 0.2 s of steps (start to start), 1 to 32 (rank 0 decides).

        The host's cycle is how long a step took to queue; on CUDA the GPU may be far behind it, so
        the cycle is at least the last step's time on the GPU (CUDA events, ``devices.step_timer``)."""
        return agree_interval(self._cycle_s or 0.0, self._last_step_s if self.dinfo.device.type == "cuda" else None)

