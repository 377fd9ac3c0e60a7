"""The launcher rejects bad input, its own flags and the built-in trainer's after ``--``, with one
line, status 2, no traceback, within seconds, before it starts anything."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from elastic_trainer import cli
from elastic_trainer.cli import launch
from tests.helpers.common import cli_cmd

BAD_INPUTS = {
    "min_above_max": (["--min-nodes", "3", "--max-nodes", "1"], "--max-nodes (1) must be at least --min-nodes (3)"),
    "min_not_a_number": (["--min-nodes", "a"], "--min-nodes must be a whole number"),
    "nnodes_three_parts": (["--nnodes", "1:2:3"], "--nnodes takes N or MIN:MAX"),
    "nproc_zero": (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    "missing_script": (["/nonexistent/train.py"], "does not exist"),
    "nnodes_and_min": (["--nnodes", "1:2", "--min-nodes", "1"], "not both"),
    "bad_run_id": (["--run-id", "a b"], "--run-id"),
    "bad_rdzv_conf": (["--rdzv-conf", "novalue"], "key=value"),
    "umask_not_octal": (["--umask", "089"], "--umask takes an octal mask"),
    # the built-in trainer's flags after `--` are checked by the launcher, with the trainer's parser
    "trainer_batch_zero": (["--", "--global-batch-size", "0"],
                           "trainer: --global-batch-size must be a positive number"),
    "trainer_unknown_flag": (["--", "--bogus", "1"], "trainer: unrecognized arguments: --bogus 1"),
    "trainer_not_a_number": (["--", "--lr", "fast"], "trainer: argument --lr: invalid float value: 'fast'"),
    "trainer_every_zero": (["--", "--checkpoint-every", "0"], "trainer: --checkpoint-every must be a positive number"),
    "trainer_bad_choice": (["--nnodes", "1", "--", "--device", "tpu"], "trainer: argument --device: invalid choice"),
    "checkpoint_dir_gcs": (["--checkpoint-dir", "gs://bucket/run"],
                           "'gs://bucket/run': checkpoints cannot be committed atomically on gs://"),
    "checkpoint_dir_twice": (["--checkpoint-dir", "a", "--", "--checkpoint-dir", "b"],
                             "--checkpoint-dir is given twice, 'a' before `--` and 'b' after it"),
}


@pytest.fixture
def nothing_launched(monkeypatch):
    """Fail the test if the launcher gets as far as starting etcd and the agent."""
    def run_node(run):
        raise AssertionError(f"launched {run.program} despite bad input")
    monkeypatch.setattr(launch, "run_node", run_node)


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_flags_are_one_line_errors_in_process(name, capsys, nothing_launched):
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


@pytest.mark.parametrize("name", ["min_above_max", "nnodes_three_parts", "missing_script", "trainer_batch_zero"])
def test_bad_flags_are_one_line_errors_as_a_subprocess(name):
    argv, expected = BAD_INPUTS[name]
    proc, elapsed = _run_cli(argv)
    assert proc.returncode == 2
    assert elapsed < 30, f"{elapsed:.1f} s"  # seconds, not the start of every worker (wide: a loaded CI box)
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


def test_unwritable_checkpoint_dir_after_double_dash_is_reported_before_launching(tmp_path, capsys,
                                                                                  nothing_launched):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli.main(["--", "--checkpoint-dir", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--checkpoint-dir" in err and "not writable" in err


def test_missing_etcd_binary_says_how_to_install(tmp_path):
    proc, _ = _run_cli(["--checkpoint-dir", str(tmp_path)], env={"ELASTIC_TRAINER_ETCD_BINARY": "/nonexistent/etcd",
                                                                 "PATH": "/nonexistent"})
    assert proc.returncode == 2 and "apt-get install" in proc.stderr


def test_umask_is_private_by_default_and_can_be_opened_up():
    assert launch.parse_run_config([]).umask == 0o077
    assert launch.parse_run_config(["--umask", "027"]).umask == 0o027


def test_nnodes_sets_min_and_max():
    run = launch.parse_run_config(["--nnodes", "2:4", "--nproc-per-node", "3"])
    assert (run.min_nodes, run.max_nodes, run.nproc_per_node) == (2, 4, 3)
    assert run.program[:2] == ["-m", "elastic_trainer.train"]
    assert run.embedded_etcd


def test_trainer_flags_after_double_dash_reach_the_builtin_trainer():
    run = launch.parse_run_config(["--min-nodes", "1", "--", "--max-steps", "5"])
    assert run.program == ["-m", "elastic_trainer.train", "--max-steps", "5"]


def test_checkpoint_and_log_dirs_are_taken_before_or_after_double_dash_with_one_default():
    run = launch.parse_run_config(["--run-id", "r1"])
    assert (run.checkpoint_dir, run.log_dir) == ("checkpoints/r1", "runs/r1")
    run = launch.parse_run_config(["--checkpoint-dir", "s3://b/c", "--log-dir", "L"])
    assert (run.checkpoint_dir, run.log_dir) == ("s3://b/c", "L")
    run = launch.parse_run_config(["--", "--checkpoint-dir", "s3://b/c", "--log-dir", "L"])
    assert (run.checkpoint_dir, run.log_dir) == ("s3://b/c", "L")
    assert run.program == ["-m", "elastic_trainer.train", "--checkpoint-dir", "s3://b/c", "--log-dir", "L"]
    run = launch.parse_run_config(["--checkpoint-dir", "same", "--", "--checkpoint-dir", "same"])
    assert run.checkpoint_dir == "same"
    for argv in (["--checkpoint-dir", ""], ["--", "--checkpoint-dir", ""]):  # empty: no checkpoints, either side
        run = launch.parse_run_config(argv)
        assert run.checkpoint_dir == "" and run.trainer.checkpoint_dir is None, argv


def test_a_scripts_flags_are_its_own_and_not_checked_as_the_trainers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run = launch.parse_run_config([str(script), "--", "--global-batch-size", "0"])
    assert run.program == ["-u", str(script), "--global-batch-size", "0"]


def test_script_and_its_arguments_are_passed_like_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run = launch.parse_run_config(["--nnodes", "1", str(script), "--lr", "3"])
    assert run.program == ["-u", str(script), "--lr", "3"]


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    """An etcd on loopback that serves client TLS and requires a client certificate: (server, certs)."""
    from elastic_trainer.etcd.server import EtcdServer
    from tests.helpers.tls_certs import make_certs

    certs = make_certs(tmp_path_factory.mktemp("certs"))
    data = tmp_path_factory.mktemp("etcd-tls") / "data"
    server = EtcdServer(data_dir=data, log_path=data.with_suffix(".log"), extra_args=[
        "--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server-key.pem"),
        "--trusted-ca-file", str(certs / "ca.pem"), "--client-cert-auth"])
    server.start()
    try:
        yield server, certs
    finally:
        server.stop()


def _tls_conf(certs, client: bool = True) -> str:
    conf = f"protocol=https,ca_cert={certs / 'ca.pem'}"
    return conf + (f",cert={certs / 'client.pem'},key={certs / 'client-key.pem'}" if client else "")


@pytest.mark.timeout(60)
def test_start_check_reaches_an_etcd_that_requires_client_certificates(tls_etcd, tmp_path):
    # k8s (etcd serves client TLS by default): the start-up check must speak TLS with the --rdzv-conf certificates,
    # as the rendezvous will, instead of failing every pod with status 2.
    server, certs = tls_etcd
    run = launch.parse_run_config(["--rdzv-endpoint", server.endpoint, "--rdzv-conf", _tls_conf(certs),
                                "--checkpoint-dir", str(tmp_path)])
    launch.check_environment(run)


@pytest.mark.timeout(60)
def test_start_check_against_tls_etcd_without_a_client_certificate_names_the_tls_options(tls_etcd, tmp_path):
    server, certs = tls_etcd
    for conf in (_tls_conf(certs, client=False), ""):
        run = launch.parse_run_config(["--rdzv-endpoint", server.endpoint, "--rdzv-conf", conf,
                                    "--checkpoint-dir", str(tmp_path)])
        with pytest.raises(cli.UsageError, match="no etcd answered.*TLS options"):
            launch.check_environment(run)


def test_bad_rendezvous_options_are_reported_at_start(tmp_path):
    run = launch.parse_run_config(["--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "protocol=https",
                                "--checkpoint-dir", str(tmp_path)])
    with pytest.raises(cli.UsageError, match="--rdzv-conf: protocol=https needs ca_cert"):
        launch.check_environment(run)


def test_a_node_that_finds_the_run_closed_ends_with_success(tmp_path, monkeypatch, capsys):
    """A spare pod beyond --max-nodes, or a pod that arrives after the run finished, finds the
    rendezvous closed: it has nothing to do, and a failure status would make its Job recreate it
    (which could reopen the finished run alone)."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    def closed(config, entrypoint):
        def run(*args):
            raise RendezvousClosedError("the rendezvous of run 'r' is closed (the job finished or was shut down)")
        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", closed)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # elastic-train exports the run's variables
    assert cli.main(["--rdzv-backend", "c10d", "--checkpoint-dir", str(tmp_path / "c"),
                     "--log-dir", str(tmp_path / "logs"), "--recovery", "restart"]) == 0
    assert "closed" in capsys.readouterr().err


