"""How the model is spread over the ranks: DDP (the default) or FSDP2, then ``torch.compile``.

``Parallel.wrap(module, config, dinfo)`` returns the one object the training loop asks about the
data-parallel wrapper:

- ``model``: what the forward pass runs (the DDP wrapper, the sharded module, a compiled one, or
  the bare module in a single process);
- ``no_sync()``: no gradient all-reduce for the micro-batches before the last of a step;
- ``model_state()``, ``optimizer_state(optimizer)``, ``load_optimizer_state(optimizer, state)``:
  full (unsharded) state dicts on CPU, so a checkpoint holds whole tensors whatever wrote it.
  Under FSDP these are collectives: every rank calls them.

The model's weights are loaded into the bare module *before* wrapping (DDP broadcasts rank 0's
parameters; FSDP shards what every rank holds), so only the optimizer state is set through here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from elastic_trainer.config import TrainConfig
from elastic_trainer.training.worker import DistInfo


@dataclass
class Parallel:
    """The bare ``module`` and what wraps it; see the module docstring."""

    module: torch.nn.Module
    model: torch.nn.Module
    ddp: torch.nn.Module | None = None
    fsdp: bool = False

    @classmethod
    def wrap(cls, module: torch.nn.Module, config: TrainConfig, dinfo: DistInfo) -> "Parallel":
        """DDP (or FSDP with ``--fsdp``) around ``module`` when distributed, then ``torch.compile``
        with ``--compile``."""
        par = cls(module=module, model=module)
        if dinfo.distributed and config.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=init_device_mesh(dinfo.device.type, (dinfo.world_size,)))
            par.fsdp = True
        elif dinfo.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            kwargs = {"bucket_cap_mb": config.bucket_cap_mb} if config.bucket_cap_mb else {}
            if dinfo.device.type == "cuda":
                kwargs["device_ids"] = [dinfo.device.index]
            par.ddp = par.model = DDP(module, **kwargs)  # broadcasts rank 0's parameters
        if config.compile:
            par.model = torch.compile(par.model)
        return par

    def unwrap(self) -> "Parallel":
        """The bare module without its DDP wrapper (which must go before its process group does)."""
        return Parallel(module=self.module, model=self.module, fsdp=self.fsdp)

    def no_sync(self):
        """A context in which backward accumulates gradients locally, without all-reducing them."""
        if self.ddp is not None:
            return self.ddp.no_sync()
        if self.fsdp:
            return self._fsdp_no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _fsdp_no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def model_state(self) -> dict:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.module.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.module, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.module, optimizer, optim_state_dict=state,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(state)
