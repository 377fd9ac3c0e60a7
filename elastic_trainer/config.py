"""Configuration, validated: ``RunConfig`` (what ``elastic-train`` was asked to run) and
``TrainConfig`` (what each worker's trainer runs; one field per flag of ``elastic_trainer.train``).

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` with one
sentence that names the value and says what to change, which the CLI prints as one line.
The environment variables through which the launcher tells the workers where things are
are named here once. The checkpoint manager and the sampler take their few settings as
arguments (``CheckpointManager(url, keep_checkpoints=..., async_checkpoint=...)``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

# Environment variables through which the launcher tells the workers where things are.
# They are named here, once; the trainer reads them as the defaults of its own flags.
ENV_RDZV_ENDPOINT = "ELASTIC_TRAINER_RDZV_ENDPOINT"
ENV_RUN_ID = "ELASTIC_TRAINER_RUN_ID"
ENV_CHECKPOINT_DIR = "ELASTIC_TRAINER_CHECKPOINT_DIR"
ENV_LOG_DIR = "ELASTIC_TRAINER_LOG_DIR"
ENV_RDZV_PREFIX = "ELASTIC_TRAINER_RDZV_PREFIX"
# Set by the etcd-v3 rendezvous handler in the agent after each round, inherited by workers.
ENV_RDZV_ROUND = "ELASTIC_TRAINER_RDZV_ROUND"

DEFAULT_RUN_ID = "elastic-run"


def _cuda_available() -> bool:
    import torch  # only the worker's config asks; the launcher's flags need no torch

    return torch.cuda.is_available()

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass
class RunConfig:
    """One node's share of an elastic run, as the launcher builds it from flags."""

    min_nodes: int = 1
    """Fewest nodes the job trains on; below it, the survivors wait for nodes to join."""
    max_nodes: int = 1
    """Most nodes admitted to a round; more wait as spares."""
    nproc_per_node: int = 1
    """Worker processes per node (one per GPU on GPU nodes)."""
    rdzv_endpoint: str | None = None
    """etcd ``host:port[,host:port...]``; None starts the embedded etcd for this run."""
    rdzv_backend: str = "etcd-v3"
    """torchrun rendezvous backend; ``etcd-v3`` is ours, ``c10d`` is torch's (for comparisons)."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Backend options (``--rdzv-conf k=v,k=v``), see the rendezvous docs."""
    run_id: str = DEFAULT_RUN_ID
    """Names the run: nodes with the same run id and endpoint train together."""
    max_restarts: int = 100
    """Worker-group restarts an agent allows after failures (a lost peer counts as one)."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers."""
    checkpoint_dir: str | None = None
    """fsspec URL of the checkpoint root; ``checkpoints/<run id>`` when None."""
    log_dir: str | None = None
    """Local folder for the embedded etcd's data and the agents' logs; ``runs/<run id>`` when None."""
    local_addr: str | None = None
    """The address other nodes reach this one at; looked up from the host name when None."""
    program: list[str] = field(default_factory=list)
    """The worker command after the interpreter: ``[script, args...]`` or ``["-m", module, args...]``."""

    def __post_init__(self) -> None:
        for name in ("min_nodes", "max_nodes", "nproc_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a whole number of at least 1, got {value!r}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"--max-nodes ({self.max_nodes}) must be at least --min-nodes "
                             f"({self.min_nodes}); raise --max-nodes or lower --min-nodes")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ValueError(f"--monitor-interval must be a positive number of seconds, got {self.monitor_interval}")
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"--run-id {self.run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
        if self.checkpoint_dir is None:
            self.checkpoint_dir = os.path.join("checkpoints", self.run_id)
        if self.log_dir is None:
            self.log_dir = os.path.join("runs", self.run_id)

    @property
    def embedded_etcd(self) -> bool:
        """True when this node starts its own etcd (no ``--rdzv-endpoint`` given)."""
        return self.rdzv_endpoint is None and self.rdzv_backend == "etcd-v3"


