"""The crash-loop policy (``observability/crash_loop.py``): K failures without a completed step stop
the node, a step in between starts the count over, M recoveries without a newer committed
checkpoint stop it, a usage error stops it at once, the exits that are not crashes never count; the
stop line names the rule and the last error in one line. The progress marker is written by a real
separate process and read after it died, as the agent will.

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_crash_loop.py -q
"""

from __future__ import annotations

import json
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
from elastic_trainer.env import ENV_RESTART_COUNT
from elastic_trainer.observability import crash_loop
from elastic_trainer.observability.crash_loop import CrashLoopPolicy, one_line, verdict_at_start
from tests.helpers.common import REPO, cli_cmd

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


def _attempt(folder, n: int, body: str, expect: int, env: dict | None = None) -> int:
    """Attempt ``n`` of a node's worker, as torchrun numbers it: a real process running ``body``
    inside the worker entries' ``failures_marked``; its pid."""
    code = ("import sys\nfrom elastic_trainer.observability.crash_loop import mark_progress, mark_managed\n"
            "from elastic_trainer.observability.crash_loop import failures_marked\n"
            "with failures_marked(lambda: 7):\n" + "".join(f"    {line}\n" for line in body.splitlines()))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.DEVNULL,
                            env={**os.environ, ENV_PROGRESS_DIR: str(folder), ENV_RESTART_COUNT: str(n), **(env or {})})
    assert proc.wait(timeout=60) == expect
    return proc.pid


def _verdict_at(folder, n: int, monkeypatch):
    monkeypatch.setenv(ENV_PROGRESS_DIR, str(folder))
    monkeypatch.setenv(ENV_RESTART_COUNT, str(n))
    return verdict_at_start()


def test_workers_leave_their_failures_and_steps_and_the_next_attempt_reads_them(tmp_path, monkeypatch):
    """Three attempts that raise before a step: the fourth is told to stop, naming the last error;
    a step in an attempt between starts the count over; an exit that is not a crash is not counted."""
    fails = "raise RuntimeError('CUDA error: an illegal memory access')"
    for n in range(3):
        _attempt(tmp_path, n, fails, 1)
        assert not _verdict_at(tmp_path, n, monkeypatch).stop
    verdict = _verdict_at(tmp_path, 3, monkeypatch)
    assert verdict.stop and verdict.exit_code == EXIT_CRASH_LOOP, verdict
    assert "failed 3 times in a row" in verdict.line and "RuntimeError: CUDA error: an illegal memory access" in verdict.line

    other = tmp_path / "other"
    other.mkdir()
    _attempt(other, 0, fails, 1)
    _attempt(other, 1, "mark_managed(); mark_progress(); mark_progress()\n" + fails, 1)  # a step, then the error
    _attempt(other, 2, f"sys.exit({EXIT_EXCLUDED})", EXIT_EXCLUDED)  # left out of the quorum: no crash
    _attempt(other, 3, fails, 1)
    _attempt(other, 4, fails, 1)
    assert not _verdict_at(other, 5, monkeypatch).stop, "2 failures in a row since the step"
    _attempt(other, 5, "sys.exit(3)", 3)
    assert _verdict_at(other, 6, monkeypatch).stop
    assert sorted(p.name.split(".")[1].split("-")[0] for p in other.iterdir()) == \
        ["failed", "failed", "failed", "failed", "failed", "step"]  # attempt 2 left nothing


def test_a_plain_script_that_ran_a_while_before_failing_counts_as_progress(tmp_path, monkeypatch):
    """Without the Manager no step is seen: a worker that ran PLAIN_PROGRESS_S before it failed made
    progress (a peer lost an hour in); one of a Manager's is judged by its steps alone."""
    monkeypatch.setattr(crash_loop, "PLAIN_PROGRESS_S", 0.5)
    (tmp_path / "attempt-0.failed-1").write_text(json.dumps({"exitcode": 1, "error": "x", "alive_s": 0.6, "managed": False}))
    (tmp_path / "attempt-1.failed-2").write_text(json.dumps({"exitcode": 1, "error": "x", "alive_s": 0.1, "managed": False}))
    (tmp_path / "attempt-2.failed-3").write_text(json.dumps({"exitcode": 1, "error": "x", "alive_s": 0.1, "managed": False}))
    assert not _verdict_at(tmp_path, 3, monkeypatch).stop  # the first one had made progress
    (tmp_path / "attempt-0.failed-1").write_text(json.dumps({"exitcode": 1, "error": "x", "alive_s": 99, "managed": True}))
    assert _verdict_at(tmp_path, 3, monkeypatch).stop


def test_the_launcher_stops_a_script_that_raises_at_its_first_step_with_exit_79_and_one_line(tmp_path):
    """Point 5 of the operations issue: measured before, 100 restarts over 130 s and the error
    printed 202 times, with no line saying why the job stopped."""
    script = tmp_path / "bad.py"
    script.write_text("import torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "raise RuntimeError('CUDA error: an illegal memory access (a broken GPU)')\n")
    proc = subprocess.run(cli_cmd("--nnodes", "1", "--nproc-per-node", "1", "--recovery", "restart",
                                  "--log-dir", str(tmp_path / "logs"), str(script)),
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CRASH_LOOP, out[-3000:]
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert last.startswith("elastic-train: stopped: the workers failed 3 times in a row") and \
        last.endswith("RuntimeError: CUDA error: an illegal memory access (a broken GPU)"), last
    assert out.count("Traceback") == 3, "three attempts ran the script, the fourth stopped the node before it"
    assert not list((tmp_path / "logs").glob("progress-*")), "the launcher removes its progress folder"
