"""examples/plain_ddp.py with live recovery: a lost node costs the others no restart, a new one joins.

    elastic-train --nnodes 1:3 --log-dir logs examples/own_loop.py --epochs 3 --sleep-per-step 0.05

Kill a node: the others keep their processes and train on at the smaller world size within a
fraction of a second; start it again: it receives the state from a live peer and the world grows
at the next agreed step. The ElasticSampler splits every epoch over whatever world there is, so no
sample is repeated or skipped. Steps and events go to ``--log-dir`` (the Manager writes them).
Under plain torchrun it is plain DDP. The lines that differ from plain_ddp.py: docs/usage.md.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from elastic_trainer import ElasticSampler, Manager

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=96, help="samples per step over all ranks")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--samples", type=int, default=9600)
parser.add_argument("--checkpoint", default="checkpoint.pt")
parser.add_argument("--sleep-per-step", type=float, default=0.0, help="a slower step (demos, benchmarks)")


def regression_data(samples: int) -> TensorDataset:
    """The same samples on every rank: y = x @ w + noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    args = parser.parse_args()
    manager = Manager()
    torch.manual_seed(0)
    data = regression_data(args.samples)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampler = ElasticSampler(len(data), args.batch_size, manager.rank, manager.world_size, seed=0)
    loader = manager.loader(DataLoader(data, batch_sampler=sampler))
    if os.path.exists(args.checkpoint):  # resume after the last epoch rank 0 saved
        ckpt = torch.load(args.checkpoint)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sampler.set_epoch(ckpt["epoch"] + 1)
    ddp = manager.start(model, DDP, optimizer=opt)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = manager.step(train_step, x, y)
            time.sleep(args.sleep_per_step)
        if dist.get_rank() == 0:  # written whole, then renamed: a reader never sees half a file
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch}: loss {loss}", flush=True)
    manager.finish()


if __name__ == "__main__":
    main()
