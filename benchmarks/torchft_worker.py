"""One TorchFT replica group of one process (``benchmarks/torchft_join.py`` starts them): TorchFT's
own DDP example (``torchft/examples``: ``Manager``, its ``DistributedDataParallel`` and ``Optimizer``
wrappers, gloo) on a small MLP, a step padded with ``--sleep-per-step``, each step written as a line
of ``<out>/steps/torchft-<replica>.jsonl`` (time, step, participants as ``world_size``, pid).

It needs ``torchft`` importable (``torchft_join.py`` installs it in a folder of its own and puts it
on ``PYTHONPATH``); the lighthouse's address comes in ``TORCHFT_LIGHTHOUSE``, as in TorchFT's examples.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sleep-per-step", type=float, default=0.05)
    args = p.parse_args()
    torch.manual_seed(0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's own store
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"bench_{args.replica}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1",
                      timeout=timedelta(seconds=10))
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    steps = Path(args.out) / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    x, y = torch.randn(12, 16), torch.randn(12, 16)
    with open(steps / f"torchft-{args.replica}.jsonl", "a", buffering=1) as log:
        while True:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            time.sleep(args.sleep_per_step)
            optimizer.step()
            log.write(json.dumps({"time": time.time(), "step": manager.current_step(),
                                  "world_size": manager.num_participants(), "rank": args.replica,
                                  "pid": os.getpid()}) + "\n")


if __name__ == "__main__":
    main()
