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

Where the policy runs: in each worker at its start (``verdict_at_start``, called by the worker entries
``train.py`` and ``script.py`` before anything else), from files its predecessors left in a node-local
folder the launcher makes and names in ``ENV_PROGRESS_DIR`` (torch's agent gives its restart
decisions no hook; torchrun's restart count, ``TORCHELASTIC_RESTART_COUNT``, numbers the attempts):

- ``attempt-<n>.step``: a worker completed a step in attempt ``n`` (``mark_progress``: the Manager,
  after its first step of the attempt; nothing per step after that);
- ``attempt-<n>.failed-<pid>``: a worker of attempt ``n`` ended with an error (``mark_failure``: the
  worker entries, on an uncaught exception or a failing exit code), with its one-line error, the
  newest committed checkpoint it knew of and how long it ran.

A worker whose verdict is to stop runs nothing: it stops its node through the launcher's refusal
file (``runtime.stop_node``), and the launcher prints the verdict's line and exits ``EXIT_CRASH_LOOP``.
So the attempt that stops costs one worker start (about a second: no torch import before the check),
not a restart of the training. A worker killed by a signal (SIGKILL, the OOM killer) writes nothing
and is not counted.

Like NVIDIA's resiliency extension (which exits after repeated restarts without progress) and
TorchFT (``max_failures_per_step``), the measure is progress, not time.

Usage (a worker entry)::

    verdict = verdict_at_start()
    if verdict.stop:
        stop_node(verdict.line, exit_code=verdict.exit_code)   # never returns
    try:
        run()
    except Exception as exc:
        mark_failure(1, f"{type(exc).__name__}: {exc}"); raise
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
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
    WorkerEnv,
)
from elastic_trainer.runtime import exit_status, runtime, stop_node

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


# ---- the workers' side: files in the node's progress folder ------------------------------------------
PLAIN_PROGRESS_S = 60.0
"""A worker that never made a Manager has no step its node can see: one that ran this long before it
failed counts as having made progress (a plain script that trains for an hour and then loses a peer
is not in a crash loop)."""

_started = time.monotonic()
_managed = False
_marked: set[int] = set()


def _folder(folder: str | None) -> str | None:
    return folder if folder is not None else os.environ.get(ENV_PROGRESS_DIR)


def _attempt() -> int:
    """Which start of this node's workers this is: torchrun's restart count (0 first, one more after
    each failure; a membership change starts the workers again under the same count)."""
    return WorkerEnv.from_environ().restart_count or 0


def mark_managed() -> None:
    """This process trains through the Manager: its steps are seen (``mark_progress``), so its time
    alive is not taken for progress."""
    global _managed
    _managed = True


def mark_progress(folder: str | None = None) -> None:
    """Say that this worker completed a step in this attempt: create ``<folder>/attempt-<n>.step``
    (folder: ``ENV_PROGRESS_DIR``; nothing happens where it is not set). Cheap: once per attempt."""
    folder, n = _folder(folder), _attempt()
    if folder and n not in _marked:
        _marked.add(n)
        Path(folder, f"attempt-{n}.step").touch()


def mark_failure(exitcode: int, error: str, *, checkpoint_step: int | None = None, folder: str | None = None) -> None:
    """Say that this worker is ending with ``exitcode`` (``error``: its message; ``checkpoint_step``:
    the newest committed checkpoint it knew of): ``<folder>/attempt-<n>.failed-<pid>``, one JSON object.
    Exits that are not crashes (``NOT_CRASHES``) write nothing."""
    folder = _folder(folder)
    if not folder or exitcode in NOT_CRASHES:
        return
    record = {"exitcode": exitcode, "error": one_line(error), "checkpoint_step": checkpoint_step,
              "alive_s": round(time.monotonic() - _started, 3), "managed": _managed}
    try:
        Path(folder, f"attempt-{_attempt()}.failed-{os.getpid()}").write_text(json.dumps(record))
    except OSError:  # the folder is gone (the launcher ended): nobody is left to ask
        pass


def verdict_at_start(folder: str | None = None, policy: CrashLoopPolicy | None = None) -> Verdict:
    """At a worker's start: the policy's verdict on the attempts of this node before this one, from
    their files (an attempt without a failure file ended without a crash: a membership change, a
    worker left out of the live quorum; it is not counted). ``stop``: this worker must not run."""
    folder = _folder(folder)
    if not folder:
        return Verdict(False)
    policy = policy if policy is not None else CrashLoopPolicy()
    for n in range(_attempt()):
        records = []
        for path in sorted(Path(folder).glob(f"attempt-{n}.failed-*")):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        if not records:
            continue
        first = records[0]  # one failure per attempt: the agent restarts the node's workers together
        progressed = Path(folder, f"attempt-{n}.step").exists() or any(
            not r.get("managed") and r.get("alive_s", 0) >= PLAIN_PROGRESS_S for r in records)
        steps = [r["checkpoint_step"] for r in records if isinstance(r.get("checkpoint_step"), int)]
        verdict = policy.failed(int(first.get("exitcode", 1)), str(first.get("error", "")), progressed=progressed,
                                checkpoint_step=max(steps) if steps else None)
        if verdict.stop:
            return verdict
    return Verdict(False)


def stop_a_crash_loop() -> None:
    """At a worker's start: when this node's workers failed again and again without progress
    (``observability/crash_loop.py``), stop the node with the policy's line instead of running."""
    verdict = verdict_at_start()
    if verdict.stop:
        stop_node(verdict.line, exit_code=verdict.exit_code)


@contextlib.contextmanager
def failures_marked(checkpoint_step: Callable[[], int | None] = lambda: None,
                    expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Leave this worker's failure (an exception, or ``sys.exit`` with a failing code) in the node's
    progress folder for the crash-loop policy of the next attempt, then let it go on its way.
    ``expected``: exceptions its caller turns into exit codes of its own (not marked here)."""
    try:
        yield
    except expected:
        raise
    except SystemExit as exc:
        mark_failure(exit_status(exc.code), str(exc.code), checkpoint_step=checkpoint_step())
        raise
    except Exception as exc:
        code = runtime().exit_code_for(exc)  # e.g. LiveExcluded: EXIT_EXCLUDED, not a crash (never marked)
        mark_failure(1 if code is None else code, "".join(traceback.format_exception_only(exc)),
                                checkpoint_step=checkpoint_step())
        raise


__all__ = ["CrashLoopPolicy", "ERROR_CHARS", "NOT_CRASHES", "PLAIN_PROGRESS_S", "Verdict", "failures_marked",
           "mark_failure", "mark_managed", "mark_progress", "one_line", "stop_a_crash_loop", "verdict_at_start"]
