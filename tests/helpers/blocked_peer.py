"""Two gloo ranks for the test that a rank leaving a broken group frees it at once.

    python tests/helpers/blocked_peer.py RANK PORT OUT_JSON

Rank 1 waits in ``recv`` from rank 0 (a survivor blocked on another survivor, not on the dead
peer). Rank 0's DDP step fails (its all-reduce times out after 3 s: rank 1 never joins it), goes
through the Manager's ``run_or_failed_collective`` and ``leave_process_group`` as a live re-form
does, then stays alive 12 s. Each rank writes when things happened to OUT_JSON.RANK; rank 1's
``recv`` must fail as soon as rank 0 left, not when rank 0 exits.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elastic_trainer.training.manager import leave_process_group, run_or_failed_collective


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3 if rank == 0 else 60))
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp(torch.ones(2, 4)).sum().backward()  # one good step together
    times: dict[str, float | str] = {}
    if rank == 1:
        t = torch.zeros(1)
        try:
            dist.recv(t, src=0)
            times["recv"] = "returned"
        except RuntimeError:
            times["recv_failed"] = time.time()
    else:
        def step() -> None:
            out = ddp(torch.ones(2, 4))  # locals as in the trainer's step: the traceback holds them
            loss = out.sum()
            loss.backward()  # rank 1 never joins: times out

        _, failed = run_or_failed_collective(step, recover=True)
        assert failed is not None
        ddp = None  # noqa: F841 - as the re-form drops DDP before it leaves the group
        leave_process_group()
        times["left"] = time.time()
        time.sleep(12)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(times, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
