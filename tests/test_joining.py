"""Joining a run on one machine, as docs/usage.md's recipe does it: the first node's join command
(its program, arguments and no secret), the joiner check (a node that runs another program is
refused in one line before it touches the run: ``rendezvous/program.py``), and the embedded etcd
that outlives the node that started it (``etcd/keeper.py``)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic_trainer import records
from elastic_trainer.cli.join import join_command, program_of
from elastic_trainer.cli.launch import parse_run_config
from elastic_trainer.drill.nodes import descendants
from elastic_trainer.rendezvous.program import Program, ProgramMismatch, check
from tests.helpers.common import REPO, cli_cmd, wait_until

OWN_LOOP = REPO / "examples" / "own_loop.py"


def test_a_programs_first_difference_is_named():
    script = Program("the script train.py", "a" * 64, ("--lr", "3e-4"), recovery="live")
    same = Program("the script train.py", "a" * 64, ("--lr", "3e-4"), recovery="live")
    assert script.difference(same) is None
    assert script.difference(Program("the built-in trainer", "elastic_trainer 0.1.0", recovery="live")) == \
        "the script train.py here, the built-in trainer in the run"
    assert "code differs" in script.difference(Program("the script train.py", "b" * 64, ("--lr", "3e-4"),
                                                       recovery="live"))
    assert script.difference(Program("the script train.py", "a" * 64, ("--lr", "1e-3"), recovery="live")) == \
        "the arguments '--lr 3e-4' here, '--lr 1e-3' in the run"
    assert script.difference(Program("the script train.py", "a" * 64, ("--lr", "3e-4"))) == \
        "--recovery live here, --recovery restart in the run"
    trainer = Program("the built-in trainer", "v", settings={"--global-batch-size": "16", "--lr": "0.001"})
    assert trainer.difference(Program("the built-in trainer", "v", settings={"--global-batch-size": "8",
                                                                             "--lr": "0.001"})) == \
        "--global-batch-size 16 here, --global-batch-size 8 in the run"
    with pytest.raises(ProgramMismatch, match=r"run 'r' \(node n1\): a record this version .* cannot read"):
        check(script, {"n1": b"not json"}, "r")
    check(script, {"n1": same.to_json().encode()}, "r")


def test_the_built_in_trainers_node_local_flags_may_differ_and_the_others_may_not(tmp_path):
    base = ["--checkpoint-dir", str(tmp_path / "ck"), "--"]
    here = program_of(parse_run_config([*base, "--global-batch-size", "16", "--log-dir", "a", "--num-workers", "2",
                                        "--no-wandb", "--device", "cpu"]))
    other_node = program_of(parse_run_config([*base, "--global-batch-size", "16", "--log-dir", "b"]))
    assert here.difference(other_node) is None
    other_batch = program_of(parse_run_config([*base, "--global-batch-size", "8"]))
    assert here.difference(other_batch) == "--global-batch-size 16 here, --global-batch-size 8 in the run"


def test_the_join_command_runs_the_same_program_and_carries_no_secret(tmp_path):
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "train.py").write_text("import helpers\nfrom elastic_trainer import Manager\n")
    run = parse_run_config(["--nnodes", "1:3", "--run-id", "r", "--rdzv-conf", "last_call_timeout=1",
                            str(tmp_path / "train.py"), "--lr", "3e-4", "--name", "a b"])
    conf = {"user": "root", "password_file": str(tmp_path / "etcd-password")}
    printed = shlex.split(join_command(run, "127.0.0.1:2379", conf))
    assert printed[0] == "elastic-train"
    joiner = parse_run_config(printed[1:])  # pasted as printed
    assert joiner.program == run.program and joiner.recovery == run.recovery == "live"
    assert joiner.rdzv_endpoint == "127.0.0.1:2379" and joiner.rdzv_conf["last_call_timeout"] == "1"
    assert joiner.rdzv_conf["password_file"] == conf["password_file"] and "password" not in joiner.rdzv_conf
    before = program_of(run)
    assert program_of(joiner) == before
    (tmp_path / "helpers.py").write_text("X = 2\n")  # a module of its own changed: another program
    assert "code differs" in program_of(joiner).difference(before)
    builtin = parse_run_config(["--nnodes", "2", "--", "--global-batch-size", "16"])
    pasted = parse_run_config(shlex.split(join_command(builtin, "127.0.0.1:2379", conf))[1:])
    assert program_of(pasted) == program_of(builtin)
    assert pasted.checkpoint_dir == str(Path(builtin.checkpoint_dir).resolve())  # from any folder


def test_on_the_restart_path_a_wrong_joiner_writes_nothing_into_the_run_and_leaves_it_open(etcd, run_id, monkeypatch):
    """Two real handlers on a real etcd (restart path): the first node's round completes; a node
    with another program is refused at its first rendezvous without an alive or joining key (the
    running node would otherwise stop its workers for it), and its shutdown leaves the run open."""
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastic_trainer.env import ENV_PROGRAM
    from elastic_trainer.rendezvous.handler import create_handler
    from tests.helpers.common import etcd_conn

    def handler(program: Program):
        monkeypatch.setenv(ENV_PROGRAM, program.to_json())
        return create_handler(RendezvousParameters("etcd-v3", etcd.endpoint, run_id, 1, 2, local_addr="127.0.0.1",
                                                   last_call_timeout="0.5"))

    first = handler(Program("the script a.py", "1" * 64))
    wrong = handler(Program("the script a.py", "1" * 64, ("--lr", "1")))
    conn = etcd_conn(etcd)
    try:
        assert first.next_rendezvous().world_size == 1
        before = sorted(kv[1].key for kv in conn.client.get_prefix(f"/elastic-trainer/{run_id}/", keys_only=True))
        with pytest.raises(ProgramMismatch, match=r"the arguments '--lr 1' here, '\(none\)' in the run"):
            wrong.next_rendezvous()
        after = sorted(kv[1].key for kv in conn.client.get_prefix(f"/elastic-trainer/{run_id}/", keys_only=True))
        assert after == before and first.num_nodes_waiting() == 0
        assert wrong.shutdown() is False and not first.is_closed()
    finally:
        first.shutdown()
        conn.close()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _steps(log_dir: Path, pid: int) -> list[records.StepRecord]:
    return [s for path in log_dir.glob(f"steps/rank-*-{pid}.jsonl") for s in records.read_file(path, records.StepRecord)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_wrong_joiner_is_refused_and_the_run_outlives_the_node_that_started_its_etcd(tmp_path, procs):
    """examples/own_loop.py on a first node (the embedded etcd). (1) The issue's joiner, the printed
    command without its script (the built-in trainer), is refused in one line, exit status 2, and
    the first node's worker trains on, the same process, in a world of 1. (2) The command as printed
    joins. (3) The first node's whole process group is SIGKILLed: the joiner's worker trains on, the
    same process, at world 1 (the embedded etcd lives on with its keeper). (4) The joiner stopped,
    the keeper and etcd are gone within ``lease_ttl`` 3 s + ``GRACE`` 2 s + a poll, taken twice (15 s)."""
    first_out, joiner_out = tmp_path / "first.out", tmp_path / "joiner.out"
    logs = tmp_path / "logs"
    with open(first_out, "w") as f:
        first = procs.start(cli_cmd("--nnodes", "1:3", "--run-id", "join", "--log-dir", str(logs), "--checkpoint-dir",
                                    "", str(OWN_LOOP), "--epochs", "100000", "--sleep-per-step", "0.05"),
                            stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    printed = wait_until(lambda: re.search(r"join from another terminal with: (.*)", first_out.read_text()), 120,
                         "the join command", details=lambda: first_out.read_text()[-2000:]).group(1)
    password = (logs / "etcd-password").read_text().strip()
    assert password not in first_out.read_text() and "password_file=" in printed
    assert f"{OWN_LOOP} --epochs 100000 --sleep-per-step 0.05" in printed
    step_file = wait_until(lambda: list(logs.glob("steps/rank-0-*.jsonl")), 120, "the first worker's steps",
                           details=lambda: first_out.read_text()[-2000:])[0]
    worker = int(step_file.stem.rsplit("-", 1)[1])
    started = set(descendants(first.pid))
    keeper_and_etcd = {p for p in started if "etcd" in Path(f"/proc/{p}/cmdline").read_text()}
    assert len(keeper_and_etcd) == 2, keeper_and_etcd

    # (1) the printed command without its script: the built-in trainer, into a run of own_loop.py
    argv = shlex.split(printed)[1:]
    wrong = subprocess.run(cli_cmd(*argv[:argv.index(str(OWN_LOOP))], "--log-dir", str(tmp_path / "wrong")),
                           capture_output=True, text=True, timeout=180, cwd=tmp_path)
    errors = [line for line in wrong.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert wrong.returncode == 2 and len(errors) == 1, wrong.stderr[-3000:]
    assert "runs another program than run 'join'" in errors[0] and \
        "the built-in trainer here, the script own_loop.py in the run" in errors[0], errors[0]
    before = len(_steps(logs, worker))
    wait_until(lambda: len(_steps(logs, worker)), 60, "the first worker to step on", until=lambda n: n > before + 10)
    assert {s.world_size for s in _steps(logs, worker)} == {1} and list(logs.glob("steps/*.jsonl")) == [step_file]

    # (2) the command as printed joins; (3) the first node's process group is killed
    with open(joiner_out, "w") as f:
        joiner = procs.start(cli_cmd(*argv), stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    joined = tmp_path / "runs" / "join"  # the joiner's own log dir (the default, under its folder)
    wait_until(lambda: [s for p in joined.glob("steps/*.jsonl") for s in records.read_file(p, records.StepRecord)],
               180, "the joiner's steps at world 2", until=lambda st: any(s.world_size == 2 for s in st),
               details=lambda: joiner_out.read_text()[-2000:])
    joiner_worker = int(next(joined.glob("steps/*.jsonl")).stem.rsplit("-", 1)[1])
    os.killpg(first.pid, signal.SIGKILL)
    killed = time.time()
    first.wait(timeout=30)
    wait_until(lambda: _steps(joined, joiner_worker), 90, "the joiner's worker to step on at world 1 after the kill",
               until=lambda st: sum(s.time > killed and s.world_size == 1 for s in st) >= 10,
               details=lambda: joiner_out.read_text()[-3000:])
    assert all(_alive(p) for p in keeper_and_etcd), "the embedded etcd went with the node that started it"
    assert len(list(joined.glob("steps/*.jsonl"))) == 1, "the joiner's worker was replaced"
    assert not _alive(worker), "the first node's worker outlived its node"

    # (4) the last node stops: nothing of the run is left
    joiner.send_signal(signal.SIGTERM)
    joiner.wait(timeout=60)
    wait_until(lambda: not any(_alive(p) for p in keeper_and_etcd), 15, "the keeper and etcd to stop",
               details=lambda: (logs / "etcd-keeper.log").read_text()[-1000:])
    assert not (logs / "etcd-endpoint").exists()
