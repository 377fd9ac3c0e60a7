"""Checkpoints on shared storage: atomic, verified, asynchronous, and resumed exactly.

A checkpoint is the folder ``<url>/step-<N>/``::

    step-120/
      <writer-id>/state.bin       the whole state: raw tensors behind a JSON header (format 3,
                                  ``checkpoint_format``); state.pt, one torch.save file, in format 2
      manifest.json               written last: every file with its size and checksum

A folder counts only once ``manifest.json`` exists, parses and every file it lists has the
listed size and checksum (xxh3_128; sha256 in manifests written before format 2); anything
else (in progress, killed mid-upload, truncated, bit-flipped) is skipped by readers with a
warning that names it. Data files live under a per-writer folder, and the manifest is
committed with an atomic create-if-absent (``storage.create_exclusive``) right after the
rendezvous fence is checked: if two processes both think they are rank 0 (a zombie from an old
round), the fenced one never commits, and if both pass the fence only one manifest wins, and it
lists exactly the winner's files, so the checkpoint always verifies. Given a fence object with
``guard()`` (``RoundFence``, ``LiveGroup``) the commit is instead the etcd commit record
(``record.py``), written in one transaction with the fence's token, so a writer paused after
its check cannot commit either; loads and retention then follow that record.

``CheckpointManager.save`` blocks only while the state is snapshotted into CPU memory (every
tensor into its view of one reused buffer, the arena, laid out as the file's data); a background
thread serializes (a small header, then the arena as it is, streamed into the file and hashed on
the way),
uploads, fences, commits and prunes, one save in flight at a time. With ``async_checkpoint`` the
bulk of the snapshot, the optimizer's parameters and states, is copied by that thread beside
the next forward and backward: a global optimizer step pre-hook makes the next optimizer step
wait until the copy is done and then checks each tensor's version counter, so the copy can
never hold values from after the save (a tensor changed in place in between is reported and
copied synchronously from then on). Upload failures are logged and retried with backoff and
never raised into training; the last good checkpoint is never touched before a newer one is
committed. A checkpoint can never run code: format 3 is JSON and raw bytes, checked field by
field, and formats 1 and 2 (still read) are loaded with ``torch.load(weights_only=True)``.

Example::

    ckpt = CheckpointManager("s3://bucket/run-1", keep_checkpoints=3, fence=fence.check)
    found = ckpt.load()                       # None on a fresh run
    ...
    blocked_s = ckpt.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "rng": capture_rng_state(), "meta": {"world_size": 4}})
    ckpt.close()
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import random
import re
import socket
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from elastic_trainer.checkpoint import format as checkpoint_format, storage
from elastic_trainer.checkpoint.record import CommitRecord, Conflict
from elastic_trainer.checkpoint.snapshot import DeferredCopy, OptimizerWatch, Snapshot, Snapshotter, where

log = logging.getLogger(__name__)

FORMAT_VERSION = checkpoint_format.FORMAT
"""What new manifests record: 3, one ``checkpoint_format`` file (2 when the state holds a tensor
without a raw layout: one ``torch.save`` file; 1, still read: a file per top-level entry)."""
_READABLE_FORMATS = (1, 2, 3)
MANIFEST = "manifest.json"
HASH = "xxh3_128"
"""The checksum new manifests record for each file (sha256 ones, from format 1, still verify)."""
_HASHES: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_STEP_RE = re.compile(r"^step-(\d+)$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_DATA_FILE = "state.pt"  # format 2 (and 1): torch.save
_DATA_FILE_V3 = "state.bin"  # format 3: checkpoint_format
_SERIALIZE_LOCK = threading.Lock()  # torch's CRC32 switch is process-wide


# ----------------------------------------------------------------------------- RNG state


def capture_rng_state(device: torch.device | str | None = None) -> dict:
    """This process's Python, numpy, torch CPU and CUDA RNG states, in weights_only-safe form.

    ``"cuda"`` is the generator of this process's own device only (``device``, default the
    current CUDA device when CUDA is available): one tensor, not every device's. Rank 0 saving
    ``get_rng_state_all()`` once gave rank k, on restore, the generator of rank 0's device k (one
    rank 0 never used); the trainer now saves every rank's own state (``training/rng.py``).
    """
    py_version, py_state, py_gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": int(py_version), "state": [int(x) for x in py_state], "gauss": py_gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    cuda = _cuda_device(device)
    if cuda is not None:
        state["cuda"] = torch.cuda.get_rng_state(cuda).cpu()
    return state


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    """The CUDA device whose generator is this process's: ``device`` if it is one, the current
    device when none is given and CUDA is available, else None (a CPU process)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def restore_rng_state(d: dict, device: torch.device | str | None = None) -> None:
    """Restore what ``capture_rng_state`` captured; its CUDA state goes to this process's device
    (``device``, default the current one) when both sides have CUDA.

    Checkpoints written before the per-device state hold ``"cuda"`` as a list of every device
    rank 0 saw; its first entry (rank 0's own device, local rank 0) is restored then."""
    py = d["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
    npd = d["numpy"]
    keys = npd["keys"].numpy() if isinstance(npd["keys"], torch.Tensor) else np.asarray(npd["keys"])
    np.random.set_state((npd["kind"], keys.astype(np.uint32), int(npd["pos"]), int(npd["has_gauss"]),
                         float(npd["cached_gaussian"])))
    torch.set_rng_state(d["torch"])
    cuda = _cuda_device(device) if "cuda" in d else None
    if cuda is not None:
        saved = d["cuda"]
        if isinstance(saved, (list, tuple)):  # the old all-devices form
            log.warning("checkpoint has the CUDA RNG state of the %d devices rank 0 saw (an older format); "
                        "restoring the first one on %s", len(saved), cuda)
            saved = saved[0]
        torch.cuda.set_rng_state(saved, cuda)


def _expected_digest(info: dict) -> tuple[str, str] | None:
    """``(algorithm, hex digest)`` of a manifest file entry (either format), None if unusable."""
    algorithm, digest = (info.get("hash"), info.get("digest")) if "hash" in info else ("sha256", info.get("sha256"))
    if algorithm not in _HASHES or not isinstance(digest, str):
        return None
    return algorithm, digest


def _fence_token(fence: Callable[[], None] | None) -> str | None:
    owner = getattr(fence, "__self__", None)
    token = getattr(owner, "token", None) if owner is not None else getattr(fence, "token", None)
    if token is not None:
        return str(token)
    rnd = os.environ.get("ELASTIC_TRAINER_RDZV_ROUND")
    return f"round-{rnd}" if rnd else None


def _is_fenced(exc: BaseException) -> bool:
    return any(cls.__name__ == "FencedError" for cls in type(exc).__mro__)


class _Abandon(Exception):
    """This checkpoint must not be committed (fenced, or another writer committed the step)."""


# ----------------------------------------------------------------------------- manager


class _Background:
    """Work run in the background one at a time (a sharded save's), on one daemon thread kept between saves.

    Starting a thread per save cost the training thread ~5-10 ms on this 2-core machine with four
    ranks (``Thread.start`` waits until the new thread runs, and that thread then holds the GIL);
    handing work to a waiting thread costs a queue put. ``stop`` ends the thread (``close``); a
    later ``submit`` starts another.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._done: threading.Event | None = None

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` next (the caller waited for the previous one); it reports its own failures."""
        done = threading.Event()
        self._done = done
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._jobs,), name="checkpoint-save", daemon=True)
            self._thread.start()
        self._jobs.put((work, done))

    def busy(self) -> bool:
        done = self._done
        return done is not None and not done.is_set()

    def wait(self) -> None:
        """Until the submitted work is done (at once when called from that work itself)."""
        done = self._done
        if done is not None and threading.current_thread() is not self._thread:
            done.wait()
            self._done = None

    def stop(self) -> None:
        """End the thread once its work is done."""
        self.wait()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None
            self._jobs = queue.SimpleQueue()

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            work, done = job
            try:
                work()
            except BaseException:  # noqa: BLE001 - the work reports its own failures; the thread stays
                log.exception("a background checkpoint save failed")
            finally:
                done.set()


