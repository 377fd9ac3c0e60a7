"""Retention: which step folders a checkpoint URL keeps after a commit, and removing the rest.

After each commit the writer keeps the newest ``keep_checkpoints`` committed checkpoints and
removes older ones, and removes what no checkpoint needs: step folders that were never committed
(killed or fenced writers) below every kept checkpoint, and the data folders of writers that lost
a commit inside kept steps. Rules:

* the step just committed (``protect``) is never removed, even when newer manifests exist whose
  data might be damaged: it is the one this writer knows complete;
* with an etcd commit record (``record.py``) the record's steps are what loaders pick (a round
  may be loading any of them): every one of them is kept, and storage manifests below them fill
  up to ``keep_checkpoints``; a step at or above the record's oldest that the record lacks is
  left alone;
* an uncommitted folder is removed only below the oldest kept checkpoint: a writer still
  uploading an older step could only ever produce a checkpoint older than every kept one.

    Retention(folders, record, keep=3).prune(protect=120)
"""

from __future__ import annotations

import logging

from elastic_trainer import storage
from elastic_trainer.checkpoint.manifest import MANIFEST, StepFolders
from elastic_trainer.checkpoint.record import CommitRecord

log = logging.getLogger(__name__)


class Retention:
    """Keeps the newest ``keep`` committed checkpoints in ``folders`` (see the module docstring)."""

    def __init__(self, folders: StepFolders, record: CommitRecord | None, keep: int) -> None:
        self.folders = folders
        self.record = record
        self.keep = keep

    def prune(self, protect: int) -> None:
        """Remove old checkpoints and stale leftovers; never ``protect`` nor a step in the record."""
        folders, fs = self.folders, self.folders.fs
        steps = folders.steps()
        recorded = {e["step"]: e for e in self.record.read()[0]} if self.record is not None else {}
        committed: list[tuple[int, dict]] = []
        uncommitted: list[int] = []
        for step in steps:
            if step in recorded:
                committed.append((step, recorded[step]))
                continue
            try:
                manifest = folders.read_manifest(step)
            except (ValueError, OSError):
                manifest = None
            if manifest is None:
                uncommitted.append(step)
            else:
                committed.append((step, manifest))
        if not committed:
            return
        if recorded:
            below = [(s, m) for s, m in committed if s < min(recorded)]
            kept = [(s, recorded[s]) for s in sorted(recorded, reverse=True) if s in dict(committed)]
            kept += below[: max(0, self.keep - len(kept))]
            removable = [(s, m) for s, m in below if (s, m) not in kept]
        else:
            kept = committed[: self.keep]
            removable = committed[self.keep:]
        if not kept:
            return
        oldest_kept = min(s for s, _ in kept)
        for step, _ in removable:
            if step == protect or step in recorded:
                continue
            log.debug("removing old checkpoint step-%d (keeping %d)", step, self.keep)
            storage.remove(fs, folders.path(step))
        for step in uncommitted:
            if step < oldest_kept:  # leftovers of killed or fenced writers
                log.info("removing uncommitted leftover step-%d", step)
                storage.remove(fs, folders.path(step))
        for step, manifest in kept:  # losers' data folders inside committed steps
            live = {rel.split("/", 1)[0] for rel in manifest["files"]} | {MANIFEST}
            for name in storage.list_dir(fs, folders.path(step)):
                if name not in live and not name.startswith("."):
                    storage.remove(fs, storage.join(folders.path(step), name))


__all__ = ["Retention"]
