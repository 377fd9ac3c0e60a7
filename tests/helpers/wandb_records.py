"""Read the records of a W&B offline run file (``offline-run-*/run-<id>.wandb``).

The file is what ``wandb sync`` uploads: a 7-byte header (``:W&B``, a 2-byte magic, a version
byte) and then LevelDB's log format, 32 KiB blocks of chunks (crc32, 2-byte length, type), each
record a ``wandb_internal_pb2.Record``. wandb 0.31 no longer ships a Python reader for it
(``wandb.sdk.internal.datastore`` is gone with the Python backend), so the tests read it here.
"""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> list:
    """Every record of the file, in order, as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (it starts {data[:4]!r})")
    records, pending, pos = [], b"", 7
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:  # the block's tail is padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        body = data[pos + CHUNK_HEADER: pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def record_kinds(path: str | Path) -> list[str]:
    """The kind of each record (``run``, ``history``, ``preempting``, ``exit``, ...), in order."""
    return [r.WhichOneof("record_type") for r in read_records(path)]


def exit_code(path: str | Path) -> int | None:
    """The exit code the run ended with (its ``exit`` record), or None when it never ended."""
    codes = [r.exit.exit_code for r in read_records(path) if r.WhichOneof("record_type") == "exit"]
    return codes[-1] if codes else None
