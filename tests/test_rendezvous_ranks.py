"""Rank keys: the node that completes a round writes each participant's rank where that node reads
only its own, so that N waiting nodes do not each read and decode the state of all N (a real etcd)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_trainer.rendezvous import handler_creator
from elastic_trainer.rendezvous.admission import parse_rank
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend
from elastic_trainer.rendezvous.state import decode_state, node_name
from tests.helpers.common import etcd_conn, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def conn(etcd):
    with contextlib.closing(etcd_conn(etcd)) as c:
        yield c


def test_ranks_are_written_in_transactions_etcd_accepts_read_one_by_one_and_old_rounds_deleted(conn, run_id):
    backend = EtcdRendezvousBackend(conn, run_id)
    names = [f"10.0.0.{i}_1_0" for i in range(250)]  # more than etcd's 128 operations per transaction
    backend.publish_ranks(3, {n: i for i, n in enumerate(names)})
    backend.publish_ranks(4, {names[0]: 0})
    assert parse_rank(backend.poll_round(backend.rank_key(3, names[249]))[3]) == (249, 250)
    assert backend.poll_round(backend.rank_key(3, "10.9.9.9_1_0"))[3] is None
    assert backend.poll_round()[3] is None  # no rank key asked
    backend.delete_ranks_before(4)
    assert backend.poll_round(backend.rank_key(3, names[0]))[3] is None
    assert parse_rank(backend.poll_round(backend.rank_key(4, names[0]))[3]) == (0, 1)


@pytest.mark.parametrize("value", [None, b"", b"3", b"3 3", b"-1 4", b"a b", b"1 2 3"])
def test_a_rank_key_that_is_not_a_rank_below_the_world_size_is_not_taken(value):
    assert parse_rank(value) is None


def test_waiting_nodes_take_their_rank_from_their_key_and_it_is_the_states(etcd, run_id, conn):
    create = handler_creator()
    params = RendezvousParameters("etcd-v3", f"127.0.0.1:{etcd.port}", run_id, 5, 5, local_addr="127.0.0.1",
                                  lease_ttl="2", keep_alive_interval="0.5")
    handlers = [create(params) for _ in range(5)]
    try:
        # Four wait for the fifth (a node that arrives after the round completed reads the state).
        with ThreadPoolExecutor(len(handlers)) as pool:
            futures = [pool.submit(h.next_rendezvous) for h in handlers[:4]]
            backend = EtcdRendezvousBackend(conn, run_id)

            def waiting() -> int:  # participants of the round the four wait in
                found = backend.read_state()
                return len(decode_state(found[0]).participants) if found else 0
            wait_until(waiting, 30, "four nodes waiting in the round", until=lambda n: n == 4, interval=0.05)
            futures.append(pool.submit(handlers[4].next_rendezvous))
            infos = [f.result(60) for f in futures]
        assert sorted(i.rank for i in infos) == list(range(5)) and {i.world_size for i in infos} == {5}
        from_keys = [h for h in handlers if h._op_executor.finished is not None]
        assert from_keys, "the nodes that waited took their rank from their rank key"
        completer = next(h for h, i in zip(handlers, infos) if i.rank == 0)
        assert completer._op_executor.finished is None, "the node that completed the round took rank 0"
        data, _, _ = EtcdRendezvousBackend(conn, run_id).read()
        state = decode_state(data)
        for h, info in zip(handlers, infos):
            assert state.participants[h._this_node] == info.rank
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
        # The watchdog of a node that never read the participants still revokes the round when one dies.
        watcher = from_keys[0]
        victim = next(h for h in handlers if h is not watcher)
        victim._lease.close(revoke=True)
        wait_until(lambda: watcher.num_nodes_waiting() > 0, 10, "the watchdog to revoke the round", interval=0.1)
        assert node_name(victim._this_node) in watcher._revoked or "lost their etcd lease" in watcher._revoked
    finally:
        for h in handlers:
            h.shutdown()


def test_the_last_rounds_rank_keys_are_deleted_when_the_run_closes(etcd, run_id, conn):
    """The rank keys of a round are deleted by rank 0 of a later round; those of the last round
    by its rank 0 when the run closes, so a finished run leaves none behind."""
    create = handler_creator()
    params = RendezvousParameters("etcd-v3", f"127.0.0.1:{etcd.port}", run_id, 2, 2, local_addr="127.0.0.1",
                                  lease_ttl="2", keep_alive_interval="0.5")
    handlers = [create(params) for _ in range(2)]
    backend = EtcdRendezvousBackend(conn, run_id)
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = [f.result(60) for f in [pool.submit(h.next_rendezvous) for h in handlers]]
        assert sorted(i.rank for i in infos) == [0, 1]
        assert conn.call(lambda c: list(c.get_prefix(backend.ranks_prefix))), "the round wrote its rank keys"
    finally:
        for h in handlers:
            h.shutdown()
    assert not conn.call(lambda c: list(c.get_prefix(backend.ranks_prefix))), "rank keys left after the run closed"
