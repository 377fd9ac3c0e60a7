"""One attempt to write a snapshot's files into its step folder and commit them, fenced.

The save pipeline (``writer.py``) calls ``Committer.write_and_commit`` once per attempt, on the
save thread:

1. the snapshot is serialized into this writer's own folder, ``step-<N>/<writer-id>/``: format
   3 (``format.py``: a JSON header, then the snapshot's arena as it is, hashed on its way out) or,
   for a state holding a tensor without a raw layout, format 2 (one ``torch.save`` file);
2. on a filesystem, the file's size on storage is checked (an object store's PUT either stored
   every byte or failed);
3. the fence: with a ``Fence`` (``rendezvous/round_fence.py``) the commit is the etcd commit record
   (``record.py``), one transaction fenced by the fence's token, and ``manifest.json`` follows
   in storage; with a plain check function, it is called (raising ``FencedError`` stops the
   commit) and the manifest is created with an atomic create-if-absent, so that of two writers
   of one step exactly one wins and its manifest lists exactly its own files.

``Abandon`` means this checkpoint must never be committed (another writer committed the step,
or the record holds it under this writer's token); the pipeline then removes this writer's files.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable

import torch

from elastic_trainer.checkpoint import format as checkpoint_format
from elastic_trainer import storage
from elastic_trainer.checkpoint.manifest import DATA_FILE, DATA_FILE_V2, HASH, HASHES, StepFolders, encode
from elastic_trainer.checkpoint.record import CommitRecord, Conflict
from elastic_trainer.checkpoint.snapshot import Snapshot
from elastic_trainer.fence import round_token

log = logging.getLogger(__name__)


class Abandon(Exception):
    """This checkpoint must not be committed (fenced, or another writer committed the step)."""


class Committer:
    """Writes and commits one writer's checkpoints into ``folders`` (see the module docstring).

    Args:
        folders: the checkpoint URL's step folders.
        writer_id: names this writer's data folder; recorded in the manifest.
        keep: how many commits the etcd record keeps (``keep_checkpoints``).
        record: the etcd commit record when the manager was given a ``Fence``, else None.
        check: the plain check function called right before the manifest is created (no record).
    """

    _torch_save_lock = threading.Lock()
    """Held while ``torch.save`` runs with torch's CRC32 switched off: the switch is process-wide,
    so the lock is one per process (every manager's save thread takes it)."""

    def __init__(self, folders: StepFolders, writer_id: str, keep: int, record: CommitRecord | None,
                 check: Callable[[], None] | None) -> None:
        self.folders = folders
        self.writer_id = writer_id
        self.keep = keep
        self.record = record
        self.check = check

    @property
    def fs(self) -> Any:
        return self.folders.fs

    def write_and_commit(self, step: int, snap: Snapshot, meta: Any, stats: dict, attempt: int,
                         include: dict | None = None) -> None:
        """Attempt ``attempt`` (from 1) at committing ``snap`` as ``step``; ``include`` lists files
        others wrote into the step folder (a sharded save's shards) that the manifest lists too.
        Raises ``Abandon``, ``FencedError``, or any storage error (the pipeline retries those)."""
        fs = self.fs
        manifest_path = self.folders.manifest_path(step)
        if attempt > 1 and self.record is not None:  # a retry may find its own commit in the record
            mine = next((e for e in self.record.read()[0] if e["step"] == step), None)
            if mine is not None and mine.get("writer") == self.writer_id:
                self._store_manifest(manifest_path, mine)
                return
        elif attempt > 1:  # only a retry can find a commit of its own (whose response was lost)
            writer = self.folders.manifest_writer(manifest_path)
            if writer == self.writer_id:
                return
            if writer is not None:
                raise Abandon("another writer already committed this step")
        own = storage.join(self.folders.path(step), self.writer_id)
        storage.makedirs(fs, own)
        fmt, files = self._write_files(own, snap, stats)
        if not storage.is_object_store(fs):
            # an object store's PUT either stored every byte or failed (on S3 the server also
            # checks the CRC32 botocore sends with it); a filesystem is asked once more here
            self._check_landed(own, files)
        if include is not None:
            files.update(include)
            stats["bytes"] += sum(int(info["size"]) for info in include.values())  # every byte committed
        if self.check is not None:
            self.check()
        manifest = {
            "format": fmt, "step": step, "files": files, "writer": self.writer_id,
            "fence_token": round_token(), "created": time.time(),
            "meta": meta, "host": socket.gethostname(),
        }
        if self.record is not None:
            # the commit point: one etcd transaction fenced by the round's (or quorum's) token;
            # the manifest in storage follows, for a job whose etcd has no record
            try:
                manifest["fence_token"] = self.record.commit(manifest, self.keep)
            except Conflict as exc:
                raise Abandon(str(exc)) from exc
            try:
                self._store_manifest(manifest_path, manifest)
            except Exception as exc:  # noqa: BLE001 - committed already: never remove its data now
                log.warning("checkpoint step-%d is committed in etcd, but its manifest could not be copied to "
                            "%s (%s: %s); only a job with a new etcd would miss it", step,
                            storage.redact(manifest_path), type(exc).__name__, storage.redact(exc))
            return
        if not storage.create_exclusive(fs, manifest_path, encode(manifest)):
            if self.folders.manifest_writer(manifest_path) == self.writer_id:
                return
            raise Abandon("another writer committed this step first")
        # No check after the commit: a newer writer's retention may remove this folder as a stale
        # leftover just as the manifest lands, but it does so only below every checkpoint it
        # keeps; such a manifest fails verification on load (skipped, named) and the next
        # retention removes it (docs/checkpoints.md, "Commit").

    def cleanup_own(self, step: int) -> None:
        """Remove this writer's files of ``step`` (not committed); a failure is only logged."""
        try:
            storage.remove(self.fs, storage.join(self.folders.path(step), self.writer_id))
        except Exception as exc:  # noqa: BLE001 - leftovers are pruned later
            log.warning("could not remove this writer's files of step-%d (%s)", step, type(exc).__name__)

    def _write_files(self, own: str, snap: Snapshot, stats: dict) -> tuple[int, dict]:
        """Serialize the snapshot into this writer's data file; returns the format and the
        manifest's ``files``.

        Format 3 (``checkpoint_format``): a JSON header, then the snapshot's arena as it is, hashed
        (xxh3_128) on its way out and written with ``storage.write_parts``: straight into the file
        on local disks, sent from the arena itself on S3 (no copy in memory), joined into one
        upload elsewhere. A state with a tensor that has no raw layout (sparse, quantized) is
        written as format 2, one ``torch.save`` file, with torch's own CRC32 switched off meanwhile
        (the manifest's hash covers every byte, and the CRC doubled the serialization time).
        ``stats["serialize_s"]`` is the header's time (format 3) or ``torch.save``'s (format 2,
        writing included on a filesystem).
        """
        hasher = HASHES[HASH]()
        t0 = time.perf_counter()
        head = checkpoint_format.header(snap.state, snap.arena)
        if head is not None:
            name = DATA_FILE
            stats["serialize_s"] = time.perf_counter() - t0
            parts = [head, snap.arena.data] if snap.arena.size else [head]
            size = storage.write_parts(self.fs, storage.join(own, name), parts, hasher=hasher)
            fmt = 3
        else:
            fmt, name = 2, DATA_FILE_V2

            def produce(out) -> None:
                with self._torch_save_lock:
                    crc = torch.serialization.get_crc32_options()
                    torch.serialization.set_crc32_options(False)
                    try:
                        torch.save(snap.state, out)
                    finally:
                        torch.serialization.set_crc32_options(crc)
                stats["serialize_s"] = time.perf_counter() - t0

            size = storage.write_streamed(self.fs, storage.join(own, name), produce, hasher=hasher)
        stats["bytes"] = size
        return fmt, {f"{self.writer_id}/{name}": {"size": size, "hash": HASH, "digest": hasher.hexdigest()}}

    def _store_manifest(self, manifest_path: str, manifest: dict) -> None:
        """The storage copy of a manifest the etcd record committed (create-if-absent). One left by
        another writer (an older run's same step, which this commit replaced in the record) is
        replaced too, so that the storage copy names the files the record names."""
        data = encode(manifest)
        if storage.create_exclusive(self.fs, manifest_path, data) \
                or self.folders.manifest_writer(manifest_path) == self.writer_id:
            return
        log.warning("replacing %s, another writer's manifest of a step this writer committed in the etcd record",
                    storage.redact(manifest_path))
        storage.remove(self.fs, manifest_path)
        storage.create_exclusive(self.fs, manifest_path, data)

    def _check_landed(self, own: str, files: dict) -> None:
        """Every file in this writer's folder with its size, else OSError: a stat of the one file a
        save writes, a listing for more."""
        names = [rel.split("/", 1)[1] for rel in files]
        if len(names) == 1:
            found = {names[0]: storage.size(self.fs, storage.join(own, names[0]))}
        else:
            found = storage.sizes(self.fs, own)
        for rel, info in files.items():
            got = found.get(rel.split("/", 1)[1])
            if got != info["size"]:
                raise OSError(f"{rel} has {got} bytes on storage after the upload, expected {info['size']}")


__all__ = ["Abandon", "Committer"]
