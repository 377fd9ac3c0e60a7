"""The CUDA paths, on a GPU: ``pytest -m gpu`` (skipped, saying why, where torch sees no GPU).

    .venv/bin/python -m pytest -q -m gpu tests/test_gpu.py
    bash launch/gpu-check          # on a GPU machine: these, the rendezvous tests and the GPU benchmarks

One GPU is enough for most of them (world size 1 with NCCL, AMP fp16 and bf16, TF32, CUDA step
times, the snapshot of a CUDA state and its prepared page-locked memory, the profiler, a live
NCCL group that aborts without ending the process); with two or more, the device-binding tests
also use a GPU that is not the current one, and the multi-GPU paths run (an NCCL error from a
peer that is gone reaching the training thread, the live re-form over NCCL, the state sent to a
newcomer on the device, FSDP across GPUs); with fewer they are skipped, saying why. The same
decisions are tested on the CPU in ``tests/test_devices.py``, ``tests/test_live_recovery.py``
and ``tests/test_host_memory.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_trainer import devices
from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.checkpoint.host_memory import cuda_devices
from elastic_trainer.checkpoint.snapshot import Snapshotter
from elastic_trainer.config import TrainConfig
from elastic_trainer.etcd.server import free_port
from elastic_trainer.flags import parse_train_config
from elastic_trainer.training.trainer import Trainer
from elastic_trainer.training.worker import setup_distributed
from elastic_trainer import records
from tests.helpers.common import DIST_ENV, REPO, cli_cmd, wait_until
from tests.helpers.runs import FIXTURE

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason=f"needs 2 GPUs, torch sees {torch.cuda.device_count()}: the multi-GPU paths")

GPU_TASK = "tests.helpers.gpu_task:build"


@pytest.fixture(autouse=True)
def _single_process_matmul_precision_restored(single_process_env):
    """One process (conftest's ``single_process_env``), and torch's float32 matmul settings put back."""
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
    from elastic_trainer.etcd.server import EtcdError, find_etcd_binary

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



def test_the_first_save_copies_into_memory_prepared_and_page_locked_before_it(tmp_path):
    """The snapshot's host memory is made (page-locked) on a background thread after the first
    step; the first save then only copies, as fast as the later ones (issue 28: it blocked 0.6-0.7 s
    for a 2 GB state while it page-locked a new buffer)."""
    device = torch.device("cuda", 0)
    state = {"w": torch.randn(64 << 20, device=device)}  # 256 MiB
    ckpt = CheckpointManager(str(tmp_path / "ck"), keep_checkpoints=1)
    ckpt.prepare(state)
    time.sleep(1.0)  # training steps meanwhile (0.37 s a GB to page-lock on an H100)
    blocked = []
    for step in (1, 2):
        ckpt.wait()
        blocked.append(ckpt.save(step, state))
        if step == 1:  # laid out in the prepared buffer, ready by then
            assert ckpt.last_save_stats["host_buffer_wait_s"] < 0.05, ckpt.last_save_stats
    ckpt.close()
    assert ckpt.last_save_stats["committed"]
    assert blocked[0] < max(3 * blocked[1], 0.05), blocked  # the first is a steady one


# ---------------------------------------------------------------------------------------- NCCL, live

_NCCL_PROBE = textwrap.dedent("""
    import datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    from elastic_trainer.training.manager import nccl_error_handling

    mode, rank, world = sys.argv[1], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    value = nccl_error_handling()  # what the Manager does before making the live group
    print("handling", value, flush=True)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)

    def group():
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                                timeout=datetime.timedelta(seconds=120 if mode == "hang" else 10),
                                store=dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0)
                                if world > 1 else dist.HashStore())
    group()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize(dev)
    print("reduced", t.tolist(), flush=True)
    if rank == 1:  # the peer that is gone, or (hang) alive with its connections open but never entering
        if mode == "hang":
            time.sleep(30)
            os._exit(0)
        os.kill(os.getpid(), 9)
    if mode == "abort":  # the live watcher's way (Trainer's on_member_lost): abort from another thread
        threading.Timer(3.0, dist.group.WORLD.abort).start()
    if mode == "hang":  # what the watcher calls on a lease expiry or a declared stall
        from elastic_trainer.training.abandon import GroupAbandon
        threading.Timer(3.0, GroupAbandon("nccl").abandon, args=("test",)).start()
    started = time.monotonic()
    try:
        for _ in range(10 ** 6 if world > 1 else 1):
            dist.all_reduce(t)
            torch.cuda.synchronize(dev)
            if world == 1:
                time.sleep(4)  # the abort comes meanwhile
                dist.all_reduce(t)
                torch.cuda.synchronize(dev)
        print("no error", flush=True)
    except Exception as exc:
        print("raised", type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "", flush=True)
        print(f"after {time.monotonic() - started:.1f}", flush=True)
    try:
        dist.destroy_process_group()
    except Exception as exc:
        print("destroy:", type(exc).__name__, flush=True)
    if world == 1:  # the live re-form: a new group on the same GPU, in the same process
        group()
        t = torch.ones(4, device=dev)
        dist.all_reduce(t)
        torch.cuda.synchronize(dev)
        print("re-formed", t.tolist(), flush=True)
        dist.destroy_process_group()
    print("alive", flush=True)
