"""One report per node for a live re-form (``live/node_report.py``) on a real etcd: the
workers of a node on the node's lease write their reports to the node's directory and its
reporter puts one key for them all, the proposer reads each member's step from it, and a member
whose node's reporter never reports (hung) puts its own after the grace. Two nodes of two
in-process workers each, on their agents' leases."""

from __future__ import annotations

import os
import threading
import time

import pytest

from elastic_trainer.live import node_report
from elastic_trainer.live.quorum import LiveExcluded
from tests.helpers.live_nodes import live_nodes

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def nodes(etcd, run_id):
    """Two nodes of two workers on their agents' leases, joined into one quorum and watching; in
    member order (a node's workers together, its first member first)."""
    with live_nodes(etcd, run_id, nodes=2, workers=2, lease_ttl=5, report_timeout=2.0) as made:
        yield made.groups


def _reform(workers: list, steps: dict[str, int]) -> dict:
    """The given workers re-form at once, each with its step: id -> the quorum, or the error."""
    got: dict = {}

    def one(w) -> None:
        try:
            got[w.id] = w.reform(steps[w.id], "test")
        except LiveExcluded as exc:
            got[w.id] = exc

    threads = [threading.Thread(target=one, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def _report_keys(w, target: int) -> dict[str, dict]:
    return w.keys.read_reports(target)


def test_each_node_puts_one_report_and_the_proposer_reads_every_members_step(nodes):
    steps = {w.id: 7 for w in nodes}
    behind = nodes[3]  # one worker completed one step less: it must receive the state
    steps[behind.id] = 6
    got = _reform(nodes, steps)
    q = got[nodes[0].id]
    assert all(got[w.id] == q for w in nodes), got
    assert q.world_size == 4 and q.step == 7
    assert q.receivers == (q.rank_of(behind.id),), "the step read from the node's report decides who receives"
    keys = _report_keys(nodes[0], q.q)
    assert sorted(keys) == ["@node0", "@node1"], f"one report per node, no worker's own: {sorted(keys)}"
    node_dir = nodes[0].watcher.keeper.share.dir
    assert f"report-{q.q}.done" in os.listdir(node_dir)
    again = _reform(nodes, {w.id: 8 for w in nodes})
    assert again[nodes[0].id].q == q.q + 1 and again[nodes[0].id].receivers == ()
    left = [n for n in os.listdir(node_dir) if n.startswith("report-")]
    assert left and all(n.startswith(f"report-{q.q + 1}") for n in left), f"the older re-form's files stay: {left}"


def test_a_member_whose_reporter_never_reports_puts_its_own_after_the_grace(nodes):
    """The second node's reporter (its first member) is hung: it never re-forms. Its sibling's
    report is in etcd after the grace, under its own id; the node is dropped whole at
    report_timeout and the sibling learns that it was left out."""
    first_node, second = nodes[0].me.node, nodes[2].me.node  # in the quorum's order (the order they joined)
    hung, sibling = nodes[2], nodes[3]
    others = [w for w in nodes if w is not hung]
    target = nodes[0].quorum.q + 1
    seen: list[float] = []
    began = time.monotonic()

    def watch_own() -> None:
        while time.monotonic() - began < 10 and not seen:
            if sibling.id in _report_keys(nodes[0], target):
                seen.append(time.monotonic() - began)
            time.sleep(0.02)

    t = threading.Thread(target=watch_own, daemon=True)
    t.start()
    got = _reform(others, {w.id: 7 for w in others})
    t.join(10)
    assert seen and seen[0] >= node_report.GRACE, f"its own report, once the grace passed without its node's: {seen}"
    assert isinstance(got[sibling.id], LiveExcluded), got
    q = got[nodes[0].id]
    assert q.nodes == [first_node] and second != first_node, "the second node is dropped whole"


def test_a_member_that_comes_after_its_nodes_report_puts_its_own_at_once(nodes):
    """The second node's second worker enters the re-form a second late, after its node's reporter
    put the node's report without it (past the grace): it puts its own at once, not a grace later,
    and the node stays in whole."""
    late = nodes[3]  # the quorum's order: node, node, other node's reporter, this one
    others = [w for w in nodes if w is not late]
    target = nodes[0].quorum.q + 1
    got: dict = {}
    first = threading.Thread(target=lambda: got.update(_reform(others, {w.id: 7 for w in others})), daemon=True)
    first.start()
    time.sleep(node_report.GRACE + 0.5)
    assert f"@{late.me.node}" in _report_keys(nodes[0], target), "its reporter put the node's report without it"
    entered = time.monotonic()
    got[late.id] = late.reform(7, "test")
    put_within = [time.monotonic() - entered]
    first.join(30)
    assert late.id in _report_keys(nodes[0], target)
    assert put_within[0] < node_report.GRACE, f"the late member must not wait a grace: {put_within[0]:.2f}s"
    q = got[nodes[0].id]
    assert q.world_size == 4 and all(got[w.id] == q for w in nodes), got
