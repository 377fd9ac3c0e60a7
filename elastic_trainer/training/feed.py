"""The trainer's data feed: the sampler and the micro-batches, for a map-style dataset or a stream.

The trainer asks one function for both and never asks which mode it got::

    feed.prepare(task)                                       # once, while building (a stream's row counts)
    sampler, batches = feed.make_feed(task, global_batch_size=gbs, rank=r, world_size=w, seed=seed,
                                      micro_batch_size=m, num_workers=n, device=device)
    epoch, ids, batch = batches.next(first_of_step=True)    # this rank's next micro-batch
    ...; sampler.commit_step()                               # after the optimizer step
    state = sampler.state_dict()                             # into the checkpoint and the live state

- A **map-style** ``task.dataset`` (``__len__``, ``__getitem__``) gets ``sampler.ElasticSampler``
  (a global sample offset over a seeded permutation) and ``worker.MicroBatches`` (a DataLoader
  whose batch sampler is that sampler); ``ids`` are dataset indices.
- A **stream** (``stream.ShardedSource``) gets ``stream.StreamSampler`` (the remaining ranges of
  the epoch's order, dealt out to ranks as contiguous ranges) and ``stream.StreamBatches`` (read
  units through DataLoader workers); ``ids`` are the stable sample ids of ``stream.order``.

Both samplers have the same interface (``epoch``, ``offset``, ``steps_per_epoch``,
``remaining_steps``, ``micro_batches_per_step``, ``lockstep_micro_batches``, ``sit_out``, ``commit_step``,
``state_dict``, ``load_state_dict``), both feeds have ``next`` and ``padding`` (a micro-batch for a step
in which the rank has no sample: a live join's newcomer's first), and both start lazily, at the first ``next``, from
the sampler's committed position: a position loaded after ``make_feed`` (a resume, a peer's state)
is where reading starts. After a world-size change the trainer makes a new feed and loads the old
sampler's ``state_dict()`` into the new sampler.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_trainer.tasks import Task


def is_stream(dataset: Any) -> bool:
    """Whether a task's ``dataset`` is a sharded stream (``stream.ShardedSource``)."""
    from elastic_trainer.stream.source import ShardedSource

    return isinstance(dataset, ShardedSource)


def prepare(task: Task) -> None:
    """What the data needs before training starts: a stream's row counts (its Parquet footers, its
    token files' sizes), read once. The trainer calls it while it builds, before a live newcomer asks
    to be admitted, so that the members never wait for it (they pause for a join until it trains)."""
    if is_stream(task.dataset):
        task.dataset.digest()  # reads and keeps the row counts


def make_feed(task: Task, *, global_batch_size: int, rank: int, world_size: int, seed: int,
              micro_batch_size: int | None, num_workers: int, device: torch.device) -> tuple[Any, Any]:
    """``(sampler, batches)`` for ``task``'s data at this world size (see the module docstring)."""
    if is_stream(task.dataset):
        from elastic_trainer.stream import StreamBatches, StreamSampler

        source = task.dataset
        sampler = StreamSampler(source.row_counts(), global_batch_size, rank, world_size, seed=seed,
                                shuffle=source.shuffle, buffer=source.shuffle_buffer,
                                micro_batch_size=micro_batch_size, data_digest=source.digest())
        return sampler, StreamBatches(source, sampler, num_workers, task.collate_fn, device)
    from elastic_trainer.sampler import ElasticSampler
    from elastic_trainer.training.worker import MicroBatches

    sampler = ElasticSampler(len(task.dataset), global_batch_size, rank, world_size, seed=seed,
                             micro_batch_size=micro_batch_size)
    return sampler, MicroBatches(task, sampler, num_workers, seed, device)
