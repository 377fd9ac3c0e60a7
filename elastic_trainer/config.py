"""Configuration, validated: ``RunConfig`` (what ``elastic-train`` was asked to run) and
``TrainConfig`` (what each worker's trainer runs; one field per flag of ``elastic_trainer.train``).

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` with one
sentence that names the value and says what to change, which the CLI prints as one line.

Each trainer flag is written once, as a ``TrainConfig`` field: its ``field(metadata=flag(...))``
holds its section and help, and :func:`add_train_flags` generates the trainer's parser from the
fields (torchtitan derives its CLI from its ``JobConfig`` dataclasses the same way). The flag is
the field's name with dashes, and the checkpoint manager's keyword arguments use the same names.
``elastic-train`` parses the trainer's flags with that parser, and offers the two it needs itself
(``--checkpoint-dir``, ``--log-dir``) with :func:`add_train_flag`, the same declaration.

The environment variables through which the launcher tells the workers where things are
are named here once. The checkpoint manager and the sampler take their few settings as
arguments (``CheckpointManager(url, keep_checkpoints=..., async_checkpoint=...)``).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

# Environment variables through which the launcher tells the workers where things are.
# They are named here, once; the trainer reads them as the defaults of its own flags.
from elastic_trainer.env import (  # noqa: E402,F401 - re-exported: the flags' env defaults
    ENV_CHECKPOINT_DIR,
    ENV_LOG_DIR,
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_PREFIX,
    ENV_RDZV_ROUND,
    ENV_RUN_ID,
)

DEFAULT_RUN_ID = "elastic-run"


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
    """The trainer's ``--checkpoint-dir`` (``TrainConfig.checkpoint_dir``) for this run; when None,
    ``checkpoints/<run id>``, the launcher's default, defined here only; empty = no checkpoints."""
    log_dir: str | None = None
    """The trainer's ``--log-dir`` for this run, also the embedded etcd's data and the agents' logs;
    ``runs/<run id>`` when None (the launcher's default, defined here only)."""
    local_addr: str | None = None
    """The address other nodes reach this one at; looked up from the host name when None."""
    umask: int = 0o077
    """The file-mode mask of the launcher, its agent and workers (``--umask``): 077 makes every
    folder and file the run creates (checkpoints, logs, the embedded etcd's data) private to its
    user; 027 lets the group read them, 022 everyone (torchrun's behaviour)."""
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
        if not 0 <= self.umask <= 0o777:
            raise ValueError(f"--umask must be an octal mask from 000 to 777, got {self.umask:o}")
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
    is generated from them by :func:`add_train_flags`, and ``elastic-train`` reads the trainer's
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
        "optimization", "Stop after this many optimizer steps in total (counted across restarts)."))
    epochs: int | None = field(default=None, metadata=flag(
        "optimization", "Stop after this many epochs; 1 when neither this nor --max-steps is given."))
    max_seconds: float | None = field(default=None, metadata=flag(
        "optimization", "Stop (with a checkpoint) after this many seconds of this process's training."))
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
        "checkpoint", "Save when this many seconds have passed since the last save (rank 0's clock).", metavar="T"))
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
    progress: bool = field(default=True, metadata=flag("logs", "Show the tqdm bar on global rank 0."))

    # execution
    device: str = field(default="auto", metadata=flag(
        "execution", "auto (cuda:<local rank> when CUDA is available, else cpu), cpu or cuda.",
        choices=("auto", "cpu", "cuda")))
    fsdp: bool = field(default=False, metadata=flag(
        "execution", "Shard parameters, gradients and optimizer state with FSDP (fully_shard) instead of DDP."))
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
    compile: bool = field(default=False, metadata=flag("execution", "Wrap the model in torch.compile."))
    seed: int = field(default=0, metadata=flag(
        "execution", "Seeds python, numpy, torch (the model's initialisation) and the sampler's permutations."))
    sleep_per_step: float = field(default=0.0, metadata=flag(
        "execution", "Seconds to sleep in every step (tests and drills use it to slow training down)."))
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
    """Not a flag: the ``argparse.Namespace`` handed to the task builder (set by ``train.py``)."""

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
        devices = train_field("device").metadata["choices"]
        if self.device not in devices:
            raise ValueError(f"--device must be {', '.join(devices[:-1])} or {devices[-1]}, got {self.device!r}")
        # Whether this node can run --device is checked where it runs: the launcher (cli.check_devices)
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
        if self.max_steps is None and self.epochs is None:
            self.epochs = 1
        if self.checkpoint_dir == "":
            self.checkpoint_dir = None
        if self.checkpoint_dir is None and (self.checkpoint_every or self.checkpoint_every_seconds):
            raise ValueError("--checkpoint-every/--checkpoint-every-seconds need --checkpoint-dir "
                             f"(or the env var {ENV_CHECKPOINT_DIR})")


