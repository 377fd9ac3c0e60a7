"""Live recovery under ``--fsdp`` on several nodes: HSDP (sharded within a node, replicated across
nodes) heals a lost node from a live replica; under ``--fsdp-shard-all`` (no second copy of a
shard) a late join reshards every rank from the survivors' live shards, and a lost node is rebuilt
from peer copies in host memory (``--fsdp-peer-copy-every``) or, without them, from the newest
sharded checkpoint, in place.

Real ``elastic-train --recovery live`` agents of 2 gloo workers each on a real etcd, real SIGKILL of
whole nodes; what is asserted is read back from the trainer's logs (step logs: one file per worker
process; events; the sample ledger) and the sharded checkpoints, gathered (``checkpoint.sharded``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_trainer import records
from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.checkpoint.sharded import gathered
from elastic_trainer.records import Event
from tests.helpers.live import agent_of, current_ranks, kill_node, steps_of, wait_steps
from tests.helpers.common import REPO
from tests.helpers.runs import CONF, SEEDS_MSE, agent, baseline, check_equivalence, final_batches, latest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _nodes(procs, etcd, run_id, ck: Path, logs: Path, outs: list[Path], n: int, *args: str, nnodes: str,
           conf: str = CONF):
    return [agent(procs, etcd, run_id, 2, ck, logs, *args, nnodes=nnodes, out=outs[i], recovery="live", conf=conf)
            for i in range(n)]


def _by_pid_increasing(st: list[dict]) -> None:
    """No process redid an agreed step (a step a rank completed but the world did not, logged with
    ``loss_scope`` "rank", may be taken again from a replica that holds the step before it)."""
    by_pid: dict[int, list[int]] = {}
    for s in sorted(st, key=lambda s: s["time"]):
        if "loss_scope" not in s:
            by_pid.setdefault(s["pid"], []).append(s["step"])
    for pid, steps in by_pid.items():
        assert steps == sorted(set(steps)), (pid, steps)


@pytest.mark.trial  # 220 s on CI; live FSDP re-forms: the shard-all join and loss below
def test_hsdp_loses_a_replica_then_rank_0s_and_gains_one_and_matches_an_uninterrupted_run(
        etcd, run_id, procs, tmp_path):
    """3 nodes x 2 workers, HSDP (3 replicas of 2 shards). Kill a node that is not rank 0's: the
    survivors keep their processes and shards and step on at 2 replicas, 0 steps redone; a new node
    joins and each of its ranks gets its shard from the same shard index of a live replica (the
    bytes moved are reported); kill rank 0's node: the same. Sharded checkpoints are saved every 7
    steps throughout, and none is read; every sample is used once, and the end state equals an
    uninterrupted single-process run's."""
    # the newcomer node (2 workers on 2 cores) takes 5-9 s from its start to its admission here, and
    # the test starts it 4-11 s after the kill (the 8 steps it waits for are logged at agreements):
    # twice a run of 100 steps (0.25 s each under load) ended before it joined, so 160 leave room
    total = 160
    base_model, base_loss, base_ledger = baseline(tmp_path, total)
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(4)]
    args = ("--fsdp", "--max-steps", str(total), "--sleep-per-step", "0.1", "--checkpoint-every", "7")
    agents = _nodes(procs, etcd, run_id, ck, logs, outs, 3, *args, nnodes="2:3")

    st = wait_steps("a world of 6 at step 5", lambda st: any(s["world_size"] == 6 and s["step"] >= 5 for s in st),
                    logs, 150, outs)
    assert "fsdp: HSDP over replicate=3, shard=2" in "".join(o.read_text() for o in outs if o.exists())
    ranks = current_ranks(st)
    victim, t_kill, st = kill_node(ranks[4], agents, logs, outs, 4, 8)
    at_four = [s for s in st if s["world_size"] == 4 and s["time"] > t_kill]
    assert {s["pid"] for s in at_four} == {ranks[r] for r in range(4)}, "the survivors kept their processes"
    first = min(s["time"] for s in at_four)
    print(f"kill -> first step at 4 ranks: {first - t_kill:.2f}s")

    agents.append(agent(procs, etcd, run_id, 2, ck, logs, *args, nnodes="2:3", out=outs[3], recovery="live"))
    t_join = time.time()
    st = wait_steps("a world of 6 after the join", lambda st: sum(
        s["world_size"] == 6 and s["time"] > t_join for s in st) >= 12, logs, 150, outs)
    ranks = current_ranks(st)
    rank0_agent = agent_of(ranks[0], agents)
    _, t_kill0, st = kill_node(ranks[0], agents, logs, outs, 4, 4)
    first = min(s["time"] for s in st if s["world_size"] == 4 and s["time"] > t_kill0)
    print(f"kill of rank 0's node -> first step at 4 ranks: {first - t_kill0:.2f}s")
    for a in agents:
        if a not in (victim, rank0_agent):
            assert a.wait(timeout=200) == 0, [o.read_text()[-3000:] for o in outs]

    st = steps_of(logs)
    _by_pid_increasing(st)
    # the survivors at 4 ranks are ranks 2..5 of the world of 6 (the killed node's workers may end a
    # step of the world of 6 in the milliseconds before they die: the agent's SIGKILL reaches them
    # through its death, seen once at step 97, 46 ms after the kill, under load)
    assert {s["pid"] for s in st if s["time"] > t_kill0 and s["world_size"] == 4} == {ranks[r] for r in range(2, 6)}
    assert not [s for s in st if s["time"] > t_kill0 and s["pid"] in (ranks[0], ranks[1]) and s["world_size"] != 6]
    assert max(s["step"] for s in st) == total
    events = records.read_events(logs)
    assert Event.CHECKPOINT_LOADED not in [e.event for e in events]  # nothing was read from storage
    reforms = [e for e in events if e.event == Event.LIVE_REFORM]
    assert [(e.old, e.new) for e in reforms] == [(6, 4), (4, 6), (6, 4)], reforms
    assert reforms[1].receivers == [4, 5] and reforms[1].ahead, "the join's groups formed beside the training"
    text = "".join(o.read_text() for o in outs)
    # the rest of the state at the switch, the shards while the first step at 6 ran (the newcomers at weight zero)
    joined = re.findall(r"received the training state of step \d+ \(its shards, \d+ bytes, come while its first "
                        r"step runs\) in ([0-9.]+)s", outs[3].read_text())
    came = re.findall(r"this rank's shards \((\d+) bytes\) came while its first step ran", outs[3].read_text())
    assert len(joined) == 2 and len(came) == 2 and all(int(n) > 0 for n in came), outs[3].read_text()[-3000:]
    print(f"newcomer's ranks received the rest in {' and '.join(joined)} s, then {' + '.join(came)} bytes of shards "
          f"during their first step; the survivors paused {reforms[1].total_s:.3f}s for the join")
    assert "no live replica" not in text
    committed = set(re.findall(r"checkpoint step-(\d+) committed", text))
    assert len(committed) >= 10, sorted(committed)  # saves at 6, 4 and 6 ranks (a save cut by a kill is not)
    for e in reforms:
        print(f"re-form {e.old}->{e.new}: {e.total_s:.3f}s (teardown {e.teardown_s:.3f}, agree {e.agree_s:.3f}, "
              f"group {e.group_s:.3f}, state {e.state_s:.3f})")
        assert e.total_s < 5, e

    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    for s in st:
        if "loss_scope" not in s:
            assert abs(s["loss"] - base_loss[s["step"]]) <= 1e-5 * abs(base_loss[s["step"]]), s
    step, state = latest(ck)
    assert step == total and state["meta"]["world_size"] == 4 and "model" not in state  # sharded
    check_equivalence(gathered(CheckpointManager(str(ck)), step, state)["model"], base_model, total)

    # it reshards on load: 2 ranks of one node (one shard each) resume it and train on
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "elastic_trainer.train", *SEEDS_MSE, "--fsdp", "--max-steps", str(total + 2),
                           "--checkpoint-dir", str(ck), "--log-dir", str(tmp_path / "resumed")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert latest(ck)[0] == total + 2 and f"resumed from checkpoint step-{total}" in proc.stdout + proc.stderr
    # and each shard was written once (DCP keeps one replica's copy): as many bytes as one copy sharded
    # over 2 ranks (step total + 2), not twice as many
    written = {n: sum(f.stat().st_size for f in (ck / f"step-{n}").glob("dcp-*/*.distcp")) for n in (total, total + 2)}
    print(f"shard files: {written[total]} bytes of 2 replicas x 2 shards, {written[total + 2]} bytes of 1 x 2")
    assert written[total] < 1.3 * written[total + 2]


