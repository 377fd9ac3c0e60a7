"""The worker runtime: the one object in a process that owns its background threads, and the one
place that ends a worker.

Every thread our code starts (the live quorum's watchers and probe, the SIGTERM watcher, grace and
hang timers, the checkpoint save thread and host-buffer maker, the status publisher, W&B's bounded
finish, an etcd lease's renewal loop and watchdog, the etcd client's keep-alive stream reader) is
started through ``runtime().start_thread`` or ``runtime().start_timer``: the runtime knows its name,
how to ask it to stop, and joins it at ``close()``. No other module makes a thread
(``tests/test_architecture.py`` checks it; docs/architecture.md's thread tables name each one).

The runtime is per process, and the agent (``elastic-train``, torch's elastic agent with our
rendezvous handler) has one too: the threads our code starts there (a lease's renewal loop and
watchdog, the keep-alive stream reader) go through it like a worker's. The agent never calls
``close()`` or ``exit()``: its threads stop with their owners (the handler's shutdown closes its
lease), and it ends when ``elastic-train``'s ``main`` returns. A worker calls ``close()`` at the end
of ``train.main``, after every owner closed its own.

A forced exit of a worker (a lost lease, a grace period over, a hung step after a signal) goes
through ``runtime().exit``: it runs the registered ``before_exit`` hooks (bounded: a W&B flush,
say), flushes stdout and stderr, shuts logging down and calls ``os._exit``, which appears in no
other module. The exit codes are ``elastic_trainer.env``'s. A worker that must end its whole node (it
cannot run as launched, or the crash-loop policy says so) calls ``stop_node``: the reason goes to the
launcher's refusal file, the agent gets SIGTERM, and the launcher exits with the code given.
A library object never ends the process itself: what must end a worker with a particular code (a
live worker left out of the quorum, a spare the run never needed) is raised, and
``exit_on_uncaught`` maps it to its code once it leaves the program uncaught (``sys.excepthook``:
after the program's own ``finally`` blocks ran).

Why ``os._exit`` and not ``sys.exit``: a worker whose run succeeded can abort in the interpreter's
teardown ("terminate called without an active exception", SIGABRT, which torchrun reports as a
failed job), and a forced exit from a timer thread must not wait for a main thread blocked in a
collective. The abort, from a core dump (torch 2.13, gloo): a gloo group's worker thread
(``ProcessGroupGloo::runLoop``) drops its reference to a collective that finished (an all-gather)
a moment after the caller's ``wait()`` returned; when that reference is the last, the collective's
tensors go with it, and a tensor whose Python object is owned from C++ takes the GIL to release
it. If the main thread began the interpreter's finalization meanwhile, taking the GIL ends that
thread (``PyThread_exit_thread``), the unwind meets a ``noexcept`` destructor, and C++ calls
``std::terminate``. A loaded machine makes the window wide (one run in 6 of ``tests/helpers/hsdp_heal.py``
beside another job on 2 cores). ``dist.destroy_process_group`` does not close it (the model still
refers to the group, whose thread goes on). So a worker's program ends through
``exit_without_teardown``: the built-in trainer (``train.py``) and a user's script
(``script.py``: after its ``atexit`` callbacks ran).

Usage::

    from elastic_trainer.runtime import runtime

    rt = runtime()
    rt.start_thread("live-watch", watch, stop=stop_event.set)
    rt.before_exit(lambda: wandb.finish_within(143, 3.0))
    ...
    rt.close()                 # stops and joins what is still running
    rt.exit(EXIT_EXCLUDED, "this worker's lease expired")   # never returns
    rt.exit_on_uncaught(LiveExcluded, EXIT_EXCLUDED)        # when it leaves the program uncaught
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from elastic_trainer.env import ENV_AGENT_PID, ENV_REFUSAL_FILE, EXIT_ERROR, EXIT_USAGE

logger = logging.getLogger(__name__)


@dataclass
class _Owned:
    thread: threading.Thread
    stop: Callable[[], None] | None


class WorkerRuntime:
    """Owns a process's background threads and timers (a worker's or the agent's), and a worker's exit (see the
    module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owned: list[_Owned] = []
        self._hooks: list[Callable[[], None]] = []
        self._exiting = False
        self._exit_codes: dict[type[BaseException], int] = {}
        self._node_stops: set[type[BaseException]] = set()  # kinds that stop the whole node (stop_node)
        self._previous_hook: Callable[..., object] | None = None

    # ---- threads ---------------------------------------------------------------------------------
    def start_thread(self, name: str, target: Callable[..., object], *args: object,
                     stop: Callable[[], None] | None = None, daemon: bool = True) -> threading.Thread:
        """Start ``target(*args)`` on a thread named ``name``; ``stop`` asks it to end (``close()``
        calls it, then joins). Daemon by default: a forced exit never waits for it."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
        with self._lock:
            self._owned = [o for o in self._owned if o.thread.is_alive() or not o.thread.ident]
            self._owned.append(_Owned(thread, stop))
        thread.start()
        return thread

    def start_timer(self, name: str, seconds: float, fn: Callable[..., object], *args: object) -> threading.Timer:
        """Call ``fn(*args)`` after ``seconds`` on a timer thread this runtime owns (cancelled at ``close()``)."""
        timer = threading.Timer(seconds, fn, args=args)
        timer.name, timer.daemon = name, True
        with self._lock:
            self._owned.append(_Owned(timer, timer.cancel))
        timer.start()
        return timer

    def threads(self) -> list[str]:
        """Names of the owned threads still running (for tests and diagnostics)."""
        with self._lock:
            return [o.thread.name for o in self._owned if o.thread.is_alive()]

    def close(self, timeout: float = 2.0) -> None:
        """Ask every owned thread to stop and join it (``timeout`` seconds each at most; the
        current thread is not joined)."""
        with self._lock:
            owned, self._owned = self._owned, []
        for o in owned:
            if o.stop is not None:
                try:
                    o.stop()
                except Exception as exc:  # noqa: BLE001 - one thread's stop must not keep the others running
                    logger.warning("runtime: stopping thread %s failed: %s", o.thread.name, exc)
        for o in owned:
            if o.thread is not threading.current_thread() and o.thread.ident is not None:
                o.thread.join(timeout)
                if o.thread.is_alive():
                    logger.info("runtime: thread %s did not end within %.1fs", o.thread.name, timeout)

    # ---- the exit --------------------------------------------------------------------------------
    def before_exit(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run ``hook`` before a forced ``exit`` (it must bound its own time). Returns a function
        that unregisters it."""
        with self._lock:
            self._hooks.append(hook)

        def remove() -> None:
            with self._lock:
                if hook in self._hooks:
                    self._hooks.remove(hook)

        return remove

    def exit_on_uncaught(self, kind: type[BaseException], code: int, *, node: bool = False) -> None:
        """An exception of ``kind`` that leaves the main thread uncaught ends the process with
        ``code`` (one line, no traceback), after every ``finally`` and ``with`` block of the
        program has run: ``sys.excepthook`` is where Python reports it. So a library call may
        raise what must end a worker in a particular way (a live worker left out of the quorum:
        its agent must start a newcomer) and still never end the process itself. ``node``: it
        stops the whole node (``stop_node``: an evicted straggler's launcher holds it out). The most
        specific kind registered wins. Other exceptions go to the hook that was there before."""
        with self._lock:
            self._exit_codes[kind] = code
            if node:
                self._node_stops.add(kind)
            if self._previous_hook is None:
                self._previous_hook = sys.excepthook
                sys.excepthook = self._excepthook

    def exit_code_for(self, exc: BaseException) -> int | None:
        """The code an uncaught ``exc`` ends the process with (``exit_on_uncaught``), None: none set."""
        registered = self._registered(type(exc))
        return None if registered is None else registered[1]

    def _registered(self, kind: type[BaseException]) -> tuple[type[BaseException], int] | None:
        with self._lock:
            return next(((k, self._exit_codes[k]) for k in kind.__mro__ if k in self._exit_codes), None)

    def _excepthook(self, kind: type[BaseException], exc: BaseException, tb: object) -> None:
        registered = self._registered(kind)
        if registered is None:
            assert self._previous_hook is not None
            self._previous_hook(kind, exc, tb)
            return
        if registered[0] in self._node_stops:
            stop_node(str(exc), registered[1])
        self.exit(registered[1], f"{kind.__name__}: {exc}")

    def exit(self, code: int, reason: str = "", *, run_hooks: bool = True) -> NoReturn:
        """End this process now with ``code``: hooks, flushed output, ``os._exit``. From any thread."""
        with self._lock:
            first = not self._exiting
            self._exiting = True
            hooks = list(self._hooks) if first and run_hooks else []
        if reason:
            logger.log(logging.INFO if code == 0 else logging.ERROR, "exiting %d: %s", code, reason)
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - the process ends anyway; say why a hook failed
                logger.warning("runtime: a before-exit hook failed: %s", exc)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        logging.shutdown()
        os._exit(code)


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies: the torchrun agent, or for the built-in
    trainer the fork server it was forked from (``preload.py``), which ends when the agent does.

    A worker runs in a session of its own (torch's agent starts a subprocess so; a forked one calls
    ``setsid``), so killing a node's agent (its process group) would leave the worker running, and
    blocking its peers in a collective."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before prctl took effect
        runtime().exit(EXIT_ERROR, "the agent that started this worker is gone", run_hooks=False)


def process_age() -> float | None:
    """Seconds since this process started (a forked worker: since its fork), to 1/100 s, from Linux's
    ``/proc/self/stat`` and ``/proc/uptime`` (no psutil for one number); None where they are not.
    A live newcomer logs it when it asks to be admitted: what its start cost before it (the fork
    server's imports it waited for) and after (its own build)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            after_name = f.read().rsplit(b")", 1)[1].split()  # the name may hold spaces and parentheses
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start, in ticks
    except (OSError, ValueError, IndexError):
        return None


_RUNTIME: WorkerRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> WorkerRuntime:
    """This process's one ``WorkerRuntime`` (made on first use)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = WorkerRuntime()
        return _RUNTIME


def exit_status(code: object) -> int:
    """The status a process ends with after ``sys.exit(code)``: None 0, an int itself, anything
    else (which Python prints) 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def exit_without_teardown(code: int) -> NoReturn:
    """End this worker now with ``code``, after flushing its output and logs, skipping the
    interpreter's teardown (where gloo can abort a run that succeeded: the module docstring says how).

    Call it when everything is closed (saved, logs closed, the group left): what the teardown would
    still do is free what torch holds, which the process's end frees as well."""
    runtime().exit(code, run_hooks=False)


def stop_node(reason: str, exit_code: int = EXIT_USAGE) -> NoReturn:
    """End this worker and its node because it cannot run as launched: ``reason`` (one line) and the
    launcher's exit code (``EXIT_USAGE``, or ``EXIT_CRASH_LOOP`` from the crash-loop policy) go to the
    launcher's refusal file, written once per node (the first worker's), and that worker sends its
    agent (``ENV_AGENT_PID``) SIGTERM; without the launcher's file it is printed here. Never returns."""
    path = os.environ.get(ENV_REFUSAL_FILE)
    if not path:
        print(f"elastic_trainer: error: {reason}", file=sys.stderr, flush=True)
    else:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = None  # another worker of this node said it first, and stopped the node
        if fd is not None:
            with os.fdopen(fd, "w") as f:
                f.write(f"{reason}\n{exit_code}\n")
            os.kill(int(os.environ.get(ENV_AGENT_PID) or os.getppid()), signal.SIGTERM)
    runtime().exit(exit_code, run_hooks=False)


__all__ = ["WorkerRuntime", "die_with_parent", "runtime", "stop_node"]
