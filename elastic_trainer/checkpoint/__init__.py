"""Checkpoints on shared storage: save, commit, verify, load, retention.

Modules:

- ``manager``: ``CheckpointManager`` (save asynchronously, commit fenced and atomically, verify,
  load the newest valid step, keep the latest K): a small facade over
- ``writer``: the save pipeline (snapshot, then serialize, upload, commit, prune; retries);
- ``save_thread``: the manager's one save thread, kept between saves;
- ``commit``: one snapshot's files written and committed, fenced (manifest or etcd record);
- ``retention``: which checkpoints are kept after a commit;
- ``reader``: find, verify and load the newest valid checkpoint;
- ``manifest``: the step folders, the manifest and its checksums;
- ``record``: the etcd commit record, written in one transaction with the fence's token;
- ``rng_state``: ``capture_rng_state``/``restore_rng_state`` (every generator of a process);
- ``sharded``: FSDP checkpoints saved shard by shard through DCP (``ShardedSaver``);
- ``format``: the file format (raw tensor bytes in an arena behind a JSON header; no pickle);
- ``snapshot``: the state copied into CPU memory, beside training where it can be (the
  manager's internal API: ``Snapshotter``, ``DeferredCopy``, ``OptimizerWatch``);
- ``host_memory``: the reused CPU buffer snapshots and sharded staging copy into, page-locked
  for GPU states and made ready on a background thread before the first save;
Every byte goes to and from storage through ``elastic_trainer/storage.py`` (fsspec: file, memory,
s3, ...), the layer the streamed datasets read through too.

Exports ``CheckpointManager``, ``capture_rng_state``, ``restore_rng_state``; importing this
package is cheap, the manager is imported on first use.
Design and numbers: docs/checkpoints.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointManager", "capture_rng_state", "restore_rng_state"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from elastic_trainer.checkpoint.manager import CheckpointManager

        return CheckpointManager
    if name in __all__:
        from elastic_trainer.checkpoint import rng_state

        return getattr(rng_state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
