"""The live watcher's etcd watch (``live/stream.py``) on a real etcd: a lost lease wakes every
stream, a cut or compacted stream and an etcd restart are recovered from without missing a
change, a watcher at rest reads nothing, the view a watcher keeps from the stream's events
(``live/mirror.py``) equals a fresh read after a burst of changes, with one whole read per stream
established, and a member that leaves cleanly is a departure, not a loss (no warning; none at all
once the run is finished). The request rate itself is measured by ``benchmarks/etcd_load.py``,
and the cost of an event at 1,000 nodes by ``benchmarks/live_sim.py``, not asserted here."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta

import pytest

from elastic_trainer.etcd.server import EtcdServer
from elastic_trainer.etcd.store import EtcdStore
from elastic_trainer.live.group import LiveGroup
from elastic_trainer.live.keys import Change
from elastic_trainer.live.mirror import Mirror
from elastic_trainer.live.quorum import Member, Quorum
from elastic_trainer.live.stream import WatchStream
from tests.helpers.common import etcd_conn as _conn, holds_within as wait_until
from tests.helpers.live_nodes import CutProxy, NodeAgent, live_nodes, settings

pytestmark = pytest.mark.timeout(120)


class _Seen:
    """Counts ``on_change`` calls; ``wait_next()`` waits for one after now."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def __call__(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_next(self, since: int, timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count > since, timeout)


@pytest.fixture
def watched(etcd, run_id):
    """A ``WatchStream`` on ``<run>/a/`` and ``<run>/k`` through a ``CutProxy``, with its thread;
    yields (watch, seen, conn, prefix, proxy): ``conn`` talks to etcd directly."""
    proxy = CutProxy("127.0.0.1", int(etcd.endpoint.rsplit(":", 1)[1]))
    through, conn = _conn(proxy.endpoint), _conn(etcd)
    prefix = f"/{run_id}/"
    seen = _Seen()
    watch = WatchStream(through, [prefix + "a/", prefix + "k"], seen)
    thread = threading.Thread(target=watch.run, name="test-watch", daemon=True)
    thread.start()
    assert watch.established.wait(5)
    try:
        yield watch, seen, conn, prefix, proxy
    finally:
        watch.close()
        thread.join(5)
        assert not thread.is_alive(), "close() must end the watch's thread"
        for c in (through, conn):
            c.close()
        proxy.close()


def test_a_change_under_a_watched_prefix_or_key_wakes_the_watch_and_others_do_not(watched):
    _, seen, conn, prefix, _ = watched
    for key in (prefix + "a/x", prefix + "k"):
        n = seen.count
        conn.call(lambda c, k=key: c.put(k, b"1"))
        assert seen.wait_next(n), f"a put of {key} must wake the watch"
    n = seen.count
    conn.call(lambda c: c.put(prefix + "other", b"1"))
    conn.call(lambda c: c.put(prefix + "k2", b"1"))
    time.sleep(0.3)
    assert seen.count == n, "keys outside the watched ones must not wake it"


def test_a_lost_lease_wakes_every_watcher_of_its_key(etcd, run_id):
    conns = [_conn(etcd) for _ in range(3)]
    prefix = f"/{run_id}/alive/"
    watches = [(WatchStream(c, [prefix], seen := _Seen()), seen) for c in conns]
    threads = [threading.Thread(target=w.run, daemon=True) for w, _ in watches]
    for t in threads:
        t.start()
    try:
        assert all(w.established.wait(5) for w, _ in watches)
        lease = conns[0].call(lambda c: c.lease(1))
        conns[0].call(lambda c: c.put(prefix + "gone", b"", lease=lease.id))
        time.sleep(0.2)
        counts = [s.count for _, s in watches]  # the lease is never renewed: etcd expires it within ~1-2 s
        assert all(s.wait_next(n, timeout=6) for (_, s), n in zip(watches, counts)), \
            "every watcher must be woken by the expiry of a lease"
        assert not conns[1].call(lambda c: c.get(prefix + "gone"))[0]
    finally:
        for w, _ in watches:
            w.close()
        for t in threads:
            t.join(5)
        for c in conns:
            c.close()


def test_a_stream_that_is_cut_is_opened_again_and_misses_no_change(watched):
    watch, seen, conn, prefix, proxy = watched
    opened, n = watch.opened, seen.count
    proxy.cut()  # the connection under the stream ends, as a network cut or etcd's side ends it
    # a change while the stream is down is covered by the read that the re-open asks for
    conn.call(lambda c: c.put(prefix + "a/while-down", b"1"))
    assert wait_until(lambda: watch.opened > opened and watch.established.is_set(), timeout=5)
    assert seen.count >= n + 2, "the lost stream and the re-opened one must each ask for a read"
    n = seen.count
    conn.call(lambda c: c.put(prefix + "a/after", b"1"))
    assert seen.wait_next(n), "the re-opened watch must report changes"