""")


def _nccl_probe(tmp_path: Path, mode: str, world: int) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "nccl_probe.py"
    script.write_text(_NCCL_PROBE)
    port = str(free_port())
    env = {k: v for k, v in _clean_env().items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    procs = [subprocess.Popen([sys.executable, str(script), mode], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "WORLD_SIZE": str(world),
                                                             "LOCAL_RANK": str(r), "MASTER_PORT": port})
             for r in range(world)]
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return out


def test_a_one_rank_nccl_group_made_the_live_way_aborts_without_ending_the_process_and_re_forms(tmp_path):
    """The live path's NCCL group (clean-up-only error handling, bound to its device): aborted from
    another thread, as the watcher does on a lost member, the next collective raises on the
    training thread, the process lives, and a new group forms on the same GPU."""
    (rank0,) = _nccl_probe(tmp_path, "abort", 1)
    assert rank0.returncode == 0, rank0.stdout[-3000:]
    lines = rank0.stdout.splitlines()
    assert "handling 2" in lines and "reduced [1.0, 1.0, 1.0, 1.0]" in lines, rank0.stdout[-3000:]
    assert any(ln.startswith("raised ") for ln in lines), rank0.stdout[-3000:]
    assert "re-formed [1.0, 1.0, 1.0, 1.0]" in lines and lines[-1] == "alive", rank0.stdout[-3000:]


@pytest.mark.slow
def test_a_worker_under_elastic_train_sees_nccl_clean_up_only(tmp_path):
    """torchrun's agent puts TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear the process down) into every
    worker's environment unless its own has a value; under elastic-train (live recovery, the
    default) the worker must see 2, clean up only, so that an NCCL error leaves its process alive."""
    from elastic_trainer.etcd.server import EtcdError, find_etcd_binary

    try:
        find_etcd_binary()
    except EtcdError as exc:
        pytest.skip(f"no etcd binary: {exc}")
    seen = tmp_path / "seen.json"
    task = tmp_path / "env_task.py"
    task.write_text(textwrap.dedent(f"""
        import json, os
        from tests.helpers.task_fixture import build as fixture

        def build(args):
            with open({str(seen)!r}, "w") as f:
                json.dump({{"value": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}}, f)
            return fixture(args)
    """))
    env = {k: v for k, v in _clean_env().items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    proc = subprocess.run(cli_cmd("--nproc-per-node", "1", "--run-id", "gpu-nccl-env", "--log-dir", str(tmp_path / "l"),
                                  "--checkpoint-dir", str(tmp_path / "ck"), "--", "--task", f"{task}:build",
                                  "--device", "cuda", "--global-batch-size", "16", "--max-steps", "3",
                                  "--no-wandb", "--no-progress"),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(seen.read_text())["value"] == "2", proc.stderr[-4000:]
    assert "falls back to restarting" not in proc.stderr


@needs_two_gpus
@pytest.mark.parametrize("mode", ["timeout", "abort"])
def test_an_nccl_error_from_a_peer_that_is_gone_reaches_the_training_thread_and_the_process_lives(tmp_path, mode):
    """Two ranks over NCCL made the live way; rank 1 is SIGKILLed. Rank 0's next collectives end in
    an exception on its training thread, by the watchdog's timeout or by the watcher's abort, and
    the process goes on (torch's default error handling would have ended it)."""
    rank0, rank1 = _nccl_probe(tmp_path, mode, 2)
    assert rank1.returncode == -signal.SIGKILL, rank1.stdout[-2000:]
    assert rank0.returncode == 0, rank0.stdout[-3000:]
    lines = rank0.stdout.splitlines()
    assert "handling 2" in lines and any(ln.startswith("raised ") for ln in lines), rank0.stdout[-3000:]
    assert lines[-1] == "alive", rank0.stdout[-3000:]


@needs_two_gpus
def test_abandoning_an_nccl_group_ends_a_collective_hung_on_a_silent_peer(tmp_path):
    """Rank 1 stays alive with its connections open but never enters the next all-reduce (a hung
    or frozen peer: nothing fails by itself until the 120 s timeout). ``GroupAbandon.abandon()``,
    what the live watcher calls on a lease expiry or a declared stall, ends rank 0's hung
    collective with an exception on its training thread within seconds, and the process lives."""
    rank0, rank1 = _nccl_probe(tmp_path, "hang", 2)
    assert rank0.returncode == 0, rank0.stdout[-3000:]
    lines = rank0.stdout.splitlines()
    assert any(ln.startswith("raised ") for ln in lines), rank0.stdout[-3000:]
    after = float(next(ln for ln in lines if ln.startswith("after ")).split()[1])
    assert after < 20, f"the hung collective ended {after:.1f}s after it began (the abort came at 3 s)"
    assert lines[-1] == "alive", rank0.stdout[-3000:]


_SEND_STATE = textwrap.dedent("""
    import datetime, os
    import torch, torch.distributed as dist
    from elastic_trainer.training.manager import nccl_error_handling, send_state

    rank = int(os.environ["RANK"])
    nccl_error_handling()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev, timeout=datetime.timedelta(seconds=60))
    gen = torch.Generator().manual_seed(5)
    want = {"model": {"w": torch.randn(1024, 1024, generator=gen), "b": torch.arange(7.0)}, "meta": {"step": 12}}
    state = {"model": {k: v.to(dev) for k, v in want["model"].items()}, "meta": want["meta"]} if rank == 0 else None
    got = send_state(state, 0, (1,), dev)
    if rank == 1:
        same = all(torch.equal(got["model"][k], v) for k, v in want["model"].items()) and got["meta"] == want["meta"]
        print("received", "equal" if same else "DIFFERENT", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


@needs_two_gpus
def test_the_live_state_goes_to_a_newcomer_over_nccl_from_the_device(tmp_path):
    script = tmp_path / "send_state.py"
    script.write_text(_SEND_STATE)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=_clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "received equal" in outs[1], outs[1][-3000:]


@needs_two_gpus
@pytest.mark.slow
def test_live_recovery_over_nccl_keeps_the_survivor_and_sends_the_newcomer_the_state(tmp_path):
    """elastic-train on two GPUs (live recovery, the default): one worker SIGKILLed mid-run; the
    survivor keeps its process (one step log across the re-form), the restarted worker gets the
    state from it over NCCL, and the run finishes."""
    from elastic_trainer.etcd.server import EtcdError, find_etcd_binary

    try:
        find_etcd_binary()
    except EtcdError as exc:
        pytest.skip(f"no etcd binary: {exc}")
    logs = tmp_path / "l"
    env = {k: v for k, v in _clean_env().items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    with open(tmp_path / "out.log", "w") as out:
        agent = subprocess.Popen(cli_cmd("--nproc-per-node", "2", "--run-id", "gpu-live", "--log-dir", str(logs),
                                         "--checkpoint-dir", str(tmp_path / "ck"), "--", "--task", FIXTURE,
                                         "--device", "cuda", "--global-batch-size", "16", "--max-steps", "80",
                                         "--sleep-per-step", "0.1", "--no-wandb", "--no-progress"),
                                 cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def steps() -> list[tuple[int, int, int]]:  # (rank, pid, step)
            return [(f.rank, f.pid, rec.step) for f in records.step_files(logs)
                    for rec in records.read_file(f.path, records.StepRecord)]
        before = wait_until(steps, 180, "20 steps on 2 GPUs", until=lambda st: max((s for *_, s in st), default=0) >= 20)
        pids = {rank: pid for rank, pid, _ in before}
        os.kill(pids[1], signal.SIGKILL)
        assert agent.wait(timeout=240) == 0, (tmp_path / "out.log").read_text()[-5000:]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    after = steps()
    assert max(step for *_, step in after) == 80
    survivor = [step for rank, pid, step in after if pid == pids[0]]
    assert min(survivor) <= 20 and max(survivor) == 80  # one process from before the kill to the end
    events = [e.event for e in records.read_events(logs)]
    assert "live_reform" in events and "peer_state_loaded" in events, events


@needs_two_gpus
@pytest.mark.slow
def test_fsdp_on_two_gpus_saves_sharded_and_resumes_resharded_on_one(tmp_path):
    base = ["--task", FIXTURE, "--device", "cuda", "--fsdp", "--global-batch-size", "16", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "l"), "--no-wandb", "--no-progress"]

    def run(nproc: int, steps: int) -> str:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), "-m", "elastic_trainer.train", *base, "--max-steps", str(steps)],
                              cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stderr
    first = run(2, 4)
    assert "world size 2" in first and "backend nccl" in first
    again = run(1, 6)
    assert "resumed from checkpoint step-4" in again
    state = CheckpointManager(str(tmp_path / "ck")).load()[1]
    assert state["meta"]["world_size"] == 1 and "sharded" in state


def test_sharded_staging_of_cuda_shards_copies_into_prepared_page_locked_memory():
    """--fsdp's staging: DTensors around CPU views of one prepared, page-locked buffer (the same
    mesh and placements as the shards), each view's storage exactly its bytes (DCP writes it as
    it is), the values those of the stage."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from elastic_trainer.checkpoint.sharded import Staging

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(4, 1024, device=device)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        staging = Staging()
        assert staging.prepare(state)
        staging.host.wait()
        staged = staging.stage(state)
        assert staging.host.allocations == 1 and staging.host.pinned
        w, got = state["model"]["0.weight"], staged["model"]["0.weight"]
        assert isinstance(got, DTensor) and got.device_mesh == w.device_mesh and got.placements == w.placements
        local = got.to_local()
        assert local.device.type == "cpu" and local.untyped_storage().size() == local.nbytes
        assert torch.equal(local, w.to_local().cpu())
        staging.close()
    finally:
        dist.destroy_process_group()
