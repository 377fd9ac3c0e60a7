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

The newest complete set wins. The exchange (``gather``) is point to point: one holder of each old
shard index sends each rank of the new layout only the rows of that shard that its new shard holds
(``span``: both layouts cut rows as ``torch.chunk`` does), and the state that is not sharded
(buffers, Adam's step, the trainer state) goes with shard index 0. So a rank receives about its new
shard's size, not the whole state (``tests/test_reshard.py`` measures both), and nobody holds the
whole state at once. No complete set: the caller loads a checkpoint.
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


@dataclass
class Gathered:
    """What ``gather`` returns to each rank."""

    shards: Shards
    """This rank's shards of the new layout."""
    trainer: dict
    """The trainer state (sampler, step, RNG) that came with shard index 0."""
    used: list[Held]
    """What was used for each old shard index."""
    sent: int
    """Bytes this rank sent to others (serialized rows; its own rows are not sent)."""
    received: int
    """Bytes this rank received."""


def gather(mine: dict[Held, "Shards | bytes"], extra: dict | None, module: torch.nn.Module,
           device: torch.device) -> Gathered | None:
    """Over the current group (every rank calls it, ``module`` already sharded on the new mesh):
    choose the newest complete set among what the ranks hold (``mine``: a rank's shards, as
    ``Shards`` or a host copy's bytes, ``peer_copy.encode``) and send each rank the rows of it that
    its new shards hold, point to point. ``extra``: this rank's trainer state (sampler, step, RNG,
    ...) to go with its live shards. Returns this rank's new shards (what ``Shards.load_into``
    takes), the trainer state of shard index 0's holder, what was used for each shard index and
    the bytes this rank sent and received; None when no set is complete."""
    world, me = dist.get_world_size(), dist.get_rank()
    held: list = [None] * world
    dist.all_gather_object(held, list(mine))
    chosen = choose(held)
    if chosen is None:
        return None
    (_, count, _), senders = chosen
    shape = _layout(module)
    out: dict[int, dict] = {}
    for index, (rank, h) in senders.items():
        if rank != me:
            continue
        state = _decoded(mine[h], extra if h.source == "live" else None)
        shards = Shards.from_state(state["shards"])
        for dst in range(world):
            piece = _piece(shards, index, count, shape, dst)
            if index == 0:  # what is not sharded goes with shard index 0, to every rank
                piece["common"] = {"buffers": shards.buffers, "groups": shards.groups, "trainer": state["trainer"],
                                   "sharded_keys": shards.sharded_keys, "optim_dtypes": {
                                       n: {k: st[k].dtype for k in shards.sharded_keys.get(n, ()) if k in st}
                                       for n, st in shards.optim.items()},
                                   "optim": {n: {k: v for k, v in st.items() if k not in shards.sharded_keys.get(n, ())}
                                             for n, st in shards.optim.items()}}
            if piece["rows"] or index == 0:
                out.setdefault(dst, {"pieces": []})["pieces"].append(piece)
    own = out.pop(me, {"pieces": []})["pieces"]  # this rank's rows of the shards it holds: not sent
    raw = {dst: _encoded(msg) for dst, msg in out.items()}
    sizes: list = [None] * world
    dist.all_gather_object(sizes, {dst: len(b) for dst, b in raw.items()})
    inbox = _exchange(raw, sizes, device)
    got, trainer = _assemble([p for msg in inbox for p in msg["pieces"]] + own, shape, me)
    sent = sum(len(b) for b in raw.values())
    received = sum(s.get(me, 0) for s in sizes)
    return Gathered(got, trainer, [senders[i][1] for i in range(count)], sent, received)


def span(n: int, count: int, index: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``n`` that shard ``index`` of ``count`` holds (``torch.chunk``'s cut)."""
    size = math.ceil(n / count) if n else 0
    start = min(index * size, n)
    return start, min(start + size, n)


def _layout(module: torch.nn.Module) -> dict[str, tuple[int, int, list[int], torch.Tensor]]:
    """Per parameter of the new layout: (its rows, the shard count, each rank's shard index, an
    empty tensor of its dtype and row shape: a shard with no rows)."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for n, p in module.named_parameters():
        empty = torch.empty((0, *p.shape[1:]), dtype=p.dtype)
        if not isinstance(p, DTensor):
            out[n] = (p.shape[0], 1, [0] * dist.get_world_size(), empty)
            continue
        rows(p)  # checks the placements
        dim = next(i for i, pl in enumerate(p.placements) if isinstance(pl, Shard))
        mesh = p.device_mesh.mesh
        stride = math.prod(mesh.shape[dim + 1:])
        index = [0] * dist.get_world_size()
        for i, rank in enumerate(mesh.flatten().tolist()):  # the rank's coordinate on the shard dimension
            index[rank] = (i // stride) % mesh.shape[dim]
        out[n] = (p.shape[0], mesh.shape[dim], index, empty)
    return out


def _piece(shards: Shards, index: int, count: int, shape: dict, dst: int) -> dict:
    """The rows of old shard ``index`` (of ``count``) that rank ``dst`` holds in the new layout:
    copies in host memory (a view would send its whole storage; a GPU's rows meet the others there)."""
    params, optim, at = {}, {}, {}
    for n, (total, new_count, indices, empty) in shape.items():
        o0, o1 = span(total, count, index)
        n0, n1 = span(total, new_count, indices[dst])
        lo, hi = max(o0, n0), min(o1, n1)
        if lo >= hi:
            continue
        if shards.params[n].shape[0] != o1 - o0:
            raise RuntimeError(f"live resharding: shard {index} of {count} of {n} has {shards.params[n].shape[0]} "
                               f"rows, not the {o1 - o0} that torch.chunk gives it")
        at[n] = lo
        params[n] = _host(shards.params[n][lo - o0:hi - o0])
        keys = shards.sharded_keys.get(n, ())
        optim[n] = {k: _host(shards.optim[n][k][lo - o0:hi - o0]) for k in keys if k in shards.optim.get(n, {})}
    return {"index": index, "rows": at, "params": params, "optim": optim}


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _exchange(raw: dict[int, bytes], sizes: list[dict], device: torch.device) -> list[dict]:
    """Send each message of ``raw`` (destination -> bytes) to its rank and receive this rank's from
    the others (``sizes[src][dst]``), point to point, all at once."""
    me = dist.get_rank()
    ops, inbox = [], []
    for src, out in enumerate(sizes):
        if src != me and out.get(me):
            buf = torch.empty(out[me], dtype=torch.uint8, device=device)
            inbox.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, src))
    for dst, data in sorted(raw.items()):
        ops.append(dist.P2POp(dist.isend, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return [torch.load(io.BytesIO(buf.cpu().numpy().tobytes()), weights_only=True, map_location="cpu")
            for buf in inbox]


def _assemble(pieces: list[dict], shape: dict, me: int) -> tuple[Shards, dict]:
    """This rank's new shards from the pieces it received, in row order."""
    common = next((p["common"] for p in pieces if "common" in p), None)
    if common is None:
        raise RuntimeError(f"live resharding: rank {me} got no piece of shard index 0 (the state that is not sharded)")
    pieces = sorted(pieces, key=lambda p: p["index"])
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {n: dict(st) for n, st in common["optim"].items()}
    for n, (total, new_count, indices, empty) in shape.items():
        n0, n1 = span(total, new_count, indices[me])
        parts = [p for p in pieces if n in p["params"]]
        if [p["rows"][n] for p in parts] != sorted(p["rows"][n] for p in parts) or \
                sum(p["params"][n].shape[0] for p in parts) != n1 - n0:
            raise RuntimeError(f"live resharding: rank {me} got rows of {n} that do not make up [{n0}, {n1})")
        params[n] = torch.cat([p["params"][n] for p in parts]) if parts else empty.clone()  # no rows: empty
        for k in common["sharded_keys"].get(n, ()):
            optim.setdefault(n, {})[k] = (torch.cat([p["optim"][n][k] for p in parts]) if parts
                                          else torch.empty_like(empty, dtype=common["optim_dtypes"][n][k]))
    return Shards(params, dict(common["buffers"]), optim, dict(common["sharded_keys"]), list(common["groups"])), \
        common["trainer"]


def _decoded(item: "Shards | bytes", extra: dict | None) -> dict:
    """A held shard as ``{"shards": ..., "trainer": ...}`` (a host copy's bytes decoded)."""
    if isinstance(item, bytes):
        return torch.load(io.BytesIO(item), weights_only=True, map_location="cpu")
    return {"shards": item.to_state(), "trainer": extra}


def _encoded(message: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(message, buf)
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


__all__ = ["Gathered", "Held", "choose", "cut", "full_state", "gather", "rows", "span"]