def test_a_compacted_history_does_not_break_the_watch(watched):
    _, seen, conn, prefix, _ = watched
    for i in range(5):
        conn.call(lambda c, i=i: c.put(prefix + "a/churn", str(i).encode()))
    rev = conn.call(lambda c: c.get(prefix + "a/churn"))[1].mod_revision
    conn.call(lambda c: c.compact(rev, physical=True))
    n = seen.count
    conn.call(lambda c: c.put(prefix + "a/x", b"2"))
    assert seen.wait_next(n), "a watch from 'now' lives through a compaction"


def test_an_etcd_restart_mid_watch_reopens_the_watch_and_reports_what_changed_meanwhile(tmp_path, run_id):
    server = EtcdServer(data_dir=tmp_path / "data")
    server.start()
    conn = _conn(server)
    seen = _Seen()
    watch = WatchStream(conn, [f"/{run_id}/a/"], seen)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    try:
        assert watch.established.wait(5)
        n = seen.count
        server.stop()
        assert seen.wait_next(n, timeout=5), "a lost stream must make the watcher read again"
        server.start()
        assert wait_until(lambda: watch.opened >= 2 and watch.established.is_set(), timeout=15), \
            "the watch must be re-established once etcd is back"
        n = seen.count
        conn.call(lambda c: c.put(f"/{run_id}/a/x", b"1"))
        assert seen.wait_next(n)
    finally:
        watch.close()
        thread.join(5)
        conn.close()
        server.stop()


def test_a_training_group_at_rest_reads_etcd_only_when_a_live_key_changes(etcd, run_id):
    lost: list[str] = []
    with live_nodes(etcd, run_id, nodes=1, max_nodes=2, last_call=0.0, callbacks={"on_member_lost": lost.append}) as nodes:
        group = nodes.groups[0]
        time.sleep(0.5)
        reads, requests = group.watcher.keeper.reads, group.keys.requests
        time.sleep(1.5)  # fifteen polls' worth under the old watcher
        assert group.watcher.keeper.reads == reads and group.keys.requests == requests, \
            "a watcher at rest must not read etcd"
        agent = NodeAgent(etcd, run_id, "node1")  # a node that asks to join: one event, applied without a read
        try:
            conn = _conn(etcd)
            key = group.keys.key("join/node1-0-4242")
            conn.call(lambda c: c.put(group.keys.key("alive/node1-0-4242"), b"{}", lease=agent.lease_id))
            conn.call(lambda c: c.put(key, b'{"node": "node1", "local_rank": 0, "nproc": 1}', lease=agent.lease_id))
            assert wait_until(group.change_pending.is_set, timeout=3), "a joiner must be seen through the watch"
            assert "join" in group.change_reason and group.watcher.keeper.reads == reads
            conn.close()
        finally:
            agent.close()
        assert not lost


def test_a_members_lost_lease_is_seen_through_the_watch_and_abandons_the_group(etcd, run_id):
    lost: list[str] = []
    with live_nodes(etcd, run_id, nodes=2, lease_ttl=2, callbacks={"on_member_lost": lost.append}) as nodes:
        a, b = nodes.groups
        reads = a.watcher.keeper.reads
        nodes.freeze(b)  # b's node stops renewing: frozen, as far as etcd can tell
        assert wait_until(lambda: lost, timeout=2 + 4), "the lost lease must abandon the group"
        assert f"the etcd lease of {b.id} expired" in lost[0]
        assert a.watcher.keeper.reads == reads, "the expiry came as the watch's event, not from a read"
        assert a.watcher.loss_of(a.quorum) == lost[0]


def test_a_member_that_leaves_cleanly_is_a_departure_and_after_the_run_finished_nothing(etcd, run_id, caplog):
    """At every normal end of a live run a survivor warned that a peer's lease "expired (stopped or
    cut off)". A peer that closes its group marks its key as left before it deletes it: the others
    re-form without a warning; and once rank 0 marked the run finished, nobody's leaving is a loss."""
    caplog.set_level(logging.INFO, logger="elastic_trainer.live")
    lost: list[str] = []
    with live_nodes(etcd, run_id, nodes=3, callbacks={"on_member_lost": lost.append}) as nodes:
        first, second, third = nodes.groups
        third.close()  # left mid-run (its loop raised, say): the group must re-form, but it is no failure
        assert wait_until(lambda: len(lost) >= 2, timeout=5), lost
        assert all(f"{third.id} left the group" in why for why in lost), lost
        assert first.change_pending.is_set() and "left" in first.change_reason
        first.finish()  # the run's normal end: rank 0 marks it finished, then everybody leaves
        ends = len(lost)
        quorum = first.quorum
        second.close()
        time.sleep(0.5)  # five polls: a loss would have been seen
        assert len(lost) == ends, f"leaving a finished run is no loss: {lost[ends:]}"
        assert first.watcher.loss_of(quorum) == lost[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "live:" in r.getMessage()]
    assert warnings == [], warnings


