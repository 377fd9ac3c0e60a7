"""How long a rank's own part of a training step takes: the step less its wait in the gradient
all-reduce. This is what names a straggler (``stragglers.py``): under DDP every rank's wall time per
step is the same, since no rank leaves the all-reduce before the slowest one arrives.

What is measured: from the start of the step (before its batch is fetched: data loading counts,
and a rank slow at loading is a straggler too) to the moment this rank's **last gradient bucket is
ready**, i.e. its forward and backward are done and only the reduction is left. DDP tells that
moment through its communication hook: it calls the hook once per bucket as the bucket's gradients
are ready, in bucket order, and ``GradBucket.is_last()`` marks the last. The hook here marks the
time and then does exactly what DDP does without one (``default_hooks.allreduce_hook``: divide by the
world size, all-reduce, the same bits). The start of a step is the same moment on every rank (each
left the previous all-reduce when the slowest arrived), so the time to the last bucket is this
rank's own: its data, host work and compute.

- **gloo / CPU**: compute is synchronous on the host, so the host clock (``perf_counter``) at the
  hook is when the compute ended; gloo's all-reduce runs on its own threads meanwhile.
- **CUDA (NCCL)**: kernels run after the host queued them, so host clocks say nothing about the
  device. A CUDA event is recorded on the current stream at the start and in the hook: the time
  between them is when the device reached each point, compute included and NCCL's wait excluded
  (NCCL runs on its own stream; the compute stream waits for it only after the last bucket). Host
  gaps, such as a slow batch, show too: the stream is idle until the next kernel is queued. The
  events are read without synchronizing (``query()``), so a step's own time is known a step or two
  later; ``stop()`` returns the times that became known.
- DDP's forward may hold a collective too: it broadcasts rank 0's buffers (``broadcast_buffers``,
  the default: a model with a BatchNorm or any buffer), in which every other rank waits for rank 0.
  That wait is not a rank's own time (measured: a rank 0 at a fifth of the speed made its peers look
  2-3x slower than it). Two forward pre-hooks bound it, one on the DDP wrapper (before its
  broadcast) and one on the module inside (after it), and it is taken out of the own time.
- A step without an all-reduce (one rank, or FSDP, which reduces inside its own hooks) has no
  bucket: its own time is the whole step (``stop()`` marks the end). A loop that reduces in
  another way calls ``compute_done()`` itself where its own work ends.

The data-loading part is reported beside it (``data_ready()``, host clock) so that a slow rank can
be told "slow at loading" from "slow at compute".

Cost per step: two clock reads (or two CUDA events) and one Python call in the hook of each
bucket, microseconds against steps of milliseconds or more; the hook itself is DDP's own.

Usage::

    clock = StepClock(device)
    ddp = DistributedDataParallel(model)
    clock.attach(ddp)                 # once per DDP wrapper (after each re-form's new one too)
    while training:
        clock.start()
        batch = next(batches); clock.data_ready()
        loss = ddp(batch).sum(); loss.backward(); opt.step()
        for t in clock.stop():        # OwnTime(own=..., data=...), possibly of an earlier step on CUDA
            own_times.add(t.own)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from elastic_trainer import devices


@dataclass(frozen=True)
class OwnTime:
    """One step of this rank: ``own`` seconds to its last gradient bucket (data, host, device), of
    which ``data`` seconds fetching its batch (host clock)."""

    own: float
    data: float


class StepClock:
    """Times this rank's own part of each step (see the module docstring), with ``devices``' step
    timer: the host clock on the CPU, CUDA events on the device's stream on a GPU."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self._timer = devices.step_timer(self.device)
        self._sync_timer = devices.step_timer(self.device)
        self._syncs: list[devices.StepTime] = []  # this step's waits in DDP's forward (its buffer broadcast)
        self._started = False
        self._ready: devices.StepTime | None = None
        self._data_at: float | None = None
        self._host_start = 0.0
        self._synced_at: float | None = None  # the last collective every rank left (collective_done)
        self._pending: list[tuple[devices.StepTime, float, list[devices.StepTime]]] = []

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register the timing hooks on ``ddp`` (DDP allows one comm hook per wrapper: call it once)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        # No annotations: DDP compares them with its types, and this module's are strings.
        def reduced(fut):  # on the process group's thread, once every rank's last bucket arrived
            self.collective_done()
            return fut.value()

        def hook(group, bucket):  # (ProcessGroup, GradBucket) -> Future[Tensor]
            if not bucket.is_last():
                return default_hooks.allreduce_hook(group, bucket)
            self.compute_done()
            return default_hooks.allreduce_hook(group, bucket).then(reduced)

        ddp.register_comm_hook(ddp.process_group, hook)
        ddp.register_forward_pre_hook(lambda _module, _args: self._sync_began())  # before DDP's buffer broadcast
        ddp.module.register_forward_pre_hook(lambda _module, _args: self._sync_done())  # after it

    def _sync_began(self) -> None:
        if self._started:
            self._sync_timer.start()

    def _sync_done(self) -> None:
        if self._started:
            self._syncs.append(self._sync_timer.stop())

    def collective_done(self) -> None:
        """Every rank left a collective together (the gradients' all-reduce, a step-end agreement):
        the next step's own time starts here, whenever ``start`` is called (host clock; on CUDA the
        device's stream says when, and ``start`` is the moment)."""
        self._synced_at = time.perf_counter()

    def start(self) -> None:
        """The step begins (call it before fetching the step's batch): its own time counts from the
        last ``collective_done`` since the step before, if any (the host work after it, an optimizer
        step or a pause between steps, is this rank's own), else from now."""
        synced, self._synced_at = self._synced_at, None
        self._host_start = time.perf_counter() if synced is None else synced
        self._data_at = None
        self._ready = None
        self._syncs = []
        self._started = True
        self._timer.start(self._host_start)

    def data_ready(self) -> None:
        """The step's batch is here (optional: without it the data time is 0)."""
        self._data_at = time.perf_counter()

    def compute_done(self) -> None:
        """This rank's own work of the step is done: only the reduction is left (the hook calls it)."""
        self._ready = self._timer.stop()

    def stop(self) -> list[OwnTime]:
        """The step ended: the own times that are known now (this step's on the CPU; on CUDA those of
        the steps whose end the device has passed, in order, without waiting for it)."""
        if not self._started:
            return []
        self._started = False
        own = self._ready if self._ready is not None else self._timer.stop()
        data = 0.0 if self._data_at is None else self._data_at - self._host_start
        self._pending.append((own, data, self._syncs))
        self._syncs = []
        done: list[OwnTime] = []
        while self._pending and self._pending[0][0].ready() and all(s.ready() for s in self._pending[0][2]):
            took, data, syncs = self._pending.pop(0)
            done.append(OwnTime(own=max(0.0, took.seconds() - sum(s.seconds() for s in syncs)), data=data))
        return done


__all__ = ["OwnTime", "StepClock"]
