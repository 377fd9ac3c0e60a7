"""The trainer on one process: flags, user tasks, exact resume, SIGTERM, W&B run id, AMP, profiler.

Runs in-process where that is enough (fast), as real ``python -m elastic_trainer.train``
processes where the behaviour is about processes (signals, the entry point, W&B files).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elastic_trainer import records
from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.checkpoint.sharded import gathered
from elastic_trainer.records import Event, StepRecord
from elastic_trainer.flags import parse_train_config
from elastic_trainer.config import TrainConfig
from elastic_trainer.training.trainer import Trainer
from elastic_trainer.etcd.server import free_port
from tests.helpers.common import REPO, assert_same_state, wait_until
from tests.helpers.runs import FIXTURE, TINY, latest, param_drift
from tests.helpers.wandb_records import exit_code, record_kinds

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("single_process_env")]

SEEDS = ["--example", "seeds", "--src-len", "2", "--tgt-len", "4"]  # after TINY: the seeds' workload
STEP_KEYS = {"time", "step", "epoch", "offset", "world_size", "rank", "round", "restart", "loss", "node"}


def train_inprocess(*argv: str) -> dict:
    return Trainer(parse_train_config([*argv, "--no-wandb", "--no-progress"])).train()


def worker_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "elastic_trainer.train", *argv]


# ------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, message", [
    ({"global_batch_size": 0}, "--global-batch-size must be a positive number"),
    ({"micro_batch_size": -1}, "--micro-batch-size must be a positive number"),
    ({"checkpoint_every": 5}, "need --checkpoint-dir"),
    ({"task": "no_colon"}, "must look like package.module:build"),
    ({"device": "tpu"}, "--device must be auto, cpu or cuda"),
    ({"num_workers": -1}, "--num-workers must be 0 or more"),
])
def test_config_rejects_bad_values_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_config_defaults_to_one_epoch_and_env_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIC_TRAINER_CHECKPOINT_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("ELASTIC_TRAINER_LOG_DIR", str(tmp_path / "logs"))
    config = parse_train_config([])
    assert config.epochs == 1 and config.max_steps is None
    assert config.checkpoint_dir == str(tmp_path / "ck") and config.log_dir == str(tmp_path / "logs")


def test_unknown_flags_go_to_a_user_task_and_are_refused_without_one(capsys):
    config = parse_train_config(["--task", FIXTURE, "--noise", "0", "--max-steps", "2"])
    assert config.task_args.task_argv == ["--noise", "0"] and config.max_steps == 2
    with pytest.raises(SystemExit):
        parse_train_config(["--noise", "0"])
    assert "unrecognized arguments: --noise 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- tasks

def test_default_example_learns_to_reverse_token_sequences(tmp_path):
    """The default example has something to learn: its loss falls far below the first step's."""
    train_inprocess("--d-model", "32", "--dim-feedforward", "64", "--layers", "1", "--src-len", "4",
                    "--vocab-size", "8", "--lr", "1e-2", "--global-batch-size", "16", "--max-steps", "40",
                    "--log-dir", str(tmp_path / "logs"))
    losses = [s.loss for s in records.read_steps(tmp_path / "logs", rank=0)]
    assert len(losses) == 40
    assert losses[0] > 1.5, "a fresh model guesses among 7 tokens: about ln 7"
    assert losses[-1] < losses[0] / 4, f"the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"


@pytest.mark.parametrize("flags, message", [
    (["--loss", "mse"], "--loss applies to --example seeds only"),
    (["--example", "copy", "--data", "h5:x.h5"], "--data h5:x.h5 applies to --example seeds only"),
    (["--vocab-size", "2"], "--vocab-size 2 is too small"),
])
def test_example_flags_that_do_not_fit_the_example_are_refused_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_train_config(flags)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    parse_train_config(["--example", "seeds", "--loss", "mse"])  # the seeds' workload keeps its flags


def test_seeds_example_is_the_seed_scripts_transformer_on_random_floats():
    from elastic_trainer.tasks import build_example

    task = build_example(parse_train_config(["--example", "seeds", "--dataset-size", "8"]).task_args)
    assert isinstance(task.model, torch.nn.Transformer)
    src, tgt = task.dataset[0]
    assert src.shape == (16, 128) and tgt.shape == (20, 128) and src.dtype == torch.float32


