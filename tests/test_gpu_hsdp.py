"""Live ``--fsdp`` over NCCL on GPUs: the gloo tests of ``tests/test_live_hsdp.py``,
``tests/test_hsdp.py`` and ``tests/test_reshard.py`` where a GPU changes what can go wrong (shards
in device memory, the transfers over NCCL). ``pytest -m gpu tests/test_gpu_hsdp.py``; skipped,
saying why, where torch sees too few GPUs.

- **One GPU** (world size 1 over NCCL): a rank's shards of a CUDA model are taken, serialized as a
  transfer sends them, put into a model wrapped again on the GPU and equal to the originals
  (parameters and Adam's state), and both train on alike; the same shards through a peer copy
  (host memory) and through the reshard exchange (``reshard.gather``), from a live shard and from
  a copy's bytes.
- **Two GPUs** (a node of one worker each, one GPU each: a node of one worker shards over all
  ranks, so no shard has a second copy): a late node joins and every rank's new shards are cut
  from the survivors' live ones and sent point to point over NCCL; the late node is killed and the
  survivor reloads the newest sharded checkpoint resharded to 1 rank in its own process (case 4);
  the end state equals an uninterrupted run on one GPU.
- **Four GPUs** (2 nodes x 2 GPUs: HSDP, 2 replicas of 2 shards): a killed replica is healed (the
  survivors keep their processes and step on, 0 steps redone), a new node's ranks each get their
  shards from the same shard index (as many bytes as the donor holds), and the end state equals an
  uninterrupted run.
  (The newcomer's shards checked byte for byte against the donor's over NCCL, on 2 or 4 GPUs:
  ``tests/test_hsdp.py::test_on_gpus_a_newcomer_gets_every_shard_over_nccl_and_survivors_keep_theirs``.)

The multi-GPU tests use the gloo tests' helpers (``tests/helpers/runs.py``, ``live.py``): real
``elastic-train --recovery live`` agents on a real etcd, each pinned to its GPUs with
``CUDA_VISIBLE_DEVICES``, real SIGKILL of whole nodes.
"""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_trainer import records
from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.checkpoint.sharded import gathered
from elastic_trainer.records import Event
from elastic_trainer.training import hsdp, peer_copy, reshard, state_codec
from elastic_trainer.training.parallel import fsdp_blocks
from tests.helpers.live import current_ranks, kill_node, steps_of, wait_steps
from tests.helpers.runs import SEEDS_MSE, agent, baseline, check_equivalence, final_batches, latest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
GPUS = torch.cuda.device_count()
needs_a_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a GPU, torch sees none")
CUDA = [*SEEDS_MSE, "--device", "cuda", "--no-tf32"]  # float32 matmuls as the uninterrupted run's


# ---- one GPU: the sharded state's round trips ------------------------------------------------------
@pytest.fixture
def nccl_world_of_one(single_process_env):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def _wrapped(device: torch.device):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    bare = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 6))
    skeleton = hsdp.meta_skeleton(bare)
    mesh = hsdp.device_mesh(device, 1, 1, False)
    for block in fsdp_blocks(bare):
        fully_shard(block, mesh=mesh)
    fully_shard(bare, mesh=mesh)
    return bare, skeleton, mesh


