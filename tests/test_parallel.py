"""How --fsdp is applied (elastic_trainer/training/parallel.py), decided without a process group:
which modules are sharded one by one, and the mixed-precision policy for each device and --amp.
The sharding itself runs on real gloo ranks in tests/test_trainer.py (``test_fsdp_*``)."""

from __future__ import annotations

import torch

from elastic_trainer.tasks import build_example, example_args
from elastic_trainer.training.parallel import fsdp_blocks, fsdp_mixed_precision


def test_the_blocks_are_every_transformer_layer_and_the_rest_stays_with_the_root():
    args = example_args()
    args.d_model, args.nhead, args.dim_feedforward, args.layers = 16, 2, 32, 3
    model = build_example(args).model
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(b)] for b in fsdp_blocks(model)] == (
        [f"transformer.encoder.layers.{i}" for i in range(3)] + [f"transformer.decoder.layers.{i}" for i in range(3)])


def test_a_sequential_model_shards_each_layer_with_parameters_and_nothing_is_searched_inside_a_block():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    assert fsdp_blocks(mlp) == [mlp[0], mlp[2]]

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.layers = torch.nn.ModuleDict({"a": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList(
                [torch.nn.Linear(4, 4)])), "b": torch.nn.Linear(4, 4), "empty": torch.nn.ReLU()})

    net = Net()
    assert fsdp_blocks(net) == [net.layers["a"], net.layers["b"]]
    assert fsdp_blocks(torch.nn.Linear(2, 2)) == []  # nothing to split: the root alone


def test_mixed_precision_is_bf16_compute_with_fp32_reduction_on_cuda_only():
    policy = fsdp_mixed_precision(torch.device("cuda", 0), torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_mixed_precision(torch.device("cpu"), torch.bfloat16) is None
    assert fsdp_mixed_precision(torch.device("cuda", 0), torch.float16) is None  # autocast and a GradScaler
    assert fsdp_mixed_precision(torch.device("cuda", 0), None) is None
