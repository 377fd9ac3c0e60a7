"""The built-in trainer that torchrun's workers run (``python -m elastic_trainer.train``).

Modules:

- ``trainer``: ``Trainer``, the loop (build, resume, step, agree, save) and the recovery paths;
- ``worker``: the process around the loop (process group, seeding, micro-batch feed, the round
  fence, SIGTERM while blocked in a collective);
- ``parallel``: DDP or FSDP2 wrapping, ``no_sync`` and full state dicts (``Parallel``);
- ``rng``: every rank's own RNG state gathered into a checkpoint, and which one a rank restores;
- ``data``: the example task's synthetic and HDF5 datasets;
- ``metrics``: rank-0 printing, the progress bar and the W&B logger (a no-op when off);
- ``status``: what rank 0 publishes into etcd for ``elastic-train status`` (``StatusPublisher``).

Exports ``Trainer``; the task API users write against is ``elastic_trainer.tasks`` and the
flags are ``elastic_trainer.config.TrainConfig``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from elastic_trainer.training.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
