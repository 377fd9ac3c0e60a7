"""elastic-trainer: fault-tolerant elastic data-parallel training for PyTorch.

``elastic-train`` runs torchrun's elastic agents that meet through an etcd v3 rendezvous
(``elastic_trainer.rendezvous``), and workers that train with the built-in trainer
(``elastic_trainer.training.trainer``), checkpointing to shared storage and resuming exactly.
"""

__version__ = "0.1.0"
