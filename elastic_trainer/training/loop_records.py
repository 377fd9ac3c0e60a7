"""The records of a user's own loop under the Manager: what drills, benchmarks and ``elastic-train
status`` read, written by the Manager so that the loop writes none.

The built-in trainer writes its records itself (``training/reporting.py``); a script that brings
its own loop gets the same files from ``Manager.step`` (contract: ``elastic_trainer.records``),
under the launcher's ``--log-dir`` (``ELASTIC_TRAINER_LOG_DIR``; nothing without one):

- the **step log** ``steps/rank-<r>-<pid>.jsonl`` (every rank): one ``StepRecord`` per completed
  step, with the loss the step returned (when it is a number) as this rank's own
  (``loss_scope: "rank"``: the Manager does not all-reduce it), the sampler's epoch and offset
  when the loop iterates a ``Manager.loader``;
- the **events** ``events.jsonl`` (rank 0 of the current world): ``start`` or
  ``peer_state_loaded``, ``live_reform``, ``world_size_changed``, ``live_excluded``, and
  ``finished`` or ``stopped``;
- the **status** (rank 0, whenever the etcd-v3 rendezvous started the worker, log dir or not):
  the newest step, loss and world, and the events, for ``elastic-train status``
  (``training/status.py``).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Protocol

from elastic_trainer import records
from elastic_trainer.env import ENV_LOG_DIR
from elastic_trainer.records import Event, EventRecord, JsonLines, StepRecord

class Seat(Protocol):
    """Where this worker sits now (the Manager): it changes at every re-form."""

    rank: int
    world_size: int
    round: int | None
    distributed: bool

    def time_steps(self, ddp: Any) -> bool:
        """Time this rank's own step on ``ddp`` (the straggler scores)."""


class LoopRecords:
    """Step log, events and status of a user's loop (see the module docstring)."""

    def __init__(self, seat: Seat, restart: int, log_dir: str | None = None) -> None:
        self.seat, self.restart = seat, restart
        self.log_dir = log_dir if log_dir is not None else os.environ.get(ENV_LOG_DIR) or None
        """Where the files go (None: no files)."""
        self.node = socket.gethostname()
        self.steps = JsonLines(None)
        self.events = JsonLines(None)
        self._status: Any = None  # rank 0's StatusPublisher, made once this worker is rank 0
        self._status_tried = False

    def open(self) -> None:
        """Once this worker has its first rank (the step log's name keeps it, as the trainer's does)."""
        if self.log_dir is not None and self.steps.file is None:
            self.steps = JsonLines(records.steps_path(self.log_dir, self.seat.rank, os.getpid()))
            self.events = JsonLines(records.events_path(self.log_dir))

    def step(self, step: int, result: Any, epoch: int | None, offset: int | None) -> None:
        """A completed step: its line, and on rank 0 the status."""
        s = self.seat
        loss = float(result) if isinstance(result, (int, float)) and not isinstance(result, bool) else None
        self.steps.write(StepRecord(time=time.time(), step=step, epoch=epoch, offset=offset, world_size=s.world_size,
                                    rank=s.rank, round=s.round, restart=self.restart, loss=loss,
                                    loss_scope="rank" if loss is not None else None, node=self.node))
        publisher = self._publisher()
        if publisher is not None:
            publisher.update(step=step, epoch=epoch, loss=loss, world_size=s.world_size, round=s.round,
                             node=self.node, state="training")

    def event(self, event: Event, **fields: Any) -> None:
        """An event, on rank 0 of the current world (also to the status)."""
        if self.seat.rank != 0:
            return
        record = EventRecord(time=time.time(), event=event, **fields)
        self.events.write(record)
        publisher = self._publisher()
        if publisher is not None:
            publisher.event(record.to_json())

    def close(self, state: str, step: int) -> None:
        """The loop ended (``state``: "finished" or "stopped"): the last event and status; the files close."""
        self.event(Event.FINISHED if state == "finished" else Event.STOPPED, step=step, reason=state)
        if self._status is not None:
            self._status.update(state=state, step=step)
            self._status.close()
            self._status = None
        self.steps.close()
        self.events.close()

    def _publisher(self):
        if self.seat.rank != 0:
            return None
        if not self._status_tried:
            self._status_tried = True
            from elastic_trainer.training.status import StatusPublisher

            self._status = StatusPublisher.from_env_or_none()
        return self._status


__all__ = ["LoopRecords", "Seat"]
