"""The checkpoint's host memory is made before the first save, on a background thread (issue 28).

A save blocks training while the state is copied into CPU memory; making that memory (on a GPU:
page-locking it, 0.37 s per GB on an H100) inside the first save made it block 15 times longer
than the others. These tests watch every call of ``host_memory.allocate`` and the thread it runs
on: the preparation's thread makes the buffer, and no save makes one itself. The GPU's side
(page-locked memory, the blocked milliseconds) is in tests/test_gpu.py and benchmarks/gpu_overhead.py.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

from elastic_trainer.checkpoint import CheckpointManager, host_memory
from elastic_trainer.checkpoint.host_memory import HostBuffer
from elastic_trainer.checkpoint.sharded import Staging, prepare_saves
from elastic_trainer.checkpoint.snapshot import Snapshotter
from elastic_trainer.etcd.server import free_port
from elastic_trainer.flags import parse_train_config
from elastic_trainer.training.trainer import Trainer

PREPARING = "checkpoint-host-buffer"
SMALL_EXAMPLE = ["--d-model", "64", "--dim-feedforward", "128", "--dataset-size", "256"]  # a 0.4 MB state


@pytest.fixture
def allocations(monkeypatch) -> list[tuple[str, int]]:
    """(thread name, bytes) of every host buffer made from now on."""
    made: list[tuple[str, int]] = []
    real = host_memory.allocate

    def allocate(nbytes: int, pinned: bool, touch: bool = False):
        made.append((threading.current_thread().name, nbytes))
        return real(nbytes, pinned, touch)
    monkeypatch.setattr(host_memory, "allocate", allocate)
    return made


def _state(rows: int = 256) -> dict:
    model = torch.nn.Linear(1024, rows)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()  # the optimizer's state exists after the first step
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def test_a_prepared_buffer_is_made_on_its_own_thread_and_the_first_get_only_adopts_it(allocations):
    host = HostBuffer()
    assert host.prepare(1 << 20, pinned=False)
    host.wait()
    assert allocations == [(PREPARING, (1 << 20) + host_memory.slack(1 << 20))]
    assert host.allocations == 1 and host.capacity == (1 << 20) + (64 << 10)
    buf = host.get(1 << 20, pinned=False)
    assert buf.data_ptr() == host.tensor.data_ptr() and host.allocations == 1 and len(allocations) == 1
    assert not host.prepare(1 << 20, pinned=False)  # served already: nothing more is made
    assert host.get((1 << 20) + 4096, pinned=False) is buf  # a little more fits in the slack
    host.free()
    assert host.capacity == 0


def test_the_first_save_after_prepare_lays_out_in_the_prepared_buffer_and_allocates_nothing(tmp_path, allocations):
    state = _state()
    mgr = CheckpointManager(str(tmp_path / "ck"), async_checkpoint=True)
    mgr.prepare(state)  # sized from model and optimizer; the save adds a little (meta, RNG)
    full = {**state, "meta": {"step": 1}, "rng": {"torch": torch.get_rng_state()}}
    mgr.save(1, full)
    mgr.save(2, full)
    mgr.close()
    assert [name for name, _ in allocations] == [PREPARING]  # no save made a buffer
    assert mgr.last_save_stats["committed"] and mgr.last_save_stats["host_buffer_bytes"] == allocations[0][1]
    got = mgr.load()[1]
    assert torch.equal(got["model"]["weight"], state["model"]["weight"])


def test_a_save_before_the_preparation_finished_waits_for_it_and_uses_its_buffer(allocations):
    snapper = Snapshotter()
    started, release = threading.Event(), threading.Event()
    real = host_memory.allocate

    def slow(nbytes, pinned, touch=False):
        started.set()
        release.wait(10)
        return real(nbytes, pinned, touch)
    host_memory.allocate = slow  # undone by the fixture's monkeypatch
    state = _state()
    assert snapper.prepare(state)
    started.wait(10)
    threading.Timer(0.2, release.set).start()
    stats: dict = {}
    snap, _ = snapper.take(state, stats=stats)
    assert stats["host_buffer_wait_s"] >= 0.1 and snapper.host.allocations == 1
    assert torch.equal(snap.state["model"]["weight"], state["model"]["weight"])
    snapper.clear()


def test_a_failed_preparation_is_logged_and_the_save_allocates_as_before(monkeypatch, caplog):
    def broken(nbytes, pinned, touch=False):
        raise RuntimeError("cudaHostRegister failed with CUDA error 2")
    real = host_memory.allocate
    monkeypatch.setattr(host_memory, "allocate", broken)
    snapper = Snapshotter()
    state = _state()
    snapper.prepare(state)
    monkeypatch.setattr(host_memory, "allocate", real)
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint.host_memory"):
        snap, _ = snapper.take(state)
    assert "preparing the checkpoint's host buffer failed (RuntimeError: cudaHostRegister" in caplog.text
    assert snapper.host.allocations == 1 and torch.equal(snap.state["model"]["bias"], state["model"]["bias"])


def test_sharded_staging_after_prepare_copies_into_the_prepared_buffer(allocations):
    staging = Staging()
    state = _state()
    assert staging.prepare(state)
    staged = staging.stage(state)
    staged_again = staging.stage(state)
    assert [name for name, _ in allocations] == [PREPARING]
    assert staged_again["model"]["weight"].data_ptr() == staged["model"]["weight"].data_ptr()
    assert torch.equal(staged["model"]["weight"], state["model"]["weight"])
    assert staged["model"]["weight"].data_ptr() != state["model"]["weight"].data_ptr()
    for t in [*staged["model"].values(), *staged["optimizer"]["state"][0].values()]:
        # in the one buffer, yet each tensor's storage is its own bytes: DCP writes them as they are
        assert t.untyped_storage().size() == t.nbytes
        assert staging.host.tensor.data_ptr() <= t.data_ptr() < staging.host.tensor.data_ptr() + staging.host.capacity
    staging.close()


def test_prepare_saves_prepares_on_the_saving_rank_only_unless_sharded(tmp_path, allocations):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(str(tmp_path / "ck"))
    assert prepare_saves(mgr, model, opt, sharded=False, main=False) is None
    assert prepare_saves(mgr, model, opt, sharded=False, main=True) is None
    mgr.close()
    assert [name for name, _ in allocations] == [PREPARING]


@pytest.fixture
def _no_dist_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("fsdp", [False, True], ids=["full-state", "sharded"])
def test_the_trainers_saves_use_the_memory_prepared_after_its_first_step(tmp_path, allocations, monkeypatch,
                                                                        _no_dist_env, fsdp):
    if fsdp:  # a world of one over gloo: the sharded path without torchrun
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(free_port())}.items():
            monkeypatch.setenv(name, value)
    argv = [*SMALL_EXAMPLE, "--global-batch-size", "16", "--max-steps", "6", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "l"), "--no-wandb", "--no-progress"]
    trainer = Trainer(parse_train_config([*argv, *(["--fsdp"] if fsdp else [])]))
    assert trainer.train()["step"] == 6
    names = [name for name, _ in allocations]
    # no save made memory while training waited (sharded: rank 0's small rest of the state is a
    # snapshot of its own, made on the commit's background thread)
    assert names[0] == PREPARING and threading.main_thread().name not in names, allocations
    assert names.count(PREPARING) == 1
    # the committed line's bytes are every byte the manifest lists (sharded: the shards too), as
    # soon as the save counts as committed
    manifest = json.loads((tmp_path / "ck" / "step-6" / "manifest.json").read_text())
    stats = trainer.checkpoints.manager.last_save_stats
    assert stats["committed"] and stats["bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert not fsdp or stats["bytes"] > stats["sharded_bytes"] > 0
