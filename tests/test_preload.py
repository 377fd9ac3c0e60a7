"""The built-in trainer's workers are forked from a server that imported torch ahead (``preload.py``):
what such a worker really sees, and what the server may and may not have done before it forks.

Real processes: ``elastic-train`` on the embedded etcd with a task that reports the worker's view
(``tests/helpers/preload_probe.py``), and a fresh interpreter that imports what the server imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic_trainer import preload
from elastic_trainer.drill.nodes import workers
from tests.helpers.common import REPO, cli_cmd, wait_until

AWS_CANARY = "canaryAwsSecretK3y7"
WANDB_CANARY = "wandbcanary9876543210fedcba9876543210fedc"


@pytest.mark.timeout(300)
def test_a_forked_worker_sees_its_agents_environment_its_threads_and_no_secret(tmp_path, procs):
    out = tmp_path / "probe"
    out.mkdir()
    env = {**os.environ, "PROBE_OUT": str(out), "OMP_NUM_THREADS": "2", "AWS_ACCESS_KEY_ID": "AKIACANARY",
           "AWS_SECRET_ACCESS_KEY": AWS_CANARY, "WANDB_API_KEY": WANDB_CANARY, "PYTHONPATH": str(REPO)}
    trainer = ["--task", "tests.helpers.preload_probe:build", "--max-steps", "4", "--global-batch-size", "8",
               "--no-wandb", "--sleep-per-step", "0.5", "--samples", "64"]
    cli = procs.start(cli_cmd("--nnodes", "1", "--nproc-per-node", "2", "--run-id", "preload",
                              "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--", *trainer),
                      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reported = [out / f"rank{r}.json" for r in (0, 1)]
    wait_until(lambda: all(p.exists() for p in reported) or cli.poll() is not None, 180, "both workers' reports")
    # while they train: the drill's view of the node's workers is these two, not the server (drill/nodes.py)
    pids = sorted(json.loads(p.read_text())["pid"] for p in reported)
    assert sorted(workers(cli.pid)) == pids
    output, _ = cli.communicate(timeout=240)
    assert cli.returncode == 0, output[-3000:]
    reports = [json.loads(p.read_text()) for p in reported]
    fresh_start_method = subprocess.run([sys.executable, "-c", "import multiprocessing as m; print(m.get_start_method())"],
                                        capture_output=True, text=True, timeout=60).stdout.strip()
    for rank, seen in enumerate(reports):
        # forked from the launcher's fork server, which imported what the trainer needs ahead
        assert "multiprocessing.forkserver" in seen["parent_cmdline"], seen["parent_cmdline"]
        assert all(m in seen["parent_cmdline"] for m in preload.MODULES), seen["parent_cmdline"]
        assert seen["grandparent"] == cli.pid
        assert seen["sid"] == seen["pid"] != cli.pid  # a session of its own, as torch gives a subprocess
        environ = seen["environ"]
        # the agent's environment at the worker's start: the launcher's and the rendezvous's variables,
        # set after the server started; torch's variables for this worker on top
        assert environ["ELASTIC_TRAINER_AGENT_PID"] == str(cli.pid)
        assert environ["ELASTIC_TRAINER_RDZV_ROUND"] and environ["ELASTIC_TRAINER_LIVE"]
        assert environ["ELASTIC_TRAINER_CHECKPOINT_DIR"] == str(tmp_path / "ckpt")
        assert environ["RANK"] == str(rank) and environ["LOCAL_RANK"] == str(rank) and environ["WORLD_SIZE"] == "2"
        assert environ["PROBE_OUT"] == str(out)
        # the worker's threads, not the server's
        assert environ["OMP_NUM_THREADS"] == "2" and seen["threads"] == 2 and seen["product_finite"]
        # no secret, neither in what Python sees nor in the environment /proc shows (the server's at its start)
        assert "AWS_SECRET_ACCESS_KEY" not in environ and "WANDB_API_KEY" not in environ
        assert environ["AWS_SHARED_CREDENTIALS_FILE"]  # handed over in a file instead (cli/secrets.py)
        for text in (json.dumps(environ), seen["proc_environ"]):
            assert AWS_CANARY not in text and WANDB_CANARY not in text
        assert seen["argv"][1:] == trainer
        assert seen["start_method"] == fresh_start_method  # its DataLoader workers start as a new interpreter's
    assert reports[0]["ppid"] == reports[1]["ppid"]  # one server for the node's workers
    assert AWS_CANARY not in output and WANDB_CANARY not in output


def test_the_server_only_imports():
    """What the server runs before it forks: imports, no thread, no CUDA (not even a device count: the
    driver's initialization does not survive a fork), nothing that reads the launcher's later
    environment when imported (prometheus_client's multiprocess folder)."""
    code = ("import sys, threading, torch\n"
            "asked = []\n"
            "for name in ('device_count', 'is_available', 'init', 'current_device', 'get_device_capability'):\n"
            "    setattr(torch.cuda, name, lambda *a, _n=name, **k: asked.append(_n))\n"
            f"for m in {list(preload.MODULES)!r}: __import__(m)\n"
            "print(threading.active_count(), 'prometheus_client' in sys.modules, torch.cuda.is_initialized(), asked)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False", "False", "[]"], done.stdout


@pytest.mark.timeout(300)
def test_without_its_fork_server_the_trainer_starts_its_workers_as_new_interpreters(tmp_path, procs):
    """The server's socket lives under TMPDIR; a path longer than a Unix socket's 107 bytes (a pod's
    deep temporary folder) keeps it from starting: one line, and the workers start as before."""
    deep = tmp_path / ("t" * 110)
    deep.mkdir()
    env = {**os.environ, "TMPDIR": str(deep), "PYTHONPATH": str(REPO)}
    cli = procs.start(cli_cmd("--nnodes", "1", "--run-id", "deep", "--log-dir", str(tmp_path / "logs"),
                              "--checkpoint-dir", "", "--", "--task", "tests.helpers.task_fixture:build",
                              "--max-steps", "2", "--global-batch-size", "4", "--no-wandb", "--samples", "16"),
                      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = cli.communicate(timeout=240)
    assert cli.returncode == 0, output[-3000:]
    assert "the workers start as new interpreters: their fork server could not start" in output
    assert "finished at step 2" in output, output[-3000:]
