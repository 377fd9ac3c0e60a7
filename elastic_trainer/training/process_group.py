"""A worker's default process group: joining it, leaving it, and telling its failures apart.

The Manager (``training/manager.py``) owns the group; these are the steps it is made of, each
usable on its own (the trainer and the tests call some of them directly):

- **join**: in plain mode the group torchrun's environment describes (``init_from_env``); under
  live recovery the Manager builds it on the quorum's store, with NCCL asked to raise its errors
  instead of ending the process (``nccl_error_handling``) and DDP's first construction's imports
  paid before the worker asks to be admitted (``warm_up_ddp``), not while the quorum waits for it;
- **leave**: abort and destroy the group (``leave_process_group``), sparing the etcd connections
  the live group needs (``etcd_addresses``) when its collectives are abandoned;
- **tell a failure**: a collective that failed because a peer died or its group was torn down
  (``collective_failed``) is recovered by a re-form, every other error propagates
  (``run_or_failed_collective``); after such a failure only the CPU's state is the last completed
  step's (``host_step_is_device_state``);
- **drills**: a training thread that hangs on a signal while the process stays healthy
  (``install_debug_hang``), the fault that only the lack of progress can reveal.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from elastic_trainer.env import ENV_DEBUG_HANG, ENV_DEBUG_SLOW, ENV_NCCL_ERROR_HANDLING, NCCL_CLEAN_UP_ONLY, WorkerEnv
from elastic_trainer.live.group import LiveGroup

logger = logging.getLogger(__name__)
T = TypeVar("T")


# ---- telling a failed collective from other errors -------------------------------------------------
def collective_failed(exc: BaseException) -> bool:
    """A collective with a peer failed (the peer died, or its group was torn down), on any backend:
    torch raises ``DistError`` subclasses (``DistBackendError`` for NCCL's errors and timeouts), and
    plain ``RuntimeError``s whose text names the backend (gloo, NCCL) or the connection."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(k in text for k in ("gloo", "nccl", "connection", "peer"))


def run_or_failed_collective(step: Callable[[], T], recover: bool) -> tuple[T | None, str | None]:
    """``(step(), None)``, or ``(None, cause)`` when ``recover`` and a collective failed in it.

    The failure is returned, not handled inside the ``except`` block, so that the re-form runs
    with the failed step's frames (its traceback) released: while anything refers to the broken
    process group its gloo connections stay open (checked: a peer blocked on this process then
    waits until it exits), and a survivor blocked on this one, not on the dead peer, would report
    late and be left out of the next quorum."""
    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001 - only a failed collective is recovered; the rest re-raises
        if not recover or not collective_failed(exc):
            raise
        return None, f"a collective failed ({type(exc).__name__})"


def host_step_is_device_state(device: torch.device) -> bool:
    """Whether, when a collective fails, the model and optimizer on ``device`` are those of the last
    step the host completed (so rank 0 may save them without its peers).

    On the CPU (gloo) a collective returns only once it is done, so a failure stops the host before
    the optimizer step. On CUDA (NCCL) ``work.wait()`` only makes the compute stream wait: the host
    queues the optimizer step, and further steps, behind an all-reduce that may never finish, and
    when the group is aborted (watchdog, ``--collective-timeout``) those kernels run on a partial
    result. The host's step then says nothing about the state on the GPU: no save after a failure."""
    return device.type != "cuda"


# ---- the process group ----------------------------------------------------------------------------
def leave_process_group(start_thread: Callable[..., object] | None = None) -> None:
    """Abort (NCCL: tear the communicators down, unblocking queued work) and destroy the default group.

    What still refers to the group keeps its connections open after ``destroy_process_group``
    (peers blocked on this process then wait until it exits): the caller drops DDP first. (No
    ``gc.collect()`` here: under load it took 0.3-0.4 s of every re-form, and the group goes by
    reference counting once DDP and the failed step's frames are gone.)

    ``start_thread`` (the worker runtime's): the group's last reference is dropped on a thread of
    its own. Whoever drops it runs the backend's destructor, and gloo's takes 20 ms every time
    (its connections' event loops wake every 10 ms to see that they must end; measured with
    torch 2.13, two ranks on loopback: ``destroy_process_group`` 0.0202 s with the group
    referenced nowhere else, 0.0000 s while a reference remains). The destructor releases the GIL,
    so the re-form goes on meanwhile (the next group is a new object; the old one's sockets are
    already shut or closed by the peers)."""
    if not dist.is_initialized():
        return
    old = [dist.group.WORLD]  # the only reference once destroyed: a thread drops it
    try:
        old[0].abort()
    except Exception as exc:  # noqa: BLE001 - gloo has little to abort; destroy below frees it
        logger.debug("abort of the process group: %s", exc)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may fail to destroy cleanly
        logger.info("destroying the broken process group: %s", exc)
    if start_thread is not None:
        start_thread("drop-old-group", old.clear)


def drop_group(box: list, start_thread: Callable[..., object]) -> None:
    """Destroy the process groups ``box`` holds (groups that are not the default: those a switch
    replaced, or those formed ahead and not used) and drop them, all on a thread of its own (the
    shutdown of a gloo group and its destructor take milliseconds; ``leave_process_group``): ``box``
    must hold the only references to them, so that their destructors run there, not on the caller's."""
    start_thread("drop-old-group", _destroy, box)


def _destroy(box: list) -> None:
    for group in box:
        if group is None:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - gone already (the default group's destruction took it along)
            logger.debug("destroying a process group: %s", exc)
    box.clear()


def etcd_addresses(group: LiveGroup | None) -> list[tuple[str, int]]:
    """The (address, port) pairs of the live group's etcd endpoints: connections the group's
    abandonment must leave alone."""
    if group is None:
        return []
    out = []
    for host, port in group.etcd.options.endpoints:
        try:
            out += [(info[4][0], int(port)) for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)]
        except OSError:
            out.append((host, int(port)))
    return out


def install_debug_hang(env: WorkerEnv) -> None:
    """Drills and tests: with ``ELASTIC_TRAINER_DEBUG_HANG=1`` a SIGUSR2 makes the training thread
    stop making progress for good (a sleep loop in the signal handler, which runs on the main
    thread), while the process and its other threads (lease, watcher) stay healthy: a hang that
    only the lack of progress can reveal."""
    if env.debug_hang != "1" or threading.current_thread() is not threading.main_thread():
        return

    def hang(signum, frame) -> None:
        logger.warning("live: SIGUSR2 with %s=1: the training thread hangs now (a drill)", ENV_DEBUG_HANG)
        while True:
            time.sleep(1.0)

    signal.signal(signal.SIGUSR2, hang)


class DebugSlow:
    """Drills: with ``ELASTIC_TRAINER_DEBUG_SLOW=FACTOR`` each SIGUSR1 turns this worker FACTOR times
    slower, or back: every step then pauses ``(FACTOR - 1) x`` its own step time of the moment it
    turned slow (``base()``), as this rank's own work, where a throttled GPU or a slow loader spends
    it (a pause that grew with the slowed steps would grow without end). The drill's ``slow`` fault."""

    def __init__(self, factor: float, base: Callable[[], float | None]) -> None:
        self.factor, self.base = factor, base
        self.wanted = False  # flipped by the signal handler (nothing else there: no lock, no logging)
        self.extra = 0.0

    def toggle(self, signum=None, frame=None) -> None:
        self.wanted = not self.wanted

    def pause(self) -> None:
        """Before each step (``Manager.step``): the pause, if this worker is slow now."""
        if self.wanted and self.extra == 0.0:
            self.extra = (self.factor - 1.0) * (self.base() or 0.05)
            logger.warning("live: SIGUSR1 with %s=%g: this worker pauses %.3fs a step from now (a drill)",
                           ENV_DEBUG_SLOW, self.factor, self.extra)
        elif not self.wanted and self.extra > 0.0:
            self.extra = 0.0
            logger.warning("live: SIGUSR1 with %s: this worker runs at its own speed again (a drill)", ENV_DEBUG_SLOW)
        if self.extra > 0.0:
            time.sleep(self.extra)


def install_debug_slow(env: WorkerEnv, base: Callable[[], float | None]) -> DebugSlow | None:
    """``DebugSlow`` on SIGUSR1 when ``ELASTIC_TRAINER_DEBUG_SLOW`` gives a factor above 1 (from the
    main thread only); None otherwise."""
    try:
        factor = float(env.debug_slow) if env.debug_slow else 0.0
    except ValueError:
        factor = 0.0
    if factor <= 1.0 or threading.current_thread() is not threading.main_thread():
        return None
    slow = DebugSlow(factor, base)
    signal.signal(signal.SIGUSR1, slow.toggle)
    return slow


def nccl_error_handling() -> str:
    """Ask NCCL process groups made from now on to abort their communicators on an error or a
    timeout and raise it, instead of ending the process (``NCCL_CLEAN_UP_ONLY``); a value the user
    set is kept, with a warning when it ends the process. Returns the value in force."""
    value = os.environ.setdefault(ENV_NCCL_ERROR_HANDLING, NCCL_CLEAN_UP_ONLY)
    if value != NCCL_CLEAN_UP_ONLY:
        logger.warning("live: %s=%s ends a worker on an NCCL error or timeout, so live recovery falls back to "
                       "restarting it; unset it (or set %s) to keep the process", ENV_NCCL_ERROR_HANDLING, value,
                       NCCL_CLEAN_UP_ONLY)
    return value


def init_from_env(env: WorkerEnv, device: torch.device, timeout: float) -> bool:
    """Plain mode: join the default group that torchrun's environment describes (gloo on CPU, NCCL
    on GPU, bound to ``device`` so that its communicators are made now). False when not launched."""
    if not env.launched:
        return False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **extra)
    return True


def warm_up_ddp() -> None:
    """Import what DDP's first construction imports (``torch._dynamo``: ~800 modules, 1.2-1.6 s
    here; a construction after it takes 8 ms), which a newcomer must not spend while the others
    wait for it: before it asks to be admitted. (Not beside its admission on a thread: where the
    members stop for a join, an ``--fsdp`` one, they would wait for the rest of it; measured, a
    2.2 s re-form instead of 0.3 s.) Only imports: it makes no process group."""
    importlib.import_module("torch._dynamo")


__all__ = ["DebugSlow", "collective_failed", "drop_group", "etcd_addresses", "host_step_is_device_state", "init_from_env", "install_debug_hang", "install_debug_slow",
           "leave_process_group", "nccl_error_handling", "run_or_failed_collective", "warm_up_ddp"]