def test_task_from_a_test_file_runs_through_the_task_flag(tmp_path):
    """As a world of one that joins a gloo process group (RANK/WORLD_SIZE/MASTER_* as torchrun sets them)."""
    marker = tmp_path / "built.json"
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        worker_cmd("--task", FIXTURE, "--max-steps", "3", "--global-batch-size", "16", "--no-wandb",
                   "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ck"),
                   "--marker", str(marker)),
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 1 (distributed gloo, cpu)" in proc.stderr
    assert json.loads(marker.read_text()) == {"task_argv": ["--marker", str(marker)], "global_batch_size": 16}
    steps = records.read_steps(tmp_path / "logs", rank=0)
    assert [s.step for s in steps] == [1, 2, 3]
    assert set(steps[0].to_json()) == STEP_KEYS and not steps[0].extra
    assert steps[-1].offset == 48 and steps[-1].world_size == 1
    events = [e.event for e in records.read_events(tmp_path / "logs")]
    assert events[0] == Event.START and Event.CHECKPOINT_SAVED in events and events[-1] == Event.FINISHED
    step, saved = latest(tmp_path / "ck")
    assert step == 3 and re.fullmatch(r"[a-z0-9]{8}", saved["meta"]["wandb_run_id"])  # W&B's form, W&B off
    assert "finished at step 3" in proc.stderr


def test_h5_variant_of_the_example_trains_exactly_like_the_in_memory_data(tmp_path):
    from elastic_trainer.training.data import write_synthetic_h5

    write_synthetic_h5(tmp_path / "d.h5", 256, (2, 16), (4, 16), seed=0)
    for name, data in (("mem", []), ("h5", ["--data", f"h5:{tmp_path / 'd.h5'}"])):
        train_inprocess(*TINY, *SEEDS, *data, "--max-steps", "3", "--global-batch-size", "16",
                        "--checkpoint-dir", str(tmp_path / name), "--log-dir", str(tmp_path / f"log-{name}"))
    assert_same_state(latest(tmp_path / "mem")[1]["model"], latest(tmp_path / "h5")[1]["model"])


# ------------------------------------------------------------------------------------- resume

def test_resume_restores_optimizer_scheduler_step_and_rng_exactly(tmp_path):
    common = ["--task", FIXTURE, "--global-batch-size", "32", "--micro-batch-size", "8", "--checkpoint-every", "4"]
    full = train_inprocess(*common, "--max-steps", "10", "--checkpoint-dir", str(tmp_path / "a"),
                           "--log-dir", str(tmp_path / "la"))
    first = train_inprocess(*common, "--max-steps", "6", "--checkpoint-dir", str(tmp_path / "b"),
                            "--log-dir", str(tmp_path / "lb"))
    assert first["step"] == 6
    torch.manual_seed(999)  # whatever this process did in between must not matter
    resumed = train_inprocess(*common, "--max-steps", "10", "--checkpoint-dir", str(tmp_path / "b"),
                              "--log-dir", str(tmp_path / "lb"))
    assert resumed["step"] == full["step"] == 10
    step_a, a = latest(tmp_path / "a")
    step_b, b = latest(tmp_path / "b")
    assert step_a == step_b == 10
    for key in ("model", "optimizer", "scheduler", "rng", "sampler"):
        assert_same_state(a[key], b[key], key)
    assert a["optimizer"]["state"][0]["step"].item() == 10  # AdamW's own step counter came back too
    assert resumed["loss"] == full["loss"]
    events = [e.event for e in records.read_events(tmp_path / "lb")]
    assert Event.RESUME in events and events.count(Event.START) == 1  # a resume is no start


def test_gradient_accumulation_matches_one_pass_over_the_global_batch(tmp_path):
    for name, extra in (("one", []), ("acc", ["--micro-batch-size", "5"])):
        train_inprocess(*TINY, "--max-steps", "4", "--global-batch-size", "16", *extra,
                        "--checkpoint-dir", str(tmp_path / name), "--log-dir", str(tmp_path / f"l{name}"))
    one, acc = latest(tmp_path / "one")[1]["model"], latest(tmp_path / "acc")[1]["model"]
    worst, gauge = param_drift(one, acc)
    assert worst < 1e-6, f"accumulated micro-batches drift from one pass by {worst}"
    assert gauge <= 4 * 1e-3 * 1.01  # key biases: at most lr per step (see param_drift)


