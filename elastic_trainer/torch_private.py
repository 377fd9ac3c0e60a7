"""torch's private rendezvous API, in one place.

The ``etcd-v3`` handler is torch's ``DynamicRendezvousHandler`` state machine with a few changes
(see ``handler.py``), so it needs names that torch keeps private (underscore names of
``torch.distributed.elastic.rendezvous.dynamic_rendezvous``). They are imported here and
nowhere else, under public names, and ``check_compatible()`` verifies every signature,
attribute and enum member we rely on; ``tests/test_torch_private.py`` calls it, so a torch
upgrade that changes any of them fails loudly in one test rather than deep inside a recovery.
Subclassing reaches further than imports: the handler overrides private methods (``_record``,
``_start_heartbeats``, ``_stop_heartbeats``) and reads attributes that torch's ``__init__`` sets
(``_this_node``, ``_store``, ``_settings``, ``_state_holder``). ``METHODS`` and ``ATTRIBUTES``
list every such name, ``check_compatible()`` checks each (a torch that renamed
``_start_heartbeats`` would otherwise silently bring its heartbeat writes back), and the test
reads ``handler.py`` and ``state.py`` to make sure the lists miss none. ``Tensor._version``
(``version_counter``), which ``checkpoint/snapshot.py`` compares to skip unchanged tensors, is read
and checked here too.
One more pair lives here for the same reason: DCP's ``FsspecWriter``/``FsspecReader``
(``dcp_fsspec_storage``), public classes of a private torch module, which sharded checkpoints on
object stores use (``checkpoint/sharded.py``); a module state dict's ``_metadata``
(``state_dict_metadata``: the live state transfer's format keeps it, ``training/state_codec.py``);
and ``torch._foreach_copy_`` (``foreach_copy``),
with which checkpoint snapshots copy many tensors in one call (``checkpoint/snapshot.py``,
``checkpoint/sharded.py``); torch's table of ``init_process_group`` rendezvous handlers
(``replace_rendezvous_handler``), where ``script.py`` refuses ``env://`` under live recovery; and
the two halves of ``init_process_group`` (``new_default_group``: torch's
``_new_process_group_helper``, which makes the group; ``install_default_group``: its
``_update_default_pg`` and ``_world``'s rank table, which make it the default), with which the live
group forms the next quorum's group beside the one it trains in, under a name of that quorum's
(``training/group_ahead.py``), and ``new_subgroup`` (the same helper for a group of some ranks, as
``new_group`` makes it, under a name of the quorum's): the loop's groups beside the default one.

Checked against torch 2.11 (2.11.0+cu130, on a GPU machine: ``launch/gpu-check``), 2.12 (2.12.1),
2.13 (2.13.0, what CI installs), 2.14 (2.14.1) and 2.15 (2.15.0, its CUDA build on a CPU machine);
``pyproject.toml`` bounds torch to ``>=2.11,<2.16``. To admit a new torch: ``bash launch/torch-versions VERSION``
runs ``check_compatible()``, ``tests/test_torch_private.py`` and the rendezvous tests on it in a
venv of its own; then widen the bound and ``TESTED_TORCH``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: F401 - re-exported
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
)

TESTED_TORCH = ("2.11", "2.12", "2.13", "2.14", "2.15")
"""The torch minor versions this module was checked against."""

Action = _dr._Action
"""The state machine's next step (``SYNC``, ``KEEP_ALIVE``, ``ADD_TO_PARTICIPANTS``, ...)."""
DistributedOpExecutor = _dr._DistributedRendezvousOpExecutor
"""torch's loop that reads the state, asks an operation for the next action and applies it."""
NodeDesc = _dr._NodeDesc
"""A node's identity in the state: ``(addr, pid, local_id)``."""
RendezvousContext = _dr._RendezvousContext
"""What an operation sees: ``(node, state, settings)``."""
ExitOp = _dr._RendezvousExitOp
JoinOp = _dr._RendezvousJoinOp
RendezvousState = _dr._RendezvousState
"""The round, participants, wait list, redundancy list, deadline, closed/complete flags."""
StateHolder = _dr._RendezvousStateHolder
"""The abstract state holder that our etcd-backed holder implements."""
remove_participant_epilogue = _dr._remove_participant_epilogue
"""torch's bookkeeping after a participant is removed (round completion, deadline)."""


def generate_node_desc(local_addr: str | None) -> NodeDesc:
    """A new node descriptor, as torch's handler makes one (unique per process and call)."""
    return DynamicRendezvousHandler._node_desc_generator.generate(local_addr)


