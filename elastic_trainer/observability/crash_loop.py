"""When restarting a node's workers again would not help: the crash-loop policy of its agent.

torchrun's agent restarts a failed worker group up to ``--max-restarts`` times (100 by default)
whatever the failure. A script that raises right after ``init_process_group`` was measured
restarting 100 times over 130 s under ``elastic-train --nnodes 1``, printing its error 202 times,
and ending with no line saying why; on a GPU node each restart costs tens of seconds, and under
live recovery each one costs the other nodes a re-form. ``CrashLoopPolicy`` is told of each
failure of this node's workers and says when to stop instead:

- ``max_failures_without_step`` (3) failures in a row of workers that never completed a step
  (a step completed by any worker of the node since resets the count);
- ``max_recoveries_without_checkpoint`` (5) failures in a row at each of which the newest committed
  checkpoint was still the one of the failure before (only when the run has checkpoints): the node
  keeps failing in the middle of training and the run makes no durable progress;
- at once on ``EXIT_USAGE`` (bad flags, a device the node cannot run: the worker said no restart helps).

Failures that are not crashes never count: a worker left out of the live quorum
(``EXIT_EXCLUDED``, restarted as a newcomer), stopped because another node was preempted
(``EXIT_PEER_STOPPED``) or by SIGTERM (``EXIT_PREEMPTED``), or one that exited 0.

When it stops, the node's launcher ends its workers and exits with ``EXIT_CRASH_LOOP`` (79) after one
line naming the rule and the last error (``Verdict.line``); a Kubernetes ``podFailurePolicy`` can
map that code to ``FailIndex`` so the pod is not recreated into the same loop.

How a worker's progress reaches the agent: it creates one empty file, ``<ENV_PROGRESS_DIR>/<pid>``,
when it completes its first step (``mark_progress()``; once per process, nothing per step), and the
agent asks ``made_progress(folder, pid)`` about the pid of the worker that failed (torch's
``ProcessFailure.pid``). The launcher makes the folder, node-local, and names it in
``ENV_PROGRESS_DIR``; where it is not set, ``mark_progress`` does nothing.

Like NVIDIA's resiliency extension (which exits after repeated restarts without progress) and
TorchFT (``max_failures_per_step``), the measure is progress, not time.

Usage (the agent, at each failure of its worker group)::

    policy = CrashLoopPolicy()
    verdict = policy.failed(exitcode, error, progressed=made_progress(folder, pid), checkpoint_step=newest)
    if verdict.stop:
        print(verdict.line, file=sys.stderr); return EXIT_CRASH_LOOP
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer.env import (
    ENV_PROGRESS_DIR,
    EXIT_CRASH_LOOP,
    EXIT_EXCLUDED,
    EXIT_OK,
    EXIT_PEER_STOPPED,
    EXIT_PREEMPTED,
    EXIT_USAGE,
)

NOT_CRASHES = frozenset({EXIT_OK, EXIT_EXCLUDED, EXIT_PEER_STOPPED, EXIT_PREEMPTED})
"""Exit codes of a worker that its agent restarts by design: never counted as a crash."""

ERROR_CHARS = 300
"""The last error is cut to this many characters in the stop line (its first line only)."""


@dataclass(frozen=True)
class Verdict:
    """``stop``: end the node with ``exit_code``, printing ``line``; else restart as usual."""

    stop: bool
    line: str = ""
    exit_code: int = EXIT_CRASH_LOOP


def one_line(error: str) -> str:
    """The part of an error worth one line: its last non-empty line (a traceback's exception)."""
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    text = lines[-1] if lines else "no error message"
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."


@dataclass
class CrashLoopPolicy:
    """Counts this node's worker failures (see the module docstring)."""

    max_failures_without_step: int = 3
    """Stop after this many failures in a row without a completed step (0: never stop for this)."""
    max_recoveries_without_checkpoint: int = 5
    """Stop after this many failures in a row without a newer committed checkpoint (0: never)."""
    failures_without_step: int = 0
    recoveries_without_checkpoint: int = 0
    checkpoint_step: int | None = None
    """The newest committed checkpoint step seen at the last failure (None: none known)."""
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_failures_without_step < 0 or self.max_recoveries_without_checkpoint < 0:
            raise ValueError("the crash-loop limits must be 0 (off) or more, got "
                             f"{self.max_failures_without_step} and {self.max_recoveries_without_checkpoint}")

    def progressed(self) -> None:
        """A worker of this node completed a step: failures without one start over."""
        self.failures_without_step = 0

    def failed(self, exitcode: int, error: str = "", *, progressed: bool = False,
               checkpoint_step: int | None = None) -> Verdict:
        """A worker of this node ended with ``exitcode`` (``error``: its message); ``progressed``:
        it completed a step before; ``checkpoint_step``: the newest committed checkpoint now
        (None: the run keeps none, or none yet)."""
        if exitcode in NOT_CRASHES:
            return Verdict(False)
        last = one_line(error) if error else f"exit code {exitcode}"
        self.errors.append(last)
        if exitcode == EXIT_USAGE:
            return Verdict(True, f"elastic-train: stopped: a worker exited {EXIT_USAGE} (a usage or device error "
                                 f"no restart can fix): {last}")
        if progressed:
            self.failures_without_step = 0
        else:
            self.failures_without_step += 1
        if checkpoint_step is None:  # no checkpoints (yet): the rule does not apply
            self.recoveries_without_checkpoint = 0
        elif self.checkpoint_step is not None and checkpoint_step <= self.checkpoint_step:
            self.recoveries_without_checkpoint += 1
        else:  # the first failure seen, or the checkpoint advanced since the last one
            self.recoveries_without_checkpoint = 0
            self.checkpoint_step = checkpoint_step
        k, m = self.max_failures_without_step, self.max_recoveries_without_checkpoint
        if k and self.failures_without_step >= k:
            return Verdict(True, f"elastic-train: stopped: the workers failed {self.failures_without_step} times in a "
                                 f"row without completing a step (a crash loop; restarting again would fail the "
                                 f"same way): {last}")
        if m and self.recoveries_without_checkpoint >= m:
            return Verdict(True, f"elastic-train: stopped: {m} recoveries in a row and the committed checkpoint "
                                 f"is still at step {self.checkpoint_step} (no durable progress): {last}")
        return Verdict(False)


# ---- the worker's side: one file at its first completed step ------------------------------------------
def mark_progress(folder: str | None = None) -> None:
    """Say that this process completed a step: create ``<folder>/<pid>`` (folder: ``ENV_PROGRESS_DIR``;
    nothing happens where it is not set). Cheap and idempotent; call it after the first step."""
    folder = folder if folder is not None else os.environ.get(ENV_PROGRESS_DIR)
    if folder:
        Path(folder, str(os.getpid())).touch()


def made_progress(folder: str, pid: int) -> bool:
    """The agent's question about a worker that failed: had it completed a step?"""
    return Path(folder, str(pid)).exists()


__all__ = ["CrashLoopPolicy", "ERROR_CHARS", "NOT_CRASHES", "Verdict", "made_progress", "mark_progress", "one_line"]
