"""`elastic-train export` to safetensors and `--init-from`: the file is read back with the
safetensors library itself and compared with the checkpoint; a run starts from its weights."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from elastic_trainer import cli
from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.tasks import Task
from elastic_trainer.flags import parse_train_config
from elastic_trainer.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

FIXTURE = "tests.helpers.task_fixture:build"


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "ELASTIC_TRAINER_CHECKPOINT_DIR", "ELASTIC_TRAINER_LOG_DIR", "ELASTIC_TRAINER_RDZV_ROUND"):
        monkeypatch.delenv(name, raising=False)


def _trained(tmp_path) -> str:
    ckpt = str(tmp_path / "ck")
    Trainer(parse_train_config(["--task", FIXTURE, "--global-batch-size", "16", "--max-steps", "3", "--checkpoint-dir", ckpt,
                          "--log-dir", str(tmp_path / "l"), "--no-wandb", "--no-progress"])).train()
    return ckpt


def test_export_writes_the_checkpoints_model_weights_that_safetensors_reads_back(tmp_path, capsys):
    ckpt = _trained(tmp_path)
    out = tmp_path / "model.safetensors"
    assert cli.main(["export", ckpt, "--to", str(out)]) == 0
    assert "exported the model weights of step-3" in capsys.readouterr().out
    step, state = CheckpointManager(ckpt).load()
    weights = load_file(str(out))
    assert set(weights) == set(state["model"]) and len(weights) == 4
    for key, value in state["model"].items():
        assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), key
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["step"] == "3"
    assert not list(tmp_path.glob("model.safetensors.tmp-*"))


def test_export_of_tied_weights_and_of_an_empty_store(tmp_path, capsys):
    shared = torch.arange(6.0).reshape(2, 3)
    CheckpointManager(str(tmp_path / "tied"), async_checkpoint=False).save(
        5, {"model": {"embed.weight": shared, "head.weight": shared}})
    out = tmp_path / "tied.safetensors"
    assert cli.main(["export", str(tmp_path / "tied"), "--to", str(out)]) == 0
    weights = load_file(str(out))
    assert torch.equal(weights["embed.weight"], shared) and torch.equal(weights["head.weight"], shared)

    assert cli.main(["export", str(tmp_path / "nothing"), "--to", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no complete checkpoint in" in err[0]
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", str(tmp_path / "tied"), "--to", str(tmp_path / "model.pt")])
    assert exc.value.code == 2 and "must end with .safetensors" in capsys.readouterr().err


def test_init_from_starts_a_new_run_from_the_exported_weights(tmp_path):
    ckpt = _trained(tmp_path)
    out = tmp_path / "model.safetensors"
    assert cli.main(["export", ckpt, "--to", str(out)]) == 0
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    at_first_step = []

    def training_step(m, batch):
        if not at_first_step:
            at_first_step.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 2))
    config = parse_train_config(["--init-from", str(out), "--global-batch-size", "16", "--max-steps", "1",
                           "--checkpoint-dir", str(tmp_path / "new"), "--log-dir", str(tmp_path / "l2"),
                           "--no-wandb", "--no-progress"])
    Trainer(config, Task(model=model, dataset=data, training_step=training_step)).train()
    want = load_file(str(out))
    assert set(at_first_step[0]) == set(want)
    for key, value in want.items():
        assert torch.equal(at_first_step[0][key], value), key


def test_init_from_a_file_that_does_not_fit_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_train_config(["--init-from", str(tmp_path / "missing.safetensors")])
    assert "--init-from" in capsys.readouterr().err
    wrong = tmp_path / "wrong.safetensors"
    save_file({"weight": torch.zeros(3, 4)}, str(wrong))
    config = parse_train_config(["--init-from", str(wrong), "--global-batch-size", "8", "--max-steps", "1",
                           "--log-dir", str(tmp_path / "l"), "--no-wandb", "--no-progress"])
    task = Task(model=torch.nn.Linear(4, 2), dataset=torch.utils.data.TensorDataset(torch.randn(16, 4)),
                training_step=lambda m, b: m(b[0]).sum())
    with pytest.raises(ValueError, match=r"--init-from .*wrong.safetensors does not fit this model: missing \['bias'\]"):
        Trainer(config, task).train()
