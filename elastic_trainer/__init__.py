"""elastic-trainer: fault-tolerant elastic data-parallel training for PyTorch.

``elastic-train`` runs torchrun's elastic agents that meet through an etcd v3 rendezvous
(``elastic_trainer.rendezvous``), and workers that train with the built-in trainer
(``elastic_trainer.training.trainer``), checkpointing to shared storage and resuming exactly.

Public names (docs/manager.md is their reference):

- ``Manager`` (``elastic_trainer.training.manager``): your own training loop under live recovery:
  it joins the process group, runs each step (``manager.step``), re-forms the group after a lost
  node and sends newcomers the state (``examples/own_loop.py``; the built-in trainer uses it too);
- ``ElasticSampler`` (``elastic_trainer.sampler``): a batch sampler whose position is a global
  sample offset, so an epoch goes on at any world size with no sample repeated or skipped;
- ``WorkerEnv`` (``elastic_trainer.env``): what a worker is told through its environment, typed.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["ElasticSampler", "Manager", "WorkerEnv", "__version__"]


def __getattr__(name: str) -> Any:  # imported on first use: `elastic-train` itself needs no torch
    if name == "Manager":
        from elastic_trainer.training.manager import Manager

        return Manager
    if name == "ElasticSampler":
        from elastic_trainer.sampler import ElasticSampler

        return ElasticSampler
    if name == "WorkerEnv":
        from elastic_trainer.env import WorkerEnv

        return WorkerEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
