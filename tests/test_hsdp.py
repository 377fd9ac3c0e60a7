"""HSDP's pieces (``training/hsdp.py``): the mesh, who sends which shard, and a newcomer's and a
survivor's shards checked byte for byte on 4 gloo ranks. The whole trainer under faults:
``tests/test_live_hsdp.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from elastic_trainer.training.hsdp import check_layout, group_plan, mesh_shape, shard_donors
from elastic_trainer.training.recovery import Subgroups
from tests.helpers.common import REPO


def _members(nodes: int, nproc: int):
    return [SimpleNamespace(node=f"n{r // nproc}", local_rank=r % nproc) for r in range(nodes * nproc)]


def test_several_nodes_replicate_across_nodes_and_shard_within_one():
    assert mesh_shape(6, 2, shard_all=False) == (3, 2)
    assert mesh_shape(2, 2, shard_all=False) == (2,)  # one node: sharded over it
    assert mesh_shape(6, 2, shard_all=True) == (6,)  # --fsdp-shard-all: the old layout
    assert mesh_shape(3, 1, shard_all=False) == (3,)  # one worker per node: nothing to shard within a node


def test_the_planned_groups_are_the_meshs_rows_and_columns_and_the_checkpoints_world():
    """``group_plan``: what the Manager makes with every default group (``Manager.plan_groups``)."""
    plan = group_plan(2, shard_all=False, checkpoint=True)
    assert plan(6) == {"replicate": Subgroups(((0, 2, 4), (1, 3, 5))),
                       "shard": Subgroups(((0, 1), (2, 3), (4, 5))),
                       "checkpoint": Subgroups(((0, 1, 2, 3, 4, 5),), backend="gloo")}
    assert plan(2) == {"checkpoint": Subgroups(((0, 1),), backend="gloo")}  # one node: the default group's mesh
    assert group_plan(2, shard_all=True, checkpoint=False)(6) == {}
    assert plan(6)["replicate"].of(3) == (1, (1, 3, 5)) and Subgroups(((0, 1),)).of(2) is None


@pytest.mark.timeout(120)
def test_outside_live_recovery_the_planned_groups_are_made_when_asked_and_make_the_mesh(tmp_path):
    """Plain mode (torchrun's group, as with NCCL under live recovery): ``Manager.group`` makes the
    plan's groups with ``dist.new_group`` at the first ask, every rank at once, and HSDP's mesh is
    made of them: each dimension reduces over its row or column, the checkpoint's over all."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(REPO / "tests" / "helpers" / "planned_mesh.py"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(4)]
    for r, got in enumerate(results):
        assert got["shape"] == [2, 2] and got["names"] == ["replicate", "shard"], got
        assert got["ranks"] == {"replicate": [r % 2, r % 2 + 2], "shard": [r - r % 2, r - r % 2 + 1]}, got
        assert got["sums"] == {"replicate": float(2 * (r % 2) + 2), "shard": float(2 * (r - r % 2) + 1)}, got
        assert got["checkpoint"] == 4.0 and got["same"], got


def test_each_rank_gets_its_shard_index_from_a_holder_of_the_step_all_go_on_from():
    assert shard_donors([7] * 6, nproc=2) == {}  # all at one step: nothing moves
    assert shard_donors([7, 7, 7, 7, -1, -1], nproc=2) == {4: 0, 5: 1}  # a newcomer node
    assert shard_donors([7, 6, 7, 7], nproc=2) == {1: 3}  # rank 1 behind: shard 1's holder of 7
    # rank 0 completed step 7, which no holder of shard 1 did: it goes back to 6, from rank 2
    assert shard_donors([7, 6, 6, 6], nproc=2) == {0: 2}
    assert shard_donors([7, 6, 6, 6, -1, -1], nproc=2) == {0: 2, 4: 2, 5: 1}
    # no copy of shard 0 at the step shard 1 has: everyone loads a checkpoint
    assert shard_donors([7, 6, 7, 6], nproc=2) == {0: None, 1: None, 2: None, 3: None}
    assert shard_donors([-1, -1, 6, 6], nproc=2) == {0: 2, 1: 3}
    assert shard_donors([-1, 6, -1, 6], nproc=2) == {r: None for r in range(4)}  # shard 0: no holder


def test_a_quorum_whose_ranks_are_not_whole_nodes_in_local_order_is_refused():
    check_layout(_members(2, 2), 2)
    swapped = _members(2, 2)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(RuntimeError, match="rank 0 is n0 local rank 1"):
        check_layout(swapped, 2)


def _heal(tmp_path, nproc: int, *kind: str) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                           str(REPO / "tests" / "helpers" / "hsdp_heal.py"), str(out), *kind],
                          cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_healed(r: dict, world: int) -> None:
    half = world // 2
    assert r["mesh"] == [2, half] and r["donors"] == {str(half + i): i for i in range(half)}
    filled, trained = r["filled"], r["trained"]
    assert len(filled[0]) == 16  # 4 parameters x (shard, exp_avg, exp_avg_sq, step)
    for i in range(half):
        assert filled[half + i] == filled[i]  # every shard's bytes: the donor's
        assert trained[half + i] == trained[i]  # and the replicas stay equal as they train
        assert r["bytes"][half + i] == r["bytes"][i] > 0
    if half > 1:
        assert filled[0] != filled[1]  # (two shard indices hold different shards)
    assert r["kept_same"] == [True] * half and r["stepped"] == [True] * half


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_newcomer_node_gets_every_shard_from_the_same_index_and_survivors_keep_theirs(tmp_path):
    """4 gloo ranks, (replicate=2, shard=2): the second node's ranks, emptied, get their shards from
    the first node's ranks of the same shard index: every parameter and optimizer-state shard equal
    to the donor's byte for byte, and the replicas stay equal through 2 more steps; then the
    first node re-forms alone around the very shards it kept, and steps."""
    _check_healed(_heal(tmp_path, 4), 4)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 GPUs, torch sees {torch.cuda.device_count()}: NCCL between two GPUs")
