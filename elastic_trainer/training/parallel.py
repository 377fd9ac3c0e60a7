"""How the model is spread over the ranks: DDP (the default) or FSDP2, then ``torch.compile``.

``Parallel.wrap(module, config, dinfo)`` returns the one object the training loop asks about the
data-parallel wrapper:

- ``model``: what the forward pass runs (the DDP wrapper, the sharded module, a compiled one, or
  the bare module in a single process);
- ``no_sync()``: no gradient all-reduce for the micro-batches before the last of a step;
- ``model_state()``, ``optimizer_state(optimizer)``, ``load_optimizer_state(optimizer, state)``:
  full (unsharded) state dicts on CPU, so a checkpoint holds whole tensors whatever wrote it.
  Under FSDP these are collectives: every rank calls them.

Under DDP the model's weights are loaded into the bare module *before* wrapping (DDP broadcasts
rank 0's parameters), so only the optimizer state is set through here.

On more than one node ``--fsdp`` is HSDP: sharded over a node's workers, replicated across nodes
(``fsdp_options``; ``training/hsdp.py`` heals a lost replica under live recovery).

FSDP2 as torchtitan applies it (``torchtitan/models/*/parallelize``): ``fully_shard`` on every
block (``fsdp_blocks``: each transformer layer), then on the root, which keeps what is left (the
embeddings, the head). Each block's parameters are then gathered only around its own forward and
backward and freed after, so a rank holds its shards plus about one block in full, where a
``fully_shard`` on the root alone gathers the whole model for the whole step. The model is left
on the CPU until ``fully_shard`` moves it, one block at a time, to the mesh's device, so the full
model is never on any GPU. With ``--amp bf16`` on CUDA a ``MixedPrecisionPolicy`` computes in
bf16 and reduces gradients in fp32 (``fsdp_mixed_precision``). A whole-state checkpoint is loaded
after the wrap, from rank 0 only (``load_model_state``/``load_optimizer_state`` with
``broadcast_from_rank0``: one tensor at a time, not a full copy per rank).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from elastic_trainer.config import TrainConfig
from elastic_trainer.training.worker import DistInfo

logger = logging.getLogger(__name__)


@dataclass
class Parallel:
    """The bare ``module`` and what wraps it; see the module docstring."""

    module: torch.nn.Module
    model: torch.nn.Module
    ddp: torch.nn.Module | None = None
    fsdp: bool = False

    @classmethod
    def wrap(cls, module: torch.nn.Module, config: TrainConfig, dinfo: DistInfo,
             blocks: Iterable[torch.nn.Module] | None = None, group: Callable[[str], object] | None = None,
             init_sync: bool = True) -> "Parallel":
        """DDP (or FSDP with ``--fsdp``: each of ``blocks``, default ``fsdp_blocks(module)``, then the
        root) around ``module`` when distributed, then ``torch.compile`` with ``--compile``.
        ``group``: ``Manager.group``, which holds the mesh's groups (``hsdp.group_plan``).
        ``init_sync`` False: DDP does not broadcast rank 0's parameters (every rank alike: a live
        join whose newcomers get theirs late, ``Reform.late``)."""
        par = cls(module=module, model=module)
        if dinfo.distributed and config.fsdp:
            from torch.distributed.fsdp import fully_shard

            options = fsdp_options(config, dinfo, group)
            for block in (fsdp_blocks(module) if blocks is None else list(blocks)):
                fully_shard(block, **options)
            fully_shard(module, **options)
            par.fsdp = True
        elif dinfo.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            kwargs = {"bucket_cap_mb": config.bucket_cap_mb} if config.bucket_cap_mb else {}
            if dinfo.device.type == "cuda":
                kwargs["device_ids"] = [dinfo.device.index]
            par.ddp = par.model = DDP(module, init_sync=init_sync, **kwargs)  # broadcasts rank 0's parameters
        if config.compile:
            par.model = torch.compile(par.model)
        return par

    @classmethod
    def rewrap(cls, skeleton: torch.nn.Module, config: TrainConfig, dinfo: DistInfo,
               blocks=None, group: Callable[[str], object] | None = None) -> "Parallel":
        """FSDP after a live re-form: a new sharded model on the new group's mesh, made from the meta
        ``skeleton`` (``hsdp.meta_skeleton``), its shards allocated but not set (load them:
        ``hsdp.Shards.load_into``, or a checkpoint)."""
        from elastic_trainer.training import hsdp

        options = fsdp_options(config, dinfo, group)
        module = hsdp.rewrap(skeleton, options["mesh"], blocks or fsdp_blocks, dinfo.device, options.get("mp_policy"))
        return cls(module=module, model=torch.compile(module) if config.compile else module, fsdp=True)

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

    def load_model_state(self, state: dict) -> None:
        """A whole-model state dict into the sharded module: rank 0's ``state`` is broadcast tensor
        by tensor and every rank keeps its shard (the other ranks pass ``{}``). FSDP only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Under FSDP a collective: rank 0's whole ``state`` is broadcast (the others pass ``{}``)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.module, optimizer, optim_state_dict=state,
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        else:
            optimizer.load_state_dict(state)


def fsdp_blocks(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``--fsdp`` shards one by one before the root: the elements of every outermost
    ``nn.ModuleList``/``nn.ModuleDict`` (the layers of a transformer: ``nn.Transformer``'s encoder
    and decoder layers, a ``model.layers``), or, for an ``nn.Sequential`` model, its children that
    hold parameters. A task can name its own (``Task.fsdp_blocks``). Blocks are not searched
    inside; modules outside every block (embeddings, final norm, head) stay with the root."""
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    if isinstance(root, (*containers, torch.nn.Sequential)):
        return [m for m in root.children() if any(True for _ in m.parameters())]
    blocks: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, containers):
                blocks.extend(m for m in child.children() if any(True for _ in m.parameters()))
            else:
                visit(child)

    visit(root)
    return blocks


def fsdp_options(config: TrainConfig, dinfo: DistInfo, group: Callable[[str], object] | None = None) -> dict:
    """``fully_shard``'s mesh and mixed-precision policy: HSDP (replicate across nodes x shard over
    a node's ``local_world_size`` workers) on more than one node, one shard per rank with
    ``--fsdp-shard-all`` or on one node (``training/hsdp.py``)."""
    from elastic_trainer.training.hsdp import device_mesh

    mesh = device_mesh(dinfo.device, dinfo.world_size, dinfo.local_world_size, config.fsdp_shard_all, group)
    if dinfo.rank == 0:
        logger.info("fsdp: %s over %s", "HSDP" if mesh.ndim == 2 else "sharded",
                    ", ".join(f"{n}={k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape)))
    options: dict = {"mesh": mesh}
    policy = fsdp_mixed_precision(dinfo.device, torch.bfloat16 if config.amp == "bf16" else None)
    if policy is not None:
        options["mp_policy"] = policy
    return options


def fsdp_mixed_precision(device: torch.device, amp_dtype: torch.dtype | None):
    """FSDP's ``MixedPrecisionPolicy`` for ``--amp``: parameters gathered and computed in bf16,
    gradients reduced in fp32, with bf16 on CUDA (as torchtitan); None otherwise (fp32 throughout
    on the CPU, where gloo reduces what autocast leaves; fp16 keeps its autocast and GradScaler)."""
    if device.type != "cuda" or amp_dtype != torch.bfloat16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