def _step(model, optimizer, n: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(n)
    model(torch.randn(4, 16, generator=g).to(device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.full_tensor().cpu() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            out[f"o.{names[p]}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()
    return out


@needs_a_gpu
def test_a_cuda_ranks_shards_go_to_host_bytes_and_back_into_a_model_wrapped_again(nccl_world_of_one):
    """What a newcomer receives (``Shards.to_state`` serialized, read on the host) and what a
    survivor keeps (``rewrap`` around its own shards), and a peer copy's bytes, on the GPU: each
    lands in a model wrapped again on the GPU equal to the original, and trains on alike."""
    device = nccl_world_of_one
    model, skeleton, mesh = _wrapped(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for n in range(2):
        _step(model, optimizer, n, device)
    before = _full(model, optimizer)
    shards = hsdp.Shards.take(model, optimizer, settle=False)
    assert all(t.is_cuda for t in shards.params.values()) and shards.nbytes > 0

    sent = hsdp.Shards.from_state(state_codec.decode(state_codec.encode(shards.to_state()).clone()))  # the transfer's format
    assert sent.nbytes == shards.nbytes
    copy = peer_copy.host_copy(shards)  # a peer copy: host memory, then the bytes a holder keeps
    assert not any(t.is_cuda for t in copy.params.values())
    raw = peer_copy.encode(copy, {"meta": {"step": 2}})

    # (the kept shards first: a survivor's optimizer state is its own tensors, so only the others train on)
    for source in (shards, hsdp.Shards.from_state(torch.load(io.BytesIO(raw), weights_only=True)["shards"]), sent):
        again = hsdp.rewrap(skeleton, mesh, fsdp_blocks, device)
        opt_again = torch.optim.Adam(again.parameters(), lr=1e-2)
        source.load_into(again, opt_again)
        got = _full(again, opt_again)
        assert got.keys() == before.keys() and all(torch.equal(got[k], before[k]) for k in before)
        assert all(p.to_local().is_cuda for p in again.parameters())
    _step(model, optimizer, 2, device)
    _step(again, opt_again, 2, device)
    trained, trained_again = _full(model, optimizer), _full(again, opt_again)
    for k in trained:  # the same kernels on the same inputs (within a float32 rounding, should cuBLAS vary)
        torch.testing.assert_close(trained_again[k], trained[k], rtol=0, atol=1e-6, msg=k)


@needs_a_gpu
def test_the_reshard_exchange_on_a_gpu_rebuilds_the_state_from_a_live_shard_and_from_a_copy(nccl_world_of_one):
    """``reshard.gather`` over NCCL (world of one): the rows of a live CUDA shard and of a peer
    copy's bytes, into a model on the GPU, equal to the original; nothing sent to another rank."""
    device = nccl_world_of_one
    model, skeleton, mesh = _wrapped(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, optimizer, 0, device)
    before = _full(model, optimizer)
    shards = hsdp.Shards.take(model, optimizer, settle=False)
    raw = peer_copy.encode(peer_copy.host_copy(shards), {"meta": {"step": 1}})
    for mine in ({reshard.Held(3, 1, 0, 1, "live"): shards}, {reshard.Held(3, 1, 0, 1, "copy"): raw}):
        target = hsdp.rewrap(skeleton, mesh, fsdp_blocks, device)
        opt_target = torch.optim.Adam(target.parameters(), lr=1e-2)
        got = reshard.gather(mine, {"meta": {"step": 1}}, target, device)
        assert got is not None and got.trainer == {"meta": {"step": 1}} and (got.sent, got.received) == (0, 0)
        got.shards.load_into(target, opt_target)
        after = _full(target, opt_target)
        assert all(torch.equal(after[k], before[k]) for k in before), mine


# ---- two and four GPUs: elastic-train nodes under faults ---------------------------------------------
def _node(procs, etcd, run_id, monkeypatch, gpus: str, nproc: int, ck: Path, logs: Path, out: Path, *args: str,
          nnodes: str):
    """An ``elastic-train`` node on the GPUs ``gpus`` (``CUDA_VISIBLE_DEVICES``)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)  # the trainer sets its own
    return agent(procs, etcd, run_id, nproc, ck, logs, *args, nnodes=nnodes, out=out, recovery="live", workload=CUDA)


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, torch sees {GPUS}: two nodes of one GPU over NCCL")
def test_on_two_gpus_a_late_join_reshards_live_and_a_lost_node_reloads_in_place(
        etcd, run_id, procs, tmp_path, monkeypatch):
    """``--fsdp`` on 2 nodes of 1 GPU (sharded over both: no second copy of a shard). The first
    node trains alone; the second joins and the survivor's live shard is cut to 2 ranks and sent
    point to point over NCCL (no storage read); the second is killed past a checkpoint and the
    survivor reloads it resharded to 1 rank in its own process, redoes the steps since it, and ends
    equal to an uninterrupted run on one GPU."""
    total = 70  # 0.5 s steps: room for the late node's start (CUDA and NCCL included) before the end
    base_model, _, base_ledger = baseline(tmp_path, total, workload=CUDA)
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(2)]
    args = ("--fsdp", "--max-steps", str(total), "--sleep-per-step", "0.5", "--checkpoint-every", "30")
    agents = [_node(procs, etcd, run_id, monkeypatch, "0", 1, ck, logs, outs[0], *args, nnodes="1:2")]
    st = wait_steps("one GPU at step 3", lambda st: any(s["step"] >= 3 for s in st), logs, 180, outs)
    first = {s["pid"] for s in st}
    agents.append(_node(procs, etcd, run_id, monkeypatch, "1", 1, ck, logs, outs[1], *args, nnodes="1:2"))
    st = wait_steps("2 GPUs past step 32", lambda st: any(s["world_size"] == 2 and s["step"] >= 32 for s in st),
                    logs, 180, outs)
    ranks = current_ranks(st)
    assert ranks[0] in first, "the first node's worker kept its process through the join"
    victim, t_kill, st = kill_node(ranks[1], agents, logs, outs, 1, 3)
    assert agents[0].wait(timeout=200) == 0, outs[0].read_text()[-3000:]
    st = steps_of(logs)
    assert {s["pid"] for s in st if s["world_size"] == 1} == first, "the survivor kept its process"
    events = records.read_events(logs)
    reforms = [e for e in events if e.event == Event.LIVE_REFORM and e.old != e.new]
    assert [(e.old, e.new, e.extra.get("state_from")) for e in reforms] == [
        (1, 2, "live shards"), (2, 1, "checkpoint")], reforms
    assert reforms[0].extra["moved_bytes"] > 0  # the newcomer's rows, over NCCL
    loaded = [e for e in events if e.event == Event.CHECKPOINT_LOADED]
    assert len(loaded) == 1 and loaded[0].time > t_kill and loaded[0].step == 30
    assert "backend nccl" in "".join(o.read_text() for o in outs)
    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    step, state = latest(ck)
    assert step == total
    check_equivalence(gathered(CheckpointManager(str(ck)), step, state)["model"], base_model, total)


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 4, reason=f"needs 4 GPUs, torch sees {GPUS}: 2 nodes of 2 GPUs (HSDP) over NCCL")
def test_on_four_gpus_hsdp_heals_a_killed_replica_fills_a_newcomer_from_a_peer_and_matches_a_run_without_faults(
        etcd, run_id, procs, tmp_path, monkeypatch):
    """HSDP over NCCL, 2 nodes x 2 GPUs (2 replicas of 2 shards). Kill the node that is not rank
    0's: the survivors keep their processes and shards and step on at 1 replica, 0 steps redone, no
    checkpoint read; a node joins on the same GPUs and each of its ranks gets its shards from the
    same shard index of the live replica (as many bytes as the donor holds); the end state equals
    an uninterrupted run on one GPU."""
    total = 60
    base_model, base_loss, base_ledger = baseline(tmp_path, total, workload=CUDA)
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    outs = [tmp_path / f"agent{i}.log" for i in range(3)]
    args = ("--fsdp", "--max-steps", str(total), "--sleep-per-step", "0.2", "--checkpoint-every", "7")
    agents = [_node(procs, etcd, run_id, monkeypatch, gpus, 2, ck, logs, outs[i], *args, nnodes="1:2")
              for i, gpus in enumerate(("0,1", "2,3"))]
    st = wait_steps("4 GPUs at step 5", lambda st: any(s["world_size"] == 4 and s["step"] >= 5 for s in st),
                    logs, 180, outs)
    assert "fsdp: HSDP over replicate=2, shard=2" in "".join(o.read_text() for o in outs if o.exists())
    ranks = current_ranks(st)
    victim, t_kill, st = kill_node(ranks[2], agents, logs, outs, 2, 5)
    assert {s["pid"] for s in st if s["world_size"] == 2 and s["time"] > t_kill} == {ranks[0], ranks[1]}
    gpus_of_victim = "0,1" if victim is agents[0] else "2,3"
    agents.append(_node(procs, etcd, run_id, monkeypatch, gpus_of_victim, 2, ck, logs, outs[2], *args, nnodes="1:2"))
    t_join = time.time()
    wait_steps("4 GPUs after the join", lambda st: sum(s["world_size"] == 4 and s["time"] > t_join for s in st) >= 8,
               logs, 180, outs)
    for a in agents:
        if a is not victim:
            assert a.wait(timeout=200) == 0, [o.read_text()[-3000:] for o in outs]

    st = steps_of(logs)
    events = records.read_events(logs)
    assert Event.CHECKPOINT_LOADED not in [e.event for e in events]  # nothing was read from storage
    # (the first world may have formed of one node, the other joining live: a re-form 2 -> 4 before)
    reforms = [e for e in events if e.event == Event.LIVE_REFORM and e.old != e.new and e.time > t_kill]
    assert [(e.old, e.new) for e in reforms] == [(4, 2), (2, 4)], reforms
    assert reforms[1].receivers == [2, 3]
    joined = [int(n) for n in re.findall(r"received the training state of step \d+ \(shards: (\d+) bytes\)",
                                         outs[2].read_text())]
    assert len(joined) == 2 and all(n > 0 for n in joined), outs[2].read_text()[-3000:]
    assert reforms[1].extra["moved_bytes"] == reforms[1].extra["sent_bytes"] == sum(joined)  # as the donors hold
    for s in st:  # 0 steps redone, the same losses as the run without faults
        if "loss_scope" not in s:
            assert abs(s["loss"] - base_loss[s["step"]]) <= 1e-4 * abs(base_loss[s["step"]]), s
    assert max(s["step"] for s in st) == total
    assert final_batches(logs) == {n: sorted(ix) for n, ix in base_ledger.items()}
    step, state = latest(ck)
    assert step == total
    check_equivalence(gathered(CheckpointManager(str(ck)), step, state)["model"], base_model, total)