def test_on_gpus_a_newcomer_gets_every_shard_over_nccl_and_survivors_keep_theirs(tmp_path):
    """The same on NCCL, one rank per GPU: 2 GPUs are 2 replicas of 1 shard, 4 GPUs 2 x 2 (an odd
    last GPU stays out)."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    _check_healed(_heal(tmp_path, world, "cuda"), world)


def test_the_launcher_runs_fsdp_live_by_default_and_scale_lr_still_on_restarts():
    from elastic_trainer.cli import launch

    assert launch.parse_run_config(["--", "--fsdp"]).recovery == "live"
    assert launch.parse_run_config(["--", "--fsdp", "--fsdp-shard-all"]).recovery == "live"
    assert launch.parse_run_config(["--", "--scale-lr"]).recovery == "restart"
    with pytest.raises(launch.UsageError, match="--scale-lr"):
        launch.parse_run_config(["--recovery", "live", "--", "--scale-lr"])


def test_the_mesh_groups_are_aborted_with_the_default_one_on_nccl():
    """On NCCL a re-forming rank (and the watcher, on a silent loss) aborts the mesh's groups too,
    not only the default one: a peer blocked on it in a shard group then fails at once (the
    Manager's ``group`` adds them, ``Manager.subgroups``). Here stand-ins for them are aborted; a new
    default group forgets them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from elastic_trainer.training.abandon import GroupAbandon
    from elastic_trainer.training.hsdp import device_mesh

    class Group:
        aborted = 0

        def abort(self) -> None:
            self.aborted += 1

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(torch.nn.Linear(2, 2), mesh=device_mesh(torch.device("cpu"), 1, 1, False))
        abandon = GroupAbandon("nccl")
        with abandon.recording():
            pass
        abandon.groups += [Group(), Group()]
        abandon.abandon("a test")
        assert [g.aborted for g in abandon.groups] == [1, 1]
        with abandon.recording():  # a new default group: the old one's subgroups are forgotten
            pass
        assert abandon.groups == []
    finally:
        dist.destroy_process_group()


def test_a_step_that_failed_in_the_forward_leaves_shards_that_a_survivor_can_take(tmp_path):
    """A kill that lands in a forward leaves the root FSDP module in its forward state with its
    gathered parameters registered (the root does not reshard after forward, and ``reshard()``
    then does nothing); ``Shards.take`` must still find the optimizer's sharded parameters by name
    (it once raised KeyError there: the survivors crashed and were restarted instead of reloading
    in place). One gloo rank; a block's forward raises as a collective to a dead peer would."""
    script = tmp_path / "forward_fails.py"
    script.write_text('''
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from elastic_trainer.training.hsdp import Shards, device_mesh
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
mesh = device_mesh(torch.device("cpu"), 1, 1, True)
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters())
model(torch.ones(2, 4)).sum().backward(); opt.step()
def boom(*a):
    raise RuntimeError("a peer is gone")
h = model[2].register_forward_pre_hook(boom)
try:
    model(torch.ones(2, 4))
except RuntimeError:
    pass
h.remove()
s = Shards.take(model, opt)
assert set(s.optim) == {n for n, _ in model.named_parameters()}, s.optim.keys()
print("TOOK", sorted(s.params))
''')
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(script)], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0 and "TOOK" in proc.stdout, proc.stderr[-3000:]


