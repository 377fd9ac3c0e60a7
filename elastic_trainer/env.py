"""What the launcher, the agents and the workers tell each other through the environment, and
how a worker's process ends: every variable name and every exit code is defined here, once.

Names: the launcher (``elastic-train``) sets ``ENV_RDZV_ENDPOINT``, ``ENV_RUN_ID``,
``ENV_CHECKPOINT_DIR``, ``ENV_LOG_DIR`` for the trainer's flag defaults; the etcd-v3 handler
(``rendezvous/handler.py``) sets the ``ENV_RDZV_*`` of its round and, in live mode, ``ENV_LIVE``
(the live quorum's settings) in the agent's environment, which torchrun passes to the workers.

Every other variable we read or set is named here too: the knobs a person sets for one process
(``ENV_LOG_LEVEL``, ...) and other programs' variables (AWS's, W&B's, ``CUDA_VISIBLE_DEVICES``, ...);
tests/test_architecture.py fails on a variable name written anywhere else.

A worker reads what it is told through one typed object, ``WorkerEnv.from_environ()``: torchrun's
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``TORCHELASTIC_RESTART_COUNT``, the
handler's round, prefix, node and etcd connection, and the live settings (``LiveSettings``, one
JSON value under ``ENV_LIVE``); the handler writes through ``WorkerEnv(...).to_environ()``.
``LiveSettings``' field defaults are the only defaults of those settings (``rendezvous/options.py``
takes its own from them).

Exit codes of a worker (what its agent, torchrun, and the drills read):

======================  =====  ==========================================================
``EXIT_OK``             0      finished, stopped at ``--max-seconds``, or a spare not needed
``EXIT_ERROR``          1      an error (a traceback says which); torchrun restarts the worker
``EXIT_USAGE``          2      bad flags or a device the node cannot run: one line, no restart helps
``EXIT_PEER_STOPPED``   75     another node was preempted; step saved; restart into a new round
``EXIT_EXCLUDED``       76     left out of the live quorum; the agent restarts it as a newcomer
``EXIT_PREEMPTED``      143    128 + SIGTERM: this worker was stopped by a signal
======================  =====  ==========================================================

And of the launcher (``elastic-train``), besides 0, 1, 2 and 128 + a signal:

======================  =====  ==========================================================
``EXIT_CRASH_LOOP``     79     the crash-loop policy stopped this node: its workers failed again
                               and again without progress (``observability/crash_loop.py``);
                               restarting the pod will not help, its one line says why
======================  =====  ==========================================================
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TypeVar

T = TypeVar("T")

# ---- environment variables ------------------------------------------------------------------
ENV_RDZV_ENDPOINT = "ELASTIC_TRAINER_RDZV_ENDPOINT"
ENV_RUN_ID = "ELASTIC_TRAINER_RUN_ID"
ENV_CHECKPOINT_DIR = "ELASTIC_TRAINER_CHECKPOINT_DIR"
ENV_LOG_DIR = "ELASTIC_TRAINER_LOG_DIR"
ENV_RDZV_PREFIX = "ELASTIC_TRAINER_RDZV_PREFIX"
ENV_RDZV_ROUND = "ELASTIC_TRAINER_RDZV_ROUND"
"""Set by the etcd-v3 rendezvous handler in the agent after each round, inherited by workers."""
ENV_RDZV_NODE = "ELASTIC_TRAINER_RDZV_NODE"
ENV_RDZV_CONN = "ELASTIC_TRAINER_RDZV_CONN"
ENV_RDZV_PASSWORD = "ELASTIC_TRAINER_RDZV_PASSWORD"
ENV_RDZV_LEASE = "ELASTIC_TRAINER_RDZV_LEASE"
"""Set by the etcd-v3 handler in live mode: the id of the agent's etcd lease (the node's), to which
the workers attach their live keys instead of keeping leases of their own (``rendezvous/lease.py``)."""
ENV_LIVE = "ELASTIC_TRAINER_LIVE"
"""Set by the etcd-v3 handler in live mode: JSON of the live quorum's settings."""
ENV_WANDB_KEY_FILE = "ELASTIC_TRAINER_WANDB_KEY_FILE"
ENV_METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"
"""Set by ``elastic-train`` while it serves ``/metrics`` (``observability/metrics_server.py``): the
node's folder of Prometheus figures, inherited by its workers, which write theirs there
(``observability/metrics.py``) and never open a socket for them. The name is prometheus_client's own
(its multiprocess mode reads it when it is first imported); unset, recording is a no-op."""
ENV_PROGRESS_DIR = "ELASTIC_TRAINER_PROGRESS_DIR"
"""Set by ``elastic-train`` for its workers: a node-local folder where each attempt's workers leave
whether they completed a step and how they failed, so that the next attempt's workers know whether
this node is in a crash loop (``observability/crash_loop.py``)."""
ENV_REFUSAL_FILE = "ELASTIC_TRAINER_REFUSAL_FILE"
"""Set by ``elastic-train`` for a user's script: where a worker that cannot run as launched (a script
under live recovery that forms its process group without the Manager: ``script.py``) writes why, in
one line, before it stops its node (SIGTERM to its agent); the launcher then prints that line and
exits with ``EXIT_USAGE`` (or ``EXIT_CRASH_LOOP``, the code on the file's second line) instead of
restarting the worker."""
ENV_AGENT_PID = "ELASTIC_TRAINER_AGENT_PID"
"""Set by ``elastic-train`` for its workers: the pid of their torchrun agent (the launcher), which
a worker that stops its node signals (``runtime.stop_node``). A worker's parent is not always its
agent: the built-in trainer's are forked from a server that imported torch ahead (``preload.py``)."""
ENV_FORK_SERVER_PARENT = "ELASTIC_TRAINER_FORK_SERVER_PARENT"
"""Set by ``elastic-train`` in the environment of the fork server it starts (``preload.py``): its own
pid, so that the server, importing ``preload`` first, asks to die with it (its workers hold the pipe
by which multiprocessing would tell it that the launcher is gone)."""
ENV_STRAGGLERS = "ELASTIC_TRAINER_STRAGGLERS"
"""Set by ``elastic-train`` for its workers: the ``--straggler-*`` settings as JSON
(``observability/stragglers.StragglerConfig``), read by the Manager's ``StragglerWatch``."""
ENV_PROGRAM = "ELASTIC_TRAINER_PROGRAM"
"""Set by ``elastic-train`` in its agent's environment: JSON of what this node runs
(``rendezvous/program.py``'s ``Program``), which the etcd-v3 handler records in etcd and checks a
joining node against. Names and digests only, never a secret (secrets are refused on command lines)."""
ENV_ETCD_BINARY = "ELASTIC_TRAINER_ETCD_BINARY"
"""The etcd binary the embedded etcd runs (default: ``etcd`` on PATH); the launcher passes it to
the embedded etcd's keeper."""
ENV_DEBUG_HANG = "ELASTIC_TRAINER_DEBUG_HANG"
"""Drills and tests: ``1`` makes a live worker's training thread hang for good on SIGUSR2
(``training/manager.py``, ``install_debug_hang``), to prove the hang detection."""
ENV_DEBUG_SLOW = "ELASTIC_TRAINER_DEBUG_SLOW"
"""Drills (``elastic-train drill``'s ``slow`` fault): a factor; with it set, each SIGUSR1 turns a
worker FACTOR times slower than it was, or back (``training/process_group.py``, ``DebugSlow``), to
prove that a straggler is found and left out."""

