"""The built-in trainer's workers start with torch imported: forked from a server that imported it
while the launcher started.

A worker started as a new interpreter (``python -m elastic_trainer.train``) first imports, one after
the other and after its launcher paid for torch itself: torch (1.3-1.6 s on the 2 cores of our
benchmarks), ``torch._dynamo`` (1.2-1.5 s: DDP's construction and the optimizers import it), our
trainer (0.25 s). A node that joins a running job waits for all of it. So ``elastic-train`` starts
multiprocessing's fork server first thing (:func:`start_server`, before its own flags import torch),
the server imports :data:`MODULES` while the launcher parses, checks the node and meets the others,
and torch's agent forks each worker from it: torch's own way for a function entrypoint
(``elastic_launch`` with :func:`train_worker` and ``start_method="forkserver"``). docs/trainer.md
("A node added") has the measured effect.

What a forked worker does itself, because it did not start from its agent as a new process
(:func:`train_worker`):

1. **its environment**: the server's is the launcher's at its start, without the secrets
   (:func:`start_server` leaves them out; the launcher moves them to files later, ``cli/secrets.py``).
   The agent's environment at the moment it starts the worker (the rendezvous's exports, the run's
   folders, the handed-over secret files, ...) travels with the worker's arguments
   (:class:`AgentEnviron`, taken when torch's agent pickles the worker for the server) and replaces
   it; torch's own variables for the worker (``RANK``, ...) go on top, as they do for a subprocess;
2. **torch's threads**: torch read ``OMP_NUM_THREADS`` in the server; ``torch.set_num_threads``
   applies the worker's. The server runs no torch operation, it imports only: a process forked after
   an OpenMP parallel region hangs at its own first one (libgomp), and one forked after CUDA's
   initialization (a device count is enough) cannot use CUDA. tests/test_preload.py checks that the
   imports ask CUDA nothing and that a worker computes with several threads; on a GPU, tests/test_gpu.py
   runs the trainer's workers so (not run on this machine, which has none);
3. **a session of its own** (``os.setsid``), as torch gives a worker it starts as a subprocess: a
   terminal's Ctrl-C reaches the agent, which ends its workers, not each worker at once; and a new
   interpreter's default start method for its own processes (multiprocessing makes the fork
   server's the default of what it forks: DataLoader workers would come from a fork server of the
   worker's own, which outlives a killed worker);
4. **its agent**: the worker's parent is the server, so the launcher names the agent in
   ``ENV_AGENT_PID`` (``runtime.stop_node`` signals it). The worker dies with its parent
   (``runtime.die_with_parent``), and the server with the launcher: multiprocessing would end it when
   its pipe from the launcher closes, but every forked worker holds a copy of that pipe, so a killed
   launcher would leave server and workers running. The server imports this module first, and when
   the launcher's pid is in its environment (``ENV_FORK_SERVER_PARENT``, :func:`start_server` puts it
   there) it asks Linux to SIGKILL it when the launcher dies (:func:`_die_with_the_launcher`);
5. **its end**, torch's contract for a function: a run that ended well returns 0 (torch's agent
   waits for the return value; the forked process then ends by ``os._exit``, without the interpreter's
   teardown, as ``runtime.exit_without_teardown`` ends the other workers); any other status ends the
   process at once with that status (``exit_without_teardown``), which the agent reads as a failure.

A user's script still runs in a new interpreter (``elastic_trainer.script``): its ``__main__`` is its own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from elastic_trainer.env import (ENV_FORK_SERVER_PARENT, ENV_OMP_NUM_THREADS, EXIT_ERROR, TORCH_WORKER_ENV,
                                 TORCH_WORKER_ENV_PREFIX)
from elastic_trainer.runtime import die_with_parent, runtime

MODULES = ("elastic_trainer.preload", "torch", "torch._dynamo", "elastic_trainer.train",
           "elastic_trainer.training.trainer", "elastic_trainer.checkpoint.sharded", "elastic_trainer.training.rng",
           "torch.distributed.algorithms.ddp_comm_hooks")
"""What the fork server imports before it forks a worker: this module first (the server then dies with
the launcher: point 4), torch, what DDP's construction imports (``torch._dynamo``, ~all of its first
cost), the trainer, and what the trainer imports only on its way to its first step (a live newcomer
does that while the members wait for its first gradients: restoring a peer's state, timing its
steps through a DDP hook; ~7 ms). Never a module that reads the
environment the launcher completes later when it is imported (prometheus_client reads
``PROMETHEUS_MULTIPROC_DIR`` so): tests/test_preload.py checks."""


def start_server(environ: Mapping[str, str]) -> str | None:
    """Start multiprocessing's fork server now, importing :data:`MODULES`, with ``environ`` as its
    environment (the launcher's without its secrets). Returns at once: the server imports while the
    launcher goes on, and a worker asked for before it is done waits for it. Call it before any
    thread starts (the environment is swapped for the moment the server starts).

    None once it started; else why it could not (its socket's path under ``TMPDIR`` longer than a Unix
    socket's 107 bytes, say): the workers then start as new interpreters, slower to start."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(list(MODULES))
    # The server inherits this process's environment (multiprocessing takes no other): it is the
    # given one for the moment of its start, so that no secret is in any forked worker's initial
    # environment (/proc/PID/environ shows that one, whatever the worker sets later).
    kept = dict(os.environ)
    os.environ.clear()
    os.environ.update({**environ, ENV_FORK_SERVER_PARENT: str(os.getpid())})
    try:
        forkserver.ensure_running()
        return None
    except OSError as exc:
        return str(exc)
    finally:
        os.environ.clear()
        os.environ.update(kept)


class AgentEnviron:
    """The agent's environment, taken when a worker is started: when torch's agent pickles the
    worker's arguments to send them to the fork server (after the rendezvous wrote the round's
    variables), not when ``elastic_launch`` is called."""

    def __init__(self) -> None:
        self.environ: dict[str, str] = {}

    def __getstate__(self) -> dict[str, str]:
        return dict(os.environ)

    def __setstate__(self, state: dict[str, str]) -> None:
        self.environ = state


def train_worker(agent: AgentEnviron, *argv: str) -> int:
    """The built-in trainer in a worker forked from the fork server (the module docstring's 1-5):
    ``elastic_trainer.train.main(argv)``; 0, or the process ends with the status."""
    import multiprocessing

    import torch

    from elastic_trainer import train
    from elastic_trainer.runtime import exit_without_teardown

    # torch's variables for this worker (RANK, LOCAL_RANK, ...: LocalElasticAgent._start_workers),
    # which torch's _wrap wrote over the server's environment, on top of the agent's.
    given = {k: v for k, v in os.environ.items() if k in TORCH_WORKER_ENV or k.startswith(TORCH_WORKER_ENV_PREFIX)}
    os.environ.clear()
    os.environ.update({**agent.environ, **given})
    os.setsid()
    # multiprocessing set the fork server's start method as this process's default: a new interpreter's
    # default again, so that its DataLoader workers start as they would (forked from it, a fork of a
    # killed worker ending with it) and not from a fork server of its own that would outlive it.
    multiprocessing.set_start_method(None, force=True)
    if "numpy.random" in sys.modules:  # seeded once in the server, so alike in every worker: fresh entropy,
        sys.modules["numpy.random"].seed()  # as a new interpreter has (Python's random reseeds itself at a fork)
    threads = os.environ.get(ENV_OMP_NUM_THREADS, "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.argv = [train.__file__, *argv]
    code = train.main(list(argv))
    if code != 0:
        exit_without_teardown(code)
    return 0


def _die_with_the_launcher() -> None:
    """In the fork server (the launcher's pid in ``ENV_FORK_SERVER_PARENT``), when it imports this
    module: SIGKILL it when the launcher dies, or end it now if the launcher is gone already."""
    launcher = os.environ.get(ENV_FORK_SERVER_PARENT)
    if launcher is None:
        return
    die_with_parent()
    if str(os.getppid()) != launcher:
        runtime().exit(EXIT_ERROR, "the launcher that started this fork server is gone", run_hooks=False)


_die_with_the_launcher()
