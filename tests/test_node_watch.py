"""One etcd watch per node (``live/node_share.py``): the first worker to lock the node's watch keeps
it and publishes its views; a sibling is woken by each one (not at its next poll) and reads it
back; when the watching process dies (SIGKILL: nothing of it runs) a sibling takes the watch at
its next poll. Real processes, real files and sockets; the etcd side is in test_node_lease.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_trainer.live.keys import Change
from elastic_trainer.live.mirror import Mirror
from elastic_trainer.live.node_share import (NodeShare, change_from_line, change_to_line, keys_from_bytes,
                                             keys_to_bytes)
from elastic_trainer.live.quorum import Member, Quorum
from tests.helpers.common import wait_until
from tests.helpers.live_nodes import live_nodes

pytestmark = pytest.mark.timeout(60)
POLL = 0.1


P = "/run/live/"


def _keys() -> Mirror:
    q = Quorum(7, (Member("n0-0-1", "n0", 0, "127.0.0.1:1"), Member("n1-0-2", "n1", 0, "127.0.0.1:2")), step=12)
    keys = Mirror(P)
    keys.load([Change(P + "quorum", q.to_json(), 40, 42), Change(P + "alive/n0-0-1", b"{}", 3, 3),
               Change(P + "alive/n1-0-2", b"{}", 4, 4), Change(P + "join/n2-0-3", b'{"node": "n2"}', 50, 50),
               Change(P + "alive/n3-0-4", b'{"left": 1}', 5, 5),
               Change(P + "stall/6", b'{"by": "n0-0-1"}', 45, 45),
               Change(P + "busy/n1-0-2", b'{"q": 7, "what": "checkpoint"}', 46, 46)])
    return keys


def test_what_the_watching_worker_knows_survives_its_trip_through_the_published_file():
    """Every live key travels, not a view for the publisher's quorum (a sibling in another
    quorum serves itself from it: the view it derives for any quorum is the publisher's)."""
    keys = _keys()
    back = Mirror(P)
    assert keys_from_bytes(back, keys_to_bytes(keys, 5), 5)
    for q in (6, 7, 8):
        assert back.view(q) == keys.view(q)
    assert back.quorum_record == keys.quorum_record and back.left == keys.left == {"n3-0-4"}
    decoded = back.quorum
    assert not keys_from_bytes(back, keys_to_bytes(keys, 6), 5), "a snapshot of another epoch is not loaded"
    assert keys_from_bytes(back, keys_to_bytes(keys, 6))
    assert back.quorum is decoded, "the quorum record is decoded again only when its revision changed"


def test_a_sibling_applies_the_logged_changes_and_starts_over_from_a_new_snapshot(tmp_path):
    """Between snapshots the watching worker appends the changes it applied; a sibling applies
    those since its last load (O(changes), not a parse of every key: at 1,000 x 8 a snapshot is
    ~0.9 MB), reads whole lines only, and loads the snapshot again when a new epoch begins."""
    leader = NodeShare(str(tmp_path / "node"), POLL, lambda: None, lambda: None)
    sibling = NodeShare(str(tmp_path / "node"), POLL, lambda: None, lambda: None)
    try:
        assert leader.try_lead()
        keys, got = _keys(), Mirror(P)
        leader.publish(keys, None)
        assert sibling.load(got) and got.view(7) == keys.view(7)
        burst = [Change(P + "alive/n1-0-2", None, 0, 60), Change(P + "join/n2-0-3", None, 0, 61),
                 Change(P + "busy/n9-0-9", '{"q": 7, "what": "écrire"}'.encode(), 62, 62)]
        odd = Change(P + "alive/x", bytes(range(256)), 1, 2)
        assert change_from_line(change_to_line(odd)) == odd, "any bytes travel exactly"
        keys.track(keys.quorum)
        for change in burst[:2]:
            keys.apply(change)
        leader.publish(keys, burst[:2])
        with open(tmp_path / "node" / "changes.log", "ab") as log:
            log.write(b'["' + P.encode() + b'busy/half')  # a line being appended: not read yet
        got.track(got.quorum)
        assert sibling.load(got) and got.view(7) == keys.view(7) and list(got.missing) == ["n1-0-2"]
        assert "n9-0-9" not in got.busy
        keys.apply(burst[2])
        leader.publish(keys, None)  # a new epoch: the snapshot has the third change
        assert sibling.load(got) and got.busy["n9-0-9"]["what"] == "écrire" and got.view(7) == keys.view(7)
    finally:
        leader.close()
        sibling.close()