def test_a_newcomers_optimizer_warm_up_changes_nothing(tmp_path):
    """``hsdp.warm_up_optimizer``: a newcomer's first optimizer step, taken before its state comes
    (learning rate 0, zero gradients), leaves its parameters bit for bit, no optimizer state, its
    learning rates (a float and a tensor) and no gradients: the next real step equals that of an
    optimizer that never warmed up. An optimizer with state, or not one of torch's, is left alone.
    One gloo rank, FSDP2 on a 1-D mesh (sharded parameters, as in HSDP)."""
    script = tmp_path / "warm_up.py"
    script.write_text('''
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from elastic_trainer.training.hsdp import device_mesh, warm_up_optimizer
dist.init_process_group("gloo")
mesh = device_mesh(torch.device("cpu"), 1, 1, True)
def model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m
def step(m, opt, sched=None):
    m(torch.ones(2, 8)).sum().backward(); opt.step(); opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()
def same(a, b):
    return all(torch.equal(x.full_tensor(), y.full_tensor()) for x, y in zip(a.parameters(), b.parameters()))
for make in (lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
             lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.1), weight_decay=0.5, foreach=False),
             lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5)):
    warm, cold = model(), model()
    opt_w, opt_c = make(warm.parameters()), make(cold.parameters())
    sched_w = torch.optim.lr_scheduler.StepLR(opt_w, 1, 0.5)
    sched_c = torch.optim.lr_scheduler.StepLR(opt_c, 1, 0.5)
    lr = opt_w.param_groups[0]["lr"]
    assert warm_up_optimizer(opt_w)
    assert same(warm, cold), "the warm-up changed a parameter"
    assert not opt_w.state and all(p.grad is None for p in warm.parameters())
    assert opt_w.param_groups[0]["lr"] is lr
    step(warm, opt_w, sched_w); step(cold, opt_c, sched_c)
    step(warm, opt_w, sched_w); step(cold, opt_c, sched_c)
    assert same(warm, cold), "a warmed-up optimizer's steps differ"
    assert not warm_up_optimizer(opt_w)  # it has state: left alone
class Mine(torch.optim.SGD):
    pass
assert not warm_up_optimizer(Mine(model().parameters(), lr=0.1))
print("WARMED")
''')
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(script)], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0 and "WARMED" in proc.stdout, proc.stderr[-3000:]