# ---- helper processes ----------------------------------------------------------------------------
HELPER_ENV = ("PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "LANG", "LANGUAGE", "TZ",
              "GOMAXPROCS", "GOMEMLIMIT", "GODEBUG", "ETCD_UNSUPPORTED_ARCH")
"""What a helper process (the embedded etcd, the drill's etcd) inherits, besides ``LC_*``: the
basics any program needs, Go's runtime limits, and ``ETCD_UNSUPPORTED_ARCH`` (etcd 3.4 on arm64
needs it). Nothing else: not the checkpoint URL, ``AWS_*``, ``WANDB_API_KEY``, the etcd password
or any other variable a user may keep a secret in (docs/security.md)."""


def helper_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to start a helper process with: ``HELPER_ENV`` and ``LC_*`` of ``environ``
    (``os.environ`` when None), nothing else."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k in HELPER_ENV or k.startswith("LC_")}


# ---- knobs a person sets for one process ----------------------------------------------------------
ENV_LOG_LEVEL = "ELASTIC_TRAINER_LOG_LEVEL"
"""The logging level of ``elastic-train`` and of the built-in trainer's workers (default ``INFO``)."""
ENV_RDZV_LOG = "ELASTIC_TRAINER_RDZV_LOG"
"""The etcd-v3 rendezvous's own logging level in the agent (``INFO``: show what the rendezvous does)."""
ENV_ETCD_BINARY = "ELASTIC_TRAINER_ETCD_BINARY"
"""The etcd program the embedded etcd runs (default: ``etcd`` on the ``PATH``)."""
ENV_S3_ENDPOINT_URL = "ELASTIC_TRAINER_S3_ENDPOINT_URL"
"""The endpoint of ``s3://`` checkpoint URLs (a MinIO, say); else ``ENV_AWS_ENDPOINT_URL``, else AWS's."""

