"""Checkpoints on shared storage: atomic, verified, asynchronous, and resumed exactly.

A checkpoint is the folder ``<url>/step-<N>/``::

    step-120/
      <writer-id>/state.pt        the whole state, one torch.save file
      manifest.json               written last: every file with its size and checksum

A folder counts only once ``manifest.json`` exists, parses and every file it lists has the
listed size and checksum (xxh3_128; sha256 in manifests written before format 2); anything
else (in progress, killed mid-upload, truncated, bit-flipped) is skipped by readers with a
warning that names it. Data files live under a per-writer folder, and the manifest is
committed with an atomic create-if-absent (``storage.create_exclusive``) right after the
rendezvous fence is checked: if two processes both think they are rank 0 (a zombie from an old
round), the fenced one never commits, and if both pass the fence only one manifest wins, and it
lists exactly the winner's files, so the checkpoint always verifies.

``CheckpointManager.save`` blocks only while the state is snapshotted into CPU memory; a
background thread serializes (``torch.save`` streamed into the file, hashed on the way),
uploads, fences, commits and prunes, one save in flight at a time. With ``async_save`` the
bulk of the snapshot, the optimizer's parameters and states, is copied by that thread beside
the next forward and backward: a global optimizer step pre-hook makes the next optimizer step
wait until the copy is done and then checks each tensor's version counter, so the copy can
never hold values from after the save (a tensor changed in place in between is reported and
copied synchronously from then on). Upload failures are logged and retried with backoff and
never raised into training; the last good checkpoint is never touched before a newer one is
committed. Loading uses ``torch.load(weights_only=True)``: a checkpoint can never run code.

Example::

    ckpt = CheckpointManager("s3://bucket/run-1", keep_latest=3, fence=fence.check)
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
import random
import re
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Callable

import numpy as np
import torch
import xxhash
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic_trainer import storage

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 1: files listed with "sha256"; 2: with "hash" (algorithm) and "digest"
_READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
HASH = "xxh3_128"
"""The checksum new manifests record for each file (sha256 ones, from format 1, still verify)."""
_HASHES: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_STEP_RE = re.compile(r"^step-(\d+)$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_DATA_FILE = "state.pt"
_SERIALIZE_LOCK = threading.Lock()  # torch's CRC32 switch is process-wide


# ----------------------------------------------------------------------------- RNG state


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and (when available) CUDA RNG states, in weights_only-safe form."""
    py_version, py_state, py_gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": int(py_version), "state": [int(x) for x in py_state], "gauss": py_gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(d: dict) -> None:
    """Restore what ``capture_rng_state`` captured (CUDA only when both sides have it)."""
    py = d["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
    npd = d["numpy"]
    keys = npd["keys"].numpy() if isinstance(npd["keys"], torch.Tensor) else np.asarray(npd["keys"])
    np.random.set_state((npd["kind"], keys.astype(np.uint32), int(npd["pos"]), int(npd["has_gauss"]),
                         float(npd["cached_gaussian"])))
    torch.set_rng_state(d["torch"])
    if "cuda" in d and torch.cuda.is_available():
        cuda = list(d["cuda"])
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("checkpoint has CUDA RNG state for %d devices, this process sees %d; "
                        "restoring device 0 only", len(cuda), torch.cuda.device_count())
            torch.cuda.set_rng_state(cuda[0])


# ----------------------------------------------------------------------------- snapshot


_PLAIN = frozenset({str, bool, int, float, type(None)})


def _where(key: tuple) -> str:
    return "state" + "".join(f"[{k!r}]" for k in key)


class _DeferredCopy:
    """Tensor copies that run beside training, checked before anything may have changed them.

    ``run`` copies (in the writer thread); ``settle`` (in the training thread, at the next
    optimizer step or ``wait``) waits for that copy and then compares each source's version
    counter with the one recorded at ``save``: every in-place change of a tensor (an optimizer
    step, ``add_``, ``copy_``, a broadcast into it) bumps it. Settling after the copy, from the
    thread that trains, means no change can be half done at that moment, so equal versions prove
    the copy holds the values of the save. ``settled`` is what the writer waits for.
    """

    def __init__(self, items: list[tuple[tuple, torch.Tensor, torch.Tensor, int]], stats: dict) -> None:
        self.items = items  # (key, destination buffer, source, source version at save)
        self.stats = stats
        self.copied = threading.Event()
        self.settled = threading.Event()
        self.changed: list[tuple] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            torch._foreach_copy_([d for _, d, _, _ in self.items], [s for _, _, s, _ in self.items])
        except BaseException as exc:  # noqa: BLE001 - handed to the writer, which reports it
            self.error = exc
        finally:
            self.copied.set()

    def settle(self) -> float:
        """Wait for the copy and judge it (once); returns the seconds waited here."""
        with self._lock:
            if self.settled.is_set():
                return 0.0
            start = time.perf_counter()
            self.copied.wait()
            waited = time.perf_counter() - start
            self.changed = [key for key, _, src, version in self.items if src._version != version]
            self.items = []  # drop the references to the live tensors
            self.settled.set()
            return waited


class _Snapshotter:
    """Copies a state into CPU memory, reusing the buffers of the previous save when shapes match.

    Reuse is safe because a new save starts only after the previous one finished with its copy;
    it avoids allocating (and page-faulting) fresh memory for every save, which is most of the
    cost of the copy. Copies go out in one ``torch._foreach_copy_`` (one dispatch instead of one
    per tensor); CUDA sources land in pinned buffers, with one synchronize at the end.

    ``take(state, defer=ptrs)`` copies only the tensors whose memory is not in ``ptrs`` now; the
    others (the optimizer's parameters and states, which only an optimizer step changes) are
    returned as a ``_DeferredCopy`` to run beside training. A deferred tensor found changed is
    copied synchronously by every later ``take`` (``sync_keys``).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.sync_keys: set[tuple] = set()

    def take(self, state: dict, defer: set[int] | None = None,
             stats: dict | None = None) -> tuple[dict, _DeferredCopy | None]:
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        later: list[tuple] = []
        seen: set[tuple] = set()
        snap = self._copy(state, (), seen, dst, src, later, defer or set())
        if dst:
            torch._foreach_copy_(dst, src, non_blocking=True)
            if any(t.is_cuda for t in src):
                torch.cuda.synchronize()
        for key in set(self.buffers) - seen:  # tensors that are gone from the state
            del self.buffers[key]
        return snap, (_DeferredCopy(later, stats if stats is not None else {}) if later else None)

    def _buffer(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype and buf.is_pinned() == t.is_cuda:
            return buf
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)

    def _copy(self, value: Any, key: tuple, seen: set, dst: list, src: list, later: list, defer: set) -> Any:
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.layout != torch.strided or t.is_quantized or not t.is_contiguous():
                return t.to("cpu", copy=True)  # rare in a state dict: no buffer reuse
            buf = self._buffer(t, key)
            self.buffers[key] = buf
            seen.add(key)
            if defer and not t.is_cuda and t.data_ptr() in defer and key not in self.sync_keys:
                later.append((key, buf, t, t._version))
            else:
                dst.append(buf)
                src.append(t)
            return buf
        if isinstance(value, dict):
            return {k: self._copy(v, (*key, k), seen, dst, src, later, defer) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if all(type(v) in _PLAIN for v in value):  # e.g. python's RNG state, 625 ints: one pass in C
                return list(value) if isinstance(value, list) else tuple(value)
            items = [self._copy(v, (*key, i), seen, dst, src, later, defer) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if value is None or isinstance(value, (str, bool, int, float, torch.dtype, torch.Size)):
            return value
        if isinstance(value, np.generic):
            return value.item()
        raise TypeError(f"cannot checkpoint {_where(key)} of type {type(value).__name__}: use tensors and plain "
                        "python values (str/int/float/bool/None/list/tuple/dict)")


class _OptimizerWatch:
    """One global optimizer step pre-hook for the process (registered by the first manager).

    It remembers the optimizers that step (their tensors are the ones a save may copy beside
    training) and, before any optimizer changes its parameters, settles the deferred copies of
    every manager that has one in flight.
    """

    _instance: "_OptimizerWatch | None" = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self.waiting: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()
        register_optimizer_step_pre_hook(self._before_step)

    @classmethod
    def get(cls) -> "_OptimizerWatch":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizers.add(optimizer)
        if self.waiting:
            for manager in list(self.waiting):
                manager._settle_copy()

    def owned(self) -> set[int]:
        """Data pointers of every parameter and optimizer-state tensor of the optimizers seen."""
        ptrs: set[int] = set()
        for opt in list(self.optimizers):
            for group in opt.param_groups:
                ptrs.update(p.data_ptr() for p in group["params"])
            for per_param in opt.state.values():
                ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return ptrs


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


class CheckpointManager:
    """Saves to and loads from ``<url>/step-<N>/``; see the module docstring.

    Args:
        url: any fsspec URL or local path (storage options from the environment).
        keep_latest: how many committed checkpoints to keep (older ones pruned after a commit).
        async_save: serialize and upload in a background thread (else inside ``save``).
        fence: called right before the commit; raising ``FencedError`` (or anything) prevents it.
        writer_id: names this writer's data folder and appears in the manifest (default unique).
        overlap_copy: with ``async_save``, copy the optimizer's tensors (parameters and states)
            beside training instead of inside ``save``; the next optimizer step waits for that
            copy if it is still running (see the module docstring).
    """

    def __init__(self, url: str, keep_latest: int = 3, async_save: bool = True,
                 fence: Callable[[], None] | None = None, writer_id: str | None = None,
                 *, retries: int = 3, retry_backoff_s: float = 1.0, overlap_copy: bool = True) -> None:
        if keep_latest < 1:
            raise ValueError(f"keep_latest must be at least 1, got {keep_latest}")
        self.url = url
        self.keep_latest = keep_latest
        self.async_save = async_save
        self.overlap_copy = overlap_copy
        self.fence = fence
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if not _KEY_RE.match(self.writer_id):
            raise ValueError(f"writer_id {self.writer_id!r} may only use letters, digits, '_', '.' and '-'")
        self.retries = max(1, retries)
        self.retry_backoff_s = retry_backoff_s
        self.fs, self.root = storage.get_fs(url)
        self.last_save_stats: dict = {}
        self.last_error: str | None = None
        self.last_committed_step: int | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._snapshotter = _Snapshotter()
        self._deferred: _DeferredCopy | None = None
        self._watch = _OptimizerWatch.get() if async_save and overlap_copy else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict, *, blocking: bool = False) -> float:
        """Snapshot ``state`` for ``step`` and write it (in the background unless ``blocking``).

        Returns the seconds the caller was blocked here (waiting for the previous save +
        copying). With ``overlap_copy`` the optimizer's tensors are copied beside training, and
        a wait for that copy at the next optimizer step is added to ``last_save_stats``'s
        ``blocked_s`` (and ``copy_wait_s``) when it happens.
        """
        start = time.perf_counter()
        self.wait()
        stats = {"step": int(step), "blocked_s": 0.0, "copy_s": 0.0, "copy_wait_s": 0.0, "serialize_s": 0.0,
                 "upload_s": 0.0, "bytes": 0, "committed": False, "error": None}
        background = self.async_save and not blocking
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
            self._write(int(step), snap, stats)
        blocked = time.perf_counter() - start
        with self._lock:
            stats["blocked_s"] += blocked
            self.last_save_stats = stats
        return blocked

    def _settle_copy(self) -> None:
        """Judge the copy running beside training (waiting for it if needed); see ``_DeferredCopy``."""
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
        """Block until the in-flight save (if any) is done; its failure is in ``last_error``."""
        self._settle_copy()
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def close(self) -> None:
        """Finish the in-flight save and free the snapshot buffers."""
        self.wait()
        self._snapshotter.buffers.clear()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step_dir(self, step: int) -> str:
        return storage.join(self.root, f"step-{step}")

    def _write_in_background(self, step: int, snap: dict, stats: dict, deferred: _DeferredCopy | None) -> None:
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

    def _copy_failed(self, step: int, stats: dict, deferred: _DeferredCopy) -> None:
        if deferred.error is not None:
            self._failed(stats, f"checkpoint step-{step} not saved: copying the state failed "
                                f"({type(deferred.error).__name__}: {deferred.error})")
            return
        self._snapshotter.sync_keys.update(deferred.changed)
        names = ", ".join(_where(k) for k in deferred.changed[:3]) + (" ..." if len(deferred.changed) > 3 else "")
        self._failed(stats, f"checkpoint step-{step} abandoned: {names} changed in place before the optimizer "
                            "step, while it was being copied beside training; later saves copy it before "
                            "returning instead")

    def _write(self, step: int, snap: dict, stats: dict) -> None:
        """Serialize, upload, fence, commit, prune; retried with backoff; never raises."""
        name = f"step-{step}"
        meta = snap.get("meta") if isinstance(snap.get("meta"), dict) else None
        t0 = time.perf_counter()
        for attempt in range(1, self.retries + 1):
            try:
                self._upload_and_commit(step, snap, meta, stats, attempt)
                stats["upload_s"] = time.perf_counter() - t0 - stats["serialize_s"]
                stats["committed"] = True
                self.last_committed_step = step
                self.last_error = None
                log.info("checkpoint %s committed (%d bytes, serialize %.2fs, upload %.2fs)", name,
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

    def _write_files(self, own: str, snap: dict, stats: dict) -> dict:
        """Serialize the snapshot into this writer's data file; returns the manifest's ``files``.

        ``torch.save`` writes straight into the file on local disks (into memory, then one
        upload, elsewhere) and every byte is hashed (xxh3_128) on its way out. torch's own CRC32 is
        switched off meanwhile: the manifest's hash covers every byte, and the CRC doubled the
        serialization time.
        """
        hasher = _HASHES[HASH]()

        def produce(out) -> None:
            t0 = time.perf_counter()
            with _SERIALIZE_LOCK:
                crc = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
                try:
                    torch.save(snap, out)
                finally:
                    torch.serialization.set_crc32_options(crc)
            stats["serialize_s"] = time.perf_counter() - t0

        size = storage.write_streamed(self.fs, storage.join(own, _DATA_FILE), produce, hasher=hasher)
        stats["bytes"] = size
        return {f"{self.writer_id}/{_DATA_FILE}": {"size": size, "hash": HASH, "digest": hasher.hexdigest()}}

    def _upload_and_commit(self, step: int, snap: dict, meta: Any, stats: dict, attempt: int) -> None:
        fs, step_dir = self.fs, self._step_dir(step)
        manifest_path = storage.join(step_dir, MANIFEST)
        if attempt > 1:  # only a retry can find a commit of its own (whose response was lost)
            writer = self._manifest_writer(manifest_path)
            if writer == self.writer_id:
                return
            if writer is not None:
                raise _Abandon("another writer already committed this step")
        own = storage.join(step_dir, self.writer_id)
        storage.makedirs(fs, own)
        files = self._write_files(own, snap, stats)
        if not storage.is_object_store(fs):
            # an object store's PUT either stored every byte or failed (and the check after the
            # commit below lists the folder anyway); a filesystem is asked once more here
            self._check_landed(own, files, "after upload")
        if self.fence is not None:
            self.fence()
        manifest = {
            "format": FORMAT_VERSION, "step": step, "files": files, "writer": self.writer_id,
            "fence_token": _fence_token(self.fence), "created": time.time(),
            "meta": meta, "host": socket.gethostname(),
        }
        data = json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()
        if not storage.create_exclusive(fs, manifest_path, data):
            if self._manifest_writer(manifest_path) == self.writer_id:
                return
            raise _Abandon("another writer committed this step first")
        try:
            self._check_landed(own, files, "after commit")
        except OSError as exc:
            # another writer's retention may have pruned our folder as a stale leftover (it only
            # does so for steps older than all it keeps); then take the manifest back
            storage.remove(fs, manifest_path)
            raise _Abandon(f"{exc} (pruned by a newer writer?); manifest withdrawn") from exc

    def _check_landed(self, own: str, files: dict, when: str) -> None:
        """One listing of this writer's folder: every file there with its size, else OSError."""
        found = storage.sizes(self.fs, own)
        for rel, info in files.items():
            got = found.get(rel.split("/", 1)[1])
            if got != info["size"]:
                raise OSError(f"{rel} has {got} bytes on storage {when}, expected {info['size']}")

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
        """Keep the newest ``keep_latest`` committed checkpoints; remove older ones and stale leftovers.

        ``protect`` (the step this writer just committed and knows complete) is never removed, even
        if newer manifests exist whose data might be damaged.
        """
        steps = self._steps()
        committed: list[tuple[int, dict]] = []
        uncommitted: list[int] = []
        for step in steps:
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
        kept = committed[: self.keep_latest]
        oldest_kept = kept[-1][0]
        for step, _ in committed[self.keep_latest:]:
            if step == protect:
                continue
            log.info("removing old checkpoint step-%d (keeping %d)", step, self.keep_latest)
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

    def _read_verified(self, step: int) -> dict[str, bytes]:
        """The bytes of every file of ``step``, checked against its manifest; ValueError saying what is wrong."""
        manifest = self._read_manifest(step)
        if manifest is None:
            raise ValueError("no manifest (never committed: in progress, killed or abandoned)")
        out = {}
        for rel, info in sorted(manifest["files"].items()):
            try:
                data = storage.read_bytes(self.fs, storage.join(self._step_dir(step), rel))
            except FileNotFoundError as exc:
                raise ValueError(f"{rel} is missing") from exc
            if len(data) != info["size"]:
                raise ValueError(f"{rel} has {len(data)} bytes, manifest says {info['size']} (truncated?)")
            algorithm, digest = _expected_digest(info)
            if _HASHES[algorithm](data).hexdigest() != digest:
                raise ValueError(f"{rel} fails its {algorithm} check (corrupted)")
            out[rel] = data
        return out

    def _verified_load(self, step: int) -> dict:
        """Read, verify and deserialize ``step`` (``torch.load(weights_only=True)``: never runs code)."""
        blobs = self._read_verified(step)
        state: dict = {}
        for rel in list(blobs):
            state.update(torch.load(io.BytesIO(blobs.pop(rel)), map_location="cpu", weights_only=True))
        return state

    def _candidates(self, step: int | None):
        steps = self._steps()
        return [s for s in steps if s == step] if step is not None else steps

    def load(self, step: int | None = None) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid checkpoint (or of ``step``); None when there is none."""
        for candidate in self._candidates(step):
            try:
                state = self._verified_load(candidate)
            except Exception as exc:  # noqa: BLE001 - any defect means "skip it"; say which and why
                self._warn_skip(candidate, exc)
                continue
            log.info("loaded checkpoint step-%d from %s", candidate, storage.redact(self.url))
            return candidate, state
        return None

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint that verifies (sizes and sha256), or None."""
        for candidate in self._steps():
            try:
                self._read_verified(candidate)
            except Exception as exc:  # noqa: BLE001 - skip defects, naming them
                self._warn_skip(candidate, exc)
                continue
            return candidate
        return None

    def _warn_skip(self, step: int, exc: BaseException) -> None:
        log.warning("skipping checkpoint %s: %s", storage.join(storage.redact(self.url), f"step-{step}"),
                    storage.redact(exc))