def test_one_worker_keeps_the_watch_and_a_sibling_is_woken_by_each_published_view(tmp_path):
    changes: list[float] = []
    promoted = threading.Event()
    long_poll = 30.0  # a wake-up within the test's seconds is the datagram's, not the poll's
    leader = NodeShare(str(tmp_path / "node"), long_poll, lambda: None, lambda: None)
    sibling = NodeShare(str(tmp_path / "node"), long_poll, lambda: changes.append(time.monotonic()), promoted.set)
    thread = threading.Thread(target=sibling.run, daemon=True)
    try:
        assert leader.try_lead() and not sibling.try_lead(), "one watching worker per node"
        thread.start()
        time.sleep(3 * POLL)  # the sibling's socket is bound; no view yet, no promotion while the leader lives
        got = Mirror(P)
        assert not changes and not promoted.is_set() and not sibling.load(got)
        leader.publish(_keys(), None)
        deadline = time.monotonic() + 5
        while not changes and time.monotonic() < deadline:
            time.sleep(0.001)
        assert changes, "the sibling must be woken by the published view, not at its poll"
        assert sibling.load(got) and got.view(7) == _keys().view(7)
    finally:
        sibling.close()
        leader.close()
        thread.join(2)
    assert not thread.is_alive()


def test_a_sibling_takes_the_watch_within_a_poll_when_the_watching_process_is_killed(tmp_path):
    directory = str(tmp_path / "node")
    code = ("import sys, time; from elastic_trainer.live.node_share import NodeShare;"
            f"w = NodeShare({directory!r}, 0.1, lambda: None, lambda: None); assert w.try_lead();"
            "print('leading', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    promoted = threading.Event()
    sibling = NodeShare(directory, POLL, lambda: None, promoted.set)
    thread = threading.Thread(target=sibling.run, daemon=True)
    try:
        assert holder.stdout.readline().strip() == "leading"
        assert not sibling.try_lead()
        thread.start()
        time.sleep(3 * POLL)
        assert not promoted.is_set(), "no promotion while the watching worker lives"
        holder.send_signal(signal.SIGKILL)
        holder.wait(5)
        assert promoted.wait(2), "a sibling must take the watch of a killed worker (at its next poll: 20 of them)"
        assert sibling.leader
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(5)
        sibling.close()
        if thread.ident is not None:
            thread.join(2)


def test_after_a_re_form_a_sibling_serves_itself_from_its_nodes_view_and_reads_nothing(etcd, run_id):
    """The watching worker used to publish a view for its own quorum: a sibling that adopted the
    next quorum first (each worker re-forms on its own) found the view "for another quorum" and
    read etcd whole, so every re-form sent ~every sibling to etcd (100 nodes x 8: 423 whole reads,
    the next quorum known everywhere after 72 s). Now the view holds every live key: the sibling
    waits for the one that shows its quorum (concluding no loss from the older one), and the new
    quorum record, a change from the quorum it held, costs it no read either."""
    lost: list[str] = []
    with live_nodes(etcd, run_id, nodes=1, workers=2, lease_ttl=5) as nodes:
        workers = nodes.groups
        keeper = next(w for w in workers if w.watcher.keeper.stream is not None)
        sibling = next(w for w in workers if w is not keeper)
        sibling.on_member_lost = lost.append  # (the keeper, still in quorum 1, sees the quorum move)
        reads, loads = sibling.watcher.keeper.reads, sibling.watcher.keeper.loads
        q1 = keeper.quorum
        q2 = Quorum(q=2, members=q1.members, step=5, cause="test: a planned re-form")
        sibling.membership.adopt(q2)  # the sibling re-formed first; the keeper is still in quorum 1
        sibling.wake()
        time.sleep(0.3)
        assert not lost and not sibling.change_pending.is_set(), "no loss from a view older than quorum 2"
        assert keeper.keys.cas_quorum(q2, keeper.keys.read().quorum_rev, base=q1)
        wait_until(lambda: sibling.watcher.keeper.mirror.quorum == q2, 3, "the keeper's next view, with quorum 2",
                   interval=0.02)
        keeper.membership.adopt(q2)
        time.sleep(0.3)
        assert sibling.watcher.keeper.reads == reads and sibling.watcher.keeper.loads > loads, \
            "the sibling read etcd itself"
        assert not sibling.change_pending.is_set() and not lost
