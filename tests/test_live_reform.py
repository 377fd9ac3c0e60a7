"""The live re-form's one proposer (``live/reform.py``) on a real etcd, with every node on its agent's
lease as ``elastic-train`` runs it: the first member writes the next quorum from its standing
report feed while the others, following it through their watch, read nothing; the first three
candidates keep the feed, and a proposer without one reads the reports itself; a proposer killed
(its probe port refuses), one whose node froze (its lease expired, seen through the watch) and one
alive but silent are taken over, so a dead proposer never blocks a re-form."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from elastic_trainer.live.quorum import LiveExcluded, RunFinished
from elastic_trainer.live.stream import WatchStream
from tests.helpers.common import holds_within
from tests.helpers.live_nodes import live_nodes

pytestmark = pytest.mark.timeout(120)


class _Reads:
    """Counts the live keys' reads each re-form thread makes (``LiveKeys.read``/``read_reports``)."""

    def __init__(self, groups) -> None:
        self.by: dict[str, int] = {g.id: 0 for g in groups}
        for g in groups:
            for name in ("read", "read_reports"):
                setattr(g.keys, name, self._counted(g.id, getattr(g.keys, name)))

    def _counted(self, gid: str, read):
        def call(*args, **kwargs):
            if threading.current_thread().name == f"reform {gid}":
                self.by[gid] += 1
            return read(*args, **kwargs)
        return call


