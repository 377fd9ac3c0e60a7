"""Checkpoints on shared storage: atomic, verified, asynchronous, and resumed exactly.

A checkpoint is the folder ``<url>/step-<N>/``::

    step-120/
      <writer-id>/state.bin       the whole state: raw tensors behind a JSON header (format 3,
                                  ``checkpoint_format``); state.pt, one torch.save file, in format 2
      manifest.json               written last: every file with its size and checksum

A folder counts only once ``manifest.json`` exists, parses and every file it lists has the
listed size and checksum (xxh3_128; sha256 in manifests written before format 2); anything
else (in progress, killed mid-upload, truncated, bit-flipped) is skipped by readers with a
warning that names it. Data files live under a per-writer folder, and the manifest is
committed with an atomic create-if-absent (``storage.create_exclusive``) right after the
rendezvous fence is checked: if two processes both think they are rank 0 (a zombie from an old
round), the fenced one never commits, and if both pass the fence only one manifest wins, and it
lists exactly the winner's files, so the checkpoint always verifies. Given a ``Fence``
(``rendezvous/round_fence.py``: ``RoundFence``, the live group) the commit is instead the etcd commit
record (``record.py``), written in one transaction with the fence's token, so a writer paused
after its check cannot commit either; loads and retention then follow that record.

``CheckpointManager`` is a small facade over the parts, each a module of its own:

- ``writer.py``: the save pipeline (snapshot in ``save``, the rest on the save thread; retries);
- ``save_thread.py``: the manager's one save thread, kept between saves, at a lower CPU priority;
- ``commit.py``: one attempt to write a snapshot's files and commit them, fenced;
- ``retention.py``: which checkpoints are kept after a commit;
- ``reader.py``: load the newest checkpoint that verifies (sizes and checksums), never running code;
- ``manifest.py``: the step folders, the manifest, the checksums.

``save`` blocks only while the state is snapshotted into CPU memory (with ``async_checkpoint``
the optimizer's tensors are copied beside training); uploads that fail are logged and retried
and never raised into training; the last good checkpoint is never touched before a newer one is
committed. A checkpoint can never run code: format 3 is JSON and raw bytes, checked field by
field, and formats 1 and 2 (still read) are loaded with ``torch.load(weights_only=True)``.

Example::

    ckpt = CheckpointManager("s3://bucket/run-1", keep_checkpoints=3, fence=RoundFence.from_env())
    found = ckpt.load()                       # None on a fresh run
    ...
    blocked_s = ckpt.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "rng": capture_rng_state(), "meta": {"world_size": 4}})
    ckpt.close()
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from typing import Any, Callable

from elastic_trainer import storage
from elastic_trainer.checkpoint.commit import Committer
from elastic_trainer.checkpoint.manifest import StepFolders
from elastic_trainer.checkpoint.reader import CheckpointReader
from elastic_trainer.checkpoint.record import CommitRecord
from elastic_trainer.checkpoint.retention import Retention
from elastic_trainer.checkpoint.writer import CheckpointWriter
from elastic_trainer.fence import Fence

_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class CheckpointManager:
    """Saves to and loads from ``<url>/step-<N>/``; see the module docstring.

    Args:
        url: any fsspec URL or local path (storage options from the environment).
        keep_checkpoints: how many committed checkpoints to keep (older ones pruned after a commit).
        async_checkpoint: serialize and upload on the save thread (else inside ``save``).
        fence: either a ``Fence`` (``rendezvous.fence``: ``RoundFence``, the live group): the
            commit is then the etcd commit record (``record.py``), written in one transaction with
            the fence's token, and loads and retention follow that record; or a plain function,
            called right before the manifest is created (check-then-act: raising ``FencedError``
            prevents it; the manifest records ``rendezvous.fence.round_token()``). A fence is an
            object, never callable itself; a callable is taken as the check function.
        writer_id: names this writer's data folder and appears in the manifest (default unique).
        overlap_copy: with ``async_checkpoint``, copy the optimizer's tensors (parameters and states)
            beside training instead of inside ``save``; the next optimizer step waits for that
            copy if it is still running (``writer.py``).
    """

    def __init__(self, url: str, keep_checkpoints: int = 3, async_checkpoint: bool = True,
                 fence: Fence | Callable[[], None] | None = None, writer_id: str | None = None,
                 *, retries: int = 3, retry_backoff_s: float = 1.0, overlap_copy: bool = True) -> None:
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {keep_checkpoints}")
        self.url = url
        self.async_checkpoint = async_checkpoint
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if not _KEY_RE.match(self.writer_id):
            raise ValueError(f"writer_id {self.writer_id!r} may only use letters, digits, '_', '.' and '-'")
        fs, self.root = storage.get_fs(url)
        self.folders = StepFolders(fs, self.root)
        check = fence if fence is None or callable(fence) else None
        self.record = CommitRecord(fence, url) if fence is not None and check is None else None
        self.reader = CheckpointReader(url, self.folders, self.record)
        self.writer = CheckpointWriter(
            url, Committer(self.folders, self.writer_id, keep_checkpoints, self.record, check),
            Retention(self.folders, self.record, keep_checkpoints), async_checkpoint=async_checkpoint,
            overlap_copy=overlap_copy, retries=retries, retry_backoff_s=retry_backoff_s)

    @property
    def fs(self) -> Any:
        """The fsspec file system of ``url`` (settable: every part reads and writes through it)."""
        return self.folders.fs

    @fs.setter
    def fs(self, fs: Any) -> None:
        self.folders.fs = fs

    @property
    def keep_checkpoints(self) -> int:
        """How many committed checkpoints retention keeps (and the etcd record holds); settable."""
        return self.writer.retention.keep

    @keep_checkpoints.setter
    def keep_checkpoints(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {keep}")
        self.writer.retention.keep = self.writer.committer.keep = keep

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict, *, blocking: bool = False, include: dict | None = None) -> float:
        """Snapshot ``state`` for ``step`` and write it (on the save thread unless ``blocking``).

        ``include`` lists files inside the step folder that others already wrote (the DCP shards
        of a sharded save, ``sharded.py``), as manifest entries ``{"<folder>/<name>": {"size",
        "hash", "digest"}}`` hashed from storage by their writers: the manifest lists them too
        (blocking saves only).

        Returns the seconds the caller was blocked here (waiting for the previous save +
        copying). With ``overlap_copy`` the optimizer's tensors are copied beside training, and
        a wait for that copy at the next optimizer step is added to ``last_save_stats``'s
        ``blocked_s`` (and ``copy_wait_s``) when it happens.
        """
        return self.writer.save(step, state, blocking=blocking, include=include)

    def prepare(self, state: dict) -> None:
        """Make the snapshot memory for saves of states like ``state`` now, on a background thread
        (page-locked for a GPU state), so that the first save blocks no longer than the later ones;
        call it once the state exists (after the first optimizer step). See ``host_memory``."""
        self.writer.prepare(state)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is done; its failure is in ``last_error``.
        (Called from the save thread itself, as a sharded save's commit does, it returns at once.)"""
        self.writer.wait()

    def busy(self) -> bool:
        """Whether a save is in flight (its background part not done yet)."""
        return self.writer.busy()

    def run_in_background(self, step: int, work: Callable[[], None]) -> None:
        """Run ``work`` on the manager's save thread as its in-flight save of ``step``, after
        the previous save is done: ``wait``, ``close`` and the next ``save`` wait for it (a sharded
        save's writing and commit, ``sharded.py``). ``work`` reports its own failures
        (``record_failure``)."""
        self.writer.run_in_background(work)

    def record_failure(self, stats: dict, message: str) -> None:
        """Report a save done with ``run_in_background`` as failed: ``stats`` (with ``committed``
        False and ``error``) become ``last_save_stats`` and ``message`` ``last_error``."""
        self.writer.record_failure(stats, message)

    @property
    def last_save_stats(self) -> dict:
        """The stats of the last save (``writer.py``); ``{}`` before the first."""
        return self.writer.last_save_stats

    @property
    def last_error(self) -> str | None:
        """Why the last save failed, None when it committed (or is still in flight)."""
        return self.writer.last_error

    @property
    def last_committed_step(self) -> int | None:
        return self.writer.last_committed_step

    def close(self) -> None:
        """Finish the in-flight save, stop and join the save thread, free the snapshot buffers."""
        self.writer.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ load

    def load(self, step: int | None = None, *, share: tuple[int, int] | None = None,
             skip: frozenset[int] | set[int] = frozenset()) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid checkpoint (or of ``step``) that is not in
        ``skip``; None when there is none. With ``share`` ``(index, count)``, of a sharded
        checkpoint's shard files only this share is verified here (``reader.py``): ranks that
        verify a share each must agree before they trust the step (``Trainer``), so that no rank
        reads the whole checkpoint."""
        return self.reader.load(step, share=share, skip=skip)

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint that verifies (sizes and checksums), or None."""
        return self.reader.latest_step()

    def steps(self) -> list[int]:
        """Every step that has a folder, newest first, committed or not."""
        return self.folders.steps()


__all__ = ["CheckpointManager"]
