"""Storage through fsspec: one URL names where checkpoints live, on any filesystem.

``memory://``, local or NFS paths, ``s3://bucket/prefix`` (s3fs) and every other protocol
fsspec knows work the same way. Storage options come from the environment (for S3:
``AWS_*`` credentials, ``ELASTIC_TRAINER_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL`` for a
non-AWS endpoint) and are never logged.
"""

from __future__ import annotations

import os
import uuid

import fsspec
from fsspec.core import url_to_fs


class StorageError(RuntimeError):
    """Storage cannot be used: unreachable, unwritable, or a write failed."""


def storage_options(url: str) -> dict:
    """Options for ``url``'s filesystem, from the environment (secrets stay out of logs)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("ELASTIC_TRAINER_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return {}


def get_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for ``url``; ``StorageError`` for an unknown protocol."""
    try:
        return url_to_fs(url, **storage_options(url))
    except (ValueError, ImportError) as exc:
        raise StorageError(f"cannot open {url!r}: {exc}") from exc


def check_writable(url: str) -> None:
    """Create ``url`` if needed and write, read back and delete a probe file in it.

    Raises ``StorageError`` with one sentence when the location cannot be written.
    """
    fs, root = get_fs(url)
    probe = f"{root.rstrip('/')}/.write-probe-{uuid.uuid4().hex}"
    try:
        fs.makedirs(root, exist_ok=True)
        with fs.open(probe, "wb") as f:
            f.write(b"ok")
        with fs.open(probe, "rb") as f:
            if f.read() != b"ok":
                raise StorageError(f"{url!r} did not read back what was written")
        fs.rm(probe)
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means "not writable"; say which
        raise StorageError(f"{url!r} is not writable ({type(exc).__name__}: {exc})") from exc
