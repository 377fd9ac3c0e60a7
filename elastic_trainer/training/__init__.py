"""The built-in trainer that torchrun's workers run (``python -m elastic_trainer.train``).

Modules:

- ``manager``: ``Manager`` (public: ``elastic_trainer.Manager``), a training loop under live
  recovery: each step (``step``), the step agreement, the re-form, the state to newcomers; a plain
  manager otherwise. Its parts: ``worker_group`` (the process group: join, form, re-form),
  ``process_group`` (leave, a failed collective), ``state_transfer`` (the state from a peer),
  ``agreement`` (the step agreement), ``recovery`` (what a re-form asks of a loop), ``loop`` (a
  plain loop's model, loader and state), ``loop_records`` (its step log, events and status) and
  ``uses_manager`` (whether a script runs live);
- ``trainer``: ``Trainer``, the loop (build, resume, step, agree, save), one client of the Manager;
  ``trainer_live``: its part of a live re-form (with HSDP's in ``sharded_live``);
- ``checkpointing``: ``Checkpointing``, the trainer's checkpoints (capture, save, load, resume,
  the save after a failure) over ``elastic_trainer.checkpoint``;
- ``reporting``: ``Reporter``, what a worker tells people and tools (rank-0 lines, bar, W&B,
  status, step log, events, sample ledger);
- ``preemption``: ``Preemption``, SIGTERM (a save at the next step boundary, the grace period,
  the hung-step watchdog, the watcher that sees a signal while blocked in a collective);
- ``runtime``: the worker runtime that owns every background thread and the one exit;
- ``worker``: the process around the loop (device, plain process group, seeding, the map-style
  micro-batch feed, the round fence);
- ``feed``: the sampler and the micro-batch feed of either data mode, map-style or a stream
  (``elastic_trainer.stream``);
- ``parallel``: DDP or FSDP2 wrapping, ``no_sync`` and full state dicts (``Parallel``);
- ``rng``: every rank's own RNG state gathered into a checkpoint, and which one a rank restores;
- ``data``: the example task's datasets (token sequences, synthetic and HDF5), its stream shards and transform;
- ``metrics``: rank-0 printing, the progress bar and the W&B logger (a no-op when off);
- ``status``: what rank 0 publishes into etcd for ``elastic-train status`` (``StatusPublisher``).

Exports ``Trainer`` and ``Manager``; the task API users write against is ``elastic_trainer.tasks`` and the
flags are ``elastic_trainer.config.TrainConfig``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Manager", "Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from elastic_trainer.training.trainer import Trainer

        return Trainer
    if name == "Manager":
        from elastic_trainer.training.manager import Manager

        return Manager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
