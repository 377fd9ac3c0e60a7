"""Sharded checkpoints of FSDP models through ``torch.distributed.checkpoint`` (DCP), saved asynchronously.

A full-state save gathers every parameter and optimizer state on rank 0, so a model whose state
does not fit in one host's memory cannot be checkpointed that way. Here every rank writes its own
shards (DCP, one file per rank, plus DCP's ``.metadata`` from its coordinator) into
``<url>/step-N/dcp-<writer>/``; rank 0 then writes the small rest of the state (RNG, sampler,
scheduler, meta) as its usual format-3 file and commits the manifest last, listing every shard
file with its size and xxh3_128, fenced like any commit (``CheckpointManager``, ``record.py``).
A reader verifies every file before anything is loaded. Loading reshards: DCP's ``load`` fills
the sharded state dicts of the *current* model and optimizer, whatever world size wrote them.

A save (``ShardedSaver.save``) blocks training only while this rank's shards are copied into CPU
memory (``Staging``: one ``foreach_copy`` into buffers kept for the next save, so a rank
holds one extra copy of its own shards, never of the model); the rest, DCP's ``save`` of those
buffers, runs on a background thread that the ``CheckpointManager`` owns as its in-flight save,
so ``ckpt.wait()``, ``ckpt.close()`` and the next save wait for it:

1. DCP writes every rank's shards and, on rank 0, ``.metadata`` (its collectives run on a gloo
   group of their own, made once, so they never interleave with training's collectives);
2. every rank hashed the files it wrote while writing them (``HashingFiles``; a file written
   with a seek, or a DCP without the file system this wraps, is read back instead) and the entries
   are gathered on rank 0, which checks that every file DCP's metadata names is listed;
3. rank 0 commits: the rest of the state, then the manifest, fenced.

So a commit needs every rank's finished write: a rank that exits, is killed or fails during a
save makes the others' collectives fail (or time out, after ``timeout``), nothing is committed,
and the newest checkpoint stays the one before; the leftovers of the uncommitted step are removed
by a later retention. A process that ends normally waits for the save (``Trainer._finish``: wait,
then its last save blocking).

    saver = ShardedSaver(ckpt)                                  # every rank
    saver.save(step, module, optimizer, rest=...)               # collectively; rest on rank 0 only
    ckpt.wait()                                                 # the save done (rank 0: committed or not)
    found = ckpt.load()                                         # rank 0, then broadcast the step; rest
    load_sharded(ckpt, step, found[1], module, optimizer)       # every rank, collectively

Stores: local and NFS paths through DCP's ``FileSystemWriter``/``FileSystemReader`` (files
fsynced), every other fsspec store (``s3://``) through DCP's ``FsspecWriter``/``FsspecReader``
(imported where torch's private modules are, ``torch_private.py``) with the storage
options of ``storage.storage_options``; an object store's files are not fsynced (closed is
uploaded).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from elastic_trainer import storage
from elastic_trainer.checkpoint.host_memory import HostBuffer, cuda_devices
from elastic_trainer.torch_private import dtensor_like, foreach_copy

log = logging.getLogger(__name__)

SHARDS = "dcp"
"""The prefix of the DCP folder inside a step folder (``dcp-<writer id>``)."""
HASH = "xxh3_128"
_READ = 4 << 20
_ALIGN = 64  # bytes: each staged tensor starts on a multiple (as in a format-3 arena)


def _url(ckpt, path: str) -> str:
    """``path`` (inside ``ckpt``'s filesystem) as DCP's writers and readers take it."""
    return path if storage.is_local(ckpt.fs) else ckpt.fs.unstrip_protocol(path)


def _writer(ckpt, path: str):
    import torch.distributed.checkpoint as dcp

    if storage.is_local(ckpt.fs):
        return dcp.FileSystemWriter(path)
    from elastic_trainer.torch_private import dcp_fsspec_storage

    FsspecWriter = dcp_fsspec_storage()[0]
    # an object store's file is durable once closed; DCP's fsync fallback would sync the machine
    return FsspecWriter(_url(ckpt, path), sync_files=False, **storage.storage_options(ckpt.url))


def _reader(ckpt, path: str):
    import torch.distributed.checkpoint as dcp

    if storage.is_local(ckpt.fs):
        return dcp.FileSystemReader(path)
    from elastic_trainer.torch_private import dcp_fsspec_storage

    return dcp_fsspec_storage()[1](_url(ckpt, path), **storage.storage_options(ckpt.url))


def _sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}


def _dcp_files(metadata: Any) -> list[str]:
    """Every file a DCP save wrote, from the ``Metadata`` it returned: the data files its storage
    entries name, and ``.metadata``."""
    names = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    names.discard(None)
    return sorted(names | {".metadata"})


def _hash_files(fs, base: str, folder: str, names: list[str]) -> dict:
    """Manifest entries (``<folder>/<name>``: size, xxh3_128) of ``names`` in ``base``, read back from storage."""
    out = {}
    for name in names:
        hasher, size = xxhash.xxh3_128(), 0
        with fs.open(storage.join(base, name), "rb") as f:
            while chunk := f.read(_READ):
                hasher.update(chunk)
                size += len(chunk)
        out[f"{folder}/{name}"] = {"size": size, "hash": HASH, "digest": hasher.hexdigest()}
    return out


class HashingStream:
    """A stream DCP writes a file through: every byte also goes into an xxh3_128 as it is written.
    A seek makes it give up (what was hashed may then not be the file): ``sequential`` False."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.hasher = xxhash.xxh3_128()
        self.size = 0
        self.sequential = True

    def write(self, data) -> int:
        n = self._raw.write(data)
        view = storage.as_bytes_view(data)
        n = len(view) if n is None else n
        self.hasher.update(view[:n])
        self.size += n
        return n

    def seek(self, *args):
        self.sequential = False
        return self._raw.seek(*args)

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


class HashingFiles:
    """Wraps a DCP storage writer's file system (its ``fs``: ``create_stream`` and ``rename``) so
    that every file it writes is hashed while it is written: ``files`` maps each file's name to its
    ``(size, xxh3_128)``, known when the file is closed (on an object store: uploaded), and follows
    a rename (DCP writes ``.metadata`` under a temporary name). Spares reading every file back to
    hash it, which on an object store is a second download of the checkpoint."""

    def __init__(self, fs) -> None:
        self._fs = fs
        self._lock = threading.Lock()
        self.files: dict[str, tuple[int, str]] = {}

    @staticmethod
    def wraps(writer) -> "HashingFiles | None":
        """Put a ``HashingFiles`` around ``writer.fs``; None (the files are then hashed by reading
        them back) where the writer has no such file system (another torch's DCP)."""
        fs = getattr(writer, "fs", None)
        if not (callable(getattr(fs, "create_stream", None)) and callable(getattr(fs, "rename", None))):
            return None
        writer.fs = HashingFiles(fs)
        return writer.fs

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        with self._fs.create_stream(path, mode) as stream:
            tee = HashingStream(stream)
            yield tee
        if tee.sequential:
            with self._lock:
                self.files[os.path.basename(os.fspath(path))] = (tee.size, tee.hasher.hexdigest())

    def rename(self, path, new_path) -> None:
        self._fs.rename(path, new_path)
        with self._lock:
            moved = self.files.pop(os.path.basename(os.fspath(path)), None)
            if moved is not None:
                self.files[os.path.basename(os.fspath(new_path))] = moved

    def __getattr__(self, name: str):
        return getattr(self._fs, name)


def _leaves(tree: Any, path: tuple = ()):
    """(path, value) of every leaf: dict values, list and tuple items."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


class Staging:
    """This rank's shards of a state dict copied into one CPU buffer that is kept between saves.

    The staged copy has the state's structure; each of its tensors is a view of one
    ``host_memory.HostBuffer`` (page-locked when the shards are on a GPU, so the copy runs at the
    bus's speed), wrapped in a DTensor with the source's mesh and placements where the source is
    one (``torch_private.dtensor_like``: what DCP's own ``DefaultStager`` makes, without an
    allocation or a dispatch per tensor). The
    first ``stage`` (and any after the state's layout changed: other keys, shapes, dtypes or
    shardings) lays the views out; every ``stage`` copies the live tensors into them with one
    ``foreach_copy`` (then one synchronize per GPU) and rebuilds only the containers,
    with fresh copies of the non-tensor values (learning rates, step counters kept as numbers).
    ``prepare(state)`` makes the buffer on a background thread before the first save, which then
    copies and does not allocate.
    """

    def __init__(self) -> None:
        self.host = HostBuffer()
        self._staged: dict[tuple, torch.Tensor] = {}  # path -> staged tensor (a DTensor or a tensor)
        self._buffers: list[torch.Tensor] = []  # their local tensors, in the order of the layout
        self._layout: list[tuple[tuple, tuple]] | None = None

    @staticmethod
    def _local(tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    @staticmethod
    def _signature(tensor: torch.Tensor, local: torch.Tensor) -> tuple:
        from torch.distributed.tensor import DTensor

        spec = (tensor.device_mesh, tuple(tensor.placements)) if isinstance(tensor, DTensor) else None
        return type(tensor), tensor.dtype, tuple(tensor.shape), tuple(local.shape), local.device.type, spec

    def _tensors(self, state: dict) -> list[tuple[tuple, torch.Tensor, torch.Tensor]]:
        return [(path, v, self._local(v)) for path, v in _leaves(state) if isinstance(v, torch.Tensor)]

    def prepare(self, state: dict) -> bool:
        """Start making the buffer for ``state``'s shards on a background thread (nothing is
        copied); returns whether one was started (not when the current buffer serves it)."""
        with torch.no_grad():
            locals_ = [local for _, _, local in self._tensors(state)]
        nbytes = sum(t.numel() * t.element_size() + _ALIGN for t in locals_)
        return self.host.prepare(nbytes, pinned=any(t.is_cuda for t in locals_))

    def stage(self, state: dict) -> dict:
        """A copy of ``state`` whose tensors are this object's CPU buffers, filled now."""
        with torch.no_grad():
            tensors = self._tensors(state)
            layout = [(path, self._signature(v, local)) for path, v, local in tensors]  # in order: the buffers' order
            self.host.waited_s = 0.0
            if layout != self._layout:
                self._lay_out(tensors)
                self._layout = layout
            sources = [local for _, _, local in tensors]
            foreach_copy(self._buffers, sources, non_blocking=self.host.pinned)
            for device in cuda_devices(sources):  # the copies' own GPUs, not the current one
                torch.cuda.synchronize(device)
        return self._rebuild(state, ())

    def _lay_out(self, tensors: list[tuple[tuple, torch.Tensor, torch.Tensor]]) -> None:
        """Views of the host buffer for every tensor, aligned, wrapped like their sources."""
        from torch.distributed.tensor import DTensor

        self._staged, self._buffers, self._layout = {}, [], None  # no view of the old buffer stays here
        offsets, size = [], 0
        for _, _, local in tensors:
            offsets.append(size)
            size += -(-local.numel() * local.element_size() // _ALIGN) * _ALIGN
        buffer = self.host.get(size, pinned=any(local.is_cuda for _, _, local in tensors))
        raw = buffer.numpy()
        for (path, v, local), offset in zip(tensors, offsets):
            view = _exact_view(raw, offset, local)
            # a DTensor source: its mesh and placements around the view (what DCP's stager makes)
            self._staged[path] = dtensor_like(v, view) if isinstance(v, DTensor) else view
            self._buffers.append(view)

    def _rebuild(self, tree: Any, path: tuple) -> Any:
        if isinstance(tree, dict):
            return {k: self._rebuild(v, (*path, k)) for k, v in tree.items()}
        if isinstance(tree, list):
            return [self._rebuild(v, (*path, i)) for i, v in enumerate(tree)]
        if isinstance(tree, tuple):
            items = [self._rebuild(v, (*path, i)) for i, v in enumerate(tree)]
            return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)  # a namedtuple, or not
        if isinstance(tree, torch.Tensor):
            return self._staged[path]
        return copy.deepcopy(tree)

    def close(self) -> None:
        """Free the buffer."""
        self._staged, self._buffers, self._layout = {}, [], None
        self.host.free()


def _exact_view(raw, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed as ``like`` over ``raw[offset:]`` (the host buffer as a numpy
    array) whose storage is exactly its own bytes: DCP's writer clones a tensor whose storage is
    larger than the tensor (and ``torch.save`` would write all of it), which a plain view of the
    buffer is."""
    nbytes = like.numel() * like.element_size()
    if nbytes == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    exact = torch.frombuffer(memoryview(raw[offset:offset + nbytes]), dtype=torch.uint8)
    return exact.view(like.dtype).view(like.shape)


class ShardedSaver:
    """Every rank's sharded saves into ``ckpt`` (a ``CheckpointManager`` on every rank), one in
    flight at a time, asynchronous; see the module docstring.

    Args:
        ckpt: this rank's manager; its in-flight save is the sharded save's background work.
        timeout: of the checkpoint's own gloo group (DCP's collectives, the gathering of hashes):
            how long a save waits for a rank that stopped answering before it fails.
        group: gives that group, made elsewhere (the training Manager's, made with the default
            group: ``Manager.group``); by default it is made here on first use (``dist.new_group``).
    """

    def __init__(self, ckpt, timeout: datetime.timedelta | float | None = None,
                 group: Callable[[], Any] | None = None) -> None:
        self.ckpt = ckpt
        self.timeout = datetime.timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._given = group
        self._group = None
        self._folder: str | None = None
        self._staging = Staging()
        self.last_stats: dict = {}

    def group(self):
        """The gloo group of checkpoint collectives (made on first use: collective)."""
        if self._group is None and self._given is not None:
            self._group = self._given()
        if self._group is None:
            kwargs = {"timeout": self.timeout} if self.timeout is not None else {}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group

    def folder(self) -> str:
        """The shards' folder in every step, named by rank 0's writer id (made on first use: collective)."""
        if self._folder is None:
            box = [f"{SHARDS}-{self.ckpt.writer_id}" if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.group())
            self._folder = box[0]
        return self._folder

    def prepare(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, staging: bool = True) -> bool:
        """Every rank, collectively, once the optimizer has its state (after the first step): make
        the checkpoint group and the folder's name now, and (``staging``) this rank's staging buffer
        on a background thread (``Staging.prepare``), so that the first save only copies; returns
        whether a buffer is being made."""
        self.folder()
        return self._staging.prepare(_sharded_state(module, optimizer)) if staging else False

    def regroup(self) -> None:
        """A new world whose shards this rank holds as before (a live join): the next collective
        takes the new world's group (``group``) and asks for the folder's name again (``folder``:
        every rank, also the newcomers); the staging buffer serves on. Not while a save is in
        flight (a live re-form settles it first, or the save failed with the old group)."""
        self._group = None
        self._folder = None

    def save(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
             rest: dict | None, *, blocking: bool = False) -> float:
        """Every rank, collectively: stage this rank's shards of ``step`` and write them in the
        background; rank 0 (``rest`` given there: RNG, sampler, meta, ...) then commits. Waits
        for the previous save first. Returns the seconds training was blocked here (with
        ``blocking``, until the save is done; rank 0's result is in ``ckpt.last_save_stats``)."""
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        self.ckpt.wait()
        waited = time.perf_counter() - start
        group = self.group()
        folder = self.folder()
        path = storage.join(self.ckpt.root, f"step-{step}", folder)
        storage.makedirs(self.ckpt.fs, path)
        rest = copy.deepcopy(rest) if rest is not None else None  # the scheduler's lists may change meanwhile
        staged = time.perf_counter()
        # this rank's shards copied into the staging buffers now; DCP writes those in the
        # background (its collectives on our group)
        state = self._staging.stage(_sharded_state(module, optimizer))
        writer = _writer(self.ckpt, path)
        hashing = HashingFiles.wraps(writer)
        stats = {"step": int(step), "wait_s": waited, "stage_s": time.perf_counter() - staged, "folder": folder,
                 "host_buffer_wait_s": self._staging.host.waited_s, "host_buffer_bytes": self._staging.host.capacity}
        self.last_stats = stats

        def write():
            return dcp.save(state, storage_writer=writer, process_group=group)
        self.ckpt.run_in_background(step, lambda: self._finish(step, folder, path, write, hashing, rest, stats, group))
        stats["blocked_s"] = time.perf_counter() - start
        if blocking:
            self.ckpt.wait()
        return time.perf_counter() - start

    def close(self) -> None:
        """Wait for the save in flight, then free the staging buffers."""
        self.ckpt.wait()
        self._staging.close()

    def _finish(self, step: int, folder: str, path: str, write: Callable[[], Any], hashing: "HashingFiles | None",
                rest: dict | None, stats: dict, group) -> None:
        """The background part of a save: every rank's shards written, hashed, gathered; rank 0 commits.

        Every rank takes part in the gathering, failed or not (a rank that skipped it would leave
        the others waiting, and its next save's collectives would meet this one's)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        t0 = time.perf_counter()
        entries: dict = {}
        names: list[str] = []
        error: str | None = None
        try:
            names = _dcp_files(write())  # returns once every rank wrote its shards and rank 0 .metadata
            stats["write_s"] = time.perf_counter() - t0
            if hashing is not None:  # the files this rank wrote, hashed as they were written
                entries = {f"{folder}/{name}": {"size": size, "hash": HASH, "digest": digest}
                           for name, (size, digest) in hashing.files.items() if name in names}
            else:
                entries = _hash_files(self.ckpt.fs, path, folder, names[rank::world])
            stats["hash_s"] = time.perf_counter() - t0 - stats["write_s"]
        except Exception as exc:  # noqa: BLE001 - a failed save is reported, never raised into training
            error = f"rank {rank} could not write or hash its shards ({type(exc).__name__}: {storage.redact(exc)})"
        shares: list | None = [None] * world if rank == 0 else None
        try:
            dist.gather_object((entries, names, error), shares, dst=0, group=group)
        except Exception as exc:  # noqa: BLE001 - a rank is gone: nothing is committed
            error = error or f"gathering the shards' hashes failed ({type(exc).__name__}: {storage.redact(exc)})"
            shares = None
        if rank != 0:
            if error is not None:
                log.error("checkpoint step-%d: %s", step, error)
            return
        files: dict = {}
        if shares is not None:
            errors = [e for _, _, e in shares if e is not None]
            error = "; ".join(errors) if errors else None
            for got, _, _ in shares:
                files.update(got)
            missing = sorted(set(names) - {rel.split("/", 1)[1] for rel in files})
            if error is None and missing:  # written with a seek (not hashed while written): read back
                try:
                    files.update(_hash_files(self.ckpt.fs, path, folder, missing))
                except Exception as exc:  # noqa: BLE001 - reported as not committed
                    error = f"hashing {', '.join(missing)} failed ({type(exc).__name__}: {storage.redact(exc)})"
        if error is None:
            try:
                self.ckpt.save(step, {**(rest or {}), "sharded": {"folder": folder}}, blocking=True, include=files)
            except Exception as exc:  # noqa: BLE001 - e.g. a rest that cannot be snapshotted
                error = f"the commit failed ({type(exc).__name__}: {storage.redact(exc)})"
        if error is not None:
            error = f"checkpoint step-{step} not committed: {error}"
            self.ckpt.record_failure(stats, error)
            log.error("%s; the last good checkpoint stays", error)
            return
        done = self.ckpt.last_save_stats
        done.update(blocked_s=stats["blocked_s"], sharded_bytes=sum(e["size"] for e in files.values()),
                    total_s=time.perf_counter() - t0, **{k: stats[k] for k in ("stage_s", "write_s", "hash_s")})


def prepare_saves(ckpt, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool, main: bool,
                  timeout: datetime.timedelta | float | None = None, group: Callable[[], Any] | None = None,
                  staging: bool = True) -> "ShardedSaver | None":
    """After the first step, on every rank: start making the host memory the saves to come copy
    into (page-locked for a GPU state, on a background thread: ``host_memory``), so that the first
    save blocks no longer than the later ones. Sharded (``--fsdp``): this rank's staging buffer,
    and the ``ShardedSaver`` to save with is returned; else the full-state snapshot's buffer on
    the rank that saves (``main``), sized from ``module`` and ``optimizer``, and None."""
    if sharded:
        saver = ShardedSaver(ckpt, timeout=timeout, group=group)
        saver.prepare(module, optimizer, staging=staging)
        return saver
    if main:
        ckpt.prepare({"model": module.state_dict(), "optimizer": optimizer.state_dict()})
    return None


def save_sharded(ckpt, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 rest: dict | None) -> bool:
    """Every rank: a blocking sharded save of ``step`` (``ShardedSaver``, its group made for this
    one save); returns whether it was committed (on rank 0; True elsewhere when it was written)."""
    saver = ShardedSaver(ckpt)
    saver.save(step, module, optimizer, rest, blocking=True)
    saver.close()
    committed = bool(ckpt.last_save_stats.get("committed")) if dist.get_rank() == 0 else True
    dist.barrier()  # no rank moves on (and changes its shards) before the commit
    return committed


def load_sharded(ckpt, step: int, state: dict, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: load the shards of ``step`` (already verified by ``ckpt.load``) into ``module``
    and ``optimizer`` at this world size; ``state`` is what ``ckpt.load`` returned for it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    info = state.get("sharded")
    if not isinstance(info, dict) or not isinstance(info.get("folder"), str):
        raise ValueError(f"checkpoint step-{step} holds no sharded state")
    path = storage.join(ckpt.root, f"step-{step}", info["folder"])
    target = _sharded_state(module, optimizer)
    dcp.load(target, storage_reader=_reader(ckpt, path))
    set_model_state_dict(module, target["model"])
    set_optimizer_state_dict(module, optimizer, optim_state_dict=target["optimizer"])


def gathered(ckpt, step: int, state: dict) -> dict:
    """The whole model and optimizer state of a sharded ``step`` in this process, without a process
    group (``export``, tests): DCP's public ``dcp_to_torch_save`` through a temporary folder (the
    shards copied there first from an object store). Needs the memory of the whole state, as any
    single-file export does."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = storage.join(ckpt.root, f"step-{step}", state["sharded"]["folder"])
    with tempfile.TemporaryDirectory() as tmp:
        if not storage.is_local(ckpt.fs):
            ckpt.fs.get(path.rstrip("/") + "/", f"{tmp}/dcp/", recursive=True)
            path = f"{tmp}/dcp"
        out = f"{tmp}/full.pt"
        dcp_to_torch_save(path, out)
        return torch.load(out, map_location="cpu", weights_only=True)


def is_sharded(state: Any) -> bool:
    """Whether a loaded checkpoint state is the rest of a sharded save."""
    return isinstance(state, dict) and isinstance(state.get("sharded"), dict)
