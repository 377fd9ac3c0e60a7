"""Configuration, validated: ``RunConfig`` (what ``elastic-train`` was asked to run) and
``TrainConfig`` (what each worker's trainer runs; one field per flag of ``elastic_trainer.train``).

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` with one
sentence that names the value and says what to change, which the CLI prints as one line.

Each flag and each default is written once, as a field: its ``field(metadata=...)`` holds its
section and help (:func:`flag` for the trainer's, :func:`run_flag` for the launcher's), its default
is the field's, and ``elastic_trainer/flags.py`` generates both parsers from the fields
(torchtitan derives its CLI from its ``JobConfig`` dataclasses the same way). The flag is the
field's name with dashes, and the checkpoint manager's keyword arguments use the same names.
``elastic-train`` parses the trainer's flags with the trainer's parser, and offers the two it needs
itself (``--checkpoint-dir``, ``--log-dir``) with the trainer's declaration of them.

The environment variables through which the launcher tells the workers where things are
are named in ``env.py``, once. The checkpoint manager and the sampler take their few settings as
arguments (``CheckpointManager(url, keep_checkpoints=..., async_checkpoint=...)``).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

# Environment variables through which the launcher tells the workers where things are.
# They are named in env.py, once; the trainer reads them as the defaults of its own flags.
from elastic_trainer.env import (  # noqa: E402,F401 - re-exported: the flags' env defaults
    ENV_CHECKPOINT_DIR,
    ENV_LOG_DIR,
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_PREFIX,
    ENV_RDZV_ROUND,
    ENV_RUN_ID,
)
from elastic_trainer.observability.stragglers import POLICIES, StragglerConfig  # noqa: E402

DEFAULT_RUN_ID = "elastic-run"
RECOVERY_MODES = ("live", "restart")
DEFAULT_CHECKPOINT_EVERY_SECONDS = 1800.0
"""The built-in trainer's save interval when no interval is given (30 min, rank 0's clock): a run
that loses every node at once (a rack, a maintenance window, its etcd) loses at most that much."""

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


# ------------------------------------------------------------------------------ launcher flags

RUN_SECTIONS = {
    "nodes": "nodes",
    "rendezvous": "rendezvous",
    "agent": "agent",
    "storage": "storage (the trainer's own flags: give each here or after `--`, not both)",
    "metrics": "metrics (this node's Prometheus /metrics: docs/operations.md, docs/security.md)",
    "stragglers": "stragglers (a slow node found and left out live: docs/operations.md)",
}
"""The argument groups of the launcher's parser, in order; every ``RunConfig`` flag is in one."""


def run_flag(section: str, help: str = "", *, parse: Callable[[str], Any] | None = None, metavar: str | None = None,
             aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None,
             default_text: str | None = None, trainer: bool = False) -> dict[str, Any]:
    """The ``field(metadata=...)`` of a ``RunConfig`` field that is a flag of ``elastic-train``.

    The flag is the field's name with dashes; ``aliases`` are torchrun's spellings. ``parse`` turns
    the text into the value (default: the field's type). ``default_text`` replaces the field's
    default in the help where that reads better (``077`` for the umask). ``trainer`` marks a
    flag that is the built-in trainer's own (``--checkpoint-dir``): its declaration, help included,
    is ``TrainConfig``'s; its ``default_text`` is the launcher's default, which differs from the trainer's.
    """
    if section not in RUN_SECTIONS:
        raise ValueError(f"launcher flag section {section!r} is not one of {', '.join(RUN_SECTIONS)}")
    return {"section": section, "help": help, "parse": parse, "metavar": metavar, "aliases": aliases,
            "choices": choices, "default_text": default_text, "trainer": trainer}


def positive_int(flag: str) -> Callable[[str], int]:
    """A flag's value parser: a whole number of at least 1, else an error naming ``flag``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be at least 1, got {value}")
        return value
    return parse


def parse_nproc(text: str) -> int:
    """``--nproc-per-node``: a number, or ``auto``/``gpu``/``cpu`` counted on this node's GPUs."""
    if text in ("auto", "gpu", "cpu"):
        from elastic_trainer import devices

        try:
            return devices.nproc_per_node(text, devices.CudaView.probe())
        except devices.DeviceError as exc:  # `gpu` without a GPU: an error, as torchrun's
            raise argparse.ArgumentTypeError(str(exc)) from None
    return positive_int("--nproc-per-node")(text)


