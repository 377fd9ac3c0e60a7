"""The fenced commit: the etcd commit record (elastic_trainer/checkpoint/record.py) against a real
etcd, on the file store and on S3 (moto's server), with a real writer process that is paused
right after its fence check (SIGSTOP) and resumed once a newer round has committed and trained."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer import storage
from elastic_trainer.checkpoint.record import CommitRecord
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend
from elastic_trainer.rendezvous.round_fence import RoundFence
from elastic_trainer.rendezvous.state import encode_state
from elastic_trainer.torch_private import RendezvousState
from tests.helpers.common import etcd_conn, wait_until

pytestmark = pytest.mark.timeout(180)

WRITER = Path(__file__).resolve().parent / "helpers" / "ckpt_writer.py"


def _state(step: int, fill: float) -> dict:
    return {"model": {"w": torch.full((64,), fill), "b": torch.arange(step, dtype=torch.float32)},
            "step": step}


class _Rendezvous:
    """The rendezvous state of one run in a real etcd, whose round a test moves on."""

    def __init__(self, endpoint: str, run_id: str, round_: int) -> None:
        self.conn = etcd_conn(endpoint)
        self.backend = EtcdRendezvousBackend(self.conn, run_id)
        self.state = RendezvousState()
        self.state.round, self.state.complete = round_, True
        self.backend.set_state(encode_state(self.state))

    def next_round(self) -> None:
        _, token = self.backend.get_state()
        self.state.round += 1
        self.backend.set_state(encode_state(self.state), token)

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def rendezvous(etcd, run_id):
    rdzv = _Rendezvous(etcd.endpoint, run_id, 4)
    try:
        yield rdzv
    finally:
        rdzv.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
@pytest.mark.parametrize("store", ["file", "s3"])
def test_writer_paused_after_its_fence_check_never_commits_over_a_newer_round(store, request, etcd, rendezvous,
                                                                               tmp_path, procs):
    url = str(tmp_path / "ckpt") if store == "file" else request.getfixturevalue("s3_url")
    prefix = rendezvous.backend.prefix
    old = procs.start([sys.executable, str(WRITER), "--url", url, "--steps", "1,5", "--writer-id", "old-round-4",
                       "--keep", "1", "--etcd", etcd.endpoint, "--prefix", prefix, "--round", "4",
                       "--stop-after-fence-at", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    while "fence-passed 5" not in lines:
        line = old.stdout.readline()
        assert line, f"the writer ended early: {lines} {old.stderr.read()[-2000:]}"
        lines.append(line.strip())
    assert lines == ["committed 1", "fence-passed 5"]
    wait_until(lambda: _stopped(old.pid), 10, "the writer to stop itself")

    # a new round forms while the old rank 0 is paused, resumes from step 1, trains and commits
    rendezvous.next_round()
    fence = RoundFence(5, prefix, etcd.endpoint, retry_timeout=5)
    try:
        new = CheckpointManager(url, keep_checkpoints=1, async_checkpoint=False, fence=fence, writer_id="new-round-5")
        step, state = new.load()
        assert step == 1 and bool((state["model"]["w"] == float(sum(map(ord, "old-round-4")))).all())
        for step in (2, 3):
            new.save(step, _state(step, 5.0))
            assert new.last_save_stats["committed"], new.last_error

        os.kill(old.pid, signal.SIGCONT)
        out, err = old.communicate(timeout=60)
        assert old.returncode == 0, err[-3000:]
        assert "not-committed 5" in out and "fenced" in err, (out, err[-3000:])

        fs, root = storage.get_fs(url)
        assert not storage.exists(fs, storage.join(root, "step-5", "manifest.json"))
        # what the new round needs is all there: its step 3 loads through the record and from storage alone
        for reader in (CheckpointManager(url, fence=RoundFence(5, prefix, etcd.endpoint)), CheckpointManager(url)):
            step, state = reader.load()
            assert step == 3 and torch.equal(state["model"]["w"], torch.full((64,), 5.0))
            if reader.record is not None:
                reader.record.fence.close()
        # and its own save of step 5 is not abandoned as "another writer committed this step first"
        new.save(5, _state(5, 5.0))
        assert new.last_save_stats["committed"], new.last_error
        entries, _ = CommitRecord(fence, url).read()
        assert [(e["step"], e["writer"], e["fence_token"]) for e in entries] == [(5, "new-round-5", "round-5")]
        manifest = json.loads(storage.read_bytes(fs, storage.join(root, "step-5", "manifest.json")))
        assert manifest["writer"] == "new-round-5"
        assert CheckpointManager(url).load()[0] == 5
    finally:
        fence.close()


def test_loaders_follow_the_record_not_a_newer_manifest_in_storage(rendezvous, etcd, tmp_path):
    """A manifest in storage that the record lacks (a writer outside the protocol) is never resumed
    from while the record names complete checkpoints; without a record (a new etcd) it is."""
    url = str(tmp_path / "ckpt")
    fence = RoundFence(4, rendezvous.backend.prefix, etcd.endpoint, retry_timeout=5)
    try:
        fenced = CheckpointManager(url, keep_checkpoints=2, async_checkpoint=False, fence=fence, writer_id="fenced")
        fenced.save(3, _state(3, 3.0))
        CheckpointManager(url, keep_checkpoints=5, async_checkpoint=False, writer_id="outsider").save(9, _state(9, 9.0))
        assert fenced.load()[0] == 3 and fenced.latest_step() == 3
        assert CheckpointManager(url).load()[0] == 9  # storage alone: the newest complete manifest
        fenced.save(4, _state(4, 4.0))
        fenced.save(5, _state(5, 5.0))
        fs, root = storage.get_fs(url)
        # retention kept the record's two steps and left the step the record does not know alone
        assert sorted(fenced.steps()) == [4, 5, 9]
    finally:
        fence.close()


def test_a_run_started_over_commits_below_an_older_runs_steps_and_resumes_from_its_own(rendezvous, etcd, tmp_path):
    """--no-resume into the same checkpoint dir and etcd: its commits are not refused for being
    below the older run's steps, a restart resumes from its newest commit, and a step committed
    again in a new round replaces the old round's entry; a twin in the same round cannot."""
    url = str(tmp_path / "ckpt")
    prefix = rendezvous.backend.prefix
    fence = RoundFence(4, prefix, etcd.endpoint, retry_timeout=5)
    fence5 = RoundFence(5, prefix, etcd.endpoint, retry_timeout=5)
    try:
        old = CheckpointManager(url, keep_checkpoints=3, async_checkpoint=False, fence=fence, writer_id="old")
        for step in (99, 100):
            old.save(step, _state(step, 100.0))
        twin = CheckpointManager(url, keep_checkpoints=3, async_checkpoint=False, fence=fence, writer_id="twin")
        twin.save(100, _state(100, 7.0))
        assert not twin.last_save_stats["committed"] and "already committed by 'old' (round-4)" in twin.last_error

        rendezvous.next_round()
        again = CheckpointManager(url, keep_checkpoints=3, async_checkpoint=False, fence=fence5, writer_id="again")
        for step in (1, 2, 99):
            again.save(step, _state(step, 5.0))
            assert again.last_save_stats["committed"], again.last_error
        entries, _ = CommitRecord(fence5, url).read()
        assert [(e["step"], e["writer"]) for e in entries] == [(99, "again"), (2, "again"), (1, "again")]
        step, state = CheckpointManager(url, fence=fence5).load()
        assert step == 99 and bool((state["model"]["w"] == 5.0).all())
        step, state = CheckpointManager(url).load(step=99)  # the storage copy names the new files too
        assert bool((state["model"]["w"] == 5.0).all())
        again.save(3, _state(3, 5.0))
        assert CheckpointManager(url, fence=fence5).load()[0] == 3  # the newest commit, not the highest step
    finally:
        fence.close()
        fence5.close()


