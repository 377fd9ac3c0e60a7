"""What ``--fsdp`` shards, seen from inside a rank (run under torchrun, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/fsdp_blocks.py OUT_DIR

Wraps the built-in example's model as the trainer does (``Parallel.wrap``, ``--fsdp``) and writes
``OUT_DIR/rank<r>.json``: which modules are FSDP units, each parameter's placement, this rank's
local and the global parameter bytes, and, seen from inside the first encoder layer's forward,
whether the first decoder layer's parameters are still sharded (they are only when each block is
its own unit: a ``fully_shard`` on the root alone gathers the whole model for the whole step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from elastic_trainer.config import TrainConfig
from elastic_trainer.tasks import build_example, example_args
from elastic_trainer.runtime import exit_without_teardown
from elastic_trainer.training.parallel import Parallel
from elastic_trainer.training.worker import DistInfo


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    args = example_args()
    args.d_model, args.nhead, args.dim_feedforward, args.src_len, args.dataset_size = 16, 2, 32, 4, 64
    task = build_example(args)
    model = task.model
    par = Parallel.wrap(model, TrainConfig(fsdp=True), DistInfo(rank=rank, world_size=world, distributed=True))
    seen = {}

    def probe(module, inputs, output):
        seen["decoder_sharded_during_encoder"] = isinstance(model.transformer.decoder.layers[0].linear1.weight,
                                                            DTensor)

    model.transformer.encoder.layers[0].register_forward_hook(probe)
    src, tgt = task.dataset[0]
    loss = task.compute_loss(par.model, (src[None], tgt[None]))
    loss.backward()
    params = {name: {"dtensor": isinstance(p, DTensor),
                     "shard_dim0": isinstance(p, DTensor) and [(type(x).__name__, getattr(x, "dim", None))
                                                               for x in p.placements] == [("Shard", 0)],
                     "local_bytes": (p.to_local() if isinstance(p, DTensor) else p).nbytes,
                     "global_bytes": p.numel() * p.element_size()}
              for name, p in model.named_parameters()}
    report = {"units": sorted(name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)),
              "params": params, **seen, "world": world}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo may abort in interpreter teardown after a clean run (runtime.py says how)
