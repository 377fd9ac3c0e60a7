"""Live resharding and peer copies (``training/reshard.py``, ``training/peer_copy.py``): which set of
shards a re-form rebuilds from, the copies a holder keeps, a copy sent over its socket, and on 4 gloo
ranks a layout cut from another's shards byte for byte. Under faults: ``tests/test_live_hsdp.py``."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from elastic_trainer.training.hsdp import Shards
from elastic_trainer.training.peer_copy import PeerCopies, Store
from elastic_trainer.training.reshard import Held, choose
from tests.helpers.common import REPO


def _held(q, shards, index, step, source="copy"):
    return Held(q, shards, index, step, source)


def test_the_newest_set_that_every_shard_index_has_a_holder_of_is_chosen():
    # 4 shards of quorum 2: the survivors (ranks 0, 1) hold 0 and 1 live at step 8 and copies of
    # all four at steps 3 and 6, but the copy of index 3 at step 6 went with the lost node
    held = [[_held(2, 4, 0, 8, "live"), _held(2, 4, 0, 6), _held(2, 4, 0, 3), _held(2, 4, 2, 6), _held(2, 4, 2, 3)],
            [_held(2, 4, 1, 8, "live"), _held(2, 4, 1, 6), _held(2, 4, 1, 3), _held(2, 4, 3, 3)]]
    key, senders = choose(held)
    assert key == (2, 4, 3) and {i: r for i, (r, _) in senders.items()} == {0: 0, 1: 1, 2: 0, 3: 1}
    held[1].append(_held(2, 4, 3, 6))
    assert choose(held)[0] == (2, 4, 6)
    # a live shard is preferred to a copy of the same set (no decode of a copy needed)
    both = [[_held(1, 2, 0, 5), _held(1, 2, 1, 5)], [_held(1, 2, 1, 5, "live")]]
    assert choose(both)[1][1] == (1, _held(1, 2, 1, 5, "live"))
    assert choose([[_held(2, 4, 0, 8, "live")], [_held(2, 4, 1, 8, "live")]]) is None  # half the shards


def test_a_holder_keeps_two_steps_per_shard_and_drops_older_quorums():
    store = Store()
    for step in (3, 6, 9):
        store.put(_held(2, 4, 1, step), b"x" * step)
    assert sorted(h.step for h in store.items()) == [6, 9] and store.nbytes == 15
    store.put(_held(2, 4, 2, 9), b"y")
    store.put(_held(3, 2, 0, 12), b"z")
    assert list(store.items()) == [_held(3, 2, 0, 12)]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_snapshot_reaches_its_holder_over_a_socket_and_training_may_change_the_tensors_meanwhile(one_rank):
    import time

    copies = PeerCopies(1, "127.0.0.1", 1)  # world 1: its own holder
    try:
        w = torch.arange(6.0)
        shards = Shards({"w": w}, {}, {"w": {"exp_avg": w * 2, "step": torch.tensor(4.0)}}, {"w": ["exp_avg"]},
                        [{"lr": 0.1}])
        copies.snapshot(q=5, rank=0, world=1, shards_count=1, step=4, shards=shards, trainer={"meta": {"step": 4}})
        w.add_(100)  # training goes on: the copy was taken before
        deadline = time.time() + 20
        while copies.sent < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert copies.sent == 1
        (held, raw), = copies.store.items().items()
        assert held == Held(5, 1, 0, 4, "copy")
        got = torch.load(io.BytesIO(raw), weights_only=True)
        assert torch.equal(got["shards"]["params"]["w"], torch.arange(6.0)) and got["trainer"]["meta"]["step"] == 4
        assert torch.equal(got["shards"]["optim"]["w"]["exp_avg"], torch.arange(6.0) * 2)
    finally:
        copies.close()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_layout_cut_from_another_layouts_shards_holds_the_same_state_and_trains_the_same(tmp_path):
    """4 ranks: FSDP over all 4 (uneven rows) -> HSDP 2 x 2, through the gathered full state and
    point to point (each rank sent only its new rows: fewer bytes than every shard to every rank)."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(REPO / "tests" / "helpers" / "reshard_check.py"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["gathered_equal"] and r["cut_equal"], r
    assert r["after_step_max_diff"] < 1e-6, r
    assert r["rows"]["0.weight"] == [0, 15]  # rank 0 of the 2-shard layout: the first half of 30 rows
    # point to point (reshard.gather): each rank received only the rows it holds now, the rest of the
    # state once (with shard index 0); before, every rank received every other rank's whole shard
    assert r["p2p_equal"], r
    print(f"bytes received per rank, 4 shards -> 2 x 2: point to point {r['p2p_received']}, "
          f"all to all before {r['allgather_received']}")
    assert sum(r["p2p_received"]) < 0.6 * sum(r["allgather_received"]), r
