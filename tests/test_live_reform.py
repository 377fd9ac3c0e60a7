"""The live re-form's one proposer (``rendezvous/live_reform.py``) on a real etcd: the first
member reads the reports and writes the next quorum while the others, following it through their
watch, read nothing; a proposer killed (its probe port refuses), one whose lease expired (its
``alive`` key gone, seen through the watch) and one alive but silent are taken over, so a dead
proposer never blocks a re-form. Three in-process groups of one worker each, nodes node0-node2."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_trainer.env import LiveSettings
from elastic_trainer.rendezvous import live_reform
from elastic_trainer.rendezvous.live_reform import FOLLOW_GRACE
from elastic_trainer.rendezvous.quorum import LiveExcluded, LiveGroup
from tests.helpers.common import etcd_conn, holds_within, join_and_watch

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def make_groups(etcd, run_id):
    """``make_groups(**settings)``: three groups that joined one quorum and watch (``_groups``),
    closed at the test's end."""
    made: list[LiveGroup] = []

    def make(**settings) -> list[LiveGroup]:
        groups = _groups(etcd, run_id, **settings)
        made.extend(groups)
        return groups

    yield make
    _close(made)


def _groups(etcd, run_id, n: int = 3, **settings) -> list[LiveGroup]:
    """``n`` groups of one worker each that joined one quorum and watch; in member order."""
    s = LiveSettings(min_nodes=1, max_nodes=n, last_call=10.0, join_timeout=20, **settings)
    return join_and_watch([LiveGroup(etcd_conn(etcd), f"/{run_id}/", f"node{i}", 0, 1, "127.0.0.1", s)
                           for i in range(n)])


