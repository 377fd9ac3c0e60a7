"""Training's position in a sharded stream, and which rank reads what: exact at any world size.

The streaming counterpart of ``sampler.ElasticSampler``: the same global batch ``B``, the same
split of a step over ranks (``share_of_batch``), the same micro-batches and loss weights, the same
``commit_step`` / ``state_dict`` / ``load_state_dict``. What differs is how the epoch's order
(``order.EpochOrder``: seeded shard order and block shuffle, order positions ``0..N-1``) is dealt
out: each rank reads one *contiguous range* of it front to back, instead of a slice of every
global batch, so that a rank's reads are sequential in its shards.

Invariants (``V`` is the part of the epoch not trained yet):

1. ``V`` is a sorted list of disjoint intervals of order positions (``remaining``). An epoch starts
   with ``V = [[0, N)]``.
2. A **segment** is a stretch of steps at one world size ``W`` and global batch ``B``; it has
   ``S = |V| // B`` steps. Rank ``r``, whose share of a step is ``(start_r, len_r) =
   share_of_batch(B, W, r)``, owns the range ``V[S*start_r : S*(start_r + len_r)]`` of ``V`` laid end
   to end, and at the segment's step ``k`` it takes the next ``len_r`` samples of it (cut into
   micro-batches as the map-style sampler cuts a share). The ranges tile ``V[:S*B]``, so every step
   trains exactly ``B`` samples, none twice; the last ``|V| - S*B < B`` samples (the *tail*) belong to
   no rank in this segment.
3. A world-size change, like every load of a saved position, starts a new segment whose ``V`` is
   the unread rest of each rank's range, in rank order, then the tail (``Segment.unread``). Ranges
   are split at sample granularity, inside shards, so no rank idles at the end of the epoch.
   Re-segmenting at the same ``W`` and ``B`` deals the same samples again, and a segment that ran no
   step leaves ``V`` as it was: which samples a step trains is a pure function of the world sizes of
   the steps before it in the epoch (``drill/ledger.py`` replays it to check a run).
4. ``offset``, the global sample offset, is ``N - |V| + k*B``: the samples committed this epoch.
   When a segment's steps are done the epoch ends, its tail is dropped and the next epoch starts at
   ``V = [[0, N)]``. With a constant ``B`` every epoch trains exactly the order positions
   ``[0, (N // B) * B)``, at any sequence of world sizes: the same samples as without a change, and
   the same dropped tail.

The state (``state_dict``) is plain JSON: epoch, offset, the segment (``remaining``, its world size,
global batch and steps done), seed, shuffle, buffer, ``total`` and a digest of the shard list. It is
the same on every rank, lives in the checkpoint and travels with the live state to newcomers.

Usage (``stream.loader.StreamBatches`` feeds the trainer from it)::

    sampler = StreamSampler(source.row_counts(), 64, rank, world, seed=0, buffer=1024, micro_batch_size=16,
                            data_digest=source.digest())
    sampler.load_state_dict(ckpt["sampler"])        # any world size; optional
    sampler.rest()                                  # this rank's unread order positions, to read front to back
    sampler.batch_ids()                             # this rank's micro-batches (sample ids) of the next step
    ... train the step ...; sampler.commit_step()
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from elastic_trainer.sampler import micro_batch_count, share_of_batch, split_evenly
from elastic_trainer.stream.order import EpochOrder

log = logging.getLogger(__name__)

STATE_KIND = "stream"
STATE_VERSION = 1
Interval = tuple[int, int]


def span(intervals: Sequence[Interval]) -> int:
    """Positions in ``intervals`` (each ``[start, stop)``)."""
    return sum(b - a for a, b in intervals)


def merge(intervals: Sequence[Interval]) -> list[Interval]:
    """``intervals`` without empty ones, neighbours joined (``[a, b), [b, c)`` -> ``[a, c)``)."""
    out: list[Interval] = []
    for a, b in intervals:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class Segment:
    """Steps at one world size and global batch over the remaining positions ``V`` (invariant 2)."""

    remaining: tuple[Interval, ...]
    """``V``: the order positions not trained when the segment started, sorted, disjoint."""
    world_size: int
    global_batch_size: int
    steps_done: int = 0

    @functools.cached_property
    def _ends(self) -> list[int]:
        """Where each interval of ``V`` ends, ``V`` laid end to end."""
        return list(itertools.accumulate(b - a for a, b in self.remaining))

    @property
    def size(self) -> int:
        """``|V|``."""
        return self._ends[-1] if self._ends else 0

    @property
    def steps(self) -> int:
        """``S = |V| // B``: the steps of this segment (to the end of the epoch)."""
        return self.size // self.global_batch_size

    def take(self, start: int, length: int) -> list[Interval]:
        """``V[start : start + length]`` (``V`` laid end to end) as intervals of order positions."""
        out: list[Interval] = []
        i = bisect.bisect_right(self._ends, start)
        while length > 0 and i < len(self.remaining):
            a, b = self.remaining[i]
            before = self._ends[i] - (b - a)
            lo = a + max(0, start - before)
            hi = min(b, lo + length)
            out.append((lo, hi))
            length -= hi - lo
            start += hi - lo
            i += 1
        return out

    def rank_range(self, rank: int, from_step: int = 0) -> list[Interval]:
        """Rank ``rank``'s range from the segment's step ``from_step`` to its end."""
        start, length = share_of_batch(self.global_batch_size, self.world_size, rank)
        return self.take(self.steps * start + from_step * length, (self.steps - from_step) * length)

    def rank_part(self, rank: int, step: int) -> list[Interval]:
        """What ``rank`` trains at the segment's step ``step``."""
        start, length = share_of_batch(self.global_batch_size, self.world_size, rank)
        return self.take(self.steps * start + step * length, length)

    def unread(self) -> list[Interval]:
        """``V`` of the next segment (invariant 3): every rank's unread rest in rank order, then the tail."""
        parts = [iv for r in range(self.world_size) for iv in self.rank_range(r, self.steps_done)]
        tail = self.steps * self.global_batch_size
        return merge(sorted(parts + self.take(tail, self.size - tail)))