def _reform(groups, timeout: float | None = None, late: dict[str, float] | None = None) -> tuple[dict, dict]:
    """Every group re-forms at once, each in a thread named ``reform <id>`` (those in ``late``: that
    many seconds later): (id -> quorum or the error, id -> seconds from its own start)."""
    got, took = {}, {}

    def one(g) -> None:
        time.sleep((late or {}).get(g.id, 0.0))
        t = time.monotonic()
        try:
            got[g.id] = g.reform(7, "test", report_timeout=timeout)
        except LiveExcluded as exc:
            got[g.id] = exc
        took[g.id] = time.monotonic() - t

    threads = [threading.Thread(target=one, args=(g,), name=f"reform {g.id}", daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got, took


def _formed_without_the_first(got: dict, rest: list):
    """The quorum the others adopted: the same for all of them, of them alone, in their order."""
    q = got[rest[0].id]
    assert q.q == 2 and [m.id for m in q.members] == [g.id for g in rest]
    assert all(got[g.id] == q for g in rest), "every survivor must adopt the one quorum written"
    return q


def _feeds() -> int:
    return sum(t.name == "live-report-watch" and t.is_alive() for t in threading.enumerate())


def test_one_proposer_writes_the_quorum_and_no_member_reads_etcd_in_the_round(etcd, run_id):
    with live_nodes(etcd, run_id) as nodes:
        groups = nodes.groups
        reads = _Reads(groups)
        got, _ = _reform(groups)
        q = got[groups[0].id]
        assert q.q == 2 and q.world_size == 3 and q.step == 7
        assert all(got[g.id] == q for g in groups), "every member must adopt the one quorum written"
        assert reads.by == {g.id: 0 for g in groups}, \
            f"the proposer follows the reports through its feed, the others the quorum through their watch: {reads.by}"


def _one_report_late(groups, by: float) -> tuple[dict, dict]:
    """Every group re-forms, the last in member order ``by`` seconds late: (reads, took) by id,
    once all adopted the one quorum of them all."""
    reads = _Reads(groups)
    got, took = _reform(groups, late={groups[-1].id: by})
    q = got[groups[0].id]
    assert q.q == 2 and q.world_size == len(groups) and all(got[g.id] == q for g in groups)
    return reads.by, took


def test_the_proposer_follows_a_late_report_and_writes_the_quorum_right_after_it(etcd, run_id):
    with live_nodes(etcd, run_id) as nodes:
        groups = nodes.groups
        late = groups[2]
        reads, took = _one_report_late(groups, 1.0)
        # Following the feed, the proposer reads nothing while it waits the second for the late report;
        # polling (a read per look, every few ms) would make dozens. One read is its documented fallback
        # when its watcher's last view is over a second old (the watcher thread starved on a loaded
        # machine: CI saw it once), so the bound is 1, not 0.
        assert reads[groups[0].id] <= 1, f"the proposer must wait for the late report on its feed: {reads}"
        conn = groups[0].conn
        report = conn.call(lambda c: c.get(late.keys.key(f"report/2/{late.id}")))[1]
        quorum = conn.call(lambda c: c.get(late.keys.key("quorum")))[1]
        assert quorum.mod_revision == report.mod_revision + 1, "the quorum is etcd's next write after the last report"
        # The late member's whole round (its report, the proposer's look, the compare-and-swap, its
        # watch's event): median 7.0 ms, 5.1-38.4 ms over 30 runs on 2 cores at load 11; 1 s is the margin.
        assert took[late.id] < 1.0, took


def test_the_first_three_candidates_keep_a_report_feed_and_a_proposer_without_one_reads(etcd, run_id):
    """Four nodes: the first member of each of the first three keeps a standing watch on the
    reports from the moment it adopted the quorum; the fourth does not. With the first three nodes
    frozen, the fourth proposes alone: it reads the reports itself."""
    before = _feeds()
    with live_nodes(etcd, run_id, nodes=4, lease_ttl=2, report_timeout=10.0) as nodes:
        groups = nodes.groups
        assert holds_within(lambda: _feeds() - before == 3, 5), "the first three candidates keep a feed"
        for g in groups[:3]:
            nodes.freeze(g)
        last = groups[3]
        reads = _Reads([last])
        got, _ = _reform([last], timeout=10.0)
        q = got[last.id]
        assert [m.id for m in q.members] == [last.id] and reads.by[last.id] >= 1
        assert holds_within(lambda: _feeds() - before >= 1, 5), "it keeps a feed once it is a first candidate"


def test_a_proposer_whose_report_stream_never_opens_reads_the_reports(etcd, run_id):
    class NeverOpens(WatchStream):
        def run(self) -> None:  # never established
            return None

    def streams(conn, keys, on_change, on_events=None):
        kind = NeverOpens if keys[0].endswith("/report/") else WatchStream
        return kind(conn, keys, on_change, on_events=on_events)

    with live_nodes(etcd, run_id, callbacks={"stream_factory": streams}) as nodes:
        groups = nodes.groups
        reads, _ = _one_report_late(groups, 0.5)
        assert reads[groups[0].id] > 3, f"without its feed the proposer reads the reports: {reads}"
        assert reads[groups[1].id] == reads[groups[2].id] == 0, reads


def test_a_killed_proposer_is_taken_over_by_the_next_in_line(etcd, run_id):
    with live_nodes(etcd, run_id, report_timeout=10.0) as nodes:
        dead, rest = nodes.groups[0], nodes.groups[1:]
        nodes.kill(dead)  # its process is gone: the port refuses; its node's lease lives on
        got, took = _reform(rest, timeout=10.0)
        _formed_without_the_first(got, rest)
        assert max(took.values()) < 10.0, f"the backup must find the proposer dead by its probe, not wait: {took}"


def test_a_proposer_whose_node_froze_is_taken_over_through_the_watch(etcd, run_id):
    with live_nodes(etcd, run_id, lease_ttl=2, report_timeout=10.0) as nodes:
        frozen, rest = nodes.groups[0], nodes.groups[1:]
        nodes.freeze(frozen)  # its probe port still accepts: only the lease's expiry tells
        got, took = _reform(rest, timeout=10.0)
        _formed_without_the_first(got, rest)
        assert max(took.values()) < 10.0, f"the next in line must propose once the lease expired: {took}"


def test_a_silent_proposer_is_overtaken_by_a_backup_at_report_timeout(etcd, run_id, caplog):
    caplog.set_level(logging.INFO, logger="elastic_trainer.live.reform")
    with live_nodes(etcd, run_id, nodes=4) as nodes:
        silent, rest = nodes.groups[0], nodes.groups[1:]
        got, took = _reform(rest, timeout=1.0)  # the proposer lives but never reports
        _formed_without_the_first(got, rest)
        writers = [r.threadName for r in caplog.records if "quorum 2 formed" in r.getMessage()]
        backups = [f"reform {g.id}" for g in rest[:2]]  # the two next in line; the third follows
        assert len(writers) == 1 and writers[0] in backups, \
            f"a backup writes it at report_timeout, not the follower after the grace: {writers}"
        writer = writers[0].split(" ", 1)[1]
        assert took[writer] >= 1.0, f"nobody may drop a live member before report_timeout: {took}"
        assert holds_within(lambda: silent.change_pending.is_set(), timeout=5), \
            "the silent member's watcher sees the quorum move on"


def test_a_worker_that_re_forms_after_the_run_finished_ends_and_forms_no_quorum_of_its_own(etcd, run_id):
    """A newcomer whose state never came (the members stopped while its group formed ahead) re-forms
    with step -1; the members finished meanwhile: it must end (``RunFinished``, exit 0), not propose
    a quorum of itself that would train from nothing."""
    with live_nodes(etcd, run_id, nodes=2) as nodes:
        first, late = nodes.groups
        first.finish()  # rank 0 marks the run finished
        t = time.monotonic()
        with pytest.raises(RunFinished):
            late.reform(-1, "test: the state did not come", report_timeout=10.0)
        assert time.monotonic() - t < 8.0, "it waited for the proposer's deadline"
        assert first.keys.read().quorum.q == 1, "a quorum was written after the run finished"


def test_rank_0_forgets_the_keys_nobody_reads_in_one_request_and_keeps_the_rest(etcd, run_id):
    """``LiveKeys.forgettable`` after quorum 5's group is up, deleted in one transaction (rank 0's
    next step waits for it): the store and record of quorum 3, its stall, the reports that formed 4;
    a key that only starts like one of them stays."""
    from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions, parse_endpoints
    from elastic_trainer.live.keys import LiveKeys

    conn = EtcdConnection(EtcdOptions(endpoints=parse_endpoints(etcd.endpoint)))
    try:
        keys = LiveKeys(conn, f"/elastic-trainer/{run_id}/")
        gone = ["store/3/a", "store/3/b/c", "report/4/m-1", "report/4/@node", "stall/3", "members/3"]
        kept = ["store/4/a", "store/30/a", "report/5/m-1", "report/40/m", "stall/30", "members/30", "quorum"]
        for sub in gone + kept:
            conn.call(lambda c, k=keys.key(sub): c.put(k, b"x"))
        before = keys.requests
        keys.delete(*keys.forgettable(5))
        assert keys.requests == before + 1
        left = {m.key.decode()[len(keys.prefix):] for _, m in conn.call(lambda c: list(c.get_prefix(keys.prefix)))}
        assert left == set(kept)
    finally:
        conn.close()
