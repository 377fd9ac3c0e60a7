"""A user task, as a user would write one, for the trainer tests (``--task tests.helpers.task_fixture:build``).

It uses every optional hook (its own optimizer and LR scheduler, a ``training_step`` that draws
from the global torch RNG) so that resuming must restore all of them to match an uninterrupted
run. Its own flags come through ``args.task_argv``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from elastic_trainer.tasks import Task


def build(args: argparse.Namespace) -> Task:
    p = argparse.ArgumentParser(prog="task_fixture")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--noise", type=float, default=0.05, help="input noise drawn from the torch RNG per step")
    p.add_argument("--marker", default=None, help="write the args this builder saw to this file")
    opts = p.parse_args(args.task_argv)
    if opts.marker:
        Path(opts.marker).write_text(json.dumps({"task_argv": args.task_argv, "global_batch_size": args.global_batch_size}))
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(opts.samples, 8, generator=gen)
    y = torch.tanh(x @ torch.randn(8, 2, generator=gen))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def training_step(model: torch.nn.Module, batch) -> torch.Tensor:
        inputs, targets = batch
        inputs = inputs + opts.noise * torch.randn_like(inputs)  # global RNG: resume must restore it
        return F.mse_loss(model(inputs), targets)

    return Task(
        model=model,
        dataset=torch.utils.data.TensorDataset(x, y),
        training_step=training_step,
        optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
    )
