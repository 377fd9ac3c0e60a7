"""Your own DDP loop with live recovery: a lost node costs the others no restart, a new one joins.

    elastic-train --nnodes 1:3 --log-dir logs examples/own_loop.py --max-steps 5000 --sleep-per-step 0.05

Kill a node: the others keep their processes and train on at the smaller world size within a
fraction of a second (``Manager.reform``); start it again: it receives the state from a live peer
and the world grows at the next agreed step. Steps are logged as the built-in trainer logs them
(``steps/rank-*.jsonl`` under ``--log-dir``). Under plain torchrun it trains as plain DDP.
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

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--max-steps", type=int, default=1000)
p.add_argument("--max-seconds", type=float, default=None, help="stop after this long (rank 0's clock)")
p.add_argument("--sleep-per-step", type=float, default=0.0, help="a longer step, for benchmarks")
p.add_argument("--log-dir", default=os.environ.get(ENV_LOG_DIR, "logs"))
args = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step, started = 0, time.monotonic()


def state() -> dict:  # what a newcomer (or a rank behind) receives from a live peer
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def load(got: dict | None) -> None:
    global step
    if got is not None:
        model.load_state_dict(got["model"]), opt.load_state_dict(got["optimizer"])
        step = got["step"]


def train_step(ddp: DDP):  # one step and, every few steps, the ranks' agreement
    global step
    g = torch.Generator().manual_seed(step * 1000 + manager.rank)  # this rank's synthetic batch
    x = torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()  # the gradient all-reduce: a lost peer fails it here
    opt.step()
    step += 1
    out_of_time = manager.rank == 0 and args.max_seconds is not None and time.monotonic() - started > args.max_seconds
    return loss.item(), manager.agree([float(out_of_time)]) if manager.agree_due() else None


with Manager() as manager:  # joins the live quorum's process group (plain torchrun: its group)
    load(manager.receive_state())
    log = records.JsonLines(records.steps_path(args.log_dir, manager.rank, os.getpid()))
    ddp = DDP(model)
    while step < args.max_steps:
        manager.before_step()
        out, failed = manager.run(lambda: train_step(ddp))  # (None, cause) when a collective failed
        if failed is None:
            log.write(records.StepRecord(time=time.time(), step=step, epoch=0, offset=0, rank=manager.rank,
                                         world_size=manager.world_size, round=manager.round, loss=out[0],
                                         restart=manager.env.restart_count or 0, node=socket.gethostname()))
            if out[1] is not None and out[1].values[0] > 0:
                break
            time.sleep(args.sleep_per_step)
        if failed is not None or (out[1] is not None and out[1].reform):
            ddp = None  # nothing may refer to the old group
            load(manager.reform(step, failed or "planned", state).state)
            ddp = DDP(model)
    manager.close(finished=step >= args.max_steps)
    ddp = None
    log.close()
