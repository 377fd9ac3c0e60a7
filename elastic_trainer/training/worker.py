"""The worker process around the training loop: where it sits in the job, and its plumbing.

``setup_distributed`` joins the process group that torchrun's environment describes (gloo on
CPU, NCCL on GPU) and returns a ``DistInfo``; ``seed_everything`` seeds every RNG;
``MicroBatches`` feeds this rank's micro-batches from a DataLoader over the elastic sampler,
with the dataset indices of each; ``round_fence`` finds the rendezvous round fence.
``trainer.Trainer`` uses them all (its logs are ``elastic_trainer.records``).
"""

from __future__ import annotations

import collections
import datetime
import importlib.util
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_trainer import config as cfgmod
from elastic_trainer import devices
from elastic_trainer.config import TrainConfig
from elastic_trainer.tasks import Task

logger = logging.getLogger(__name__)


@dataclass
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    distributed: bool = False
    round: int | None = None
    restart: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default


def setup_distributed(config: TrainConfig, live=None) -> DistInfo:
    """Join the process group when launched by torchrun (or with RANK/WORLD_SIZE/MASTER_* set).

    With a ``live`` group (``training/live.py``) only the device is chosen here: the worker builds
    its model first and then calls ``join_live``, so that the others never wait for its start-up."""
    info = DistInfo(rank=_env_int("RANK", 0), world_size=_env_int("WORLD_SIZE", 1),
                    local_rank=_env_int("LOCAL_RANK", 0), round=_env_int(cfgmod.ENV_RDZV_ROUND),
                    restart=_env_int("TORCHELASTIC_RESTART_COUNT", 0))
    info.device = devices.pick_device(config.device, info.local_rank, devices.CudaView.probe())
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if live is not None:
        return info
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not dist.is_initialized():
            backend = devices.backend_for(info.device)
            # NCCL: bound to this rank's GPU, so that its communicators are made here (eagerly), not
            # inside the first collective, and a wrong device is an error now.
            extra = {"device_id": info.device} if backend == "nccl" else {}
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.collective_timeout),
                                    **extra)
        info.distributed = True
        info.rank, info.world_size = dist.get_rank(), dist.get_world_size()
    return info


def warm_up_ddp() -> None:
    """Construct DDP once on a throwaway one-process group: its first construction imports ~800
    modules (1.6 s here), which a newcomer must not spend while the others wait for it."""
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    finally:
        dist.destroy_process_group()


def join_live(info: DistInfo, config: TrainConfig, live) -> None:
    """Wait until the live quorum admits this worker, then join its process group (fills ``info``)."""
    t0 = time.perf_counter()
    quorum = live.join()
    t1 = time.perf_counter()
    live.init_process_group(devices.backend_for(info.device), config.collective_timeout, info.device)
    logger.info("live: admitted to quorum %d as rank %d of %d after %.3fs (%s); group in %.3fs", quorum.q,
                dist.get_rank(), quorum.world_size, t1 - t0, "cold start" if quorum.cold else "newcomer",
                time.perf_counter() - t1)
    info.distributed, info.round = True, quorum.q
    info.rank, info.world_size = dist.get_rank(), dist.get_world_size()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class _RecordingBatchSampler:
    """Wraps the sampler and remembers the indices of micro-batches not yet consumed (FIFO)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.pending: collections.deque[list[int]] = collections.deque()

    def __iter__(self):
        self.pending.clear()
        for indices in self.sampler:
            self.pending.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.sampler)


class MicroBatches:
    """This rank's micro-batches from a DataLoader over the elastic sampler, with their indices.

    A DataLoader iterator runs to the end of the sampler's epoch; the next one starts where the
    sampler's committed position is then (the next epoch, after the last step's commit).
    """

    def __init__(self, task: Task, sampler, num_workers: int, seed: int, device: torch.device) -> None:
        self.sampler, self.device = sampler, device
        self.recorder = _RecordingBatchSampler(sampler)
        self.loader = torch.utils.data.DataLoader(
            task.dataset, batch_sampler=self.recorder, num_workers=num_workers, collate_fn=task.collate_fn,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(seed))  # worker seeds from here, not the global RNG
        self.iterator = None

    def next(self, first_of_step: bool) -> tuple[int, list[int], Any]:
        """``(epoch, indices, batch on the device)`` of the next micro-batch."""
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            batch = next(self.iterator)
        except StopIteration:
            if not first_of_step:
                raise RuntimeError("the sampler's epoch ended in the middle of a step; this is a bug") from None
            self.iterator = iter(self.loader)  # the sampler rolled to the next epoch at the last commit
            batch = next(self.iterator)
        return self.sampler.epoch, self.recorder.pending.popleft(), _to_device(batch, self.device)


def round_fence() -> Any:
    """The rendezvous round fence (``RoundFence``) when running under the etcd-v3 rendezvous, else
    None. Given to ``CheckpointManager`` as its fence, its ``guard()`` fences the commit record."""
    try:
        present = importlib.util.find_spec("elastic_trainer.rendezvous.fence") is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        return None
    from elastic_trainer.rendezvous.fence import RoundFence

    return RoundFence.from_env()


def broadcast_object(value: Any, dinfo: DistInfo) -> Any:
    if not dinfo.distributed or dinfo.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
