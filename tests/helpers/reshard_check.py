"""Live resharding on 4 gloo ranks, for ``tests/test_reshard.py`` (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/helpers/reshard_check.py OUT

1. A small model (128 inputs: the bytes are mostly rows, not framing) with uneven row counts (30 rows over 4 shards: 8, 8, 8, 6; 6 rows: 2, 2, 2, 0)
   under ``fully_shard`` over all 4 ranks trains 2 steps with Adam.
2. Every rank's shards are gathered (``all_gather_object``) and ``reshard.full_state`` must equal
   each parameter's and each optimizer state's ``full_tensor()``.
3. A model on another layout, HSDP (replicate=2, shard=2), is made from a meta skeleton, and each
   rank loads its cut (``reshard.cut``): its ``full_tensor()`` must equal the old one exactly, and
   one more step on both layouts must give the same parameters (the optimizer state came along).

4. The same cut the way a re-form makes it (``reshard.gather``): each rank of the new layout is
   sent only its rows, point to point; its shards must equal the cut's, and the bytes it received
   are set beside what the old exchange (every shard to every rank, ``all_gather_object``) moved.

Rank 0 writes what it found to ``OUT`` (JSON).
"""

from __future__ import annotations

import io
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from elastic_trainer.training import hsdp, reshard
from elastic_trainer.training.parallel import fsdp_blocks


def wrap(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in fsdp_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model, optimizer, n: int) -> None:
    g = torch.Generator().manual_seed(100 * n + dist.get_rank())
    model(torch.randn(4, 128, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def fulls(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.full_tensor() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if hasattr(v, "full_tensor"):
                out[f"o.{names[p]}.{k}"] = v.full_tensor()
    return out


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    bare = torch.nn.Sequential(torch.nn.Linear(128, 30), torch.nn.Tanh(), torch.nn.Linear(30, 6))
    skeleton = hsdp.meta_skeleton(bare)
    old = wrap(bare, init_device_mesh("cpu", (4,)))
    opt_old = torch.optim.Adam(old.parameters(), lr=1e-2)
    for n in range(2):
        step(old, opt_old, n)
    before = fulls(old, opt_old)

    mine = hsdp.Shards.take(old, opt_old, settle=False)
    every: list = [None] * 4
    dist.all_gather_object(every, mine.to_state())
    full = reshard.full_state([hsdp.Shards.from_state(s) for s in every])
    gathered_ok = all(torch.equal(full.params[n], before[f"p.{n}"]) for n in full.params) and all(
        torch.equal(full.optim[n][k], before[f"o.{n}.{k}"]) for n in full.optim for k in full.sharded_keys[n])

    new = hsdp.rewrap(skeleton, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                      fsdp_blocks, torch.device("cpu"))
    opt_new = torch.optim.Adam(new.parameters(), lr=1e-2)
    local_rows = {n: reshard.rows(p) for n, p in new.named_parameters()}
    reshard.cut(full, new).load_into(new, opt_new)
    after = fulls(new, opt_new)
    cut_ok = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    step(old, opt_old, 2)
    step(new, opt_new, 2)  # the same data per rank: HSDP averages over all 4 ranks as FSDP does
    stepped = {k: (fulls(old, opt_old)[k] - fulls(new, opt_new)[k]).abs().max().item() for k in before}
    # 4. point to point: the old layout's shards of step 2 (kept before the third step) to the new one
    rank = dist.get_rank()
    target = hsdp.rewrap(skeleton, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                         fsdp_blocks, torch.device("cpu"))
    mine_live = {reshard.Held(1, 4, rank, 2, "live"): hsdp.Shards.from_state(every[rank])}
    got = reshard.gather(mine_live, {"meta": {"step": 2}}, target, torch.device("cpu"))
    # (not ``full``: the cut loaded above shares its optimizer tensors with opt_new, which stepped)
    want = reshard.cut(reshard.full_state([hsdp.Shards.from_state(s) for s in every]), target)
    p2p_ok = got is not None and got.trainer == {"meta": {"step": 2}} and all(
        torch.equal(got.shards.params[n], want.params[n]) for n in want.params) and all(
        torch.equal(got.shards.optim[n][k], want.optim[n][k]) for n in want.optim for k in want.optim[n])
    received: list = [None] * 4
    dist.all_gather_object(received, got.received if got is not None else -1)
    # the old exchange: one all_gather_object in which each shard's holder sent its whole shard, so
    # every rank received every other rank's serialized shard
    sizes: list = [None] * 4
    buf = io.BytesIO()
    torch.save({"shards": every[rank], "trainer": {"meta": {"step": 2}}}, buf)
    dist.all_gather_object(sizes, buf.tell())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"gathered_equal": gathered_ok, "cut_equal": cut_ok, "after_step_max_diff": max(stepped.values()),
                       "rows": {n: list(r) for n, r in local_rows.items()}, "p2p_equal": p2p_ok,
                       "p2p_received": received, "allgather_received": [sum(sizes) - s for s in sizes]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from elastic_trainer.runtime import exit_without_teardown

    main(sys.argv[1])
    exit_without_teardown(0)  # gloo may abort in the interpreter's teardown after a clean run (runtime.py says how)