def test_a_node_that_joins_hsdp_gets_its_shards_while_the_members_train_on(etcd, run_id, procs, tmp_path):
    """``--fsdp`` on 2 nodes x 2 workers, the second late: the first trains alone (a mesh of one
    node's 2 shards), then the second joins, which makes the world HSDP (2 replicas x 2 shards)
    without a stop for its groups: the members agree on the quorum, then train on while their
    groups of the next world (the default one, the mesh's replicate and shard groups, the
    checkpoint's) form beside theirs and the model is wrapped on the new mesh
    (``TrainerRecovery.ahead``); the newcomer's ranks, wrapped and waiting, get the shards of
    their shard index at the switch. Checkpoints every 5 steps commit before and after it (the
    members' saver kept its memory, only its group and folder changed); every sample is used
    once and the end state equals an uninterrupted run's."""
    total = 60
    base_model, _, base_ledger = baseline(tmp_path, total)
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(2)]
    # slow steps: the late node's start takes 5-9 s here under load; it must join well before the end
    args = ("--fsdp", "--max-steps", str(total), "--sleep-per-step", "0.5", "--checkpoint-every", "5")
    agents = _nodes(procs, etcd, run_id, ck, logs, outs, 1, *args, nnodes="1:2")
    st = wait_steps("a world of 2 at step 3", lambda st: any(s["world_size"] == 2 and s["step"] >= 3 for s in st),
                    logs, 150, outs)
    first = {s["pid"] for s in st}
    agents.append(agent(procs, etcd, run_id, 2, ck, logs, *args, nnodes="1:2", out=outs[1], recovery="live"))
    for a in agents:
        assert a.wait(timeout=200) == 0, [o.read_text()[-3000:] for o in outs]
    st = steps_of(logs)
    _by_pid_increasing(st)
    at4 = [s for s in st if s["world_size"] == 4]
    assert at4 and max(s["step"] for s in st) == total, "the late node joined before the end"
    assert first <= {s["pid"] for s in at4}, "the first node's workers kept their processes through the join"
    text = "".join(o.read_text() for o in outs)
    assert "fsdp: HSDP over replicate=2, shard=2" in text
    events = records.read_events(logs)
    reforms = _membership_reforms(events)
    assert [(e.old, e.new, e.receivers, e.ahead, e.extra.get("state_from")) for e in reforms] == [
        (2, 4, [2, 3], True, "replica")], reforms
    assert "the model on the mesh of 4 ranks made ahead" in text, text[-3000:]
    assert text.count("the optimizer's first step warmed up") == 2, text[-3000:]  # each newcomer rank, before it waits
    # the shards moved while every rank took the first step at 4 (the newcomers at weight zero, no samples)
    assert text.count("came while its first step ran; loaded before its optimizer step") == 2, text[-3000:]
    assert reforms[0].extra.get("moved_bytes", 0) > 0, reforms
    joined = min(s["step"] for s in at4)
    committed = {int(n) for n in re.findall(r"checkpoint step-(\d+) committed", text)}
    assert any(n > joined for n in committed) and any(n < joined for n in committed), (joined, sorted(committed))
    print(f"joined at step {joined}; the members' re-form {reforms[0].total_s:.3f}s "
          f"(state {reforms[0].state_s:.3f}); checkpoints {sorted(committed)}")
    assert Event.CHECKPOINT_LOADED not in [e.event for e in events]
    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    step, state = latest(ck)
    assert step == total
    check_equivalence(gathered(CheckpointManager(str(ck)), step, state)["model"], base_model, total)


