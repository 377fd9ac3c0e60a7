"""HSDP healing on 4 gloo ranks (2 "nodes" of 2), for ``tests/test_hsdp.py`` (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/helpers/hsdp_heal.py OUT
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/hsdp_heal.py OUT cuda

With ``cuda`` each rank uses its GPU and NCCL, and the 2 "nodes" hold half the ranks each (2 GPUs:
replicate=2 x shard=1; 4 GPUs: 2 x 2).

1. A small model under ``fully_shard`` on the (replicate=2, shard=2) mesh trains 3 steps.
2. Ranks 2 and 3 (the second node) drop their model and optimizer for a fresh, empty one, as a
   newcomer node has; each gets its shards from the rank of the same shard index on the first node
   (``hsdp.shard_donors``, ``manager.send_states``). Every rank's shards (parameters and optimizer
   state) are then hashed and compared with the donor's, byte for byte; then all train 2 more steps
   and the replicas must still be equal.
3. The second node goes (its ranks exit); ranks 0 and 1 leave the group, join a new one of 2 and
   wrap the model again on it around the shards they kept (``Shards.take``, ``rewrap``,
   ``rebind_optimizer``): the same bytes, and a step trains.

Rank 0 writes what it found to ``OUT`` (JSON).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from elastic_trainer.training import hsdp
from elastic_trainer.training.manager import send_states
from elastic_trainer.training.parallel import fsdp_blocks



def build(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Tanh(), torch.nn.Linear(30, 6))  # on the CPU:
    # fully_shard moves it to the mesh's device
    skeleton = hsdp.meta_skeleton(model)
    from torch.distributed.fsdp import fully_shard

    for block in fsdp_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, skeleton, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(model, optimizer, n: int, rank: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(100 * n + rank)
    model(torch.randn(4, 8, generator=g).to(device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def digests(model, optimizer) -> dict[str, str]:
    shards = hsdp.Shards.take(model, optimizer)
    out = {f"param/{n}": hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest() for n, t in shards.params.items()}
    for n, st in shards.optim.items():
        for k, v in st.items():
            out[f"optim/{n}/{k}"] = hashlib.sha256(v.contiguous().cpu().numpy().tobytes()).hexdigest()
    return out


def gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def mesh_of(device: torch.device, world: int):
    """(replicate=2, shard=world/2): the CPU's through ``hsdp.device_mesh`` as the trainer makes it."""
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cpu":
        return hsdp.device_mesh(device, world, world // 2, shard_all=False)
    return init_device_mesh("cuda", (2, world // 2) if world >= 2 else (1,), mesh_dim_names=("replicate", "shard"))


def main(out_path: str, kind: str = "cpu") -> None:
    timeout = datetime.timedelta(seconds=60)
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    half = world // 2
    report: dict = {}
    mesh = mesh_of(device, world)
    report["mesh"] = list(mesh.shape)
    model, skeleton, optimizer = build(mesh)
    for n in range(3):
        step(model, optimizer, n, rank, device)

    # 2. the second node's ranks start over empty and are filled from the first node's
    kept = hsdp.Shards.take(model, optimizer)
    if rank >= half:
        model = hsdp.rewrap(skeleton, mesh, fsdp_blocks, device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    donors = hsdp.shard_donors([3] * half + [-1] * half, nproc=half)
    report["donors"] = {str(k): v for k, v in donors.items()}
    got = send_states(kept.to_state() if rank < half else None, donors, device)
    if rank >= half:
        received = hsdp.Shards.from_state(got)
        report_bytes = received.nbytes
        received.load_into(model, optimizer)
    else:
        report_bytes = kept.nbytes
    del kept
    report["bytes"] = gathered(report_bytes)
    report["filled"] = gathered(digests(model, optimizer))
    for n in range(3, 5):
        step(model, optimizer, n, rank, device)
    report["trained"] = gathered(digests(model, optimizer))

    # 3. the second node goes; the first re-forms at 2 ranks and keeps its shards
    kept = hsdp.Shards.take(model, optimizer)
    before = digests(model, optimizer)
    dist.destroy_process_group()
    if rank >= half:
        return
    store = dist.FileStore(os.path.join(os.path.dirname(out_path), "store2"), half)
    extra = {"device_id": device} if kind == "cuda" else {}
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=store, rank=rank, world_size=half,
                            timeout=timeout, **extra)
    mesh2 = hsdp.device_mesh(device, half, half, shard_all=False)
    new = hsdp.rewrap(skeleton, mesh2, fsdp_blocks, device)
    hsdp.rebind_optimizer(optimizer, model, new)
    kept.load_into(new, optimizer)
    report["kept_same"] = gathered(digests(new, optimizer) == before)
    step(new, optimizer, 5, rank, device)
    report["stepped"] = gathered(digests(new, optimizer) != before)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from elastic_trainer.runtime import exit_without_teardown

    main(*sys.argv[1:])
    exit_without_teardown(0)  # gloo may abort in the interpreter's teardown after a clean run (runtime.py says how)
