"""One etcd lease per node under live recovery (``rendezvous/node_lease.py``, ``live/worker_lease.py``),
on a real etcd: the workers' keys ride on the agent's lease and send no renewal while the agent
renews it; an agent paused alone costs nothing (one worker at a time renews for it); a node frozen
whole loses the lease and every worker leaves; a worker that leaves keeps the lease and a new one
clears its earlier self's keys. The request rate per node is measured by ``benchmarks/etcd_load.py``,
not here."""

from __future__ import annotations

import time

import pytest

from elastic_trainer.etcd.client import EtcdConnection
from elastic_trainer.rendezvous.node_lease import RenewalRecord
from tests.helpers.common import etcd_conn, holds_within
from tests.helpers.live_nodes import NodeAgent, group, live_nodes, settings

pytestmark = pytest.mark.timeout(120)

TTL, INTERVAL = 2, 0.5


@pytest.fixture
def node(etcd, run_id):
    """An agent and its two workers on its lease, joined into a world of 2 and watching; what the
    workers' ``on_lease_lost`` was called with."""
    left: list[str] = []
    with live_nodes(etcd, run_id, nodes=1, workers=2, lease_ttl=TTL, keep_alive_interval=INTERVAL,
                    callbacks={"on_lease_lost": left.append}) as nodes:
        yield nodes, left


def _lease_ttl(conn: EtcdConnection, lease_id: int) -> int:
    return conn.call(lambda c: c.get_lease_info(lease_id)).TTL


def test_workers_on_the_nodes_lease_renew_nothing_while_their_agent_renews_it(node):
    nodes, left = node
    agent, workers = nodes.agents["node0"], nodes.groups
    time.sleep(4 * INTERVAL)  # four of the agent's renewals
    assert not left
    assert [w.lease.renewals for w in workers] == [0, 0], "a worker renewed the node's lease beside its agent"
    assert RenewalRecord(agent.lease_id).last() > time.monotonic() - 2 * INTERVAL, "the agent records its renewals"


def test_an_agent_paused_alone_costs_nothing_its_workers_renew_the_nodes_lease_one_at_a_time(node, etcd):
    nodes, left = node
    agent, workers = nodes.agents["node0"], nodes.groups
    agent.pause()
    paused = time.monotonic()
    time.sleep(3 * TTL)  # three leases: the lease would be gone twice over
    elapsed = time.monotonic() - paused
    conn = etcd_conn(etcd)
    try:
        assert _lease_ttl(conn, agent.lease_id) > 0, "the node's lease expired while its workers lived"
        assert not left and not any(w.lease.lost for w in workers)
        renewals = sum(w.lease.renewals for w in workers)
        # One renewal per 1.5 intervals at most (a quarter interval of lateness each): the siblings
        # take turns through the record's lock instead of both renewing.
        assert 1 <= renewals <= elapsed / (1.5 * INTERVAL) + 1, renewals
        for w in workers:
            assert conn.call(lambda c, w=w: c.get(w.lease.key))[0] is not None
    finally:
        conn.close()


def test_a_node_frozen_whole_loses_its_lease_and_every_worker_leaves(node):
    nodes, left = node
    nodes.agents["node0"].pause()
    for w in nodes.groups:
        nodes.threads[w.id].stop("node-lease")  # the workers' stand-in renewals freeze with the node
    assert holds_within(lambda: len(left) >= 2, timeout=TTL + 4), "every worker of the node must leave with its lease"
    assert all(w.lease.lost for w in nodes.groups)


def test_a_worker_on_the_nodes_lease_leaves_it_alive_and_clears_its_earlier_selves(etcd, run_id):
    agent = NodeAgent(etcd, run_id, "node0", ttl=TTL, interval=INTERVAL)
    conn = etcd_conn(etcd)
    try:
        stale = f"/{run_id}/live/join/node0-0-999999"  # a worker killed alone left its join key behind
        conn.call(lambda c: c.put(stale, b"{}", lease=agent.lease_id))
        conn.call(lambda c: c.put(f"/{run_id}/live/alive/node0-0-999999", b"{}", lease=agent.lease_id))
        keep = f"/{run_id}/live/alive/node0-1-999999"  # another local rank's key is not its business
        conn.call(lambda c: c.put(keep, b"{}", lease=agent.lease_id))
        w = group(etcd, run_id, agent, "node0", 0, 2, settings(lease_ttl=TTL, keep_alive_interval=INTERVAL))
        assert conn.call(lambda c: c.get(stale))[0] is None
        assert conn.call(lambda c: c.get(f"/{run_id}/live/alive/node0-0-999999"))[0] is None
        assert conn.call(lambda c: c.get(keep))[0] is not None
        assert conn.call(lambda c: c.get(w.lease.key))[0] is not None
        w.close()
        w.conn.close()
        assert conn.call(lambda c: c.get(w.lease.key))[0] is None, "a worker that leaves deletes its key"
        assert _lease_ttl(conn, agent.lease_id) > 0, "a worker that leaves must not revoke its node's lease"
    finally:
        agent.close()
        conn.close()


