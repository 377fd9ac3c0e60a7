"""Storage: writability checks with one-line errors, and the atomic create-if-absent commit."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from elastic_trainer import storage
from elastic_trainer.etcd.server import free_port
from tests.helpers.common import mounted_tmpfs

pytestmark = pytest.mark.timeout(120)


def test_writable_location_passes_and_leaves_no_probe(any_url):
    storage.check_writable(any_url)
    fs, root = storage.get_fs(any_url)
    assert storage.list_dir(fs, root) == []


def test_directory_under_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(storage.StorageError) as info:
        storage.check_writable(str(tmp_path / "afile" / "ckpt"))
    assert "is not writable" in str(info.value) and "\n" not in str(info.value)


def test_read_only_filesystem_is_a_one_line_error(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", size="1m", read_only=True) as mnt:
        with pytest.raises(storage.StorageError, match="is not writable") as info:
            storage.check_writable(str(mnt / "ckpt"))
        assert "\n" not in str(info.value)


def test_missing_bucket_is_a_one_line_error_and_is_not_created(s3_endpoint):
    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(storage.StorageError, match="is not writable") as info:
        storage.check_writable(f"s3://{bucket}/run")
    assert "\n" not in str(info.value)
    fs, _ = storage.get_fs(f"s3://{bucket}")
    assert not storage.exists(fs, bucket)


def test_unreachable_s3_endpoint_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("ELASTIC_TRAINER_S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # closed port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(storage.StorageError, match="is not writable") as info:
        storage.check_writable(f"s3://nobucket-{uuid.uuid4().hex[:8]}/x")
    assert "\n" not in str(info.value) and "testing" not in str(info.value)


def test_unknown_protocol_is_a_storage_error():
    with pytest.raises(storage.StorageError, match="cannot open"):
        storage.get_fs("nosuchproto://x/y")


@pytest.mark.parametrize("url", ["gs://bucket/run", "gcs://bucket/run", "az://container/run", "abfs://c@acct/run",
                                 "simplecache::gs://bucket/run"])
def test_stores_without_a_tested_atomic_create_are_refused_naming_the_protocol(url):
    protocol = url.split("::")[-1].split("://")[0]
    with pytest.raises(storage.StorageError, match=rf"checkpoints cannot be committed atomically on {protocol}://"):
        storage.check_writable(url)


def test_create_exclusive_refuses_a_filesystem_whose_create_is_check_then_write(tmp_path):
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    fs = DirFileSystem(path=str(tmp_path), fs=LocalFileSystem())  # a real fsspec store, protocol "dir"
    with pytest.raises(storage.StorageError, match="cannot be committed atomically on dir://"):
        storage.create_exclusive(fs, "manifest.json", b"{}")
    assert not (tmp_path / "manifest.json").exists()


def test_credentials_in_urls_are_redacted():
    assert storage.redact("s3://AKIA:secret@bucket/x and http://u:p@h/") == "s3://***@bucket/x and http://***@h/"
    assert storage.redact("/plain/path") == "/plain/path"


def test_create_exclusive_has_exactly_one_winner_among_racing_writers(any_url):
    fs, root = storage.get_fs(any_url)
    storage.makedirs(fs, root)
    path = storage.join(root, "manifest.json")
    results: dict[int, bool] = {}
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        results[i] = storage.create_exclusive(fs, path, f"writer-{i}".encode() * 1000)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(winners) == 1
    assert storage.read_bytes(fs, path) == f"writer-{winners[0]}".encode() * 1000
    assert storage.list_dir(fs, root) == ["manifest.json"]  # no temp files left behind


def test_size_exists_remove_and_list(any_url):
    fs, root = storage.get_fs(any_url)
    storage.makedirs(fs, storage.join(root, "d"))
    storage.write_bytes(fs, storage.join(root, "d", "f.bin"), b"12345")
    assert storage.size(fs, storage.join(root, "d", "f.bin")) == 5
    assert storage.size(fs, storage.join(root, "d", "nope")) is None
    assert storage.exists(fs, storage.join(root, "d", "f.bin"))
    assert "d" in storage.list_dir(fs, root)
    storage.remove(fs, storage.join(root, "d"))
    storage.remove(fs, storage.join(root, "d"))  # missing is fine
    assert not storage.exists(fs, storage.join(root, "d", "f.bin"))



def _record_writeback_hints(monkeypatch) -> list[tuple[int, int]]:
    """(offset, bytes) of every ``sync_file_range`` writeback hint storage sends (none where the
    platform has no sync_file_range)."""
    hints: list[tuple[int, int]] = []
    real = storage.SYNC_FILE_RANGE
    if real is not None:
        def recording(fd, offset, nbytes, flags):
            hints.append((offset, nbytes))
            return real(fd, offset, nbytes, flags)
        monkeypatch.setattr(storage, "SYNC_FILE_RANGE", recording)
    return hints

def test_write_streamed_writes_and_hashes_every_byte_in_order(any_url, monkeypatch):
    import array

    import xxhash

    monkeypatch.setattr(storage, "WRITEBACK_CHUNK", 4096)  # many writeback hints on a local disk
    hints = _record_writeback_hints(monkeypatch)
    pieces = [b"header", bytes(range(256)) * 40, memoryview(array.array("d", range(1000))), b"", b"tail" * 3000]
    want = b"".join(bytes(memoryview(p).cast("B")) if isinstance(p, memoryview) else p for p in pieces)
    fs, root = storage.get_fs(any_url)
    storage.makedirs(fs, root)
    path = storage.join(root, "streamed.bin")
    hasher = xxhash.xxh3_128()

    def produce(out):
        for p in pieces:
            out.write(p)

    assert storage.write_streamed(fs, path, produce, hasher=hasher) == len(want)
    assert storage.read_bytes(fs, path) == want
    assert hasher.hexdigest() == xxhash.xxh3_128(want).hexdigest()
    if storage.is_local(fs) and storage.SYNC_FILE_RANGE is not None:
        assert hints and hints[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(hints, hints[1:]))  # contiguous, in order


def test_write_streamed_reports_the_storage_error_not_torch_save_s(tmp_path):
    import errno

    import torch
    from fsspec.implementations.local import LocalFileSystem

    class FullAfter:
        def __init__(self, path, limit):
            self.f, self.limit = open(path, "wb"), limit

        def write(self, data):
            if self.f.tell() + memoryview(data).nbytes > self.limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def flush(self):
            self.f.flush()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    class FullDisk(LocalFileSystem):
        cachable = False

        def open(self, path, mode="rb", **kwargs):
            return FullAfter(path, 100_000) if "w" in mode else super().open(path, mode, **kwargs)

    with pytest.raises(OSError, match="No space left on device") as info:
        storage.write_streamed(FullDisk(), str(tmp_path / "f.pt"), lambda out: torch.save(torch.ones(100_000), out))
    assert info.value.errno == errno.ENOSPC


def test_write_parts_writes_and_hashes_the_concatenation(any_url):
    """A format-3 save hands over its header and its arena: every store gets their concatenation
    (S3 reads the request body from the buffers themselves), hashed in order."""
    import xxhash

    arena = torch.arange(300_000, dtype=torch.int32)  # 1.2 MB, a tensor's memory like an arena's
    parts = [b"head" * 10, memoryview(arena.numpy()), b"", b"tail"]
    want = b"head" * 10 + arena.numpy().tobytes() + b"tail"
    fs, root = storage.get_fs(any_url)
    storage.makedirs(fs, root)
    path = storage.join(root, "parts.bin")
    hasher = xxhash.xxh3_128()
    assert storage.write_parts(fs, path, parts, hasher=hasher) == len(want)
    assert storage.read_bytes(fs, path) == want
    assert hasher.hexdigest() == xxhash.xxh3_128(want).hexdigest()


def test_parts_reader_reads_seeks_and_slices_without_copying():
    blob = bytes(range(256)) * 50
    parts = [memoryview(blob)[:1000], memoryview(blob)[1000:1001], memoryview(b""), memoryview(blob)[1001:]]
    reader = storage.PartsReader(parts)
    assert len(reader) == len(blob) and reader.read() == blob and reader.read() == b""
    reader.seek(995)
    assert reader.read(10) == blob[995:1005] and reader.tell() == 1005
    reader.seek(-3, 2)
    assert reader.read() == blob[-3:]
    for lo, hi in [(0, 1000), (999, 1002), (1001, len(blob)), (5000, 9000), (7, 7)]:
        part = reader[lo:hi]
        assert len(part) == hi - lo and part.read() == blob[lo:hi]
    assert all(v.obj is blob for v in reader[500:5000].parts)  # views of the caller's buffers
    reader.seek(100)
    chunk = reader.read(800)  # inside one part: a view of it, no copy
    assert isinstance(chunk, memoryview) and chunk.obj is blob and chunk == blob[100:900]
    reader.seek(990)
    across = reader.read(20)  # across parts: joined
    assert isinstance(across, bytes) and across == blob[990:1010] and reader.tell() == 1010
    reader.seek(len(blob) - 5)
    assert reader.read(100) == blob[-5:] and reader.read(100) == b"" and reader.read(0) == b""


def test_write_parts_multipart_upload_reads_each_part_from_the_buffers(s3_url):
    """Above s3fs's single-PUT size the body is cut into multipart parts: with a 5 MiB chunk (the
    S3 minimum), 12 MB become 3 parts, sent concurrently, each read from the same buffers."""
    import random

    rnd = random.Random(7)
    a, b = rnd.randbytes(7_000_000), rnd.randbytes(5_000_000)
    fs, root = storage.get_fs(s3_url)
    path = storage.join(root, "multipart.bin")
    fs.pipe_file(path, storage.PartsReader([memoryview(a), memoryview(b)]), chunksize=5 << 20)
    assert storage.read_bytes(fs, path) == a + b
    assert "-3" in fs.info(path)["ETag"]  # a multipart ETag: <md5 of the part md5s>-<parts>


def test_write_streamed_hashes_and_writes_one_large_write_in_pieces(any_url, monkeypatch):
    """A format-3 save hands over its whole arena in one write: it still goes out (and, on a
    local disk, starts its writeback) piece by piece, every byte hashed in order."""
    import xxhash

    monkeypatch.setattr(storage, "WRITE_PIECE", 1000)
    monkeypatch.setattr(storage, "WRITEBACK_CHUNK", 4096)
    hints, updates = _record_writeback_hints(monkeypatch), []

    class Recorder:
        def __init__(self):
            self.h = xxhash.xxh3_128()

        def update(self, data):
            updates.append(memoryview(data).nbytes)
            self.h.update(data)

    blob = bytes(range(256)) * 100  # 25,600 bytes in one write
    fs, root = storage.get_fs(any_url)
    storage.makedirs(fs, root)
    path = storage.join(root, "big.bin")
    hasher = Recorder()
    assert storage.write_streamed(fs, path, lambda out: out.write(blob), hasher=hasher) == len(blob)
    assert storage.read_bytes(fs, path) == blob
    assert hasher.h.hexdigest() == xxhash.xxh3_128(blob).hexdigest()
    assert updates == [1000] * 25 + [600]
    if storage.is_local(fs) and storage.SYNC_FILE_RANGE is not None:
        assert len(hints) >= 5 and hints[0][0] == 0  # writeback started while the write went on
        assert all(a[0] + a[1] == b[0] for a, b in zip(hints, hints[1:]))
