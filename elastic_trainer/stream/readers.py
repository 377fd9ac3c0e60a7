"""Shard readers: the rows ``[start, stop)`` of one shard, read front to back, never the whole shard.

A reader is any object with two methods (``ShardReader``)::

    reader.num_rows(url) -> int                      # rows in the shard (from its footer or its size)
    reader.read(url, start, stop) -> list[row]       # those rows, in order

A row is a ``dict`` of column name to value; a list column's value is a numpy array (a view, no
copy). Shards are fsspec URLs opened through ``elastic_trainer/storage.py`` (local paths, ``memory://``,
``s3://`` with the same options and environment as checkpoints). Two readers ship here:

- ``ParquetReader``: Parquet through pyarrow. It reads only the footer to count rows, and only the
  row groups a read needs, one at a time (its column chunks fetched in one coalesced read, then
  decoded in record batches of ``batch_rows`` rows), so memory holds one row group's chunks and one
  batch, never a shard (``tests/test_stream_readers.py`` counts the bytes read). A row group is the
  smallest unit Parquet can seek to: a read that starts inside one decodes it from its start. The
  reader keeps a cursor, so reads that go on where the last one stopped (a rank's stream reads its
  shards front to back) decode every row once. Keep row groups moderate (the example writes 256-row
  groups; a few MB to tens of MB is a good size).
- ``TokenFileReader``: raw token files, a flat array of ``dtype`` tokens (nanoGPT's ``train.bin``);
  row ``i`` is the ``seq_len`` tokens from ``i * seq_len`` (a shorter remainder at the end is never
  read). A read is one ranged read of exactly its bytes.

``datasets`` (Hugging Face) in streaming mode is not wrapped: its ``IterableDataset`` can only skip
rows by reading them. Its shards are addressable when they are Parquet files, as every dataset on
the Hub is (its ``refs/convert/parquet`` branch): list them as ``hf://datasets/<repo>@~parquet/...``
URLs (fsspec's ``hf://`` protocol, from ``huggingface_hub``) and read them with ``ParquetReader``.

Readers open files lazily in the process that reads (a DataLoader worker opens its own), so they
can be pickled to spawned workers and are never shared across a fork.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from elastic_trainer import storage

log = logging.getLogger(__name__)

_OPEN_FILES = 2  # Parquet shards a reader keeps open (the one being read and the one before it)


@runtime_checkable
class ShardReader(Protocol):
    """What ``ShardedSource`` needs of a reader."""

    def num_rows(self, url: str) -> int: ...

    def read(self, url: str, start: int, stop: int) -> list[Any]: ...


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("reading Parquet shards needs pyarrow: pip install 'elastic-trainer[stream]'") from exc
    return pq


def rows_of(batch) -> list[dict[str, Any]]:
    """A pyarrow ``RecordBatch`` as rows: list columns of numbers become numpy views, others Python values."""
    import pyarrow as pa

    columns: dict[str, list[Any]] = {}
    for name, col in zip(batch.schema.names, batch.columns):
        kind = col.type
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and \
                (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)) and col.null_count == 0:
            offsets = col.offsets.to_numpy()
            values = col.values.to_numpy(zero_copy_only=False)
            columns[name] = [values[offsets[i]:offsets[i + 1]] for i in range(len(col))]
        else:
            columns[name] = col.to_pylist()
    names = list(columns)
    return [{name: columns[name][i] for name in names} for i in range(batch.num_rows)]


@dataclass
class _Cursor:
    """Where a Parquet reader's batch iterator is: the next row it yields, in one shard."""

    url: str
    row_group: int  # the row group being read
    row: int  # the shard row of the first row of ``pending`` (or of the next batch)
    batches: Any  # the iterator over the row group's record batches
    pending: Any = None  # the rest of a batch a read stopped inside