def test_the_renewal_record_lets_one_process_claim_a_late_renewal(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    a, b = RenewalRecord(0xABC), RenewalRecord(0xABC)
    try:
        assert a.path == b.path and a.path.startswith(str(tmp_path))
        a.renewed(time.monotonic())
        assert a.claim(due=1.0) is None and b.claim(due=1.0) is None, "not due yet"
        a.renewed(time.monotonic() - 5)
        first = b.claim(due=1.0)
        assert first is not None and a.claim(due=1.0) is None, "a claimed renewal is not claimed twice"
        assert time.monotonic() - a.last() < 1.0
    finally:
        a.close(remove=True)
        b.close()


def test_a_node_keeps_one_etcd_watch_its_sibling_sees_a_joiner_through_it_and_takes_it_over(etcd, run_id):
    """One watch stream per node (``live/node_share.py``): one worker keeps it, the other loads
    its published views, sees a node asking to join as fast, and keeps the watch once the first is gone."""
    left: list[str] = []
    with live_nodes(etcd, run_id, nodes=1, workers=2, max_nodes=2, last_call=0.0, lease_ttl=TTL,
                    keep_alive_interval=INTERVAL, callbacks={"on_lease_lost": left.append}) as nodes:
        workers = nodes.groups
        keeping = [w for w in workers if w.watcher.keeper.stream is not None]
        assert len(keeping) == 1, "exactly one of the node's workers keeps an etcd watch"
        keeper, sibling = keeping[0], next(w for w in workers if w is not keeping[0])
        reads = sibling.watcher.keeper.reads
        conn = etcd_conn(etcd)
        try:
            # A whole node asks to join (its one worker's join key): a planned re-form for both.
            joiner, alive = f"/{run_id}/live/join/node9-0-4242", f"/{run_id}/live/alive/node9-0-4242"
            conn.call(lambda c: c.put(alive, b"{}"))
            conn.call(lambda c: c.put(joiner, b'{"node": "node9", "local_rank": 0, "nproc": 1, "probe": "127.0.0.1:1"}'))
            assert holds_within(lambda: all(w.change_pending.is_set() for w in workers), timeout=3), \
                [w.change_reason for w in workers]
            assert sibling.watcher.keeper.loads >= 2 and sibling.watcher.keeper.reads == reads, \
                "the sibling read etcd itself"
            conn.call(lambda c: c.delete(joiner))
            conn.call(lambda c: c.delete(alive))
            keeper.close()  # the keeping worker leaves: its lock goes with it
            assert holds_within(lambda: sibling.watcher.keeper.stream is not None, timeout=2), \
                "the sibling must take the watch"
            assert not left
        finally:
            conn.close()


def test_an_agents_first_record_sweeps_what_killed_agents_left_and_nothing_alive(tmp_path, monkeypatch):
    """A killed agent leaves its record and node directory in the temp dir; the next agent's first
    renewal removes those untouched for an hour, and keeps fresh ones, their directories, links and
    other files."""
    import os
    import tempfile

    from elastic_trainer.rendezvous.node_lease import STALE_AFTER, AgentRecord, node_dir, record_path

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    old = time.time() - STALE_AFTER - 60

    def left_by_a_killed_agent(lease_id: int, *, age: float) -> None:
        RenewalRecord(lease_id).close()
        os.makedirs(os.path.join(node_dir(lease_id), "share"))
        for path in (os.path.join(node_dir(lease_id), "share"), node_dir(lease_id), record_path(lease_id)):
            os.utime(path, (age, age))

    left_by_a_killed_agent(0x1, age=old)
    left_by_a_killed_agent(0x2, age=time.time())  # a live node's (another job of the user)
    orphan = node_dir(0x3)  # a directory whose record is gone
    os.makedirs(orphan)
    os.utime(orphan, (old, old))
    target = tmp_path / "not-ours"
    target.write_text("x")
    os.symlink(target, record_path(0x4))  # a link is never followed nor removed
    os.utime(record_path(0x4), (old, old), follow_symlinks=False)
    other = tmp_path / "elastic-trainer-notes"
    other.write_text("x")
    os.utime(other, (old, old))

    agent = AgentRecord()
    try:
        agent(0x5, time.monotonic())
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(os.path.basename(p) for p in (record_path(0x2), node_dir(0x2), record_path(0x4),
                                                           record_path(0x5), str(target), str(other))), left
        assert target.read_text() == "x"
    finally:
        agent.close()
    assert not os.path.exists(record_path(0x5))  # its own removed at its close
