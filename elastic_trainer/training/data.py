"""Datasets for the example tasks: token sequences (in memory, or written as stream shards), and the
seeds' synthetic tensors in memory or in an HDF5 file.

``token_dataset`` is the default example's data: random token sequences and their reversal (or
copy), generated in memory from a seed; a model can learn it, so its loss falls.
``write_token_shards`` writes the same sequences as Parquet shards or flat token files, and
``TokenRows`` turns a streamed row back into the example's ``(src, tgt)`` (``--data parquet:...``).

The seed scripts train ``torch.nn.Transformer`` on ``src = rand(2048, 1, 512)`` and
``tgt = rand(2048, 20, 512)``, first from memory and then from an HDF5 file read with h5py.
Both are here, generated from the same seeded chunks, so the file holds exactly the tensors of
``synthetic_dataset`` with the same arguments. Any map-style dataset works with
``ElasticSampler``; these are the ones the built-in task and the tests use.

    python -c "from elastic_trainer.training.data import write_synthetic_h5; write_synthetic_h5('data.h5', 2048)"

``H5Dataset`` opens its file lazily, once per process, on first access: a handle opened in the
parent would be shared by forked ``DataLoader`` workers (h5py handles are not fork-safe) and cannot
be pickled for spawned ones, so the dataset never holds one when it is copied to a worker.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

SRC_SHAPE = (1, 512)
TGT_SHAPE = (20, 512)
_CHUNK = 1024  # samples per generated chunk; part of the data's definition, do not change


def _synthetic_chunks(n: int, shapes: Sequence[Sequence[int]], seed: int):
    """Yield ``(start, [tensor per shape])`` chunks of uniform [0, 1) float32 samples, seeded per chunk."""
    if n < 0:
        raise ValueError(f"the number of samples must not be negative, got {n}.")
    for chunk_no, start in enumerate(range(0, n, _CHUNK)):
        count = min(_CHUNK, n - start)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + chunk_no)
        yield start, [torch.rand((count, *shape), generator=gen) for shape in shapes]


def synthetic_dataset(
    n: int = 2048,
    src_shape: Sequence[int] = SRC_SHAPE,
    tgt_shape: Sequence[int] = TGT_SHAPE,
    seed: int = 0,
) -> TensorDataset:
    """The seed scripts' synthetic ``(src, tgt)`` dataset, identical in every process for one seed."""
    parts = [(s, t) for _, (s, t) in _synthetic_chunks(n, [src_shape, tgt_shape], seed)]
    if not parts:
        return TensorDataset(torch.empty((0, *src_shape)), torch.empty((0, *tgt_shape)))
    return TensorDataset(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))


TOKEN_TASKS = ("reverse", "copy")
BOS = 0  # the token that starts the decoder's input; never in a sequence


