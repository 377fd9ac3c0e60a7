"""Stream shards the tests write themselves with pyarrow and numpy, on any store (a path, memory://, s3://).

Every row says which sample it is: row ``i`` of shard ``s`` has ``id = sum(rows[:s]) + i`` (the
stream's sample id) and ``tokens`` derived from it (``tokens_of``), so a test can check that the
samples a reader or a DataLoader worker delivered are the ones their ids name.

    urls = write_parquet_shards("memory://data", [40, 25, 60], row_group_size=7)
    urls = write_token_files(tmp_path, [40, 25], seq_len=4, dtype="uint16")
"""

from __future__ import annotations

import numpy as np

from elastic_trainer import storage

VOCAB = 16
"""Tokens are in 1..VOCAB-1, so the built-in example (``--vocab-size 16``) can train on them."""


def tokens_of(sample_id: int, length: int) -> list[int]:
    """The tokens of the sample with this id (in 1..VOCAB-1)."""
    return [(sample_id * 7 + 3 * j + sample_id // 13) % (VOCAB - 1) + 1 for j in range(length)]


def _paths(url: str, count: int, suffix: str) -> tuple[object, list[str]]:
    fs, root = storage.get_fs(str(url))
    storage.makedirs(fs, root)
    return fs, [storage.join(root, f"part-{i:03d}.{suffix}") for i in range(count)]


def _as_url(url: str, fs, path: str) -> str:
    return fs.unstrip_protocol(path) if "://" in str(url) else path


def write_parquet_shards(url, rows: list[int], *, length: int = 4, row_group_size: int = 8,
                         varying: bool = False) -> list[str]:
    """Parquet shards with columns ``id`` (int64) and ``tokens`` (list<int32>); ``varying``: rows of
    ``length`` to ``length + 3`` tokens. Returns their URLs in id order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, paths = _paths(url, len(rows), "parquet")
    base = 0
    for path, n in zip(paths, rows):
        ids = list(range(base, base + n))
        tokens = [tokens_of(i, length + (i % 4 if varying else 0)) for i in ids]
        table = pa.table({"id": pa.array(ids, pa.int64()), "tokens": pa.array(tokens, pa.list_(pa.int32()))})
        with fs.open(path, "wb") as f:
            pq.write_table(table, f, row_group_size=row_group_size)
        base += n
    return [_as_url(url, fs, p) for p in paths]


def write_token_files(url, rows: list[int], *, seq_len: int = 4, dtype: str = "uint16", extra_tokens: int = 0) -> list[str]:
    """Flat token files of ``dtype``: row ``i`` of file ``s`` holds ``tokens_of(id)``; ``extra_tokens``
    appends a partial row that no reader may deliver. Returns their URLs in id order."""
    fs, paths = _paths(url, len(rows), "bin")
    base = 0
    for path, n in zip(paths, rows):
        flat = [t for i in range(base, base + n) for t in tokens_of(i, seq_len)] + [1] * extra_tokens
        with fs.open(path, "wb") as f:
            f.write(np.asarray(flat, dtype=dtype).tobytes())
        base += n
    return [_as_url(url, fs, p) for p in paths]
