"""Output for people and dashboards: rank-0 log lines, the progress bar, W&B.

This is the only module that imports ``wandb``. It keeps no state of its own: which rank this
process is, and which bar is shown, belong to the caller (``training/reporting.py``'s
``Reporter``, which asks these only on global rank 0 and reads the rank from the worker's
``DistInfo``, so a live re-form that makes another process rank 0 needs no call here).

- ``print0(msg, rank, progress)``: one log line on global rank 0 (through the bar when one is shown).
- ``Progress``: one tqdm bar (epoch, step, loss, samples/s, world size; the caller enables it on
  global rank 0 only). Its total and ETA follow what stops the run: seconds with ``--max-seconds``
  (and no ``--max-steps``), else steps. While it is shown, this process's log lines go above it
  (tqdm's ``logging_redirect_tqdm``).
- ``init_wandb(...)``: a W&B run (the caller asks on rank 0 only), resumed by id
  (``resume="allow"``) so one run shows the whole training across restarts; offline (files under
  ``<log dir>/wandb``) when ``WANDB_API_KEY`` is unset; ``enabled=False`` (``--no-wandb``) gives a
  logger that does nothing.
- ``fixed_run_id(root)``: the W&B run id, fixed at the training's first start in ``<root>/wandb-run-id``
  (the checkpoint dir, shared by every node), so a restart before the first checkpoint resumes
  the same W&B run instead of opening a new one.

How a W&B run ends tells what happened (W&B's exit-code contract: 0 is a success, anything else
is failed or preempted): ``finish(exit_code=0)`` when training finished or hit ``--max-seconds``;
on SIGTERM ``mark_preempting()`` at once, then ``finish(exit_code=EXIT_PREEMPTED)`` (``elastic_trainer.env``) after the
save, also from the forced exits (``finish_within``, bounded, before ``runtime().exit``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import string
import sys
import tempfile
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("elastic_trainer.training.metrics")


def print0(msg: str, rank: int, progress: "Progress | None" = None) -> None:
    """Print one line to stderr when ``rank`` (the global rank) is 0, through ``progress``'s bar
    when one is shown."""
    if rank != 0:
        return
    line = f"[elastic-trainer] {msg}"
    if progress is not None and progress.bar is not None:
        progress.bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


class Progress:
    """One tqdm bar; a no-op when disabled (the caller enables it on global rank 0 only).

    ``total`` steps (None: unknown), or with ``seconds`` a bar of this many seconds of training
    (``--max-seconds``): then its ETA is the time left, and the step is in the postfix.
    """

    def __init__(self, total: int | None, initial: int, enabled: bool = True, seconds: float | None = None) -> None:
        self.bar = None
        self._redirect = contextlib.ExitStack()
        self._started = time.monotonic()
        self.seconds = seconds
        if enabled:
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
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._redirect.close()


RUN_ID_CHARS = string.ascii_lowercase + string.digits


def new_run_id() -> str:
    """A fresh W&B run id (created once per training, then carried in every checkpoint): W&B's own
    form, 8 base-36 characters from ``secrets`` as ``wandb.util.generate_id`` makes them. Made here
    so that a run without W&B never imports wandb: its import makes two temporary folders
    (``tmp*wandb-media``, ``tmp*wandb-artifacts``) that only the interpreter's teardown removes, and
    a worker ends without one (``runtime.exit_without_teardown``)."""
    return "".join(secrets.choice(RUN_ID_CHARS) for _ in range(8))


RUN_ID_FILE = "wandb-run-id"


def fixed_run_id(root: str, *, fresh: bool = False) -> str:
    """The training's W&B run id, stored in ``<root>/wandb-run-id`` at the first start.

    The first caller creates the file atomically (``storage.create_exclusive``; S3 and NFS
    included), later starts read it, so every start of the training (on any node, before or after
    the first checkpoint) logs into one W&B run. ``fresh`` (``--no-resume``) replaces it.
    """
    from elastic_trainer import storage

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
    """The logger when W&B is off (``--no-wandb``), before it starts, or on ranks other than 0."""

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

    def __init__(self, run, staging: str | None = None) -> None:
        self.run = run
        self.run_id = run.id
        self._staging = staging  # wandb's import-time temporary folders are in it (``_import_wandb``)
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
            try:
                self.run.finish(exit_code=exit_code)
            finally:
                self._remove_staging()

    def finish_within(self, exit_code: int, seconds: float) -> None:
        """``finish`` from a forced exit: give it at most ``seconds``, the process ends after this."""
        from elastic_trainer.runtime import runtime

        runtime().start_thread("wandb-finish", self.finish, exit_code).join(seconds)
        self._remove_staging()

    def _remove_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


from elastic_trainer.env import ENV_WANDB_KEY_FILE as WANDB_KEY_FILE  # noqa: E402
from elastic_trainer.env import ENV_WANDB_API_KEY, ENV_WANDB_DIR, ENV_WANDB_MODE, ENV_WANDB_SILENT  # noqa: E402
"""The path of a file holding the W&B API key: what the launcher hands its workers instead of
``WANDB_API_KEY``; set it yourself to give the key as a file (a mounted Kubernetes Secret)."""


def wandb_api_key() -> str | None:
    """The W&B API key: ``WANDB_API_KEY``, else the file named by ``ELASTIC_TRAINER_WANDB_KEY_FILE``
    (what the launcher hands its workers, or a mounted secret). An absent file is no key (an
    optional Kubernetes Secret that was not created: W&B runs offline, with a warning); a file that
    exists but cannot be read is an error naming the file, not a silent offline run."""
    key = os.environ.get(ENV_WANDB_API_KEY)
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


def init_wandb(*, enabled: bool, run_id: str | None, log_dir: str, project: str, config: dict[str, Any],
               group: str | None = None, say: Callable[[str], None] | None = None) -> NullLogger | WandbLogger:
    """Start (or resume, same id) the run's W&B run; a ``NullLogger`` when not ``enabled`` or
    without a ``run_id``. Call it on global rank 0 only. ``say`` gets the one line that names the
    run (default: this module's logger).

    Without an API key (``WANDB_API_KEY`` or its file, see ``wandb_api_key``; and no ``WANDB_MODE``
    chosen) the run is offline: its files
    are under ``<log_dir>/wandb/offline-run-*-<run id>/`` and ``wandb sync`` uploads them later.
    """
    if not enabled or run_id is None:
        return NullLogger()
    wandb, staging = _import_wandb()
    try:
        key = wandb_api_key()
        if not key and not os.environ.get(ENV_WANDB_MODE):
            os.environ[ENV_WANDB_MODE] = "offline"
        os.environ.setdefault(ENV_WANDB_DIR, log_dir)
        os.environ.setdefault(ENV_WANDB_SILENT, "true")
        os.makedirs(os.environ[ENV_WANDB_DIR], exist_ok=True)
        # the key goes to W&B in its settings, never into this process's environment (inherited by
        # DataLoader workers and subprocesses)
        settings = wandb.Settings(api_key=key) if key else None
        run = wandb.init(project=project, id=run_id, resume="allow", group=group, config=config,
                         dir=os.environ[ENV_WANDB_DIR], settings=settings)
        run.define_metric("global_step")
        run.define_metric("*", step_metric="global_step")
    except BaseException:  # no run to finish: its folders go now
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    (say or logger.info)(f"W&B run {run.id} ({os.environ.get(ENV_WANDB_MODE, 'online')}) in {os.environ[ENV_WANDB_DIR]}")
    return WandbLogger(run, staging)


def _import_wandb() -> tuple[Any, str | None]:
    """``wandb``, imported with its import-time temporary folders (``tmp*wandb-media``,
    ``tmp*wandb-artifacts``) made in a folder of ours (``tempfile.tempdir`` for the import's time),
    returned to be removed when the run finishes: wandb leaves their removal to the interpreter's
    teardown, and a worker ends without one (``runtime.exit_without_teardown``), so each run's rank 0
    would leave two folders in the machine's temp dir. None when wandb was imported already."""
    if "wandb" in sys.modules:
        return sys.modules["wandb"], None
    staging, kept = tempfile.mkdtemp(prefix="elastic-trainer-wandb-"), tempfile.tempdir
    tempfile.tempdir = staging
    try:
        import wandb
    finally:
        tempfile.tempdir = kept
    return wandb, staging
