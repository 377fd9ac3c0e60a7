"""SIGTERM: save at the next step boundary, and exit within the grace period whatever happens.

A node that is preempted (a spot instance, a Kubernetes eviction, ``elastic-train`` stopped) gets
SIGTERM and ``--grace-seconds`` before SIGKILL. ``Preemption`` turns that into a clean stop:

1. The signal only records itself (``signum``); every rank learns at the next step-end
   agreement that some rank got one, and they all stop and save that step together
   (``PEER_STOPPED`` on the others: they exit ``EXIT_PEER_STOPPED`` so that torchrun restarts
   them into a round without the preempted node).
2. A Python handler runs only when the main thread next runs Python code, never while it is
   blocked in a collective with a dead peer; ``SignalWatcher`` sees the signal at delivery
   (``signal.set_wakeup_fd``), so the timers below start even then.
3. The **grace timer** ends the process (``EXIT_PREEMPTED``) when the save has not finished
   within ``--grace-seconds``; the **hung-step watchdog** ends it sooner when no step boundary
   passes within ``max(2 s, 3 step times)`` of the signal (the step waits for a peer that is
   gone: no save is possible, the newest checkpoint stays), unless a save after a failure is
   under way (that one has the whole grace period).

Threads: the watcher thread and both timers are started through the worker runtime
(``runtime.py``), which also ends the process (its ``before_exit`` hooks flush W&B
first). ``close()`` stops and joins the watcher and restores the previous handler; ``disarm()``
cancels the timers once training has ended normally.

Usage (what ``Trainer`` does)::

    preemption = Preemption(config.grace_seconds)           # first: a SIGTERM during start-up counts
    ...
    preemption.watch(dinfo, step_seconds=..., on_signal=report.mark_preempting, on_hung=abort,
                     saving=lambda: checkpoints.saving_after_failure)
    ... preemption.boundaries += 1 after each step; preemption.signum at each agreement ...
    preemption.disarm(); preemption.close()
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Any, Callable

from elastic_trainer.env import EXIT_PREEMPTED
from elastic_trainer.runtime import runtime
from elastic_trainer.training.worker import DistInfo

logger = logging.getLogger(__name__)

PEER_STOPPED = "a peer was stopped by a signal"
"""Why a rank stops when another node was preempted: it saves with the others, then exits with
``EXIT_PEER_STOPPED`` so that its agent restarts it into a round without the preempted node."""


class SignalWatcher:
    """Acts on SIGTERM when it arrives, not when the main thread next runs Python code.

    Python runs signal handlers in the main thread between bytecodes, so a worker blocked in a
    collective with a dead peer would never see the signal. ``signal.set_wakeup_fd`` makes the
    C-level handler write the signal number to a socket at delivery; a thread of the worker
    runtime (``sigterm-watcher``) reads it and calls ``callback(signum)``.
    """

    def __init__(self, callback: Callable[[int], None]) -> None:
        self._callback = callback
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = runtime().start_thread("sigterm-watcher", self._run, stop=self._stop)

    def _run(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._callback(signal.SIGTERM)

    def _stop(self) -> None:
        try:
            self._read.shutdown(socket.SHUT_RDWR)
        except OSError:  # already shut down (closed, or the runtime asked after close())
            pass

    def close(self) -> None:
        """Restore the previous wakeup fd and end the thread (no thread may outlive the trainer)."""
        signal.set_wakeup_fd(self._old_fd)
        self._stop()
        self._thread.join(timeout=5)
        self._write.close()
        self._read.close()


class Preemption:
    """A worker's SIGTERM handling; see the module docstring."""

    def __init__(self, grace_seconds: float) -> None:
        self.grace_seconds = grace_seconds
        self.signum: int | None = None  # the signal this rank got (None: none yet)
        self.boundaries = 0  # step boundaries passed: the hung-step watchdog tells a hung step by it
        self._dinfo = DistInfo()  # where this worker sits (``watch``); rank 0 of 1 until then
        self._step_seconds: Callable[[], float | None] = lambda: None
        self._on_signal: Callable[[], None] = lambda: None
        self._on_hung: Callable[[], None] = lambda: None
        self._saving: Callable[[], bool] = lambda: False
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)  # acted on at a step boundary
        self._watcher = SignalWatcher(self._on_sigterm)

    def watch(self, dinfo: DistInfo, *, step_seconds: Callable[[], float | None], on_signal: Callable[[], None],
              on_hung: Callable[[], None], saving: Callable[[], bool]) -> None:
        """Once the worker is built: ``dinfo`` (its rank and world), ``step_seconds()`` (the last
        step's time, None before the first), ``on_signal()`` (called at the signal, from the signal
        handler or the watcher thread: it must not block), ``on_hung()`` (before the watchdog's exit:
        let an async save under way commit, bounded) and ``saving()`` (a save after a failure is under
        way: the watchdog leaves it to the grace timer)."""
        self._dinfo, self._step_seconds, self._on_signal = dinfo, step_seconds, on_signal
        self._on_hung, self._saving = on_hung, saving

    @property
    def signalled(self) -> bool:
        """Whether this rank got SIGTERM."""
        return self.signum is not None

    def stop_reason(self, *, peer_signalled: bool) -> str:
        """Why training stops at this agreement: this rank's signal (``"signal SIGTERM"``), else
        ``PEER_STOPPED`` when another rank got one (``peer_signalled``: save with it, then go on
        without it), else ``"max-seconds"``."""
        if self.signum is not None:
            return f"signal {signal.Signals(self.signum).name}"
        return PEER_STOPPED if peer_signalled else "max-seconds"

    def _on_sigterm(self, signum: int, frame: Any = None) -> None:
        """SIGTERM, from the Python handler (main thread) or the ``SignalWatcher`` (at delivery)."""
        with self._lock:
            if self.signum is not None:
                return
            self.signum = signum
        logger.warning("rank %d got %s: saving at the next step boundary, exiting within %.0fs",
                       self._dinfo.rank, signal.Signals(signum).name, self.grace_seconds)
        self._on_signal()
        self._timers.append(runtime().start_timer("sigterm-grace", self.grace_seconds, self._grace_expired))
        step_s = self._step_seconds()
        if step_s is not None and self._dinfo.world_size > 1:
            # A healthy step ends within about one step time. If none ends soon after the signal,
            # the step is stuck in a collective with a peer that is gone (torchrun stops us to
            # re-rendezvous): no save is possible, so do not sit out the whole grace period.
            hung_after = max(2.0, 3 * step_s)
            self._timers.append(runtime().start_timer("sigterm-hung-step", hung_after, self._exit_if_hung,
                                                      self.boundaries, hung_after))

    def _exit_if_hung(self, boundaries_at_signal: int, waited: float) -> None:
        if self.boundaries != boundaries_at_signal or self._saving():
            return
        logger.error("rank %d: the step in progress has not ended %.1fs after the signal (steps take %.2fs): "
                     "a peer is gone; exiting without a save (the newest checkpoint stays)",
                     self._dinfo.rank, waited, self._step_seconds() or 0.0)
        self._on_hung()
        runtime().exit(EXIT_PREEMPTED)

    def _grace_expired(self) -> None:
        logger.error("rank %d: grace period of %.0fs over before the step boundary save finished; exiting now",
                     self._dinfo.rank, self.grace_seconds)
        runtime().exit(EXIT_PREEMPTED)

    def disarm(self) -> None:
        """Training ended normally (saved, closed): cancel the grace and hung-step timers."""
        for timer in self._timers:
            timer.cancel()

    def close(self) -> None:
        """Stop and join the watcher thread and restore the previous SIGTERM handler. The timers
        stay armed (``disarm``): after an error the grace period still bounds the exit."""
        self._watcher.close()
        signal.signal(signal.SIGTERM, self._old_handler)
