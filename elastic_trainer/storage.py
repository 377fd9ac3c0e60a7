"""Storage through fsspec: one URL names where checkpoints live, on any filesystem.

``memory://``, local or NFS paths, ``s3://bucket/prefix`` (s3fs) and every other protocol
fsspec knows work the same way. Storage options come from the environment (for S3:
``AWS_*`` credentials, ``ELASTIC_TRAINER_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL`` for a
non-AWS endpoint) and are never logged. Only an S3 URL may carry keys (``s3://KEY:SECRET@bucket``,
taken out by ``split_credentials``); a URL on any other protocol with ``user:password@`` in it is
refused (``check_credentials``), and what is stored, logged or shown is ``without_userinfo`` or
``redact``-ed.

Besides opening a filesystem this module offers the few operations a checkpoint needs:
``write_bytes``, ``write_streamed`` and ``write_parts`` (durable on local disks), ``create_exclusive`` (atomic
create-if-absent, the commit primitive), ``read_bytes``, ``list_dir``, ``exists``, ``remove``
and ``redact``.

``write_streamed`` takes a producer that writes into a stream. On a local disk the bytes go
straight into the destination file (no copy in memory) and the kernel is asked to start
writing them back every ``WRITEBACK_CHUNK`` bytes (``sync_file_range``), so the final
``fsync`` waits only for the tail; elsewhere they are collected in memory (``io.BytesIO``, whose
``getvalue()`` hands over its ``bytes`` without a copy) and uploaded in one call (s3fs turns a
large one into a concurrent multipart upload). ``write_parts`` takes buffers that are already
complete (a checkpoint's header and its arena): on S3 the request body is read from them directly,
so nothing is copied in memory at all.

How ``create_exclusive`` is atomic on each store:

- local and NFS paths: the bytes go to a temporary file which is then ``os.link``-ed to the
  final name; ``link`` fails with ``EEXIST`` when the name exists, atomically, also on NFS
  (the classic NFS lock-file idiom), and readers never see a partial file.
- ``s3://``: a conditional PUT (``If-None-Match: *``, s3fs ``mode="create"``); AWS S3 and
  moto answer 412 when the key exists, which s3fs raises as ``FileExistsError``.
- ``memory://``: check and write under one process-wide lock (the store is per-process).
- anything else (``gs://``, Azure's ``az://``/``abfs://``, ...): refused, by ``check_writable``
  at launch and by ``create_exclusive``, with one sentence naming the protocol. fsspec's generic
  ``pipe_file(mode="create")`` checks and then writes there, so two writers could both commit; GCS
  (``ifGenerationMatch=0``) and Azure (``If-None-Match: *``) have real conditional creates, but
  none is wired up and tested here against a real endpoint, and a silent non-atomic commit is
  worse than a clear refusal. Checkpoints on those stores can still be read (``export``).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import io
import os
import re
import threading
import uuid
from typing import Callable, Protocol, Sequence

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from elastic_trainer.env import ENV_AWS_ENDPOINT_URL, ENV_S3_ENDPOINT_URL


class StorageError(RuntimeError):
    """Storage cannot be used: unreachable, unwritable, or a write failed."""


_MEMORY_LOCK = threading.Lock()

WRITEBACK_CHUNK = 2 << 20
"""``write_streamed`` on a local disk starts the writeback of every this many bytes. Measured on
this VM's disk, alternating (docs/checkpoints.md): an 11 MB save's fsync waited 5.2 ms with 2 MiB
against 8.4 ms with 8 MiB; a 177 MB save was no slower (4 and 1 MiB were no better)."""

WRITE_PIECE = 1 << 20
"""``write_streamed``'s sinks hash and write a large write in pieces of this many bytes, so that
the hash reads each piece from memory and the write finds it still in the CPU cache, and so that
the writeback of a large write starts while it is still being written."""


CREDENTIAL_PROTOCOLS = ("s3", "s3a")
"""Protocols whose keys a URL may carry as ``KEY:SECRET@`` userinfo: the launcher takes them out of
the URL into a 0600 credentials file for its workers (``cli.secrets``), and only the URL without
them is stored, logged, shown or handed on. Userinfo in any other URL is refused
(:func:`check_credentials`): nothing would route those keys, and the URL would carry them
into etcd's commit records and the workers' environment."""

# RFC 3986: userinfo is what the authority (up to the first "/", "?" or "#") holds before its last "@".
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/?#\s]*)@")
# S3 keys: an access key id (never "/" or ":") and a secret, which may hold "/" (AWS's often do):
# a bucket name never holds ":", so ``s3://KEY:SE/CRET@bucket`` is keys, not a bucket "KEY:SE".
_S3_KEYS = re.compile(r"(s3a?://)([^/@\s:]+):([^@\s]+)@", re.IGNORECASE)
_CONTAINER_AT = {"abfs", "abfss", "az", "adl", "wasb", "wasbs"}
"""Azure's URLs name ``container@account``: an "@" there without a ":" is no credential."""


