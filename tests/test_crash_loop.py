"""The crash-loop policy (``observability/crash_loop.py``): K failures without a completed step stop
the node, a step in between starts the count over, M recoveries without a newer committed
checkpoint stop it, a usage error stops it at once, the exits that are not crashes never count; the
stop line names the rule and the last error in one line. The progress marker is written by a real
separate process and read after it died, as the agent will.

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_crash_loop.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_trainer.env import (
    ENV_PROGRESS_DIR,
    EXIT_CRASH_LOOP,
    EXIT_ERROR,
    EXIT_EXCLUDED,
    EXIT_PEER_STOPPED,
    EXIT_PREEMPTED,
    EXIT_USAGE,
)
from elastic_trainer.observability.crash_loop import CrashLoopPolicy, made_progress, mark_progress, one_line
from tests.helpers.common import REPO

TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nRuntimeError: CUDA error: an illegal memory access\n'


def test_three_failures_without_a_step_stop_the_node_with_one_line_naming_the_last_error():
    policy = CrashLoopPolicy()
    assert not policy.failed(EXIT_ERROR, "ValueError: first").stop
    assert not policy.failed(EXIT_ERROR, "ValueError: second").stop
    verdict = policy.failed(EXIT_ERROR, TRACEBACK)
    assert verdict.stop and verdict.exit_code == EXIT_CRASH_LOOP == 79
    assert verdict.line == ("elastic-train: stopped: the workers failed 3 times in a row without completing a step "
                            "(a crash loop; restarting again would fail the same way): RuntimeError: CUDA error: "
                            "an illegal memory access")


def test_a_completed_step_between_failures_starts_the_count_over():
    policy = CrashLoopPolicy()
    for _ in range(10):
        assert not policy.failed(EXIT_ERROR, "boom").stop
        assert not policy.failed(EXIT_ERROR, "boom", progressed=True).stop
    policy.failed(EXIT_ERROR, "boom")
    policy.progressed()
    assert not policy.failed(EXIT_ERROR, "boom").stop and not policy.failed(EXIT_ERROR, "boom").stop


def test_exits_that_are_not_crashes_never_count():
    policy = CrashLoopPolicy(max_failures_without_step=1)
    for code in (0, EXIT_EXCLUDED, EXIT_PEER_STOPPED, EXIT_PREEMPTED) * 5:
        assert not policy.failed(code, "left out").stop
    assert policy.failed(EXIT_ERROR, "").line.endswith(": exit code 1")


def test_a_usage_error_stops_at_once():
    verdict = CrashLoopPolicy().failed(EXIT_USAGE, "error: --device cuda was asked for but torch sees no CUDA device")
    assert verdict.stop and "exited 2 (a usage or device error no restart can fix)" in verdict.line


def test_recoveries_that_never_advance_the_committed_checkpoint_stop_the_node():
    policy = CrashLoopPolicy(max_failures_without_step=0, max_recoveries_without_checkpoint=3)
    assert not policy.failed(EXIT_ERROR, "oom", progressed=True, checkpoint_step=100).stop
    assert not policy.failed(EXIT_ERROR, "oom", progressed=True, checkpoint_step=200).stop  # it advanced
    for _ in range(2):
        assert not policy.failed(EXIT_ERROR, "oom", progressed=True, checkpoint_step=200).stop
    verdict = policy.failed(EXIT_ERROR, "torch.OutOfMemoryError: CUDA out of memory", progressed=True,
                            checkpoint_step=200)
    assert verdict.stop and "3 recoveries in a row and the committed checkpoint is still at step 200" in verdict.line


def test_a_run_without_checkpoints_is_never_stopped_for_them():
    policy = CrashLoopPolicy(max_failures_without_step=0, max_recoveries_without_checkpoint=1)
    assert not any(policy.failed(EXIT_ERROR, "x", progressed=True, checkpoint_step=None).stop for _ in range(20))


def test_the_last_error_is_one_short_line():
    assert one_line(TRACEBACK) == "RuntimeError: CUDA error: an illegal memory access"
    assert len(one_line("E" * 1000)) == 300 and one_line("") == "no error message"
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        CrashLoopPolicy(max_failures_without_step=-1)


def test_a_worker_process_marks_its_progress_and_the_agent_reads_it_after_it_died(tmp_path, monkeypatch):
    def worker(steps: bool) -> int:
        code = "from elastic_trainer.observability.crash_loop import mark_progress\n" + \
               ("mark_progress(); mark_progress()\n" if steps else "") + "raise SystemExit(1)\n"
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                                env={**os.environ, ENV_PROGRESS_DIR: str(tmp_path)})
        assert proc.wait(timeout=60) == 1
        return proc.pid

    stepped, never = worker(True), worker(False)
    assert made_progress(str(tmp_path), stepped) and not made_progress(str(tmp_path), never)
    monkeypatch.delenv(ENV_PROGRESS_DIR, raising=False)
    mark_progress()  # not set: nothing happens anywhere
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(stepped)]
