"""How --fsdp is applied (elastic_trainer/training/parallel.py), decided without a process group:
which modules are sharded one by one, and the mixed-precision policy for each device and --amp.
The sharding itself runs on real gloo ranks in tests/test_trainer.py (``test_fsdp_*``)."""

from __future__ import annotations

import pytest
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_model_reaches_the_gpu_sharded_and_blocks_compute_in_bf16():
    """World size 1 over NCCL: Parallel.wrap moves the CPU-built model to the GPU (fully_shard, block
    by block), blocks run in bf16 under --amp bf16, and parameters and gradients stay fp32."""
    import torch.distributed as dist

    from elastic_trainer.config import TrainConfig
    from elastic_trainer.training.parallel import Parallel
    from elastic_trainer.training.worker import DistInfo

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = example_args()
        args.d_model, args.nhead, args.dim_feedforward, args.src_len = 16, 2, 32, 4
        task = build_example(args)
        model = task.model
        config = TrainConfig(fsdp=True)
        config.amp = "bf16"
        par = Parallel.wrap(model, config, DistInfo(device=device, distributed=True, world_size=1))
        seen = {}

        def hook(module, inputs) -> None:  # None: a hook's result would replace the inputs
            seen.setdefault("dtype", module.linear1.weight.dtype)
        # a pre-hook: FSDP's own pre-forward (all-gather, bf16) runs before it; its post-forward
        # reshards (fp32 shards again) before any forward hook registered after it
        model.transformer.encoder.layers[0].register_forward_pre_hook(hook)
        src, tgt = task.dataset[0]
        task.compute_loss(par.model, (src[None].to(device), tgt[None].to(device))).backward()
        assert seen["dtype"] == torch.bfloat16
        for name, p in model.named_parameters():
            assert p.device == device and p.dtype == torch.float32, name
            assert p.grad is not None and p.grad.dtype == torch.float32, name
    finally:
        dist.destroy_process_group()