def _is_credential(match: re.Match) -> bool:
    return ":" in match.group(2) or match.group(1)[:-3].lower() not in _CONTAINER_AT


def _userinfo(url: str) -> re.Match | None:
    """The first credential in ``url``: S3 keys, or any other userinfo (Azure's container aside)."""
    return _S3_KEYS.search(url) or next((m for m in _USERINFO.finditer(url) if _is_credential(m)), None)


def without_userinfo(url: str) -> str:
    """``url`` without any ``user:password@`` (any protocol): what may be stored, logged or shown."""
    while (match := _userinfo(url)) is not None:
        url = url[:match.start()] + match.group(1) + url[match.end():]
    return url


def check_credentials(url: str) -> None:
    """``StorageError`` (one sentence, no secret in it) when ``url`` carries userinfo that this
    version does not route: anything but ``s3://KEY:SECRET@bucket/...`` (:data:`CREDENTIAL_PROTOCOLS`)."""
    match = _userinfo(url)
    if match is None:
        return
    s3 = _S3_KEYS.match(url)
    if s3 is not None and without_userinfo(url[s3.end():]) == url[s3.end():]:
        return
    protocol = match.group(1)[:-3].lower()
    if protocol in CREDENTIAL_PROTOCOLS:
        raise StorageError(f"{redact(url)!r}: keys in an S3 URL go right after s3:// as KEY:SECRET@ (access key id "
                           f"and secret key); or give them in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    raise StorageError(f"{redact(url)!r}: credentials in the URL are refused on {protocol}:// (they would be stored in "
                       f"etcd's commit records and handed to every worker); only s3:// URLs take KEY:SECRET@, "
                       f"other stores take their keys from their own environment or credentials files")


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``s3://KEY:SECRET@bucket/prefix`` -> (``s3://bucket/prefix``, (KEY, SECRET)); a URL without
    userinfo as it is. ``StorageError`` for userinfo anywhere else (:func:`check_credentials`).

    Only S3 URLs: fsspec would otherwise take ``KEY:SECRET@bucket`` for the bucket's name."""
    check_credentials(url)
    match = _S3_KEYS.match(url)
    if not match:
        return url, None
    scheme, key, secret = match.groups()
    return scheme + url[match.end():], (key, secret)


def storage_options(url: str) -> dict:
    """Options for ``url``'s filesystem, from the environment (secrets stay out of logs), and the
    key and secret of an ``s3://KEY:SECRET@bucket`` URL."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    options: dict = {}
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get(ENV_S3_ENDPOINT_URL) or os.environ.get(ENV_AWS_ENDPOINT_URL)
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        credentials = split_credentials(url)[1]
        if credentials is not None:
            options["key"], options["secret"] = credentials
    return options


def get_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for ``url``; ``StorageError`` for an unknown protocol."""
    try:
        return url_to_fs(split_credentials(url)[0], **storage_options(url))
    except (ValueError, ImportError) as exc:
        raise StorageError(f"cannot open {redact(url)!r}: {exc}") from exc


def has_credentials(text: str) -> bool:
    """Whether ``text`` holds a URL with ``user:secret@`` in it."""
    text = str(text)
    return _S3_KEYS.search(text) is not None or any(":" in m.group(2) for m in _USERINFO.finditer(text))


