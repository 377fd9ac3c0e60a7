"""The launcher rejects bad input with one line, status 2, no traceback, within 5 s."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from elastic_trainer import cli
from tests.conftest import cli_cmd

BAD_INPUTS = {
    "min_above_max": (["--min-nodes", "3", "--max-nodes", "1"], "--max-nodes (1) must be at least --min-nodes (3)"),
    "min_not_a_number": (["--min-nodes", "a"], "--min-nodes must be a whole number"),
    "nnodes_three_parts": (["--nnodes", "1:2:3"], "--nnodes takes N or MIN:MAX"),
    "nproc_zero": (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    "missing_script": (["/nonexistent/train.py"], "does not exist"),
    "nnodes_and_min": (["--nnodes", "1:2", "--min-nodes", "1"], "not both"),
    "bad_run_id": (["--run-id", "a b"], "--run-id"),
    "bad_rdzv_conf": (["--rdzv-conf", "novalue"], "key=value"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_flags_are_one_line_errors_in_process(name, capsys):
    argv, expected = BAD_INPUTS[name]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("elastic-train: error:") and expected in err


def _run_cli(argv, env=None, timeout=60):
    """Run the CLI; a hang (the join timeout is minutes) fails by ``timeout``, which is wide
    on purpose: interpreter start alone took seconds on a loaded 2-core CI box."""
    start = time.monotonic()
    proc = subprocess.run(cli_cmd(*argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc, time.monotonic() - start


@pytest.mark.parametrize("name", ["min_above_max", "nnodes_three_parts", "missing_script"])
def test_bad_flags_are_one_line_errors_as_a_subprocess(name):
    argv, expected = BAD_INPUTS[name]
    proc, _ = _run_cli(argv)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_endpoint_is_reported_not_waited_on(tmp_path):
    # A loopback listener that accepts but never answers: the probe (5 s budget) must time
    # out with a one-line error instead of waiting out the join timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        proc, _ = _run_cli(["--rdzv-endpoint", f"127.0.0.1:{port}", "--checkpoint-dir", str(tmp_path)])
    assert proc.returncode == 2, proc.stderr
    assert "--rdzv-endpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_closed_port_endpoint_is_reported(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with-block ends
    proc, _ = _run_cli(["--rdzv-endpoint", f"127.0.0.1:{port}", "--checkpoint-dir", str(tmp_path)])
    assert proc.returncode == 2 and "no etcd answered" in proc.stderr


def test_unwritable_checkpoint_dir_is_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc, _ = _run_cli(["--checkpoint-dir", str(blocker / "sub")])
    assert proc.returncode == 2 and "--checkpoint-dir" in proc.stderr and "not writable" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_etcd_binary_says_how_to_install(tmp_path):
    proc, _ = _run_cli(["--checkpoint-dir", str(tmp_path)], env={"ELASTIC_TRAINER_ETCD_BINARY": "/nonexistent/etcd",
                                                                 "PATH": "/nonexistent"})
    assert proc.returncode == 2 and "apt-get install" in proc.stderr


def test_nnodes_sets_min_and_max():
    run = cli.parse_run_config(["--nnodes", "2:4", "--nproc-per-node", "3"])
    assert (run.min_nodes, run.max_nodes, run.nproc_per_node) == (2, 4, 3)
    assert run.program[:2] == ["-m", "elastic_trainer.train"]
    assert run.embedded_etcd


def test_trainer_flags_after_double_dash_reach_the_builtin_trainer():
    run = cli.parse_run_config(["--min-nodes", "1", "--", "--max-steps", "5"])
    assert run.program == ["-m", "elastic_trainer.train", "--max-steps", "5"]


def test_script_and_its_arguments_are_passed_like_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run = cli.parse_run_config(["--nnodes", "1", str(script), "--lr", "3"])
    assert run.program == ["-u", str(script), "--lr", "3"]
