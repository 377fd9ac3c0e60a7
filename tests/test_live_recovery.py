"""Live recovery: survivors keep their processes and state when a node is lost or added.

Real ``elastic-train --recovery live`` agents (torchrun's elastic agent, our etcd-v3 rendezvous in
live mode) on a real etcd, real workers, real SIGKILL and SIGSTOP of whole nodes (process groups).
What is asserted is read back from the trainer's own logs: the step logs (one file per worker
process, so a worker that keeps its pid across a fault kept its process), the events and the
sample ledger.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elastic_trainer import records
from elastic_trainer.records import Event
from tests.helpers.common import REPO, cli_cmd
from tests.helpers.live import agent_of, current_ranks, kill_node, live_agent, steps_of, two_members, wait_steps
from tests.helpers.runs import CONF, baseline, check_equivalence, final_batches, latest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_live_run_that_loses_two_nodes_and_gains_one_keeps_survivors_and_matches_an_uninterrupted_run(
        etcd, run_id, procs, tmp_path):
    """Kill a non-rank-0 node, add a node, kill rank 0's node: every survivor keeps its process and
    its state (no checkpoint read, 0 steps redone), the newcomer gets its state from a live peer,
    every sample is used exactly once, and the end state equals an uninterrupted run's."""
    total = 60
    base_model, base_loss, base_ledger = baseline(tmp_path, total)
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(4)]
    args = ("--max-steps", str(total), "--sleep-per-step", "0.1")
    agents = [live_agent(procs, etcd, run_id, ck, logs, outs[i], *args) for i in range(3)]

    st = wait_steps("a world of 3 at step 5", lambda st: any(s["world_size"] == 3 and s["step"] >= 5 for s in st),
                    logs, 120, outs)
    ranks = current_ranks(st)
    victim, t_kill, st = kill_node(ranks[2], agents, logs, outs, 2, 6)
    survivors = {ranks[0], ranks[1]}
    assert {s["pid"] for s in st if s["world_size"] == 2} == survivors  # the same processes

    agents.append(live_agent(procs, etcd, run_id, ck, logs, outs[3], *args))
    t_join = time.time()
    st = wait_steps("a world of 3 after the join", lambda st: sum(
        s["world_size"] == 3 and s["time"] > t_join for s in st) >= 6, logs, 120, outs)
    newcomer = {s["pid"] for s in st if s["world_size"] == 3 and s["time"] > t_join} - survivors
    assert len(newcomer) == 1

    ranks = current_ranks(st)
    rank0_agent = agent_of(ranks[0], agents)
    os.killpg(rank0_agent.pid, signal.SIGKILL)
    t_kill0 = time.time()
    for a in agents:
        if a not in (victim, rank0_agent):
            assert a.wait(timeout=200) == 0, [o.read_text()[-3000:] for o in outs]

    st = steps_of(logs)
    final_pids = {s["pid"] for s in st if s["time"] > t_kill0}
    assert final_pids == {ranks[1], ranks[2]}  # again the survivors' own processes
    by_pid: dict[int, list[int]] = {}
    for s in sorted(st, key=lambda s: s["time"]):
        by_pid.setdefault(s["pid"], []).append(s["step"])
    for pid, steps in by_pid.items():  # no process redid a step: each logged strictly increasing steps
        assert steps == sorted(set(steps)), (pid, steps)
    assert max(s["step"] for s in st) == total

    events = records.read_events(logs)
    kinds = [e.event for e in events]
    assert Event.CHECKPOINT_LOADED not in kinds  # nothing was read from storage
    reforms = [e for e in events if e.event == Event.LIVE_REFORM]
    assert [(e.old, e.new) for e in reforms] == [(3, 2), (2, 3), (3, 2)], reforms
    assert reforms[1].receivers == [2]  # the newcomer got the state over the new group
    # the join's group formed beside the survivors' while they trained (group_ahead.py); the kills' did not
    assert [e.ahead for e in reforms] == [False, True, False], reforms
    peer = [e for e in events if e.event == Event.PEER_STATE_LOADED]
    assert len(peer) <= 1  # logged by rank 0 only; the newcomer's own line is in its log:
    assert "received the training state of step" in outs[3].read_text()
    # its model and optimizer came while the first step at 3 ran (it took that step at weight zero,
    # without samples: the ledger below is still the uninterrupted run's)
    assert "this rank's model and optimizer" in outs[3].read_text() and \
        "came while its first step ran" in outs[3].read_text(), outs[3].read_text()[-3000:]
    for e in reforms:
        assert e.total_s < 5, e

    # every step consumed the uninterrupted run's global batch, each sample once
    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    for s in st:
        if "loss_scope" not in s:
            assert abs(s["loss"] - base_loss[s["step"]]) <= 1e-5 * abs(base_loss[s["step"]]), s
    step, state = latest(ck)
    assert step == total and state["meta"]["world_size"] == 2
    check_equivalence(state["model"], base_model, total)