def redact(text: str) -> str:
    """``text`` with any ``user:password@`` inside URLs replaced by ``***@`` (safe to log)."""
    text = _S3_KEYS.sub(r"\1***@", str(text))
    return _USERINFO.sub(lambda m: m.group(1) + "***@" if _is_credential(m) else m.group(0), text)


ATOMIC_CREATE_PROTOCOLS = ("file", "local", "memory", "s3", "s3a")
"""URL protocols whose atomic create-if-absent ``create_exclusive`` implements (and tests test)."""


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].split("::")[-1].lower() if "://" in url else "file"


def check_atomic_create(url: str) -> None:
    """``StorageError`` (one sentence) unless checkpoints can be committed atomically under ``url``."""
    protocol = _protocol(url)
    if protocol not in ATOMIC_CREATE_PROTOCOLS:
        raise StorageError(
            f"{redact(url)!r}: checkpoints cannot be committed atomically on {protocol}:// (this version has a "
            f"tested create-if-absent only for local/NFS paths, memory:// and s3://); use a mounted path (e.g. "
            f"gcsfuse, blobfuse2) or an S3-compatible endpoint (ELASTIC_TRAINER_S3_ENDPOINT_URL)")


def check_writable(url: str) -> None:
    """Create ``url`` if needed and write, read back and delete a probe file in it.

    Raises ``StorageError`` with one sentence when the URL carries credentials this version does
    not route (``check_credentials``), when the location cannot be written, or when a checkpoint
    could not be committed there atomically (``check_atomic_create``).
    """
    check_credentials(url)
    check_atomic_create(url)
    fs, root = get_fs(url)
    probe = join(root, f".write-probe-{uuid.uuid4().hex}")
    try:
        makedirs(fs, root)
        with fs.open(probe, "wb") as f:
            f.write(b"ok")
        with fs.open(probe, "rb") as f:
            if f.read() != b"ok":
                raise StorageError(f"{redact(url)!r} did not read back what was written")
        fs.rm(probe)
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means "not writable"; say which
        raise StorageError(f"{redact(url)!r} is not writable ({type(exc).__name__}: {redact(exc)})") from exc


