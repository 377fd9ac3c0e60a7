"""Checkpoints on shared storage: save, commit, verify, load, retention.

Modules:

- ``manager``: ``CheckpointManager`` (save asynchronously, commit fenced and atomically, verify,
  load the newest valid step, keep the latest K), ``capture_rng_state``/``restore_rng_state``;
- ``record``: the etcd commit record, written in one transaction with the fence's token;
- ``format``: the file format (raw tensor bytes in an arena behind a JSON header; no pickle);
- ``snapshot``: the state copied into CPU memory, beside training where it can be (the
  manager's internal API: ``Snapshotter``, ``DeferredCopy``, ``OptimizerWatch``);
- ``host_memory``: the reused CPU buffer snapshots and sharded staging copy into, page-locked
  for GPU states and made ready on a background thread before the first save;
- ``storage``: every byte to and from storage, through fsspec (file, memory, s3, ...).

Exports ``CheckpointManager``, ``capture_rng_state``, ``restore_rng_state``; importing this
package is cheap (``storage`` alone needs no torch), the manager is imported on first use.
Design and numbers: docs/checkpoints.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointManager", "capture_rng_state", "restore_rng_state"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from elastic_trainer.checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