def parse_umask(text: str) -> int:
    """``--umask``: an octal mask from 000 to 777."""
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--umask takes an octal mask such as 077 or 027, got {text!r}") from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"--umask must be from 000 to 777, got {text!r}")
    return value


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf``: ``key=value[,key=value...]`` as a dict."""
    conf = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--rdzv-conf takes key=value[,key=value...], got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


@dataclass
class RunConfig:
    """One node's share of an elastic run, as the launcher builds it from flags.

    Each field that is a flag of ``elastic-train`` has its help in its ``metadata`` (:func:`run_flag`)
    and its default here: the launcher's parser is generated from them (``flags.add_run_flags``).
    """

    min_nodes: int = field(default=1, metadata=run_flag(
        "nodes", "fewest nodes to train on; below it, the survivors wait for nodes to join",
        parse=positive_int("--min-nodes")))
    max_nodes: int | None = field(default=None, metadata=run_flag(
        "nodes", "most nodes in a round; more wait as spares", parse=positive_int("--max-nodes"),
        default_text="--min-nodes"))
    nproc_per_node: int = field(default=1, metadata=run_flag(
        "nodes", "workers on this node: a number, 'auto' (one per GPU, else 1), 'gpu' (one per GPU; an error "
        "without one) or 'cpu' (1 worker: unlike torchrun's 'cpu', not one per core)",
        parse=parse_nproc, metavar="N", aliases=("--nproc_per_node",)))
    rdzv_endpoint: str | None = field(default=None, metadata=run_flag(
        "rendezvous", "etcd to meet through; leave out to start the embedded etcd on this machine",
        metavar="HOST:PORT[,HOST:PORT]", aliases=("--rdzv_endpoint",), default_text="the embedded etcd"))
    rdzv_backend: str = field(default="etcd-v3", metadata=run_flag(
        "rendezvous", "torchrun rendezvous backend: etcd-v3 (ours) or c10d (torch's, for comparisons)",
        aliases=("--rdzv_backend",)))
    rdzv_conf: dict[str, str] = field(default_factory=dict, metadata=run_flag(
        "rendezvous", "rendezvous options, e.g. last_call_timeout=1,lease_ttl=3 (docs/rendezvous.md lists them)",
        parse=parse_rdzv_conf, metavar="K=V,...", aliases=("--rdzv_conf",)))
    run_id: str = field(default=DEFAULT_RUN_ID, metadata=run_flag(
        "rendezvous", "the run's name; nodes with the same run id and endpoint train together",
        aliases=("--rdzv-id", "--rdzv_id")))
    max_restarts: int = field(default=100, metadata=run_flag(
        "agent", "restarts of this node's worker group after a failure: a worker that errs or (live recovery) is "
        "left out of the quorum; on the restart path also the collective a lost peer breaks. A join costs none",
        aliases=("--max_restarts",)))
    monitor_interval: float = field(default=0.1, metadata=run_flag(
        "agent", "seconds between the agent's checks of its workers", aliases=("--monitor_interval",)))
    recovery: str | None = field(default=None, metadata=run_flag(
        "agent", "live: survivors keep their processes and state when a node is lost or added, and a newcomer "
        "gets the state from a live rank; restart: every fault restarts the workers, which resume from the "
        "newest checkpoint", choices=RECOVERY_MODES,
        default_text="live for the built-in trainer (DDP or --fsdp) and for scripts that use "
        "elastic_trainer.Manager (also through a module of their own); restart for other scripts and "
        "--scale-lr. Given, it always wins"))
    # The trainer's --checkpoint-dir and --log-dir; when None, the launcher's defaults (defined here
    # only): checkpoints/<run id> (empty = no checkpoints) and runs/<run id> (also the embedded
    # etcd's data and the agents' logs).
    checkpoint_dir: str | None = field(default=None, metadata=run_flag(
        "storage", trainer=True, default_text="checkpoints/<run-id>"))
    log_dir: str | None = field(default=None, metadata=run_flag("storage", trainer=True, default_text="runs/<run-id>"))
    local_addr: str | None = field(default=None, metadata=run_flag(
        "rendezvous", "address other nodes reach this one at (default: looked up from the host name)",
        aliases=("--local_addr",)))
    umask: int = field(default=0o077, metadata=run_flag(
        "storage", "file-mode mask of this node's launcher and workers: 077 keeps checkpoints, logs and the "
        "embedded etcd's data readable by this user only; 027 also by its group; 022 by everyone (torchrun's)",
        parse=parse_umask, metavar="OCTAL", default_text="077"))
    metrics_port: int | None = field(default=None, metadata=run_flag(
        "metrics", "TCP port of this node's Prometheus /metrics; 0 turns metrics off. Given, a port in use is an "
        "error; the default taken (another node of this machine has it) means no metrics here, with a warning",
        metavar="PORT", default_text="29600"))
    metrics_addr: str = field(default="", metadata=run_flag(
        "metrics", "address /metrics listens on (127.0.0.1: this machine only)", metavar="ADDR",
        default_text="every address"))
    metrics_certfile: str | None = field(default=None, metadata=run_flag(
        "metrics", "PEM certificate: serve /metrics over HTTPS (with --metrics-keyfile)", metavar="PEM"))
    metrics_keyfile: str | None = field(default=None, metadata=run_flag(
        "metrics", "PEM private key of --metrics-certfile", metavar="PEM"))
    metrics_client_cafile: str | None = field(default=None, metadata=run_flag(
        "metrics", "PEM CA bundle: a scraper must present a certificate it signed (mutual TLS)", metavar="PEM"))
    straggler_policy: str = field(default="evict", metadata=run_flag(
        "stragglers", "evict: a node that slows the job (it would step faster without it) for --straggler-sustain "
        "seconds is left out live, held out for --straggler-hold-out, checked and let rejoin; report: only "
        "named (logs, /metrics); off: not measured. Live recovery only, never below --min-nodes",
        choices=POLICIES))
    straggler_min_slowdown: float = field(default=StragglerConfig.min_slowdown, metadata=run_flag(
        "stragglers", "a rank is named when its own step time is at least this many times its peers' median",
        metavar="X"))
    straggler_sustain: float = field(default=StragglerConfig.sustain_s, metadata=run_flag(
        "stragglers", "seconds a node must stay slow enough to leave out before it is evicted", metavar="SECONDS"))
    straggler_cooldown: float = field(default=StragglerConfig.cooldown_s, metadata=run_flag(
        "stragglers", "seconds after any change of the world during which no node is evicted", metavar="SECONDS"))
    straggler_hold_out: float = field(default=StragglerConfig.hold_out_s, metadata=run_flag(
        "stragglers", "seconds an evicted node waits before its checks and its rejoin (doubled for each eviction "
        "of the same node)", metavar="SECONDS"))
    program: list[str] = field(default_factory=list)
    """Not a flag: the worker command after the interpreter, ``[script, args...]`` or ``["-m", module, args...]``."""
    trainer: TrainConfig | None = None
    """Not a flag: the built-in trainer's config, its flags after ``--`` parsed as each worker will
    parse them; None for your own script."""
    forked_workers: bool = False
    """Not a flag: the built-in trainer's fork server runs (``preload.py``), and its workers are forked
    from it; else each worker starts as a new interpreter."""
    fork_server_error: str | None = None
    """Not a flag: why the built-in trainer's fork server could not start (the launcher says it when
    it starts the workers)."""

    def __post_init__(self) -> None:
        if self.max_nodes is None:
            self.max_nodes = self.min_nodes
        for name in ("min_nodes", "max_nodes", "nproc_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag_name(name)} must be a whole number of at least 1, got {value!r}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"--max-nodes ({self.max_nodes}) must be at least --min-nodes "
                             f"({self.min_nodes}); raise --max-nodes or lower --min-nodes")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if not 0 <= self.umask <= 0o777:
            raise ValueError(f"--umask must be an octal mask from 000 to 777, got {self.umask:o}")
        if not self.monitor_interval > 0:
            raise ValueError(f"--monitor-interval must be a positive number of seconds, got {self.monitor_interval}")
        self.stragglers  # checks the --straggler-* flags
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"--run-id {self.run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
        if self.checkpoint_dir is None:
            self.checkpoint_dir = os.path.join("checkpoints", self.run_id)
        if self.log_dir is None:
            self.log_dir = os.path.join("runs", self.run_id)

    @property
    def stragglers(self) -> StragglerConfig:
        """The ``--straggler-*`` flags (``observability/stragglers.py``), as the workers get them."""
        if self.straggler_hold_out <= 0:
            raise ValueError(f"--straggler-hold-out must be a positive number of seconds, got {self.straggler_hold_out}")
        try:
            return StragglerConfig(policy=self.straggler_policy, min_slowdown=self.straggler_min_slowdown,
                                   sustain_s=self.straggler_sustain, cooldown_s=self.straggler_cooldown,
                                   hold_out_s=self.straggler_hold_out)
        except ValueError as exc:
            raise ValueError(str(exc).replace("straggler sustain_s", "--straggler-sustain")
                             .replace("straggler cooldown_s", "--straggler-cooldown")) from exc

    @property
    def embedded_etcd(self) -> bool:
        """True when this node starts its own etcd (no ``--rdzv-endpoint`` given)."""
        return self.rdzv_endpoint is None and self.rdzv_backend == "etcd-v3"


# ------------------------------------------------------------------------------ trainer flags

SECTIONS = {
    "data": "data: what to train on, and how much of it per step",
    "optimization": "optimization: the optimizer and when to stop",
    "checkpoint": "checkpoint: saving, retention and resume",
    "logs": "logs",
    "execution": "execution: device, parallelism, timeouts",
    "profiling": "profiling (torch.profiler)",
}
"""The argument groups of the trainer's parser, in order; every ``TrainConfig`` flag is in one."""


