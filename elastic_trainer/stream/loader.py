"""Feeding the trainer from a stream: this rank's micro-batches, read by DataLoader workers, exact.

``StreamBatches`` is the streaming counterpart of ``training.worker.MicroBatches``: the trainer
calls ``next(first_of_step)`` and gets ``(epoch, sample ids, batch on the device)``. Behind it:

1. From the sampler's *committed* position, ``StreamSampler.rest()`` names this rank's unread order
   positions to the end of the epoch. ``RankStream`` cuts them into **read units** at the shuffle
   blocks' edges: a unit's rows lie in one block, so it is one front-to-back read of at most
   ``shuffle_buffer`` consecutive rows (``EpochOrder.pieces``), then visited in the block's order.
2. With ``--num-workers N`` worker ``w`` reads units ``w, w + N, w + 2N, ...``: each worker reads its
   part, and no two read the same block. A DataLoader over an ``IterableDataset`` hands out its
   workers' items round robin, in worker order, so the units arrive in their order whatever ``N``.
3. The main process cuts the units' samples into micro-batches of the sampler's sizes
   (``micro_sizes``) and collates each with the task's ``collate_fn``. It reads the first read unit
   itself before any worker starts, and samples cross from a worker stacked, one tensor per field
   (``pack``).

The position stays exact because only the sampler's ``commit_step`` moves it: units that workers
have read ahead (prefetched, never trained) are not counted, and after a re-form or a resume a new
``StreamBatches`` starts reading at the committed position again. The same position gives the same
micro-batches with any number of workers (``tests/test_stream_loader.py``), so a resume may change
``--num-workers``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from elastic_trainer.devices import to_device
from elastic_trainer.stream.order import EpochOrder
from elastic_trainer.stream.position import Interval, StreamSampler
from elastic_trainer.stream.source import ShardedSource


def read_units(intervals: Sequence[Interval], buffer: int) -> Iterator[Interval]:
    """``intervals`` of order positions cut at every multiple of ``buffer`` (the shuffle blocks' edges)."""
    for a, b in intervals:
        while a < b:
            end = min(b, (a // buffer + 1) * buffer)
            yield a, end
            a = end


def split_at(intervals: Sequence[Interval], n: int) -> tuple[list[Interval], list[Interval]]:
    """``intervals`` laid end to end, cut after ``n`` positions: ``(the first n, the rest)``."""
    first: list[Interval] = []
    for i, (a, b) in enumerate(intervals):
        if n <= 0:
            return first, list(intervals[i:])
        if b - a > n:
            return first + [(a, a + n)], [(a + n, b), *intervals[i + 1:]]
        first.append((a, b))
        n -= b - a
    return first, []


class RankStream(IterableDataset):
    """One rank's samples over ``intervals`` of epoch ``epoch``'s order, as ``(ids, samples)`` read units.

    Built from plain values (the source, the row counts, the order's settings and the intervals),
    so that it pickles to DataLoader workers; each process makes its own ``EpochOrder`` and reader state.
    """

    def __init__(self, source: ShardedSource, sizes: Sequence[int], intervals: Sequence[Interval], *,
                 seed: int, epoch: int, buffer: int, shuffle: bool) -> None:
        self.source, self.sizes, self.intervals = source, list(sizes), list(intervals)
        self.seed, self.epoch, self.buffer, self.shuffle = seed, epoch, buffer, shuffle

    def __iter__(self) -> Iterator[tuple[list[int], tuple[str, Any]]]:
        """Read units as ``(ids, packed samples)``: this worker's share of them (every one without workers)."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = EpochOrder(self.sizes, self.seed, self.epoch, self.buffer, self.shuffle)
        for n, (lo, hi) in enumerate(read_units(self.intervals, self.buffer)):
            if n % workers == worker:
                ids, samples = self.read(order, lo, hi)
                yield ids, (pack(samples) if info is not None else ("list", samples))

    def read(self, order: EpochOrder, lo: int, hi: int) -> tuple[list[int], list[Any]]:
        """Order positions ``[lo, hi)`` (inside one block): their ids and samples, in order."""
        q = order.stream_positions(lo, hi)
        first = int(q.min())
        rows = self.source.read(order.pieces(first, int(q.max()) + 1))
        return order.ids(q).tolist(), [self.source.sample(rows[i]) for i in (q - first).tolist()]


def pack(samples: list[Any]) -> tuple[str, Any]:
    """A read unit's samples for the trip from a DataLoader worker to the trainer.

    A tensor crosses processes as a shared-memory segment of its own, so a unit of 1,024 samples
    sent as they are costs 1,024 segments (measured: 0.8k rows/s against 136k in-process, in
    ``benchmarks/stream_read.py``). Samples that are tensors of one shape, or tuples, lists or dicts
    of them, go as one stacked tensor per field instead, stacked by torch's ``default_collate``
    (which, in a worker, stacks straight into shared memory: no copy on the way); ``unpack`` gives
    back views of it. Anything else goes as it is. The task's ``collate_fn`` still gets a list of
    samples."""
    first = samples[0] if samples else None
    kind = None
    if isinstance(first, torch.Tensor):
        kind = "tensor"
    elif isinstance(first, (tuple, list)) and first and all(isinstance(x, torch.Tensor) for x in first):
        kind = type(first).__name__ if type(first) in (tuple, list) else None
    elif isinstance(first, dict) and first and all(isinstance(x, torch.Tensor) for x in first.values()):
        kind = "dict" if all(isinstance(x, dict) and x.keys() == first.keys() for x in samples) else None
    if kind is None:
        return "list", samples
    try:
        return kind, torch.utils.data.default_collate(samples)
    except (RuntimeError, TypeError):  # shapes, kinds or lengths differ between samples: as they are
        return "list", samples


def unpack(packed: tuple[str, Any]) -> list[Any]:
    """The samples ``pack`` packed, in order."""
    kind, data = packed
    if kind == "list":
        return data
    if kind == "tensor":
        return list(data.unbind(0))
    if kind == "dict":
        keys = list(data)
        return [dict(zip(keys, row)) for row in zip(*(data[k].unbind(0) for k in keys))]
    rebuild = tuple if kind == "tuple" else list
    return [rebuild(row) for row in zip(*(col.unbind(0) for col in data))]


def _as_is(item: Any) -> Any:
    """The DataLoader's ``collate_fn`` for read units: they stay as the worker made them."""
    return item


class StreamBatches:
    """This rank's micro-batches of a ``ShardedSource`` from the sampler's committed position; see the module docstring.

    Args:
        source: the task's source; sampler: its ``StreamSampler`` (the one the trainer commits).
        num_workers: DataLoader worker processes (0: read in this process).
        collate_fn: makes a micro-batch of a list of samples (default torch's ``default_collate``).
        device: where batches go.
    """

    def __init__(self, source: ShardedSource, sampler: StreamSampler, num_workers: int,
                 collate_fn: Callable[[list], Any] | None, device: torch.device) -> None:
        self.source, self.sampler, self.num_workers, self.device = source, sampler, num_workers, device
        self.collate = collate_fn or torch.utils.data.default_collate
        self._units: Iterator | None = None
        self._ids: collections.deque[int] = collections.deque()
        self._samples: collections.deque[Any] = collections.deque()
        self._left = 0  # samples of the current stream not handed out yet
        self._micro = 0  # the micro-batch of the step that comes next

    def _start(self) -> None:
        """A new stream from the sampler's committed position to the end of its epoch.

        The first read unit (or units, up to one step's samples) is read here first, in this
        process, and only then do the workers start (a fork each) and read the units after it while
        the steps it feeds train: after a world change a rank waits for one block and the forks, not
        for a read that competes with the workers' and then for their first units as well (measured
        in ``benchmarks/stream_read.py``, "reposition": cutting the first step's samples out of
        their block moved a worker's start-up into the second step, 0.3-0.9 s under load)."""
        s = self.sampler
        rest = s.rest()
        head_rows, step_rows = 0, sum(s.micro_sizes)
        for lo, hi in read_units(rest, s.buffer):  # whole read units, at least one step's samples
            head_rows += hi - lo
            if head_rows >= step_rows:
                break
        head, tail = split_at(rest, head_rows)
        stream = RankStream(self.source, s.sizes, tail, seed=s.seed, epoch=s.epoch, buffer=s.buffer, shuffle=s.shuffle)
        self._ids.clear()
        self._samples.clear()
        order = s.order()
        for lo, hi in read_units(head, s.buffer):
            ids, samples = stream.read(order, lo, hi)
            self._ids.extend(ids)
            self._samples.extend(samples)
        self._units = iter(DataLoader(stream, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is))
        self._left = sum(b - a for a, b in rest)

    def next(self, first_of_step: bool) -> tuple[int, list[int], Any]:
        """``(epoch, sample ids, batch on the device)`` of this rank's next micro-batch."""
        if first_of_step:
            self._micro = 0
            if self._units is None or self._left == 0:  # the first step, or the epoch rolled at the last commit
                self._start()
        elif self._units is None or self._micro >= len(self.sampler.micro_sizes):
            raise RuntimeError("StreamBatches.next(first_of_step=False) before a step began; this is a trainer bug.")
        n = self.sampler.micro_sizes[self._micro]
        while len(self._ids) < n:
            unit = next(self._units, None)
            if unit is None:
                raise RuntimeError(f"the stream of epoch {self.sampler.epoch} ended in the middle of a step; this is a bug.")
            self._ids.extend(unit[0])
            self._samples.extend(unpack(unit[1]))
        ids = [self._ids.popleft() for _ in range(n)]
        batch = self.collate([self._samples.popleft() for _ in range(n)])
        self._micro += 1
        self._left -= n
        return self.sampler.epoch, ids, to_device(batch, self.device)

    def padding(self) -> Any:
        """A micro-batch for a step in which this rank has no sample (``StreamSampler.sit_out``: a live
        newcomer's first step, at weight zero; ``MicroBatches.padding``): the step's first samples, read
        here (the stream of this rank's own samples starts at the next step) and counted nowhere."""
        s = self.sampler
        size = s.micro_batch_size or max(1, s.global_batch_size // s.world_size)
        head, _ = split_at(s.positions(), size)
        stream = RankStream(self.source, s.sizes, head, seed=s.seed, epoch=s.epoch, buffer=s.buffer, shuffle=s.shuffle)
        order = s.order()
        samples = [x for lo, hi in read_units(head, s.buffer) for x in stream.read(order, lo, hi)[1]]
        return to_device(self.collate(samples), self.device)