# ------------------------------------------------------- what NCCL does on an error, as a worker sees it

NCCL_PROBE = '''
import os
from pathlib import Path

from tests.helpers import task_fixture


def build(args):
    value = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "<unset>")
    Path(os.environ["NCCL_PROBE_OUT"], "rank" + os.environ["RANK"]).write_text(value)
    return task_fixture.build(args)
'''


def _worker_nccl_error_handling(tmp_path, name: str, *flags: str, env: dict | None = None) -> tuple[str, str]:
    """Run a one-step job under `elastic-train` whose task records the worker's
    TORCH_NCCL_ASYNC_ERROR_HANDLING; return (that value, the launcher's stderr)."""
    from tests.helpers.common import REPO

    probe, out = tmp_path / f"probe_{name}.py", tmp_path / f"out_{name}"
    probe.write_text(NCCL_PROBE)
    out.mkdir()
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    proc = subprocess.run(
        cli_cmd("--nnodes", "1", "--nproc-per-node", "1", "--run-id", name, "--log-dir", str(tmp_path / name),
                "--checkpoint-dir", str(tmp_path / f"ck_{name}"), "--rdzv-conf", "last_call_timeout=1", *flags,
                "--", "--task", f"{probe}:build", "--global-batch-size", "8", "--max-steps", "1", "--no-wandb",
                "--no-progress"),
        capture_output=True, text=True, timeout=180, cwd=REPO,
        env={**environ, "NCCL_PROBE_OUT": str(out), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (out / "rank0").read_text(), proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_live_workers_keep_the_process_on_an_nccl_error_and_a_users_value_is_kept_with_a_warning(tmp_path):
    """torchrun's agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (end the process on an
    NCCL error) unless the agent's own environment has it, which would turn live recovery into
    restarts on GPUs: in live mode the launcher sets clean-up-only (2) there; a user's value wins,
    with a one-line warning."""
    warning = "turns live recovery into restarts"
    seen, err = _worker_nccl_error_handling(tmp_path, "live", "--recovery", "live")
    assert seen == "2" and warning not in err
    seen, err = _worker_nccl_error_handling(tmp_path, "user", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert seen == "1"
    assert len([line for line in err.splitlines() if warning in line]) == 1, err[-3000:]
