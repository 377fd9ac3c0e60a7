"""Preempting one node (SIGTERM to its agent) saves the step and the others go on without it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_trainer import records
from elastic_trainer.etcd.server import free_port
from elastic_trainer.records import Event
from tests.helpers.common import REPO, wait_until
from tests.helpers.runs import SEEDS_MSE, agent, latest, wait_for_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _preempt_one_of_two(etcd, run_id, procs, tmp_path, recovery: str):
    """Two nodes train together; node b gets SIGTERM (preemption). Returns (nodes, steps, the
    time of the signal, the last step at 2 ranks, node a's worker pids before the signal)."""
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    args = ("--max-steps", "100000", "--checkpoint-every", "1000", "--sleep-per-step", "0.2")
    outs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    nodes = [agent(procs, etcd, run_id, 1, ck, logs, *args, nnodes="1:2", out=out, recovery=recovery)
             for out in outs]
    wait_for_steps("a world of 2 at step 3", lambda st: any(s.world_size == 2 and s.step >= 3 for s in st),
                   logs, 240, nodes, outs)
    nodes[1].send_signal(signal.SIGTERM)  # node b is preempted
    t_term = time.time()
    nodes[1].wait(timeout=120)
    steps = wait_for_steps("node a training alone", lambda st: sum(s.world_size == 1 and s.time > t_term
                                                               for s in st) >= 3, logs, 240, nodes, outs)
    assert nodes[0].poll() is None, "the surviving node must keep training"
    stopped_at = max(s.step for s in steps if s.world_size == 2)
    # (the first agent up may have trained alone for a moment before the other joined)
    first_alone = min(s.step for s in steps if s.world_size == 1 and s.time > t_term)
    assert first_alone == stopped_at + 1, "the preempted step is kept: nothing is redone, nothing lost"
    return nodes, logs, ck, stopped_at


def _stop_survivor(nodes, logs: Path, ck: Path) -> None:
    nodes[0].send_signal(signal.SIGTERM)
    nodes[0].wait(timeout=120)
    assert nodes[0].returncode == 128 + signal.SIGTERM
    assert latest(ck)[0] == max(s.step for s in records.read_steps(logs)), "the survivor saves its last step"


def test_sigterm_to_one_node_saves_and_the_other_node_continues_alone(etcd, run_id, procs, tmp_path):
    """The restart path: both save the step, the survivor restarts its worker and loads it."""
    nodes, logs, ck, stopped_at = _preempt_one_of_two(etcd, run_id, procs, tmp_path, "restart")
    events = records.read_events(logs)
    assert any(e.event == Event.CHECKPOINT_LOADED and e.step == stopped_at for e in events)
    assert any(e.event == Event.STOP and e.reason == "a peer was stopped by a signal" for e in events)
    _stop_survivor(nodes, logs, ck)


def test_sigterm_to_one_node_under_live_recovery_leaves_the_survivor_training_in_its_own_process(
        etcd, run_id, procs, tmp_path):
    """The live path: the survivor keeps its worker process and its state; nothing is read from storage."""
    nodes, logs, ck, stopped_at = _preempt_one_of_two(etcd, run_id, procs, tmp_path, "live")
    steps = records.read_steps(logs)
    events = records.read_events(logs)
    assert not any(e.event == Event.CHECKPOINT_LOADED for e in events), "a live survivor reads no checkpoint"
    reforms = [e for e in events if e.event == Event.LIVE_REFORM and (e.old, e.new) == (2, 1)]
    assert reforms and reforms[0].step == stopped_at, reforms
    # the survivor's worker that trained at 2 ranks is the one that trains alone
    files = {f.pid: [r.world_size for r in records.read_file(f.path, records.StepRecord)]
             for f in records.step_files(logs)}
    assert any(1 in sizes and 2 in sizes for sizes in files.values()), files
    assert max(s.step for s in steps) > stopped_at + 2
    _stop_survivor(nodes, logs, ck)


def _two_rank_world(procs, tmp_path: Path, *trainer_args: str) -> tuple[list[subprocess.Popen], Path]:
    """Two trainer processes forming a gloo world directly (no agent), logging to tmp_path/logs;
    returns them once 6+ steps are logged."""
    port, logs = free_port(), tmp_path / "logs"
    workers = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        workers.append(procs.start([sys.executable, "-m", "elastic_trainer.train", *SEEDS_MSE,
                                    "--max-steps", "100000", "--sleep-per-step", "0.1", "--log-dir", str(logs),
                                    "--checkpoint-dir", str(tmp_path / "ck"), *trainer_args],
                                   cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    wait_until(lambda: records.read_steps(logs), 180, "6 steps of the two-rank world",
               until=lambda steps: len(steps) >= 6)
    return workers, logs


def test_sigterm_while_a_peer_is_frozen_exits_long_before_the_grace_period(procs, tmp_path):
    """torchrun stops the survivors' workers to re-rendezvous when a peer dies; a worker stuck in a
    collective with that peer cannot reach a step boundary, and must not sit out --grace-seconds."""
    workers, _ = _two_rank_world(procs, tmp_path, "--grace-seconds", "60")
    os.kill(workers[1].pid, signal.SIGSTOP)  # the peer is gone as far as the collective is concerned
    time.sleep(1.0)
    t0 = time.monotonic()
    workers[0].send_signal(signal.SIGTERM)
    _, err = workers[0].communicate(timeout=90)
    waited = time.monotonic() - t0
    assert workers[0].returncode == 128 + signal.SIGTERM
    assert "a peer is gone" in err
    assert waited < 30, f"took {waited:.1f}s, close to the 60 s grace"


def test_a_killed_peer_costs_no_step_rank_0_saves_the_last_completed_one(procs, tmp_path):
    """SIGKILL of a peer makes rank 0's collective fail; rank 0 saves the step it had completed
    (its state is consistent at that point under DDP) instead of going back to the last periodic save."""
    workers, logs = _two_rank_world(procs, tmp_path, "--checkpoint-every", "1000", "--sleep-per-step", "0.5")
    os.kill(workers[1].pid, signal.SIGKILL)
    _, err = workers[0].communicate(timeout=120)
    assert workers[0].returncode != 0
    logged = max(s.step for s in records.read_steps(logs) if s.rank == 0)
    # The kill lands between steps (--sleep-per-step): rank 0's next backward fails, and the
    # step it logged last is whole on every rank, so it saves that one.
    assert "saving the last completed step" in err, err[-2000:]
    step, state = latest(tmp_path / "ck")
    assert step == logged
    assert len(state["rng"]["ranks"]) == 1  # rank 0 saved alone: its own RNG state (training/rng.py)
