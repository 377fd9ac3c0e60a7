"""Loading checkpoints: the newest one that verifies, read without ever running code.

A candidate step is trusted only after every file its manifest lists has the listed size and
checksum (xxh3_128; sha256 in manifests written before format 2); anything else (in progress,
killed mid-upload, truncated, bit-flipped) is skipped with a warning that names it, and the next
older candidate is tried. Which candidates, in which order:

* with an etcd commit record (``record.py``, when the manager was given a ``Fence``): the
  record's steps in commit order (newest commit first, which is not always the highest step: a
  run started over commits below an older run's steps), verified against the record's file
  lists, then the storage manifests below the record's oldest step;
* without one: every step folder, newest first, with its manifest read from storage.

Deserializing never runs code: format 3 is JSON and raw bytes (``format.py``), formats 1 and 2
are read with ``torch.load(weights_only=True)``. A sharded checkpoint's shard files are verified
here (streamed, not kept) and read by their own loader (``sharded.py``); with ``share`` each
rank verifies only its share of them.

    reader = CheckpointReader(url, folders, record)
    found = reader.load()                 # (step, state) or None
"""

from __future__ import annotations

import io
import logging

import torch

from elastic_trainer.checkpoint import format as checkpoint_format
from elastic_trainer import storage
from elastic_trainer.checkpoint.manifest import DATA_FILE, DATA_FILE_V2, HASHES, StepFolders, expected_digest
from elastic_trainer.checkpoint.record import CommitRecord

log = logging.getLogger(__name__)


class CheckpointReader:
    """Finds, verifies and loads the checkpoints of ``url`` (see the module docstring).

    Args:
        url: the checkpoint URL (named in messages, redacted).
        folders: its step folders.
        record: the etcd commit record, when the manager was given a ``Fence``.
    """

    def __init__(self, url: str, folders: StepFolders, record: CommitRecord | None) -> None:
        self.url = url
        self.folders = folders
        self.record = record

    def load(self, step: int | None = None, *, share: tuple[int, int] | None = None,
             skip: frozenset[int] | set[int] = frozenset()) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid checkpoint (or of ``step``) not in ``skip``; None
        when there is none. ``share``: see ``read_verified``."""
        for candidate, manifest in self.candidates(step):
            if candidate in skip:
                continue
            try:
                state = self._verified_load(candidate, manifest, share)
            except Exception as exc:  # noqa: BLE001 - any defect means "skip it"; say which and why
                self._warn_skip(candidate, exc)
                continue
            log.info("loaded checkpoint step-%d from %s", candidate, storage.redact(self.url))
            return candidate, state
        return None

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint that verifies (sizes and checksums), or None."""
        for candidate, manifest in self.candidates(None):
            try:
                self.read_verified(candidate, manifest)
            except Exception as exc:  # noqa: BLE001 - skip defects, naming them
                self._warn_skip(candidate, exc)
                continue
            return candidate
        return None

    def candidates(self, step: int | None) -> list[tuple[int, dict | None]]:
        """``(step, manifest)`` to try, newest first: with an etcd record its steps in commit order
        (with the record's file lists), then the storage manifests below them; without one, every
        step folder (its manifest read from storage: None)."""
        entries = self.record.read()[0] if self.record is not None else []
        recorded = {e["step"]: e for e in entries}
        if step is not None:
            return [(step, recorded.get(step))] if step in recorded or step in self.folders.steps() else []
        if not entries:
            return [(s, None) for s in self.folders.steps()]
        # never a storage manifest at or above the record's oldest step that the record lacks: the
        # record is the commit, and such a manifest is not one of its checkpoints
        return [(e["step"], e) for e in entries] + \
            [(s, None) for s in self.folders.steps() if s < min(recorded)]

    def read_verified(self, step: int, manifest: dict | None = None,
                      share: tuple[int, int] | None = None) -> tuple[int, dict[str, bytes]]:
        """The manifest's format and the bytes of every file of ``step``, checked against its
        manifest (``manifest``, the etcd record's entry, else the one in storage); ValueError
        saying what is wrong. With ``share`` ``(index, count)`` only every count-th shard file
        (a sharded save's, in name order, from ``index``) is checked; every other file is."""
        if manifest is None:
            manifest = self.folders.read_manifest(step)
        if manifest is None:
            raise ValueError("no manifest (never committed: in progress, killed or abandoned)")
        fs = self.folders.fs
        out = {}
        shard = -1
        for rel, info in sorted(manifest["files"].items()):
            keep = manifest["format"] != 3 or rel.rsplit("/", 1)[-1] in (DATA_FILE, DATA_FILE_V2)
            if not keep:
                shard += 1
                if share is not None and shard % share[1] != share[0]:
                    continue  # another rank's share
            path = storage.join(self.folders.path(step), rel)
            algorithm, digest = expected_digest(info)
            try:
                if keep:
                    data = storage.read_bytes(fs, path)
                    size, hasher = len(data), None
                else:  # a shard (sharded.py): verified here, read by its own loader; streamed
                    data, size, hasher = None, 0, HASHES[algorithm]()
                    with fs.open(path, "rb") as f:
                        while chunk := f.read(storage.WRITE_PIECE * 4):
                            hasher.update(chunk)
                            size += len(chunk)
            except FileNotFoundError as exc:
                raise ValueError(f"{rel} is missing") from exc
            if size != info["size"]:
                raise ValueError(f"{rel} has {size} bytes, manifest says {info['size']} (truncated?)")
            if (hasher.hexdigest() if hasher is not None else HASHES[algorithm](data).hexdigest()) != digest:
                raise ValueError(f"{rel} fails its {algorithm} check (corrupted)")
            if keep:
                out[rel] = data
        return manifest["format"], out

    def _verified_load(self, step: int, manifest: dict | None, share: tuple[int, int] | None) -> dict:
        """Read, verify and deserialize ``step`` (never runs code; see the module docstring)."""
        fmt, blobs = self.read_verified(step, manifest, share)
        state: dict = {}
        for rel in list(blobs):
            data = blobs.pop(rel)
            try:
                if fmt == 3:
                    state.update(checkpoint_format.read(data))
                else:
                    state.update(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
            except Exception as exc:
                raise ValueError(f"{rel} does not load ({type(exc).__name__}: {exc})") from exc
        return state

    def _warn_skip(self, step: int, exc: BaseException) -> None:
        log.warning("skipping checkpoint %s: %s", storage.join(storage.redact(self.url), f"step-{step}"),
                    storage.redact(exc))


__all__ = ["CheckpointReader"]