def dcp_fsspec_storage() -> tuple[type, type]:
    """DCP's ``FsspecWriter`` and ``FsspecReader`` (public classes of its private
    ``_fsspec_filesystem`` module up to torch 2.14, of the public ``fsspec_filesystem`` from 2.15), with which ``checkpoint/sharded.py`` writes and reads sharded
    checkpoints on object stores; imported on first use (they need fsspec)."""
    try:  # public from torch 2.15 on (the private module then warns that it is deprecated)
        from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """Copy every ``src[i]`` into ``dst[i]`` in one dispatch (``torch._foreach_copy_``, private:
    one call instead of one per tensor, what a snapshot of many small tensors needs)."""
    torch._foreach_copy_(dst, src, non_blocking=non_blocking)


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place changes ``tensor`` went through (its private ``_version``, which autograd
    keeps): a snapshot taken before the optimizer step compares it after the copy, to tell the
    tensors that changed under it (``checkpoint/snapshot.py``)."""
    return tensor._version


def replace_rendezvous_handler(scheme: str, handler) -> None:
    """Make ``handler`` what ``init_process_group`` calls for an ``init_method`` of ``scheme://`` (``env``:
    the default) in this process: torch's private ``_rendezvous_handlers`` table, whose public
    ``register_rendezvous_handler`` refuses a scheme that has a handler already. ``script.py`` puts
    its refusal of ``env://`` there for a script under live recovery."""
    importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers[scheme] = handler


def dtensor_like(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local`` as it is, on
    whatever device it is: torch's constructor with ``like``'s private ``_spec``, no dispatch and no
    copy (``DTensor.from_local`` moves a local tensor to the mesh's device; DCP's own stager makes
    its CPU DTensors from the spec too). ``checkpoint/sharded.py`` stages GPU shards in CPU memory
    with it."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


# What the subclasses in handler.py and state.py (and the executor in handler.py) override, call or
# read on torch's classes. ``tests/test_torch_private.py`` reads those two files and fails when they
# touch a private name of torch's that is not listed here, so these lists stay complete.
METHODS: dict[str, tuple[str, ...]] = {
    "DynamicRendezvousHandler": ("__init__", "_record", "_get_world", "_get_store", "_get_deadline", "_keep_alive",
                                 "_close", "_start_heartbeats", "_stop_heartbeats", "next_rendezvous",
                                 "num_nodes_waiting", "shutdown", "set_closed", "is_closed", "use_agent_store"),
    "DistributedOpExecutor": ("__init__", "_record", "run", "_keep_alive", "_add_to_participants",
                              "_add_to_wait_list", "_add_to_redundancy_list", "_remove_from_participants",
                              "_remove_from_wait_list", "_remove_from_redundancy_list", "_mark_rendezvous_complete",
                              "_mark_rendezvous_closed"),
    "StateHolder": ("state", "sync", "mark_dirty"),
}
"""Methods of torch's classes that our subclasses override or call, by class. An override of a method
torch renamed would be dead code: ``_start_heartbeats`` would bring torch's heartbeat writes back."""
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "DynamicRendezvousHandler": ("_this_node", "_settings", "_store", "_state_holder", "_op_executor"),
    "DistributedOpExecutor": ("_node", "_state_holder", "_settings", "_state"),
}
"""Instance attributes that torch's methods set and use and our subclasses read or replace, by class
(``_op_executor``: the handler puts its own executor there; ``_state``: the executor's ``run`` sets
it for the operation methods). Checked in torch's source: they are assigned on ``self`` there."""
_SIGNATURES = {
    "DynamicRendezvousHandler.__init__": ["self", "node", "settings", "backend_name", "store", "state_holder"],
    "DistributedOpExecutor.__init__": ["self", "node", "state_holder", "settings"],
    "DistributedOpExecutor.run": ["self", "state_handler", "deadline", "update_deadline"],
    "DynamicRendezvousHandler._record": ["self", "message", "node_state", "rank"],
    "DistributedOpExecutor._record": ["self", "message", "node_state"],
    "NodeDesc": ["addr", "pid", "local_id"],
    "RendezvousContext": ["node", "state", "settings"],
    "remove_participant_epilogue": ["state", "settings"],
}
_STATE_FIELDS = ("round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list",
                 "last_heartbeats")
_ACTIONS = ("KEEP_ALIVE", "ADD_TO_PARTICIPANTS", "ADD_TO_WAIT_LIST", "ADD_TO_REDUNDANCY_LIST",
            "REMOVE_FROM_PARTICIPANTS", "REMOVE_FROM_WAIT_LIST", "REMOVE_FROM_REDUNDANCY_LIST",
            "MARK_RENDEZVOUS_COMPLETE", "MARK_RENDEZVOUS_CLOSED", "SYNC", "ERROR_CLOSED", "ERROR_TIMEOUT", "FINISH")


