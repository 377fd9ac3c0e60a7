"""Snapshots: a checkpoint's state copied into CPU memory, beside training where it can be.

``CheckpointManager.save`` calls ``Snapshotter.take``: every dense tensor of the state goes into
its view of one reused buffer, the ``checkpoint_format.Arena``, laid out as a format-3 file's
data, so the writer later writes a small header and then the arena as it is. With
``async_checkpoint`` the optimizer's parameters and states are not copied inside ``save`` but
returned as a ``DeferredCopy`` that the writer thread runs beside the next forward and
backward; ``OptimizerWatch`` (one global optimizer step pre-hook) makes the next optimizer
step wait for that copy and then checks every source's version counter, so a snapshot can
never hold values from after the save. The arena's memory is one ``host_memory.HostBuffer``,
page-locked for CUDA states and made ready before the first save (``Snapshotter.prepare``).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Protocol

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic_trainer.checkpoint import format as checkpoint_format
from elastic_trainer.checkpoint.format import Arena
from elastic_trainer.checkpoint.host_memory import HostBuffer, cuda_devices
from elastic_trainer.torch_private import foreach_copy, version_counter


class SettlesCopy(Protocol):
    """What waits on ``OptimizerWatch`` (a ``writer.CheckpointWriter``, which imports this module):
    a copy beside training to judge before the optimizer changes the tensors."""

    def settle_copy(self) -> None: ...


_PLAIN = frozenset({str, bool, int, float, type(None)})


def where(key: tuple) -> str:
    return "state" + "".join(f"[{k!r}]" for k in key)


class DeferredCopy:
    """Tensor copies that run beside training, checked before anything may have changed them.

    ``run`` copies (in the writer thread); ``settle`` (in the training thread, at the next
    optimizer step or ``wait``) waits for that copy and then compares each source's version
    counter with the one recorded at ``save``: every in-place change of a tensor (an optimizer
    step, ``add_``, ``copy_``, a broadcast into it) bumps it. Settling after the copy, from the
    thread that trains, means no change can be half done at that moment, so equal versions prove
    the copy holds the values of the save. ``settled`` is what the writer waits for.
    """

    def __init__(self, items: list[tuple[tuple, torch.Tensor, torch.Tensor, int]], stats: dict) -> None:
        self.items = items  # (key, destination buffer, source, source version at save)
        self.stats = stats
        self.copied = threading.Event()
        self.settled = threading.Event()
        self.changed: list[tuple] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            foreach_copy([d for _, d, _, _ in self.items], [s for _, _, s, _ in self.items])
        except BaseException as exc:  # noqa: BLE001 - handed to the writer, which reports it
            self.error = exc
        finally:
            self.copied.set()

    def settle(self) -> float:
        """Wait for the copy and judge it (once); returns the seconds waited here."""
        with self._lock:
            if self.settled.is_set():
                return 0.0
            start = time.perf_counter()
            self.copied.wait()
            waited = time.perf_counter() - start
            self.changed = [key for key, _, src, version in self.items if version_counter(src) != version]
            self.items = []  # drop the references to the live tensors
            self.settled.set()
            return waited


class Snapshot:
    """What a save writes: the copied state, whose dense tensors are views of ``arena``."""

    __slots__ = ("state", "arena")

    def __init__(self, state: dict, arena: Arena) -> None:
        self.state = state
        self.arena = arena


class _Walk:
    """The bookkeeping of one pass of ``Snapshotter._copy`` over a state."""

    __slots__ = ("defer", "dst", "src", "later", "tensors", "hits", "missing")

    def __init__(self, defer: set[int]) -> None:
        self.defer = defer
        self.dst: list[torch.Tensor] = []  # copied inside save()
        self.src: list[torch.Tensor] = []
        self.later: list[tuple] = []  # copied beside training (DeferredCopy items)
        self.tensors: list[tuple[tuple, torch.Tensor]] = []  # every tensor that belongs in the arena
        self.hits = 0  # tensors that found their view in the current arena
        self.missing = False  # a tensor found none


class Snapshotter:
    """Copies a state into CPU memory: every dense tensor into its view of one ``Arena``.

    The arena is laid out as a format-3 file's data (``checkpoint_format``), so the writer
    writes a small header and then the arena as it is: no pickling, no per-tensor work. It is
    reused from save to save while every tensor of the state finds its view there (same key,
    shape and dtype), which avoids allocating (and page-faulting) fresh memory for every save,
    most of the cost of the copy; when the tensors change (one added, gone, reshaped, retyped)
    a new arena is laid out and the state walked again. Reuse is safe because a new save starts
    only after the previous one finished writing. Every arena lives in one ``HostBuffer``, which
    a re-layout reuses when the new state fits, so the snapshot's memory (pinned for CUDA
    sources) stays about the size of the state. Copies go out in one ``foreach_copy``
    (one dispatch instead of one per tensor); with CUDA sources the arena is pinned and one
    synchronize ends the copy. Tensors without a raw layout (sparse, quantized, sub-byte dtypes)
    are copied apart, and their state is then written with ``torch.save`` (format 2).

    ``take(state, defer=ptrs)`` copies only the tensors whose memory is not in ``ptrs`` now; the
    others (the optimizer's parameters and states, which only an optimizer step changes) are
    returned as a ``DeferredCopy`` to run beside training. A deferred tensor found changed is
    copied synchronously by every later ``take`` (``sync_keys``).

    ``prepare(state)`` gets the host buffer for states like ``state`` ready on a background
    thread (``host_memory.HostBuffer.prepare``), so that the first ``take`` finds it made and
    page-locked instead of making it while training waits.
    """

    def __init__(self) -> None:
        self.arena: Arena | None = None
        self.buffers: dict[tuple, torch.Tensor] = {}  # key -> its view of the arena
        self.sync_keys: set[tuple] = set()
        self.host = HostBuffer()

    def take(self, state: dict, defer: set[int] | None = None,
             stats: dict | None = None) -> tuple[Snapshot, DeferredCopy | None]:
        walk = _Walk(defer or set())
        snap = self._copy(state, (), walk)
        if self.arena is None or walk.missing or walk.hits != len(self.buffers):
            self.buffers, self.arena = {}, None  # a new layout, in the same host buffer when it fits
            self.arena = Arena([(t.shape, t.dtype) for _, t in walk.tensors],
                               pinned=any(t.is_cuda for _, t in walk.tensors), allocate=self.host.get)
            if stats is not None:
                stats["host_buffer_wait_s"] = self.host.waited_s  # a preparation not finished yet
            self.buffers = {key: view for (key, _), view in zip(walk.tensors, self.arena.views)}
            walk = _Walk(walk.defer)
            snap = self._copy(state, (), walk)
        if walk.dst:
            foreach_copy(walk.dst, walk.src, non_blocking=True)
            for device in cuda_devices(walk.src):  # the copies' own GPUs, not the current one
                torch.cuda.synchronize(device)
        if stats is not None:
            stats["host_buffer_bytes"] = self.host.capacity  # the snapshot's memory (pinned for CUDA)
        deferred = DeferredCopy(walk.later, stats if stats is not None else {}) if walk.later else None
        return Snapshot(snap, self.arena), deferred

    def prepare(self, state: dict) -> bool:
        """Start making the host buffer for a snapshot of ``state`` (its dense tensors, a little
        more for what a save adds to them) on a background thread; returns whether one was started
        (not when the current buffer serves it already). Nothing is copied."""
        walk = _Walk(set())
        self._copy(state, (), walk)
        tensors = [t for _, t in walk.tensors]
        nbytes = sum(t.numel() * t.element_size() + 64 for t in tensors)  # + each view's alignment
        return self.host.prepare(nbytes, pinned=any(t.is_cuda for t in tensors))

    def clear(self) -> None:
        """Free the arena and its host buffer (the next ``take`` lays out a new one)."""
        self.buffers = {}
        self.arena = None
        self.host.free()

    def _copy(self, value: Any, key: tuple, walk: _Walk) -> Any:
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if not checkpoint_format.is_raw(t):
                return t.to("cpu", copy=True)  # rare in a state dict: its own copy, written by torch.save
            walk.tensors.append((key, t))
            buf = self.buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or (t.is_cuda and not self.arena.pinned):
                walk.missing = True
                return None
            walk.hits += 1
            if walk.defer and not t.is_cuda and t.data_ptr() in walk.defer and key not in self.sync_keys:
                walk.later.append((key, buf, t, version_counter(t)))
            else:
                walk.dst.append(buf)
                walk.src.append(t)
            return buf
        if isinstance(value, dict):
            return {k: self._copy(v, (*key, k), walk) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if all(type(v) in _PLAIN for v in value):  # e.g. python's RNG state, 625 ints: one pass in C
                return list(value) if isinstance(value, list) else tuple(value)
            items = [self._copy(v, (*key, i), walk) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if value is None or isinstance(value, (str, bool, int, float, torch.dtype, torch.Size)):
            return value
        if isinstance(value, np.generic):
            return value.item()
        raise TypeError(f"cannot checkpoint {where(key)} of type {type(value).__name__}: use tensors and plain "
                        "python values (str/int/float/bool/None/list/tuple/dict)")


class OptimizerWatch:
    """One global optimizer step pre-hook for the process (registered by the first manager).

    It remembers the optimizers that step (their tensors are the ones a save may copy beside
    training) and, before any optimizer changes its parameters, settles the deferred copies of
    every checkpoint writer that has one in flight.
    """

    _instance: "OptimizerWatch | None" = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self.waiting: "weakref.WeakSet[SettlesCopy]" = weakref.WeakSet()
        register_optimizer_step_pre_hook(self._before_step)

    @classmethod
    def get(cls) -> "OptimizerWatch":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizers.add(optimizer)
        if self.waiting:
            for writer in list(self.waiting):
                writer.settle_copy()

    def owned(self) -> set[int]:
        """Data pointers of every parameter and optimizer-state tensor of the optimizers seen."""
        ptrs: set[int] = set()
        for opt in list(self.optimizers):
            for group in opt.param_groups:
                ptrs.update(p.data_ptr() for p in group["params"])
            for per_param in opt.state.values():
                ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return ptrs
