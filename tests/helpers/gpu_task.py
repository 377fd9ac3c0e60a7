"""A task whose first steps overflow in float16 (``--task tests.helpers.gpu_task:build``), for the
``--amp fp16`` tests: the GradScaler must skip those steps and the LR scheduler must not count them.

``--overflow-steps K``: the first K calls of ``training_step`` multiply the loss by 1e30 (finite in
float32; its gradients overflow in float16, so the scaler finds inf and skips the step).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from elastic_trainer.tasks import Task


def build(args: argparse.Namespace) -> Task:
    p = argparse.ArgumentParser(prog="gpu_task")
    p.add_argument("--overflow-steps", type=int, default=0)
    opts = p.parse_args(args.task_argv)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=gen)
    y = x @ torch.randn(16, 4, generator=gen)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    calls = [0]

    def training_step(model: torch.nn.Module, batch) -> torch.Tensor:
        calls[0] += 1
        inputs, targets = batch
        loss = F.mse_loss(model(inputs), targets)
        return loss * 1e30 if calls[0] <= opts.overflow_steps else loss

    return Task(model=model, dataset=torch.utils.data.TensorDataset(x, y), training_step=training_step,
                optimizer_fn=lambda params: torch.optim.SGD(params, lr=1e-3),
                scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
