"""The one thread on which a checkpoint manager does its background save work, kept between saves.

Every save's background part runs here, one at a time: a full-state save's copy beside training,
serialization, upload, fence, commit and retention (``writer.py``), and a sharded save's DCP
writing, hashing and commit (``sharded.py``, through ``CheckpointManager.run_in_background``).

Why one kept thread, and not one per save: ``Thread.start`` waits until the new thread runs, and
that thread then holds the GIL; on a 2-core machine with four ranks that cost the training
thread ~5-10 ms per save, while handing work to a waiting thread costs a queue put.

Priority: the thread lowers its own CPU priority once, when it starts (nice +10, this thread
only; not Linux or not allowed: it stays at normal priority), and keeps it for its whole life: it
only ever does save work, which should never take the CPU from the training thread. An
unprivileged thread cannot raise its priority back, which is why nothing here tries. The copy
beside training (``snapshot.DeferredCopy``) runs at that priority too: the next optimizer step,
if it comes before the copy is done, waits for it, and while it waits the training thread leaves
the CPU to the copy.

Ownership: the manager that makes a ``SaveThread`` starts it (on the first ``submit``, through
``runtime().start_thread``, which also stops it at the worker's exit), waits for its work
(``wait``) and stops and joins it (``stop``, from ``CheckpointManager.close``); a later ``submit``
starts a new thread.

    thread = SaveThread("checkpoint-save")
    thread.submit(lambda: write(step, snapshot))   # after wait(): one job in flight
    thread.wait()
    thread.stop()
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable

from elastic_trainer.runtime import runtime

log = logging.getLogger(__name__)

NICE = 10
"""How much lower than the process's the save thread's CPU priority is (``os.setpriority``)."""


class SaveThread:
    """A kept daemon thread that runs submitted work one job at a time (see the module docstring)."""

    def __init__(self, name: str = "checkpoint-save") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._done: threading.Event | None = None

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` next (the caller waited for the previous job); ``work`` reports its own
        failures (one that raises is logged, and the thread goes on)."""
        done = threading.Event()
        self._done = done
        if self._thread is None:
            jobs = self._jobs
            self._thread = runtime().start_thread(self.name, self._run, jobs, stop=lambda: jobs.put(None))
        self._jobs.put((work, done))

    def busy(self) -> bool:
        """Whether a submitted job is not done yet."""
        done = self._done
        return done is not None and not done.is_set()

    def wait(self) -> None:
        """Until the submitted job is done (at once when called from that job itself)."""
        done = self._done
        if done is not None and threading.current_thread() is not self._thread:
            done.wait()
            self._done = None

    def stop(self) -> None:
        """Wait for the job in flight, then end the thread and join it."""
        self.wait()
        thread = self._thread
        if thread is None:
            return
        self._jobs.put(None)
        self._thread = None
        self._jobs = queue.SimpleQueue()
        if thread is not threading.current_thread():
            thread.join()

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + NICE)
        except (OSError, AttributeError):  # not Linux, or not allowed: run at normal priority
            pass
        while (job := jobs.get()) is not None:
            work, done = job
            try:
                work()
            except BaseException:  # noqa: BLE001 - the work reports its own failures; the thread stays
                log.exception("a background checkpoint save failed")
            finally:
                done.set()


__all__ = ["NICE", "SaveThread"]
