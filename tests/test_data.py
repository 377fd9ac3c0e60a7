"""The example datasets: synthetic tensors, the HDF5 file, and reading it through DataLoader workers.

Run:  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_data.py
"""

from __future__ import annotations

import pickle

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from elastic_trainer.training.data import BOS, H5Dataset, synthetic_dataset, token_dataset, write_synthetic_h5
from elastic_trainer.sampler import ElasticSampler

SHAPES = dict(src_shape=(1, 8), tgt_shape=(4, 8))


def test_synthetic_dataset_has_the_seed_shapes_and_is_the_same_for_one_seed():
    a = synthetic_dataset(1500, seed=3, **SHAPES)
    b = synthetic_dataset(1500, seed=3, **SHAPES)
    assert len(a) == 1500 and a[0][0].shape == (1, 8) and a[0][1].shape == (4, 8)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    assert not torch.equal(a.tensors[0], synthetic_dataset(1500, seed=4, **SHAPES).tensors[0])
    default = synthetic_dataset(4)
    assert default.tensors[0].shape == (4, 1, 512) and default.tensors[1].shape == (4, 20, 512)


def test_token_dataset_targets_are_the_reversed_or_copied_sources_and_one_seed_gives_one_dataset():
    rev = token_dataset(300, 6, 10, "reverse", seed=1)
    src, tgt = rev.tensors
    assert src.shape == tgt.shape == (300, 6) and src.dtype == torch.int64
    assert torch.equal(tgt, src.flip(1))
    assert int(src.min()) > BOS and int(src.max()) < 10, "tokens are 1..vocab-1; 0 starts the decoder"
    assert torch.equal(src, token_dataset(300, 6, 10, "reverse", seed=1).tensors[0])
    assert not torch.equal(src, token_dataset(300, 6, 10, "reverse", seed=2).tensors[0])
    copy = token_dataset(300, 6, 10, "copy", seed=1)
    assert torch.equal(copy.tensors[0], src) and torch.equal(copy.tensors[1], src)
    with pytest.raises(ValueError, match="one of reverse, copy"):
        token_dataset(3, 6, 10, "sort")


def test_h5_file_holds_exactly_the_synthetic_dataset(tmp_path):
    path = write_synthetic_h5(tmp_path / "d" / "data.h5", 1300, seed=2, **SHAPES)
    mem = synthetic_dataset(1300, seed=2, **SHAPES)
    with h5py.File(path, "r") as f:
        assert np.array_equal(f["src"][:], mem.tensors[0].numpy())
        assert np.array_equal(f["tgt"][:], mem.tensors[1].numpy())
    assert not list(path.parent.glob(".*.tmp"))
    ds = H5Dataset(path)
    assert len(ds) == 1300
    src, tgt = ds[1299]
    assert torch.equal(src, mem[1299][0]) and torch.equal(tgt, mem[1299][1])
    assert torch.equal(ds[-1][0], src)
    with pytest.raises(IndexError):
        ds[1300]


def test_h5_batch_read_keeps_the_order_of_unsorted_and_repeated_indices(tmp_path):
    path = write_synthetic_h5(tmp_path / "data.h5", 50, **SHAPES)
    ds, mem = H5Dataset(path), synthetic_dataset(50, **SHAPES)
    idx = [7, 3, 49, 3, 0]
    got = ds.__getitems__(idx)
    for i, (src, tgt) in zip(idx, got):
        assert torch.equal(src, mem[i][0]) and torch.equal(tgt, mem[i][1])
    assert ds.__getitems__([]) == []
    one_key = H5Dataset(path, keys=("tgt",))
    assert torch.equal(one_key[5], mem[5][1])


def test_h5_dataset_opens_lazily_and_pickles_without_a_file_handle(tmp_path):
    path = write_synthetic_h5(tmp_path / "data.h5", 20, **SHAPES)
    ds = H5Dataset(path)
    assert ds._file is None  # nothing open for forked workers to inherit
    ds[0]
    assert ds._file is not None
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives
    assert clone._file is None and torch.equal(clone[3][1], ds[3][1])
    ds.close()
    clone.close()
    assert ds._file is None


def test_h5_dataset_refuses_missing_keys_and_unequal_lengths_with_a_sentence(tmp_path):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f["src"] = np.zeros((4, 2), dtype="float32")
        f["tgt"] = np.zeros((5, 2), dtype="float32")
    with pytest.raises(ValueError, match="differ in length"):
        H5Dataset(path)
    with pytest.raises(ValueError, match="has no dataset"):
        H5Dataset(path, keys=("src", "label"))
    with pytest.raises(ValueError, match="cannot open HDF5 file"):
        H5Dataset(tmp_path / "missing.h5")


def _epoch_through_loader(ds, num_workers):
    sampler = ElasticSampler(len(ds), 12, 1, 2, seed=5, micro_batch_size=4)
    sampler.commit_step()  # resume mid-epoch
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=num_workers)
    batches = []
    for src, tgt in loader:
        batches.append((src, tgt))
    return sampler, batches


@pytest.mark.timeout(180)
def test_h5_dataset_through_a_dataloader_with_2_workers_matches_memory(tmp_path):
    path = write_synthetic_h5(tmp_path / "data.h5", 64, **SHAPES)
    ds, mem = H5Dataset(path), synthetic_dataset(64, **SHAPES)
    sampler, with_workers = _epoch_through_loader(ds, 2)
    _, in_process = _epoch_through_loader(ds, 0)
    expected = [mb for k in range(1, sampler.steps_per_epoch) for mb in sampler.batches_for_step(k)]
    assert len(with_workers) == len(in_process) == len(expected) > 0
    for (src, tgt), (src0, tgt0), idx in zip(with_workers, in_process, expected):
        assert src.shape == (len(idx), 1, 8) and tgt.shape == (len(idx), 4, 8)
        assert torch.equal(src, mem.tensors[0][idx]) and torch.equal(tgt, mem.tensors[1][idx])
        assert torch.equal(src, src0) and torch.equal(tgt, tgt0)
    ds.close()
