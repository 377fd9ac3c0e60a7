"""The shard readers and the source on real files written by the tests (pyarrow, numpy), on every store:
a local path, memory:// and S3 (moto's real HTTP endpoint), through the checkpoints' storage layer.

Run:  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_stream_readers.py
"""

from __future__ import annotations

import numpy as np
import pytest

from elastic_trainer.stream import ParquetReader, ShardedSource, TokenFileReader, list_shards
from elastic_trainer.stream.order import EpochOrder
from tests.helpers.stream_data import tokens_of, write_parquet_shards, write_token_files


def _check(rows, first_id, length=None):
    for k, row in enumerate(rows):
        assert row["id"] == first_id + k if "id" in row else True
        want = tokens_of(first_id + k, length if length is not None else len(row["tokens"]))
        assert row["tokens"].tolist() == want


def test_parquet_rows_of_any_range_across_row_groups_and_shards(any_url):
    urls = write_parquet_shards(any_url, [30, 17], row_group_size=7, varying=True)
    reader = ParquetReader(["id", "tokens"], batch_rows=4)
    assert [reader.num_rows(u) for u in urls] == [30, 17]
    # front to back in uneven steps (the cursor goes on), then jumps back and forward (it seeks)
    for start, stop in [(0, 3), (3, 10), (10, 11), (11, 30), (5, 6), (27, 29), (0, 30), (14, 22)]:
        rows = reader.read(urls[0], start, stop)
        assert len(rows) == stop - start
        _check(rows, start)
        assert all(isinstance(r["tokens"], np.ndarray) for r in rows)
    _check(reader.read(urls[1], 2, 17), 32)
    _check(reader.read(urls[0], 29, 30), 29)  # back to the first shard after the second
    assert reader.read(urls[1], 4, 4) == []
    with pytest.raises(ValueError, match="outside Parquet shard"):
        reader.read(urls[1], 17, 18)


def test_parquet_reads_only_the_row_groups_a_range_needs(tmp_path):
    """Row groups 0 and 1 of the shard are destroyed on disk: a range in row groups 2-3 reads as if
    nothing happened (they were never fetched or decoded), a range touching them fails."""
    import pyarrow.parquet as pq

    [url] = write_parquet_shards(tmp_path, [40], row_group_size=10)
    meta = pq.ParquetFile(url).metadata
    end_of_group_1 = max(meta.row_group(1).column(c).file_offset + meta.row_group(1).column(c).total_compressed_size
                         for c in range(meta.num_columns))
    with open(url, "r+b") as f:
        f.seek(4)  # after the magic bytes: every page of row groups 0 and 1
        f.write(b"\xff" * (end_of_group_1 - 4))
    reader = ParquetReader(["id", "tokens"])
    assert reader.num_rows(url) == 40  # the footer is intact
    _check(reader.read(url, 23, 40), 23)
    with pytest.raises(Exception):  # noqa: B017 - pyarrow's own error for a corrupt page, whatever its type
        reader.read(url, 5, 8)


def test_parquet_fetches_about_one_row_group_for_a_read_never_the_shard(tmp_path):
    """Bytes this process read from files (``/proc/self/io`` rchar, page cache included) to open a
    shard of 16 row groups of 128 kB (random, uncompressed) and read 10 rows from its middle: its
    footer and about one row group, not the rest of the shard (pyarrow's ``pre_buffer`` would fetch
    the row groups after it too: 1.4 MB here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    url = str(tmp_path / "random.parquet")
    values = np.random.default_rng(0).integers(0, 2**31 - 1, (16 * 64, 512), dtype=np.int32)
    pq.write_table(pa.table({"tokens": pa.array(list(values), pa.list_(pa.int32()))}), url, row_group_size=64,
                   compression="none", use_dictionary=False)
    group = pq.ParquetFile(url).metadata.row_group(4).total_byte_size

    def read_bytes() -> int:
        with open("/proc/self/io") as io:
            return int(next(line for line in io if line.startswith("rchar")).split()[1])

    before = read_bytes()
    rows = ParquetReader(["tokens"]).read(url, 4 * 64 + 5, 4 * 64 + 15)
    fetched = read_bytes() - before
    assert [r["tokens"].tolist() for r in rows] == values[4 * 64 + 5: 4 * 64 + 15].tolist()
    assert fetched < 2 * group, f"read {fetched} bytes for 10 rows; a row group is {group}, the shard 2 MB"


def test_a_parquet_shard_without_the_column_is_refused_naming_it(tmp_path):
    [url] = write_parquet_shards(tmp_path, [5])
    with pytest.raises(ValueError, match=r"no column \['text'\]"):
        ParquetReader(["text"]).num_rows(url)


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_token_files_give_fixed_rows_and_never_the_partial_one(any_url, dtype):
    urls = write_token_files(any_url, [9, 6], seq_len=5, dtype=dtype, extra_tokens=3)
    reader = TokenFileReader(5, dtype)
    assert [reader.num_rows(u) for u in urls] == [9, 6]
    for start, stop in [(0, 9), (4, 5), (2, 7)]:
        rows = reader.read(urls[0], start, stop)
        _check(rows, start, 5)
        assert rows[0]["tokens"].dtype == np.dtype(dtype)
    _check(reader.read(urls[1], 0, 6), 9, 5)
    with pytest.raises(ValueError, match="fewer than 7 rows"):
        reader.read(urls[1], 5, 7)


def test_list_shards_sorts_a_glob_and_the_urls_open_again(any_url):
    write_parquet_shards(any_url, [3, 4, 5])
    write_token_files(any_url, [2])
    found = list_shards(f"{any_url}/part-*.parquet")
    assert [u.rsplit("/", 1)[-1] for u in found] == ["part-000.parquet", "part-001.parquet", "part-002.parquet"]
    assert ParquetReader(["id"]).num_rows(found[2]) == 5
    with pytest.raises(ValueError, match="no file matches"):
        list_shards(f"{any_url}/nothing-*.parquet")


def test_keys_in_a_data_url_are_refused_without_showing_them():
    with pytest.raises(ValueError) as err:
        list_shards("s3://AKIAEXAMPLE:sEcReT@bucket/data/*.parquet")
    assert "sEcReT" not in str(err.value) and "environment" in str(err.value)
    with pytest.raises(ValueError, match="carries keys"):
        ShardedSource(["s3://AKIAEXAMPLE:sEcReT@bucket/a.parquet"], ParquetReader())


def test_the_source_reads_an_epochs_pieces_and_its_digest_ignores_where_the_shards_live(tmp_path):
    rows = [12, 0, 9, 20]
    here = ShardedSource(write_parquet_shards(tmp_path / "a", rows, row_group_size=5), ParquetReader(["id", "tokens"]))
    there = ShardedSource(write_parquet_shards("memory://copy/x", rows, row_group_size=5), ParquetReader(["id"]))
    assert here.row_counts() == there.row_counts() == rows
    assert here.digest() == there.digest()
    assert ShardedSource(here.shards[:3], here.reader).digest() != here.digest()
    order = EpochOrder(rows, seed=3, epoch=1, buffer=6)
    q = np.arange(5, 33)
    got = here.read(order.pieces(5, 33))
    assert [r["id"] for r in got] == order.ids(q).tolist()


def test_a_source_refuses_a_reader_that_is_not_one_and_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="num_rows"):
        ShardedSource(["a.parquet"], reader=object())
    with pytest.raises(ValueError, match="one count"):
        ShardedSource(["a.parquet", "b.parquet"], ParquetReader(), sizes=[3])