def test_a_member_killed_while_a_joins_group_forms_ahead_takes_the_newcomer_into_the_survivors_re_form(
        etcd, run_id, procs, tmp_path):
    """A node joins 2 nodes; while the members' group with it forms ahead (``group_ahead.py``: they
    train on, then switch at an agreed step), one member's node is killed. The survivor's collective
    fails, it drops the group made ahead, and its re-form from the agreed quorum takes the newcomer in
    (whose wait for the state failed: it re-formed with step -1 and receives the state over the new
    group). Nothing is redone or lost: the end state equals an uninterrupted run's."""
    total = 36
    base_model, base_loss, base_ledger = baseline(tmp_path, total)
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(3)]
    args = ("--max-steps", str(total), "--sleep-per-step", "0.2")  # the switch comes a step (0.2 s) after the line below
    agents = [live_agent(procs, etcd, run_id, ck, logs, outs[i], *args) for i in range(2)]
    st = wait_steps("a world of 2 at step 3", lambda st: any(s["world_size"] == 2 and s["step"] >= 3 for s in st),
                    logs, 120, outs)
    ranks = current_ranks(st)
    rank0_out = outs[agents.index(agent_of(ranks[0], agents))]
    agents.append(live_agent(procs, etcd, run_id, ck, logs, outs[2], *args))
    deadline = time.monotonic() + 120
    while "its group forms beside" not in rank0_out.read_text():  # the join's quorum agreed: its group forms
        assert time.monotonic() < deadline, [o.read_text()[-3000:] for o in outs]
        time.sleep(0.005)
    victim = agent_of(ranks[1], agents)
    os.killpg(victim.pid, signal.SIGKILL)
    t_kill = time.time()
    for a in agents:
        if a is not victim:
            assert a.wait(timeout=200) == 0, [o.read_text()[-3000:] for o in outs]

    st = steps_of(logs)
    after = {s["pid"] for s in st if s["time"] > t_kill}
    assert ranks[0] in after and len(after) == 2, after  # the survivor's own process, and the newcomer
    by_pid: dict[int, list[int]] = {}
    for s in sorted(st, key=lambda s: s["time"]):
        by_pid.setdefault(s["pid"], []).append(s["step"])
    for pid, steps in by_pid.items():
        assert steps == sorted(set(steps)), (pid, steps)
    events = records.read_events(logs)
    assert Event.CHECKPOINT_LOADED not in [e.event for e in events]
    reforms = [e for e in events if e.event == Event.LIVE_REFORM]
    assert [(e.old, e.new, e.receivers, e.ahead) for e in reforms] == [(2, 2, [1], False)], reforms
    assert "received the training state of step" in outs[2].read_text()
    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    step, state = latest(ck)
    assert step == total
    check_equivalence(state["model"], base_model, total)


def test_an_agent_stopped_past_its_lease_keeps_its_node_and_its_worker_trains_on(etcd, run_id, procs, tmp_path):
    """Only the agent stops (its worker, in a session of its own, runs on): the worker renews the
    node's lease while its agent's renewals are late (rendezvous/node_lease.py), so the lease never
    expires, no worker is stopped or replaced and the agent finds its lease alive when it resumes
    (before the node's lease was shared, the agent took a new lease and the worker kept its own;
    before that, the agent stopped its healthy worker: two re-forms and a newcomer for nothing)."""
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(2)]
    args = ("--max-steps", "100000", "--sleep-per-step", "0.1")
    agents = [live_agent(procs, etcd, run_id, ck, logs, outs[i], *args, nnodes="2:2") for i in range(2)]
    st = wait_steps("a world of 2 at step 3", lambda st: any(s["world_size"] == 2 and s["step"] >= 3 for s in st),
                    logs, 120, outs)
    workers = set(current_ranks(st).values())
    stopped = agent_of(current_ranks(st)[1], agents)
    os.killpg(stopped.pid, signal.SIGSTOP)
    time.sleep(6)  # twice the lease
    os.killpg(stopped.pid, signal.SIGCONT)
    t_resume = time.time()
    st = wait_steps("3 s of steps after the agent resumed", lambda st: any(s["time"] > t_resume + 3 for s in st),
                    logs, 60, outs)
    assert {s["pid"] for s in st} == workers, "a worker was replaced"
    assert {s["round"] for s in st} == {st[0]["round"]} and {s["world_size"] for s in st} == {2}
    text = outs[agents.index(stopped)].read_text()
    assert "expired" not in text and "stopping its workers" not in text, text[-3000:]
    assert "renews it for its agent" in text, "the worker must have renewed the node's lease: " + text[-3000:]