@dataclass
class TrainConfig:
    """Everything the trainer needs besides the task; each field is a flag of ``elastic_trainer.train``."""

    task: str | None = None
    """``package.module:build`` or ``file.py:build``; None = the built-in Transformer example."""
    global_batch_size: int = 32
    """Samples per optimizer step over all ranks; constant across world sizes (unless ``scale_lr``)."""
    micro_batch_size: int | None = None
    """Most samples per forward/backward on one rank; None = the rank's whole share in one pass."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (counted across restarts)."""
    epochs: int | None = None
    """Stop after this many epochs; when neither this nor ``max_steps`` is set, 1 epoch."""
    max_seconds: float | None = None
    """Stop (with a checkpoint) after this many seconds of this process's training."""
    lr: float = 1e-3
    """Learning rate of the default Adam optimizer (the seeds' 1e-3)."""
    scale_lr: bool = False
    """Linear rule: ``global_batch_size`` is per rank, the learning rate is multiplied by the world size."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value; None = no clipping."""
    seed: int = 0
    """Seeds python, numpy, torch (the model's initialisation) and the sampler's permutations."""
    checkpoint_dir: str | None = None
    """fsspec URL of the checkpoints; default env ELASTIC_TRAINER_CHECKPOINT_DIR; None = no checkpoints."""
    checkpoint_every: int | None = None
    """Save every N optimizer steps (rank 0)."""
    checkpoint_every_seconds: float | None = None
    """Save when this many seconds have passed since the last save (rank 0's clock)."""
    keep_checkpoints: int = 3
    """Committed checkpoints to keep; older ones are removed after each commit."""
    async_checkpoint: bool = True
    """Serialize and upload in the background (the step is blocked only for the CPU copy)."""
    resume: bool = True
    """Load the newest valid checkpoint at start; False starts from scratch (checkpoints still saved)."""
    grace_seconds: float = 20.0
    """After SIGTERM: save at the next step boundary and exit; exit anyway after this many seconds."""
    log_dir: str = "runs/local"
    """Step log, events, ledger, profiler traces and offline W&B files go here."""
    step_log: bool = True
    """Write one JSON line per optimizer step per rank to ``<log dir>/steps/``."""
    sample_ledger: bool = False
    """Write the dataset indices each rank consumed per step to ``<log dir>/ledger/``."""
    wandb: bool = True
    """Log to W&B from rank 0 (offline unless WANDB_API_KEY is set)."""
    wandb_project: str = "elastic-trainer"
    """W&B project name."""
    progress: bool = True
    """Show the tqdm bar on global rank 0."""
    device: str = "auto"
    """``auto`` (cuda:<local rank> when CUDA is available, else cpu), ``cpu`` or ``cuda``."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state with FSDP (``fully_shard``) instead of DDP."""
    bucket_cap_mb: float | None = None
    """DDP gradient bucket size in MiB; None = torch's default (25)."""
    amp: bool = False
    """Mixed precision: bf16 autocast on CPU; fp16 autocast with a GradScaler on CUDA."""
    compile: bool = False
    """Wrap the model in ``torch.compile``."""
    profile: bool = False
    """Record a torch.profiler trace (one Chrome trace per rank + key-averages table in ``<log dir>/profile``)."""
    profile_wait: int = 1
    """Profiler schedule: steps to skip first."""
    profile_warmup: int = 1
    """Profiler schedule: warm-up steps (traced, discarded)."""
    profile_active: int = 3
    """Profiler schedule: steps recorded."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    sleep_per_step: float = 0.0
    """Seconds to sleep in every step (tests and drills use it to slow training down)."""
    collective_timeout: float = 300.0
    """Seconds a collective may hang before the process group gives up."""
    task_args: Any = None
    """The ``argparse.Namespace`` handed to the task builder (set by ``train.py``)."""

    def __post_init__(self) -> None:
        def positive(name: str, value: Any, allow_none: bool = True) -> None:
            if value is None and allow_none:
                return
            if value is None or not value > 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive number, got {value!r}")

        for name in ("global_batch_size", "micro_batch_size", "max_steps", "epochs", "max_seconds", "lr",
                     "clip_grad_norm", "checkpoint_every", "checkpoint_every_seconds", "keep_checkpoints",
                     "grace_seconds", "bucket_cap_mb", "profile_active", "collective_timeout"):
            positive(name, getattr(self, name))
        for name in ("profile_wait", "profile_warmup", "num_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.sleep_per_step < 0:
            raise ValueError(f"--sleep-per-step must be 0 or more seconds, got {self.sleep_per_step}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not _cuda_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
        if self.task is not None and ":" not in self.task:
            raise ValueError(f"--task {self.task!r} must look like package.module:build")
        if self.max_steps is None and self.epochs is None:
            self.epochs = 1
        if self.checkpoint_dir == "":
            self.checkpoint_dir = None
        if self.checkpoint_dir is None and (self.checkpoint_every or self.checkpoint_every_seconds):
            raise ValueError("--checkpoint-every/--checkpoint-every-seconds need --checkpoint-dir "
                             f"(or the env var {ENV_CHECKPOINT_DIR})")
