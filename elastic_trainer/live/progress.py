"""The training thread's progress, as the live quorum's watcher judges it: is this rank stalled?

A worker whose process and lease threads are healthy can still stop making progress: a deadlock,
an endless loop in user code, a CUDA kernel that never returns, a collective one rank never
enters. Its lease is renewed by a thread that knows nothing of that, so the lease cannot tell;
the step clock can. The ``Manager`` marks when its training thread enters and leaves a step
(``enter``/``leave``, around ``Manager.run`` and ``Manager.agree``); the quorum's watcher asks
``stalled()`` every poll. A rank is **stalled** when its current step has lasted longer than
the bound, ``max(hang_min, hang_factor x median step)`` over the last steps, and it is not
**busy**:

- in a slow phase its loop announced (``slow("checkpoint")``: a save, an evaluation), or
- warming up: in the first step after this process joined or after a re-form (a first step, a
  compile, a recompile for the new per-rank batch, DDP's bucket rebuild). That step is not a step
  time either; a bound needs one measured step.

A stalled rank is not the hung one (every rank that waits for the hung one is stalled at the
same step); the watcher then asks its peers whether one of them is busy, and if none is,
declares the stall in etcd: every rank abandons its collectives, the ranks that wait re-form,
and the one whose training thread does not move (``moves`` unchanged) within half a second is
the hung one: its watcher ends its process (``live/watcher.py``, ``Watcher``'s stuck check). NVIDIA's resiliency extension's in-process
restart works the same way (a progress timeout, then the ranks that cannot restart are ended);
its "soft timeout" is our bound and its monitor process our watcher thread.

Pure bookkeeping: no etcd, no torch; thread-safe (the training thread writes, the watcher reads).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator


class Progress:
    """The step clock of one worker's training thread (see the module docstring).

    ``hang_factor <= 0`` turns hang detection off (``stalled()`` is then always None)."""

    def __init__(self, hang_min: float = 2.0, hang_factor: float = 3.0, window: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hang_min, self.hang_factor = hang_min, hang_factor
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=window)
        self._depth = 0
        self._entered: float | None = None
        self._slow: list[tuple[str, float | None]] = []  # (what, until)
        self._slow_in_step = False
        self._warm = True  # the next step is the first since this process joined or re-formed
        self.moves = 0
        """Counts every call of the training thread into the Manager (enter, leave, slow, reform):
        a watcher that sees it unchanged for a while knows the thread did not move."""
        self.reforming = False
        self.forming_since: float | None = None
        """When the training thread began making its process group (``forming``), None outside it."""

    # ---- the training thread --------------------------------------------------------------------
    def enter(self) -> None:
        """The training thread starts a step (or a step-end agreement; nested calls count once)."""
        with self._lock:
            self.moves += 1
            self._depth += 1
            if self._depth == 1:
                self._entered = self._clock()
                self._slow_in_step = bool(self._slow)

    def leave(self, measured: bool = True) -> None:
        """The step ended (``measured``: count its time; a failed step's is not a step time)."""
        with self._lock:
            self.moves += 1
            self._depth = max(0, self._depth - 1)
            if self._depth == 0 and self._entered is not None:
                if measured and not self._slow_in_step and not self._warm:
                    self._steps.append(self._clock() - self._entered)
                if measured:
                    self._warm = False
                self._entered = None

    @contextlib.contextmanager
    def slow(self, what: str, limit: float | None = None) -> Iterator[None]:
        """A phase that may take much longer than a step (a checkpoint save, a compile): while in it
        (for at most ``limit`` seconds, when given) this rank is busy, and its peers do not take
        the wait for it as a hang."""
        entry = (what, None if limit is None else self._clock() + limit)
        with self._lock:
            self.moves += 1
            self._slow.append(entry)
            self._slow_in_step = self._slow_in_step or self._depth > 0
        try:
            yield
        finally:
            with self._lock:
                self.moves += 1
                self._slow.remove(entry)

    @contextlib.contextmanager
    def forming(self) -> Iterator[None]:
        """The training thread makes its process group (a join's, a re-form's): a formation that goes
        on after a member of its quorum was lost can only fail, and may not end by itself
        (``live/watcher.py``'s stuck check)."""
        with self._lock:
            self.moves += 1
            self.forming_since = self._clock()
        try:
            yield
        finally:
            with self._lock:
                self.moves += 1
                self.forming_since = None

    def reform_started(self) -> None:
        with self._lock:
            self.moves += 1
            self.reforming = True
            self._depth, self._entered = 0, None

    def reform_ended(self) -> None:
        with self._lock:
            self.moves += 1
            self.reforming = False
            self._warm = True

    # ---- the watcher ----------------------------------------------------------------------------
    def median_step(self) -> float | None:
        with self._lock:
            return statistics.median(self._steps) if self._steps else None

    def bound(self) -> float | None:
        """Seconds a step may last before this rank counts as stalled; None while warming up or off."""
        with self._lock:
            if self.hang_factor <= 0 or not self._steps:
                return None
            return max(self.hang_min, self.hang_factor * statistics.median(self._steps))

    def busy(self) -> str | None:
        """Why this rank may legitimately take long now (a slow phase, warming up), else None."""
        with self._lock:
            now = self._clock()
            within = [what for what, until in self._slow if until is None or now < until]
            if within:
                return within[-1]
            if self._entered is not None and self._warm:
                return "warm-up"
            return None

    def in_step(self) -> float | None:
        """Seconds the current step has lasted, None outside a step."""
        with self._lock:
            return None if self._entered is None else self._clock() - self._entered

    def stalled(self) -> float | None:
        """Seconds in the current step when that is past the bound and this rank is not busy."""
        bound, busy, lasted = self.bound(), self.busy(), self.in_step()
        if bound is None or busy is not None or lasted is None or lasted <= bound:
            return None
        return lasted


__all__ = ["Progress"]