def test_the_watcher_tells_a_lost_process_within_a_poll_and_calls_the_abort_hook(etcd, run_id):
    """NCCL collectives may hang on a dead peer instead of failing, so on CUDA the Manager sets
    ``probe_peers`` (``on_member_lost`` aborts the group): the watcher must call it as soon as a member of
    another node is gone (its probe port refuses: what the kernel does when a process dies), long
    before the member's lease (3 s) expires. Real etcd, two members of two nodes in one process."""
    with two_members(etcd, run_id) as groups:
        a, b = groups
        calls: list[tuple[float, str]] = []
        a.on_member_lost = lambda why: calls.append((time.monotonic(), why))
        a.probe_peers = True  # what the Manager sets on CUDA
        a.start_watching()
        time.sleep(0.5)
        assert calls == [] and not a.change_pending.is_set(), "no loss while both members live"
        b.probe.close()  # what the kernel does to a killed process's listening socket
        t_gone = time.monotonic()
        end = t_gone + 2.0
        while not calls and time.monotonic() < end:
            time.sleep(0.01)
        assert calls, "the watcher did not call on_member_lost"
        assert calls[0][0] - t_gone < 1.0, f"took {calls[0][0] - t_gone:.2f}s"
        assert "is gone" in calls[0][1] and b.id in calls[0][1]
        assert a.change_pending.is_set() and a.change_reason == calls[0][1]


def test_nccl_groups_of_the_live_path_abort_instead_of_ending_the_process(monkeypatch, caplog):
    """torch's default NCCL error handling ends the process on an error or timeout, which would
    turn every live re-form on GPUs into a restart; the live path asks for clean-up only, and
    keeps (and warns about) a value the user chose."""
    from elastic_trainer.env import ENV_NCCL_ERROR_HANDLING as NCCL_ERROR_HANDLING
    from elastic_trainer.training.manager import nccl_error_handling

    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    assert nccl_error_handling() == "2" and os.environ[NCCL_ERROR_HANDLING] == "2"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "3")
    with caplog.at_level("WARNING"):
        assert nccl_error_handling() == "3"
    assert "falls back to restarting" in caplog.text