class StreamSampler:
    """The position in a sharded stream and this rank's part of it; see the module docstring.

    Args:
        sizes: rows per shard, in the source's listed order (``ShardedSource.row_counts()``).
        global_batch_size: samples per optimizer step over all ranks (``B``), at least ``world_size``.
        rank, world_size: this rank and the current number of ranks.
        seed, shuffle, buffer: the epoch order's (``order.EpochOrder``).
        micro_batch_size: most samples in one forward/backward; ``None`` = the whole share.
        data_digest: a fingerprint of the shard list (``ShardedSource.digest()``); a saved position
            with another one is refused on load.
    """

    def __init__(self, sizes: Sequence[int], global_batch_size: int, rank: int, world_size: int, *,
                 seed: int = 0, shuffle: bool = True, buffer: int = 1024, micro_batch_size: int | None = None,
                 data_digest: str | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank={rank} of {world_size}.")
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than world_size={world_size}, so some ranks "
                f"would get no sample in a step; raise the global batch size to at least the largest world size "
                f"the job may reach (max nodes x processes per node).")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1 or None, got {micro_batch_size}.")
        self.sizes = [int(n) for n in sizes]
        self.total = sum(self.sizes)
        if self.total < global_batch_size:
            raise ValueError(f"the shards hold {self.total} rows in all, fewer than global_batch_size="
                             f"{global_batch_size}, so an epoch has no full step; use a smaller global batch or more data.")
        if buffer < 1:
            raise ValueError(f"the shuffle buffer must hold at least 1 row, got {buffer}.")
        self.global_batch_size, self.rank, self.world_size = global_batch_size, rank, world_size
        self.seed, self.shuffle, self.buffer = seed, shuffle, buffer
        self.micro_batch_size, self.data_digest = micro_batch_size, data_digest
        self.epoch = 0
        self.offset = 0
        self.segment = self._fresh_segment()
        self._order: EpochOrder | None = None
        self._sitting: tuple[int, int, tuple[int, ...], Segment] | None = None
        """``sit_out``: (epoch, offset, the step's ranks with samples, the one-step segment that deals it to them)."""

    def _fresh_segment(self) -> Segment:
        return Segment(((0, self.total),), self.world_size, self.global_batch_size)

    # ---- a step that some ranks sit out -------------------------------------------------------------
    def sit_out(self, ranks: Sequence[int]) -> None:
        """The next step (at the committed position) is dealt to the other ranks only, as a step of a
        world of their number: rank ``r``, the ``i``-th of them in rank order, takes the share of the
        ``i``-th rank of a segment at that world size over the unread positions, one step long; the
        steps after it are a new segment at this world size over what is left (invariant 3, so no
        sample is skipped or repeated, and which samples a step trains still follows from how many
        ranks trained the steps before it: ``drill.ledger.stream_order``). The loss weights
        (``loss_weight``) keep the reduced gradient the global batch's mean. A live join's newcomers
        sit out their first step (``ElasticSampler.sit_out``), asked by every rank. After a join of
        ``k`` newcomers to ``W`` members whose ranks keep their order, the step is dealt as the
        members' next step would have been without the join. Call it before the next step's reads
        start (``StreamBatches``)."""
        out = set(ranks)
        rest = tuple(r for r in range(self.world_size) if r not in out)
        if not rest or len(rest) > self.global_batch_size:
            raise ValueError(f"sit_out({sorted(out)}): a step needs between 1 and {self.global_batch_size} ranks "
                             f"with samples of the {self.world_size}")
        step = Segment(tuple(self.segment.unread()), len(rest), self.global_batch_size)
        self._sitting = (self.epoch, self.offset, rest, step) if out else None

    def _sat_out(self) -> tuple[tuple[int, ...], Segment] | None:
        """The ranks with samples in the next step and the segment that deals it, when some sit it out."""
        s = self._sitting
        return (s[2], s[3]) if s is not None and (s[0], s[1]) == (self.epoch, self.offset) else None

    def _deal(self, rank: int, ahead: int) -> tuple[list[Interval], int]:
        """What ``rank`` trains ``ahead`` steps after the committed one: its order positions and micro-batch count."""
        sat = self._sat_out()
        if sat is None:
            return (self.segment.rank_part(rank, self.segment.steps_done + ahead),
                    micro_batch_count(self.global_batch_size, self.world_size, rank, self.micro_batch_size))
        dealt, step = sat
        if ahead > 0:
            return (self._after(step).rank_part(rank, ahead - 1),
                    micro_batch_count(self.global_batch_size, self.world_size, rank, self.micro_batch_size))
        if rank not in dealt:
            return [], 0
        i = dealt.index(rank)
        return step.rank_part(i, 0), micro_batch_count(self.global_batch_size, len(dealt), i, self.micro_batch_size)

    def _after(self, step: Segment) -> Segment:
        """The segment at this world size after a step sat out (dealt by the one-step ``step``)."""
        return Segment(tuple(replace(step, steps_done=1).unread()), self.world_size, self.global_batch_size)

    @property
    def micro_batches_per_step(self) -> int:
        """This rank's micro-batches in the next step (0 in a step it sits out: ``sit_out``)."""
        return self._deal(self.rank, 0)[1]

    @property
    def lockstep_micro_batches(self) -> int:
        """As ``ElasticSampler.lockstep_micro_batches``: the most micro-batches any rank runs in the next step."""
        sat = self._sat_out()
        return micro_batch_count(self.global_batch_size, len(sat[0]) if sat else self.world_size, 0,
                                 self.micro_batch_size)

    @property
    def micro_sizes(self) -> list[int]:
        """Samples in each of this rank's micro-batches of the next step, in order."""
        part, count = self._deal(self.rank, 0)
        return [n for _, n in split_evenly(span(part), count)] if count else []

    # ---- position -------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch started at offset 0 (``N // global_batch_size``)."""
        return self.total // self.global_batch_size

    @property
    def remaining_steps(self) -> int:
        """Optimizer steps left in the current epoch from the committed position."""
        return self.segment.steps - self.segment.steps_done

    @property
    def step_in_epoch(self) -> int:
        """Committed steps of this epoch when it ran at this global batch from offset 0."""
        return self.offset // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` at offset 0; a no-op when ``epoch`` is the current one (``ElasticSampler.set_epoch``)."""
        if epoch < 0:
            raise ValueError(f"epoch must not be negative, got {epoch}.")
        if epoch != self.epoch:
            self.epoch, self.offset, self.segment = epoch, 0, self._fresh_segment()

    def commit_step(self) -> None:
        """Record one finished optimizer step; at the end of the epoch the tail is dropped and the next begins."""
        if self.remaining_steps < 1:
            raise RuntimeError(f"commit_step() past the end of epoch {self.epoch}; this is a trainer bug.")
        sat = self._sat_out()
        self._sitting = None
        self.offset += self.global_batch_size
        self.segment = self._after(sat[1]) if sat else replace(self.segment, steps_done=self.segment.steps_done + 1)
        self._roll_if_done()

    def _roll_if_done(self) -> None:
        if self.remaining_steps < 1:
            self.epoch, self.offset, self.segment = self.epoch + 1, 0, self._fresh_segment()

    # ---- what to read ---------------------------------------------------------------------
    def order(self, epoch: int | None = None) -> EpochOrder:
        """The epoch's order (cached for the current epoch)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is None or self._order.epoch != epoch:
            self._order = EpochOrder(self.sizes, self.seed, epoch, self.buffer, self.shuffle)
        return self._order

    def rest(self) -> list[Interval]:
        """This rank's unread order positions from the committed position to the end of the epoch, in order:
        ``remaining_steps`` shares, the first of ``sum(micro_sizes)`` samples (none in a step it sits out)."""
        sat = self._sat_out()
        if sat is None:
            return self.segment.rank_range(self.rank, self.segment.steps_done)
        return merge([*self._deal(self.rank, 0)[0], *self._after(sat[1]).rank_range(self.rank)])

    def positions(self, ahead: int = 0, rank: int | None = None) -> list[Interval]:
        """The order positions that ``rank`` trains ``ahead`` steps after the committed one; every rank's,
        in rank order, when ``rank`` is None (the step's global batch)."""
        if not 0 <= ahead < self.remaining_steps:
            raise ValueError(f"step {ahead} ahead is outside the {self.remaining_steps} steps left in epoch {self.epoch}.")
        ranks = range(self.world_size) if rank is None else (rank,)
        return [iv for r in ranks for iv in self._deal(r, ahead)[0]]

    def _ids(self, intervals: Sequence[Interval]) -> list[int]:
        order = self.order()
        parts = [order.ids(order.stream_positions(a, b)) for a, b in intervals]
        return np.concatenate(parts).tolist() if parts else []

    def batch_ids(self, ahead: int = 0, rank: int | None = None) -> list[list[int]]:
        """The micro-batches (sample ids) that ``rank`` (default this one) trains ``ahead`` steps after the
        committed position, within this epoch (pure: no state changes)."""
        rank = self.rank if rank is None else rank
        if not 0 <= ahead < self.remaining_steps:
            raise ValueError(f"step {ahead} ahead is outside the {self.remaining_steps} steps left in epoch {self.epoch}.")
        part, count = self._deal(rank, ahead)
        ids = self._ids(part)
        return [ids[s:s + n] for s, n in split_evenly(len(ids), count)] if count else []

    def global_batch(self, ahead: int = 0) -> list[int]:
        """The ids of every rank's part of the step ``ahead`` steps after the committed one, in rank order."""
        return [i for r in range(self.world_size) for mb in self.batch_ids(ahead, r) for i in mb]

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The committed position and what it means, as plain JSON-safe values (the same on every rank)."""
        seg = self.segment
        return {
            "version": STATE_VERSION, "kind": STATE_KIND, "epoch": self.epoch, "offset": self.offset,
            "seed": self.seed, "shuffle": self.shuffle, "buffer": self.buffer, "total": self.total,
            "data_digest": self.data_digest, "global_batch_size": self.global_batch_size,
            "world_size": self.world_size, "remaining": [list(iv) for iv in seg.remaining],
            "segment_world_size": seg.world_size, "segment_global_batch_size": seg.global_batch_size,
            "segment_steps": seg.steps_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position; this sampler's world size and global batch deal out the rest.

        - A map-style sampler's state, another ``total`` or another ``data_digest`` (other shards, or
          the same shards with other row counts) is refused with a ``ValueError``: the positions would
          name other samples.
        - ``seed``, ``shuffle`` and ``buffer`` are taken from the state (they define the order being
          continued); a different constructor value is overridden with a warning.
        - The saved segment is closed and a new one starts at this world size and global batch
          (invariant 3), also when both are unchanged (then it deals the same samples). Another global
          batch is allowed, as in ``ElasticSampler``: the epoch goes on in steps of the new size.
        """
        if state.get("kind") != STATE_KIND:
            raise ValueError("the saved data position is a map-style sampler's (ElasticSampler) but this task reads a "
                             "sharded stream; resume with the task's map-style dataset, or start over with --no-resume.")
        keys = ("epoch", "offset", "seed", "buffer", "total", "remaining", "segment_world_size",
                "segment_global_batch_size", "segment_steps")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"stream position lacks {missing}; it was not written by StreamSampler.state_dict().")
        if int(state["total"]) != self.total:
            raise ValueError(f"the saved stream position is for shards of {state['total']} rows in all but these "
                             f"shards hold {self.total}: its positions would name other samples; train on the same "
                             f"shards or start over with --no-resume.")
        saved_digest = state.get("data_digest")
        if saved_digest and self.data_digest and saved_digest != self.data_digest:
            raise ValueError("the saved stream position is for another shard list (other file names or row counts, "
                             f"digest {saved_digest} against {self.data_digest}); train on the same shards or start "
                             "over with --no-resume.")
        seed, shuffle, buffer = int(state["seed"]), bool(state.get("shuffle", True)), int(state["buffer"])
        if (seed, shuffle, buffer) != (self.seed, self.shuffle, self.buffer):
            log.warning("stream: resuming with the saved seed=%d shuffle=%s buffer=%d instead of seed=%d shuffle=%s "
                        "buffer=%d so the epoch in progress keeps its order.", seed, shuffle, buffer, self.seed,
                        self.shuffle, self.buffer)
        if int(state["global_batch_size"]) != self.global_batch_size:
            log.warning("stream: global batch size changed from %s to %d; epoch %s continues at sample offset %s.",
                        state["global_batch_size"], self.global_batch_size, state["epoch"], state["offset"])
        segment = self._checked_segment(state)
        self._sitting = None
        self.seed, self.shuffle, self.buffer = seed, shuffle, buffer
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None
        self.segment = Segment(tuple(segment.unread()), self.world_size, self.global_batch_size)
        self._roll_if_done()

    def _checked_segment(self, state: dict[str, Any]) -> Segment:
        """The saved segment, after checking that it describes a position of this data (else ``ValueError``)."""
        remaining = [(int(a), int(b)) for a, b in state["remaining"]]
        world, batch, done = (int(state["segment_world_size"]), int(state["segment_global_batch_size"]),
                              int(state["segment_steps"]))
        flat = [x for iv in remaining for x in iv]
        if (flat != sorted(flat) or any(b <= a for a, b in remaining) or (flat and (flat[0] < 0 or flat[-1] > self.total))
                or world < 1 or batch < world or int(state["epoch"]) < 0):
            raise ValueError(f"saved stream position epoch={state['epoch']} remaining={remaining[:4]}... (world size "
                             f"{world}, global batch {batch}) is not a position in {self.total} rows.")
        segment = Segment(tuple(remaining), world, batch, done)
        if not 0 <= done <= segment.steps or int(state["offset"]) != self.total - segment.size + done * batch:
            raise ValueError(f"saved stream position is inconsistent: offset {state['offset']} after {done} of "
                             f"{segment.steps} steps over {segment.size} remaining rows of {self.total}.")
        return segment

    def __repr__(self) -> str:
        return (f"StreamSampler(total={self.total}, shards={len(self.sizes)}, global_batch_size={self.global_batch_size}, "
                f"rank={self.rank}, world_size={self.world_size}, buffer={self.buffer}, epoch={self.epoch}, "
                f"offset={self.offset}, ranges={len(self.segment.remaining)})")
