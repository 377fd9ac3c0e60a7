"""A sharded, streamed source: what a ``Task`` gives instead of a map-style dataset.

    from elastic_trainer.stream import ParquetReader, ShardedSource

    def build(args):
        source = ShardedSource.from_glob("s3://bucket/corpus/*.parquet", ParquetReader(["tokens"]),
                                         transform=to_sample, shuffle_buffer=4096)
        return Task(model=..., dataset=source, loss_fn=...)

The shards are files or fsspec URLs (``list_shards`` expands a glob, sorted by name), read through
the storage layer the checkpoints use too (``elastic_trainer/storage.py``: local and NFS paths, ``memory://``,
``s3://`` with ``AWS_*`` credentials and ``ELASTIC_TRAINER_S3_ENDPOINT_URL`` from the environment;
a URL with keys in it is refused, as it would put them in argv and logs). The order of the list
defines the sample ids (``order.py``), so keep a shard list stable while a run lives: a resume
checks it against the digest saved with the position (``digest``: shard names relative to their
common folder, and row counts).

A row (what the reader returns: a dict of columns) becomes a sample through ``transform`` in the
process that reads it (a DataLoader worker with ``--num-workers``); the task's ``collate_fn`` then
makes micro-batches of samples, as in the map-style mode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_trainer import storage
from elastic_trainer.stream.readers import ShardReader

log = logging.getLogger(__name__)


def list_shards(url_glob: str) -> list[str]:
    """The files matching ``url_glob`` (a path or fsspec URL with ``*``, ``?``, ``[...]``), sorted, as URLs."""
    if storage.has_credentials(url_glob):
        raise ValueError(f"{storage.redact(url_glob)!r}: give storage keys in the environment (AWS_ACCESS_KEY_ID, "
                         "AWS_SECRET_ACCESS_KEY), not in a data URL, which would put them in argv and the logs.")
    fs, pattern = storage.get_fs(url_glob)
    fs.invalidate_cache()
    found = sorted(name for name, info in fs.glob(pattern, detail=True).items() if info.get("type") == "file")
    if not found:
        raise ValueError(f"no file matches {storage.redact(url_glob)!r}; check the path and the pattern "
                         "(e.g. data/*.parquet, s3://bucket/prefix/*.parquet).")
    return found if "://" not in url_glob else [fs.unstrip_protocol(name) for name in found]


def _relative_names(shards: Sequence[str]) -> list[str]:
    paths = [s.split("://", 1)[-1] for s in shards]
    common = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    return [os.path.relpath(p, common) if common else p for p in paths]


@dataclass
class ShardedSource:
    """Shards read front to back by ``reader``, with the stream's shuffle settings."""

    shards: Sequence[str]
    """The shard files or fsspec URLs; their order defines the sample ids (``list_shards`` sorts by name)."""
    reader: ShardReader
    """Reads rows of one shard (``ParquetReader``, ``TokenFileReader`` or your own ``ShardReader``)."""
    transform: Callable[[Any], Any] | None = None
    """``transform(row) -> sample``, run where the row is read; picklable for spawned workers. Default: the row."""
    shuffle_buffer: int = 1024
    """Rows in one shuffle block (``order.py``): a reader holds this many rows and visits them in a seeded order."""
    shuffle: bool = True
    """``False``: the shards in the listed order, each front to back, no block shuffle."""
    sizes: Sequence[int] | None = None
    """Rows of each shard when known (e.g. from an index file); default: asked of the reader (Parquet footers)."""
    _counts: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.shards = [str(s) for s in self.shards]
        if not self.shards:
            raise ValueError("a ShardedSource needs at least one shard; list_shards(glob) finds them.")
        leaked = [storage.redact(s) for s in self.shards if storage.has_credentials(s)]
        if leaked:
            raise ValueError(f"shard URL {leaked[0]!r} carries keys; give them in the environment (AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY) instead.")
        if not isinstance(self.reader, ShardReader):
            raise ValueError(f"ShardedSource.reader must have num_rows(url) and read(url, start, stop); got "
                             f"{type(self.reader).__name__}.")
        if self.shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be at least 1 row, got {self.shuffle_buffer}.")
        if self.sizes is not None:
            self._counts = [int(n) for n in self.sizes]
            if len(self._counts) != len(self.shards) or min(self._counts) < 0:
                raise ValueError(f"sizes gives {len(self._counts)} row counts for {len(self.shards)} shards; give one "
                                 "count (>= 0) per shard, in the shards' order.")

    @classmethod
    def from_glob(cls, url_glob: str, reader: ShardReader, **kwargs: Any) -> "ShardedSource":
        """The source of every file matching ``url_glob`` (``list_shards``)."""
        return cls(list_shards(url_glob), reader, **kwargs)

    def row_counts(self) -> list[int]:
        """Rows of each shard, asked of the reader once (the Parquet footers; a token file's size)."""
        if self._counts is None:
            self._counts = [int(self.reader.num_rows(url)) for url in self.shards]
            log.info("stream: %d shards, %d rows", len(self.shards), sum(self._counts))
        return self._counts

    def digest(self) -> str:
        """A fingerprint of the shard list: names relative to their common folder, and row counts."""
        text = json.dumps([_relative_names(self.shards), self.row_counts()])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def read(self, pieces: Sequence[tuple[int, int, int]]) -> list[Any]:
        """The rows of ``pieces`` (``(shard index, first row, end row)``, see ``EpochOrder.pieces``), in order."""
        rows: list[Any] = []
        for shard, start, stop in pieces:
            got = self.reader.read(self.shards[shard], start, stop)
            if len(got) != stop - start:
                raise ValueError(f"{type(self.reader).__name__} returned {len(got)} rows for rows [{start}, {stop}) of "
                                 f"{storage.redact(self.shards[shard])}; a reader must return exactly the rows asked for.")
            rows += got
        return rows

    def sample(self, row: Any) -> Any:
        """``transform(row)``, or the row itself."""
        return row if self.transform is None else self.transform(row)
