"""Model weights in and out of the safetensors format, which standard tools open.

Writing: :func:`export_weights` loads the newest complete checkpoint under a URL (or step ``N``),
verified as a resume would, and writes its model's weights (``state["model"]``: the full state
dict, as the trainer saves it under DDP, gathered from the shards under FSDP) with
``safetensors.torch.save_file``, the step and the source in the file's metadata. The file is
written beside the target and renamed into place, so a half-written file never has the target's
name. ``elastic-train export`` (``cli/export.py``) is the command around it.

Reading: ``--init-from`` loads such a file into the model before it is wrapped
(:func:`load_weights`; under FSDP rank 0 reads it with :func:`read_weights` and broadcasts) when
there is no checkpoint to resume from; a checkpoint, when there is one, wins (it holds the
optimizer too).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)


def weights_of(model_state: Any) -> dict[str, torch.Tensor]:
    """The tensors of a model state dict as safetensors takes them: contiguous, one storage each."""
    if not isinstance(model_state, dict):
        raise ValueError("the checkpoint has no model state dict")
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    skipped = []
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            skipped.append(str(key))
            continue
        tensor = value.detach().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen and tensor.numel():  # a tied weight: safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[str(key)] = tensor
    if skipped:
        log.warning("export: left out model entries that are not tensors: %s", ", ".join(skipped[:5]))
    return out


def export_weights(url: str, to: str, step: int | None = None) -> int:
    """Write the model weights of ``url``'s newest (or ``step``'s) checkpoint to ``to``; returns the step."""
    from safetensors.torch import save_file

    from elastic_trainer.checkpoint import CheckpointManager
    from elastic_trainer import storage

    found = CheckpointManager(url).load(step)
    if found is None:
        where = f"step-{step} of {storage.redact(url)}" if step is not None else storage.redact(url)
        raise ValueError(f"no complete checkpoint in {where} (see the warnings above for the ones skipped)")
    step, state = found
    from elastic_trainer.checkpoint.sharded import gathered, is_sharded

    if is_sharded(state):  # gathered from the shards of an --fsdp checkpoint
        state = gathered(CheckpointManager(url), step, state)
    weights = weights_of(state.get("model"))
    tmp = f"{to}.tmp-{os.getpid()}"
    try:
        save_file(weights, tmp, metadata={"step": str(step), "source": storage.redact(url), "format": "pt"})
        os.replace(tmp, to)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return step


def read_weights(module: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    """The weights of a safetensors file, checked against ``module``'s keys and shapes (without
    loading them); ``ValueError`` naming ``--init-from``."""
    from safetensors.torch import load_file

    try:
        weights = load_file(path)
    except Exception as exc:  # noqa: BLE001 - any reason the file cannot be read: say it in one line
        raise ValueError(f"--init-from {path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    own = module.state_dict()
    missing, unexpected = _mismatch(own, weights)
    if missing or unexpected:
        raise ValueError(f"--init-from {path} does not fit this model: missing {missing[:3] or 'none'}, unexpected "
                         f"{unexpected[:3] or 'none'}; export the weights of the same model (--task and its sizes)")
    wrong = [f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if v.shape != weights[k].shape]
    if wrong:
        raise ValueError(f"--init-from {path} does not fit this model: size mismatch for {wrong[0]}")
    return weights


def load_weights(module: torch.nn.Module, path: str) -> None:
    """Load a safetensors file into ``module`` (all keys must match); ``ValueError`` naming ``--init-from``."""
    weights = read_weights(module, path)
    try:
        module.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise ValueError(f"--init-from {path} does not fit this model: {first}") from exc


def _mismatch(own: dict, weights: dict) -> tuple[list[str], list[str]]:
    return sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