def state_dict_metadata(state: object) -> dict | None:
    """The ``_metadata`` a module's ``state_dict()`` keeps on its ``OrderedDict`` (each submodule's
    ``version``, which ``load_state_dict`` hands to ``_load_from_state_dict`` for its format
    migrations), or None; ``training/state_codec.py`` sends it with the state."""
    meta = getattr(state, "_metadata", None)
    return meta if isinstance(meta, dict) else None


def set_state_dict_metadata(state: dict, meta: dict) -> None:
    """Put ``state_dict_metadata``'s value back on a decoded ``OrderedDict``."""
    state._metadata = meta  # type: ignore[attr-defined]


def new_default_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
                      name: str, device_id: torch.device | None = None) -> dist.ProcessGroup:
    """A process group of ``world_size`` ranks on ``store``, made as ``init_process_group(backend,
    store=store, ...)`` makes the default one (torch's ``_new_process_group_helper``: the same
    backends, options and registration), but named ``name`` (torch names its default group after a
    counter, "0", which the group in use holds already) and not made the default: it may be made on
    another thread while the default group trains (``install_default_group`` swaps it in). Every rank
    of it must make it under the same name on the same store (the name prefixes its keys)."""
    pg, _ = _c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store, name,
                                            timeout=timeout, device_id=device_id, group_desc="default_pg")
    return pg


def new_subgroup(backend: str, store: dist.Store, ranks: list[int], rank: int, timeout: datetime.timedelta,
                 name: str) -> dist.ProcessGroup:
    """Rank ``rank``'s group of ``ranks`` (ranks of the default group, ``rank`` among them) on ``store``,
    as ``dist.new_group(ranks)`` makes it (torch's ``_new_process_group_helper``, and ``_world``'s
    table of its ranks) but named ``name`` and made by the ranks in it only: no other rank takes
    part, so each rank makes the one group of a partition it is in, and the groups of the next quorum
    may be made on another thread while the current ones train, the default group being the old one
    or the new (a member's rank is the same in both). Every rank of it must make it under the same
    name on the same store (the name prefixes its keys). No device is bound: an NCCL group made so
    creates its communicator from the store, not by splitting the default group's."""
    pg, _ = _c10d._new_process_group_helper(len(ranks), ranks.index(rank), list(ranks),
                                            dist.Backend(backend), store, name, timeout=timeout,
                                            group_desc=name)
    _c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
    return pg