def flag(section: str, help: str, *, metavar: str | None = None, choices: tuple[str, ...] | None = None,
         env: str | None = None, off: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``field(metadata=...)`` of a ``TrainConfig`` field that is a flag.

    The flag is always the field's name with dashes (``keep_checkpoints`` is ``--keep-checkpoints``),
    so no layer renames a setting. ``help`` is the field's only documentation. ``env`` names the
    environment variable that replaces the default (the launcher sets it for its workers); ``off``
    lists extra spellings that set a bool field to False (``--sync-checkpoint``).
    """
    if section not in SECTIONS:
        raise ValueError(f"flag section {section!r} is not one of {', '.join(SECTIONS)}")
    return {"section": section, "help": help, "metavar": metavar, "choices": choices, "env": env, "off": off}


@dataclass
class TrainConfig:
    """Everything the trainer needs besides the task; each field is a flag of ``elastic_trainer.train``.

    A field's help, section and flag details are its ``metadata`` (see :func:`flag`); the parser
    is generated from them by ``flags.add_train_flags``, and ``elastic-train`` reads the trainer's
    flags with that same parser.
    """

    # data
    task: str | None = field(default=None, metadata=flag(
        "data", "Task builder, package.module:build or path/to/file.py:build; none = the built-in "
        "Transformer example. With --task, flags the trainer does not know reach the builder.",
        metavar="MODULE:FN"))
    global_batch_size: int = field(default=32, metadata=flag(
        "data", "Samples per optimizer step over all ranks; kept when the world size changes (unless --scale-lr)."))
    micro_batch_size: int | None = field(default=None, metadata=flag(
        "data", "Most samples per forward/backward on one rank, more is gradient accumulation; "
        "none = the rank's whole share in one pass."))
    num_workers: int = field(default=0, metadata=flag("data", "DataLoader worker processes per rank."))

    # optimization
    max_steps: int | None = field(default=None, metadata=flag(
        "optimization", "Stop after this many optimizer steps in total (counted across restarts: a resumed "
        "run goes on from the checkpoint's step)."))
    epochs: int | None = field(default=None, metadata=flag(
        "optimization", "Stop after this many epochs (counted across restarts); 1 when none of --epochs, "
        "--max-steps and --max-seconds is given."))
    max_seconds: float | None = field(default=None, metadata=flag(
        "optimization", "Stop (with a checkpoint) once global rank 0 has trained this many seconds, on the "
        "clock of its worker process since that process started training; given alone, training goes on "
        "over epochs until then. Not counted across restarts: live recovery keeps the processes and so the "
        "count, a worker restart (the restart path) starts it again."))
    lr: float = field(default=1e-3, metadata=flag(
        "optimization", "Learning rate of the default Adam optimizer (the seeds' 1e-3)."))
    scale_lr: bool = field(default=False, metadata=flag(
        "optimization", "Linear rule: --global-batch-size is per rank and the learning rate is "
        "multiplied by the world size."))
    clip_grad_norm: float | None = field(default=None, metadata=flag(
        "optimization", "Clip the global gradient norm to this value; none = no clipping."))

    # checkpoint
    checkpoint_dir: str | None = field(default=None, metadata=flag(
        "checkpoint", "fsspec URL of the checkpoint root: a path, memory://..., s3://bucket/prefix; "
        "empty = no checkpoints. elastic-train takes it before or after `--`, uses checkpoints/<run-id> "
        f"when it is not given, checks that it is writable and hands it to its workers in {ENV_CHECKPOINT_DIR}.",
        metavar="URL", env=ENV_CHECKPOINT_DIR))
    checkpoint_every: int | None = field(default=None, metadata=flag(
        "checkpoint", "Save every N optimizer steps (rank 0).", metavar="N"))
    checkpoint_every_seconds: float | None = field(default=None, metadata=flag(
        "checkpoint", "Save when this many seconds have passed since the last save (rank 0's clock). "
        f"When neither this nor --checkpoint-every is given and there is a checkpoint dir: every "
        f"{DEFAULT_CHECKPOINT_EVERY_SECONDS:.0f} s, so that losing every node at once loses at most that much; "
        "0 turns time-based saves off.", metavar="T"))
    keep_checkpoints: int = field(default=3, metadata=flag(
        "checkpoint", "Committed checkpoints to keep; older ones are removed after each commit.", metavar="K"))
    async_checkpoint: bool = field(default=True, metadata=flag(
        "checkpoint", "Serialize and upload in the background, the step blocked only for the CPU copy; "
        "--no-async-checkpoint (or --sync-checkpoint) does it inside the step.", off=("--sync-checkpoint",)))
    resume: bool = field(default=True, metadata=flag(
        "checkpoint", "Load the newest valid checkpoint at start; --no-resume starts from scratch "
        "(checkpoints are still saved)."))
    init_from: str | None = field(default=None, metadata=flag(
        "checkpoint", "Start from the model weights in this safetensors file (`elastic-train export` writes "
        "one) when there is no checkpoint to resume from.", metavar="PATH.safetensors"))
    grace_seconds: float = field(default=20.0, metadata=flag(
        "checkpoint", "After SIGTERM: save at the next step boundary and exit; exit anyway after this many seconds."))

    # logs
    log_dir: str = field(default="runs/local", metadata=flag(
        "logs", "Local folder for the step log, events, ledger, profiler traces and offline W&B files. "
        "elastic-train takes it before or after `--`, uses runs/<run-id> when it is not given, keeps its "
        f"embedded etcd's data and the agents' logs there too and hands it to its workers in {ENV_LOG_DIR}.",
        metavar="DIR", env=ENV_LOG_DIR))
    step_log: bool = field(default=True, metadata=flag(
        "logs", "Write one JSON line per optimizer step per rank to <log-dir>/steps/."))
    sample_ledger: bool = field(default=False, metadata=flag(
        "logs", "Write the dataset indices each rank consumed per step to <log-dir>/ledger/."))
    wandb: bool = field(default=True, metadata=flag(
        "logs", "Log to W&B from rank 0 (offline unless WANDB_API_KEY is set)."))
    wandb_project: str = field(default="elastic-trainer", metadata=flag("logs", "W&B project name."))
    progress: bool = field(default=True, metadata=flag(
        "logs", "Show the tqdm bar on global rank 0: seconds up to --max-seconds when there is no --max-steps, "
        "else steps; log lines are written above it."))

    # execution
    device: str = field(default="auto", metadata=flag(
        "execution", "auto (cuda:<local rank> when CUDA is available, else cpu), cpu or cuda; auto on a node "
        "that shows NVIDIA GPUs torch cannot use is an error (docs/gpu.md).",
        choices=("auto", "cpu", "cuda")))
    fsdp: bool = field(default=False, metadata=flag(
        "execution", "Shard parameters, gradients and optimizer state with FSDP (fully_shard) instead of DDP. "
        "On more than one node: HSDP, sharded over a node's workers and replicated across nodes, so that "
        "live recovery heals a lost node from a replica (docs/trainer.md, \"HSDP\")."))
    fsdp_shard_all: bool = field(default=False, metadata=flag(
        "execution", "With --fsdp: shard over every rank of every node (one copy of the state in all) "
        "instead of HSDP. Less memory per GPU; under live recovery a lost node then costs a reload of "
        "the newest checkpoint (in place, without a restart)."))
    fsdp_peer_copy_every: int = field(default=0, metadata=flag(
        "execution", "With --fsdp under live recovery on more than one node: every K steps, copy each rank's "
        "shards (parameters, optimizer state, trainer state) to the host memory of a rank on the next node, in "
        "the background, so that a lost node whose shards no live replica holds (--fsdp-shard-all) is rebuilt "
        "from the copies, at most K steps back, without reading storage. 0 (the default) keeps no copies: "
        "such a loss reloads the newest checkpoint. Costs host memory of 4 shards per rank "
        "(docs/trainer.md, \"HSDP\").", metavar="K"))
    bucket_cap_mb: float | None = field(default=None, metadata=flag(
        "execution", "DDP gradient bucket size in MiB; none = torch's default (25)."))
    amp: str = field(default="off", metadata=flag(
        "execution", "Mixed precision: bf16 (autocast to bfloat16, no loss scaling; CUDA on Ampere or newer, "
        "or the CPU), fp16 (float16 autocast with a GradScaler; CUDA only) or off. Saved in the checkpoint "
        "with the scaler's state; a resume with another value says so and starts a fresh scaler.",
        choices=("off", "bf16", "fp16")))
    tf32: bool = field(default=True, metadata=flag(
        "execution", "TF32 for float32 matmuls and convolutions on CUDA (Ampere or newer); --no-tf32 keeps "
        "full float32. No effect on the CPU."))
    compile: bool = field(default=False, metadata=flag(
        "execution", "Wrap the model in torch.compile (its first steps compile, which takes long on a CPU)."))
    seed: int = field(default=0, metadata=flag(
        "execution", "Seeds python, numpy, torch (the model's initialisation) and the sampler's permutations."))
    sleep_per_step: float = field(default=0.0, metadata=flag(
        "execution", "Seconds to sleep between two steps, counted as this rank's own work (tests and drills use it "
        "to slow training down; node-local, so a node given more is a straggler). It comes after the step's "
        "agreement and what the ranks agreed at it (a re-form, a join's switch), as in a loop that sleeps after "
        "Manager.step, and not before a step lost to a re-form runs again."))
    collective_timeout: float = field(default=300.0, metadata=flag(
        "execution", "Seconds a collective may hang before the process group gives up."))

    # profiling
    profile: bool = field(default=False, metadata=flag(
        "profiling", "Record a torch.profiler trace: one Chrome trace per rank and a key-averages table "
        "in <log-dir>/profile/."))
    profile_wait: int = field(default=1, metadata=flag("profiling", "Profiler schedule: steps to skip first."))
    profile_warmup: int = field(default=1, metadata=flag(
        "profiling", "Profiler schedule: warm-up steps (traced, discarded)."))
    profile_active: int = field(default=3, metadata=flag("profiling", "Profiler schedule: steps recorded."))

    task_args: Any = None
    """Not a flag: the ``argparse.Namespace`` handed to the task builder (set by ``flags.parse_train_config``)."""

    def __post_init__(self) -> None:
        def positive(name: str, value: Any, allow_none: bool = True) -> None:
            if value is None and allow_none:
                return
            if value is None or not value > 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive number, got {value!r}")

        if self.checkpoint_every_seconds is not None and not self.checkpoint_every_seconds >= 0:
            raise ValueError("--checkpoint-every-seconds must be 0 (off) or a positive number of seconds, "
                             f"got {self.checkpoint_every_seconds!r}")
        for name in ("global_batch_size", "micro_batch_size", "max_steps", "epochs", "max_seconds", "lr",
                     "clip_grad_norm", "checkpoint_every", "keep_checkpoints",
                     "grace_seconds", "bucket_cap_mb", "profile_active", "collective_timeout"):
            positive(name, getattr(self, name))
        for name in ("profile_wait", "profile_warmup", "num_workers", "fsdp_peer_copy_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.sleep_per_step < 0:
            raise ValueError(f"--sleep-per-step must be 0 or more seconds, got {self.sleep_per_step}")
        devices = train_field("device").metadata["choices"]
        if self.device not in devices:
            raise ValueError(f"--device must be {', '.join(devices[:-1])} or {devices[-1]}, got {self.device!r}")
        # Whether this node can run --device is checked where it runs: the launcher (cli/launch.py's check_devices)
        # and each worker (devices.pick_device), not here (the k8s manifests are parsed off the node).
        amps = train_field("amp").metadata["choices"]
        if self.amp not in amps:
            raise ValueError(f"--amp must be {', '.join(amps[:-1])} or {amps[-1]}, got {self.amp!r}")
        if self.amp == "fp16" and self.device == "cpu":
            raise ValueError("--amp fp16 needs CUDA (float16 autocast with a GradScaler); with --device cpu "
                             "use --amp bf16 or --amp off")
        if self.task is not None and ":" not in self.task:
            raise ValueError(f"--task {self.task!r} must look like package.module:build")
        if self.init_from is not None and not (self.init_from.endswith(".safetensors")
                                               and os.path.isfile(self.init_from)):
            raise ValueError(f"--init-from {self.init_from!r} must be an existing .safetensors file "
                             "(elastic-train export CHECKPOINT_URL --to PATH.safetensors writes one)")
        if self.max_steps is None and self.epochs is None and self.max_seconds is None:
            self.epochs = 1  # with only --max-seconds, the clock alone stops the run
        if self.checkpoint_dir == "":
            self.checkpoint_dir = None
        if self.checkpoint_dir is None and (self.checkpoint_every or self.checkpoint_every_seconds):
            raise ValueError("--checkpoint-every/--checkpoint-every-seconds need --checkpoint-dir "
                             f"(or the env var {ENV_CHECKPOINT_DIR})")

    @property
    def save_every_seconds(self) -> float | None:
        """The time-based save interval in force (None: none): ``--checkpoint-every-seconds`` when
        given (0: off), else ``DEFAULT_CHECKPOINT_EVERY_SECONDS`` for a run with a checkpoint dir and
        no ``--checkpoint-every``."""
        if self.checkpoint_dir is None:
            return None
        if self.checkpoint_every_seconds is not None:
            return self.checkpoint_every_seconds or None
        return None if self.checkpoint_every is not None else DEFAULT_CHECKPOINT_EVERY_SECONDS


# ------------------------------------------------------------------------- flags of a config

def train_flag_fields() -> list[Field]:
    """The ``TrainConfig`` fields that are flags (every one but ``task_args``), in order."""
    return [f for f in fields(TrainConfig) if "section" in f.metadata]


def train_field(name: str) -> Field:
    """``TrainConfig``'s field ``name`` (its metadata holds the flag's help and details)."""
    return TrainConfig.__dataclass_fields__[name]


def flag_name(name: str) -> str:
    """The flag of a field: ``keep_checkpoints`` -> ``--keep-checkpoints``."""
    return "--" + name.replace("_", "-")


def run_flag_fields() -> list[Field]:
    """The ``RunConfig`` fields that are flags of ``elastic-train`` (all but ``program`` and ``trainer``)."""
    return [f for f in fields(RunConfig) if "section" in f.metadata]
