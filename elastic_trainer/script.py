"""The worker entry that torchrun runs for a user's script under ``elastic-train``.

    python -u -m elastic_trainer.script PROGRAM.py [ARGS...]      # what the launcher runs for `elastic-train PROGRAM.py ARGS`
    python -u -m elastic_trainer.script -m PKG.MODULE [ARGS...]   # for `elastic-train -m PKG.MODULE ARGS`

It runs the program as ``python -u PROGRAM.py ARGS`` would (as ``__main__``, with that ``sys.argv`` and
the script's folder first on ``sys.path``), after three things a plain ``python`` cannot do (the
third: when this node's workers failed again and again without progress, it stops the node instead
of running, and a failure of the program is left for the next attempt to judge:
``observability/crash_loop.py``), and it ends differently (4.):

1. **The worker dies with its agent.** torch's agent starts each worker in a session of its own,
   so a node killed with its process group (a crashed launcher, ``kill -9 -PGID``) would leave the
   worker training, for a whole lease in a world that has moved on. ``die_with_parent`` sets
   ``PR_SET_PDEATHSIG(SIGKILL)`` before anything else: Linux kills the worker the moment the thread
   that forked it ends. That thread is the agent's main thread (torch's ``LocalElasticAgent`` starts
   and restarts workers from its monitoring loop, ``SubprocessHandler``'s ``Popen``), which lives as
   long as the agent. The built-in trainer (``train.py``) and the Manager do the same.
2. **Under live recovery, ``env://`` is refused.** The etcd-v3 handler gives torch's agent a world
   of its own node (``handler.py``, ``_live_rendezvous``), so torchrun's environment here describes
   this node's workers only: ``RANK`` the local rank, ``WORLD_SIZE`` this node's worker count,
   ``GROUP_WORLD_SIZE`` 1, ``MASTER_ADDR``/``MASTER_PORT`` on this node. A plain
   ``init_process_group()`` (``env://``, also through ``init_device_mesh``) would form a group of
   this node alone and train apart from the others, silently. The Manager forms its group on a
   store in etcd (``init_process_group(store=...)``), never through ``env://``, so only a script
   that skips it gets there: it is stopped with one line naming the fix (use the Manager, or
   ``--recovery restart``), and its node with it (``runtime.stop_node``): the worker writes the line to
   the launcher's refusal file (``ENV_REFUSAL_FILE``) and sends its agent SIGTERM, and the
   launcher prints the line and exits 2. Exiting alone would make torch's agent restart the worker
   ``--max-restarts`` times. The other nodes of the run are not touched (a SIGTERM leaves the
   rendezvous open).
4. **It ends without the interpreter's teardown.** Once the program has ended as Python ends it
   (its non-daemon threads joined, its ``atexit`` callbacks run, an uncaught exception's traceback
   printed), the worker leaves with the program's exit status through
   ``runtime.exit_without_teardown``: in the teardown, a gloo group's thread that drops the last
   reference to a finished collective can abort a worker whose program succeeded (SIGABRT, a failed
   job for torchrun; ``runtime.py`` says how). What the teardown would still do is free memory and
   finalize objects left alive, which a program cannot count on at exit anyway (the Python docs
   on ``__del__``); a file left open unclosed is flushed by its finalizer there, so close your files
   (``with open(...)``) as you would for any program that may be killed.
"""

from __future__ import annotations

import atexit
import contextlib
import runpy
import signal
import sys
from pathlib import Path

from elastic_trainer.env import WorkerEnv
from elastic_trainer.observability import crash_loop
from elastic_trainer.runtime import die_with_parent, exit_status, exit_without_teardown, stop_node

USAGE = "usage: python -m elastic_trainer.script [-m MODULE | SCRIPT.py] [ARGS...]"


def refuse_env_rendezvous(program: str) -> None:
    """Under live recovery: make ``env://`` (``init_process_group``'s default) refuse, with the fix."""
    from elastic_trainer.torch_private import replace_rendezvous_handler

    def refused(url: str, rank: int = -1, world_size: int = -1, **kwargs):
        stop_node(f"{program} runs under live recovery but forms its process group with init_process_group's "
               f"env:// rendezvous, which under live recovery would hold this node's workers only and train apart "
               f"from the other nodes; use elastic_trainer.Manager for the group (examples/own_loop.py), or run it "
               f"with --recovery restart")
        yield  # never reached: stop_node() ends the process

    replace_rendezvous_handler("env", refused)


def main(argv: list[str] | None = None) -> None:
    """Run the program in ``argv`` (``[-m] PROGRAM ARGS...``) as ``__main__``, as the module docstring says."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module = argv[:1] == ["-m"]
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit(USAGE)
    die_with_parent()
    crash_loop.stop_a_crash_loop()
    program, args = argv[0], argv[1:]
    if WorkerEnv.from_environ().live is not None:
        refuse_env_rendezvous(("module " if module else "") + program)
    ended = ExitStatus()
    atexit.register(ended.exit)  # before the program's own callbacks, so it runs after them (last in, first out)
    with crash_loop.failures_marked(), ended.recording():
        if module:
            sys.argv = [program, *args]  # run_module puts the module's file in argv[0], as python -m does
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [program, *args]
            sys.path[0] = str(Path(program).resolve().parent)  # where `python PROGRAM` finds the script's own modules
            runpy.run_path(program, run_name="__main__")


class ExitStatus:
    """The exit status Python gives the program's end, and the exit with it at ``atexit`` time (4.)."""

    def __init__(self) -> None:
        self.code = 1  # a program that never returned (an exception no handler saw): Python's 1

    @contextlib.contextmanager
    def recording(self):
        """Record how the program ended, which goes on as it would have (Python prints and exits)."""
        try:
            yield
        except SystemExit as stop:
            self.code = exit_status(stop.code)
            raise
        except KeyboardInterrupt:
            self.code = 128 + signal.SIGINT  # Python ends by SIGINT, which a shell reports as 130
            raise
        else:
            self.code = 0

    def exit(self) -> None:
        exit_without_teardown(self.code)


if __name__ == "__main__":
    main()
