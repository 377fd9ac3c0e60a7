"""The quorum key's record (``live/quorum.py``): a re-form writes the change from the
quorum it replaces (a few hundred bytes however large the group) and the whole record beside it; a
reader that holds the base rebuilds the member list exactly, one that does not reads the whole
record, and one that can do neither fails instead of guessing. On a real etcd: the
compare-and-swap writes both keys, a newcomer's read and the fence check work from the change."""

from __future__ import annotations

import pytest

from elastic_trainer.live import quorum as quorum_record
from elastic_trainer.live.keys import Change
from elastic_trainer.live.mirror import Mirror
from elastic_trainer.live.quorum import Member, Quorum
from elastic_trainer.rendezvous.round_fence import FencedError
from tests.helpers.live_nodes import NodeAgent, group, live_nodes, settings

pytestmark = pytest.mark.timeout(60)


def _members(nodes: range, workers: int = 8) -> tuple[Member, ...]:
    return tuple(Member(f"n{n}-{r}-{1000 + n}", f"n{n}", r, f"10.0.{n // 256}.{n % 256}:{20000 + r}")
                 for n in nodes for r in range(workers))


def _never(q: int) -> bytes | None:
    raise AssertionError(f"a reader that holds the base must not read quorum {q}'s whole record")


def test_a_re_form_is_written_as_its_change_and_rebuilt_exactly_from_the_quorum_it_replaces():
    old = Quorum(q=4, members=_members(range(100)), step=90, cause="x")
    survivors = tuple(m for m in old.members if m.node not in ("n3", "n57"))
    new = Quorum(q=5, members=survivors + _members(range(100, 101)), step=120, source=2, receivers=(792, 793),
                 cause="lost n3, n57; added n100", formed_at=12.5)
    value, whole = quorum_record.encode(new, old)
    assert whole == new.to_json() and len(value) < 2000 < 60_000 < len(whole), \
        "the key carries the change; the whole record goes beside it"
    assert quorum_record.record_q(value) == 5
    assert quorum_record.decode(value, lambda q: old if q == 4 else None, _never) == new
    assert quorum_record.decode(value, lambda q: None, lambda q: whole if q == 5 else None) == new, \
        "a reader without the base builds on the whole record"
    with pytest.raises(ValueError, match="does not hold"):
        quorum_record.decode(value, lambda q: None, lambda q: None)
    other = Quorum(q=4, members=_members(range(1, 3)))
    assert quorum_record.decode(value, lambda q: other if q == 3 else None, lambda q: whole) == new


def test_a_record_that_is_not_a_change_is_written_whole():
    old = Quorum(q=2, members=_members(range(3), workers=2))
    reordered = Quorum(q=3, members=tuple(reversed(old.members)))
    assert quorum_record.encode(reordered, old) == (reordered.to_json(), None)
    cold = Quorum(q=1, members=old.members, cold=True)
    assert quorum_record.encode(cold, None) == (cold.to_json(), None)
    assert quorum_record.decode(cold.to_json(), lambda q: None, None) == cold
    finished = Quorum(q=2, members=old.members, finished=True)
    value, _ = quorum_record.encode(finished, old)
    assert quorum_record.decode(value, lambda q: old if q == 2 else None, _never) == finished


def test_a_mirror_applies_a_change_record_from_the_quorum_it_holds():
    p = "/r/live/"
    old = Quorum(q=1, members=_members(range(4), workers=2))
    new = Quorum(q=2, members=old.members[2:])
    value, whole = quorum_record.encode(new, old)
    keys = Mirror(p, fetch_members=_never)
    keys.load([Change(p + "quorum", old.to_json(), 3, 3)])
    keys.apply(Change(p + "quorum", value, 3, 9))
    assert keys.quorum == new and keys.quorum_record == value
    later = Quorum(q=2, members=new.members, formed_at=1.0)  # other bytes: not the decoded one again
    value, whole = quorum_record.encode(later, old)
    fresh = Mirror(p, fetch_members=lambda q: whole if q == 2 else None)
    fresh.load([Change(p + "quorum", value, 3, 9)])
    assert fresh.quorum == later, "a watcher that missed quorum 1 reads quorum 2's whole record"


def test_a_compare_and_swap_writes_the_change_and_the_whole_record_and_readers_resolve_it(etcd, run_id):
    with live_nodes(etcd, run_id, nodes=1, max_nodes=4) as nodes:
        g = nodes.groups[0]
        agent = nodes.agents["node9"] = NodeAgent(etcd, run_id, "node9")  # closed with the others
        newcomer = group(etcd, run_id, agent, "node9", live=settings(max_nodes=4))
        nodes.groups.append(newcomer)
        conn, keys = g.conn, g.keys
        q1 = g.quorum
        q2 = Quorum(q=2, members=q1.members + _members(range(5, 7), workers=2), step=3)
        assert keys.cas_quorum(q2, keys.read().quorum_rev, base=q1)
        value = conn.call(lambda c: c.get(f"/{run_id}/live/quorum"))[0]
        assert b'"base": 1' in value and b'"members"' not in value
        assert conn.call(lambda c: c.get(f"/{run_id}/live/members/2"))[0] == q2.to_json()
        assert newcomer.keys.read().quorum == q2, "a reader without quorum 1 reads the whole record"
        g.membership.adopt(q2)
        assert keys.read(held=q2).quorum == q2
        g.guard()  # the fence check reads the quorum's number from the change
        g.membership.adopt(q1)
        with pytest.raises(FencedError):
            g.guard()
