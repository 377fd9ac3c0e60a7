"""elastic-trainer: fault-tolerant elastic data-parallel training for PyTorch.

``elastic-train`` runs torchrun's elastic agents that meet through an etcd v3 rendezvous
(``elastic_trainer.rendezvous``), and workers that train with the built-in trainer
(``elastic_trainer.training.trainer``), checkpointing to shared storage and resuming exactly.

Public names:

- ``Manager`` (``elastic_trainer.training.manager``): a worker's process group under live
  recovery, for your own training loop: join, re-form after a lost node, state to newcomers, the
  step agreement (``examples/own_loop.py``; the built-in trainer uses it too);
- ``WorkerEnv`` (``elastic_trainer.env``): what a worker is told through its environment, typed.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Manager", "WorkerEnv", "__version__"]


def __getattr__(name: str) -> Any:  # imported on first use: `elastic-train` itself needs no torch.distributed
    if name == "Manager":
        from elastic_trainer.training.manager import Manager

        return Manager
    if name == "WorkerEnv":
        from elastic_trainer.env import WorkerEnv

        return WorkerEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