def _membership_reforms(events) -> list:
    """The re-forms that changed the world (a stall the hang detection declares under heavy load
    re-forms the same ranks, with their own shards: not what these tests are about)."""
    return [e for e in events if e.event == Event.LIVE_REFORM and e.old != e.new]


def _shard_all_run(etcd, run_id, procs, tmp_path, total: int, kill_after: int, *extra: str, after_join: int = 0):
    """``--fsdp-shard-all`` on 2 nodes x 2 workers where the second node comes late: the first trains
    alone (world 2) for a few steps, then the second joins before any checkpoint exists, a join that
    reshards every rank (4 shards instead of 2): the survivors keep their processes and cut the new
    layout from their live shards. Then the late node is killed past step ``kill_after`` (and
    ``after_join`` steps after the join). Returns (the base run's
    model and ledger, logs, checkpoint dir, the kill's time, the agents' logs)."""
    base_model, _, base_ledger = baseline(tmp_path, total)
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(2)]
    # slow steps: the late node's start takes ~9 s at load 16 and more above it; it must join before the end
    args = ("--fsdp", "--fsdp-shard-all", "--max-steps", str(total), "--sleep-per-step", "0.6", *extra)
    agents = _nodes(procs, etcd, run_id, ck, logs, outs, 1, *args, nnodes="1:2")
    st = wait_steps("a world of 2 at step 3", lambda st: any(s["world_size"] == 2 and s["step"] >= 3 for s in st),
                    logs, 150, outs)
    first = {s["pid"] for s in st}
    assert len(first) == 2
    agents.append(agent(procs, etcd, run_id, 2, ck, logs, *args, nnodes="1:2", out=outs[1], recovery="live"))

    def ready(st) -> bool:
        at4 = [s["step"] for s in st if s["world_size"] == 4]
        return bool(at4) and max(at4) >= max(kill_after, min(at4) + after_join)

    st = wait_steps(f"a world of 4 past step {kill_after}", ready, logs, 150, outs)
    joined_at = min(s["step"] for s in st if s["world_size"] == 4)
    print(f"the late node joined at step {joined_at}; checkpoints before it: "
          f"{[n for n in range(1, joined_at) if (ck / f'step-{n}').exists()]}")
    assert "fsdp: sharded over shard=4" in "".join(o.read_text() for o in outs if o.exists())
    ranks = current_ranks(st)
    assert {ranks[0], ranks[1]} == first, "the first node's workers kept their processes through the join"
    victim, t_kill, st = kill_node(ranks[2], agents, logs, outs, 2, 4)
    assert {s["pid"] for s in st if s["world_size"] == 2 and s["time"] > t_kill} == first
    print(f"kill -> first step at 2 ranks: "
          f"{min(s['time'] for s in st if s['world_size'] == 2 and s['time'] > t_kill) - t_kill:.2f}s")
    for a in agents:
        if a is not victim:
            assert a.wait(timeout=200) == 0, [o.read_text()[-3000:] for o in outs]
    assert {s["pid"] for s in steps_of(logs)} == first | {ranks[2], ranks[3]}, "no worker restarted"
    return base_model, base_ledger, logs, ck, t_kill, outs


