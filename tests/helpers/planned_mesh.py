"""Run by ``tests/test_hsdp.py`` under ``torchrun --nproc-per-node 4`` (plain mode: torchrun's group):
HSDP's mesh of 2 "nodes" x 2 from the Manager's planned groups (``Manager.plan_groups``; made with
``dist.new_group`` when first asked, outside live recovery), one all-reduce over each dimension and
over the checkpoint's group; writes what each rank saw to ``argv[1]``-<rank>.json."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from elastic_trainer.runtime import exit_without_teardown
from elastic_trainer.training import hsdp
from elastic_trainer.training.manager import Manager

out = sys.argv[1]
os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two workers on one machine
manager = Manager()
manager.plan_groups(hsdp.group_plan(2, shard_all=False, checkpoint=True))
manager.start()
rank = dist.get_rank()
mesh = hsdp.device_mesh(torch.device("cpu"), 4, 2, False, group=manager.group)
sums = {}
for name in ("replicate", "shard"):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group(name))
    sums[name] = t.item()
ck = manager.group("checkpoint")
t = torch.tensor([1.0])
dist.all_reduce(t, group=ck)
result = {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names), "sums": sums, "checkpoint": t.item(),
          "same": manager.group("checkpoint") is ck,
          "ranks": {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in ("replicate", "shard")}}
with open(f"{out}-{rank}.json", "w") as f:
    json.dump(result, f)
manager.finish()
exit_without_teardown(0)
