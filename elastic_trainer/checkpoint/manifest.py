"""The step folders of a checkpoint URL and the manifest that commits each one.

A checkpoint is the folder ``<url>/step-<N>/``; its data files live under a folder per writer
(``<writer-id>/state.bin``) and ``manifest.json``, written last, lists every file with its size
and checksum. A folder without a manifest that parses is not a checkpoint (in progress, killed,
fenced). This module names those files, lists the step folders and reads a manifest, checked
field by field; the writer (``writer.py``, ``commit.py``), the reader (``reader.py``) and
retention (``retention.py``) all go through it.

    folders = StepFolders(fs, root)
    folders.steps()                       # [120, 100, 80]: every step folder, newest first
    manifest = folders.read_manifest(120) # None when absent; ValueError when it is malformed
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable

import xxhash

from elastic_trainer.checkpoint import format as checkpoint_format
from elastic_trainer import storage

FORMAT_VERSION = checkpoint_format.FORMAT
"""What new manifests record: 3, one ``checkpoint_format`` file (2 when the state holds a tensor
without a raw layout: one ``torch.save`` file; 1, still read: a file per top-level entry)."""
READABLE_FORMATS = (1, 2, 3)
MANIFEST = "manifest.json"
HASH = "xxh3_128"
"""The checksum new manifests record for each file (sha256 ones, from format 1, still verify)."""
HASHES: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Every checksum a manifest may name, by its name: a new hasher of it."""
DATA_FILE_V2 = "state.pt"
"""The data file of formats 2 (and 1): ``torch.save``."""
DATA_FILE = "state.bin"
"""The data file of format 3: ``checkpoint_format``."""
STEP_RE = re.compile(r"^step-(\d+)$")


def expected_digest(info: dict) -> tuple[str, str] | None:
    """``(algorithm, hex digest)`` of a manifest file entry (either format), None if unusable."""
    algorithm, digest = (info.get("hash"), info.get("digest")) if "hash" in info else ("sha256", info.get("sha256"))
    if algorithm not in HASHES or not isinstance(digest, str):
        return None
    return algorithm, digest


def encode(manifest: dict) -> bytes:
    """The bytes of ``manifest`` as ``manifest.json`` holds them."""
    return json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()


class StepFolders:
    """The ``step-<N>/`` folders under ``root`` on ``fs`` (see the module docstring)."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root

    def path(self, step: int) -> str:
        """The folder of ``step``."""
        return storage.join(self.root, f"step-{step}")

    def manifest_path(self, step: int) -> str:
        return storage.join(self.path(step), MANIFEST)

    def steps(self) -> list[int]:
        """Steps that have a folder, newest first (committed or not)."""
        out = []
        for name in storage.list_dir(self.fs, self.root):
            m = STEP_RE.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out, reverse=True)

    def read_manifest(self, step: int) -> dict | None:
        """The parsed manifest of ``step``, None when absent; ValueError when it does not parse."""
        try:
            raw = storage.read_bytes(self.fs, self.manifest_path(step))
        except FileNotFoundError:
            return None
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS \
                or manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
            raise ValueError("manifest has the wrong format, step or file list")
        for rel, info in manifest["files"].items():
            if (".." in rel.split("/") or rel.startswith("/") or not isinstance(info, dict)
                    or not isinstance(info.get("size"), int)):
                raise ValueError(f"manifest lists a bad entry {rel!r}")
            if expected_digest(info) is None:
                raise ValueError(f"manifest lists {rel!r} without a checksum this version knows "
                                 f"({info.get('hash', 'sha256')!r}; known: {', '.join(sorted(HASHES))})")
        return manifest

    def manifest_writer(self, manifest_path: str) -> str | None:
        """The writer id in an existing manifest ("" when unreadable), None when there is none."""
        try:
            raw = storage.read_bytes(self.fs, manifest_path)
        except FileNotFoundError:
            return None
        try:
            return str(json.loads(raw).get("writer") or "")
        except (ValueError, AttributeError):
            return ""


__all__ = ["DATA_FILE", "DATA_FILE_V2", "FORMAT_VERSION", "HASH", "HASHES", "MANIFEST", "READABLE_FORMATS",
           "StepFolders", "encode", "expected_digest"]