def test_shards_over_all_ranks_a_late_join_and_a_lost_node_keep_the_survivors_processes(
        etcd, run_id, procs, tmp_path):
    """``--fsdp-shard-all``, no peer copies: no shard has a second copy. A node that joins late
    is given its shards cut from the survivors' live ones (no storage read; usually before the
    first checkpoint exists, which the peer-copy test below makes certain); a killed node's shards are lost, so the survivors
    re-form at 2 ranks and load the newest sharded checkpoint resharded to 2 ranks in place, redo
    the steps since it, and end equal to an uninterrupted run. (Before the late join was built,
    this test started both nodes in one first world: such a join restarted every worker.)"""
    total = 50
    base_model, base_ledger, logs, ck, t_kill, outs = _shard_all_run(etcd, run_id, procs, tmp_path, total, 33,
                                                                     "--checkpoint-every", "30")
    events = records.read_events(logs)
    reforms = _membership_reforms(events)
    assert [(e.old, e.new, e.extra.get("state_from")) for e in reforms] == [
        (2, 4, "live shards"), (4, 2, "checkpoint")], reforms
    assert all(e.time > t_kill for e in events if e.event == Event.CHECKPOINT_LOADED), "the join read no checkpoint"
    loaded = [e for e in events if e.event == Event.CHECKPOINT_LOADED]
    assert len(loaded) == 1 and loaded[0].step == 30 and loaded[0].world_size == 2
    before = max(s["step"] for s in steps_of(logs) if s["time"] <= t_kill)
    print(f"steps redone after the reload: {before - loaded[0].step}; the join: {reforms[0].total_s:.3f}s")
    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    step, state = latest(ck)
    assert step == total
    check_equivalence(gathered(CheckpointManager(str(ck)), step, state)["model"], base_model, total)


