"""A user's DDP loop on ``elastic_trainer.Manager`` with slow phases, for the hang-detection tests.

Like ``examples/own_loop.py`` (steps in ``steps/rank-*.jsonl``), plus what a real loop does that
must not be taken for a hang: a long first step on one node (a compile), and every
``--slow-every`` steps a slow phase on one rank inside ``manager.slow("checkpoint")`` (a save
that blocks the loop), while its peers wait for it in the next step's all-reduce.
"""

import argparse
import logging
import os
import socket
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_trainer import Manager, records
from elastic_trainer.env import ENV_LOG_DIR

p = argparse.ArgumentParser()
p.add_argument("--max-steps", type=int, default=1000)
p.add_argument("--sleep-per-step", type=float, default=0.02)
p.add_argument("--first-step-seconds", type=float, default=0.0, help="a compile: the first step of --slow-node")
p.add_argument("--slow-every", type=int, default=0)
p.add_argument("--slow-seconds", type=float, default=0.0)
p.add_argument("--slow-node", default="", help="the hostname-independent node tag (ELASTIC_TRAINER_TEST_NODE)")
p.add_argument("--log-dir", default=os.environ.get(ENV_LOG_DIR, "logs"))
args = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
me = os.environ.get("ELASTIC_TRAINER_TEST_NODE", "")
slow_here = bool(args.slow_node) and me == args.slow_node

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
first = True


def state() -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def load(got: dict | None) -> None:
    global step
    if got is not None:
        model.load_state_dict(got["model"]), opt.load_state_dict(got["optimizer"])
        step = got["step"]


def train_step(ddp: DDP):
    global step, first
    if first and slow_here and args.first_step_seconds:
        time.sleep(args.first_step_seconds)  # a compile: no announcement, the warm-up covers it
    first = False
    g = torch.Generator().manual_seed(step * 1000 + manager.rank)
    x = torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if args.slow_every and step % args.slow_every == 0 and slow_here:
        with manager.slow("checkpoint"):
            time.sleep(args.slow_seconds)
    return loss.item(), manager.agree([0.0]) if manager.agree_due() else None


with Manager() as manager:
    load(manager.receive_state())
    log = records.JsonLines(records.steps_path(args.log_dir, manager.rank, os.getpid()))
    ddp = DDP(model)
    while step < args.max_steps:
        manager.before_step()
        out, failed = manager.run(lambda: train_step(ddp))
        if failed is None:
            log.write(records.StepRecord(time=time.time(), step=step, epoch=0, offset=0, rank=manager.rank,
                                         world_size=manager.world_size, round=manager.round, loss=out[0],
                                         restart=manager.env.restart_count or 0, node=socket.gethostname()))
            time.sleep(args.sleep_per_step)
        if failed is not None or (out[1] is not None and out[1].reform):
            ddp = None
            load(manager.reform(step, failed or "planned", state).state)
            ddp = DDP(model)
    manager.close(finished=step >= args.max_steps)
    ddp = None
    log.close()
