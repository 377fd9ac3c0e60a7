"""How another node joins this one: the join command the first node prints, and what every node of
a run must run alike (the program record of the joiner check, ``rendezvous/program.py``).

The join command (:func:`join_command`) is this node's own: its node counts, run id, recovery mode,
checkpoint folder, the program and its arguments (a script by its absolute path, so that it works
from any folder; the built-in trainer's flags after ``--``), plus the embedded etcd's endpoint and
the ``--rdzv-conf`` that reaches it (TLS files, ``user``, ``password_file``: a path, never the
password). A command pasted as printed runs the same program, so it passes the joiner check.

The program record (:func:`program_of`): a script's or module's own files hashed (the script and
the local modules it imports, by their paths relative to the script's folder:
``training/uses_manager.script_sources``) and its arguments; for the built-in trainer, every
``TrainConfig`` flag but the node-local ones (``NODE_LOCAL``); and the recovery mode.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
from dataclasses import fields
from pathlib import Path

from elastic_trainer.config import RunConfig, TrainConfig
from elastic_trainer.rendezvous.program import Program

BUILTIN = "the built-in trainer"
NODE_LOCAL = frozenset({
    "num_workers", "max_seconds", "checkpoint_dir", "resume", "init_from", "grace_seconds", "log_dir", "step_log",
    "sample_ledger", "wandb", "wandb_project", "progress", "device", "sleep_per_step", "collective_timeout",
    "profile", "profile_wait", "profile_warmup", "profile_active"})
"""The built-in trainer's flags that may differ between the nodes of a run: this node's folders,
logs and device, its data loader workers, its own timeouts, its profiler; where it starts from (a
newcomer gets the state from a peer) and when rank 0 stops (``--max-seconds``: rank 0's clock).
Every other flag is compared (a new flag is, until it is named here)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def trainer_settings(trainer: TrainConfig) -> dict[str, str]:
    """The built-in trainer's flags that every node must share, by flag, as text: ``TrainConfig``'s and
    its task's (``task_args``: the example model's flags, a task's own), but ``NODE_LOCAL``."""
    values = {f.name: getattr(trainer, f.name) for f in fields(trainer) if f.name != "task_args"}
    values.update({k: v for k, v in vars(trainer.task_args or argparse.Namespace()).items() if k not in values})
    return {_flag(name): shlex.join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            for name, value in sorted(values.items()) if name not in NODE_LOCAL}


def _digest(root: Path, files: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)):
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def program_of(run: RunConfig) -> Program:
    """What this node runs, for the joiner check."""
    from elastic_trainer import __version__
    from elastic_trainer.training.uses_manager import script_sources

    recovery = run.recovery or "restart"
    if run.trainer is not None:
        return Program(BUILTIN, f"elastic_trainer {__version__}", settings=trainer_settings(run.trainer),
                       recovery=recovery)
    module = run.program[0] == "-m"
    name, args = run.program[1], tuple(run.program[2:])
    sources = script_sources(name, module=module)
    digest = _digest(sources.root, sources.files) if sources.root is not None else "not found"
    return Program(f"the module {name}" if module else f"the script {Path(name).name}", digest, args,
                   recovery=recovery)


def join_command(run: RunConfig, endpoint: str, conf: dict[str, str]) -> str:
    """The command another terminal of this machine joins this node's run with (see the module
    docstring); ``conf``: the ``--rdzv-conf`` options that reach the embedded etcd."""
    from elastic_trainer.storage import has_credentials

    options = {k: v for k, v in run.rdzv_conf.items() if k != "recovery"} | conf
    cmd = ["elastic-train", "--nnodes", f"{run.min_nodes}:{run.max_nodes}", "--nproc-per-node",
           str(run.nproc_per_node), "--run-id", run.run_id, "--rdzv-endpoint", endpoint,
           "--rdzv-conf", ",".join(f"{k}={v}" for k, v in options.items())]
    if run.recovery:
        cmd += ["--recovery", run.recovery]
    ckpt = run.checkpoint_dir or ""
    if "--checkpoint-dir" not in run.program and not has_credentials(ckpt):  # (keys come from the environment)
        cmd += ["--checkpoint-dir", ckpt if not ckpt or "://" in ckpt else str(Path(ckpt).resolve())]
    if run.trainer is not None:
        trainer_args = run.program[2:]
        cmd += ["--", *trainer_args] if trainer_args else []
    elif run.program[0] == "-m":
        cmd += run.program
    else:
        cmd += [str(Path(run.program[1]).resolve()), *run.program[2:]]
    return shlex.join(cmd)


__all__ = ["BUILTIN", "NODE_LOCAL", "join_command", "program_of", "trainer_settings"]
