"""Resuming with other --global-batch-size, --epochs, --max-steps or dataset size: the run either
continues from the saved sample offset (every remaining sample of the epoch exactly once) or stops
with one error naming the flag; it never reports itself finished having skipped data.

In-process, one rank, the example task at its smallest (256 samples): a few seconds each.
"""

from __future__ import annotations

import pytest

from elastic_trainer import records
from elastic_trainer.sampler import epoch_permutation
from elastic_trainer.flags import parse_train_config
from elastic_trainer.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

TINY = ["--d-model", "16", "--nhead", "2", "--num-encoder-layers", "1", "--num-decoder-layers", "1",
        "--dim-feedforward", "32", "--src-len", "2", "--tgt-len", "4", "--dataset-size", "256"]


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "ELASTIC_TRAINER_CHECKPOINT_DIR", "ELASTIC_TRAINER_LOG_DIR", "ELASTIC_TRAINER_RDZV_ROUND"):
        monkeypatch.delenv(name, raising=False)


def _train(tmp_path, log: str, *argv: str) -> dict:
    config = parse_train_config([*TINY, *argv, "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / log),
                           "--sample-ledger", "--no-wandb", "--no-progress", "--seed", "3"])
    return Trainer(config).train()


def _samples(tmp_path, log: str) -> list[int]:
    return [i for row in records.read_ledger(tmp_path / log, rank=0) for i in row.indices]


@pytest.mark.parametrize("stop", [["--epochs", "1"], ["--max-steps", "10"]])
def test_resume_with_a_larger_global_batch_trains_the_rest_of_the_epoch_from_the_sample_offset(tmp_path, stop):
    first = _train(tmp_path, "a", "--global-batch-size", "16", "--max-steps", "8")
    assert first["step"] == 8  # 128 of 256 samples
    resumed = _train(tmp_path, "b", "--global-batch-size", "64", *stop)
    # 128 samples left = 2 steps of 64; the step count goes on (a step is one optimizer step)
    assert resumed["step"] == 10
    perm = epoch_permutation(256, 3, 0).tolist()
    assert _samples(tmp_path, "a") == perm[:128]
    assert _samples(tmp_path, "b") == perm[128:]


def test_resume_with_a_smaller_global_batch_continues_at_the_same_sample(tmp_path):
    _train(tmp_path, "a", "--global-batch-size", "64", "--max-steps", "1")
    resumed = _train(tmp_path, "b", "--global-batch-size", "16", "--epochs", "1")
    assert resumed["step"] == 1 + 12  # the other 192 samples in steps of 16
    assert _samples(tmp_path, "b") == epoch_permutation(256, 3, 0).tolist()[64:]


def test_resume_past_max_steps_stops_with_an_error_naming_the_flag(tmp_path):
    _train(tmp_path, "a", "--global-batch-size", "16", "--max-steps", "8")
    with pytest.raises(ValueError, match=r"step-8 .* 4 steps past --max-steps 4; raise --max-steps"):
        _train(tmp_path, "b", "--global-batch-size", "16", "--max-steps", "4")
    assert _train(tmp_path, "c", "--global-batch-size", "16", "--max-steps", "8")["step"] == 8  # finished: no error


def test_resume_with_fewer_epochs_than_already_trained_names_the_flag(tmp_path):
    _train(tmp_path, "a", "--global-batch-size", "64", "--epochs", "2", "--max-steps", "6")  # epoch 2, offset 128
    with pytest.raises(ValueError, match=r"epoch 2 \(sample offset 128\), past --epochs 1; raise --epochs"):
        _train(tmp_path, "b", "--global-batch-size", "64", "--epochs", "1")
    resumed = _train(tmp_path, "c", "--global-batch-size", "64", "--epochs", "2")
    assert resumed["step"] == 8 and _samples(tmp_path, "c") == epoch_permutation(256, 3, 1).tolist()[128:]


def test_resume_with_another_dataset_size_names_the_flag(tmp_path):
    _train(tmp_path, "a", "--global-batch-size", "16", "--max-steps", "2")
    tiny = [a if a != "256" else "512" for a in TINY]
    config = parse_train_config([*tiny, "--global-batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck"),
                           "--log-dir", str(tmp_path / "b"), "--no-wandb", "--no-progress"])
    with pytest.raises(ValueError, match=r"dataset of 256 samples but this dataset has 512.*--dataset-size 256"):
        Trainer(config).train()


def test_resume_with_another_amp_says_so_and_keeps_the_flag_in_the_checkpoint(tmp_path, capsys):
    from elastic_trainer.checkpoint import CheckpointManager

    _train(tmp_path, "a", "--global-batch-size", "16", "--max-steps", "2", "--amp", "bf16")
    assert CheckpointManager(str(tmp_path / "ck")).load()[1]["meta"]["amp"] == "bf16"
    capsys.readouterr()
    resumed = _train(tmp_path, "b", "--global-batch-size", "16", "--max-steps", "4", "--amp", "off")
    assert resumed["step"] == 4 and "--amp changed: bf16 -> off" in capsys.readouterr().err
    assert CheckpointManager(str(tmp_path / "ck")).load()[1]["meta"]["amp"] == "off"
    _train(tmp_path, "c", "--global-batch-size", "16", "--max-steps", "5", "--amp", "off")
    assert "--amp changed" not in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elastic_train_run_again_with_a_larger_batch_trains_the_rest_of_the_epoch(tmp_path, procs):
    """As a new user would: `elastic-train` (live recovery, embedded etcd) to step 8 at global batch 16,
    then the same command with --global-batch-size 64 --epochs 1: the second launch is not taken for a
    spare of the finished run (which exits 0 without training) and trains the epoch's last 128 samples."""
    import subprocess

    from tests.helpers.common import cli_cmd

    common = ["--nnodes", "1", "--nproc-per-node", "1", "--run-id", "again", "--checkpoint-dir", str(tmp_path / "ck"),
              "--log-dir", str(tmp_path / "logs"), "--", *TINY, "--no-wandb", "--no-progress", "--seed", "3",
              "--sample-ledger"]
    outs = []
    for extra in (["--global-batch-size", "16", "--max-steps", "8"], ["--global-batch-size", "64", "--epochs", "1"]):
        proc = procs.start(cli_cmd(*common, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]
        outs.append(out)
    assert "training from step 8 until step 10" in outs[1] and "finished at step 10" in outs[1], outs[1][-3000:]
    perm = epoch_permutation(256, 3, 0).tolist()
    rows = records.read_ledger(tmp_path / "logs")
    assert sorted(i for r in rows for i in r.indices) == sorted(perm)  # each sample of the epoch exactly once
    assert [i for r in sorted(rows, key=lambda r: r.step) if r.step > 8 for i in r.indices] == perm[128:]
