"""An elastic, resumable batch sampler: every sample exactly once per epoch, whatever the world size.

The position of training in the data is one number per epoch, the *global sample offset*: how
many samples of this epoch's permutation the committed optimizer steps have consumed. It does
not depend on how many ranks there are, so a run that stops at any step and restarts at any
world size continues at the same place and splits the rest of the epoch over the new ranks.

- The epoch's permutation is ``torch.randperm(dataset_len)`` with a generator seeded from
  ``(seed, epoch)`` (the identity when ``shuffle=False``): the same on every rank and process.
- Optimizer step ``k`` of an epoch started at offset 0 consumes the global batch
  ``perm[k*B : (k+1)*B]`` (``B = global_batch_size``). Rank ``r`` of ``W`` takes the contiguous
  slice ``share_of_batch(B, W, r)`` of it and splits that into micro-batches of at most
  ``micro_batch_size`` samples.
- ``steps_per_epoch = dataset_len // B``: the last partial global batch of each epoch (fewer than
  ``B`` samples) is dropped, never padded. The permutation changes every epoch, so the dropped
  samples differ from epoch to epoch.
- ``commit_step()`` moves the offset on by ``B`` after the optimizer step; the state saved in a
  checkpoint therefore names the samples whose gradients are in the saved model, never the ones
  the ``DataLoader`` has prefetched. A new iterator starts at the committed offset.

Usage (see docs/sampler.md for the whole trainer recipe)::

    sampler = ElasticSampler(len(ds), global_batch_size=64, rank=rank, world_size=world,
                             seed=0, micro_batch_size=16)
    sampler.load_state_dict(ckpt["sampler"])           # any world size; optional
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2)
    while sampler.epoch < epochs:
        it = iter(loader)
        for _ in range(sampler.remaining_steps):
            for i in range(sampler.micro_batches_per_step):
                src, tgt = next(it)                     # this rank's indices, collated
                loss = loss_fn(model(src), tgt) * loss_weight(len(src), 64, world)
                loss.backward()                         # no_sync() for all but the last
            optimizer.step(); sampler.commit_step()
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

STATE_VERSION = 1
_SEED_MASK = (1 << 63) - 1


def share_of_batch(global_batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return ``(start, length)``: the slice of a global batch that ``rank`` of ``world_size`` takes.

    The batch is cut into ``world_size`` contiguous slices in rank order. Each has
    ``global_batch_size // world_size`` samples, and the first ``global_batch_size % world_size``
    ranks take one more, so the slices cover the batch exactly once. When
    ``global_batch_size < world_size`` the last ranks get length 0 (``ElasticSampler`` refuses
    that case; this function only describes the split).
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    base, extra = divmod(global_batch_size, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def loss_weight(samples_in_micro_batch: int, global_batch_size: int, world_size: int) -> float:
    """Weight for a micro-batch's *mean* loss so that DDP's averaged gradient is the global-batch mean.

    Each rank backpropagates ``mean_loss(micro) * n * W / B`` for every micro-batch of its share
    (``n`` samples in the micro-batch). Summed over the micro-batches of a rank that is
    ``(W / B) * sum of per-sample losses of the share``; DDP averages over ``W`` ranks, giving
    ``(1 / B) * sum over the global batch``: the gradient of the mean loss over the global batch,
    whatever the world size and however the shares are split into micro-batches.
    """
    if global_batch_size < 1 or world_size < 1:
        raise ValueError(
            f"global_batch_size and world_size must be at least 1, got {global_batch_size} and {world_size}."
        )
    if samples_in_micro_batch < 0:
        raise ValueError(f"samples_in_micro_batch must not be negative, got {samples_in_micro_batch}.")
    return samples_in_micro_batch * world_size / global_batch_size


def split_evenly(length: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``range(length)`` into ``parts`` contiguous ``(start, length)`` pieces, larger ones first."""
    base, extra = divmod(length, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out


def micro_batch_count(global_batch_size: int, world_size: int, rank: int, micro_batch_size: int | None) -> int:
    """How many micro-batches ``rank`` splits its share of every global batch into.

    The count is chosen from the *largest* share, ``ceil(B / W)``, so it is the same on every
    rank: ``ceil(ceil(B / W) / micro_batch_size)``. That matters for FSDP, whose every forward
    is a collective. The one exception: ``micro_batch_size == 1`` with ``B % W != 0``, where the
    ranks with the smaller share have one micro-batch fewer (micro-batches are never empty); a
    world-size change can make any ``--global-batch-size`` indivisible, so instead of refusing
    it the FSDP trainer pads those ranks with one zero-weight micro-batch
    (``ElasticSampler.lockstep_micro_batches``).
    """
    _, length = share_of_batch(global_batch_size, world_size, rank)
    if micro_batch_size is None:
        return 1
    largest = -(-global_batch_size // world_size)
    return min(length, -(-largest // micro_batch_size))


def permutation_seed(seed: int, epoch: int) -> int:
    """The generator seed for ``epoch``'s permutation: a hash of both, so ``(s, e)`` never aliases ``(s+1, e-1)``."""
    digest = hashlib.sha256(f"elastic-sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _SEED_MASK


def epoch_permutation(dataset_len: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order in which ``epoch`` visits the dataset: identical in every process for one torch build."""
    if not shuffle:
        return torch.arange(dataset_len, dtype=torch.int64)
    gen = torch.Generator()
    gen.manual_seed(permutation_seed(seed, epoch))
    return torch.randperm(dataset_len, generator=gen)


def _digest(perm: torch.Tensor) -> str:
    """A short fingerprint of a permutation's head, to notice a torch build that shuffles differently."""
    return hashlib.sha256(perm[:256].numpy().tobytes()).hexdigest()[:16]


class ElasticSampler(torch.utils.data.Sampler[list[int]]):
    """Batch sampler over a map-style dataset whose position survives restarts at any world size.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler)``. Iterating yields this rank's
    micro-batches (lists of dataset indices) from the committed offset to the end of the epoch;
    ``micro_batches_per_step`` of them make up this rank's part of one optimizer step.

    Args:
        dataset_len: number of samples in the (map-style) dataset.
        global_batch_size: samples per optimizer step over all ranks together (``B``).
        rank, world_size: this rank and the current number of ranks; ``B >= world_size``.
        seed: seeds every epoch's permutation together with the epoch number.
        shuffle: ``False`` visits the dataset in index order every epoch.
        micro_batch_size: most samples in one forward/backward; ``None`` = the whole share.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        micro_batch_size: int | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than world_size={world_size}, so some "
                f"ranks would get no sample in a step; raise the global batch size to at least the "
                f"largest world size the job may reach (max nodes x processes per node)."
            )
        if dataset_len < global_batch_size:
            raise ValueError(
                f"dataset_len={dataset_len} is smaller than global_batch_size={global_batch_size}, so an "
                f"epoch has no full step; use a smaller global batch or a larger dataset."
            )
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1 or None, got {micro_batch_size}.")
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.micro_batch_size = micro_batch_size
        self.epoch = 0
        self.offset = 0
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None
        self._share = share_of_batch(global_batch_size, world_size, rank)
        self._lockstep = micro_batch_count(global_batch_size, world_size, 0, micro_batch_size)
        self._micro = split_evenly(self._share[1], micro_batch_count(global_batch_size, world_size, rank,
                                                                     micro_batch_size))
        self._sitting: tuple[int, int, tuple[int, ...]] | None = None  # (epoch, offset, the step's ranks): sit_out
        if self._lockstep != micro_batch_count(global_batch_size, world_size, world_size - 1,
                                               micro_batch_size) and rank == 0:
            log.info(
                "micro_batch_size=1 with global_batch_size=%d not divisible by world_size=%d: ranks run "
                "%d or %d micro-batches per step (under FSDP the ones with fewer run a zero-weight padding "
                "micro-batch, so every rank runs the same number of forwards).",
                global_batch_size, world_size, self._lockstep, self._lockstep - 1,
            )

    @property
    def micro_batches_per_step(self) -> int:
        """This rank's micro-batches in the next step (0 in a step it sits out: ``sit_out``)."""
        return len(self._split(self.epoch, self.offset)[1])

    @property
    def lockstep_micro_batches(self) -> int:
        """The most micro-batches any rank runs in the next step (the first of its ranks', whose
        share is the largest): where every forward is a collective (FSDP) each rank runs this many,
        the ones beyond its own ``micro_batches_per_step`` as padding that counts for nothing (the
        trainer's ``_train_step``)."""
        sitting = self._sitting_at(self.epoch, self.offset)
        if sitting is None:
            return self._lockstep
        return micro_batch_count(self.global_batch_size, len(sitting), 0, self.micro_batch_size)

    def sit_out(self, ranks: Sequence[int]) -> None:
        """The next step (at the committed position) is split over the other ranks only: ``ranks``
        get no sample in it and the others share its whole global batch, each its slice of it in
        rank order (``share_of_batch`` over those ranks), so no sample is skipped or repeated and
        the loss weights (``loss_weight``) still make the reduced gradient the global batch's mean.
        The steps after it are split over every rank as before. A live join's newcomers sit out
        their first step (they take it at weight zero while their state arrives: docs/trainer.md),
        and every rank of the world asks the same. Call it before the iterator that reads that step
        is made."""
        out = set(ranks)
        rest = tuple(r for r in range(self.world_size) if r not in out)
        if not rest or len(rest) > self.global_batch_size:
            raise ValueError(f"sit_out({sorted(out)}): a step needs between 1 and {self.global_batch_size} ranks "
                             f"with samples of the {self.world_size}")
        self._sitting = (self.epoch, self.offset, rest) if out else None

    def _sitting_at(self, epoch: int, offset: int) -> tuple[int, ...] | None:
        s = self._sitting
        return s[2] if s is not None and (s[0], s[1]) == (epoch, offset) else None

    def _split(self, epoch: int, offset: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
        """This rank's ``(start, length)`` of the step at ``offset`` and its micro-batches' ``(start, length)``."""
        sitting = self._sitting_at(epoch, offset)
        if sitting is None:
            return self._share, self._micro
        if self.rank not in sitting:
            return (0, 0), []
        i = sitting.index(self.rank)
        share = share_of_batch(self.global_batch_size, len(sitting), i)
        count = micro_batch_count(self.global_batch_size, len(sitting), i, self.micro_batch_size)
        return share, split_evenly(share[1], count)

    def reshard(self, rank: int, world_size: int) -> None:
        """Split the rest of the epoch over a new world (a live re-form): the same object, with this
        rank's share of every global batch from the committed position on. An iterator made before
        keeps its old share; the next one (a new ``iter(loader)``) starts with the new one."""
        position = self.state_dict()
        self.__init__(self.dataset_len, self.global_batch_size, rank, world_size, seed=self.seed,  # type: ignore[misc]
                      shuffle=self.shuffle, micro_batch_size=self.micro_batch_size)
        self.load_state_dict(position)

    # ---- position -------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch started at offset 0 (``dataset_len // global_batch_size``)."""
        return self.dataset_len // self.global_batch_size

    @property
    def remaining_steps(self) -> int:
        """Optimizer steps left in the current epoch from the committed offset."""
        return (self.dataset_len - self.offset) // self.global_batch_size

    @property
    def step_in_epoch(self) -> int:
        """Committed steps of this epoch when the epoch started at offset 0 with this batch size."""
        return self.offset // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` at offset 0; a no-op when ``epoch`` is already the current epoch.

        The no-op keeps a resumed mid-epoch offset when the trainer's epoch loop calls
        ``set_epoch(sampler.epoch)``. Treat ``sampler.epoch`` as the source of truth: calling
        ``set_epoch`` with an earlier epoch starts that epoch again from its beginning.
        """
        if epoch < 0:
            raise ValueError(f"epoch must not be negative, got {epoch}.")
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0

    def commit_step(self) -> None:
        """Record one finished optimizer step: the offset moves on by ``global_batch_size``.

        When fewer than ``global_batch_size`` samples are left, the epoch is over (the tail is
        dropped) and the sampler moves to the next epoch at offset 0.
        """
        if self.remaining_steps < 1:
            raise RuntimeError(f"commit_step() past the end of epoch {self.epoch}; this is a trainer bug.")
        if self._sitting_at(self.epoch, self.offset) is not None:
            self._sitting = None
        self.offset += self.global_batch_size
        self._roll_if_done()

    def _roll_if_done(self) -> None:
        if self.remaining_steps < 1:
            self.epoch, self.offset = self.epoch + 1, 0

    # ---- indices --------------------------------------------------------------------------
    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """This epoch's (or ``epoch``'s) order of dataset indices; cached for the current epoch."""
        epoch = self.epoch if epoch is None else epoch
        if epoch != self._perm_epoch:
            self._perm = epoch_permutation(self.dataset_len, self.seed, epoch, self.shuffle)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def global_batch_at(self, offset: int, epoch: int | None = None) -> list[int]:
        """The ``global_batch_size`` indices of the step that starts at sample ``offset``."""
        if offset < 0 or offset + self.global_batch_size > self.dataset_len:
            raise ValueError(
                f"offset={offset} leaves no full global batch of {self.global_batch_size} in "
                f"{self.dataset_len} samples."
            )
        return self.permutation(epoch)[offset : offset + self.global_batch_size].tolist()

    def micro_batches_at(self, offset: int, epoch: int | None = None) -> list[list[int]]:
        """This rank's micro-batches of the step that starts at sample ``offset`` (pure: no state change)."""
        (start, length), micro = self._split(self.epoch if epoch is None else epoch, offset)
        mine = self.global_batch_at(offset, epoch)[start : start + length]
        return [mine[s : s + n] for s, n in micro]

    def batches_for_step(self, step_in_epoch: int, epoch: int | None = None) -> list[list[int]]:
        """This rank's micro-batches of step ``step_in_epoch`` (offset ``step * global_batch_size``)."""
        return self.micro_batches_at(step_in_epoch * self.global_batch_size, epoch)

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches from the committed offset to the end of the epoch.

        The position is read when ``iter()`` is called; steps committed meanwhile do not move an
        iterator that is already running, and the next iterator starts at the new offset.
        """
        return self._iter_from(self.epoch, self.offset)

    def _iter_from(self, epoch: int, offset: int) -> Iterator[list[int]]:
        perm = self.permutation(epoch)
        while offset + self.global_batch_size <= self.dataset_len:
            (start, length), micro = self._split(epoch, offset)
            mine = perm[offset + start : offset + start + length].tolist()
            for s, n in micro:
                yield mine[s : s + n]
            offset += self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches a new iterator yields: the rest of the current epoch for this rank."""
        if self.remaining_steps < 1:
            return 0
        return (self.remaining_steps - 1) * len(self._micro) + self.micro_batches_per_step

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The committed position and what it means, as plain python values (JSON-safe)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "perm_digest": _digest(self.permutation()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position; this sampler's rank and world size split the rest of the epoch.

        - ``dataset_len`` must match: an offset into another dataset's permutation means nothing.
        - ``seed`` and ``shuffle`` are taken from the state (they define the permutation being
          continued); a different constructor value is overridden with a warning.
        - A different ``global_batch_size`` is allowed (e.g. the trainer's linear-LR mode, where the
          global batch follows the world size): the epoch continues from the saved *sample* offset
          in steps of the new size, and its dropped tail is whatever is left, fewer than one batch.
        """
        if state.get("kind") == "stream":
            raise ValueError("the saved data position is a stream's (StreamSampler) but this task has a map-style "
                             "dataset; resume with the task's streamed source, or start over with --no-resume.")
        missing = [k for k in ("epoch", "offset", "seed", "dataset_len", "global_batch_size") if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; it was not written by ElasticSampler.state_dict().")
        if int(state["dataset_len"]) != self.dataset_len:
            raise ValueError(
                f"the saved sampler position is for a dataset of {state['dataset_len']} samples but this "
                f"dataset has {self.dataset_len}: its sample offset would point into another order; train on "
                f"the same dataset (the example task: --dataset-size {state['dataset_len']}) or start over with "
                f"--no-resume."
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.dataset_len:
            raise ValueError(f"saved sampler position epoch={epoch} offset={offset} is out of range.")
        seed, shuffle = int(state["seed"]), bool(state.get("shuffle", self.shuffle))
        if (seed, shuffle) != (self.seed, self.shuffle):
            log.warning(
                "sampler: resuming with the saved seed=%d shuffle=%s instead of seed=%d shuffle=%s so the "
                "epoch in progress keeps its order.", seed, shuffle, self.seed, self.shuffle,
            )
        if int(state["global_batch_size"]) != self.global_batch_size:
            log.warning(
                "sampler: global batch size changed from %d to %d; epoch %d continues at sample offset %d.",
                state["global_batch_size"], self.global_batch_size, epoch, offset,
            )
        self.seed, self.shuffle, self.epoch, self.offset = seed, shuffle, epoch, offset
        self._perm_epoch = None
        saved_digest = state.get("perm_digest")
        if saved_digest and saved_digest != _digest(self.permutation()):
            log.warning(
                "sampler: epoch %d's permutation differs from the one saved (another torch build?); "
                "samples of this epoch may repeat or be skipped.", epoch,
            )
        self._roll_if_done()

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(dataset_len={self.dataset_len}, global_batch_size={self.global_batch_size}, "
            f"rank={self.rank}, world_size={self.world_size}, micro_batch_size={self.micro_batch_size}, "
            f"epoch={self.epoch}, offset={self.offset})"
        )