# ---- other programs' variables that we read or set ------------------------------------------------
ENV_AWS_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
ENV_AWS_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
ENV_AWS_SESSION_TOKEN = "AWS_SESSION_TOKEN"
ENV_AWS_SHARED_CREDENTIALS_FILE = "AWS_SHARED_CREDENTIALS_FILE"
ENV_AWS_PROFILE = "AWS_PROFILE"
ENV_AWS_ENDPOINT_URL = "AWS_ENDPOINT_URL"
"""boto3's, which s3fs reads: the launcher moves the keys out of its workers' environment into a 0600
credentials file that ``ENV_AWS_SHARED_CREDENTIALS_FILE`` names (``cli/secrets.py``)."""
ENV_WANDB_API_KEY = "WANDB_API_KEY"
ENV_WANDB_MODE = "WANDB_MODE"
ENV_WANDB_DIR = "WANDB_DIR"
ENV_WANDB_SILENT = "WANDB_SILENT"
"""W&B's (``training/metrics.py``); the key reaches a worker in the file ``ENV_WANDB_KEY_FILE`` names."""
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""The GPUs a process may see (``devices.py`` reads it to explain a node's GPU count)."""
ENV_OMP_NUM_THREADS = "OMP_NUM_THREADS"
"""The launcher sets it for its workers from the node's CPUs (``cpus.py``) unless it is set."""
ENV_PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
"""The drill sets it for the nodes it starts, so that their lines reach its logs as they are printed."""
ENV_GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
ENV_TP_SOCKET_IFNAME = "TP_SOCKET_IFNAME"
"""gloo's and TensorPipe's network interface: the drill's nodes in network namespaces (``drill/netns.py``) use theirs."""


# ---- exit codes -------------------------------------------------------------------------------
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PEER_STOPPED = 75
"""EX_TEMPFAIL: not an error of this worker; torchrun restarts it into a round without the
preempted node."""
EXIT_EXCLUDED = 76
"""A worker left out of the quorum exits with this; its agent restarts it as a newcomer."""
EXIT_PREEMPTED = 128 + int(signal.SIGTERM)
"""The usual exit code after a SIGTERM: W&B's "not a success"."""
EXIT_CRASH_LOOP = 79
"""The launcher's, when the crash-loop policy stops the node (``observability/crash_loop.py``): outside
sysexits' 64-78 and the signals' 128+, so a Kubernetes ``podFailurePolicy`` can tell it from the rest
(``FailJob`` or ``FailIndex``: a new pod on the same image and data would fail the same way)."""
EXIT_EVICTED = 80
"""A worker whose node was evicted as a straggler (``training/straggler_watch.py``) stops its node with
this code; the launcher holds the node out, checks it and lets it rejoin (never its own exit code)."""

# ---- torch's variables that we set --------------------------------------------------------------
ENV_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""How an NCCL process group handles an error or a timeout; torchrun's agent sets ``1`` (end the
process) for its workers when its own environment lacks it."""
NCCL_CLEAN_UP_ONLY = "2"
"""``ENV_NCCL_ERROR_HANDLING``'s value for the live path: abort the communicators and raise the
error on the training thread, keeping the process. ``elastic-train`` sets it in live mode."""

# ---- the typed worker environment -------------------------------------------------------------
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's own names (set by its agent for every worker)."""
TORCH_WORKER_ENV = frozenset({
    ENV_RANK, ENV_LOCAL_RANK, ENV_WORLD_SIZE, ENV_LOCAL_WORLD_SIZE, "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", ENV_NCCL_ERROR_HANDLING,
    ENV_OMP_NUM_THREADS, ENV_CUDA_VISIBLE_DEVICES})
TORCH_WORKER_ENV_PREFIX = "TORCHELASTIC_"
"""What torch's agent sets for each worker it starts (``LocalElasticAgent._start_workers``, and
``start_processes``' error file): these names and every name with the prefix. A worker forked from
the fork server gets them on top of its agent's environment (``preload.py``)."""


