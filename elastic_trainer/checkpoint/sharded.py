"""Sharded checkpoints of FSDP models through ``torch.distributed.checkpoint`` (DCP).

A full-state save gathers every parameter and optimizer state on rank 0, so a model whose state
does not fit in one host's memory cannot be checkpointed that way. Here every rank writes its own
shards (DCP's ``save``, one file per rank, plus DCP's ``.metadata`` from its coordinator) into
``<url>/step-N/dcp-<writer>/``; rank 0 then writes the small rest of the state (RNG, sampler,
scheduler, meta) as its usual format-3 file and commits the manifest last, listing every shard
file with its size and xxh3_128 (hashed from storage, streamed), fenced like any commit
(``CheckpointManager``, ``record.py``). A reader verifies every file before anything is loaded.
Loading reshards: DCP's ``load`` fills the sharded state dicts of the *current* model and
optimizer, whatever world size wrote them.

    # every rank, collectively:
    save_sharded(ckpt, step, module, optimizer, rest={"rng": ..., "sampler": ..., "meta": ...})
    found = ckpt.load()                                   # rank 0, then broadcast the step; rest
    load_sharded(ckpt, step, found[1], module, optimizer) # every rank, collectively

Local and NFS paths use DCP's public ``FileSystemWriter``/``FileSystemReader``; other stores
are not supported for sharded saves yet (``ValueError`` naming ``--fsdp``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.checkpoint import storage

log = logging.getLogger(__name__)

SHARDS = "dcp"
"""The prefix of the DCP folder inside a step folder (``dcp-<writer id>``)."""


def _check_store(ckpt) -> None:
    if not storage.is_local(ckpt.fs):
        raise ValueError(f"sharded --fsdp checkpoints are written only to local or NFS paths so far, not "
                         f"{storage.redact(ckpt.url)}; use a mounted path for --checkpoint-dir")


def _sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}


def save_sharded(ckpt, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 rest: dict | None) -> bool:
    """Every rank: write this rank's shards of ``step``; rank 0 (``rest`` given there) then commits
    the step with its manifest listing every shard. Blocking; returns whether it was committed
    (on rank 0; True elsewhere)."""
    import torch.distributed.checkpoint as dcp

    _check_store(ckpt)
    box = [f"{SHARDS}-{ckpt.writer_id}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    path = storage.join(ckpt.root, f"step-{step}", folder)
    storage.makedirs(ckpt.fs, path)
    dcp.save(_sharded_state(module, optimizer), storage_writer=dcp.FileSystemWriter(path))
    committed = True
    if dist.get_rank() == 0:
        ckpt.save(step, {**(rest or {}), "sharded": {"folder": folder}}, blocking=True, include=folder)
        committed = bool(ckpt.last_save_stats.get("committed"))
    dist.barrier()  # no rank moves on (and changes its shards) before the commit
    return committed


def load_sharded(ckpt, step: int, state: dict, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: load the shards of ``step`` (already verified by ``ckpt.load``) into ``module``
    and ``optimizer`` at this world size; ``state`` is what ``ckpt.load`` returned for it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    info = state.get("sharded")
    if not isinstance(info, dict) or not isinstance(info.get("folder"), str):
        raise ValueError(f"checkpoint step-{step} holds no sharded state")
    path = storage.join(ckpt.root, f"step-{step}", info["folder"])
    target = _sharded_state(module, optimizer)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path))
    set_model_state_dict(module, target["model"])
    set_optimizer_state_dict(module, optimizer, optim_state_dict=target["optimizer"])


def gathered(ckpt, step: int, state: dict) -> dict:
    """The whole model and optimizer state of a sharded ``step`` in this process, without a process
    group (``export``, tests): DCP's public ``dcp_to_torch_save`` through a temporary file. Needs
    the memory of the whole state, as any single-file export does."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = storage.join(ckpt.root, f"step-{step}", state["sharded"]["folder"])
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/full.pt"
        dcp_to_torch_save(path, out)
        return torch.load(out, map_location="cpu", weights_only=True)


def is_sharded(state: Any) -> bool:
    """Whether a loaded checkpoint state is the rest of a sharded save."""
    return isinstance(state, dict) and isinstance(state.get("sharded"), dict)