@pytest.mark.timeout(90)
def test_a_rank_leaving_a_broken_group_frees_it_so_a_peer_blocked_on_it_fails_at_once(procs, tmp_path):
    """A survivor blocked in a collective with another survivor (not with the dead peer) learns of
    the failure only when that one's connections close: nothing may keep the left group alive
    (DDP, a traceback, a stray reference), or the blocked peer waits for its timeout, reports
    late and is left out of the quorum (a restart instead of a re-form)."""
    import json
    import subprocess
    import sys

    from elastic_trainer.etcd.server import free_port

    port, out = free_port(), tmp_path / "times"
    script = REPO / "tests" / "helpers" / "blocked_peer.py"
    ranks = [procs.start([sys.executable, str(script), str(r), str(port), str(out)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    for p in ranks:
        p.wait(timeout=60)
    left = json.loads(Path(f"{out}.0").read_text())["left"]
    failed = json.loads(Path(f"{out}.1").read_text())["recv_failed"]
    assert failed - left < 1.5, f"the blocked peer failed {failed - left:.2f}s after the other left (it lives 12 s)"


def test_a_short_etcd_outage_costs_a_live_run_no_restart(procs, run_id, tmp_path):
    """etcd killed and started again 2 s later (same data): under live recovery the workers keep
    their processes and train on (on the restart path every agent's cut-off watchdog stops its
    workers after lease_ttl - keep_alive_interval without a renewal, and they restart)."""
    from elastic_trainer.etcd.server import EtcdServer

    server = EtcdServer(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log").start()
    try:
        ck, logs = tmp_path / "ck", tmp_path / "logs"
        outs = [tmp_path / f"agent{i}.log" for i in range(2)]
        args = ("--max-steps", "100000", "--sleep-per-step", "0.1")
        for out in outs:
            live_agent(procs, server, run_id, ck, logs, out, *args, nnodes="2:2")
        st = wait_steps("a world of 2 at step 5", lambda st: any(s["world_size"] == 2 and s["step"] >= 5
                                                                 for s in st), logs, 120, outs)
        pids = set(current_ranks(st).values())
        server.kill()
        t_kill = time.time()
        time.sleep(2.0)
        server.start()
        st = wait_steps("steps after etcd is back", lambda st: sum(s["time"] > t_kill + 3 for s in st) >= 10,
                        logs, 60, outs)
        after = {s["pid"] for s in st if s["time"] > t_kill}
        assert after == pids, "the same worker processes trained on"
        assert "has not been renewed" not in "".join(o.read_text() for o in outs)
    finally:
        server.stop()


@pytest.mark.trial  # 132 s on CI; own_loop.py's live kill and survivors in test_joining, the Manager's exactness in test_manager
def test_own_loop_recovers_live_trains_every_sample_once_and_ends_where_an_uninterrupted_run_ends(
        etcd, run_id, procs, tmp_path):
    """``examples/own_loop.py`` (``plain_ddp.py`` made live: a DataLoader over the ElasticSampler,
    no built-in trainer) under ``elastic-train``. A SIGKILLed node costs the survivors no restart
    (same worker processes; they step at N-1 within a second); a node started again joins with a
    live peer's state (its first step continues the count). Every step's samples are trained once:
    the step log the Manager writes holds each step once, at the sampler position that step
    committed, whatever the world; and the run ends equal to an uninterrupted one-process run. The
    Manager wrote the events, and ``elastic-train status`` shows the finished run."""
    logs, ck = tmp_path / "logs", tmp_path / "ck.pt"
    outs = [tmp_path / f"agent{i}.log" for i in range(4)]
    epochs, per_epoch, batch = 20, 30, 48  # 600 steps: the join lands well before the end (under load too)
    run = ("--epochs", str(epochs), "--samples", str(per_epoch * batch), "--batch-size", str(batch))

    def agent(out: Path):
        with open(out, "a") as log:
            return procs.start(cli_cmd("--nnodes", "1:3", "--rdzv-endpoint", etcd.endpoint, "--run-id", run_id,
                                       "--rdzv-conf", CONF, "--log-dir", str(logs),
                                       str(REPO / "examples" / "own_loop.py"), *run, "--checkpoint", str(ck),
                                       "--sleep-per-step", "0.04"),
                               cwd=REPO, stdout=log, stderr=log)

    agents = [agent(outs[i]) for i in range(3)]
    st = wait_steps("a world of 3 at step 10", lambda st: any(s["world_size"] == 3 and s["step"] >= 10 for s in st),
                    logs, 120, outs)
    ranks = current_ranks(st)
    victim, t_kill, st = kill_node(ranks[2], agents, logs, outs, 2, 10)
    at_two = [s for s in st if s["world_size"] == 2 and s["time"] > t_kill]
    assert {s["pid"] for s in at_two} == {ranks[0], ranks[1]}, "the survivors kept their worker processes"
    first = min(s["time"] for s in at_two)
    assert first - t_kill < 1.0, f"the first step at 2 came {first - t_kill:.2f}s after the kill"
    before = max(s["step"] for s in st if s["time"] <= t_kill)
    assert min(s["step"] for s in at_two) <= before + 2, "the survivors went on from where they were"

    agents.append(agent(outs[3]))
    t_join = time.time()
    st = wait_steps("a world of 3 after the join", lambda st: sum(
        s["world_size"] == 3 and s["time"] > t_join for s in st) >= 6, logs, 120, outs)
    newcomer = {s["pid"] for s in st if s["world_size"] == 3 and s["time"] > t_join} - {ranks[0], ranks[1]}
    assert len(newcomer) == 1
    joined = min((s for s in st if s["pid"] in newcomer), key=lambda s: s["time"])
    assert joined["step"] > before, "the newcomer continued the count: it received a live peer's state"
    for a in agents:
        if a is not victim:
            assert a.wait(timeout=240) == 0, [o.read_text()[-3000:] for o in outs]

    total = epochs * per_epoch
    by_step: dict[int, set] = {}
    for s in steps_of(logs):
        by_step.setdefault(s["step"], set()).add((s["epoch"], s["offset"]))
    assert sorted(by_step) == list(range(1, total + 1)), "every step ran, none twice apart"
    assert all(by_step[k] == {(k // per_epoch, k % per_epoch * batch)} for k in by_step), \
        "each step committed the next global batch of its epoch, whatever the world"
    events = [e.event for e in records.read_events(logs)]
    assert events[0] == Event.START and events[-1] == Event.FINISHED, events  # rank 0's
    assert events.count(Event.LIVE_REFORM) >= 2 and Event.WORLD_SIZE_CHANGED in events, events  # the kill, the join
    status = subprocess.run(cli_cmd("status", "--rdzv-endpoint", etcd.endpoint, "--run-id", run_id, "--json"),
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    training = json.loads(status.stdout)["training"]
    assert training["state"] == "finished" and training["step"] == total, training

    base = tmp_path / "base.pt"  # the same run in one process, never interrupted (plain torchrun)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    str(REPO / "examples" / "own_loop.py"), *run, "--checkpoint", str(base)],
                   cwd=tmp_path, check=True, capture_output=True, timeout=300)
    got, want = torch.load(ck)["model"], torch.load(base)["model"]
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-4, f"the live run ended {worst:.2e} from the uninterrupted one"