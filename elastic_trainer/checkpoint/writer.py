"""The save pipeline: snapshot in the training thread, everything else on the save thread.

``CheckpointWriter.save`` blocks only while the state is snapshotted into CPU memory (every
tensor into its view of one reused buffer, the arena: ``snapshot.py``); the manager's one save
thread (``save_thread.py``) then writes it: serialize, upload, fence, commit (``commit.py``),
then retention (``retention.py``), one save in flight at a time. With ``overlap_copy`` the bulk
of the snapshot, the optimizer's parameters and states, is copied by that thread beside the next
forward and backward: a global optimizer step pre-hook (``snapshot.OptimizerWatch``) makes the
next optimizer step wait until the copy is done and then checks each tensor's version counter,
so the copy can never hold values from after the save (a tensor changed in place in between is
reported, the save abandoned, and that tensor copied synchronously from then on).

Failures never reach training: an upload that fails is retried with backoff (``retries``,
``retry_backoff_s``), then the save is given up, this writer's files removed and the message
kept in ``last_error`` and ``last_save_stats["error"]``; a fenced writer or a lost commit race
(``commit.Abandon``) gives up at once. The last good checkpoint is never touched before a newer
one is committed.

``last_save_stats`` of a save: ``step``, ``blocked_s`` (the training thread's time in ``save``,
plus any wait for the copy at the next optimizer step, ``copy_wait_s``), ``copy_s``,
``serialize_s``, ``upload_s``, ``bytes``, ``committed``, ``error``, ``host_buffer_bytes``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from elastic_trainer import storage
from elastic_trainer.checkpoint.commit import Abandon, Committer
from elastic_trainer.checkpoint.retention import Retention
from elastic_trainer.checkpoint.save_thread import SaveThread
from elastic_trainer.checkpoint.snapshot import DeferredCopy, OptimizerWatch, Snapshot, Snapshotter, where
from elastic_trainer.fence import FencedError

log = logging.getLogger(__name__)


class CheckpointWriter:
    """One writer's saves, one in flight at a time (see the module docstring).

    Args:
        url: the checkpoint URL (named in messages, redacted).
        committer: writes and commits one snapshot.
        retention: prunes after each commit.
        async_checkpoint: write on the save thread (else inside ``save``).
        overlap_copy: with ``async_checkpoint``, copy the optimizer's tensors beside training.
        retries, retry_backoff_s: upload attempts, and the first pause between them (doubling).
    """

    def __init__(self, url: str, committer: Committer, retention: Retention, *, async_checkpoint: bool,
                 overlap_copy: bool, retries: int, retry_backoff_s: float) -> None:
        self.url = url
        self.committer = committer
        self.retention = retention
        self.async_checkpoint = async_checkpoint
        self.retries = max(1, retries)
        self.retry_backoff_s = retry_backoff_s
        self.last_save_stats: dict = {}
        self.last_error: str | None = None
        self.last_committed_step: int | None = None
        self.deferred: DeferredCopy | None = None
        """The copy of the save in flight that runs beside training, until it is settled."""
        self.thread = SaveThread("checkpoint-save")
        self._lock = threading.Lock()
        self._snapshotter = Snapshotter()
        self._watch = OptimizerWatch.get() if async_checkpoint and overlap_copy else None

    def save(self, step: int, state: dict, *, blocking: bool = False, include: dict | None = None) -> float:
        """Snapshot ``state`` for ``step`` and write it (on the save thread unless ``blocking``,
        or ``include``: see ``CheckpointManager.save``); returns the seconds blocked here."""
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
                self.deferred = deferred
                self._watch.waiting.add(self)
            self.thread.submit(lambda: self._write_in_background(int(step), snap, stats, deferred))
        else:
            self._write(int(step), snap, stats, include)
        blocked = time.perf_counter() - start
        with self._lock:
            stats["blocked_s"] += blocked
            self.last_save_stats = stats
        return blocked

    def prepare(self, state: dict) -> None:
        """The snapshot's host memory for states like ``state``, made on a background thread."""
        self._snapshotter.prepare(state)

    def settle_copy(self) -> None:
        """Judge the copy running beside training (waiting for it if needed); see ``DeferredCopy``."""
        deferred = self.deferred
        if deferred is None:
            return
        waited = deferred.settle()
        self.deferred = None
        if self._watch is not None:
            self._watch.waiting.discard(self)
        with self._lock:
            deferred.stats["copy_wait_s"] += waited
            deferred.stats["blocked_s"] += waited

    def wait(self) -> None:
        """Until the save in flight is done (at once from the save thread itself)."""
        self.settle_copy()
        self.thread.wait()

    def busy(self) -> bool:
        return self.thread.busy()

    def run_in_background(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the save thread as the save in flight, after the previous one."""
        self.wait()
        self.thread.submit(work)

    def close(self) -> None:
        """Finish the save in flight, stop and join the save thread, free the snapshot buffers."""
        self.wait()
        self.thread.stop()
        self._snapshotter.clear()

    def record_failure(self, stats: dict, message: str) -> None:
        """Make ``stats`` (of a save that failed with ``message``) the last save's; not logged here."""
        self.last_error = message
        self.last_save_stats = {**stats, "committed": False, "error": message}

    def _write_in_background(self, step: int, snap: Snapshot, stats: dict, deferred: DeferredCopy | None) -> None:
        """On the save thread: finish the snapshot copy, wait until training judged it, then ``_write``."""
        if deferred is not None:
            deferred.run()
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
                self.committer.write_and_commit(step, snap, meta, stats, attempt, include)
                stats["upload_s"] = time.perf_counter() - t0 - stats["serialize_s"]
                stats["committed"] = True
                self.last_committed_step = step
                self.last_error = None
                log.debug("checkpoint %s committed (%d bytes, serialize %.2fs, upload %.2fs)", name,
                          stats["bytes"], stats["serialize_s"], stats["upload_s"])
                break
            except Abandon as exc:
                self.committer.cleanup_own(step)
                self._failed(stats, f"checkpoint {name} abandoned: {exc}")
                return
            except FencedError as exc:
                self.committer.cleanup_own(step)
                self._failed(stats, f"checkpoint {name} not committed: this writer is fenced "
                                    f"({type(exc).__name__}: {storage.redact(exc)})")
                return
            except Exception as exc:  # noqa: BLE001 - retried, then reported; training goes on
                msg = (f"checkpoint {name} upload to {storage.redact(self.url)} failed "
                       f"(attempt {attempt}/{self.retries}, {type(exc).__name__}: {storage.redact(exc)})")
                if attempt < self.retries:
                    delay = self.retry_backoff_s * 2 ** (attempt - 1)
                    log.warning("%s; retrying in %.1fs", msg, delay)
                    time.sleep(delay)
                else:
                    self.committer.cleanup_own(step)
                    self._failed(stats, f"{msg}; giving up on this checkpoint, the last good one stays")
                    return
        try:
            self.retention.prune(protect=step)
        except Exception as exc:  # noqa: BLE001 - pruning is best effort; the commit stands
            log.warning("pruning old checkpoints in %s failed (%s: %s)", storage.redact(self.url),
                        type(exc).__name__, storage.redact(exc))

    def _failed(self, stats: dict, message: str) -> None:
        stats["error"] = message
        self.last_error = message
        log.error("%s", message)


__all__ = ["CheckpointWriter"]
