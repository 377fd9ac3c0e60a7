"""The baseline: plain torchrun + DDP training of the built-in example task, no fault tolerance.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/plain_ddp.py --max-steps 110 --log-dir /tmp/plain

This is what a user would write without elastic-trainer: ``DistributedSampler``, a ``DataLoader``
with ``batch_size = global batch / world size``, ``DistributedDataParallel``, Adam, no checkpoints,
no step log during training. The model, the data and the loss come from the same builder the
trainer uses (``elastic_trainer.tasks.build_example``, same flags, same defaults), so both train the
identical workload at the same global batch and world size; only the loop around it differs.

Timing: rank 0 keeps the wall-clock time after every optimizer step in memory (no I/O in the loop).
At the end each rank writes those times as its step log under ``--log-dir``, one
``elastic_trainer.records.StepRecord`` per step with its time, step, world size and rank (the
trainer's step-log format, so one parser reads both), and rank 0 prints one line::

    plain_ddp: {"samples_per_s": ..., "first_step": W, "last_step": N, "global_batch_size": ..., ...}

with samples/s measured over the steps after ``--warmup-steps``.

``--live-step-log`` writes each line as its step ends instead (``benchmarks/live_recovery.py`` reads
the logs while torchrun recovers the job), ``--sleep-per-step`` pads every step as the trainer's
flag of that name does, and ``--collective-timeout`` bounds the gloo collectives (silent faults).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from elastic_trainer import records
from elastic_trainer.tasks import add_example_arguments, build_example


def _die_with_parent() -> None:
    """SIGKILL this worker when its torchrun agent dies (workers live in their own sessions)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--global-batch-size", type=int, default=32, help="samples per step over all ranks (default 32)")
    p.add_argument("--max-steps", type=int, default=110, help="optimizer steps to run (default 110)")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of samples/s (default 10)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3, as the trainer)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed (default 0)")
    p.add_argument("--log-dir", default=None, help="write the per-step times to <log-dir>/steps/ at the end")
    p.add_argument("--live-step-log", action="store_true",
                   help="write each step's line to <log-dir>/steps/ as it ends, not at exit (recovery benchmarks "
                        "read it while the job runs; a killed worker keeps what it logged)")
    p.add_argument("--sleep-per-step", type=float, default=0.0,
                   help="seconds to sleep after every step, as the trainer's flag (default 0)")
    p.add_argument("--collective-timeout", type=float, default=None,
                   help="seconds a gloo collective may wait before it fails (default: torch's, 30 min); "
                        "what a user lowers to get out of a hang on a silent peer")
    add_example_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    args = build_parser().parse_args(argv)
    if args.collective_timeout is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch_size % world:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} must be divisible by the world size {world}")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # the trainer seeds the same way before building the task
    task = build_example(args)
    model = DDP(task.model)
    sampler = DistributedSampler(task.dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    loader = DataLoader(task.dataset, batch_size=args.global_batch_size // world, sampler=sampler, drop_last=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    times: list[float] = []
    step, epoch = 0, 0
    live_log = None
    if args.live_step_log:
        if not args.log_dir:
            raise SystemExit("--live-step-log needs --log-dir")
        live_log = records.JsonLines(records.steps_path(args.log_dir, rank, os.getpid()))  # flushed per line
    model.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = task.compute_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            times.append(time.time())
            if live_log is not None:
                live_log.write(records.StepRecord(time=times[-1], step=step, world_size=world, rank=rank))
            if args.sleep_per_step:
                time.sleep(args.sleep_per_step)
            if step >= args.max_steps:
                break
        epoch += 1
    final_loss = float(loss.detach())

    if live_log is not None:
        live_log.close()
    elif args.log_dir:
        log = records.JsonLines(records.steps_path(args.log_dir, rank, os.getpid()))
        for i, t in enumerate(times, start=1):
            log.write(records.StepRecord(time=t, step=i, world_size=world, rank=rank))
        log.close()
    if rank == 0:
        w = min(args.warmup_steps, len(times) - 2) if len(times) >= 2 else 0
        span = times[-1] - times[w] if len(times) >= 2 else float("nan")
        n = len(times) - 1 - w
        result = {"samples_per_s": n * args.global_batch_size / span if span > 0 else float("nan"),
                  "first_step": w + 1, "last_step": len(times), "seconds": span,
                  "global_batch_size": args.global_batch_size, "world_size": world, "final_loss": final_loss}
        print("plain_ddp: " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # as the trainer's workers do: no exit-time teardown, where gloo can abort a finished run
    from elastic_trainer.runtime import exit_without_teardown

    exit_without_teardown(main())