def test_each_step_is_in_the_ledger_before_its_backward_all_reduces_it(tmp_path):
    """A peer killed right after a step's gradient all-reduce must already have logged that step,
    since rank 0 may save it: the ledger line is written before the last micro-batch's backward."""
    from elastic_trainer.tasks import Task

    log_dir = tmp_path / "logs"
    seen = []  # the newest step in the ledger as each micro-batch's forward starts

    def training_step(model, batch):
        rows = records.read_ledger(log_dir, rank=0)
        seen.append(max((r.step for r in rows), default=0))
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    task = Task(model=torch.nn.Linear(4, 1), dataset=data, training_step=training_step)
    config = parse_train_config(["--max-steps", "3", "--global-batch-size", "8", "--micro-batch-size", "4",
                           "--log-dir", str(log_dir), "--sample-ledger", "--no-wandb", "--no-progress"])
    Trainer(config, task).train()
    # two micro-batches a step: the first runs before the step's line is written, the last after it
    assert seen == [0, 1, 1, 2, 2, 3]
    rows = records.read_ledger(log_dir, rank=0)
    assert [r.step for r in rows] == [1, 2, 3] and all(len(r.indices) == 8 for r in rows)


def test_no_resume_starts_from_scratch(tmp_path):
    args = ["--task", FIXTURE, "--global-batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck"),
            "--log-dir", str(tmp_path / "l")]
    train_inprocess(*args, "--max-steps", "2")
    again = train_inprocess(*args, "--max-steps", "3", "--no-resume")
    assert again["step"] == 3
    assert [e.event for e in records.read_events(tmp_path / "l")].count(Event.START) == 2


# ------------------------------------------------------------------------------------- processes

def _wait_for_steps(log_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 90) -> list[StepRecord]:
    def steps_of_a_running_trainer() -> list[StepRecord]:
        steps = records.read_steps(log_dir)
        assert len(steps) >= count or proc.poll() is None, f"trainer exited early with {proc.returncode}"
        return steps

    return wait_until(steps_of_a_running_trainer, timeout, f"{count} steps in {log_dir}",
                      until=lambda steps: len(steps) >= count)