@dataclass(frozen=True)
class LiveSettings:
    """What the live quorum (``live/group.py``) needs from the launcher: the handler exports
    them as ``ENV_LIVE`` (JSON). The defaults here are the ``--rdzv-conf`` defaults too."""

    min_nodes: int = 1
    max_nodes: int = 1
    last_call: float = 1.0
    """Seconds a cold start waits for more nodes once ``min_nodes`` registered."""
    join_timeout: float = 600.0
    """Seconds a worker waits to be admitted, or for ``min_nodes`` after a loss."""
    report_timeout: float = 5.0
    """Seconds the survivors wait for a member that neither reported nor is provably dead (its
    lease still renewed: a stopped or cut-off member is dropped when its lease expires)."""
    lease_ttl: int = 3
    """Seconds of the node's etcd lease, on which each worker keeps ``alive/<id>`` (``rendezvous/node_lease.py``)."""
    keep_alive_interval: float = 1.0
    """Seconds between two renewals of that lease."""
    poll: float = 0.1
    """Seconds between the watcher's checks that need no etcd (the hang bound, the probes) while
    training; it reads etcd only when its watch reports a change (``rendezvous/live_watch.py``)."""
    hang_min: float = 2.0
    """A rank whose step lasts longer than ``max(hang_min, hang_factor x median step)`` while no
    peer is busy (a checkpoint, a warm-up) declares the group stalled: the hung rank is excluded."""
    hang_factor: float = 3.0
    """See ``hang_min``; 0 turns hang detection off (the collective timeout is then the bound)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LiveSettings:
        """Parse ``ENV_LIVE``; keys this version does not know are ignored."""
        return settings_from_json(cls, text, f"{ENV_LIVE}={text!r} is not the JSON the etcd-v3 handler writes")


def settings_from_json(cls: type[T], text: str, error: str) -> T:
    """``cls`` (a dataclass of settings a launcher hands its workers as JSON) from ``text``; keys this
    version does not know (a newer launcher's) are ignored; text that is not JSON raises ``error``."""
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ValueError(error) from exc
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def _int_or(text: str | None, default: int | None) -> int | None:
    return int(text) if text is not None and text.strip().lstrip("-").isdigit() else default


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker is told through its environment, typed (``None``: not set).

    ``rank``/``world_size`` are torchrun's view (under live recovery: this node alone; the
    Manager's quorum decides the real ones). ``live`` is set under the etcd-v3 rendezvous in live
    mode. ``from_environ(os.environ)`` reads it, ``to_environ()`` gives the variables to set."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    restart_count: int | None = None
    rdzv_round: int | None = None
    rdzv_prefix: str | None = None
    rdzv_node: str | None = None
    rdzv_conn: str | None = None
    """``etcd_client.export_options``' JSON: endpoints and TLS files, a password only as a file name."""
    rdzv_endpoint: str | None = None
    rdzv_lease: int | None = None
    """The node's etcd lease (the agent's), live mode only."""
    debug_hang: str | None = None
    debug_slow: str | None = None
    live: LiveSettings | None = None

    _NAMES = {"rank": ENV_RANK, "world_size": ENV_WORLD_SIZE, "local_rank": ENV_LOCAL_RANK,
              "local_world_size": ENV_LOCAL_WORLD_SIZE, "restart_count": ENV_RESTART_COUNT,
              "rdzv_round": ENV_RDZV_ROUND, "rdzv_prefix": ENV_RDZV_PREFIX, "rdzv_node": ENV_RDZV_NODE,
              "rdzv_conn": ENV_RDZV_CONN, "rdzv_endpoint": ENV_RDZV_ENDPOINT, "rdzv_lease": ENV_RDZV_LEASE,
              "debug_hang": ENV_DEBUG_HANG, "debug_slow": ENV_DEBUG_SLOW}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read ``environ`` (default ``os.environ``); a number that does not parse counts as unset."""
        env = os.environ if environ is None else environ
        ints = {"rank", "world_size", "local_rank", "local_world_size", "restart_count", "rdzv_round", "rdzv_lease"}
        values: dict[str, object] = {}
        for attr, name in cls._NAMES.items():
            text = env.get(name)
            values[attr] = _int_or(text, None) if attr in ints else (text or None)
        live = env.get(ENV_LIVE)
        return cls(**values, live=LiveSettings.from_json(live) if live else None)

    def to_environ(self) -> dict[str, str]:
        """The variables that say this (unset fields are left out)."""
        out = {name: str(getattr(self, attr)) for attr, name in self._NAMES.items()
               if getattr(self, attr) is not None}
        if self.live is not None:
            out[ENV_LIVE] = self.live.to_json()
        return out

    @property
    def launched(self) -> bool:
        """Whether a launcher (torchrun) gave this process a rank and a world size."""
        return self.rank is not None and self.world_size is not None
