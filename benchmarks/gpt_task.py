"""A GPT-class task for the GPU benchmarks: a decoder-only Transformer on random tokens.

    python -m elastic_trainer.train --task benchmarks/gpt_task.py:build --device cuda --amp bf16 \\
        --global-batch-size 16 --max-steps 300 --gpt-width 1024 --gpt-blocks 8 --gpt-seq 512

The default size (d 1024, 8 blocks of 16 heads, sequence 512, vocabulary 32,000, untied output
layer) has 166M parameters: with AdamW a 2.0 GB checkpoint (fp32 parameters and two moments), and
about 30 ms a step at batch 16 under bf16 autocast on an H100. The data are random tokens drawn
from a seed (nothing to learn; the loss stays near ln(vocab)); ``--gpt-samples`` of them, in memory.
``benchmarks/gpu_overhead.py`` trains the same model with plain ``torchrun`` + DDP
(``make_model``, ``make_dataset``, ``make_optimizer`` and ``loss`` are shared by both sides).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

from elastic_trainer.tasks import Task


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The task's flags, named --gpt-* so that the trainer's own flags (--d-model, --lr) never take them."""
    p.add_argument("--gpt-width", type=int, default=1024, help="d_model (default 1024)")
    p.add_argument("--gpt-blocks", type=int, default=8, help="Transformer blocks (default 8)")
    p.add_argument("--gpt-heads", type=int, default=16, help="attention heads (default 16)")
    p.add_argument("--gpt-seq", type=int, default=512, help="tokens per sample (default 512)")
    p.add_argument("--gpt-vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--gpt-samples", type=int, default=8192, help="random token sequences in the data set (default 8192)")
    p.add_argument("--gpt-lr", type=float, default=3e-4, help="AdamW's learning rate (default 3e-4)")
    return p


class Block(nn.Module):
    """Pre-norm attention (causal, ``scaled_dot_product_attention``) and a 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, blocks: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * blocks) if name.endswith(("proj.weight", "out.weight"))
                                               else 1.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_model(opts: argparse.Namespace) -> GPT:
    return GPT(opts.gpt_vocab, opts.gpt_seq, opts.gpt_width, opts.gpt_blocks, opts.gpt_heads)


def make_dataset(opts: argparse.Namespace, seed: int = 0) -> torch.utils.data.TensorDataset:
    tokens = torch.randint(opts.gpt_vocab, (opts.gpt_samples, opts.gpt_seq + 1),
                           generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def make_optimizer(params, opts: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=opts.gpt_lr, weight_decay=0.1)


def loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def build(args: argparse.Namespace) -> Task:
    """The trainer's builder (``--task benchmarks/gpt_task.py:build``); its --gpt-* flags go among the trainer's."""
    opts = add_arguments(argparse.ArgumentParser(prog="gpt_task")).parse_args(args.task_argv)
    return Task(model=make_model(opts), dataset=make_dataset(opts), training_step=loss,
                optimizer_fn=lambda params: make_optimizer(params, opts),
                fsdp_blocks=lambda model: list(model.blocks))
