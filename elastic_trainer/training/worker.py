"""The worker process around the training loop: where it sits in the job, and its plumbing.

``setup_distributed`` picks the device and, in plain mode, joins the process group that
torchrun's environment describes (gloo on CPU, NCCL on GPU), and returns a ``DistInfo`` (under
live recovery ``manager.Manager`` joins the group); ``seed_everything`` seeds every RNG;
``MicroBatches`` feeds this rank's micro-batches from a DataLoader over the elastic sampler,
with the dataset indices of each; ``round_fence`` finds the rendezvous round fence.
``trainer.Trainer`` uses them all (its logs are ``elastic_trainer.records``).
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_trainer import devices
from elastic_trainer.config import TrainConfig
from elastic_trainer.env import WorkerEnv
from elastic_trainer.tasks import Task
from elastic_trainer.training.process_group import init_from_env

logger = logging.getLogger(__name__)


@dataclass
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    """Workers per node (HSDP shards over them)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    distributed: bool = False
    round: int | None = None
    restart: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(config: TrainConfig, env: WorkerEnv | None = None) -> DistInfo:
    """Where this process sits in the job (``env``: its ``WorkerEnv``, read from the environment by
    default), on the device ``--device`` picks; in plain mode (no live recovery) it also joins the
    process group torchrun's environment describes (``manager.init_from_env``).

    Under live recovery only the device is chosen here: the worker builds its model first and
    then ``Manager.start()`` joins the quorum's group, so that the others never wait for its start-up."""
    env = WorkerEnv.from_environ() if env is None else env
    info = DistInfo(rank=env.rank or 0, world_size=env.world_size or 1, local_rank=env.local_rank or 0,
                    local_world_size=env.local_world_size or 1, round=env.rdzv_round, restart=env.restart_count or 0)
    info.device = devices.pick_device(config.device, info.local_rank, devices.CudaView.probe())
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if env.live is not None:
        return info
    if init_from_env(env, info.device, config.collective_timeout):
        info.distributed = True
        info.rank, info.world_size = dist.get_rank(), dist.get_world_size()
    return info


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
        return self.sampler.epoch, self.recorder.pending.popleft(), devices.to_device(batch, self.device)

    def padding(self) -> Any:
        """A micro-batch for a step in which this rank has no sample (``ElasticSampler.sit_out``: a
        live newcomer's first step, at weight zero): the first samples of the step's global batch,
        read here (not through the loader, whose iterator stays at the next step) and counted
        nowhere."""
        s = self.sampler
        size = s.micro_batch_size or max(1, s.global_batch_size // s.world_size)
        ids = s.global_batch_at(s.offset)[:size]
        return devices.to_device(self.loader.collate_fn([self.loader.dataset[i] for i in ids]), self.device)


def round_fence() -> Any:
    """The rendezvous round fence (``RoundFence``) when running under the etcd-v3 rendezvous, else
    None. Given to ``CheckpointManager`` as its fence, its ``guard()`` fences the commit record."""
    try:
        present = importlib.util.find_spec("elastic_trainer.rendezvous.round_fence") is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        return None
    from elastic_trainer.rendezvous.round_fence import RoundFence

    return RoundFence.from_env()


def broadcast_object(value: Any, dinfo: DistInfo) -> Any:
    if not dinfo.distributed or dinfo.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