# ---- the view kept from the watch's events --------------------------------------------------------------
def _state(keys: Mirror) -> tuple:
    """What a mirror knows, but the departures it saw (a fresh read after a departed key was
    deleted cannot know them)."""
    return (keys.quorum, keys.quorum_rev, sorted(keys.alive), dict(keys.joiners), dict(keys.stalls),
            dict(keys.busy), list(keys.missing))


def _quorum(q: int, *ids: str) -> Quorum:
    return Quorum(q=q, members=tuple(Member(i, i.split("-")[0], 0, "127.0.0.1:1") for i in ids))


def test_a_mirror_from_changes_equals_a_load_of_the_result_and_keeps_the_missing_members():
    p = "/r/live/"
    q1 = _quorum(1, "a-0", "b-0", "c-0")
    changes = [Change(p + "quorum", q1.to_json(), 5, 5), Change(p + "alive/a-0", b"{}", 6, 6),
               Change(p + "alive/b-0", b"{}", 7, 7), Change(p + "alive/c-0", b"{}", 8, 8),
               Change(p + "join/d-0", b'{"node": "d", "local_rank": 0, "nproc": 1}', 9, 9),
               Change(p + "busy/a-0", b'{"q": 1, "what": "checkpoint"}', 10, 10),
               Change(p + "stall/1", b'{"by": "b-0"}', 11, 11), Change(p + "join/e-0", b"not json", 12, 12),
               Change(p + "other", b"1", 13, 13), Change(p + "alive/b-0", None, 0, 14),
               Change(p + "busy/a-0", None, 0, 15)]
    keys = Mirror(p)
    keys.load([])
    keys.track(q1)
    for change in changes:
        keys.apply(change)
    assert list(keys.missing) == ["b-0"], "a member whose alive key was deleted is missing"
    fresh = Mirror(p)
    fresh.load([Change(p + "quorum", q1.to_json(), 5, 5), Change(p + "alive/a-0", b"{}", 6, 6),
                Change(p + "alive/c-0", b"{}", 8, 8),
                Change(p + "join/d-0", b'{"node": "d", "local_rank": 0, "nproc": 1}', 9, 9),
                Change(p + "stall/1", b'{"by": "b-0"}', 11, 11), Change(p + "join/e-0", b"not json", 12, 12)])
    fresh.track(q1)
    assert _state(keys) == _state(fresh)
    view = keys.view(1)
    assert view.stall == {"by": "b-0"} and view.busy == {} and keys.view(2).stall is None
    keys.apply(Change(p + "alive/b-0", b"{}", 16, 16))
    assert not keys.missing, "a member whose alive key is back is not missing"
    keys.track(_quorum(2, "a-0", "z-0"))
    assert list(keys.missing) == ["z-0"], "a new quorum is tracked from the alive keys known"
    assert keys.view(2).quorum is keys.quorum


def _fresh(group: LiveGroup) -> Mirror:
    keys = Mirror(group.keys.prefix)
    keys.load(group.keys.read_watched())
    keys.track(group.quorum)
    return keys


def test_the_view_kept_from_events_equals_a_fresh_read_after_a_burst_of_changes(etcd, run_id):
    conn = _conn(etcd)
    with live_nodes(etcd, run_id, nodes=1) as nodes:
        group = nodes.groups[0]
        keeper = group.watcher.keeper
        p = group.keys.prefix
        lease = conn.call(lambda c: c.lease(30))
        for i in range(20):  # alive keys on one lease (a node), joiners, busy and stall keys, the quorum
            conn.call(lambda c, i=i: c.put(f"{p}alive/n{i}-0", b"{}", lease=lease.id))
            conn.call(lambda c, i=i: c.put(f"{p}join/n{i}-0", json.dumps(
                {"node": f"n{i}", "local_rank": 0, "nproc": 1}).encode()))
            if i % 3 == 0:
                conn.call(lambda c, i=i: c.delete(f"{p}join/n{i}-0"))
        conn.call(lambda c: c.put(p + "busy/x", b'{"q": 1, "what": "checkpoint"}'))
        conn.call(lambda c: c.put(p + "stall/7", b'{"by": "x"}'))
        conn.call(lambda c: c.delete(p + "busy/x"))
        conn.call(lambda c: c.put(p + "alive/n0-0", b'{"left": 1}', lease=lease.id))  # n0 leaves cleanly
        moved = _quorum(group.quorum.q + 1, group.id, "n1-0")
        conn.call(lambda c: c.put(p + "quorum", moved.to_json()))
        conn.call(lambda c: c.revoke_lease(lease.id))  # a node lost: its 20 alive keys at once
        assert wait_until(lambda: _state(keeper.mirror) == _state(_fresh(group)), timeout=5), \
            "the view kept from the watch's events must equal a fresh read"
        assert keeper.reads == 1, "changes are applied from the events, not read again"
        assert keeper.applied >= 20 + 20 + 7 + 4 + 1 + 20
        assert keeper.mirror.left == {"n0-0"}, "a departure seen through the watch is remembered"
    conn.close()


