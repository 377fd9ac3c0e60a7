"""The random number generators' state of a process, captured into a checkpoint and restored.

A resumed run draws the same numbers as one that never stopped only if every generator it uses
is restored: Python's ``random``, numpy's global generator, torch's CPU generator and the CUDA
generator of this process's own device. ``capture_rng_state`` returns them in a form that a
checkpoint holds without pickle (tensors, numbers, strings and lists: ``format.py``, and
``torch.load(weights_only=True)`` for older formats); ``restore_rng_state`` puts them back.
The trainer saves every rank's own state (``training/rng.py``).

    state["rng"] = capture_rng_state()
    ...
    restore_rng_state(state["rng"])
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng_state(device: torch.device | str | None = None) -> dict:
    """This process's Python, numpy, torch CPU and CUDA RNG states, in weights_only-safe form.

    ``"cuda"`` is the generator of this process's own device only (``device``, default the
    current CUDA device when CUDA is available): one tensor, not every device's. Rank 0 saving
    ``get_rng_state_all()`` once gave rank k, on restore, the generator of rank 0's device k (one
    rank 0 never used); the trainer now saves every rank's own state (``training/rng.py``).
    """
    py_version, py_state, py_gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": int(py_version), "state": [int(x) for x in py_state], "gauss": py_gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    cuda = _cuda_device(device)
    if cuda is not None:
        state["cuda"] = torch.cuda.get_rng_state(cuda).cpu()
    return state


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    """The CUDA device whose generator is this process's: ``device`` if it is one, the current
    device when none is given and CUDA is available, else None (a CPU process)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def restore_rng_state(d: dict, device: torch.device | str | None = None) -> None:
    """Restore what ``capture_rng_state`` captured; its CUDA state goes to this process's device
    (``device``, default the current one) when both sides have CUDA.

    Checkpoints written before the per-device state hold ``"cuda"`` as a list of every device
    rank 0 saw; its first entry (rank 0's own device, local rank 0) is restored then."""
    py = d["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
    npd = d["numpy"]
    keys = npd["keys"].numpy() if isinstance(npd["keys"], torch.Tensor) else np.asarray(npd["keys"])
    np.random.set_state((npd["kind"], keys.astype(np.uint32), int(npd["pos"]), int(npd["has_gauss"]),
                         float(npd["cached_gaussian"])))
    torch.set_rng_state(d["torch"])
    cuda = _cuda_device(device) if "cuda" in d else None
    if cuda is not None:
        saved = d["cuda"]
        if isinstance(saved, (list, tuple)):  # the old all-devices form
            log.warning("checkpoint has the CUDA RNG state of the %d devices rank 0 saw (an older format); "
                        "restoring the first one on %s", len(saved), cuda)
            saved = saved[0]
        torch.cuda.set_rng_state(saved, cuda)



__all__ = ["capture_rng_state", "restore_rng_state"]