def _reform(groups: list[LiveGroup], timeout: float | None = None,
            late: dict[str, float] | None = None) -> tuple[dict, dict, dict]:
    """Every group in ``groups`` re-forms at once (those in ``late``: that many seconds later):
    (id -> quorum or the error, id -> reads, id -> seconds from its own start)."""
    got, reads, took = {}, {}, {}

    def one(g: LiveGroup) -> None:
        time.sleep((late or {}).get(g.id, 0.0))
        calls = [0]

        def counted(read):
            def call(*args, **kwargs):
                calls[0] += 1
                return read(*args, **kwargs)
            return call

        g._read, g._read_reports = counted(g._read), counted(g._read_reports)  # every read of etcd's
        t = time.monotonic()
        try:
            got[g.id] = g.reform(7, "test", report_timeout=timeout)
        except LiveExcluded as exc:
            got[g.id] = exc
        took[g.id], reads[g.id] = time.monotonic() - t, calls[0]

    threads = [threading.Thread(target=one, args=(g,), daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got, reads, took


def _formed_without_the_first(got: dict, rest: list[LiveGroup]):
    """The quorum the others adopted: the same for all of them, of them alone, in their order."""
    q = got[rest[0].id]
    assert q.q == 2 and [m.id for m in q.members] == [g.id for g in rest]
    assert all(got[g.id] == q for g in rest), "every survivor must adopt the one quorum written"
    return q


def _close(groups: list[LiveGroup]) -> None:
    for g in groups:
        try:
            g.close()
        except Exception:  # noqa: BLE001 - a group the test broke on purpose
            pass


def test_one_proposer_reads_the_reports_and_the_followers_read_nothing(make_groups):
    groups = make_groups()
    got, reads, took = _reform(groups)
    q = got[groups[0].id]
    assert q.q == 2 and q.world_size == 3 and q.step == 7
    assert all(got[g.id] == q for g in groups), "every member must adopt the one quorum written"
    assert reads[groups[0].id] >= 1, "the first member proposes"
    assert reads[groups[1].id] == reads[groups[2].id] == 0, \
        f"the followers must learn the quorum through their watch, not by reading etcd: {reads}"
    assert max(took.values()) < 2.0, took


def test_the_proposer_follows_a_late_report_through_its_watch_and_writes_at_once(make_groups, monkeypatch):
    monkeypatch.setattr(live_reform, "WATCH_FROM", 1)  # three members stand for a large group
    groups = make_groups()
    late = groups[2]
    got, reads, took = _reform(groups, late={late.id: 1.5})
    q = got[groups[0].id]
    assert q.q == 2 and q.world_size == 3 and all(got[g.id] == q for g in groups)
    assert reads[groups[0].id] <= 3, \
        f"the proposer must wait for the late report on its watch, not read every 3 ms: {reads}"
    assert 1.5 <= took[groups[0].id] < 1.5 + 0.5, took
    assert took[late.id] < 0.5, f"the quorum must be written as soon as the last report is put: {took}"


def test_a_proposer_whose_report_watch_never_opens_reads_everything_as_before(make_groups, monkeypatch):
    from elastic_trainer.rendezvous import report_watch

    monkeypatch.setattr(live_reform, "WATCH_FROM", 1)
    monkeypatch.setattr(live_reform, "WATCH_WAIT", 0.2)
    class NeverOpens(report_watch.KeysWatch):
        def run(self) -> None:  # its stream is never established
            return None

    monkeypatch.setattr(report_watch, "KeysWatch", NeverOpens)
    groups = make_groups()
    late = groups[2]
    got, reads, took = _reform(groups, late={late.id: 0.5})
    q = got[groups[0].id]
    assert q.q == 2 and q.world_size == 3 and all(got[g.id] == q for g in groups)
    assert reads[groups[0].id] > 3, f"without its watch the proposer must keep reading: {reads}"
    assert took[late.id] < 0.5, took


def test_a_small_groups_proposer_reads_without_a_watch(make_groups, monkeypatch):
    groups = make_groups()
    opened = []
    real = live_reform.ReportsWatch
    monkeypatch.setattr(live_reform, "ReportsWatch", lambda *a: opened.append(a) or real(*a))
    got, reads, _ = _reform(groups)
    assert got[groups[0].id].q == 2 and reads[groups[0].id] >= 1
    assert not opened, "below WATCH_FROM members a whole read costs less than opening a watch"


def test_a_killed_proposer_is_taken_over_by_the_next_in_line(make_groups):
    groups = make_groups()
    dead, rest = groups[0], groups[1:]
    dead._stop_watching()
    dead._probe.close()  # its process is gone: the port refuses; its node's lease lives on
    got, reads, took = _reform(rest, timeout=10.0)
    _formed_without_the_first(got, rest)
    assert reads[rest[0].id] >= 1 and reads[rest[1].id] == 0, reads
    assert max(took.values()) < 2.0, f"the backup must find the proposer dead by its probe: {took}"


def test_a_proposer_whose_lease_expired_is_taken_over_through_the_watch(make_groups):
    groups = make_groups(lease_ttl=2)
    frozen, rest = groups[0], groups[1:]
    frozen._stop_watching()
    frozen._lease._stop.set()  # frozen: it renews nothing, and its probe port still accepts
    stopped = time.monotonic()
    got, _, _ = _reform(rest, timeout=10.0)
    _formed_without_the_first(got, rest)
    assert time.monotonic() - stopped < 2 + 2.5, "the next in line must propose once the lease expired"


def test_a_silent_proposer_is_overtaken_after_report_timeout(make_groups):
    groups = make_groups()
    silent, rest = groups[0], groups[1:]
    got, _, took = _reform(rest, timeout=1.0)  # the proposer lives but never reports
    _formed_without_the_first(got, rest)
    assert 1.0 <= max(took.values()) < 1.0 + FOLLOW_GRACE, \
        f"a backup proposes at report_timeout, not after the followers' grace: {took}"
    assert holds_within(lambda: silent.change_pending.is_set(), timeout=5), \
        "the silent member's watcher sees the quorum move on"