def join(root: str, *parts: str) -> str:
    """``root/part/...`` with exactly one ``/`` between the pieces."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local (or NFS-mounted) filesystem, where ``os`` calls apply."""
    return isinstance(fs, LocalFileSystem)


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss"}


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    """True for bucket stores (S3, GCS, Azure, ...), which have no real directories."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _OBJECT_STORES for p in protocols)


def makedirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Create ``path``; a no-op on object stores (where it would create a missing bucket)."""
    if not is_object_store(fs):
        fs.makedirs(path, exist_ok=True)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` (overwriting); on local disks also fsync the file."""
    fs.pipe_file(path, data)
    if is_local(fs):
        _fsync_path(path)


class Hasher(Protocol):
    """What ``write_streamed`` feeds: ``hashlib`` and ``xxhash`` objects qualify."""

    def update(self, data: memoryview, /) -> None: ...


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    name = ctypes.util.find_library("c")
    func = getattr(ctypes.CDLL(name, use_errno=True), "sync_file_range", None) if name else None
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        func.restype = ctypes.c_int
    return func


SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait


def as_bytes_view(data) -> memoryview:
    """``data`` as a flat view of bytes (a tensor's or an array's memory, without a copy)."""
    view = memoryview(data)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class _FileSink:
    """A write-only stream into an open local file that hashes what it writes and asks the
    kernel to start writing back every ``WRITEBACK_CHUNK`` bytes (a hint: ``fsync`` at the end
    is what makes the file durable; the hint only means less is left to wait for then)."""

    def __init__(self, f, hasher: Hasher | None) -> None:
        self.f = f
        self.hasher = hasher
        self.size = 0
        self.started = 0  # bytes whose writeback was started
        self.error: OSError | None = None
        try:
            self.fd: int | None = f.fileno() if SYNC_FILE_RANGE is not None else None
        except (AttributeError, OSError, ValueError):  # a wrapper without a real descriptor
            self.fd = None

    def write(self, data) -> int:
        view = as_bytes_view(data)
        for start in range(0, view.nbytes, WRITE_PIECE):
            piece = view[start:start + WRITE_PIECE] if view.nbytes > WRITE_PIECE else view
            if self.hasher is not None:
                self.hasher.update(piece)
            try:
                self.f.write(piece)
                self.size += piece.nbytes
                if self.fd is not None and self.size - self.started >= WRITEBACK_CHUNK:
                    self.f.flush()
                    self._start_writeback()
            except OSError as exc:
                self.error = exc  # the producer (torch.save) may turn it into its own RuntimeError
                raise
        return view.nbytes

    def _start_writeback(self) -> None:
        if SYNC_FILE_RANGE(self.fd, self.started, self.size - self.started, SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(err, f"sync_file_range: {os.strerror(err)}")
            self.fd = None  # this filesystem has no such hint; the fsync at the end still applies
        self.started = self.size

    def flush(self) -> None:
        self.f.flush()


class _BufferSink:
    """A write-only stream into memory that hashes what it writes; ``getvalue()`` gives ``bytes``.

    ``io.BytesIO`` grows by ``realloc`` (``mremap`` for large blocks on Linux: no copying) and
    its ``getvalue()`` hands over its own ``bytes`` without a copy when no view of it is held, so
    every byte is written once. (A preallocated ``bytearray`` is slower here: it is zero-filled
    first, and botocore sends a ``bytearray`` body ~25% slower than ``bytes``.)
    """

    def __init__(self, hasher: Hasher | None) -> None:
        self.buf = io.BytesIO()
        self.hasher = hasher
        self.size = 0

    def write(self, data) -> int:
        view = as_bytes_view(data)
        for start in range(0, view.nbytes, WRITE_PIECE):
            piece = view[start:start + WRITE_PIECE] if view.nbytes > WRITE_PIECE else view
            if self.hasher is not None:
                self.hasher.update(piece)
            self.buf.write(piece)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass

    def getvalue(self) -> bytes:
        return self.buf.getvalue()


def write_streamed(fs: fsspec.AbstractFileSystem, path: str, produce: Callable[[object], None], *,
                   hasher: Hasher | None = None) -> int:
    """Write to ``path`` (overwriting) whatever ``produce(stream)`` writes into ``stream``.

    Returns the number of bytes written; ``hasher`` (if given) is updated with every one of them,
    in order. Local disks: streamed straight into the file, writeback started every
    ``WRITEBACK_CHUNK`` bytes, fsynced before returning. Other stores: collected in memory, then
    written in one call.
    """
    if not is_local(fs):
        out = _BufferSink(hasher)
        produce(out)
        write_bytes(fs, path, out.getvalue())
        return out.size
    with fs.open(path, "wb") as f:
        sink = _FileSink(f, hasher)
        try:
            produce(sink)
        except Exception:
            if sink.error is not None:  # torch.save reports a failed write as "unexpected pos ..."
                raise sink.error from None
            raise
        f.flush()
        if sink.fd is not None:
            os.fsync(sink.fd)
    if sink.fd is None:
        _fsync_path(path)
    return sink.size


class PartsReader(io.RawIOBase):
    """A read-only, seekable file over a sequence of buffers, which it never copies: the body of
    one S3 request sent straight from the buffers (botocore takes any seekable file as a body,
    reads it for its checksum, for the SigV4 payload hash over plain http, and once more to send
    it, and seeks back to retry). Slicing gives a reader over that byte range, which is how s3fs
    cuts a large body into multipart parts.

    ``read(n)`` returns a ``memoryview`` of the buffer when the range lies in one part (a copy,
    as ``bytes``, only across a boundary or at the end): every reader of an upload body here
    only hashes or sends the chunks, and copying each into a fresh ``bytes`` cost 3.6 ms of an
    11 MB PUT (56 ms) on the local S3 endpoint. Chunks stay valid while the buffers do: the
    caller keeps them unchanged until the upload returns."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        super().__init__()
        self.parts = [p for p in parts if p.nbytes]
        self.starts = []
        offset = 0
        for p in self.parts:
            self.starts.append(offset)
            offset += p.nbytes
        self.size = offset
        self.pos = 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> "PartsReader":
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("only contiguous slices")
        out = []
        for p, base in zip(self.parts, self.starts):
            lo, hi = max(start - base, 0), min(stop - base, p.nbytes)
            if lo < hi:
                out.append(p[lo:hi])
        return PartsReader(out)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self.pos = base + offset
        return self.pos

    def read(self, size: int | None = -1) -> bytes | memoryview:
        if size is None or size < 0:
            size = self.size - self.pos
        if size == 0 or self.pos >= self.size:
            return b""
        i = bisect.bisect_right(self.starts, self.pos) - 1
        lo = self.pos - self.starts[i]
        part = self.parts[i]
        if lo + size <= part.nbytes:
            self.pos += size
            return part[lo:lo + size]
        return super().read(size)

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        n = 0
        for p, base in zip(self.parts, self.starts):
            if n == out.nbytes:
                break
            if self.pos < base + p.nbytes:
                lo = max(self.pos - base, 0)
                take = min(p.nbytes - lo, out.nbytes - n)
                out[n:n + take] = p[lo:lo + take]
                n += take
                self.pos = base + lo + take
        return n


def write_parts(fs: fsspec.AbstractFileSystem, path: str, parts: Sequence, *,
                hasher: Hasher | None = None) -> int:
    """Write the concatenation of ``parts`` (bytes-like) to ``path`` (overwriting); returns the
    number of bytes. ``hasher`` (if given) sees every byte, in order.

    Local disks: as ``write_streamed`` (straight into the file, early writeback, fsync). S3: one
    upload whose body is read from the parts themselves, with no copy of them in memory (a large
    one becomes s3fs's multipart upload, each part read from the same buffers). Other stores: the
    parts joined into one ``bytes``, then one call.
    """
    views = [as_bytes_view(p) for p in parts]
    if is_local(fs):
        def produce(out) -> None:
            for v in views:
                out.write(v)
        return write_streamed(fs, path, produce, hasher=hasher)
    if hasher is not None:
        for v in views:
            for start in range(0, v.nbytes, WRITE_PIECE):
                hasher.update(v[start:start + WRITE_PIECE])
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    body = PartsReader(views) if any(p in ("s3", "s3a") for p in protocols) else b"".join(views)
    fs.pipe_file(path, body)
    return sum(v.nbytes for v in views)


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Atomically create ``path`` holding ``data`` unless it exists; False when it already did.

    Readers never see a partially written file (see the module docstring for each store).
    """
    if is_local(fs):
        parent = os.path.dirname(path)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            dfd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            return True
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    if isinstance(fs, MemoryFileSystem):
        with _MEMORY_LOCK:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data)
            return True
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if not any(p in ATOMIC_CREATE_PROTOCOLS for p in protocols):
        check_atomic_create(f"{protocols[0]}://{path}")  # raises: never a silent check-then-write commit
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    fs.invalidate_cache(path)
    return True


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """The whole content of ``path`` (never from a stale listing cache)."""
    fs.invalidate_cache(path)
    return fs.cat_file(path)


def exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether ``path`` exists now (listing caches invalidated first)."""
    fs.invalidate_cache(path)
    return fs.exists(path)


def size(fs: fsspec.AbstractFileSystem, path: str) -> int | None:
    """Size of ``path`` in bytes, or None when it does not exist."""
    fs.invalidate_cache(path)
    try:
        return int(fs.info(path)["size"])
    except FileNotFoundError:
        return None


def sizes(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, int]:
    """Base name -> size of the files directly in ``path``, in one listing ({} when it does not exist)."""
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries if e.get("type") == "file"}


def list_dir(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Base names of the entries directly in ``path`` ([] when it does not exist)."""
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})


def remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete ``path`` (file or whole folder); missing is fine."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
    fs.invalidate_cache(path)
