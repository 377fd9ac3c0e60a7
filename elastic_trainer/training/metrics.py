"""Output for people and dashboards: rank-0 log lines, the progress bar, W&B.

This is the only module that imports ``wandb``. Everything here acts on global rank 0
only; on other ranks the same calls do nothing, so the training loop never asks
``if rank == 0`` to print.

- ``print0(msg)``: one log line on global rank 0 (written through the bar when one is shown).
- ``Progress``: one tqdm bar on global rank 0 (epoch, step, loss, samples/s, world size). Its total
  and ETA follow what stops the run: seconds with ``--max-seconds`` (and no ``--max-steps``), else
  steps. While it is shown, this process's log lines go above it (tqdm's ``logging_redirect_tqdm``).
- ``init_wandb(...)``: a W&B run on rank 0, resumed by id (``resume="allow"``) so one run shows
  the whole training across restarts; offline (files under ``<log dir>/wandb``) when
  ``WANDB_API_KEY`` is unset; ``enabled=False`` (``--no-wandb``) gives a logger that does nothing.
- ``fixed_run_id(root)``: the W&B run id, fixed at the training's first start in ``<root>/wandb-run-id``
  (the checkpoint dir, shared by every node), so a restart before the first checkpoint resumes
  the same W&B run instead of opening a new one.

How a W&B run ends tells what happened (W&B's exit-code contract: 0 is a success, anything else
is failed or preempted): ``finish(exit_code=0)`` when training finished or hit ``--max-seconds``;
on SIGTERM ``mark_preempting()`` at once, then ``finish(exit_code=PREEMPTED_EXIT_CODE)`` after the
save, also from the forced exits (``finish_within``, bounded, before ``os._exit``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from typing import Any

logger = logging.getLogger("elastic_trainer.training.metrics")

_RANK = int(os.environ.get("RANK", "0"))
_BAR: "Progress | None" = None


def set_rank(rank: int) -> None:
    """Tell this module the process's global rank (the trainer calls it once at start)."""
    global _RANK
    _RANK = rank


def print0(msg: str) -> None:
    """Print one line on global rank 0 (through the progress bar if there is one), to stderr."""
    if _RANK != 0:
        return
    line = f"[elastic-trainer] {msg}"
    if _BAR is not None and _BAR.bar is not None:
        _BAR.bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


class Progress:
    """One tqdm bar on global rank 0; a no-op elsewhere or when disabled.

    ``total`` steps (None: unknown), or with ``seconds`` a bar of this many seconds of training
    (``--max-seconds``): then its ETA is the time left, and the step is in the postfix.
    """

    def __init__(self, total: int | None, initial: int, enabled: bool = True, seconds: float | None = None) -> None:
        global _BAR
        self.bar = None
        self._redirect = contextlib.ExitStack()
        self._started = time.monotonic()
        self.seconds = seconds
        if enabled and _RANK == 0:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            if seconds is not None:
                self.bar = tqdm(total=seconds, desc="train: ", unit="s", file=sys.stderr, dynamic_ncols=True,
                                mininterval=0.5, bar_format="{desc}{percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s "
                                                            "[{elapsed}<{remaining}{postfix}]")
            else:
                self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                                dynamic_ncols=True, mininterval=0.5)
            # Log lines (ours, torch's) are written above the bar instead of into it.
            self._redirect.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))
        _BAR = self

    def update(self, *, step: int, epoch: int, loss: float, samples_per_s: float, world_size: int) -> None:
        if self.bar is None:
            return
        self.bar.set_description(f"epoch {epoch}", refresh=False)
        self.bar.set_postfix(step=step, loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.1f}",
                             world=world_size, refresh=False)
        if self.seconds is not None:
            self.bar.update(min(self.seconds, time.monotonic() - self._started) - self.bar.n)
        else:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        global _BAR
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._redirect.close()
        _BAR = None


def new_run_id() -> str:
    """A fresh W&B run id (created once per training, then carried in every checkpoint)."""
    try:
        import wandb
    except ImportError:  # wandb is a dependency; keep --no-wandb runs working without it
        return uuid.uuid4().hex[:8]
    generate = getattr(getattr(wandb, "util", None), "generate_id", None)
    if generate is None:  # wandb >= 0.2x moved it
        from wandb.sdk.lib.runid import generate_id as generate
    return generate()


RUN_ID_FILE = "wandb-run-id"
from elastic_trainer.env import EXIT_PREEMPTED as PREEMPTED_EXIT_CODE  # noqa: E402 - defined once, in env.py