class CheckpointManager:
    """Saves to and loads from ``<url>/step-<N>/``; see the module docstring.

    Args:
        url: any fsspec URL or local path (storage options from the environment).
        keep_checkpoints: how many committed checkpoints to keep (older ones pruned after a commit).
        async_checkpoint: serialize and upload in a background thread (else inside ``save``).
        fence: either a fence object with ``guard()`` (``RoundFence``, ``LiveGroup``): the commit is
            then the etcd commit record (``record.py``), written in one transaction with the fence's
            token, and loads and retention follow that record; or a plain callable, called right
            before the manifest is created (check-then-act: raising ``FencedError`` prevents it).
        writer_id: names this writer's data folder and appears in the manifest (default unique).
        overlap_copy: with ``async_checkpoint``, copy the optimizer's tensors (parameters and states)
            beside training instead of inside ``save``; the next optimizer step waits for that
            copy if it is still running (see the module docstring).
    """

    def __init__(self, url: str, keep_checkpoints: int = 3, async_checkpoint: bool = True,
                 fence: Callable[[], None] | None = None, writer_id: str | None = None,
                 *, retries: int = 3, retry_backoff_s: float = 1.0, overlap_copy: bool = True) -> None:
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {keep_checkpoints}")
        self.url = url
        self.keep_checkpoints = keep_checkpoints
        self.async_checkpoint = async_checkpoint
        self.overlap_copy = overlap_copy
        self.record = CommitRecord(fence, url) if hasattr(fence, "guard") else None
        self.fence = None if self.record is not None else fence
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if not _KEY_RE.match(self.writer_id):
            raise ValueError(f"writer_id {self.writer_id!r} may only use letters, digits, '_', '.' and '-'")
        self.retries = max(1, retries)
        self.retry_backoff_s = retry_backoff_s
        self.fs, self.root = storage.get_fs(url)
        self.last_save_stats: dict = {}
        self.last_error: str | None = None
        self.last_committed_step: int | None = None
        self._thread: threading.Thread | None = None  # a full-state save's writer (one per save: it lowers its priority)
        self._background = _Background()  # a sharded save's writing and commit (run_in_background)
        self._lock = threading.Lock()
        self._snapshotter = Snapshotter()
        self._deferred: DeferredCopy | None = None
        self._watch = OptimizerWatch.get() if async_checkpoint and overlap_copy else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict, *, blocking: bool = False, include: dict | None = None) -> float:
        """Snapshot ``state`` for ``step`` and write it (in the background unless ``blocking``).

        ``include`` lists files inside the step folder that others already wrote (the DCP shards
        of a sharded save, ``sharded.py``), as manifest entries ``{"<folder>/<name>": {"size",
        "hash", "digest"}}`` hashed from storage by their writers: the manifest lists them too
        (blocking saves only).

        Returns the seconds the caller was blocked here (waiting for the previous save +
        copying). With ``overlap_copy`` the optimizer's tensors are copied beside training, and
        a wait for that copy at the next optimizer step is added to ``last_save_stats``'s
        ``blocked_s`` (and ``copy_wait_s``) when it happens.
        """
        start = time.perf_counter()
        self.wait()
        stats = {"step": int(step), "blocked_s": 0.0, "copy_s": 0.0, "copy_wait_s": 0.0, "serialize_s": 0.0,
                 "upload_s": 0.0, "bytes": 0, "committed": False, "error": None}
        background = self.async_checkpoint and not blocking and include is None
        defer = self._watch.owned() if background and self._watch is not None else None
        snap, deferred = self._snapshotter.take(state, defer, stats)
        stats["copy_s"] = time.perf_counter() - start
        if background:
            if deferred is not None:
                self._deferred = deferred
                self._watch.waiting.add(self)
            self._thread = threading.Thread(target=self._write_in_background, args=(int(step), snap, stats, deferred),
                                            name=f"checkpoint-step-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(int(step), snap, stats, include)
        blocked = time.perf_counter() - start
        with self._lock:
            stats["blocked_s"] += blocked
            self.last_save_stats = stats
        return blocked

    def prepare(self, state: dict) -> None:
        """Make the snapshot memory for saves of states like ``state`` now, on a background thread
        (page-locked for a GPU state), so that the first save blocks no longer than the later ones;
        call it once the state exists (after the first optimizer step). See ``host_memory``."""
        self._snapshotter.prepare(state)

    def settle_copy(self) -> None:
        """Judge the copy running beside training (waiting for it if needed); see ``DeferredCopy``."""
        deferred = self._deferred
        if deferred is None:
            return
        waited = deferred.settle()
        self._deferred = None
        if self._watch is not None:
            self._watch.waiting.discard(self)
        with self._lock:
            deferred.stats["copy_wait_s"] += waited
            deferred.stats["blocked_s"] += waited

    def wait(self) -> None:
        """Block until the in-flight save (if any) is done; its failure is in ``last_error``.
        (Called from the in-flight save's own thread, as a sharded save's commit does, it
        returns at once.)"""
        self.settle_copy()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            self._thread = None
        self._background.wait()

    def busy(self) -> bool:
        """Whether a save is in flight (its background part not done yet)."""
        thread = self._thread
        return (thread is not None and thread.is_alive()) or self._background.busy()

    def run_in_background(self, step: int, work: Callable[[], None]) -> None:
        """Run ``work`` on the manager's save thread as its in-flight save of ``step``, after
        the previous save is done: ``wait``, ``close`` and the next ``save`` wait for it (a sharded
        save's writing and commit, ``sharded.py``). ``work`` reports its own failures."""
        self.wait()
        self._background.submit(work)

    def close(self) -> None:
        """Finish the in-flight save and free the snapshot buffers."""
        self.wait()
        self._snapshotter.clear()
        self._background.stop()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step_dir(self, step: int) -> str:
        return storage.join(self.root, f"step-{step}")

    def _write_in_background(self, step: int, snap: Snapshot, stats: dict, deferred: DeferredCopy | None) -> None:
        """Finish the snapshot copy (at normal priority: the next optimizer step may wait for it),
        then ``_write`` at a lower CPU priority (nice +10, this thread only), so that on a busy
        CPU the training thread comes first."""
        if deferred is not None:
            deferred.run()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + 10)
        except (OSError, AttributeError):  # not Linux, or not allowed: run at normal priority
            pass
        if deferred is not None:
            deferred.settled.wait()
            if deferred.error is not None or deferred.changed:
                self._copy_failed(step, stats, deferred)
                return
        self._write(step, snap, stats)

    def _copy_failed(self, step: int, stats: dict, deferred: DeferredCopy) -> None:
        if deferred.error is not None:
            self._failed(stats, f"checkpoint step-{step} not saved: copying the state failed "
                                f"({type(deferred.error).__name__}: {deferred.error})")
            return
        self._snapshotter.sync_keys.update(deferred.changed)
        names = ", ".join(where(k) for k in deferred.changed[:3]) + (" ..." if len(deferred.changed) > 3 else "")
        self._failed(stats, f"checkpoint step-{step} abandoned: {names} changed in place before the optimizer "
                            "step, while it was being copied beside training; later saves copy it before "
                            "returning instead")

    def _write(self, step: int, snap: Snapshot, stats: dict, include: dict | None = None) -> None:
        """Serialize, upload, fence, commit, prune; retried with backoff; never raises."""
        name = f"step-{step}"
        meta = snap.state.get("meta") if isinstance(snap.state.get("meta"), dict) else None
        t0 = time.perf_counter()
        for attempt in range(1, self.retries + 1):
            try:
                self._upload_and_commit(step, snap, meta, stats, attempt, include)
                stats["upload_s"] = time.perf_counter() - t0 - stats["serialize_s"]
                stats["committed"] = True
                self.last_committed_step = step
                self.last_error = None
                log.debug("checkpoint %s committed (%d bytes, serialize %.2fs, upload %.2fs)", name,
                         stats["bytes"], stats["serialize_s"], stats["upload_s"])
                break
            except _Abandon as exc:
                self._cleanup_own(step)
                self._failed(stats, f"checkpoint {name} abandoned: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - retried, then reported; training goes on
                if _is_fenced(exc):
                    self._cleanup_own(step)
                    self._failed(stats, f"checkpoint {name} not committed: this writer is fenced "
                                        f"({type(exc).__name__}: {storage.redact(exc)})")
                    return
                msg = (f"checkpoint {name} upload to {storage.redact(self.url)} failed "
                       f"(attempt {attempt}/{self.retries}, {type(exc).__name__}: {storage.redact(exc)})")
                if attempt < self.retries:
                    delay = self.retry_backoff_s * 2 ** (attempt - 1)
                    log.warning("%s; retrying in %.1fs", msg, delay)
                    time.sleep(delay)
                else:
                    self._cleanup_own(step)
                    self._failed(stats, f"{msg}; giving up on this checkpoint, the last good one stays")
                    return
        try:
            self._prune(protect=step)
        except Exception as exc:  # noqa: BLE001 - pruning is best effort; the commit stands
            log.warning("pruning old checkpoints in %s failed (%s: %s)", storage.redact(self.url),
                        type(exc).__name__, storage.redact(exc))

    def _failed(self, stats: dict, message: str) -> None:
        stats["error"] = message
        self.last_error = message
        log.error("%s", message)

    def _write_files(self, own: str, snap: Snapshot, stats: dict) -> tuple[int, dict]:
        """Serialize the snapshot into this writer's data file; returns the format and the
        manifest's ``files``.

        Format 3 (``checkpoint_format``): a JSON header, then the snapshot's arena as it is, hashed
        (xxh3_128) on its way out and written with ``storage.write_parts``: straight into the file
        on local disks, sent from the arena itself on S3 (no copy in memory), joined into one
        upload elsewhere. A state with a tensor that has no raw layout (sparse, quantized) is
        written as format 2, one ``torch.save`` file, with torch's own CRC32 switched off meanwhile
        (the manifest's hash covers every byte, and the CRC doubled the serialization time).
        ``stats["serialize_s"]`` is the header's time (format 3) or ``torch.save``'s (format 2,
        writing included on a filesystem).
        """
        hasher = _HASHES[HASH]()
        t0 = time.perf_counter()
        head = checkpoint_format.header(snap.state, snap.arena)
        if head is not None:
            name = _DATA_FILE_V3
            stats["serialize_s"] = time.perf_counter() - t0
            parts = [head, snap.arena.data] if snap.arena.size else [head]
            size = storage.write_parts(self.fs, storage.join(own, name), parts, hasher=hasher)
            fmt = 3
        else:
            fmt, name = 2, _DATA_FILE

            def produce(out) -> None:
                with _SERIALIZE_LOCK:
                    crc = torch.serialization.get_crc32_options()
                    torch.serialization.set_crc32_options(False)
                    try:
                        torch.save(snap.state, out)
                    finally:
                        torch.serialization.set_crc32_options(crc)
                stats["serialize_s"] = time.perf_counter() - t0

            size = storage.write_streamed(self.fs, storage.join(own, name), produce, hasher=hasher)
        stats["bytes"] = size
        return fmt, {f"{self.writer_id}/{name}": {"size": size, "hash": HASH, "digest": hasher.hexdigest()}}

    def _upload_and_commit(self, step: int, snap: Snapshot, meta: Any, stats: dict, attempt: int,
                           include: dict | None = None) -> None:
        fs, step_dir = self.fs, self._step_dir(step)
        manifest_path = storage.join(step_dir, MANIFEST)
        if attempt > 1 and self.record is not None:  # a retry may find its own commit in the record
            mine = next((e for e in self.record.read()[0] if e["step"] == step), None)
            if mine is not None and mine.get("writer") == self.writer_id:
                self._store_manifest(manifest_path, mine)
                return
        elif attempt > 1:  # only a retry can find a commit of its own (whose response was lost)
            writer = self._manifest_writer(manifest_path)
            if writer == self.writer_id:
                return
            if writer is not None:
                raise _Abandon("another writer already committed this step")
        own = storage.join(step_dir, self.writer_id)
        storage.makedirs(fs, own)
        fmt, files = self._write_files(own, snap, stats)
        if not storage.is_object_store(fs):
            # an object store's PUT either stored every byte or failed (on S3 the server also
            # checks the CRC32 botocore sends with it); a filesystem is asked once more here
            self._check_landed(own, files)
        if include is not None:
            files.update(include)
            stats["bytes"] += sum(int(info["size"]) for info in include.values())  # every byte committed
        if self.fence is not None:
            self.fence()
        manifest = {
            "format": fmt, "step": step, "files": files, "writer": self.writer_id,
            "fence_token": _fence_token(self.fence), "created": time.time(),
            "meta": meta, "host": socket.gethostname(),
        }
        if self.record is not None:
            # the commit point: one etcd transaction fenced by the round's (or quorum's) token;
            # the manifest in storage follows, for a job whose etcd has no record
            try:
                manifest["fence_token"] = self.record.commit(manifest, self.keep_checkpoints)
            except Conflict as exc:
                raise _Abandon(str(exc)) from exc
            try:
                self._store_manifest(manifest_path, manifest)
            except Exception as exc:  # noqa: BLE001 - committed already: never remove its data now
                log.warning("checkpoint step-%d is committed in etcd, but its manifest could not be copied to "
                            "%s (%s: %s); only a job with a new etcd would miss it", step,
                            storage.redact(manifest_path), type(exc).__name__, storage.redact(exc))
            return
        data = json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()
        if not storage.create_exclusive(fs, manifest_path, data):
            if self._manifest_writer(manifest_path) == self.writer_id:
                return
            raise _Abandon("another writer committed this step first")
        # No check after the commit: a newer writer's retention may remove this folder as a stale
        # leftover just as the manifest lands, but it does so only below every checkpoint it
        # keeps; such a manifest fails verification on load (skipped, named) and the next
        # retention removes it (docs/checkpoints.md, "Commit").

    def _store_manifest(self, manifest_path: str, manifest: dict) -> None:
        """The storage copy of a manifest the etcd record committed (create-if-absent). One left by
        another writer (an older run's same step, which this commit replaced in the record) is
        replaced too, so that the storage copy names the files the record names."""
        data = json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()
        if storage.create_exclusive(self.fs, manifest_path, data) or self._manifest_writer(manifest_path) == self.writer_id:
            return
        log.warning("replacing %s, another writer's manifest of a step this writer committed in the etcd record",
                    storage.redact(manifest_path))
        storage.remove(self.fs, manifest_path)
        storage.create_exclusive(self.fs, manifest_path, data)

    def _check_landed(self, own: str, files: dict) -> None:
        """Every file in this writer's folder with its size, else OSError: a stat of the one file a
        save writes, a listing for more."""
        names = [rel.split("/", 1)[1] for rel in files]
        if len(names) == 1:
            found = {names[0]: storage.size(self.fs, storage.join(own, names[0]))}
        else:
            found = storage.sizes(self.fs, own)
        for rel, info in files.items():
            got = found.get(rel.split("/", 1)[1])
            if got != info["size"]:
                raise OSError(f"{rel} has {got} bytes on storage after the upload, expected {info['size']}")

    def _manifest_writer(self, manifest_path: str) -> str | None:
        """The writer id in an existing manifest ("" when unreadable), None when there is none."""
        try:
            raw = storage.read_bytes(self.fs, manifest_path)
        except FileNotFoundError:
            return None
        try:
            return str(json.loads(raw).get("writer") or "")
        except (ValueError, AttributeError):
            return ""

    def _cleanup_own(self, step: int) -> None:
        try:
            storage.remove(self.fs, storage.join(self._step_dir(step), self.writer_id))
        except Exception as exc:  # noqa: BLE001 - leftovers are pruned later
            log.warning("could not remove this writer's files of step-%d (%s)", step, type(exc).__name__)

    # ------------------------------------------------------------------ listing, retention

    def _steps(self) -> list[int]:
        """Steps that have a folder, newest first (committed or not)."""
        out = []
        for name in storage.list_dir(self.fs, self.root):
            m = _STEP_RE.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out, reverse=True)

    def _read_manifest(self, step: int) -> dict | None:
        """The parsed manifest of ``step``, None when absent; ValueError when it does not parse."""
        try:
            raw = storage.read_bytes(self.fs, storage.join(self._step_dir(step), MANIFEST))
        except FileNotFoundError:
            return None
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE_FORMATS \
                or manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
            raise ValueError("manifest has the wrong format, step or file list")
        for rel, info in manifest["files"].items():
            if (".." in rel.split("/") or rel.startswith("/") or not isinstance(info, dict)
                    or not isinstance(info.get("size"), int)):
                raise ValueError(f"manifest lists a bad entry {rel!r}")
            if _expected_digest(info) is None:
                raise ValueError(f"manifest lists {rel!r} without a checksum this version knows "
                                 f"({info.get('hash', 'sha256')!r}; known: {', '.join(sorted(_HASHES))})")
        return manifest

    def _prune(self, protect: int) -> None:
        """Keep the newest ``keep_checkpoints`` committed checkpoints; remove older ones and stale leftovers.

        ``protect`` (the step this writer just committed and knows complete) is never removed, even
        if newer manifests exist whose data might be damaged.
        """
        steps = self._steps()
        recorded = {e["step"]: e for e in self.record.read()[0]} if self.record is not None else {}
        committed: list[tuple[int, dict]] = []
        uncommitted: list[int] = []
        for step in steps:
            if step in recorded:
                committed.append((step, recorded[step]))
                continue
            try:
                manifest = self._read_manifest(step)
            except (ValueError, OSError):
                manifest = None
            if manifest is None:
                uncommitted.append(step)
            else:
                committed.append((step, manifest))
        if not committed:
            return
        if recorded:
            # the record's steps are what loaders pick (a round may be loading any of them); storage
            # manifests below them fill up to keep_checkpoints; any other step is left alone
            below = [(s, m) for s, m in committed if s < min(recorded)]
            kept = [(s, recorded[s]) for s in sorted(recorded, reverse=True) if s in dict(committed)]
            kept += below[: max(0, self.keep_checkpoints - len(kept))]
            removable = [(s, m) for s, m in below if (s, m) not in kept]
        else:
            kept = committed[: self.keep_checkpoints]
            removable = committed[self.keep_checkpoints:]
        if not kept:
            return
        oldest_kept = min(s for s, _ in kept)
        for step, _ in removable:
            if step == protect or step in recorded:
                continue
            log.debug("removing old checkpoint step-%d (keeping %d)", step, self.keep_checkpoints)
            storage.remove(self.fs, self._step_dir(step))
        for step in uncommitted:
            # leftovers of killed or fenced writers; a writer still uploading an older step could
            # only ever produce a checkpoint older than every kept one
            if step < oldest_kept:
                log.info("removing uncommitted leftover step-%d", step)
                storage.remove(self.fs, self._step_dir(step))
        for step, manifest in kept:  # losers' data folders inside committed steps
            live = {rel.split("/", 1)[0] for rel in manifest["files"]} | {MANIFEST}
            for name in storage.list_dir(self.fs, self._step_dir(step)):
                if name not in live and not name.startswith("."):
                    storage.remove(self.fs, storage.join(self._step_dir(step), name))

    # ------------------------------------------------------------------ loading

    def _read_verified(self, step: int, manifest: dict | None = None,
                       share: tuple[int, int] | None = None) -> tuple[int, dict[str, bytes]]:
        """The manifest's format and the bytes of every file of ``step``, checked against its
        manifest (``manifest``, the etcd record's entry, else the one in storage); ValueError
        saying what is wrong. With ``share`` ``(index, count)`` only every count-th shard file
        (a sharded save's, in name order, from ``index``) is checked; every other file is."""
        if manifest is None:
            manifest = self._read_manifest(step)
        if manifest is None:
            raise ValueError("no manifest (never committed: in progress, killed or abandoned)")
        out = {}
        shard = -1
        for rel, info in sorted(manifest["files"].items()):
            keep = manifest["format"] != 3 or rel.rsplit("/", 1)[-1] in (_DATA_FILE_V3, _DATA_FILE)
            if not keep:
                shard += 1
                if share is not None and shard % share[1] != share[0]:
                    continue  # another rank's share
            path = storage.join(self._step_dir(step), rel)
            try:
                if keep:
                    data = storage.read_bytes(self.fs, path)
                    size, hasher = len(data), None
                else:  # a shard (sharded.py): verified here, read by its own loader; streamed
                    data, size, hasher = None, 0, _HASHES[_expected_digest(info)[0]]()
                    with self.fs.open(path, "rb") as f:
                        while chunk := f.read(storage.WRITE_PIECE * 4):
                            hasher.update(chunk)
                            size += len(chunk)
            except FileNotFoundError as exc:
                raise ValueError(f"{rel} is missing") from exc
            if size != info["size"]:
                raise ValueError(f"{rel} has {size} bytes, manifest says {info['size']} (truncated?)")
            algorithm, digest = _expected_digest(info)
            if (hasher.hexdigest() if hasher is not None else _HASHES[algorithm](data).hexdigest()) != digest:
                raise ValueError(f"{rel} fails its {algorithm} check (corrupted)")
            if keep:
                out[rel] = data
        return manifest["format"], out

    def _verified_load(self, step: int, manifest: dict | None = None, share: tuple[int, int] | None = None) -> dict:
        """Read, verify and deserialize ``step``; never runs code: format 3 is JSON and raw bytes,
        formats 1 and 2 are read with ``torch.load(weights_only=True)``."""
        fmt, blobs = self._read_verified(step, manifest, share)
        state: dict = {}
        for rel in list(blobs):
            data = blobs.pop(rel)
            try:
                if fmt == 3:
                    state.update(checkpoint_format.read(data))
                else:
                    state.update(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
            except Exception as exc:
                raise ValueError(f"{rel} does not load ({type(exc).__name__}: {exc})") from exc
        return state

    def _candidates(self, step: int | None) -> list[tuple[int, dict | None]]:
        """``(step, manifest)`` to try, newest first: with an etcd record its steps in commit order
        (with the record's file lists), then the storage manifests below them; without one, every
        step folder (its manifest read from storage: None)."""
        entries = self.record.read()[0] if self.record is not None else []
        recorded = {e["step"]: e for e in entries}
        if step is not None:
            return [(step, recorded.get(step))] if step in recorded or step in self._steps() else []
        if not entries:
            return [(s, None) for s in self._steps()]
        # never a storage manifest at or above the record's oldest step that the record lacks: the
        # record is the commit, and such a manifest is not one of its checkpoints
        return [(e["step"], e) for e in entries] + \
            [(s, None) for s in self._steps() if s < min(recorded)]

    def load(self, step: int | None = None, *, share: tuple[int, int] | None = None,
             skip: frozenset[int] | set[int] = frozenset()) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid checkpoint (or of ``step``) that is not in
        ``skip``; None when there is none. With ``share`` ``(index, count)``, of a sharded
        checkpoint's shard files only this share is verified here (``_read_verified``): ranks
        that verify a share each must agree before they trust the step (``Trainer``), so that
        no rank reads the whole checkpoint."""
        for candidate, manifest in self._candidates(step):
            if candidate in skip:
                continue
            try:
                state = self._verified_load(candidate, manifest, share)
            except Exception as exc:  # noqa: BLE001 - any defect means "skip it"; say which and why
                self._warn_skip(candidate, exc)
                continue
            log.info("loaded checkpoint step-%d from %s", candidate, storage.redact(self.url))
            return candidate, state
        return None

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint that verifies (sizes and checksums), or None."""
        for candidate, manifest in self._candidates(None):
            try:
                self._read_verified(candidate, manifest)
            except Exception as exc:  # noqa: BLE001 - skip defects, naming them
                self._warn_skip(candidate, exc)
                continue
            return candidate
        return None

    def _warn_skip(self, step: int, exc: BaseException) -> None:
        log.warning("skipping checkpoint %s: %s", storage.join(storage.redact(self.url), f"step-{step}"),
                    storage.redact(exc))