# ------------------------------------------------------------------------- the generated parser

def train_flag_fields() -> list[Field]:
    """The ``TrainConfig`` fields that are flags (every one but ``task_args``), in order."""
    return [f for f in fields(TrainConfig) if "section" in f.metadata]


def train_field(name: str) -> Field:
    """``TrainConfig``'s field ``name`` (its metadata holds the flag's help and details)."""
    return TrainConfig.__dataclass_fields__[name]


def flag_name(name: str) -> str:
    """The flag of a field: ``keep_checkpoints`` -> ``--keep-checkpoints``."""
    return "--" + name.replace("_", "-")


@functools.cache
def _types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


class _Switch(argparse.Action):
    """A bool field's flag: ``--name`` sets it, ``--no-name`` (and the field's ``off`` spellings) clears it."""

    def __init__(self, option_strings: list[str], dest: str, off: tuple[str, ...] = (), **kwargs: Any) -> None:
        self.off = ("--no-" + option_strings[0][2:], *off)
        super().__init__([*option_strings, *self.off], dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string not in self.off)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings[:2])


def _converter(kind: type, optional: bool) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if optional and text.lower() in ("none", ""):
            return None
        return kind(text)
    convert.__name__ = kind.__name__  # argparse says "invalid int value: 'x'"
    return convert


def _default_text(f: Field) -> str | None:
    if f.metadata["env"]:
        return f"${f.metadata['env']}, else {'none' if f.default is None else f.default}"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return None if f.default is None else str(f.default)


def add_train_flag(container: Any, name: str, *, default: Any, default_text: str | None = None) -> argparse.Action:
    """Add the flag of ``TrainConfig.<name>`` to ``container`` (a parser or an argument group).

    Its type, choices, metavar and help come from the field; ``default`` is the caller's (the
    trainer's is the field's default or its env var; the launcher's is None, "not given here").
    """
    f = train_field(name)
    meta = f.metadata
    kind = _types()[name]
    optional = type(None) in typing.get_args(kind)
    if optional:
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    text = meta["help"] + (f" (default: {default_text})" if default_text else "")
    text = text.replace("%", "%%")
    if kind is bool:
        return container.add_argument(flag_name(name), action=_Switch, off=meta["off"], default=default, help=text)
    metavar = meta["metavar"] or {int: "N", float: "X"}.get(kind)
    return container.add_argument(flag_name(name), type=None if kind is str else _converter(kind, optional),
                                  choices=meta["choices"], metavar=metavar, default=default, help=text)


def add_train_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add every ``TrainConfig`` flag to ``parser``, one argument group per section of :data:`SECTIONS`.

    A default is the field's, or the value of the field's env var in ``environ`` (``os.environ``
    unless given) when that is set and not empty.
    """
    environ = os.environ if environ is None else environ
    groups = {section: parser.add_argument_group(title) for section, title in SECTIONS.items()}
    for f in train_flag_fields():
        env = f.metadata["env"]
        default = (environ.get(env) if env else None) or f.default
        add_train_flag(groups[f.metadata["section"]], f.name, default=default, default_text=_default_text(f))
