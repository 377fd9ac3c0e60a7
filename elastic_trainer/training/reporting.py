"""What a worker tells people and tools while it trains: one ``Reporter`` per worker.

The trainer says each thing once, to the reporter, which sends it where it belongs:

- **log lines** (``print0``): global rank 0 only, prefixed ``[elastic-trainer]``, above the bar;
- the **progress bar** (``--progress``) and the **W&B run** (``--wandb``): rank 0 only
  (``training/metrics.py``); before ``start`` the W&B logger is a no-op;
- the **status** that ``elastic-train status`` shows: rank 0's ``StatusPublisher`` writes the
  newest step, checkpoint and events to etcd (only under the etcd-v3 rendezvous);
- the **records** the drills read (``elastic_trainer.records``): the step log (every rank), the
  events (rank 0; every member under live recovery) and the sample ledger (``--sample-ledger``).

"Rank 0" is read from the worker's ``DistInfo`` at each call: a live re-form that makes another
process rank 0 moves the lines, the bar's updates and the status there with no call here.

How the W&B run ends tells what happened: ``close`` ends it with 0 when training finished or
reached ``--max-seconds``, preempted (143) after this rank's SIGTERM, ``EXIT_PEER_STOPPED`` when
another node's; ``failed`` after an error; a forced exit (the grace period over, a hung step)
ends it as preempted through the worker runtime's ``before_exit`` hook, within ``WANDB_FINISH_S``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from elastic_trainer import config as cfgmod
from elastic_trainer import devices, records
from elastic_trainer import storage
from elastic_trainer.config import TrainConfig
from elastic_trainer.env import EXIT_PEER_STOPPED, EXIT_PREEMPTED
from elastic_trainer.records import Event, EventRecord, JsonLines, LedgerRecord, StepRecord
from elastic_trainer.training import metrics
from elastic_trainer.training.preemption import PEER_STOPPED
from elastic_trainer.training.straggler_watch import event_fields
from elastic_trainer.runtime import runtime
from elastic_trainer.training.worker import DistInfo

logger = logging.getLogger(__name__)

WANDB_FINISH_S = 3.0
"""At most this long for the W&B run's final flush on a forced exit or an error (offline: milliseconds)."""


def wandb_exit_code(stopped_by: str | None) -> int:
    """The exit code the W&B run ends with: 0 when training finished or reached ``--max-seconds``;
    preempted (143) after this rank's SIGTERM; ``EXIT_PEER_STOPPED`` when another node's was."""
    if stopped_by in ("done", "max-seconds"):
        return 0
    if stopped_by == PEER_STOPPED:
        return EXIT_PEER_STOPPED
    return EXIT_PREEMPTED


def wandb_config(c: TrainConfig) -> dict[str, Any]:
    """The run config W&B records (and uploads): every flag, credentials in URLs redacted."""
    return {k: storage.redact(v) if isinstance(v, str) else v for k, v in asdict(c).items() if k != "task_args"}


