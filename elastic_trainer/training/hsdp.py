"""HSDP under live recovery: shard within a node, replicate across nodes, heal a lost replica in place.

With ``--fsdp`` on more than one node the model is sharded over the workers of a node and
replicated over the nodes: FSDP2's ``fully_shard`` on a 2-D ``DeviceMesh`` (replicate x shard),
rank ``r`` at ``(r // nproc, r % nproc)``. So a node holds one whole copy of the training state
(a *replica*), and every rank's shard has one copy in each other node, held by the rank with the
same shard index (its local rank). ``--fsdp-shard-all`` keeps the old layout (one shard per rank
over the whole world: nothing is held twice).

What a fault costs (docs/trainer.md, "HSDP"):

1. **A lost node is a lost replica.** The quorum keeps whole nodes, so every survivor keeps its
   shard index and its shard's size: it keeps its shards (parameters and optimizer state, in
   memory), the process group re-forms at ``N - 1`` replicas, and the model is wrapped again on
   the new mesh around the very same local tensors (``Shards.take``, ``rewrap``): 0 steps redone.
2. **A newcomer** (a node that joins, or a rank at another step) gets each shard from the rank
   with the same shard index that holds the step all go on from (``shard_donors``),
   point to point over the new group (``manager.send_states``, one transfer per shard index, all
   at once: ``Manager.reform(donors=...)``), never from storage: parameters, optimizer state, RNG, sampler position, step.
   A join's shards come while every rank takes the next step, the newcomers at weight zero and
   without samples (``Recovery.late``: ``trainer_live.py``), so the members do not wait for them.
3. **No live replica holds a shard** (``--fsdp-shard-all``, or a shard whose every copy is gone):
   the survivors still keep their processes; they re-form, wrap a fresh model on the new mesh and
   rebuild the state in it from their live shards (a join), from peer copies (``peer_copy.py``),
   or from the newest sharded checkpoint, resharded to the new world (``sharded_live.py``).

Why not TorchFT's way: TorchFT keeps FSDP's process groups and swaps the replicate dimension's
backend under them (a ``ManagedProcessGroup`` on a ``ManagedDeviceMesh``), re-forming it every
step. Here the whole default group is re-formed once per fault (the Manager's quorum), so the
mesh is new and the model is wrapped again: public ``fully_shard`` on a meta copy of the model
(``skeleton``), whose local shards are then the old ones (the parameters copied once, the
optimizer's state tensors moved without a copy). The price: the parameters' shards are held
twice for the moment of the copy. For a join even that is off the members' stop: the mesh's
groups are planned (``group_plan``: made with every default group, ahead of a join as it is) and
the model on the new mesh is made beside the training (``sharded_live.ShardedLive.wrap_ahead``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from elastic_trainer.training.recovery import GroupPlan, Subgroups

logger = logging.getLogger(__name__)


# ---- the mesh ------------------------------------------------------------------------------------
def mesh_shape(world_size: int, nproc: int, shard_all: bool) -> tuple[int, ...]:
    """``(replicas, nproc)`` for HSDP, ``(world_size,)`` when sharding over every rank (one node,
    ``--fsdp-shard-all``, or a world that is not whole nodes of ``nproc``)."""
    if shard_all or nproc <= 1 or world_size <= nproc or world_size % nproc:
        return (world_size,)
    return (world_size // nproc, nproc)


def group_plan(nproc: int, shard_all: bool, checkpoint: bool) -> GroupPlan:
    """The process groups beside the default one that ``--fsdp`` uses in a world (``Manager.plan_groups``):
    HSDP's mesh dimensions (``replicate``: the ranks of one shard index, one per node; ``shard``: a
    node's ranks), and with ``checkpoint`` the sharded saves' gloo group of every rank
    (``checkpoint/sharded.ShardedSaver``). A 1-D mesh is the default group itself."""
    def plan(world_size: int) -> dict[str, Subgroups]:
        out: dict[str, Subgroups] = {}
        shape = mesh_shape(world_size, nproc, shard_all)
        if len(shape) == 2:
            replicas, n = shape
            out["replicate"] = Subgroups(tuple(tuple(range(i, world_size, n)) for i in range(n)))
            out["shard"] = Subgroups(tuple(tuple(range(r * n, (r + 1) * n)) for r in range(replicas)))
        if checkpoint:
            out["checkpoint"] = Subgroups((tuple(range(world_size)),), backend="gloo")
        return out

    return plan


def device_mesh(device: torch.device, world_size: int, nproc: int, shard_all: bool,
                group: Callable[[str], object] | None = None):
    """The mesh ``fully_shard`` spreads the model over: HSDP's two dimensions from ``group(name)``
    (``Manager.group``: the groups of ``group_plan``, made with the default group; or those of a
    join's next world, made ahead of it), a 1-D mesh on the default group; without ``group``,
    ``init_device_mesh`` makes the dimensions' groups."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    shape = mesh_shape(world_size, nproc, shard_all)
    if len(shape) == 1:
        return init_device_mesh(device.type, shape, mesh_dim_names=("shard",))
    if group is None:
        return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return DeviceMesh.from_group([group("replicate"), group("shard")], device.type,
                                 mesh=torch.arange(world_size).view(shape), mesh_dim_names=("replicate", "shard"))


def check_layout(members, nproc: int) -> None:
    """HSDP needs rank ``r`` on the ``r // nproc``-th node as its local rank ``r % nproc`` (the
    quorum orders members so); anything else would replicate shards across the wrong ranks."""
    for r, m in enumerate(members):
        if m.local_rank != r % nproc or m.node != members[r - r % nproc].node:
            raise RuntimeError(f"live HSDP: rank {r} is {m.node} local rank {m.local_rank}, not local rank "
                               f"{r % nproc} of the node of rank {r - r % nproc}; the quorum's order changed")


# ---- a rank's own shards ---------------------------------------------------------------------------
def meta_skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of the bare ``module`` on the meta device (no memory): what ``rewrap`` shards again."""
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


@dataclass
class Shards:
    """This rank's local shards of the model and its optimizer, as plain tensors by parameter name
    (what a newcomer of the same shard index loads, and what a survivor keeps across a re-form)."""

    params: dict[str, torch.Tensor]
    """Each parameter's local shard (the DTensor's ``to_local()``)."""
    buffers: dict[str, torch.Tensor]
    """The module's buffers (not sharded: every rank holds them whole)."""
    optim: dict[str, dict[str, torch.Tensor]]
    """Per parameter name: the optimizer's state (state tensors of the parameter's shape: local shards)."""
    sharded_keys: dict[str, list[str]]
    """Per parameter name: which of ``optim``'s entries are shards (the others, like Adam's step, are whole)."""
    groups: list[dict]
    """The optimizer's param groups' hyperparameters (lr, betas, ...), without the parameters."""

    @classmethod
    def take(cls, module: torch.nn.Module, optimizer: torch.optim.Optimizer, settle: bool = True) -> "Shards":
        """This rank's shards of ``module`` and ``optimizer``: views, not copies (no collective).
        ``settle`` (after a failed step): have FSDP hold its sharded parameters first
        (``registered_sharded``); not needed at a step boundary, where FSDP holds them already."""
        from torch.distributed.tensor import DTensor

        if settle:
            registered_sharded(module)
        names = {p: n for n, p in module.named_parameters()}
        params = {n: (p.to_local() if isinstance(p, DTensor) else p).detach() for n, p in module.named_parameters()}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        keys: dict[str, list[str]] = {}
        for p, st in optimizer.state.items():
            n = names[p]
            optim[n] = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in st.items()}
            keys[n] = [k for k, v in st.items() if isinstance(v, DTensor)]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(params, dict(module.named_buffers()), optim, keys, groups)

    def to_state(self) -> dict:
        """A plain dict (``torch.save``'s weights-only format) for the transfer."""
        return {"params": self.params, "buffers": self.buffers, "optim": self.optim,
                "sharded_keys": self.sharded_keys, "groups": self.groups}

    @classmethod
    def from_state(cls, state: dict) -> "Shards":
        return cls(state["params"], state["buffers"], state["optim"], state["sharded_keys"], state["groups"])

    @property
    def nbytes(self) -> int:
        tensors = [*self.params.values(), *self.buffers.values(),
                   *(v for st in self.optim.values() for v in st.values() if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def load_into(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Put these shards into ``module`` (sharded on a mesh of the same shard size: each local
        shard has the same shape) and make them ``optimizer``'s state for its parameters."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for n, p in module.named_parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                src = self.params[n]
                if src.shape != local.shape:
                    raise RuntimeError(f"live HSDP: the shard of {n} is {tuple(src.shape)} here but "
                                       f"{tuple(local.shape)} was sent; the shard sizes differ")
                if src.data_ptr() != local.data_ptr():
                    local.copy_(src)
            for n, b in module.named_buffers():
                if n in self.buffers and self.buffers[n].data_ptr() != b.data_ptr():
                    b.copy_(self.buffers[n])
        by_name = dict(module.named_parameters())
        optimizer.state.clear()
        for n, st in self.optim.items():
            p = by_name[n]
            sharded = set(self.sharded_keys.get(n, ()))
            optimizer.state[p] = {
                k: (DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()) if k in sharded else v)
                for k, v in st.items()}
        for group, hyper in zip(optimizer.param_groups, self.groups):
            group.update({k: v for k, v in hyper.items() if k != "params"})


def registered_sharded(module: torch.nn.Module) -> None:
    """Have ``module`` (the root FSDP module) hold its sharded parameters again: a step that failed
    in a collective may have left FSDP's gathered (unsharded) ones registered, which the optimizer
    does not know; the shards themselves are never changed before the optimizer step.

    ``FSDPModule.reshard`` alone is not enough: a step that failed in the forward leaves the root
    in FSDP's forward state, and the root does not reshard after forward (FSDP's default for it),
    so its ``reshard()`` returns without doing anything and the root keeps its gathered
    parameters (the flaky no-live-copy test: a kill that landed in a forward crashed both survivors
    in ``Shards.take``). So each FSDP module is first told to reshard after forward
    (``set_reshard_after_forward``, public; the module is wrapped anew after the re-form, so the
    change does not outlive it). Not ``FSDPModule.reset_iter_state``: it waits on the failed
    collective's work, which raises again."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


def rebind_optimizer(optimizer: torch.optim.Optimizer, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """``optimizer`` (the same object: the LR scheduler holds it) over ``new``'s parameters, which
    have the names of ``old``'s; its state is cleared (``Shards.load_into`` sets it)."""
    registered_sharded(old)
    old_names = {p: n for n, p in old.named_parameters()}
    by_name = dict(new.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [by_name[old_names[p]] for p in group["params"]]
    optimizer.state.clear()


def warm_up_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """A newcomer's first optimizer step taken before its state arrives, changing nothing, so that
    its first step in the world is as fast as the members' (who wait for it in the next step's
    reductions). On sharded parameters (DTensors) torch works out each operation's sharding once
    per process and shapes (``ShardingPropagator``'s cache): an optimizer's first ``step()`` took
    0.10-0.14 s more than the next ones in the benchmark's newcomers (docs/trainer.md). The step runs with every group's learning rate 0 and zero gradients (an
    update times 0; decoupled weight decay times ``1 - 0``: the parameters keep their exact
    values), then the state it made is cleared and the learning rates and gradients are put back:
    the optimizer is as it was, and ``Shards.load_into`` gives it the members' state.

    Only torch's own optimizers (``torch.optim``: each parameter's update is computed on its own
    shard, so no collective runs, and a learning rate of 0 makes it none), and only one without
    state yet; returns whether the step ran."""
    if optimizer.state or not type(optimizer).__module__.startswith("torch.optim."):
        return False
    lrs = [group["lr"] for group in optimizer.param_groups]
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and p.grad is None]
    try:
        with torch.no_grad():
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
            for p in params:
                p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = None
        optimizer.state.clear()
    return True


def rewrap(skeleton: torch.nn.Module, mesh, blocks: Callable[[torch.nn.Module], Iterable[torch.nn.Module]],
           device: torch.device, mp_policy=None) -> torch.nn.Module:
    """A new sharded model on ``mesh``: a copy of the meta ``skeleton``, ``fully_shard`` on each of
    its ``blocks`` then the root, its local shards allocated on ``device`` (values: load them)."""
    from torch.distributed.fsdp import fully_shard

    module = copy.deepcopy(skeleton)
    options = {"mesh": mesh, **({"mp_policy": mp_policy} if mp_policy is not None else {})}
    for block in blocks(module):
        fully_shard(block, **options)
    fully_shard(module, **options)
    module.to_empty(device=device)
    return module


# ---- who sends which shard -----------------------------------------------------------------------
def shard_donors(steps: list[int], nproc: int) -> dict[int, int | None]:
    """Who sends which rank its shards, from every rank's completed step (``-1``: a newcomer, no
    state): receiver rank -> donor rank, the donor holding the same shard index (``rank % nproc``).

    A collective that fails when a node dies may complete on some ranks and not on others, so the
    survivors may hold two steps. The step they all go on from is the newest step that every shard
    index has a holder of (``min`` over shard indices of the newest step held); every rank at
    another step (behind it, a newcomer, or one that completed a step that no holder of some other
    shard did) gets its shards of that step from a rank of its shard index that holds it: the
    lowest such rank. Every rank None: some shard index has no holder (a checkpoint is loaded)."""
    world = len(steps)
    best: dict[int, int] = {}
    for r, st in enumerate(steps):
        if st >= 0:
            best[r % nproc] = max(best.get(r % nproc, -1), st)
    if len(best) < min(nproc, world):
        return {r: None for r in range(world)}
    target = min(best.values())
    out: dict[int, int | None] = {}
    for r, st in enumerate(steps):
        if st != target:
            out[r] = next((d for d in range(r % nproc, world, nproc) if steps[d] == target), None)
    if any(d is None for d in out.values()):
        return {r: None for r in range(world)}
    return out


__all__ = ["Shards", "check_layout", "device_mesh", "group_plan", "mesh_shape", "meta_skeleton", "rebind_optimizer",
           "rewrap", "shard_donors"]
