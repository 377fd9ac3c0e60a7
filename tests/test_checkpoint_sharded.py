"""Sharded FSDP checkpoints (elastic_trainer/checkpoint/sharded.py): every rank writes its shards
through torch.distributed.checkpoint, in the background after a copy, the manifest lists every
shard and commits last, a rank lost mid-save leaves nothing committed, and a load at another
world size reshards. Real gloo processes under torchrun, a real local store and a real S3
endpoint (moto's server)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from elastic_trainer.checkpoint import CheckpointManager
from tests.helpers.common import REPO, Processes, assert_same_state
from tests.helpers.runs import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HELPER = Path(__file__).resolve().parent / "helpers" / "fsdp_sharded.py"


def _run(procs, nproc: int, *args: str) -> str:
    proc = procs.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        str(HELPER), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory, s3_endpoint) -> SimpleNamespace:
    """One 4-rank FSDP run's step 2, saved sharded to a local folder and to S3 (one torchrun launch:
    each is seconds of Python and torch start-up per rank), and its gathered state (``saved.pt``).
    The tests below load it at 3 ranks from the file and at 2 from S3."""
    from elastic_trainer import storage

    tmp = tmp_path_factory.mktemp("sharded-at-4")
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    storage.get_fs(f"s3://{bucket}")[0].mkdir(bucket)
    saved = SimpleNamespace(tmp=tmp, file_url=str(tmp / "ck"), s3_url=f"s3://{bucket}/run", state=tmp / "saved.pt")
    procs = Processes()
    try:
        _run(procs, 4, "save", "--url", saved.file_url, "--url", saved.s3_url, "--out", str(saved.state))
    finally:
        procs.kill_all()
    return saved


def test_sharded_save_at_4_ranks_loads_resharded_at_3_with_equal_state(saved_at_4, tmp_path, procs, caplog):
    """4 -> 3 ranks: no shard maps onto one rank (4 -> 2, an even split, is loaded from S3 below)."""
    url, ck = saved_at_4.file_url, Path(saved_at_4.file_url)
    manifest = json.loads((ck / "step-2" / "manifest.json").read_text())
    shards = sorted(rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith("dcp-"))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    for rel, info in manifest["files"].items():
        assert (ck / "step-2" / rel).stat().st_size == info["size"] and info["hash"] == "xxh3_128"
    saved = torch.load(saved_at_4.state, weights_only=True)
    assert len(saved["optimizer"]["state"]) == 4  # Adam's exp_avg/exp_avg_sq of all four parameters
    _run(procs, 3, "load", "--url", url, "--out", str(tmp_path / "loaded-3.pt"))
    assert_same_state(saved, torch.load(tmp_path / "loaded-3.pt", weights_only=True), "at 3 ranks")

    # export gathers the model from the shards into one safetensors file
    from safetensors.torch import load_file

    from elastic_trainer import cli

    assert cli.main(["export", url, "--to", str(tmp_path / "model.safetensors")]) == 0
    assert_same_state(saved["model"], load_file(str(tmp_path / "model.safetensors")), "exported")

    # a shard with one flipped byte: the step fails verification before anything is loaded
    shard = ck / "step-2" / next(r for r in manifest["files"] if r.endswith("__2_0.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert CheckpointManager(url).load() is None
    assert "__2_0.distcp fails its xxh3_128 check" in caplog.text


def test_async_save_holds_its_steps_state_while_the_shards_change_and_the_next_save_waits_for_it(tmp_path, procs):
    """At 2 ranks, loaded at 1 (both steps in one launch): the world sizes are not what is tested."""
    url = str(tmp_path / "ck")
    _run(procs, 2, "async", "--url", url, "--out", str(tmp_path / "at.pt"))
    _run(procs, 1, "load", "--step", "2", "--step", "3", "--url", url, "--out", str(tmp_path / "loaded.pt"))
    for step, saved in ((2, tmp_path / "at.pt"), (3, tmp_path / "at.pt.3")):
        manifest = json.loads((tmp_path / "ck" / f"step-{step}" / "manifest.json").read_text())
        assert len([rel for rel in manifest["files"] if rel.endswith(".distcp")]) == 2
        # step 2 was written while every shard was halved: what it holds is the state at step 2
        assert_same_state(torch.load(saved, weights_only=True),
                          torch.load(tmp_path / f"loaded.pt.{step}", weights_only=True), f"step {step}")
    assert CheckpointManager(url).load()[0] == 3


def test_a_rank_that_exits_mid_save_leaves_that_step_uncommitted_and_the_previous_one_newest(tmp_path, procs):
    """At 2 ranks: rank 1 exits mid-save, rank 0 waits for the save and finds it uncommitted."""
    url = str(tmp_path / "ck")
    out = _run(procs, 2, "exit", "--url", url, "--out", str(tmp_path / "exit.json"))
    result = json.loads((tmp_path / "exit.json").read_text())
    assert result["step"] == 3 and result["committed"] is False, out[-3000:]
    assert result["error"].startswith("checkpoint step-3 not committed: ")
    assert not (tmp_path / "ck" / "step-3" / "manifest.json").exists()
    assert CheckpointManager(url).load()[0] == 2


def test_sharded_save_on_s3_at_4_ranks_loads_resharded_at_2(saved_at_4, tmp_path, procs):
    from elastic_trainer import storage

    s3_url = saved_at_4.s3_url
    fs, root = storage.get_fs(s3_url)
    manifest = json.loads(storage.read_bytes(fs, f"{root}/step-2/manifest.json"))
    shards = sorted(rel.split("/", 1)[1] for rel in manifest["files"] if rel.startswith("dcp-"))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    for rel, info in manifest["files"].items():
        assert storage.size(fs, f"{root}/step-2/{rel}") == info["size"]
    _run(procs, 2, "load", "--url", s3_url, "--out", str(tmp_path / "loaded.pt"))
    saved = torch.load(saved_at_4.state, weights_only=True)
    assert_same_state(saved, torch.load(tmp_path / "loaded.pt", weights_only=True), "at 2 ranks from S3")

    # export gathers the model from the shards on S3
    from safetensors.torch import load_file

    from elastic_trainer import cli

    assert cli.main(["export", s3_url, "--to", str(tmp_path / "model.safetensors")]) == 0
    assert_same_state(saved["model"], load_file(str(tmp_path / "model.safetensors")), "exported from S3")


FSDP_ARGS = [*TINY, "--global-batch-size", "12", "--micro-batch-size", "3", "--no-wandb", "--no-progress"]


def test_fsdp_training_saves_sharded_in_the_background_to_s3_and_resumes_at_one_rank(s3_url, tmp_path, procs):
    from elastic_trainer import records
    from elastic_trainer.checkpoint.sharded import is_sharded

    for nproc, until in ((2, "3"), (1, "5")):
        proc = procs.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(nproc), "-m", "elastic_trainer.train", *FSDP_ARGS, "--fsdp", "--max-steps", until,
                            "--checkpoint-every", "1", "--checkpoint-dir", s3_url, "--log-dir", str(tmp_path / "logs")],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
    assert "resumed from checkpoint step-3" in out
    saves = [(e.step, e.blocking, e.committed, e.world_size) for e in records.read_events(tmp_path / "logs")
             if e.event == "checkpoint_saved"]
    # periodic saves run in the background (committed: known later); each run's last one blocks
    assert saves == [(1, False, None, 2), (2, False, None, 2), (3, True, True, 2), (4, False, None, 1),
                     (5, True, True, 1)]
    step, state = CheckpointManager(s3_url).load()
    assert step == 5 and is_sharded(state) and state["meta"]["world_size"] == 1
    from elastic_trainer import storage

    fs, root = storage.get_fs(s3_url)
    steps = sorted(n for n in storage.list_dir(fs, root) if n.startswith("step-"))
    assert steps == ["step-3", "step-4", "step-5"]  # --keep-checkpoints 3: steps 1 and 2 pruned


def test_staging_reuses_its_buffers_holds_each_saves_values_and_restages_when_the_layout_changes():
    """``Staging``: the second save copies into the first one's buffers (no new memory, no new
    layout), holds the values of its own moment whatever changes after, and stages anew
    when the keys' order or a tensor's shape changes."""
    from elastic_trainer.checkpoint.sharded import Staging

    w, b, step = torch.arange(6.0).reshape(2, 3), torch.ones(3), torch.tensor(3.0)

    def state(w, b, lr, order=("w", "b")):
        model = {"w": w, "b": b} if order == ("w", "b") else {"b": b, "w": w}
        return {"model": model, "optimizer": {"state": {"w": {"step": step}},
                                              "param_groups": [{"lr": lr, "betas": (0.9, 0.99), "params": ["w"]}]}}

    staging = Staging()
    first = staging.stage(state(w, b, 0.1))
    assert torch.equal(first["model"]["w"], w) and first["model"]["w"].data_ptr() != w.data_ptr()
    buffer = first["model"]["w"].data_ptr()
    restaged = []  # layouts made after the first: only on a layout change
    lay_out = staging._lay_out
    staging._lay_out = lambda tensors: restaged.append(1) or lay_out(tensors)

    w.add_(10), b.mul_(2), step.add_(1)
    second = staging.stage(state(w, b, 0.2))  # the same layout: copied into the same buffers
    assert second["model"]["w"].data_ptr() == buffer
    assert torch.equal(second["model"]["w"], w) and torch.equal(second["model"]["b"], b)
    assert second["optimizer"]["state"]["w"]["step"].item() == 4.0
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.2
    assert second["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert restaged == []
    held = second["model"]["w"].clone()
    w.mul_(0)  # training goes on: the staged copy keeps the save's values
    assert torch.equal(second["model"]["w"], held)

    reordered = staging.stage(state(w, b, 0.2, order=("b", "w")))  # keys in another order: staged anew
    assert torch.equal(reordered["model"]["w"], w) and torch.equal(reordered["model"]["b"], b)
    assert restaged == [1]
    wider = torch.arange(8.0).reshape(2, 4)
    third = staging.stage(state(wider, b, 0.2))  # a shape change: staged anew
    assert torch.equal(third["model"]["w"], wider) and torch.equal(third["model"]["b"], b)
    assert restaged == [1, 1]
    staging.close()


def test_each_rank_verifies_a_share_of_the_shards_and_all_move_to_an_older_step_when_one_share_is_damaged(
        tmp_path, procs):
    """On resume no rank reads every shard file: rank r verifies the shard files r, r+world, ...
    (``CheckpointManager.load(share=...)``), and the step is used only when every rank found its
    share sound. A flipped byte in a shard that only rank 1 checks: rank 0 alone would accept the
    step, so every rank must move on to the step before it together."""
    from elastic_trainer import records

    def run(until: str) -> str:
        proc = procs.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "elastic_trainer.train", *FSDP_ARGS, "--fsdp", "--max-steps", until,
                            "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ck"),
                            "--log-dir", str(tmp_path / "logs")],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        return out

    run("3")
    manifest = json.loads((tmp_path / "ck" / "step-3" / "manifest.json").read_text())
    shards = sorted(rel for rel in manifest["files"] if rel.startswith("dcp-"))
    assert [r.split("/", 1)[1] for r in shards] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    ckpt = CheckpointManager(str(tmp_path / "ck"))
    damaged = tmp_path / "ck" / "step-3" / shards[1]  # the second shard file: rank 1's share of 2
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    assert ckpt.load(3, share=(0, 2))[0] == 3  # rank 0's share does not include it: sound to rank 0
    assert ckpt.load(3, share=(1, 2)) is None  # rank 1's does
    assert ckpt.load(3) is None

    out = run("5")
    assert "resumed from checkpoint step-2" in out, out[-3000:]
    assert "rank(s) 1 found their share of its shards damaged or missing" in out
    loaded = [(e.step, e.world_size) for e in records.read_events(tmp_path / "logs") if e.event == "checkpoint_loaded"]
    assert loaded == [(2, 2)]
    assert CheckpointManager(str(tmp_path / "ck")).load()[0] == 5


def test_files_are_hashed_as_dcp_writes_them_and_a_seek_leaves_a_file_to_be_read_back(tmp_path):
    """``HashingFiles`` around DCP's own file system: the digest recorded for a file is the xxh3_128
    of what is on disk, follows DCP's rename of ``.metadata``; a stream that seeks is not trusted."""
    import xxhash
    from torch.distributed.checkpoint import FileSystemWriter

    from elastic_trainer.checkpoint.sharded import HashingFiles

    writer = FileSystemWriter(str(tmp_path))
    files = HashingFiles.wraps(writer)
    assert files is not None and writer.fs is files
    with writer.fs.create_stream(tmp_path / "__0_0.distcp", "wb") as f:
        torch.save(torch.arange(1000.0), f)
        f.write(memoryview(bytes(range(256))))
    with writer.fs.create_stream(tmp_path / ".metadata.tmp", "wb") as f:
        f.write(b"metadata")
    writer.fs.rename(tmp_path / ".metadata.tmp", tmp_path / ".metadata")
    with writer.fs.create_stream(tmp_path / "seeked", "wb") as f:
        f.write(b"abcdef")
        f.seek(0)
        f.write(b"X")
    for name in ("__0_0.distcp", ".metadata"):
        data = (tmp_path / name).read_bytes()
        assert files.files[name] == (len(data), xxhash.xxh3_128(data).hexdigest())
    assert ".metadata.tmp" not in files.files and "seeked" not in files.files
    with writer.fs.create_stream(tmp_path / ".metadata", "rb") as f:  # reading passes through
        assert f.read() == b"metadata"
    # the object-store writer has the same file system to wrap (else saves would read back)
    from elastic_trainer.torch_private import dcp_fsspec_storage

    assert HashingFiles.wraps(dcp_fsspec_storage()[0](f"file://{tmp_path}/fsspec")) is not None
