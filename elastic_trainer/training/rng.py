"""Every rank's own RNG state in a checkpoint, and which saved state a rank takes back.

Each rank's generators (Python, numpy, torch CPU and its own CUDA device's, see
``checkpoint.capture_rng_state``) drift apart as soon as the ranks draw different amounts (a
larger share of an uneven global batch draws more dropout masks), so one rank's state restored
everywhere resumes every other rank on the wrong random numbers. A save therefore gathers every
rank's state to rank 0, which writes them all::

    state["rng"] = {"ranks": [rank 0's state, rank 1's state, ...]}

and on resume rank k restores ``rng_state_for_rank(state["rng"], k)``:

- saved rank k's state when the checkpoint has one: at the same world size every rank
  continues on exactly its own random numbers, so a run with dropout resumes bit for bit;
- otherwise (the world grew, or the save was rank 0's alone: after a lost peer, or a live
  peer's state) saved rank 0's state, which is what every rank starts from in a fresh run
  (``seed_everything`` gives every rank the same seed);
- a checkpoint written before this change holds one state (rank 0's): every rank takes it, as
  before.

A world that shrinks drops the states of the ranks that are gone. The gather is a collective:
every rank calls ``gather_rng_states`` at a save, except where only one rank saves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_trainer.checkpoint import capture_rng_state


def gather_rng_states(device: torch.device, gather: bool) -> dict | None:
    """``{"ranks": [...]}`` on rank 0 with every rank's own state when ``gather`` (a collective;
    None on the other ranks), or with this process's state alone when not (any rank)."""
    own = capture_rng_state(device)
    if not gather or not dist.is_initialized() or dist.get_world_size() == 1:
        return {"ranks": [own]}
    rank = dist.get_rank()
    states: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(own, states, dst=0)
    return {"ranks": states} if rank == 0 else None


def rng_state_for_rank(saved: dict, rank: int) -> dict:
    """The state rank ``rank`` restores from a checkpoint's ``"rng"`` (see the module docstring)."""
    if "ranks" not in saved:  # one state (older checkpoints): every rank's
        return saved
    states = saved["ranks"]
    if not states or states[0] is None:
        raise ValueError("the checkpoint's RNG state has no entry for rank 0")
    own = states[rank] if 0 <= rank < len(states) else None
    return own if own is not None else states[0]
