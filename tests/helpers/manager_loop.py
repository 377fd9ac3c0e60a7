"""A user's loop on ``elastic_trainer.Manager`` with slow phases, for the hang-detection tests.

``examples/own_loop.py``'s loop (steps in ``steps/rank-*.jsonl``, written by the Manager), plus
what a real loop does that must not be taken for a hang: a long first step on one node (a
compile), and every ``--slow-every`` steps a slow phase on one rank inside
``manager.slow("checkpoint")`` (a save that blocks the loop), while its peers wait for it in the
next step's all-reduce.
"""

import argparse
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elastic_trainer import ElasticSampler, Manager

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=1000)
p.add_argument("--max-steps", type=int, default=None, help="the ranks stop together after this many steps")
p.add_argument("--sleep-per-step", type=float, default=0.02)
p.add_argument("--first-step-seconds", type=float, default=0.0, help="a compile: the first step of --slow-node")
p.add_argument("--slow-every", type=int, default=0)
p.add_argument("--slow-seconds", type=float, default=0.0)
p.add_argument("--slow-node", default="", help="the hostname-independent node tag (ELASTIC_TRAINER_TEST_NODE)")
args = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
slow_here = bool(args.slow_node) and os.environ.get("ELASTIC_TRAINER_TEST_NODE", "") == args.slow_node

manager = Manager()
torch.manual_seed(0)
data = TensorDataset(torch.randn(960, 8), torch.randn(960, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
sampler = ElasticSampler(len(data), 48, manager.rank, manager.world_size, seed=0)
loader = manager.loader(DataLoader(data, batch_sampler=sampler))
ddp = manager.start(model, DDP, optimizer=opt)
first = True


def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
    global first
    if first and slow_here and args.first_step_seconds:
        time.sleep(args.first_step_seconds)  # a compile: no announcement, the warm-up covers it
    first = False
    loss = F.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.slow_every and (manager.steps + 1) % args.slow_every == 0 and slow_here:
        with manager.slow("checkpoint"):
            time.sleep(args.slow_seconds)
    return loss.item()


for epoch in range(sampler.epoch, args.epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        manager.step(train_step, x, y)
        if args.max_steps is not None and manager.steps >= args.max_steps:
            manager.stop()  # all stop at the next agreement
        time.sleep(args.sleep_per_step)
manager.finish()
