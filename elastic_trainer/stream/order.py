"""The order in which an epoch visits a sharded stream, and the stable id of every sample.

A streamed source is a list of shards (files) with ``n_0, ..., n_{m-1}`` rows, ``N`` in all. Nothing
here reads a file: every function is a pure function of the row counts, the seed and the epoch,
so every rank, every DataLoader worker and every later process computes the same order.

- **Sample id.** Row ``i`` of shard ``s`` (shards in the source's listed order) has the id
  ``base_s + i`` with ``base_s = n_0 + ... + n_{s-1}``: an integer in ``[0, N)`` that does not
  depend on the epoch, the seed or the world size. The sample ledger records these ids.
- **Shard order.** Epoch ``e`` reads the shards in the order ``seeded_permutation(m, key(seed, e))``
  (the listed order without shuffling). Laid end to end they form the epoch's *stream*: stream
  position ``q`` in ``[0, N)`` is one row of one shard, and each shard is read front to back.
- **Buffer shuffle.** The stream is cut into blocks of ``buffer`` consecutive positions
  ``[jK, jK + K)`` (the last one shorter; a block may span the end of one shard and the start of
  the next). The epoch visits block ``j``'s rows in a seeded permutation of the block:
  *order position* ``p = jK + i`` is stream position ``jK + pi_{e,j}(i)``. A reader holds one
  block (a buffer of ``K`` rows) and empties it in that order before it reads the next one.
  ``buffer=1`` or ``shuffle=False`` visits the stream as it is.

So the epoch's order ``P_e: p -> q -> (shard, row) -> id`` is a permutation of the ids, like the
map-style sampler's ``randperm``, but one that can be read front to back, one block at a time.

Why a block permutation and not a random-replacement buffer (webdataset's ``shuffle(K)``, torchdata's
``Shuffler``): what such a buffer holds at a stop depends on everything read before, so resuming it
means saving up to ``K`` sample ids per rank (and per DataLoader worker), and after a world-size
change the buffered samples belong to no rank. A block permutation makes the order a pure function of
``(seed, epoch)``: the position is one integer per rank range, whatever the world size.

Permutations are made here from a 64-bit mixer (``splitmix64``'s finaliser) and ``argsort``, not from
a library RNG whose stream may change between versions: the same ids in the same order on every
machine, numpy version and torch build.

Usage::

    order = EpochOrder([1000, 1000, 500], seed=0, epoch=3, buffer=256)
    q = order.stream_positions(0, 64)        # the first 64 order positions, as stream positions
    order.ids(q)                             # their sample ids
    order.pieces(q.min(), q.max() + 1)       # which rows of which shards to read for them
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

_MASK = (1 << 64) - 1
_BLOCK_CACHE = 4  # block permutations kept per EpochOrder: a reader needs the current one and its neighbour


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a ``uint64`` array: a bijection on 64-bit integers that mixes every bit."""
    x = np.array(x, dtype=np.uint64, ndmin=1)
    with np.errstate(over="ignore"):  # the multiplications wrap modulo 2**64 by design
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def order_key(seed: int, epoch: int, what: str) -> int:
    """A 64-bit key for one of an epoch's permutations (``what``: ``shards`` or ``blocks``)."""
    digest = hashlib.sha256(f"elastic-stream:{seed}:{epoch}:{what}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def seeded_permutation(n: int, key: int) -> np.ndarray:
    """A permutation of ``range(n)`` determined by ``key`` alone: ``argsort(mix64(i ^ key))``.

    ``mix64`` is a bijection, so the sort keys are distinct and the result does not depend on the
    sort's tie rule; integer arithmetic wraps the same way everywhere."""
    if n < 0:
        raise ValueError(f"a permutation needs n >= 0, got {n}.")
    keys = mix64(np.arange(n, dtype=np.uint64) ^ np.uint64(key & _MASK))
    return np.argsort(keys, kind="stable").astype(np.int64)


class EpochOrder:
    """Epoch ``epoch``'s order over shards of ``sizes`` rows (see the module docstring).

    Args:
        sizes: rows of each shard, in the source's listed order (the ids' order).
        seed, epoch: what the permutations are drawn from.
        buffer: ``K``, the rows of one shuffle block; 1 = no shuffle within the stream.
        shuffle: ``False``: shards in the listed order and no block shuffle (``P_e`` is the identity).
    """

    def __init__(self, sizes: Sequence[int], seed: int, epoch: int, buffer: int, shuffle: bool = True) -> None:
        if buffer < 1:
            raise ValueError(f"the shuffle buffer must hold at least 1 row, got {buffer}.")
        self.sizes = np.asarray(list(sizes), dtype=np.int64)
        if self.sizes.ndim != 1 or len(self.sizes) == 0 or (self.sizes < 0).any():
            raise ValueError(f"shard sizes must be a non-empty list of row counts >= 0, got {list(sizes)[:8]}.")
        self.total = int(self.sizes.sum())
        self.seed, self.epoch, self.buffer, self.shuffle = seed, epoch, buffer, shuffle
        self.id_base = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        m = len(self.sizes)
        self.shard_order = (seeded_permutation(m, order_key(seed, epoch, "shards")) if shuffle
                            else np.arange(m, dtype=np.int64))
        """Shard indices (listed order) in the order this epoch reads them."""
        self.stream_start = np.concatenate([[0], np.cumsum(self.sizes[self.shard_order])]).astype(np.int64)
        """Stream position of the first row of the k-th shard read (and the total at the end)."""
        self._block_key = order_key(seed, epoch, "blocks")
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()

    def block_permutation(self, j: int) -> np.ndarray:
        """The order in which block ``j`` visits its rows (offsets within the block)."""
        length = min(self.buffer, self.total - j * self.buffer)
        if length <= 0 or j < 0:
            raise ValueError(f"block {j} is outside a stream of {self.total} rows in blocks of {self.buffer}.")
        if not self.shuffle or self.buffer == 1:
            return np.arange(length, dtype=np.int64)
        perm = self._blocks.get(j)
        if perm is None:
            key = int(mix64((self._block_key ^ j) & _MASK)[0])
            perm = self._blocks[j] = seeded_permutation(length, key)
            while len(self._blocks) > _BLOCK_CACHE:
                self._blocks.popitem(last=False)
        return perm

    def stream_positions(self, lo: int, hi: int) -> np.ndarray:
        """Order positions ``[lo, hi)`` as stream positions (``P_e`` up to the shard lookup)."""
        if not 0 <= lo <= hi <= self.total:
            raise ValueError(f"order positions [{lo}, {hi}) are outside [0, {self.total}).")
        k, out = self.buffer, []
        for j in range(lo // k, (hi - 1) // k + 1 if hi > lo else lo // k):
            start = j * k
            perm = self.block_permutation(j)
            out.append(start + perm[max(lo, start) - start: min(hi, start + len(perm)) - start])
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def locate(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions -> (shard index in the listed order, row in that shard)."""
        q = np.asarray(q, dtype=np.int64)
        k = np.searchsorted(self.stream_start, q, side="right") - 1
        return self.shard_order[k], q - self.stream_start[k]

    def ids(self, q: np.ndarray) -> np.ndarray:
        """The sample ids at stream positions ``q``."""
        shard, row = self.locate(q)
        return self.id_base[shard] + row

    def pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """The rows behind stream positions ``[a, b)``: ``(shard index, first row, end row)`` in stream order."""
        if not 0 <= a <= b <= self.total:
            raise ValueError(f"stream positions [{a}, {b}) are outside [0, {self.total}).")
        out = []
        k = int(np.searchsorted(self.stream_start, a, side="right")) - 1
        while a < b:
            end = min(b, int(self.stream_start[k + 1]))
            if end > a:
                out.append((int(self.shard_order[k]), a - int(self.stream_start[k]), end - int(self.stream_start[k])))
            a, k = end, k + 1
        return out

    def epoch_ids(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The ids at order positions ``[lo, hi)`` (default: the whole epoch), in order."""
        return self.ids(self.stream_positions(lo, self.total if hi is None else hi))