class ParquetReader:
    """Rows of Parquet shards (see the module docstring).

    Args:
        columns: the columns to read (default all); other columns are not even fetched.
        batch_rows: rows per decoded record batch; a read holds at most one batch besides its rows.
    """

    def __init__(self, columns: list[str] | None = None, batch_rows: int = 1024) -> None:
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be at least 1, got {batch_rows}.")
        self.columns, self.batch_rows = (list(columns) if columns else None), batch_rows
        self._files: OrderedDict[str, tuple[Any, Any, list[int]]] = OrderedDict()
        self._cursor: _Cursor | None = None
        self._pid = os.getpid()

    def num_rows(self, url: str) -> int:
        pq = _pyarrow()
        fs, path = storage.get_fs(url)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            missing = [c for c in self.columns or () if c not in names]
            if missing:
                raise ValueError(f"Parquet shard {storage.redact(url)} has no column {missing}; it has {names}; "
                                 "name columns that exist.")
            return int(pf.metadata.num_rows)

    def _open(self, url: str) -> tuple[Any, Any, list[int]]:
        """``(file, ParquetFile, first row of each row group + the total)``, cached for the last few shards."""
        if self._pid != os.getpid():  # a forked copy: the parent's handles are not ours to use or close
            self._files, self._cursor, self._pid = OrderedDict(), None, os.getpid()
        if url in self._files:
            self._files.move_to_end(url)
            return self._files[url]
        pq = _pyarrow()
        fs, path = storage.get_fs(url)
        f = fs.open(path, "rb")
        pf = pq.ParquetFile(f, pre_buffer=True)  # one row group's column chunks in one coalesced read
        starts = [0]
        for i in range(pf.metadata.num_row_groups):
            starts.append(starts[-1] + pf.metadata.row_group(i).num_rows)
        self._files[url] = (f, pf, starts)
        while len(self._files) > _OPEN_FILES:
            _, (old, _, _) = self._files.popitem(last=False)
            old.close()
        return self._files[url]

    def _batches(self, pf: Any, group: int) -> Any:
        """Record batches of one row group: a batch never spans two, so a read decodes only the groups it needs."""
        return pf.iter_batches(batch_size=self.batch_rows, row_groups=[group], columns=self.columns, use_threads=False)

    def _seek(self, url: str, start: int) -> _Cursor:
        """A cursor at or before row ``start``: the current one when it can go on, else one at start's row group."""
        _, pf, starts = self._open(url)
        if not 0 <= start < starts[-1]:
            raise ValueError(f"row {start} is outside Parquet shard {storage.redact(url)} of {starts[-1]} rows.")
        group = bisect.bisect_right(starts, start) - 1
        cur = self._cursor
        if cur is not None and cur.url == url and cur.row <= start and cur.row_group == group:
            return cur
        self._cursor = _Cursor(url, group, starts[group], self._batches(pf, group))
        return self._cursor

    def read(self, url: str, start: int, stop: int) -> list[dict[str, Any]]:
        if stop <= start:
            return []
        cur = self._seek(url, start)
        _, pf, starts = self._open(url)
        rows: list[dict[str, Any]] = []
        while cur.row < stop:
            batch = cur.pending if cur.pending is not None else next(cur.batches, None)
            if batch is None:  # the row group is done: on to the next one
                if cur.row != starts[cur.row_group + 1] or cur.row_group + 2 >= len(starts):
                    raise ValueError(f"Parquet shard {storage.redact(url)} ended at row {cur.row}, before row {stop}; "
                                     "was it rewritten while training read it?")
                cur.row_group += 1
                cur.batches = self._batches(pf, cur.row_group)
                continue
            n = batch.num_rows
            lo, hi = max(start - cur.row, 0), min(stop - cur.row, n)
            if lo < hi:
                rows += rows_of(batch.slice(lo, hi - lo))
            cur.pending = batch.slice(hi) if hi < n else None
            cur.row += hi
        return rows

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_files"], state["_cursor"] = OrderedDict(), None  # handles do not travel to other processes
        return state

    def __repr__(self) -> str:
        return f"ParquetReader(columns={self.columns}, batch_rows={self.batch_rows})"


class TokenFileReader:
    """Fixed-length sequences from flat binary token files (see the module docstring).

    Args:
        seq_len: tokens per row.
        dtype: the tokens' numpy dtype as stored (``uint16`` for vocabularies under 65,536).
        column: the name of the row's one column.
    """

    def __init__(self, seq_len: int, dtype: str = "uint16", column: str = "tokens") -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}.")
        self.seq_len, self.dtype, self.column = seq_len, np.dtype(dtype), column
        self.row_bytes = seq_len * self.dtype.itemsize

    def num_rows(self, url: str) -> int:
        fs, path = storage.get_fs(url)
        size = storage.size(fs, path)
        if size is None:
            raise ValueError(f"token file {storage.redact(url)} does not exist.")
        if size % self.row_bytes:
            log.debug("token file %s: the last %d bytes make no whole row of %d tokens and are not read",
                      storage.redact(url), size % self.row_bytes, self.seq_len)
        return size // self.row_bytes

    def read(self, url: str, start: int, stop: int) -> list[dict[str, Any]]:
        if stop <= start:
            return []
        fs, path = storage.get_fs(url)
        data = fs.cat_file(path, start=start * self.row_bytes, end=stop * self.row_bytes)
        if len(data) != (stop - start) * self.row_bytes:
            raise ValueError(f"token file {storage.redact(url)} holds fewer than {stop} rows of {self.seq_len} tokens; "
                             "was it rewritten while training read it?")
        tokens = np.frombuffer(data, dtype=self.dtype).reshape(stop - start, self.seq_len)
        return [{self.column: row} for row in tokens]

    def __repr__(self) -> str:
        return f"TokenFileReader(seq_len={self.seq_len}, dtype={self.dtype.name})"
