"""The live watcher's etcd watch (``rendezvous/live_watch.py``) on a real etcd: a lost lease wakes
every watcher, a cancelled or compacted watch and an etcd restart are recovered from without
missing a change, a watcher at rest reads nothing, and the view a watcher keeps from the watch's
events (``members.LiveKeys``) equals a fresh read after a burst of changes, with one whole read
per watch established (the request rate itself is measured by ``benchmarks/etcd_load.py``, and
the cost of an event at 1,000 nodes by ``benchmarks/live_sim.py``, not asserted here)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from elastic_trainer.env import LiveSettings
from elastic_trainer.etcd.server import EtcdServer
from elastic_trainer.rendezvous.live_watch import KeysWatch
from elastic_trainer.rendezvous.members import Change, LiveKeys, Member, Quorum
from elastic_trainer.rendezvous.quorum import LiveGroup
from tests.helpers.common import etcd_conn as _conn, holds_within as wait_until

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
    """A ``KeysWatch`` on ``<run>/a/`` and ``<run>/k`` with its thread; yields (watch, seen, conn, prefix)."""
    conn = _conn(etcd)
    prefix = f"/{run_id}/"
    seen = _Seen()
    watch = KeysWatch(conn, [prefix + "a/", prefix + "k"], seen)
    thread = threading.Thread(target=watch.run, name="test-watch", daemon=True)
    thread.start()
    assert watch.established.wait(5)
    try:
        yield watch, seen, conn, prefix
    finally:
        watch.close()
        thread.join(5)
        assert not thread.is_alive(), "close() must end the watch's thread"
        conn.close()


def test_a_change_under_a_watched_prefix_or_key_wakes_the_watch_and_others_do_not(watched):
    _, seen, conn, prefix = watched
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
    watches = [(KeysWatch(c, [prefix], seen := _Seen()), seen) for c in conns]
    threads = [threading.Thread(target=w.run, daemon=True) for w, _ in watches]
    for t in threads:
        t.start()
    try:
        assert all(w.established.wait(5) for w, _ in watches)
        lease = conns[0].call(lambda c: c.lease(1))
        conns[0].call(lambda c: c.put(prefix + "gone", b"", lease=lease.id))
        time.sleep(0.2)
        counts = [s.count for _, s in watches]
        started = time.monotonic()  # the lease is never renewed: etcd expires it within ~1-2 s
        assert all(s.wait_next(n, timeout=6) for (_, s), n in zip(watches, counts)), \
            "every watcher must be woken by the expiry of a lease"
        assert not conns[1].call(lambda c: c.get(prefix + "gone"))[0]
        assert time.monotonic() - started < 4
    finally:
        for w, _ in watches:
            w.close()
        for t in threads:
            t.join(5)
        for c in conns:
            c.close()


def test_a_watch_that_etcd_cancels_is_reopened_and_misses_no_change(watched):
    watch, seen, conn, prefix = watched
    opened, n = watch.opened, seen.count
    # cancel the stream under the watch, as a compaction or an etcd-side cancel ends it
    with watch._lock:
        watch._call.cancel()
    # a change while the stream is down is covered by the read that the re-open asks for
    conn.call(lambda c: c.put(prefix + "a/while-down", b"1"))
    assert wait_until(lambda: watch.opened > opened and watch.established.is_set(), timeout=5)
    assert seen.count >= n + 2, "the lost stream and the re-opened one must each ask for a read"
    n = seen.count
    conn.call(lambda c: c.put(prefix + "a/after", b"1"))
    assert seen.wait_next(n), "the re-opened watch must report changes"


def test_a_compacted_history_does_not_break_the_watch(watched):
    _, seen, conn, prefix = watched
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
    watch = KeysWatch(conn, [f"/{run_id}/a/"], seen)
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


def _group(etcd, run_id, local_rank: int, **settings) -> LiveGroup:
    s = LiveSettings(**{"min_nodes": 1, "max_nodes": 2, "last_call": 0.0, "join_timeout": 20, **settings})
    return LiveGroup(_conn(etcd), f"/{run_id}/", f"node{local_rank}", 0, 1, "127.0.0.1", s)


def test_a_training_group_at_rest_reads_etcd_only_when_a_live_key_changes(etcd, run_id):
    group = _group(etcd, run_id, 0)
    try:
        group.join()
        lost: list[str] = []
        group.on_member_lost = lost.append
        group.start_watching()
        assert wait_until(lambda: group.watcher.reads >= 1, timeout=5)
        time.sleep(0.5)
        reads, requests = group.watcher.reads, group.requests
        time.sleep(1.5)  # fifteen polls' worth under the old watcher
        assert group.watcher.reads == reads and group.requests == requests, \
            "a watcher at rest must not read etcd"
        other = _group(etcd, run_id, 1)  # a node that asks to join: one event, applied without a read
        try:
            other._lease.put(other._key("join/" + other.id), b'{"node": "node1", "local_rank": 0, "nproc": 1}')
            assert wait_until(group.change_pending.is_set, timeout=3), "a joiner must be seen through the watch"
            assert "join" in group.change_reason
        finally:
            other.close()
        assert not lost
    finally:
        group.close()


def test_a_members_lost_lease_is_seen_within_the_lease_not_a_poll(etcd, run_id):
    # min_nodes 2: with 1 (and no last call) the first joiner could form a quorum alone before
    # the other's join key was written (seen once in CI), and the other then waits for a re-form
    a, b = _group(etcd, run_id, 0, lease_ttl=2, min_nodes=2), _group(etcd, run_id, 1, lease_ttl=2, min_nodes=2)
    try:
        threads = [threading.Thread(target=g.join, daemon=True) for g in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert a.quorum is not None and a.quorum.world_size == 2
        lost: list[str] = []
        a.on_member_lost = lost.append
        a.start_watching()
        assert wait_until(lambda: a.watcher.reads >= 1, timeout=5)
        b._lease._stop.set()  # b stops renewing: frozen, as far as etcd can tell
        stopped = time.monotonic()
        assert wait_until(lambda: lost, timeout=6), "the lost lease must abandon the group"
        assert "lease" in lost[0]
        assert time.monotonic() - stopped < 2 + 1.5  # the TTL and etcd's expiry tick, no poll on top
    finally:
        a.close()
        b._lease.close(revoke=True)
        b._probe.close()



# ---- the view kept from the watch's events --------------------------------------------------------------
def _state(keys: LiveKeys) -> tuple:
    return (keys.quorum, keys.quorum_rev, sorted(keys.alive), dict(keys.joiners), dict(keys.stalls),
            dict(keys.busy), list(keys.missing))


def _quorum(q: int, *ids: str) -> Quorum:
    return Quorum(q=q, members=tuple(Member(i, i.split("-")[0], 0, "127.0.0.1:1") for i in ids))


def test_live_keys_from_changes_equal_a_load_of_the_result_and_keep_the_missing_members():
    p = "/r/live/"
    q1 = _quorum(1, "a-0", "b-0", "c-0")
    changes = [Change(p + "quorum", q1.to_json(), 5, 5), Change(p + "alive/a-0", b"{}", 6, 6),
               Change(p + "alive/b-0", b"{}", 7, 7), Change(p + "alive/c-0", b"{}", 8, 8),
               Change(p + "join/d-0", b'{"node": "d", "local_rank": 0, "nproc": 1}', 9, 9),
               Change(p + "busy/a-0", b'{"q": 1, "what": "checkpoint"}', 10, 10),
               Change(p + "stall/1", b'{"by": "b-0"}', 11, 11), Change(p + "join/e-0", b"not json", 12, 12),
               Change(p + "other", b"1", 13, 13), Change(p + "alive/b-0", None, 0, 14),
               Change(p + "busy/a-0", None, 0, 15)]
    keys = LiveKeys(p)
    keys.load([])
    keys.track(q1)
    for change in changes:
        keys.apply(change)
    assert list(keys.missing) == ["b-0"], "a member whose alive key was deleted is missing"
    fresh = LiveKeys(p)
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


def _fresh(group: LiveGroup) -> LiveKeys:
    keys = LiveKeys(group.prefix)
    keys.load(group.watcher._read_all())
    keys.track(group.quorum)
    return keys


def test_the_view_kept_from_events_equals_a_fresh_read_after_a_burst_of_changes(etcd, run_id):
    group = _group(etcd, run_id, 0)
    conn = _conn(etcd)
    try:
        group.join()
        group.start_watching()
        assert wait_until(lambda: group.watcher.reads >= 1, timeout=5)
        p = group.prefix
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
        moved = _quorum(group.quorum.q + 1, group.id, "n1-0")
        conn.call(lambda c: c.put(p + "quorum", moved.to_json()))
        conn.call(lambda c: c.revoke_lease(lease.id))  # a node lost: its 20 alive keys at once
        assert wait_until(lambda: _state(group.watcher._keys) == _state(_fresh(group)), timeout=5), \
            "the view kept from the watch's events must equal a fresh read"
        assert group.watcher.reads == 1, "changes are applied from the events, not read again"
        assert group.watcher.applied >= 20 + 20 + 7 + 3 + 1 + 20
    finally:
        group.close()
        conn.close()


def test_a_watch_lost_with_a_change_in_between_makes_the_watcher_read_everything_again(etcd, run_id):
    group = _group(etcd, run_id, 0)
    conn = _conn(etcd)
    try:
        group.join()
        group.start_watching()
        assert wait_until(lambda: group.watcher._watch is not None and group.watcher._watch.established.is_set()
                          and group.watcher.reads >= 1, timeout=5)
        watch, p = group.watcher._watch, group.prefix
        opened = watch.opened
        with watch._lock:
            watch._call.cancel()  # as etcd's cancel or a compaction ends it: the next change has no event
        conn.call(lambda c: c.put(p + "join/while-down-0", b'{"node": "while", "local_rank": 0, "nproc": 1}'))
        assert wait_until(lambda: watch.opened > opened and group.watcher.reads >= 2, timeout=5), \
            "a re-established watch must be followed by a whole read"
        assert wait_until(lambda: "while-down-0" in group.watcher._keys.joiners, timeout=5), \
            "the change made while the watch was down must be in the view"
        assert _state(group.watcher._keys) == _state(_fresh(group))
    finally:
        group.close()
        conn.close()