def test_a_stream_lost_with_a_change_in_between_makes_the_watcher_read_everything_again(etcd, run_id):
    proxy = CutProxy("127.0.0.1", int(etcd.endpoint.rsplit(":", 1)[1]))
    conn = _conn(etcd)
    agent = NodeAgent(etcd, run_id, "node0")
    group = LiveGroup.make(_conn(proxy.endpoint), f"/{run_id}/", "node0", 0, 1, "127.0.0.1",
                           settings(max_nodes=1), agent.lease_id)
    try:
        group.join()
        keeper = group.watcher.keeper
        assert wait_until(lambda: keeper.stream is not None and keeper.stream.established.is_set()
                          and keeper.reads >= 1, timeout=5)
        opened, p = keeper.stream.opened, group.keys.prefix
        proxy.cut()  # the next change has no event on the stream that was cut
        conn.call(lambda c: c.put(p + "join/while-down-0", b'{"node": "while", "local_rank": 0, "nproc": 1}'))
        assert wait_until(lambda: keeper.stream.opened > opened and keeper.reads >= 2, timeout=5), \
            "a re-established stream must be followed by a whole read"
        assert wait_until(lambda: "while-down-0" in keeper.mirror.joiners, timeout=5), \
            "the change made while the stream was down must be in the view"
        assert _state(keeper.mirror) == _state(_fresh(group))
    finally:
        group.close()
        group.conn.close()
        agent.close()
        conn.close()
        proxy.close()


def test_a_store_wait_woken_by_a_watch_on_its_keys_looks_again_at_once(etcd, run_id):
    """``LiveGroup.watch`` on a store's prefix wakes a wait in it when a key is set (a quorum's group
    forms once its last member's address is in, not at the others' next poll). The store's polls
    are 60 s apart here, so only the watch can end the wait within the test's 15 s."""
    with live_nodes(etcd, run_id, nodes=1) as nodes:
        group = nodes.groups[0]
        store = EtcdStore(_conn(etcd), group.keys.key("store/woken/"), timeout=timedelta(seconds=120))
        store.poll_min = store.poll_max = 60.0
        store.woken = threading.Event()
        stop = group.watch(store.prefix, store.woken.set)
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(store.get("address")), daemon=True)
        try:
            waiter.start()
            time.sleep(0.5)  # its first read found nothing: it waits
            EtcdStore(_conn(etcd), store.prefix).set("address", b"127.0.0.1:4242")
            waiter.join(15)
            assert got == [b"127.0.0.1:4242"], "the watch did not wake the store's wait"
        finally:
            stop()


def test_a_groups_store_answers_from_the_standing_watch_without_asking_etcd(etcd, run_id):
    """From ``join`` on, a worker watches every quorum's store (``LiveGroup.stores``): the addresses
    its peers write when a group forms reach it as events, and its group's store answers them
    without a request (gloo asks for each peer's address in turn: one etcd round trip each)."""
    with live_nodes(etcd, run_id, nodes=1) as nodes:
        group = nodes.groups[0]
        store = group.store()
        peer = EtcdStore(_conn(etcd), store.prefix)
        peer.set("rank_1", b"127.0.0.1:4343")
        assert wait_until(lambda: (store.prefix + "rank_1").encode() in group.stores.seen, 10), \
            "the standing watch did not deliver the peer's key"
        before = store.requests
        assert store.get("rank_1") == b"127.0.0.1:4343"
        assert store.requests == before, "the store asked etcd for a key the watch had delivered"
        assert store.check(["rank_1"])  # check asks etcd, as c10d's stores do
        peer.delete_key("rank_1")
        assert wait_until(lambda: (store.prefix + "rank_1").encode() not in group.stores.seen, 10)
