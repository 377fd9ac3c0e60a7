"""Live resharding: the whole training state is all of one layout's shards, so any new layout can
be cut from them without reading storage.

FSDP2 shards every parameter (and every optimizer state tensor of its shape) along dim 0 over the
mesh's ``shard`` dimension as ``torch.chunk`` does: shard index ``i`` of ``S`` holds rows
``[i * ceil(n / S), (i + 1) * ceil(n / S))`` (fewer, or none, at the end). So the full tensor is the
concatenation of the ``S`` local shards in shard-index order (``full_state``), and a rank of a new
mesh takes its rows of it (``cut``). A *set* is one layout's shards at one step: ``(q, S, step)``,
the quorum it was made in, its shard count and the completed step; it is **complete** when some
live rank holds a copy of every shard index ``0..S-1`` (replicas of one index are the same bytes).

Where a set's shards come from (``choose``):

- **live shards**: a re-form whose new layout has another shard size (``--fsdp-shard-all`` and a
  node joined or was lost) but whose old shards all survive (a join): the survivors' own shards;
- **peer copies** (``training/peer_copy.py``): each rank's shard, every K steps, in the host memory
  of a rank on another node (and its own), so that a lost node's shards survive it.

The newest complete set wins; the exchange (``gather``) is one ``all_gather_object`` over the new
group in which one holder of each shard index sends it. Every rank then holds the whole state for
the moment of the cut (host memory: model and optimizer once); sending each rank only the rows it
needs (point to point) is the scalable next step. No complete set: the caller loads a checkpoint.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_trainer.training.hsdp import Shards

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """One shard a rank holds: of quorum ``q``'s layout of ``shards`` shard indices, index ``index``,
    after step ``step``; ``source`` is "live" (its own shards in memory) or "copy" (a host copy)."""

    q: int
    shards: int
    index: int
    step: int
    source: str

    @property
    def set_key(self) -> tuple[int, int, int]:
        return (self.q, self.shards, self.step)


def choose(held: list[list[Held]]) -> tuple[tuple[int, int, int], dict[int, tuple[int, Held]]] | None:
    """From what every rank holds (``held[rank]``): the newest complete set (by step, then quorum) and,
    per shard index, the rank that sends it and what it sends (the lowest rank, a live shard before a
    copy); None when no set is complete. Every rank computes the same answer from the same lists."""
    sets: dict[tuple[int, int, int], dict[int, tuple[int, Held]]] = {}
    for rank, items in enumerate(held):
        for h in items:
            by_index = sets.setdefault(h.set_key, {})
            best = by_index.get(h.index)
            if best is None or (best[1].source != "live" and h.source == "live"):
                by_index[h.index] = (rank, h)
    complete = [(key, by_index) for key, by_index in sets.items() if len(by_index) == key[1]
                and set(by_index) == set(range(key[1]))]
    if not complete:
        return None
    return max(complete, key=lambda kv: (kv[0][2], kv[0][0]))


def gather(mine: dict[Held, "Shards | bytes"], extra: dict | None) -> tuple[list[Shards], dict, list[Held]] | None:
    """Over the current group (every rank calls it): choose the newest complete set among what the
    ranks hold (``mine``: a rank's shards, as ``Shards`` or a host copy's bytes, ``peer_copy.encode``)
    and exchange it. ``extra``: this rank's trainer state (sampler, step, RNG, ...) to go with its
    live shards. Returns (the set's shards by shard index, the trainer state of shard index 0's
    holder, what was used for each shard index), or None when no set is complete."""
    world = dist.get_world_size()
    held: list = [None] * world
    dist.all_gather_object(held, list(mine))
    chosen = choose(held)
    if chosen is None:
        return None
    key, senders = chosen
    me = dist.get_rank()
    send = {i: _encoded(mine[h], extra if h.source == "live" else None) for i, (r, h) in senders.items() if r == me}
    parts: list = [None] * world
    dist.all_gather_object(parts, send)
    by_index: dict[int, dict] = {}
    for part in parts:
        for i, raw in part.items():
            by_index[i] = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    shards = [Shards.from_state(by_index[i]["shards"]) for i in range(key[1])]
    return shards, by_index[0]["trainer"], [senders[i][1] for i in range(key[1])]


def _encoded(item: "Shards | bytes", extra: dict | None) -> bytes:
    if isinstance(item, bytes):
        return item
    buf = io.BytesIO()
    torch.save({"shards": item.to_state(), "trainer": extra}, buf)
    return buf.getvalue()


def full_state(shards: list[Shards]) -> Shards:
    """The whole model and optimizer state from one layout's shards in shard-index order: each
    sharded tensor concatenated along dim 0, the rest (buffers, Adam's step) from index 0."""
    first = shards[0]
    params = {n: torch.cat([s.params[n] for s in shards]) for n in first.params}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for n, st in first.optim.items():
        keys = set(first.sharded_keys.get(n, ()))
        optim[n] = {k: (torch.cat([s.optim[n][k] for s in shards]) if k in keys else v) for k, v in st.items()}
    return Shards(params, dict(first.buffers), optim, dict(first.sharded_keys), list(first.groups))


def rows(p: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the full tensor that this rank's local shard of ``p`` holds
    (``p``: a DTensor sharded along dim 0 on one mesh dimension, replicated on the others)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(dims) != 1 or p.placements[dims[0]].dim != 0 or \
            not all(isinstance(pl, Replicate) for i, pl in enumerate(p.placements) if i != dims[0]):
        raise RuntimeError(f"live resharding supports parameters sharded along dim 0 on one mesh dimension "
                           f"(FSDP2's default), not placements {p.placements}")
    size, coord = p.device_mesh.size(dims[0]), p.device_mesh.get_coordinate()[dims[0]]
    n = p.shape[0]
    start = min(coord * math.ceil(n / size), n)
    local = p.to_local().shape[0]
    if start + local > n:
        raise RuntimeError(f"live resharding: a local shard of {local} rows at row {start} of {n} does not fit")
    return start, start + local


def cut(full: Shards, module: torch.nn.Module) -> Shards:
    """This rank's shards of ``full`` for ``module`` (already sharded on the new mesh): what
    ``Shards.load_into(module, optimizer)`` takes."""
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in module.named_parameters():
        start, stop = rows(p)
        params[n] = full.params[n][start:stop]
        if n in full.optim:
            keys = set(full.sharded_keys.get(n, ()))
            optim[n] = {k: (v[start:stop] if k in keys else v) for k, v in full.optim[n].items()}
    return Shards(params, dict(full.buffers), optim, dict(full.sharded_keys), list(full.groups))


__all__ = ["Held", "choose", "cut", "full_state", "gather", "rows"]