def token_dataset(n: int, length: int, vocab_size: int, task: str = "reverse", seed: int = 0) -> TensorDataset:
    """``(src, tgt)`` pairs of ``length`` tokens in ``1..vocab_size-1`` (0 is ``BOS``), int64.

    ``tgt`` is ``src`` reversed (``task="reverse"``) or ``src`` itself (``"copy"``). The same
    ``seed`` gives the same samples in every process, so ranks need not exchange data.
    """
    if task not in TOKEN_TASKS:
        raise ValueError(f"the token task must be one of {', '.join(TOKEN_TASKS)}; got {task!r}")
    if n < 0 or length < 1 or vocab_size < 3:
        raise ValueError(f"a token dataset needs n >= 0, length >= 1 and vocab_size >= 3; got {n}, {length}, {vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(BOS + 1, vocab_size, (n, length), generator=gen)
    return TensorDataset(src, src.flip(1) if task == "reverse" else src.clone())


def write_synthetic_h5(
    path: str | os.PathLike,
    n: int = 2048,
    src_shape: Sequence[int] = SRC_SHAPE,
    tgt_shape: Sequence[int] = TGT_SHAPE,
    seed: int = 0,
    keys: Sequence[str] = ("src", "tgt"),
) -> Path:
    """Write ``synthetic_dataset(n, src_shape, tgt_shape, seed)`` to an HDF5 file, chunk by chunk.

    The file is written under a temporary name and renamed, so a reader never sees half a file.
    Returns the path. Memory use is one chunk of 1024 samples whatever ``n`` is.
    """
    import h5py

    if len(keys) != 2:
        raise ValueError(f"keys names the two datasets (src, tgt); got {list(keys)}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            shapes = [tuple(src_shape), tuple(tgt_shape)]
            dsets = [
                f.create_dataset(k, shape=(n, *s), dtype="float32", chunks=(min(n, 64), *s) if n else None)
                for k, s in zip(keys, shapes)
            ]
            for start, tensors in _synthetic_chunks(n, shapes, seed):
                for d, t in zip(dsets, tensors):
                    d[start : start + len(t)] = t.numpy()
            f.attrs["seed"] = seed
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_token_shards(url: str, n: int, length: int, vocab_size: int, seed: int = 0, *, shards: int = 4,
                       fmt: str = "parquet", row_group_size: int = 256, dtype: str = "uint16") -> list[str]:
    """Write ``token_dataset(n, length, vocab_size, seed=seed)``'s source sequences as ``shards`` files in ``url``.

    ``fmt="parquet"``: ``shard-00000.parquet``... with one column ``tokens`` (lists of int32), in row
    groups of ``row_group_size`` rows; ``"tokens"``: ``shard-00000.bin``... flat arrays of ``dtype``.
    ``url`` is a folder path or fsspec URL (the checkpoint storage layer). Sequence ``i`` of the
    in-memory dataset is sample id ``i`` of the stream (files in name order). Returns the files' URLs.
    """
    from elastic_trainer import storage

    if fmt not in ("parquet", "tokens") or shards < 1 or n < shards:
        raise ValueError(f"write {n} sequences into {shards} parquet or tokens files (got fmt={fmt!r}); "
                         "give at least one sequence per shard.")
    src = token_dataset(n, length, vocab_size, "copy", seed).tensors[0].numpy()
    fs, root = storage.get_fs(url)
    storage.makedirs(fs, root)
    out = []
    for i, part in enumerate(np.array_split(src, shards)):
        path = storage.join(root, f"shard-{i:05d}.{'parquet' if fmt == 'parquet' else 'bin'}")
        with fs.open(path, "wb") as f:
            if fmt == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                tokens = pa.array(list(part.astype(np.int32)), type=pa.list_(pa.int32()))
                pq.write_table(pa.table({"tokens": tokens}), f, row_group_size=row_group_size)
            else:
                if part.max(initial=0) > np.iinfo(np.dtype(dtype)).max:
                    raise ValueError(f"tokens up to {vocab_size - 1} do not fit {dtype}; give --token-dtype uint32.")
                f.write(part.astype(dtype).tobytes())
        out.append(path if "://" not in url else fs.unstrip_protocol(path))
    return out


class TokenRows:
    """The example's stream transform: a row's first ``length`` tokens -> ``(src, tgt)``, as ``token_dataset`` gives.

    ``tgt`` is ``src`` reversed (``task="reverse"``) or copied. Tokens must lie in ``1..vocab_size-1``
    (0 is ``BOS``); a row outside that, or shorter than ``length``, is an error naming the flag."""

    def __init__(self, length: int, vocab_size: int, task: str = "reverse") -> None:
        if task not in TOKEN_TASKS:
            raise ValueError(f"the token task must be one of {', '.join(TOKEN_TASKS)}; got {task!r}")
        self.length, self.vocab_size, self.task = length, vocab_size, task

    def __call__(self, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = np.asarray(row["tokens"])
        if len(tokens) < self.length:
            raise ValueError(f"a row of --data has {len(tokens)} tokens, fewer than --src-len {self.length}; give a "
                             "--src-len no longer than the shortest row.")
        src = torch.from_numpy(tokens[:self.length].astype(np.int64))
        if int(src.min()) <= BOS or int(src.max()) >= self.vocab_size:
            raise ValueError(f"a row of --data has tokens in [{int(src.min())}, {int(src.max())}], outside "
                             f"1..{self.vocab_size - 1} (0 is BOS); raise --vocab-size above the largest token.")
        return src, (src.flip(0) if self.task == "reverse" else src.clone())


class H5Dataset(Dataset):
    """Samples ``i`` of the HDF5 datasets named ``keys`` (all of the same length), as tensors.

    ``dataset[i]`` is a tuple with one tensor per key (the tensor itself when there is one key).
    A ``DataLoader`` with ``batch_sampler=`` reads a whole micro-batch at once through
    ``__getitems__`` (one h5py read per key instead of one per sample). The file is opened on
    first access in each process and reopened after a fork; ``close()`` closes it.
    """

    def __init__(self, path: str | os.PathLike, keys: Sequence[str] = ("src", "tgt")) -> None:
        import h5py

        self.path = Path(path)
        self.keys = tuple(keys)
        if not self.keys:
            raise ValueError("keys must name at least one dataset in the HDF5 file.")
        try:
            with h5py.File(self.path, "r") as f:
                missing = [k for k in self.keys if k not in f]
                if missing:
                    raise ValueError(
                        f"{self.path} has no dataset {missing}; it has {sorted(f.keys())}; pass keys= that exist."
                    )
                lengths = {k: f[k].shape[0] for k in self.keys}
        except OSError as exc:
            raise ValueError(f"cannot open HDF5 file {self.path}: {exc}") from exc
        if len(set(lengths.values())) != 1:
            raise ValueError(f"the datasets of {self.path} differ in length {lengths}; they must match.")
        self._len = next(iter(lengths.values()))
        self._file = None
        self._pid: int | None = None

    def _datasets(self):
        import h5py

        if self._file is None or self._pid != os.getpid():
            # After a fork the inherited handle (if any) belongs to the parent: do not use or close it.
            self._file = h5py.File(self.path, "r")
            self._pid = os.getpid()
        return [self._file[k] for k in self.keys]

    def __len__(self) -> int:
        return self._len

    def _out(self, arrays: list[np.ndarray]):
        tensors = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
        return tensors[0] if len(tensors) == 1 else tensors

    def __getitem__(self, index: int):
        index = int(index)
        if not -self._len <= index < self._len:
            raise IndexError(f"index {index} is out of range for {self._len} samples in {self.path}.")
        return self._out([d[index % self._len] for d in self._datasets()])

    def __getitems__(self, indices: Sequence[int]) -> list:
        """Read a batch: h5py wants increasing unique indices, so read those and put them back in order."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return []
        if idx.min() < 0 or idx.max() >= self._len:
            raise IndexError(f"indices out of range for {self._len} samples in {self.path}.")
        uniq, inverse = np.unique(idx, return_inverse=True)
        blocks = [d[uniq][inverse] for d in self._datasets()]
        return [self._out([b[j] for b in blocks]) for j in range(len(idx))]

    def close(self) -> None:
        """Close this process's handle (a later access opens it again)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file, self._pid = None, None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_file"], state["_pid"] = None, None  # handles do not travel to other processes
        return state

    def __repr__(self) -> str:
        return f"H5Dataset({str(self.path)!r}, keys={self.keys}, len={self._len})"
