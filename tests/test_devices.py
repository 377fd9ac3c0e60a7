"""Device, backend, precision and step-time decisions (``elastic_trainer/devices.py``), on the CPU.

Each decision is a function of what it is given (a ``CudaView`` of what torch and the node show,
the local rank, the scales before and after a step), so the CUDA branches are proved here without
a GPU; ``tests/test_gpu.py`` runs the same paths on CUDA where a GPU is lent. The launcher and
worker tests run the real ``elastic-train`` and ``elastic_trainer.train`` on this GPU-less machine,
with the NVIDIA evidence a GPU pod shows (``CUDA_VISIBLE_DEVICES``) set for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from elastic_trainer import cli, devices
from elastic_trainer.cli import launch
from elastic_trainer.checkpoint.host_memory import cuda_devices
from elastic_trainer.config import TrainConfig
from elastic_trainer.devices import CudaView, DeviceError
from elastic_trainer.training.manager import agree_interval, collective_failed, host_step_is_device_state
from tests.helpers.common import REPO

NO_GPU = CudaView(available=False, device_count=0, torch_version="2.13.0+cpu", cuda_build=None)
MISMATCH = CudaView(available=False, device_count=0, torch_version="2.13.0+cu128", cuda_build="12.8",
                    hint="/dev/nvidia0 exists")
FOUR = CudaView(available=True, device_count=4, torch_version="2.13.0+cu128", cuda_build="12.8",
                hint="/dev/nvidia0 exists")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens where torch sees no GPU")


# ------------------------------------------------------------------------------ the node's evidence

def test_nvidia_hint_names_the_device_file_the_drivers_gpus_or_the_visible_devices(tmp_path):
    dev, driver = tmp_path / "dev", tmp_path / "gpus"
    dev.mkdir()
    assert devices.nvidia_hint(dev, {}, driver) is None
    # what a CUDA base image carries on a CPU node is no evidence (it would fail every CPU run there)
    assert devices.nvidia_hint(dev, {"NVIDIA_VISIBLE_DEVICES": "all"}, driver) is None
    assert devices.nvidia_hint(dev, {"CUDA_VISIBLE_DEVICES": "0,1"}, driver) == "CUDA_VISIBLE_DEVICES=0,1 is set"
    (driver / "0000:3b:00.0").mkdir(parents=True)
    assert devices.nvidia_hint(dev, {}, driver) == f"the NVIDIA driver lists GPUs in {driver}"
    (dev / "nvidia0").touch()
    assert devices.nvidia_hint(dev, {}, driver) == f"{dev / 'nvidia0'} exists"
    # GPUs hidden on purpose are no evidence, whatever else the node shows
    for hidden in ("", "-1"):
        assert devices.nvidia_hint(dev, {"CUDA_VISIBLE_DEVICES": hidden}, driver) is None


# -------------------------------------------------------------------------------- picking a device

def test_auto_trains_on_the_cpu_only_where_the_node_shows_no_gpu():
    assert devices.pick_device("auto", 0, NO_GPU) == torch.device("cpu")
    assert devices.pick_device("cpu", 3, MISMATCH) == torch.device("cpu")  # the documented override
    with pytest.raises(DeviceError) as info:
        devices.pick_device("auto", 0, MISMATCH)
    text = str(info.value)
    assert "/dev/nvidia0 exists" in text and "CUDA 12.8" in text and "--device cpu" in text and "\n" not in text


def test_cuda_without_cuda_names_the_torch_build():
    with pytest.raises(DeviceError, match=r"--device cuda .*\(torch 2.13.0\+cpu is a CPU-only build\)"):
        devices.pick_device("cuda", 0, NO_GPU)


def test_each_local_rank_gets_its_own_gpu_and_one_without_a_gpu_is_an_error():
    assert [devices.pick_device("auto", r, FOUR) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert devices.pick_device("cuda", 2, FOUR) == torch.device("cuda", 2)
    with pytest.raises(DeviceError, match="local rank 4 has no GPU of its own: torch sees 4 .*--nproc-per-node 4"):
        devices.pick_device("cuda", 4, FOUR)  # was cuda:0 again (4 % 4): two ranks on one GPU
    with pytest.raises(DeviceError, match="5 workers on this node need 5 GPUs, one each, but torch sees 4"):
        devices.check_local_ranks(5, 4)
    devices.check_local_ranks(4, 4)
    with pytest.raises(DeviceError, match="use --nproc-per-node 2"):
        devices.check_local_ranks(8, 2)


def test_nproc_per_node_gpu_without_a_gpu_is_an_error():
    assert devices.nproc_per_node("gpu", FOUR) == devices.nproc_per_node("auto", FOUR) == 4
    assert devices.nproc_per_node("auto", NO_GPU) == devices.nproc_per_node("cpu", FOUR) == 1
    with pytest.raises(DeviceError, match="--nproc-per-node gpu: torch sees no GPU .*the node shows /dev/nvidia0"):
        devices.nproc_per_node("gpu", MISMATCH)
    with pytest.raises(DeviceError, match="CPU-only build"):
        devices.nproc_per_node("gpu", NO_GPU)


def test_backend_follows_the_device():
    assert devices.backend_for(torch.device("cuda", 1)) == "nccl"
    assert devices.backend_for(torch.device("cpu")) == "gloo"


# ------------------------------------------------------------------------------------------ precision

def test_amp_plans():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert devices.amp_plan("off", cuda) == devices.AmpPlan(None, False)
    assert devices.amp_plan("fp16", cuda) == devices.AmpPlan(torch.float16, True)
    assert devices.amp_plan("bf16", cuda) == devices.AmpPlan(torch.bfloat16, False)  # no scaler
    assert devices.amp_plan("bf16", cpu) == devices.AmpPlan(torch.bfloat16, False)  # CPU autocast
    with pytest.raises(DeviceError, match="--amp fp16 needs CUDA"):
        devices.amp_plan("fp16", cpu)
    with pytest.raises(DeviceError, match="no native bfloat16 .* use --amp fp16"):
        devices.amp_plan("bf16", cuda, bf16_supported=False)


def test_amp_flag_values_are_checked_by_the_config():
    assert TrainConfig(amp="bf16", device="cpu").amp == "bf16"
    with pytest.raises(ValueError, match="--amp fp16 needs CUDA"):
        TrainConfig(amp="fp16", device="cpu")
    with pytest.raises(ValueError, match="--amp must be off, bf16 or fp16, got 'on'"):
        TrainConfig(amp="on")


def _scaler_step(grad_value: float) -> tuple[float, float]:
    """One real GradScaler step (torch's CPU scaler) with every gradient set to ``grad_value``;
    returns the scale before and after ``update()``."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    for p in model.parameters():
        p.grad.fill_(grad_value)
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return before, scaler.get_scale()


def test_a_step_the_scaler_skipped_is_told_by_its_scale():
    assert devices.scaler_skipped_step(*_scaler_step(float("inf")))  # inf gradients: skipped, scale halved
    assert not devices.scaler_skipped_step(*_scaler_step(1.0))
    assert not devices.scaler_skipped_step(1024.0, 2048.0)  # growth after a run of good steps


def test_tf32_switches_cublas_and_cudnn_for_a_cuda_device():
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:  # the flags are process settings: setting them needs no GPU
        devices.set_tf32(torch.device("cuda", 0), True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        devices.set_tf32(torch.device("cuda", 0), False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def test_tf32_is_left_alone_on_the_cpu():
    before = torch.get_float32_matmul_precision()
    devices.set_tf32(torch.device("cpu"), True)
    devices.set_tf32(torch.device("cpu"), False)
    assert torch.get_float32_matmul_precision() == before


# ----------------------------------------------------------------------------------- the first line

def test_banner_names_device_backend_and_nccl_version():
    assert devices.banner("cpu", "gloo", "2.13.0+cpu") == "device cpu, backend gloo, torch 2.13.0+cpu"
    line = devices.banner("cuda:0", "nccl", "2.13.0+cu128", "12.8", "2.27.3", "NVIDIA H200, capability 9.0")
    assert line == ("device cuda:0 (NVIDIA H200, capability 9.0), backend nccl (NCCL 2.27.3), "
                    "torch 2.13.0+cu128 (CUDA 12.8)")
    assert devices.describe(torch.device("cpu"), "gloo") == f"device cpu, backend gloo, torch {torch.__version__}"


def test_the_first_line_of_a_run_names_device_and_backend(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "ELASTIC_"))}
    proc = subprocess.run([sys.executable, "-m", "elastic_trainer.train", "--task", "tests.helpers.task_fixture:build",
                           "--global-batch-size", "8", "--max-steps", "1", "--device", "cpu", "--no-wandb",
                           "--no-progress", "--log-dir", str(tmp_path / "l"), "--checkpoint-dir", ""],
                          cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[elastic-trainer]")]
    assert lines[0] == f"[elastic-trainer] device cpu, backend none (single process), torch {torch.__version__}, amp off"


# ----------------------------------------------------------------- never silently on the CPU: launcher

@pytest.fixture
def nothing_launched(monkeypatch):
    def run_node(run):
        raise AssertionError(f"launched {run.program} despite a device it cannot use")
    monkeypatch.setattr(launch, "run_node", run_node)


@needs_no_cuda
@pytest.mark.parametrize("argv, env, expected", [
    (["--nproc-per-node", "gpu"], {}, "--nproc-per-node gpu: torch sees no GPU"),
    (["--", "--device", "auto"], {"CUDA_VISIBLE_DEVICES": "0"},
     "--device auto: this node has NVIDIA GPUs (CUDA_VISIBLE_DEVICES=0 is set)"),
    (["--", "--device", "cuda"], {}, "--device cuda was asked for but torch sees no CUDA device"),
    (["--", "--amp", "fp16"], {"CUDA_VISIBLE_DEVICES": ""}, "--amp fp16 needs CUDA"),
])
def test_launcher_refuses_a_device_this_node_cannot_run(argv, env, expected, tmp_path, capsys, monkeypatch,
                                                        nothing_launched):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "l"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("elastic-train: error:") and expected in err, err


@needs_no_cuda
def test_the_device_is_checked_before_etcd_so_a_gpu_node_that_cannot_reach_etcd_either_is_told_about_its_gpus(
        tmp_path, capsys, nothing_launched):
    """A GPU pod whose GPUs torch cannot use and whose etcd does not answer (a closed loopback
    port here): the one line names the device, the cause that a restart would not fix."""
    from elastic_trainer.etcd.server import free_port

    argv = ["--rdzv-endpoint", f"127.0.0.1:{free_port('127.0.0.1')}", "--checkpoint-dir", str(tmp_path / "ck"),
            "--log-dir", str(tmp_path / "l"), "--", "--device", "cuda"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cuda was asked for but torch sees no CUDA device" in err, err


@needs_no_cuda
def test_worker_refuses_auto_on_a_gpu_node_torch_cannot_use(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "ELASTIC_"))}
    proc = subprocess.run([sys.executable, "-m", "elastic_trainer.train", "--task", "tests.helpers.task_fixture:build",
                           "--max-steps", "1", "--no-wandb", "--log-dir", str(tmp_path / "l"), "--checkpoint-dir", ""],
                          cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "0"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "l" / "steps").exists()
    assert "--device auto: this node has NVIDIA GPUs (CUDA_VISIBLE_DEVICES=0 is set)" in proc.stderr


# ------------------------------------------------------------------------------------------ step times

def test_host_timer_measures_the_step_on_the_cpu():
    timer = devices.step_timer(torch.device("cpu"))
    before = time.perf_counter()
    timer.start()
    time.sleep(0.05)
    took = timer.stop()
    around = time.perf_counter() - before
    # in seconds, the step and no more: at least the sleep, at most the time measured around it
    assert took.ready() and 0.05 <= took.seconds() <= around, (took.seconds(), around)


def test_agreement_interval_follows_the_slower_of_host_and_device():
    assert agree_interval(0.01) == 20 and agree_interval(0.0) == 1 and agree_interval(1e-6) == 32
    # CUDA: the host queued the step in 1 ms, the GPU took 100 ms: agree every 2 steps, not 32
    assert agree_interval(0.001, 0.1) == 2
    assert agree_interval(0.05, 0.001) == 4  # a host-bound step keeps the host's cycle


def test_snapshot_waits_for_the_states_own_gpus_only():
    assert cuda_devices([torch.zeros(2), torch.ones(1)]) == []


# ------------------------------------------------------------------------------------- failures, NCCL

def test_a_failed_collective_is_recognised_on_any_backend():
    assert collective_failed(torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0"))
    assert collective_failed(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1935, remote process exited"))
    assert collective_failed(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not collective_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not collective_failed(ValueError("nccl"))


def test_no_save_after_a_failed_collective_on_cuda_where_the_gpu_may_be_steps_ahead():
    assert host_step_is_device_state(torch.device("cpu"))
    assert not host_step_is_device_state(torch.device("cuda", 0))
