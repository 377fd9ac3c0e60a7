"""The CUDA paths, on a GPU: ``pytest -m gpu`` (skipped, saying why, where torch sees no GPU).

    .venv/bin/python -m pytest -q -m gpu tests/test_gpu.py

One GPU is enough for all of them (world size 1 with NCCL, AMP fp16 and bf16, TF32, CUDA step
times, the snapshot of a CUDA state, the profiler); with two or more, the device-binding tests
also use a GPU that is not the current one. The same decisions are tested on the CPU in
``tests/test_devices.py``.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from elastic_trainer import devices
from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.checkpoint.snapshot import Snapshotter, cuda_devices
from elastic_trainer.config import TrainConfig
from elastic_trainer.etcd_server import free_port
from elastic_trainer.flags import parse_train_config
from elastic_trainer.training.trainer import Trainer
from elastic_trainer.training.worker import setup_distributed
from tests.helpers.common import REPO, cli_cmd

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

FIXTURE = "tests.helpers.task_fixture:build"
GPU_TASK = "tests.helpers.gpu_task:build"
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "ELASTIC_TRAINER_CHECKPOINT_DIR", "ELASTIC_TRAINER_LOG_DIR", "ELASTIC_TRAINER_RDZV_ROUND")


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for name in DIST_ENV:
        monkeypatch.delenv(name, raising=False)
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _train(tmp_path, *argv: str) -> dict:
    return Trainer(parse_train_config([*argv, "--no-wandb", "--no-progress", "--log-dir", str(tmp_path / "l")])).train()


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return {**env, "PYTHONPATH": str(REPO), **extra}


# ------------------------------------------------------------------------------------------- devices

def test_each_local_rank_gets_its_own_gpu_here():
    view = devices.CudaView.probe()
    assert view.available and view.device_count >= 1 and view.cuda_build
    assert devices.pick_device("auto", 0, view) == torch.device("cuda", 0)
    assert devices.pick_device("cuda", view.device_count - 1, view) == torch.device("cuda", view.device_count - 1)
    with pytest.raises(devices.DeviceError, match="has no GPU of its own"):
        devices.pick_device("cuda", view.device_count, view)  # was a modulo: two ranks on GPU 0
    assert devices.nproc_per_node("gpu", view) == view.device_count


def test_world_size_one_nccl_group_is_bound_to_its_device(monkeypatch):
    rank = torch.cuda.device_count() - 1  # the last GPU: not the current device when there are several
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    # LOCAL_RANK = last GPU with WORLD_SIZE 1 is a valid layout only in this test: CUDA_VISIBLE_DEVICES unchanged
    info = setup_distributed(TrainConfig(device="cuda", collective_timeout=60))
    try:
        assert info.device == torch.device("cuda", rank) and torch.cuda.current_device() == rank
        assert dist.get_backend() == "nccl"
        assert dist.group.WORLD.bound_device_id == torch.device("cuda", rank)  # device_id: eager communicators
        t = torch.ones(4, device=info.device)
        dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


def test_a_world_of_one_over_nccl_trains_resumes_and_names_nccl_first(tmp_path):
    port = free_port()
    env = _clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    base = [sys.executable, "-m", "elastic_trainer.train", "--task", FIXTURE, "--device", "cuda",
            "--global-batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "l"),
            "--no-wandb", "--no-progress"]
    first = subprocess.run([*base, "--max-steps", "5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("[elastic-trainer]")]
    assert lines[0].startswith("[elastic-trainer] device cuda:0 (") and "backend nccl (NCCL " in lines[0], lines[0]
    assert "torch " in lines[0] and "(CUDA " in lines[0] and "tf32 on" in lines[0]
    env["MASTER_PORT"] = str(free_port())
    again = subprocess.run([*base, "--max-steps", "8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0 and "resumed from checkpoint step-5" in again.stderr, again.stderr[-3000:]


def test_launcher_refuses_more_workers_than_gpus(tmp_path, capsys, monkeypatch):
    from elastic_trainer import cli
    from elastic_trainer.cli import launch

    def run_node(run):
        raise AssertionError(f"launched {run.nproc_per_node} workers on {torch.cuda.device_count()} GPU(s)")
    monkeypatch.setattr(launch, "run_node", run_node)
    n = torch.cuda.device_count()
    argv = ["--nproc-per-node", str(n + 1), "--rdzv-backend", "c10d",  # c10d: no etcd binary needed for the checks
            "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "l")]
    assert cli.main([*argv, "--", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{n + 1} workers on this node need {n + 1} GPUs" in err, err


@pytest.mark.slow
def test_elastic_train_nproc_gpu_runs_one_worker_per_gpu(tmp_path):
    from elastic_trainer.etcd_server import EtcdError, find_etcd_binary

    try:
        find_etcd_binary()
    except EtcdError as exc:
        pytest.skip(f"no etcd binary: {exc}")
    proc = subprocess.run(cli_cmd("--nproc-per-node", "gpu", "--run-id", "gpu-test", "--log-dir", str(tmp_path / "l"),
                                  "--checkpoint-dir", str(tmp_path / "ck"), "--", "--task", FIXTURE, "--device", "cuda",
                                  "--global-batch-size", "16", "--max-steps", "6", "--no-wandb", "--no-progress"),
                          cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"world size {torch.cuda.device_count()}" in proc.stderr and "backend nccl (NCCL " in proc.stderr


# ---------------------------------------------------------------------------------------- precision

def test_amp_fp16_skips_overflowing_steps_without_stepping_the_scheduler(tmp_path):
    out = _train(tmp_path, "--task", GPU_TASK, "--overflow-steps", "2", "--device", "cuda", "--amp", "fp16",
                 "--global-batch-size", "16", "--max-steps", "6", "--checkpoint-dir", str(tmp_path / "ck"))
    assert out["step"] == 6
    state = CheckpointManager(str(tmp_path / "ck")).load()[1]
    assert state["meta"]["amp"] == "fp16"
    assert state["scaler"]["scale"] == 65536.0 / 4  # halved by each of the two skipped steps
    assert state["scheduler"]["last_epoch"] == 4  # stepped for the 4 steps that were taken, not 6
    resumed = _train(tmp_path, "--task", GPU_TASK, "--device", "cuda", "--amp", "fp16", "--global-batch-size", "16",
                     "--max-steps", "8", "--checkpoint-dir", str(tmp_path / "ck"))
    assert resumed["step"] == 8
    assert CheckpointManager(str(tmp_path / "ck")).load()[1]["scaler"]["scale"] == 65536.0 / 4  # restored


def test_amp_bf16_trains_without_a_scaler(tmp_path):
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16 (--amp bf16 refuses it; tested on the CPU)")
    out = _train(tmp_path, "--task", FIXTURE, "--device", "cuda", "--amp", "bf16", "--global-batch-size", "16",
                 "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "ck"))
    state = CheckpointManager(str(tmp_path / "ck")).load()[1]
    assert out["step"] == 4 and torch.isfinite(torch.tensor(out["loss"]))
    assert state["scaler"] == {} and state["meta"]["amp"] == "bf16"


def test_tf32_is_on_by_default_on_cuda_and_off_with_no_tf32(tmp_path):
    _train(tmp_path, "--task", FIXTURE, "--device", "cuda", "--global-batch-size", "16", "--max-steps", "1",
           "--checkpoint-dir", "")
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    _train(tmp_path, "--task", FIXTURE, "--device", "cuda", "--no-tf32", "--global-batch-size", "16",
           "--max-steps", "1", "--checkpoint-dir", "")
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32


# ---------------------------------------------------------------------------------------- step times

def test_cuda_step_time_is_the_gpus_not_the_queueing():
    device = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    timer = devices.step_timer(device)
    t0 = time.perf_counter()
    timer.start()
    for _ in range(40):
        a = (a @ a).clamp_(-1, 1)
    took = timer.stop()
    queued = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    assert took.seconds() > 5 * queued, (took.seconds(), queued)  # the host clock saw only the queueing
    assert 0.5 * wall <= took.seconds() <= wall * 1.05, (took.seconds(), wall)


# ---------------------------------------------------------------------------------------- checkpoints

def test_snapshot_of_a_cuda_state_waits_for_its_own_gpu():
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    state = {"w": torch.randn(1024, 1024, device=last), "b": torch.arange(10.0, device=last), "step": 3}
    assert cuda_devices([state["w"], torch.zeros(1)]) == [last]
    with torch.cuda.device(0):  # the current device is GPU 0, the state may be on another one
        snap, deferred = Snapshotter().take(state)
    assert deferred is None
    assert torch.equal(snap.state["w"], state["w"].cpu()) and torch.equal(snap.state["b"], state["b"].cpu())


def test_profiler_records_cuda_kernels(tmp_path):
    _train(tmp_path, "--task", FIXTURE, "--device", "cuda", "--profile", "--profile-wait", "0", "--profile-warmup", "1",
           "--profile-active", "1", "--max-steps", "3", "--global-batch-size", "16", "--checkpoint-dir", "")
    tables = list((tmp_path / "l" / "profile").glob("key_averages-rank0-*.txt"))
    assert tables and "CUDA" in tables[0].read_text()