def test_commit_recorded_in_etcd_loads_when_its_storage_manifest_never_landed(rendezvous, etcd, tmp_path,
                                                                              monkeypatch):
    url = str(tmp_path / "ckpt")
    fence = RoundFence(4, rendezvous.backend.prefix, etcd.endpoint, retry_timeout=5)
    try:
        mgr = CheckpointManager(url, async_checkpoint=False, fence=fence, writer_id="w", retries=1)
        mgr.save(1, _state(1, 1.0))

        def crash(*args):
            raise OSError("the writer died here")

        monkeypatch.setattr(storage, "create_exclusive", crash)
        mgr.save(2, _state(2, 2.0))  # committed in etcd; the storage copy of the manifest failed
        monkeypatch.undo()
        fs, root = storage.get_fs(url)
        assert not storage.exists(fs, storage.join(root, "step-2", "manifest.json"))
        step, state = CheckpointManager(url, fence=RoundFence(4, rendezvous.backend.prefix, etcd.endpoint)).load()
        assert step == 2 and torch.equal(state["model"]["w"], torch.full((64,), 2.0))
    finally:
        fence.close()


def test_live_quorum_change_between_fence_check_and_commit_fences_the_commit(etcd, run_id, tmp_path):
    """The live path's token: the quorum number and the member's lease, compared in the commit."""
    from elastic_trainer.live.group import LiveGroup
    from elastic_trainer.live.quorum import Quorum
    from tests.helpers.live_nodes import NodeAgent, settings

    prefix = f"/elastic-trainer/{run_id}/"
    conn = etcd_conn(etcd)

    def put_quorum(q: int, members) -> None:
        conn.call(lambda c: c.put(prefix + "live/quorum", Quorum(q=q, members=members).to_json()), "test")

    class PausedAfterCheck(LiveGroup):
        """Another quorum forms right after this member's fence check passed."""

        new_quorum_after_check = False

        def guard(self):
            guard = super().guard()
            if self.new_quorum_after_check:
                self.new_quorum_after_check = False
                put_quorum(self.quorum.q + 1, ())
            return guard

    agent = NodeAgent(etcd, run_id, "node-a")
    group = PausedAfterCheck.make(conn, prefix, "node-a", 0, 1, "127.0.0.1", settings(), agent.lease_id)
    try:
        put_quorum(3, (group.me,))
        group.membership.adopt(Quorum(q=3, members=(group.me,)))
        url = str(tmp_path / "ckpt")
        mgr = CheckpointManager(url, async_checkpoint=False, fence=group, writer_id="live-rank0")
        mgr.save(1, _state(1, 1.0))
        assert mgr.last_save_stats["committed"], mgr.last_error
        group.new_quorum_after_check = True
        mgr.save(2, _state(2, 2.0))
        assert not mgr.last_save_stats["committed"] and "fenced" in mgr.last_error
        assert CheckpointManager(url, fence=group).load()[0] == 1
        entries, _ = CommitRecord(group, url).read()
        assert [(e["step"], e["fence_token"]) for e in entries] == [(1, "quorum-3")]
    finally:
        group.close()
        agent.close()
        conn.close()
