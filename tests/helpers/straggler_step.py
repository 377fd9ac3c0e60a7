"""One rank of a tiny DDP job on gloo whose steps are timed by ``StepClock``; a rank may be made slow
in its own compute or in its data loading::

    python -m tests.helpers.straggler_step RANK WORLD INIT_FILE STEPS SLOW_COMPUTE_RANK SLOW_DATA_RANK SLEEP_S

``SLOW_COMPUTE_RANK`` sleeps ``SLEEP_S`` inside the model's forward each step, ``SLOW_DATA_RANK`` while
fetching its batch (-1: none). Prints one JSON line: this rank's median own time, data time and step
period over the steps after the first two (DDP's warm-up and bucket rebuild).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_trainer.observability.step_clock import StepClock


class Model(torch.nn.Module):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        # The BatchNorm's buffers make DDP's forward broadcast rank 0's: a collective before the last bucket.
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                          torch.nn.Linear(64, 1))
        self.sleep = sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep:
            time.sleep(self.sleep)  # this rank's own compute is slow
        return self.layers(x)


def main() -> None:
    rank, world, init, steps, slow_compute, slow_data, sleep = sys.argv[1:8]
    rank, world, steps, sleep = int(rank), int(world), int(steps), float(sleep)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ddp = DistributedDataParallel(Model(sleep if rank == int(slow_compute) else 0.0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    clock = StepClock()
    clock.attach(ddp)
    own, data, periods = [], [], []
    for step in range(steps):
        began = time.perf_counter()
        clock.start()
        if rank == int(slow_data):
            time.sleep(sleep)  # this rank's loader is slow
        batch = torch.randn(32, 64)
        clock.data_ready()
        opt.zero_grad()
        ddp(batch).sum().backward()
        opt.step()
        [t] = clock.stop()
        if step >= 2:
            own.append(t.own)
            data.append(t.data)
            periods.append(time.perf_counter() - began)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "own": statistics.median(own), "data": statistics.median(data),
                      "period": statistics.median(periods)}), flush=True)


if __name__ == "__main__":
    from elastic_trainer.runtime import exit_without_teardown

    main()
    exit_without_teardown(0)  # gloo may abort in the interpreter's teardown after a clean run (runtime.py says how)