def test_sigterm_during_training_saves_the_current_step_and_exits_zero(tmp_path, procs):
    log_dir, ck = tmp_path / "logs", tmp_path / "ck"
    proc = procs.start(worker_cmd("--task", FIXTURE, "--max-steps", "10000", "--global-batch-size", "16",
                                  "--sleep-per-step", "0.2", "--checkpoint-dir", str(ck), "--checkpoint-every", "1000",
                                  "--log-dir", str(log_dir), "--no-wandb", "--grace-seconds", "30"),
                       cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(log_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    last = records.read_steps(log_dir)[-1].step
    step, state = latest(ck)
    assert step == last and state["meta"]["step"] == last
    assert state["sampler"]["offset"] == 16 * last
    events = records.read_events(log_dir)
    assert any(e.event == Event.STOP and e.reason == "signal SIGTERM" for e in events)
    assert f"stopping at step {last} (signal SIGTERM)" in err


def test_sigterm_while_a_step_hangs_exits_after_the_grace_period(tmp_path, procs):
    log_dir, tmp = tmp_path / "logs", tmp_path / "tmp"
    tmp.mkdir()
    proc = procs.start(worker_cmd("--task", FIXTURE, "--max-steps", "100", "--global-batch-size", "16",
                                  "--sleep-per-step", "60", "--checkpoint-dir", str(tmp_path / "ck"),
                                  "--log-dir", str(log_dir), "--no-wandb", "--grace-seconds", "2"),
                       cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    # step 1 and its agreement are over (its line is written at the agreement): the rank is in its
    # 60 s of work, far from the next boundary. (Signalled before that agreement, it would stop there
    # and save cleanly, exit 0: a loaded machine can take longer than a fixed wait for the first step.)
    wait_until(lambda: len(records.read_steps(log_dir)) >= 1, 90, "the trainer's first step")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - sent < 30
    assert "grace period of 2s over" in err
    # ended without the interpreter's teardown, and without W&B: nothing of wandb's left in its temp dir
    # (wandb's import makes folders there that only a teardown removes)
    assert _left_in(tmp) == []


def _offline_run_ids(log_dir: Path) -> list[str]:
    runs = sorted((log_dir / "wandb").glob("offline-run-*"))
    return [p.name.rsplit("-", 1)[1] for p in runs]


def test_wandb_run_id_after_a_restart_equals_the_first(tmp_path):
    env = _wandb_env(tmp_path / "tmp")
    args = ["--task", FIXTURE, "--global-batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck"),
            "--log-dir", str(tmp_path / "logs"), "--no-progress"]
    for steps in ("2", "4"):
        proc = subprocess.run(worker_cmd(*args, "--max-steps", steps), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ids = _offline_run_ids(tmp_path / "logs")
    assert len(ids) == 2 and ids[0] == ids[1], ids
    assert latest(tmp_path / "ck")[1]["meta"]["wandb_run_id"] == ids[0]
    # the offline run's own files name the id too (what `wandb sync` uploads)
    run_dir = sorted((tmp_path / "logs" / "wandb").glob("offline-run-*"))[1]
    assert (run_dir / f"run-{ids[0]}.wandb").exists()
    # a run that finished is a success to W&B: exit code 0, never marked preempting
    for path in (tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb"):
        assert exit_code(path) == 0 and "preempting" not in record_kinds(path)
    assert _left_in(tmp_path / "tmp") == []


def _wandb_env(tmp: Path | None = None) -> dict[str, str]:
    """Offline W&B (no key): the runs' files stay under the log dir; ``tmp``: the worker's TMPDIR."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    if tmp is not None:
        tmp.mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmp)
    return env


def _left_in(tmp: Path) -> list[str]:
    """What of wandb's a worker left in its TMPDIR: wandb makes folders there at its import that only
    the interpreter's teardown would remove, and workers end without one. (torch's compile cache,
    ``torchinductor_<user>``, stays there by design: the next run reuses it.)"""
    return [p.name for p in tmp.iterdir() if "wandb" in p.name]


def _run_files(log_dir: Path) -> list[Path]:
    return sorted((log_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_run_after_sigterm_is_marked_preempting_and_ends_as_not_a_success(tmp_path, procs):
    log_dir = tmp_path / "logs"
    proc = procs.start(worker_cmd("--task", FIXTURE, "--max-steps", "100000", "--global-batch-size", "16",
                                  "--sleep-per-step", "0.05", "--checkpoint-dir", str(tmp_path / "ck"),
                                  "--log-dir", str(log_dir), "--no-progress"),
                       cwd=REPO, env=_wandb_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: len(records.read_steps(log_dir)) >= 3, 90, "three steps")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]  # the worker's own contract: saved and stopped cleanly
    (run,) = _run_files(log_dir)
    kinds = record_kinds(run)
    assert "preempting" in kinds and kinds.index("preempting") < kinds.index("exit")
    assert exit_code(run) == 128 + signal.SIGTERM, "W&B reads a non-zero exit code as failed or preempted"


def test_wandb_forced_exit_after_the_grace_period_still_ends_the_run_as_preempted(tmp_path, procs):
    log_dir = tmp_path / "logs"
    proc = procs.start(worker_cmd("--task", FIXTURE, "--max-steps", "100", "--global-batch-size", "16",
                                  "--sleep-per-step", "60", "--log-dir", str(log_dir), "--no-progress",
                                  "--grace-seconds", "2"),
                       cwd=REPO, env=_wandb_env(tmp_path / "tmp"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
    wait_until(lambda: _run_files(log_dir) and records.read_steps(log_dir), 90, "the first step and the W&B run")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "grace period of 2s over" in err
    (run,) = _run_files(log_dir)
    assert "preempting" in record_kinds(run) and exit_code(run) == 128 + signal.SIGTERM
    assert _left_in(tmp_path / "tmp") == []


def test_wandb_restart_before_the_first_checkpoint_resumes_the_same_run(tmp_path, procs):
    log_dir, ck = tmp_path / "logs", tmp_path / "ck"
    args = ["--task", FIXTURE, "--global-batch-size", "16", "--checkpoint-dir", str(ck), "--log-dir", str(log_dir),
            "--no-progress"]
    first = procs.start(worker_cmd(*args, "--max-steps", "100000", "--sleep-per-step", "0.05"), cwd=REPO,
                        env=_wandb_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: _run_files(log_dir) and len(records.read_steps(log_dir)) >= 2, 90, "two steps")
    first.kill()  # a crash: nothing saved
    first.wait(timeout=30)
    assert not list(ck.glob("step-*")), "the restart must come before any checkpoint"
    proc = subprocess.run(worker_cmd(*args, "--max-steps", "2"), cwd=REPO, env=_wandb_env(),
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = _offline_run_ids(log_dir)
    assert len(ids) == 2 and ids[0] == ids[1], f"a second W&B run was opened: {ids}"
    assert (ck / "wandb-run-id").read_text() == ids[0] == latest(ck)[1]["meta"]["wandb_run_id"]


# ------------------------------------------------------------------------------------- features

def test_amp_bf16_on_cpu_trains(tmp_path):
    out = train_inprocess(*TINY, "--amp", "bf16", "--max-steps", "2", "--global-batch-size", "8",
                          "--log-dir", str(tmp_path / "l"))
    assert out["step"] == 2 and torch.isfinite(torch.tensor(out["loss"]))


def test_profile_writes_a_chrome_trace_and_key_averages(tmp_path):
    train_inprocess(*TINY, "--profile", "--profile-wait", "0", "--profile-warmup", "1", "--profile-active", "1",
                    "--max-steps", "3", "--global-batch-size", "8", "--log-dir", str(tmp_path / "l"))
    traces = list((tmp_path / "l" / "profile").glob("trace-rank0-*.json"))
    tables = list((tmp_path / "l" / "profile").glob("key_averages-rank0-*.txt"))
    assert traces and tables
    assert json.loads(traces[0].read_text())["traceEvents"]
    assert "Self CPU" in tables[0].read_text()


def test_max_seconds_alone_trains_over_epochs_until_the_time_is_up(tmp_path):
    """``--max-seconds`` without ``--max-steps``/``--epochs`` is not cut short by the default one epoch."""
    assert parse_train_config(["--max-seconds", "60"]).epochs is None
    assert parse_train_config(["--max-seconds", "60", "--max-steps", "5"]).epochs is None
    out = train_inprocess("--task", FIXTURE, "--samples", "32", "--global-batch-size", "16",
                          "--sleep-per-step", "0.05", "--max-seconds", "1.5", "--log-dir", str(tmp_path / "l"))
    assert out["stopped_by"] == "max-seconds" and out["epoch"] >= 3, out  # 2 steps an epoch: many epochs
    assert out["step"] >= 6


def test_time_based_checkpoints_and_max_seconds_stop_with_a_saved_step(tmp_path):
    out = train_inprocess("--task", FIXTURE, "--global-batch-size", "16", "--max-steps", "100000",
                          "--sleep-per-step", "0.1", "--max-seconds", "1", "--checkpoint-every-seconds", "0.25",
                          "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "l"))
    assert out["stopped_by"] == "max-seconds" and 3 <= out["step"] < 100
    events = records.read_events(tmp_path / "l")
    saves = [e for e in events if e.event == Event.CHECKPOINT_SAVED]
    assert len(saves) >= 3 and saves[-1].step == out["step"] and saves[-1].committed is True
    assert any(not e.blocking for e in saves)  # periodic saves are asynchronous
    assert latest(tmp_path / "ck")[0] == out["step"]


def test_a_run_with_a_checkpoint_dir_and_no_interval_saves_every_30_minutes_and_0_turns_it_off():
    """Issue 44 point 6: losing every node at once must not lose the whole run."""
    from elastic_trainer.config import DEFAULT_CHECKPOINT_EVERY_SECONDS

    assert DEFAULT_CHECKPOINT_EVERY_SECONDS == 1800
    assert parse_train_config(["--checkpoint-dir", "ck"]).save_every_seconds == 1800
    assert parse_train_config(["--checkpoint-dir", "ck", "--checkpoint-every-seconds", "60"]).save_every_seconds == 60
    assert parse_train_config(["--checkpoint-dir", "ck", "--checkpoint-every-seconds", "0"]).save_every_seconds is None
    assert parse_train_config(["--checkpoint-dir", "ck", "--checkpoint-every", "50"]).save_every_seconds is None
    assert parse_train_config([]).save_every_seconds is None  # no checkpoint dir: nothing to save to
    bad = subprocess.run([sys.executable, "-m", "elastic_trainer.train", "--checkpoint-dir", "ck",
                          "--checkpoint-every-seconds", "-1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--checkpoint-every-seconds must be 0 (off) or a positive" in bad.stderr, bad.stderr
    helped = subprocess.run([sys.executable, "-m", "elastic_trainer.train", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60).stdout
    assert "every 1800 s" in " ".join(helped.split()) and "0 turns time-based saves off" in " ".join(helped.split())


@pytest.mark.parametrize("given, periodic", [([], True), (["--checkpoint-every-seconds", "0"], False)])
def test_the_default_interval_saves_by_rank_0s_clock_and_0_saves_only_at_the_end(tmp_path, monkeypatch, given, periodic):
    """The default interval in force, shortened from 30 min to 0.25 s for the test (the module's
    constant: what ``save_every_seconds`` reads when no interval is given)."""
    monkeypatch.setattr("elastic_trainer.config.DEFAULT_CHECKPOINT_EVERY_SECONDS", 0.25)
    out = train_inprocess("--task", FIXTURE, "--global-batch-size", "16", "--max-steps", "100000",
                          "--sleep-per-step", "0.1", "--max-seconds", "1", *given,
                          "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "l"))
    saves = [e for e in records.read_events(tmp_path / "l") if e.event == Event.CHECKPOINT_SAVED]
    assert out["stopped_by"] == "max-seconds" and saves and saves[-1].step == out["step"], (out, saves)
    if periodic:
        assert len(saves) >= 3 and any(not e.blocking for e in saves), saves  # asynchronous saves on the way
    else:
        assert len(saves) == 1, saves  # only the stop's


def test_dataloader_workers_feed_the_same_samples_and_parameters(tmp_path):
    """Prefetching workers must not shift which indices a step consumes (ledger) or what it learns."""
    for name, workers in (("w0", "0"), ("w2", "2")):
        train_inprocess("--task", FIXTURE, "--noise", "0", "--global-batch-size", "16", "--micro-batch-size", "6",
                        "--max-steps", "20", "--num-workers", workers, "--sample-ledger",
                        "--checkpoint-dir", str(tmp_path / name), "--log-dir", str(tmp_path / f"l{name}"))
    ledgers = [records.read_ledger(tmp_path / f"l{name}") for name in ("w0", "w2")]
    assert ledgers[0] == ledgers[1] and len(ledgers[0]) == 20
    assert ledgers[0][15].epoch == 0 and ledgers[0][16].epoch == 1  # 256 samples: 16 steps per epoch
    assert_same_state(latest(tmp_path / "w0")[1]["model"], latest(tmp_path / "w2")[1]["model"])


@pytest.mark.slow
@pytest.mark.trial  # 50 s on CI; the FSDP resumes below and test_checkpoint_sharded's
def test_fsdp_on_two_workers_resumes_and_matches_one_process(tmp_path):
    """--fsdp (fully_shard over gloo): sharded checkpoints (each rank its DCP shards) resume and train
    like plain single-process."""
    tiny = [*TINY, "--global-batch-size", "12", "--micro-batch-size", "3"]
    for until in ("2", "4"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "elastic_trainer.train", *tiny, "--fsdp", "--max-steps", until, "--no-wandb",
                               "--checkpoint-dir", str(tmp_path / "fsdp"), "--log-dir", str(tmp_path / "lf")],
                              cwd=REPO, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    train_inprocess(*tiny, "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "one"), "--log-dir", str(tmp_path / "lo"))
    step, fsdp = latest(tmp_path / "fsdp")
    assert step == 4 and fsdp["meta"]["fsdp"] is True and "model" not in fsdp  # sharded: each rank its shards
    model = gathered(CheckpointManager(str(tmp_path / "fsdp")), step, fsdp)["model"]
    worst, gauge = param_drift(model, latest(tmp_path / "one")[1]["model"])
    assert worst < 1e-5 and gauge <= 4 * 1e-3 * 1.01


def _torchrun(nproc: int, *argv: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                           "-m", "elastic_trainer.train", *argv, "--no-wandb", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_fsdp_init_from_is_read_by_rank_0_and_broadcast_into_the_shards(tmp_path):
    """--init-from under --fsdp: rank 0 alone reads the safetensors file and its tensors are broadcast
    into every rank's shards; two ranks then train like one process started from the same file
    (a rank that kept its own random shard would not)."""
    from elastic_trainer import cli

    tiny = [*TINY, "--global-batch-size", "12", "--micro-batch-size", "3"]
    train_inprocess(*tiny, "--max-steps", "2", "--seed", "7", "--checkpoint-dir", str(tmp_path / "src"),
                    "--log-dir", str(tmp_path / "ls"))
    weights = tmp_path / "model.safetensors"
    assert cli.main(["export", str(tmp_path / "src"), "--to", str(weights)]) == 0
    _torchrun(2, *tiny, "--fsdp", "--init-from", str(weights), "--max-steps", "2", "--checkpoint-dir",
              str(tmp_path / "fsdp"), "--log-dir", str(tmp_path / "lf"))
    train_inprocess(*tiny, "--init-from", str(weights), "--max-steps", "2", "--checkpoint-dir", str(tmp_path / "one"),
                    "--log-dir", str(tmp_path / "lo"))
    step, fsdp = latest(tmp_path / "fsdp")
    model = gathered(CheckpointManager(str(tmp_path / "fsdp")), step, fsdp)["model"]
    worst, _ = param_drift(model, latest(tmp_path / "one")[1]["model"])
    assert step == 2 and worst < 1e-5


@pytest.mark.slow
def test_resume_with_dropout_on_two_ranks_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    """Each rank saves and restores its own RNG state (training/rng.py). A global batch of 7 on two
    ranks gives them 4 and 3 samples, so their dropout draws, and generators, differ: restoring
    rank 0's state on rank 1 (as before) changes rank 1's masks after the resume."""
    args = [*TINY, "--dropout", "0.3", "--global-batch-size", "7"]
    _torchrun(2, *args, "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "a"), "--log-dir", str(tmp_path / "la"))
    for until in ("2", "4"):
        _torchrun(2, *args, "--max-steps", until, "--checkpoint-dir", str(tmp_path / "b"),
                  "--log-dir", str(tmp_path / "lb"))
    (step_a, a), (step_b, b) = latest(tmp_path / "a"), latest(tmp_path / "b")
    assert step_a == step_b == 4 and len(b["rng"]["ranks"]) == 2
    assert not torch.equal(b["rng"]["ranks"][0]["torch"], b["rng"]["ranks"][1]["torch"])  # the ranks drew apart
    for key in ("model", "optimizer", "rng"):
        assert_same_state(a[key], b[key], key)


@pytest.mark.slow
def test_fsdp_shards_each_transformer_block_then_the_root(tmp_path):
    """Each encoder and decoder layer is its own FSDP unit (then the root, for the embeddings and the
    head), so a block's parameters are gathered only around its own forward: while the first
    encoder layer runs, the decoder's are still sharded. Each rank holds about half the bytes."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(REPO) / "tests" / "helpers" / "fsdp_blocks.py"), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["units"] == ["<root>", "transformer.decoder.layers.0", "transformer.decoder.layers.1",
                                   "transformer.encoder.layers.0", "transformer.encoder.layers.1"]
        assert report["decoder_sharded_during_encoder"] is True
        assert all(p["dtensor"] and p["shard_dim0"] for p in report["params"].values())
        total = sum(p["global_bytes"] for p in report["params"].values())
        local = sum(p["local_bytes"] for p in report["params"].values())
        assert abs(local - total / 2) <= 0.01 * total, (local, total)
    assert sum(sum(p["local_bytes"] for p in r["params"].values()) for r in reports) == total


@pytest.mark.slow
@pytest.mark.trial  # 60 s on CI; test_checkpoint_sharded's FSDP resumes
def test_fsdp_resumes_a_whole_state_checkpoint_broadcast_from_rank_0_exactly(tmp_path):
    """A whole-state --fsdp checkpoint (as written to stores without sharded saves) is read by rank 0
    alone, which broadcasts the model and optimizer into the shards: the resumed run ends bitwise
    equal to one that was never stopped. (The whole state is made here from a sharded step-2.)"""
    args = [*TINY, "--global-batch-size", "8", "--fsdp"]
    _torchrun(2, *args, "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "a"), "--log-dir", str(tmp_path / "la"))
    _torchrun(2, *args, "--max-steps", "2", "--checkpoint-dir", str(tmp_path / "b"), "--log-dir", str(tmp_path / "lb"))
    step, rest = latest(tmp_path / "b")
    whole = gathered(CheckpointManager(str(tmp_path / "b")), step, rest)
    state = {**{k: v for k, v in rest.items() if k != "sharded"}, "model": whole["model"],
             "optimizer": whole["optimizer"]}
    with CheckpointManager(str(tmp_path / "c"), async_checkpoint=False) as ckpt:
        ckpt.save(step, state, blocking=True)
    _torchrun(2, *args, "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "c"), "--log-dir", str(tmp_path / "lc"))
    assert [e.step for e in records.read_events(tmp_path / "lc") if e.event == Event.RESUME] == [2]
    a = gathered(CheckpointManager(str(tmp_path / "a")), *latest(tmp_path / "a"))
    c = gathered(CheckpointManager(str(tmp_path / "c")), *latest(tmp_path / "c"))
    for key in ("model", "optimizer"):
        assert_same_state(a[key], c[key], key)


@pytest.mark.slow
@pytest.mark.trial  # 52 s on CI; the FSDP resumes here and test_checkpoint_sharded's
def test_fsdp_on_three_ranks_with_an_uneven_global_batch_pads_and_matches_ddp(tmp_path):
    """A global batch of 5 in micro-batches of 1 on 3 ranks: shares of 2, 2 and 1 samples. Under FSDP
    every forward is a collective, so rank 2 runs a zero-weight padding micro-batch (else it would
    wait in a collective the others never join); the losses and the model are those of DDP."""
    args = [*TINY, "--global-batch-size", "5", "--micro-batch-size", "1", "--max-steps", "3"]
    _torchrun(3, *args, "--fsdp", "--collective-timeout", "60", "--checkpoint-dir", str(tmp_path / "fsdp"),
              "--log-dir", str(tmp_path / "lf"))
    _torchrun(3, *args, "--checkpoint-dir", str(tmp_path / "ddp"), "--log-dir", str(tmp_path / "ld"))
    fsdp_losses = [s.loss for s in records.read_steps(tmp_path / "lf", rank=0)]
    ddp_losses = [s.loss for s in records.read_steps(tmp_path / "ld", rank=0)]
    assert len(fsdp_losses) == len(ddp_losses) == 3
    assert fsdp_losses[0] == ddp_losses[0]  # the same parameters and samples: the padding counts for nothing
    assert fsdp_losses == pytest.approx(ddp_losses, rel=1e-5)
    step, fsdp = latest(tmp_path / "fsdp")
    model = gathered(CheckpointManager(str(tmp_path / "fsdp")), step, fsdp)["model"]
    worst, gauge = param_drift(model, latest(tmp_path / "ddp")[1]["model"])
    assert step == 3 and worst < 1e-5 and gauge <= 3 * 1e-3 * 1.01


# ------------------------------------------------------------------------------------- console

LOGGING_TASK = '''
import logging
from tests.helpers.task_fixture import build as fixture_build

def build(args):
    task = fixture_build(args)
    step = task.training_step
    calls = []

    def training_step(model, batch):
        calls.append(1)
        if len(calls) == 8:
            logging.getLogger("user.task").warning("MARKER from the task")
        return step(model, batch)

    task.training_step = training_step
    return task
'''


def _console_run(tmp_path: Path, *argv: str) -> str:
    task = tmp_path / "logging_task.py"
    task.write_text(LOGGING_TASK)
    proc = subprocess.run(worker_cmd("--task", f"{task}:build", "--global-batch-size", "16", "--no-wandb",
                                     "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "logs"),
                                     *argv),
                          cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _screen_lines(err: str) -> list[str]:
    """What each terminal line ends up showing: the text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in err.split("\n")]


def test_console_log_lines_go_above_the_bar_and_the_bar_counts_seconds_with_max_seconds(tmp_path):
    err = _console_run(tmp_path, "--epochs", "1000", "--max-seconds", "3", "--sleep-per-step", "0.05",
                       "--checkpoint-every", "10")
    marker = [line for line in err.split("\n") if "MARKER from the task" in line]
    assert len(marker) == 1
    # tqdm.write clears the bar's line first: the log line starts a line of its own, no bar text before it
    shown = marker[0].rsplit("\r", 1)[-1]
    assert shown.startswith("[") and "%|" not in shown, repr(marker[0])
    bars = [s for s in err.replace("\n", "\r").split("\r") if "%|" in s]
    assert bars and all("/3s [" in b for b in bars), bars[-1:]  # the total is --max-seconds, in seconds
    assert "100%|" in bars[-1]


def test_console_bar_counts_steps_with_max_steps_and_each_checkpoint_is_one_line(tmp_path):
    err = _console_run(tmp_path, "--max-steps", "12", "--checkpoint-every", "4")
    bars = [s for s in err.replace("\n", "\r").split("\r") if "%|" in s]
    assert bars and "12/12 [" in bars[-1]
    lines = [s for s in _screen_lines(err) if "checkpoint step-" in s]
    steps = [int(s.split("checkpoint step-")[1].split()[0]) for s in lines]
    assert steps == [4, 8, 12] and all("committed" in s for s in lines), lines
    assert "save started" not in err and "removing old checkpoint" not in err
