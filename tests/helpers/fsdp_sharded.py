"""A sharded FSDP save or load on N gloo ranks, for the resharding test (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/helpers/fsdp_sharded.py \\
        save --url /tmp/ck --out /tmp/saved.pt
    python -m torch.distributed.run --standalone --nproc-per-node 3 tests/helpers/fsdp_sharded.py \\
        load --url /tmp/ck --out /tmp/loaded-3.pt

``save`` trains two steps of a small model under ``fully_shard`` and saves step 2 sharded
(``checkpoint/sharded.py``) to each ``--url`` (several: one launch saves to all); ``load``
builds the same model from another seed at its own world size and loads the newest checkpoint (or
``--step``; given more than once, each step into a model of its own, written to ``<out>.<step>``).
Both write, from rank 0, the gathered (full) model and optimizer state to ``--out``, for the test
to compare.

``async`` saves step 2 without blocking, halves every parameter and first moment in place at once
(while step 2 is written), then saves that as step 3 at once (which must wait for step 2's save)
and waits: ``--out`` gets the state at step 2 (gathered before its save), ``<out>.3`` the halved
one. ``exit`` saves step 2 blocking,
then starts a save of step 3 and has rank 1 exit at once (mid-save, a crash: no teardown); the
other ranks wait for the save, and rank 0 writes ``{"committed": ..., "error": ...}`` of step 3 to
``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.checkpoint.sharded import ShardedSaver, load_sharded, save_sharded
from elastic_trainer.runtime import exit_without_teardown


def build(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full(model, optimizer) -> dict:
    """The gathered state, copied (the optimizer's ``step`` tensors would be the live ones)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy({"model": get_model_state_dict(model, options=options),
                          "optimizer": get_optimizer_state_dict(model, optimizer, options=options)})


def train_step(model, optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load", "async", "exit"])
    p.add_argument("--url", required=True, action="append", help="save: one or more; the others: one")
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, action="append", help="load: the newest when not given")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = f"rank{rank}-of-{world}-{os.getpid()}"
    ckpt = CheckpointManager(args.url[0], async_checkpoint=False, writer_id=writer)
    rest = {"meta": {"world_size": world}} if rank == 0 else None
    if args.mode == "load":
        steps = args.step or [None]
        for wanted in steps:
            model, optimizer = build(1, world)
            step, state = ckpt.load(wanted)
            load_sharded(ckpt, step, state, model, optimizer)
            state = full(model, optimizer)
            if rank == 0:
                torch.save(state, args.out if len(steps) == 1 else f"{args.out}.{wanted}")
        dist.barrier()
        return
    model, optimizer = build(0, world)
    for step in range(2):
        train_step(model, optimizer, step, rank)
    if args.mode == "save":
        for url in args.url:
            target = CheckpointManager(url, async_checkpoint=False, writer_id=writer)
            assert save_sharded(target, 2, model, optimizer, rest), target.last_error
    elif args.mode == "async":
        saver = ShardedSaver(ckpt, timeout=60)
        at_2 = full(model, optimizer)
        saver.save(2, model, optimizer, rest)
        with torch.no_grad():  # at once, while step 2 is being written: every shard changes in place
            for param in model.parameters():
                param.mul_(0.5)
                optimizer.state[param]["exp_avg"].mul_(0.5)
        saver.save(3, model, optimizer, rest)  # at once too: it must wait for step 2's save (same buffers)
        if rank == 0:
            assert ckpt.last_committed_step == 2, f"step 3's save started before step 2 was committed ({ckpt.last_error})"
        ckpt.wait()
        at_3 = full(model, optimizer)
        if rank == 0:
            assert ckpt.last_save_stats.get("committed") and ckpt.last_save_stats["step"] == 3, ckpt.last_error
            torch.save(at_2, args.out)
            torch.save(at_3, args.out + ".3")
        dist.barrier()
        return
    elif args.mode == "exit":
        saver = ShardedSaver(ckpt, timeout=60)
        saver.save(2, model, optimizer, rest, blocking=True)
        train_step(model, optimizer, 2, rank)
        saver.save(3, model, optimizer, rest)
        if rank == 1:
            os._exit(0)  # mid-save: its shards half written or not at all, no goodbye to the others
        ckpt.wait()
        if rank == 0:
            st = ckpt.last_save_stats
            with open(args.out, "w") as f:
                json.dump({"step": st.get("step"), "committed": st.get("committed"), "error": st.get("error")}, f)
        return  # no collective on the default group now: rank 1 is gone
    state = full(model, optimizer)
    if rank == 0:
        torch.save(state, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo may abort in interpreter teardown after a clean run (runtime.py says how)