def install_default_group(pg: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """Make ``pg`` (from ``new_default_group``) the default process group, as ``init_process_group``
    does with the group it made; returns the default group it replaces (None if there was none),
    which stays registered as a group of its own: ``dist.destroy_process_group(old)`` ends it alone."""
    old = _c10d._world.default_pg
    _c10d._update_default_pg(pg)
    _c10d._world.pg_group_ranks[pg] = {i: i for i in range(pg.size())}
    return old


def torch_classes() -> dict[str, type]:
    """The classes of torch's that ``METHODS`` and ``ATTRIBUTES`` name, as this module holds them now."""
    return {"DynamicRendezvousHandler": DynamicRendezvousHandler, "DistributedOpExecutor": DistributedOpExecutor,
            "StateHolder": StateHolder}


def instance_attributes(cls: type) -> set[str]:
    """The names that the methods of ``cls`` and of its bases assign on ``self``, read from their source.

    Raises ``OSError`` when the source of a class cannot be read (a torch installed without its
    ``.py`` files), ``TypeError`` for a class defined outside a file."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__ in ("abc", "builtins"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                         and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


def check_compatible() -> list[str]:
    """Every mismatch between the installed torch and what we rely on, as sentences (empty: fine)."""
    problems: list[str] = []
    classes = torch_classes()
    for label, names in METHODS.items():
        for name in names:
            if not hasattr(classes[label], name):
                problems.append(f"{label}.{name} is gone (our subclass overrides or calls it)")
    for label, names in ATTRIBUTES.items():
        try:
            assigned = instance_attributes(classes[label])
        except (OSError, TypeError) as exc:
            problems.append(f"cannot read the source of {label} to find its attributes {names} ({exc})")
            continue
        problems += [f"{label} no longer sets self.{name} (our subclass reads or replaces it)"
                     for name in names if name not in assigned]
    handler, executor = classes["DynamicRendezvousHandler"], classes["DistributedOpExecutor"]
    objects = {"DynamicRendezvousHandler.__init__": handler.__init__,
               "DistributedOpExecutor.__init__": executor.__init__,
               "DistributedOpExecutor.run": getattr(executor, "run", None),
               "DynamicRendezvousHandler._record": getattr(handler, "_record", None),
               "DistributedOpExecutor._record": getattr(executor, "_record", None),
               "NodeDesc": NodeDesc, "RendezvousContext": RendezvousContext,
               "remove_participant_epilogue": remove_participant_epilogue}
    for label, expected in _SIGNATURES.items():
        if objects[label] is None:
            continue  # reported as gone above
        params = list(inspect.signature(objects[label]).parameters)
        if params[:len(expected)] != expected:
            problems.append(f"{label} takes {params}, expected {expected}")
    tensor = torch.zeros(1)
    version = getattr(tensor, "_version", None)
    tensor.add_(1)
    if not isinstance(version, int) or getattr(tensor, "_version", version) == version:
        problems.append("torch.Tensor._version is gone or no longer counts in-place changes "
                        "(checkpoint/snapshot.py relies on it to skip unchanged tensors)")
    state = RendezvousState()
    problems += [f"RendezvousState has no field {f!r}" for f in _STATE_FIELDS if not hasattr(state, f)]
    problems += [f"Action has no member {a}" for a in _ACTIONS if a not in Action.__members__]
    if not callable(getattr(getattr(handler, "_node_desc_generator", None), "generate", None)):
        problems.append("DynamicRendezvousHandler._node_desc_generator.generate is gone")
    if not callable(getattr(torch, "_foreach_copy_", None)):
        problems.append("torch._foreach_copy_ is gone (foreach_copy: checkpoint snapshots)")
    else:
        try:
            dst, src = [torch.zeros(2)], [torch.ones(2)]
            foreach_copy(dst, src, non_blocking=False)
            if not torch.equal(dst[0], src[0]):
                problems.append("torch._foreach_copy_ no longer copies its sources into its destinations")
        except TypeError as exc:
            problems.append(f"torch._foreach_copy_(dst, src, non_blocking=...) fails ({exc})")
    from torch.distributed.tensor import DTensor

    try:  # a builtin (no signature to read) on some builds: then its use in the tests is the check
        params = list(inspect.signature(DTensor.__new__).parameters)
    except ValueError:
        params = None
    if params is not None and (params[:3] != ["cls", "local_tensor", "spec"] or "requires_grad" not in params):
        problems.append(f"DTensor.__new__ takes {params}, expected cls, local_tensor, spec, requires_grad "
                        "(dtensor_like: sharded checkpoints' staging)")
    meta = state_dict_metadata(torch.nn.Linear(1, 1).state_dict())
    if meta is None or meta.get("", {}).get("version") != 1:
        problems.append("Module.state_dict() no longer keeps its versions in _metadata "
                        "(state_dict_metadata: the live state transfer's format, training/state_codec.py)")
    # (the module: `from torch.distributed import rendezvous` is the function of that name)
    handlers = getattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or "env" not in handlers:
        problems.append("torch.distributed.rendezvous._rendezvous_handlers (the env:// handler's table) is gone "
                        "(replace_rendezvous_handler: script.py's refusal of env:// under live recovery)")
    helper = getattr(_c10d, "_new_process_group_helper", None)
    expected = ["group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name"]
    if helper is None:
        problems.append("torch.distributed.distributed_c10d._new_process_group_helper is gone (new_default_group)")
    else:
        params = list(inspect.signature(helper).parameters)
        if params[:6] != expected or not {"timeout", "device_id", "group_desc"} <= set(params):
            problems.append(f"_new_process_group_helper takes {params}, expected {expected} and timeout, device_id, "
                            "group_desc (new_default_group)")
    world = getattr(_c10d, "_world", None)
    if not callable(getattr(_c10d, "_update_default_pg", None)) or not all(
            hasattr(world, a) for a in ("default_pg", "pg_group_ranks", "pg_map")):
        problems.append("distributed_c10d._update_default_pg or _world.default_pg/pg_group_ranks/pg_map is gone "
                        "(install_default_group)")
    try:
        writer, reader = dcp_fsspec_storage()
    except ImportError as exc:
        problems.append(f"DCP's FsspecWriter/FsspecReader are gone ({exc})")
    else:
        params = inspect.signature(writer.__init__).parameters
        if "sync_files" not in params or not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            problems.append(f"FsspecWriter.__init__ takes {list(params)}, expected sync_files and **storage options")
        if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(reader.__init__).parameters.values()):
            problems.append("FsspecReader.__init__ takes no **storage options")
    return problems


__all__ = ["ATTRIBUTES", "METHODS", "TESTED_TORCH", "Action", "DistributedOpExecutor", "DynamicRendezvousHandler",
           "ExitOp", "JoinOp", "NodeDesc", "RendezvousContext", "RendezvousSettings", "RendezvousState",
           "RendezvousTimeout", "StateHolder", "check_compatible", "dcp_fsspec_storage", "dtensor_like", "foreach_copy",
           "generate_node_desc",
           "install_default_group", "instance_attributes", "new_default_group", "new_subgroup", "remove_participant_epilogue", "replace_rendezvous_handler",
           "set_state_dict_metadata", "state_dict_metadata", "torch_classes", "version_counter"]