def fixed_run_id(root: str, *, fresh: bool = False) -> str:
    """The training's W&B run id, stored in ``<root>/wandb-run-id`` at the first start.

    The first caller creates the file atomically (``storage.create_exclusive``; S3 and NFS
    included), later starts read it, so every start of the training (on any node, before or after
    the first checkpoint) logs into one W&B run. ``fresh`` (``--no-resume``) replaces it.
    """
    from elastic_trainer.checkpoint import storage

    fs, base = storage.get_fs(root)
    path = storage.join(base, RUN_ID_FILE)
    if fresh:
        run_id = new_run_id()
        storage.write_bytes(fs, path, run_id.encode())
        return run_id
    storage.makedirs(fs, base)
    candidate = new_run_id()
    if storage.create_exclusive(fs, path, candidate.encode()):
        return candidate
    stored = storage.read_bytes(fs, path).decode().strip()
    if not stored:
        raise ValueError(f"{storage.redact(path)} is empty; delete it to start a new W&B run")
    return stored


class NullLogger:
    """The logger when W&B is off (``--no-wandb``) or on ranks other than 0."""

    run_id: str | None = None

    def log(self, values: dict[str, Any]) -> None:
        pass

    def mark_preempting(self) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass

    def finish_within(self, exit_code: int, seconds: float) -> None:
        pass


class WandbLogger:
    """A W&B run on global rank 0, resumed by id."""

    def __init__(self, run) -> None:
        self.run = run
        self.run_id = run.id
        self._lock = threading.Lock()
        self._finished = False

    def log(self, values: dict[str, Any]) -> None:
        self.run.log(values)

    def mark_preempting(self) -> None:
        """Tell W&B now that this run is being preempted (a SIGTERM came), before the save."""
        with self._lock:
            if not self._finished:
                self.run.mark_preempting()

    def finish(self, exit_code: int = 0) -> None:
        """End the run with ``exit_code`` (0: a success), flushing what was logged; once."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self.run.finish(exit_code=exit_code)

    def finish_within(self, exit_code: int, seconds: float) -> None:
        """``finish`` from a forced exit: give it at most ``seconds``, the process ends after this."""
        t = threading.Thread(target=self.finish, args=(exit_code,), name="wandb-finish", daemon=True)
        t.start()
        t.join(seconds)


from elastic_trainer.env import ENV_WANDB_KEY_FILE as WANDB_KEY_FILE  # noqa: E402
"""The path of a file holding the W&B API key: what the launcher hands its workers instead of
``WANDB_API_KEY``; set it yourself to give the key as a file (a mounted Kubernetes Secret)."""


def wandb_api_key() -> str | None:
    """The W&B API key: ``WANDB_API_KEY``, else the file named by ``ELASTIC_TRAINER_WANDB_KEY_FILE``
    (what the launcher hands its workers, or a mounted secret). An absent file is no key (an
    optional Kubernetes Secret that was not created: W&B runs offline, with a warning); a file that
    exists but cannot be read is an error naming the file, not a silent offline run."""
    key = os.environ.get("WANDB_API_KEY")
    if key:
        return key
    path = os.environ.get(WANDB_KEY_FILE)
    if not path:
        return None
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        logging.getLogger(__name__).warning("no W&B API key file at %s: W&B logs offline", path)
        return None
    except OSError as exc:
        raise RuntimeError(f"cannot read the W&B API key file {path}: {exc.strerror}") from None


def init_wandb(*, enabled: bool, run_id: str | None, log_dir: str, project: str,
               config: dict[str, Any], group: str | None = None) -> NullLogger | WandbLogger:
    """Start (or resume, same id) the run's W&B run on rank 0; a ``NullLogger`` otherwise.

    Without an API key (``WANDB_API_KEY`` or its file, see ``wandb_api_key``; and no ``WANDB_MODE``
    chosen) the run is offline: its files
    are under ``<log_dir>/wandb/offline-run-*-<run id>/`` and ``wandb sync`` uploads them later.
    """
    if not enabled or _RANK != 0 or run_id is None:
        return NullLogger()
    import wandb

    key = wandb_api_key()
    if not key and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_DIR", log_dir)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.makedirs(os.environ["WANDB_DIR"], exist_ok=True)
    # the key goes to W&B in its settings, never into this process's environment (inherited by
    # DataLoader workers and subprocesses)
    settings = wandb.Settings(api_key=key) if key else None
    run = wandb.init(project=project, id=run_id, resume="allow", group=group, config=config,
                     dir=os.environ["WANDB_DIR"], settings=settings)
    run.define_metric("global_step")
    run.define_metric("*", step_metric="global_step")
    print0(f"W&B run {run.id} ({os.environ.get('WANDB_MODE', 'online')}) in {os.environ['WANDB_DIR']}")
    return WandbLogger(run)