@pytest.mark.trial  # 69 s on CI; the shard-all loss above reloads in place
def test_shards_over_all_ranks_a_lost_node_is_rebuilt_from_peer_copies_without_storage(
        etcd, run_id, procs, tmp_path):
    """``--fsdp-shard-all --fsdp-peer-copy-every 3``, no checkpoint until the end: every 3 steps each
    rank's shards go to the host memory of a rank on the other node. The late node is killed past
    step 28 (the copies are of step 27): the survivors rebuild its shards from those copies, reshard to 2 ranks in their own
    processes, redo at most 3 steps, read no storage (there is no checkpoint to read), and end
    equal to an uninterrupted run. No checkpoint exists before the last step, so the late join came
    before any checkpoint: its shards were cut from the survivors' live ones. The kill waits for 2
    steps at 4 ranks: a copy is taken at the first step after a re-form."""
    total, every = 50, 3
    base_model, base_ledger, logs, ck, t_kill, outs = _shard_all_run(etcd, run_id, procs, tmp_path, total, 28,
                                                                     "--fsdp-peer-copy-every", str(every), after_join=2)
    events = records.read_events(logs)
    assert Event.CHECKPOINT_LOADED not in [e.event for e in events]
    assert sorted(int(p.name.split("-")[1]) for p in ck.glob("step-*")) == [total]  # the final save only
    reforms = _membership_reforms(events)
    assert [(e.old, e.new, e.extra.get("state_from")) for e in reforms] == [
        (2, 4, "live shards"), (4, 2, "peer copies")], reforms
    text = "".join(o.read_text() for o in outs)
    redo = [int(n) for n in re.findall(r"from peer copies of 4 shard\(s\) in [0-9.]+s, no storage read \((\d+) steps", text)]
    assert redo and all(0 <= n <= every for n in redo), text[-3000:]
    print(f"rebuilt from peer copies: {redo[0]} steps to redo; re-form {reforms[1].total_s:.3f}s")
    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    step, state = latest(ck)
    assert step == total
    check_equivalence(gathered(CheckpointManager(str(ck)), step, state)["model"], base_model, total)
