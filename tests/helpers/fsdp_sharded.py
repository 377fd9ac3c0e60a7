"""A sharded FSDP save or load on N gloo ranks, for the resharding test (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/helpers/fsdp_sharded.py \\
        save --url /tmp/ck --out /tmp/saved.pt
    python -m torch.distributed.run --standalone --nproc-per-node 3 tests/helpers/fsdp_sharded.py \\
        load --url /tmp/ck --out /tmp/loaded-3.pt

``save`` trains two steps of a small model under ``fully_shard`` and saves step 2 sharded
(``checkpoint/sharded.py``); ``load`` builds the same model from another seed at its own world
size and loads the newest checkpoint. Both write, from rank 0, the gathered (full) model and
optimizer state to ``--out``, for the test to compare.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.checkpoint.sharded import load_sharded, save_sharded
from elastic_trainer.train import exit_without_teardown


def build(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full(model, optimizer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = CheckpointManager(args.url, async_checkpoint=False, writer_id=f"rank{rank}-of-{world}-{os.getpid()}")
    if args.mode == "save":
        model, optimizer = build(0, world)
        for step in range(2):
            g = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        committed = save_sharded(ckpt, 2, model, optimizer, {"meta": {"world_size": world}} if rank == 0 else None)
        assert committed, ckpt.last_error
    else:
        model, optimizer = build(1, world)
        step, state = ckpt.load()
        load_sharded(ckpt, step, state, model, optimizer)
    state = full(model, optimizer)
    if rank == 0:
        torch.save(state, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo may abort in interpreter teardown after a clean run (see train.py)