class Reporter:
    """A worker's log lines, progress bar, W&B run, status and records; see the module docstring."""

    def __init__(self, config: TrainConfig, dinfo: DistInfo, log_dir: Path, *, gbs: int, live: bool) -> None:
        self.config, self.dinfo, self.log_dir = config, dinfo, log_dir
        self.gbs = gbs  # samples per step (the global batch)
        self.node = socket.gethostname()
        pid = os.getpid()
        self.events = JsonLines(records.events_path(log_dir) if dinfo.is_main or live else None)
        self.step_log = JsonLines(records.steps_path(log_dir, dinfo.rank, pid) if config.step_log else None)
        self.ledger = JsonLines(records.ledger_path(log_dir, dinfo.rank, pid) if config.sample_ledger else None)
        self.wandb: metrics.NullLogger | metrics.WandbLogger = metrics.NullLogger()
        self.progress = metrics.Progress(None, 0, enabled=False)
        self._status = None  # StatusPublisher of rank 0 (`elastic-train status`), made on first use
        self._status_tried = False
        self._unhook: Callable[[], None] | None = None  # removes the W&B flush from the runtime's forced exit

    def print0(self, msg: str) -> None:
        """One line for people, on global rank 0 (above the bar)."""
        metrics.print0(msg, self.dinfo.rank, self.progress)

    def device_line(self) -> None:
        """The run's first line: where it trains, over what, with which build."""
        c, d = self.config, self.dinfo
        self.print0(devices.describe(d.device, dist.get_backend() if d.distributed else "none (single process)")
                    + f", amp {c.amp}" + (f", tf32 {'on' if c.tf32 else 'off'}" if d.device.type == "cuda" else ""))

    def joined_live(self, step: int, sampler, *, source: int, seconds: float) -> None:
        """A newcomer restored the state that live rank ``source`` sent it in ``seconds``."""
        d = self.dinfo
        self.print0(f"joined the live group at step {step} (state from rank {source}, {seconds:.3f}s); "
                    f"world size {d.world_size}")
        self.event("peer_state_loaded", step=step, epoch=sampler.epoch, offset=sampler.offset,
                   world_size=d.world_size, source=source, seconds=seconds, round=d.round)

    # ---- W&B and the bar -------------------------------------------------------------------
    def start(self, run_id: str | None, *, total: int | None, step: int, steps_per_epoch: int,
              preempting: bool) -> None:
        """Say where training starts and until when; open the W&B run (``run_id``, rank 0) and the
        bar (``total`` steps, None: unknown, from ``step``). ``preempting``: a SIGTERM came before
        the run existed, so it is marked at once."""
        c, d, main = self.config, self.dinfo, self.dinfo.is_main
        until = [f"step {total}"] if total is not None else []
        until += [f"{c.max_seconds:g}s"] if c.max_seconds is not None else []
        self.print0(f"training from step {step} until {' or '.join(until) or 'the sampler ends'}, world size "
                    f"{d.world_size} ({'distributed ' + dist.get_backend() if d.distributed else 'single process'}, "
                    f"{d.device}), global batch {self.gbs}, {steps_per_epoch} steps/epoch, "
                    f"restart {d.restart}, round {d.round}")
        self.wandb = metrics.init_wandb(enabled=c.wandb and main, run_id=run_id, log_dir=str(self.log_dir),
                                        project=c.wandb_project, group=os.environ.get(cfgmod.ENV_RUN_ID),
                                        config=wandb_config(c), say=self.print0)
        if isinstance(self.wandb, metrics.WandbLogger):
            self._unhook = runtime().before_exit(self._finish_wandb_as_preempted)
        if preempting:
            self.mark_preempting()
        seconds = c.max_seconds if c.max_seconds is not None and c.max_steps is None else None
        self.progress = metrics.Progress(total=total, initial=step, enabled=c.progress and main, seconds=seconds)

    def mark_preempting(self) -> None:
        """W&B's ``mark_preempting()``, from a thread of its own: the caller may be a signal handler
        that interrupted the main thread inside a W&B call."""
        if isinstance(self.wandb, metrics.WandbLogger):
            runtime().start_thread("wandb-preempting", self.wandb.mark_preempting)

    def _finish_wandb_as_preempted(self) -> None:
        """A forced exit skips ``close``: end the W&B run as preempted, within ``WANDB_FINISH_S``."""
        self.wandb.finish_within(EXIT_PREEMPTED, WANDB_FINISH_S)

    def failed(self) -> None:
        """After an error: the W&B run ends as failed (not a success); a restart resumes it."""
        self.wandb.finish_within(1, WANDB_FINISH_S)
        self._unhook_wandb()

    def _unhook_wandb(self) -> None:
        if self._unhook is not None:
            self._unhook()
            self._unhook = None

    # ---- status ------------------------------------------------------------------------------
    def publisher(self):
        """Rank 0's ``StatusPublisher`` (None elsewhere, or without the etcd-v3 rendezvous)."""
        if not self.dinfo.is_main:
            return None
        if not self._status_tried:
            self._status_tried = True
            from elastic_trainer.training.status import StatusPublisher

            self._status = StatusPublisher.from_env_or_none()
        return self._status

    def publish_checkpoint(self, step: int, saved_at: float) -> None:
        """The status names the newest committed checkpoint."""
        publisher = self.publisher()
        if publisher is not None:
            publisher.update(checkpoint={"step": step, "time": saved_at,
                                         "url": storage.redact(str(self.config.checkpoint_dir))})

    # ---- records -----------------------------------------------------------------------------
    def event(self, event: str, **fields: Any) -> None:
        """An event (``records.Event``) on rank 0 of the current world, also to the status."""
        if self.dinfo.is_main:  # rank 0 of the current world (live recovery changes who that is)
            record = EventRecord(time=time.time(), event=Event(event), **fields)
            self.events.write(record)
            publisher = self.publisher()
            if publisher is not None and record.event != Event.CHECKPOINT_SAVED:  # status shows the newest
                publisher.event(record.to_json())

    def stragglers(self, step: int, decision) -> None:
        """The ranks named slow changed, or a node is evicted (``Manager.straggler_news``): an event
        (the event log and the status) and, to W&B, the highest score and how many are named."""
        self.event("stragglers", step=step, **event_fields(decision))
        if self.dinfo.is_main and decision.scores:
            self.wandb.log({"global_step": step, "stragglers/max_score": max(decision.scores),
                            "stragglers/named": len(decision.named)})

    def ledger_line(self, step: int, epoch: int, consumed: list[int]) -> None:
        """The sample ledger's line of ``step``: the dataset indices this rank consumed in it."""
        self.ledger.write(LedgerRecord(step=step, epoch=epoch, round=self.dinfo.round, indices=consumed))

    def step_done(self, step: int, epoch: int, offset: int, step_time: float, ended: float, *, loss: float,
                  lr: float, saved: dict | None) -> None:
        """An agreed step (``loss`` is the global batch's): the step log, the status, the bar, W&B
        (with ``saved``, the stats of a checkpoint that committed since the last step)."""
        d = self.dinfo
        self.step_log.write(StepRecord(time=ended, step=step, epoch=epoch, offset=offset, world_size=d.world_size,
                                       rank=d.rank, round=d.round, restart=d.restart, loss=loss, node=self.node))
        samples_s = self.gbs / step_time if step_time > 0 else 0.0
        publisher = self.publisher()
        if publisher is not None:
            publisher.update(step=step, epoch=epoch, loss=loss, samples_per_s=samples_s,
                             world_size=d.world_size, round=d.round, node=self.node, state="training")
        self.progress.update(step=step, epoch=epoch, loss=loss, samples_per_s=samples_s, world_size=d.world_size)
        values = {"global_step": step, "train/loss": loss, "train/epoch": epoch,
                  "train/world_size": d.world_size, "train/step_time_s": step_time,
                  "train/samples_per_s": samples_s, "train/restarts": d.restart, "train/lr": lr}
        if saved is not None:
            values["checkpoint/blocked_s"] = saved.get("blocked_s", 0.0)
            values["checkpoint/total_s"] = (saved.get("blocked_s", 0.0) + saved.get("serialize_s", 0.0)
                                            + saved.get("upload_s", 0.0))
            values["checkpoint/bytes"] = saved.get("bytes", 0)
        self.wandb.log(values)

    def unagreed_steps(self, pending: list[tuple]) -> None:
        """After a failed collective: the step log gets the steps whose global loss was never agreed
        (``pending``: step, epoch, offset, loss sum, timer, end time), with this rank's loss over its
        own samples and ``"loss_scope": "rank"``."""
        d = self.dinfo
        share = max(1, self.gbs // max(1, d.world_size))
        for step, epoch, offset, loss_sum, _, ended in pending:
            self.step_log.write(StepRecord(time=ended, step=step, epoch=epoch, offset=offset,
                                           world_size=d.world_size, rank=d.rank, round=d.round,
                                           restart=d.restart, loss=float(loss_sum) / share, loss_scope="rank",
                                           node=self.node))

    # ---- the end -----------------------------------------------------------------------------
    def close(self, stopped_by: str | None, step: int, loss: float, first: tuple[int, float] | None) -> None:
        """The last event and line, the W&B run ended by how training ended, the status, the files."""
        finished = stopped_by == "done"
        self.event("finished" if finished else "stopped", step=step, reason=stopped_by)
        first_s = f" (step {first[0]}: {first[1]:.6f})" if first else ""
        self.print0(f"{'finished' if finished else 'stopped'} at step {step}, loss {loss:.6f}{first_s}")
        self.wandb.finish(exit_code=wandb_exit_code(stopped_by))
        self._unhook_wandb()
        if self._status is not None:
            self._status.update(state="finished" if finished else "stopped", step=step)
            self._status.close()
        for f in (self.events, self.step_log, self.ledger):
            f.close()


def start_profiler(config: TrainConfig, log_dir: Path, dinfo: DistInfo, step: Callable[[], int],
                   say: Callable[[str], None]):
    """``--profile``: a started ``torch.profiler.profile`` that writes a Chrome trace and a table of
    the top kernels per rank under ``<log dir>/profile`` (None without ``--profile``)."""
    c = config
    if not c.profile:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    out = log_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    rank, cuda = dinfo.rank, dinfo.device.type == "cuda"

    def on_trace_ready(prof) -> None:
        trace = out / f"trace-rank{rank}-step{step()}.json"
        prof.export_chrome_trace(str(trace))
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=40)
        (out / f"key_averages-rank{rank}-step{step()}.txt").write_text(table)
        say(f"profiler trace written to {trace}")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, record_shapes=True, on_trace_ready=on_trace_ready,
                   schedule=schedule(wait=c.profile_wait, warmup=c.profile_warmup, active=c.profile_active,
                                     repeat=1))
    prof.start()
    return prof
