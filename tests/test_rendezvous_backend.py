"""The etcd-v3 rendezvous backend, state holder and handler against a real etcd.

torch's own backend contract (``RendezvousBackendTestMixin`` of
test/distributed/elastic/rendezvous/rendezvous_backend_test.py) is applied case by case,
then what ours adds: JSON state, refusal of foreign keys, compare-and-swap races,
lease-based liveness, the membership watchdog, the round fence, options and
connection errors (unreachable, TLS, user/password).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from elastic_trainer.torch_private import (
    NodeDesc,
    RendezvousSettings,
    RendezvousState,
    RendezvousTimeout,
)

from elastic_trainer.etcd.server import EtcdServer, free_port
from elastic_trainer.rendezvous import handler_creator
from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend
from elastic_trainer.fence import FencedError
from elastic_trainer.rendezvous.round_fence import RoundFence
from elastic_trainer.rendezvous.handler import RendezvousOptions
from elastic_trainer.rendezvous.lease import LeaseKeeper
from elastic_trainer.rendezvous.state import (
    EtcdRendezvousStateHolder,
    decode_state,
    encode_state,
    node_name,
    parse_node_name,
)
from tests.helpers.common import wait_until
from tests.helpers.tls_certs import make_certs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def conn(etcd):
    c = EtcdConnection(EtcdOptions(endpoints=(("127.0.0.1", etcd.port),)))
    yield c
    c.close()


@pytest.fixture
def backend(conn, run_id):
    return EtcdRendezvousBackend(conn, run_id)


def _params(etcd, run_id, min_nodes=1, max_nodes=2, **conf) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", etcd.endpoint, run_id, min_nodes, max_nodes,
                                local_addr="127.0.0.1", **conf)


def _settings(run_id, min_nodes=1, max_nodes=3) -> RendezvousSettings:
    return RendezvousSettings(run_id, min_nodes, max_nodes, RendezvousTimeout(),
                              keep_alive_interval=timedelta(days=1), keep_alive_max_attempt=3)


# -- torch's backend contract (RendezvousBackendTestMixin), case by case -----------------

def _set(backend, state, token=None):
    result = backend.set_state(state, token)
    assert result is not None
    return result


def test_get_state_returns_backend_state(backend):
    backend.set_state(b"x")
    state, token = backend.get_state()
    assert state == b"x" and token is not None


def test_get_state_returns_none_if_backend_state_does_not_exist(backend):
    assert backend.get_state() is None


def test_get_state_raises_error_if_backend_state_is_corrupt(backend, conn):
    conn.client.put(backend.state_key, b"\x80not ours")
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_set_state_sets_backend_state_if_it_does_not_exist(backend):
    state, token, has_set = _set(backend, b"x")
    assert state == b"x" and token is not None and has_set


def test_set_state_sets_backend_state_if_token_is_current(backend):
    _, token1, has_set1 = _set(backend, b"x")
    state2, token2, has_set2 = _set(backend, b"y", token1)
    assert state2 == b"y" and token1 != token2 and has_set1 and has_set2


def test_set_state_returns_current_backend_state_if_token_is_old(backend):
    _, token1, _ = _set(backend, b"x")
    state2, token2, _ = _set(backend, b"y", token1)
    state3, token3, has_set = _set(backend, b"z", token1)
    assert (state3, token3, has_set) == (state2, token2, False)


def test_set_state_returns_current_backend_state_if_token_is_none(backend):
    state1, token1, _ = _set(backend, b"x")
    state2, token2, has_set = _set(backend, b"y")
    assert (state2, token2, has_set) == (state1, token1, False)


def test_set_state_returns_current_backend_state_if_token_is_invalid(backend):
    state1, token1, _ = _set(backend, b"x")
    state2, token2, has_set = _set(backend, b"y", token="invalid")
    assert (state2, token2, has_set) == (state1, token1, False)


# -- what ours adds --------------------------------------------------------------------

def test_concurrent_writers_race_and_exactly_one_wins_each_round(conn, run_id):
    writers, rounds = 8, 5
    backends = [EtcdRendezvousBackend(conn, run_id) for _ in range(writers)]
    token = _set(backends[0], b"start")[1]
    for r in range(rounds):
        barrier = threading.Barrier(writers)
        results = [None] * writers

        def write(i, token=token, r=r):
            barrier.wait()
            results[i] = backends[i].set_state(f"round {r} by {i}".encode(), token)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, res in enumerate(results) if res[2]]
        assert len(winners) == 1, results
        # The losers were handed the winner's state and token.
        assert {(res[0], res[1]) for res in results} == {(f"round {r} by {winners[0]}".encode(), results[winners[0]][1])}
        token = results[winners[0]][1]


def test_foreign_key_under_the_prefix_is_refused_with_a_clear_error(backend, conn):
    conn.client.put(backend.state_key, b'{"round": 1}')
    with pytest.raises(RendezvousStateError, match="not written by the etcd-v3 rendezvous"):
        backend.get_state()


def test_state_of_another_run_id_is_refused(conn, run_id):
    other = EtcdRendezvousBackend(conn, run_id + "-other")
    _set(other, b"x")
    # Same key, other run: copy the other run's value under ours.
    ours = EtcdRendezvousBackend(conn, run_id)
    value, _ = conn.client.get(other.state_key)
    conn.client.put(ours.state_key, value)
    with pytest.raises(RendezvousStateError, match=f"belongs to run '{run_id}-other'"):
        ours.get_state()


def _sample_state() -> RendezvousState:
    a, b, c = NodeDesc("h1", 10, 0), NodeDesc("h2", 11, 0), NodeDesc("h3", 12, 1)
    s = RendezvousState()
    s.round, s.complete, s.closed = 4, True, False
    s.deadline = datetime(2026, 1, 2, 3, 4, 5, 6789, tzinfo=timezone.utc)
    s.participants = {a: 0, b: 1}
    s.wait_list = {c}
    s.last_heartbeats = {a: datetime.now(timezone.utc), b: datetime.now(timezone.utc)}
    return s


def test_state_round_trips_through_json_without_pickle():
    s = _sample_state()
    data = encode_state(s)
    doc = json.loads(data)
    assert doc["participants"][0] == [{"addr": "h1", "pid": 10, "local_id": 0}, 0]
    back = decode_state(data)
    assert {k: v for k, v in vars(back).items() if k != "last_heartbeats"} == \
        {k: v for k, v in vars(s).items() if k != "last_heartbeats"}
    # Heartbeat times are not stored (liveness is the lease); every node gets an entry.
    assert set(back.last_heartbeats) == set(s.participants) | s.wait_list
    assert "last_heartbeats" not in doc


def test_decoded_node_descriptors_are_interned_and_still_validated():
    data = encode_state(_sample_state())
    first, second = decode_state(data), decode_state(data)
    assert first.participants == second.participants
    assert all(a is b for a, b in zip(first.participants, second.participants))  # no new objects per read
    doc = json.loads(data)
    doc["participants"][0][0]["pid"] = True  # a bool is not a pid, even though True == 1
    with pytest.raises(RendezvousStateError, match="a node pid must be an integer"):
        decode_state(json.dumps(doc).encode())
    doc["participants"][0][0] = {"addr": "h1", "pid": 10, "local_id": 0, "extra": 1}
    with pytest.raises(RendezvousStateError, match="a node must be"):
        decode_state(json.dumps(doc).encode())


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(round="1"), "round must be an integer"),
    (lambda d: d.update(extra=1), "missing or unexpected"),
    (lambda d: d["participants"].append([{"addr": "x", "pid": 1}, 0]), "a node must be"),
    (lambda d: d.update(deadline="tomorrow"), "not an ISO time"),
    (lambda d: d.update(deadline="2026-01-01T00:00:00"), "no time zone"),
    (lambda d: d.update(complete=1), "complete must be true or false"),
    (lambda d: d.update(version=2), "schema version"),
])
def test_invalid_json_state_is_refused(mutate, message):
    doc = json.loads(encode_state(_sample_state()))
    mutate(doc)
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(json.dumps(doc).encode())
    with pytest.raises(RendezvousStateError, match="not JSON"):
        decode_state(b"\x80\x04\x95pickle")


def test_holder_removes_a_node_only_when_its_lease_key_is_gone(backend, conn, run_id):
    settings = _settings(run_id)
    live, dead = NodeDesc("127.0.0.1", 1, 0), NodeDesc("127.0.0.1", 2, 0)
    lease = conn.client.lease(30)
    conn.client.put(backend.alive_key(node_name(live)), b"", lease=lease)
    state = RendezvousState()
    state.complete, state.participants = True, {live: 0, dead: 1}
    # Ancient heartbeats: torch's holder would drop both; ours keeps the one with a lease.
    old = datetime(2000, 1, 1, tzinfo=timezone.utc)
    state.last_heartbeats = {live: old, dead: old}
    backend.set_state(encode_state(state))
    holder = EtcdRendezvousStateHolder(backend, settings)
    holder.sync()
    assert set(holder.state.participants) == {live}
    conn.client.revoke_lease(lease.id)
    holder.sync(use_cache=False)
    assert holder.state.participants == {} and holder.state.round == 1 and not holder.state.complete


def test_joining_nodes_come_from_key_names_and_need_a_live_lease(backend, conn, run_id):
    """Readers take a joining node from its key's name (keys only; the value is not read):
    an address may hold ``_``; a malformed name is ignored; a name without a live lease key too."""
    lease = conn.client.lease(30)
    nodes = [NodeDesc("127.0.0.1", 7, 0), NodeDesc("host_with_underscore", 8, 2)]
    names = [node_name(n) for n in nodes] + ["no-pid-here", "127.0.0.1_9_0"]
    for name in names[:3]:
        conn.client.put(backend.alive_key(name), b"", lease=lease)
    for name in names:
        conn.client.put(backend.joining_key(name), b"not read", lease=lease)
    backend.set_state(encode_state(RendezvousState()))
    holder = EtcdRendezvousStateHolder(backend, _settings(run_id))
    holder.sync()
    assert holder.joining == nodes  # "no-pid-here" is malformed; 127.0.0.1_9_0 holds no alive key
    assert parse_node_name(node_name(nodes[1])) == nodes[1] and parse_node_name("a_b_c") is None


def _count_requests(backend) -> tuple[list[int], object]:
    """Make ``backend`` record the operations of each etcd transaction it sends; the list and
    the real ``_txn``."""
    sent: list[int] = []
    real = backend._txn

    def counting(what, compare, success, failure=None, retry_timeout=None):
        sent.append(len(success))
        return real(what, compare, success, failure, retry_timeout)
    backend._txn = counting
    return sent, real


def test_polls_read_only_new_member_keys_and_a_deletion_forces_a_full_read(backend, conn):
    """The alive/joining views are kept by reading only keys created since the last read;
    after any deletion (also a delete-and-recreate) the view is read whole, so it always
    equals what etcd holds."""
    backend.set_state(b"{}")
    sent, real = _count_requests(backend)

    def poll() -> frozenset[str]:
        sent.clear()
        backend.get_state()
        return backend.last_alive

    def alive_in_etcd() -> frozenset[str]:
        return frozenset(m.key.decode().rsplit("/", 1)[1] for _, m in conn.client.get_prefix(backend.alive_prefix))

    lease = conn.client.lease(60)
    for i in range(5):
        conn.client.put(backend.alive_key(f"n{i}"), b"", lease=lease)
    assert poll() == alive_in_etcd() == {f"n{i}" for i in range(5)}
    conn.client.put(backend.alive_key("n5"), b"", lease=lease)
    resp = real("probe", [], [backend._alive.request()])
    assert [kv.key for kv in resp.responses[0].response_range.kvs] == [backend.alive_key("n5").encode()]
    assert resp.responses[0].response_range.count == 6  # etcd counts the prefix before the filter
    assert poll() == alive_in_etcd() and len(sent) == 1  # additions: one request, only the new key
    conn.client.delete(backend.alive_key("n2"))
    assert poll() == alive_in_etcd() and "n2" not in backend.last_alive and len(sent) == 2  # + a full read
    conn.client.delete(backend.alive_key("n3"))
    conn.client.put(backend.alive_key("n3"), b"", lease=lease)  # the same name, a new key
    conn.client.put(backend.alive_key("n6"), b"", lease=lease)
    assert poll() == alive_in_etcd() and len(sent) == 2
    conn.client.revoke_lease(lease.id)
    assert poll() == alive_in_etcd() == frozenset()


def test_a_lazy_joining_view_skips_the_full_read_until_an_exact_one_is_asked(backend, conn):
    """Non-admitters read joining/ lazily: a deletion does not cost them a full read, the view
    keeps the deleted name and says it is not exact; an exact read (the admitter's) fixes it."""
    backend.set_state(b"{}")
    sent, _ = _count_requests(backend)
    lease = conn.client.lease(60)
    for i in range(3):
        conn.client.put(backend.joining_key(f"n{i}"), b"", lease=lease)
    backend.get_state(exact_joining=False)
    assert set(backend.last_joining) == {"n0", "n1", "n2"} and backend.joining_exact
    conn.client.delete(backend.joining_key("n1"))
    conn.client.put(backend.joining_key("n3"), b"", lease=lease)
    sent.clear()
    backend.get_state(exact_joining=False)
    assert len(sent) == 1 and set(backend.last_joining) == {"n0", "n1", "n2", "n3"} and not backend.joining_exact
    sent.clear()
    backend.get_state(exact_joining=False)  # stays lazy (and incremental) until asked
    assert len(sent) == 1 and not backend.joining_exact
    sent.clear()
    backend.get_state(exact_joining=True)
    assert len(sent) == 1 and set(backend.last_joining) == {"n0", "n2", "n3"} and backend.joining_exact
    conn.client.delete(backend.joining_key("n0"))
    sent.clear()
    backend.get_state()  # exact by default (torch's contract): a deletion forces the full read
    assert len(sent) == 2 and set(backend.last_joining) == {"n2", "n3"} and backend.joining_exact
    conn.client.revoke_lease(lease.id)


def test_a_light_sync_reads_no_member_list_and_falls_back_to_an_exact_one_when_a_node_died(backend, conn, run_id):
    """Nodes that do not admit sync *light*: the state, the number of live nodes and the smallest
    name waiting to join, in one request and without either member list (which made the first
    reads O(N^2) at 1,000 agents). When the count says a node of the state is dead, the sync reads
    the lists whole in the same call and removes the dead node, as an exact sync does."""
    nodes = [NodeDesc("127.0.0.1", 10 + i, 0) for i in range(3)]
    leases = [conn.client.lease(60) for _ in nodes]
    for node, lease in zip(nodes, leases):
        conn.client.put(backend.alive_key(node_name(node)), b"", lease=lease)
        conn.client.put(backend.joining_key(node_name(node)), b"", lease=lease)
    state = RendezvousState()
    state.participants = {n: 0 for n in nodes}
    backend.set_state(encode_state(state))
    holder = EtcdRendezvousStateHolder(backend, _settings(run_id))
    sent, _ = _count_requests(backend)
    holder.light = True
    holder.sync(use_cache=False)
    assert holder.last_light and len(sent) == 1 and holder.alive_count == 3
    assert holder.first_joining == node_name(nodes[0]) and set(holder.state.participants) == set(nodes)
    assert holder.alive == frozenset() and holder.joining == []  # the lists were not read

    conn.client.revoke_lease(leases[0].id)  # the admitter died: the next name admits
    sent.clear()
    holder.sync(use_cache=False)
    assert not holder.last_light and len(sent) >= 2  # the count (2 < 3) forced an exact read
    assert set(holder.state.participants) == set(nodes[1:]) and holder.alive == {node_name(n) for n in nodes[1:]}
    holder.sync(use_cache=False)  # etcd's state still names the dead node: exact again
    assert not holder.last_light
    holder.mark_dirty()  # as the admitter does: the state without the dead node
    holder.sync()
    sent.clear()
    holder.sync(use_cache=False)
    assert holder.last_light and len(sent) == 1 and holder.first_joining == node_name(nodes[1])
    for lease in leases[1:]:
        conn.client.revoke_lease(lease.id)


def test_a_lease_that_ran_out_unnoticed_is_replaced_when_the_node_rejoins(backend, conn):
    """A network cut longer than the lease: the keeper could not learn that the lease ended,
    and the next rendezvous must take a new lease instead of dying on 'lease not found'."""
    keeper = LeaseKeeper(conn, backend.alive_key("n0"), ttl=30, interval=60)
    try:
        keeper.ensure()
        old = keeper._lease_id
        conn.client.revoke_lease(old)  # etcd ended it; the keeper was not told
        assert not keeper.lost
        keeper.ensure()
        assert keeper._lease_id != old
        value, meta = conn.client.get(backend.alive_key("n0"))
        assert meta.lease_id == keeper._lease_id
        assert 0 < json.loads(value)["since"] <= time.time()  # for `elastic-train status`; readers use the name
    finally:
        keeper.close()


def test_a_lost_lease_is_told_at_once_by_the_renewal_and_on_asking_etcd(backend, conn):
    """A process paused past its lease resumes all threads at once: the renewal that finds the
    lease gone calls ``on_lost`` right away (not at the next watchdog tick, a second later), and
    ``expired_at_etcd`` lets the training thread ask before its next step."""
    lost, told_by = threading.Event(), []

    def on_lost():
        told_by.append(threading.current_thread().name)
        lost.set()

    keeper = LeaseKeeper(conn, backend.alive_key("n2"), ttl=30, interval=0.2, on_tick=lambda: None,
                         on_lost=on_lost)
    try:
        keeper.ensure()
        assert keeper.expired_at_etcd(timeout=2) is False and not keeper.lost
        conn.client.revoke_lease(keeper._lease_id)  # what etcd does to a lease past its TTL
        assert lost.wait(5), "the renewal did not call on_lost"
        # told by the renewal that found the lease gone (its loop's thread), not by the watchdog's
        # next tick (thread "etcd-watchdog <key>") nor the keep-alive stream's reader
        assert told_by == ["etcd-lease-renewals"] and keeper.lost, told_by
        assert keeper.expired_at_etcd(timeout=2) is True
    finally:
        keeper.close()

    other = LeaseKeeper(conn, backend.alive_key("n3"), ttl=30, interval=60)  # no renewal before the ask
    try:
        other.ensure()
        conn.client.revoke_lease(other._lease_id)
        assert other.expired_at_etcd(timeout=2) is True and other.lost
    finally:
        other.close()


def test_a_slow_renewal_does_not_hold_up_a_put_on_the_lease(backend, conn, monkeypatch):
    """A renewal etcd answers late (at 1,000 agents: seconds) must not delay the node's other
    writes on its lease: the handler's ``joining/`` key waited up to 17.5 s behind renewals.
    (The keeper sends with ``send_renewal`` since renewals no longer wait for the last answer;
    the slow call patched here is that one, as it was ``renew_lease`` before.)"""
    keeper = LeaseKeeper(conn, backend.alive_key("n4"), ttl=30, interval=60)
    renewing, release = threading.Event(), threading.Event()
    real_send = conn.send_renewal

    def slow_renew(lease_id):
        renewing.set()
        release.wait(10)
        return real_send(lease_id)

    try:
        keeper.ensure()
        monkeypatch.setattr(conn, "send_renewal", slow_renew)
        renewal = threading.Thread(target=keeper.refresh)
        renewal.start()
        assert renewing.wait(5)
        keeper.put(backend.alive_key("n4") + "-joining", b"x")
        # the renewal is held until `release` (10 s at most): a put that waited behind it returns after it
        assert renewal.is_alive(), "put waited for the renewal in flight to end"
        release.set()
        renewal.join(10)
        assert conn.client.get(backend.alive_key("n4") + "-joining")[1].lease_id == keeper._lease_id
        assert not keeper.lost and keeper.seconds_since_renewal() < 5
    finally:
        release.set()
        keeper.close()


def test_renewals_keep_their_pace_when_answers_come_late_and_late_answers_still_count(backend, conn, monkeypatch):
    """The renewal thread waits one interval for an answer, then sends the next renewal: a keeper
    that waited for each answer sent renewals late whenever answers were late (1,000 agents on two
    CPUs: 3 s leases ran out although etcd answered each renewal at once). An answer that comes
    after the wait is applied by the next renewal, with the time its renewal was sent.

    (Answers are now applied by the keep-alive stream's reader thread as they arrive; the late
    answer is simulated by keeping it from that thread too: the renewal's ``on_answer`` is not
    passed on while ``late``.)"""
    keeper = LeaseKeeper(conn, backend.alive_key("n6"), ttl=30, interval=60)
    real_result, real_send, late = conn.renewal_result, conn.send_renewal, [True]

    waits = []  # how long each look for an answer may wait

    def slow_to_arrive(pending, wait, failover_after=None):
        waits.append(wait)
        if late[0]:  # etcd answered, but the answer has not reached this thread yet
            time.sleep(min(wait, 0.2))
            return None
        return real_result(pending._p, wait, failover_after)

    class Unheard:
        """A renewal whose answer reaches no thread while ``late``."""

        def __init__(self, p):
            self._p = p

        def __getattr__(self, name):
            return getattr(self._p, name)

        def on_answer(self, callback):
            pass

    try:
        keeper.ensure()
        monkeypatch.setattr(conn, "renewal_result", slow_to_arrive)
        monkeypatch.setattr(conn, "send_renewal", lambda lease_id: Unheard(real_send(lease_id)))
        time.sleep(0.3)
        before = keeper.seconds_since_renewal()
        keeper.refresh(wait=0.2)
        # one look for its answer, of one interval; then it returns with the renewal in flight
        assert waits == [0.2] and len(keeper._inflight) == 1, waits
        assert keeper.seconds_since_renewal() >= before  # not counted before its answer
        sent_first = keeper._inflight[0][1].sent
        late[0] = False
        time.sleep(0.3)
        keeper.refresh(wait=5)
        assert keeper._inflight == [] and not keeper.lost
        assert keeper.seconds_since_renewal() <= time.monotonic() - sent_first + 0.01
    finally:
        keeper.close()


def test_closing_the_keeper_waits_for_a_watchdog_check_in_flight_and_logs_no_failure(backend, conn, caplog):
    """Shutdown closes the lease keeper, then the connection: a watchdog check still running
    then must not end in a 'watchdog check failed' traceback (it did, at the end of every run)."""
    started, release = threading.Event(), threading.Event()

    def slow_check():
        started.set()
        release.wait(5)
        raise RuntimeError("Channel closed!")  # what a check sees when the connection went away

    keeper = LeaseKeeper(conn, backend.alive_key("n1"), ttl=30, interval=0.05, on_tick=slow_check)
    keeper.ensure()
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    with caplog.at_level(logging.ERROR, logger="elastic_trainer.rendezvous.lease"):
        keeper.close()
    assert not keeper._thread.is_alive()  # the check ended before close() returned
    assert "watchdog check failed" not in caplog.text
    assert conn.client.get(backend.alive_key("n1"))[0] is None  # revoked after the last check


def test_options_are_parsed_and_bad_ones_named(etcd, run_id):
    o = RendezvousOptions(_params(etcd, run_id, key_prefix="/x", lease_ttl="4", last_call_timeout="0.5",
                                  timeout="900"))
    assert (o.key_prefix, o.lease_ttl, o.last_call_timeout, o.join_timeout) == ("/x", 4, 0.5, 600.0)
    for conf, message in [({"lease_tl": "3"}, "unknown etcd-v3 rendezvous option"),
                          ({"lease_ttl": "1"}, "at least 2"),
                          ({"lease_ttl": "3", "keep_alive_interval": "2"}, "at most half"),
                          ({"join_timeout": "-1"}, "must be positive"),
                          ({"protocol": "ftp"}, "http or https"),
                          ({"user": "root"}, "user and password go together"),
                          ({"cert": "/c.pem"}, "cert and key")]:
        with pytest.raises(ValueError, match=message):
            RendezvousOptions(_params(etcd, run_id, **conf))


def test_unreachable_etcd_fails_fast_with_one_clear_error(run_id):
    port = free_port()
    params = RendezvousParameters("etcd-v3", f"127.0.0.1:{port}", run_id, 1, 2)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"etcd at 127.0.0.1:{port} did not answer"):
        handler_creator()(params)
    assert time.monotonic() - start < 15  # 4 s connect_timeout; generous for a loaded machine


def _join_all(handlers):
    infos = [None] * len(handlers)

    def join(i):
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return infos


def test_handlers_form_a_round_with_fresh_bootstrap_info_and_export_the_round(etcd, run_id, monkeypatch):
    for var in ("ELASTIC_TRAINER_RDZV_ROUND", "ELASTIC_TRAINER_RDZV_PREFIX", "ELASTIC_TRAINER_RDZV_NODE",
                "ELASTIC_TRAINER_RDZV_ENDPOINT", "ELASTIC_TRAINER_RDZV_CONN"):
        monkeypatch.delenv(var, raising=False)
    create = handler_creator()
    handlers = [create(_params(etcd, run_id, 2, 3)) for _ in range(2)]
    try:
        infos = _join_all(handlers)
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
        assert not handlers[0].use_agent_store
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
        import os
        assert os.environ["ELASTIC_TRAINER_RDZV_ROUND"] == "0"
        assert os.environ["ELASTIC_TRAINER_RDZV_PREFIX"] == f"/elastic-trainer/{run_id}/"
        fence = RoundFence.from_env()
        assert fence is not None and fence.token == "round-0"
        fence.check()
        # A third node asks to join: the members see it waiting and re-rendezvous.
        third = create(_params(etcd, run_id, 2, 3))
        handlers.append(third)
        joined = threading.Thread(target=lambda: third.next_rendezvous(), daemon=True)
        joined.start()
        wait_until(lambda: handlers[0].num_nodes_waiting() > 0, 20, "the members to see the third node", interval=0.1)
        assert handlers[0].num_nodes_waiting() == 1
        infos = _join_all(handlers[:2])
        joined.join(30)
        assert {i.world_size for i in infos} == {3}
        assert infos[0].bootstrap_store_info.master_port != 0
        with pytest.raises(FencedError, match="round-0 .* is over"):
            fence.check()
    finally:
        for h in handlers:
            h.shutdown()


def test_watchdog_revokes_the_round_when_a_peer_loses_its_lease(etcd, run_id):
    create = handler_creator()
    a, b = (create(_params(etcd, run_id, 1, 2, lease_ttl="2", keep_alive_interval="0.5")) for _ in range(2))
    try:
        _join_all([a, b])
        assert a.num_nodes_waiting() == 0
        b._lease.close(revoke=True)  # b vanishes as if killed (its lease ends)
        wait_until(lambda: a.num_nodes_waiting() > 0, 10, "the watchdog to revoke the round", interval=0.1)
        assert "lost their etcd lease" in a._revoked
        # The survivor re-rendezvouses alone (no other live node to wait for).
        info = a.next_rendezvous()
        assert info.world_size == 1
    finally:
        a.shutdown()
        b.shutdown()


def test_a_node_whose_lease_expires_while_it_waits_to_join_takes_a_new_one_and_is_admitted(etcd, run_id, conn):
    """A node waiting to join (no workers) whose lease etcd expired (renewals too late: an overloaded
    etcd or node) takes a new lease and writes its keys again, and the round forms with it. It
    stayed invisible before, and at 1,000 simulated agents the nodes wrote each other out of the
    state for minutes."""
    create = handler_creator()
    a, b = (create(_params(etcd, run_id, 2, 2, lease_ttl="2", keep_alive_interval="0.5", join_timeout="20"))
            for _ in range(2))
    infos = [None, None]
    try:
        first = threading.Thread(target=lambda: infos.__setitem__(0, a.next_rendezvous()))
        first.start()
        wait_until(lambda: conn.client.get(f"/elastic-trainer/{run_id}/joining/{a.node_name}")[0] is not None,
                   10, "a to wait to join")
        conn.client.revoke_lease(a._lease._lease_id)  # as if etcd had expired it
        wait_until(lambda: conn.client.get(f"/elastic-trainer/{run_id}/alive/{a.node_name}")[0] is not None and
                   not a._lease.lost, 10, "a to take a new lease")
        infos[1] = b.next_rendezvous()
        first.join(30)
        assert [i.world_size for i in infos] == [2, 2] and sorted(i.rank for i in infos) == [0, 1]
    finally:
        a.shutdown()
        b.shutdown()


def test_node_that_lost_its_lease_must_leave_before_it_rejoins(etcd, run_id, conn):
    create = handler_creator()
    a = create(_params(etcd, run_id, 1, 2, lease_ttl="2", keep_alive_interval="0.5"))
    try:
        a.next_rendezvous()
        fence = RoundFence(0, f"/elastic-trainer/{run_id}/", etcd.endpoint, a.node_name)
        fence.check()
        # etcd expires the lease behind the node's back (as after a long pause).
        conn.client.revoke_lease(a._lease._lease_id)
        wait_until(lambda: a.num_nodes_waiting() > 0, 10, "the node to notice its lease expired", interval=0.1)
        # Seen by the renewal (etcd no longer knows the lease) or, first, by the watchdog, which
        # renews on its own thread now (this node's alive key is gone with the lease), which counts
        # fewer live nodes than participants and no longer reads their names to say which.
        assert a._revoked == "its etcd lease expired" or "of round 0 lost their etcd lease" in a._revoked
        with pytest.raises(FencedError):
            fence.check()
        info = a.next_rendezvous()  # the agent stopped its workers; a new lease, a new round
        assert info.world_size == 1 and a.num_nodes_waiting() == 0
        assert RoundFence(1, f"/elastic-trainer/{run_id}/", etcd.endpoint, a.node_name).check() is None
    finally:
        a.shutdown()


# -- TLS and user/password --------------------------------------------------------------

def test_tls_with_client_certificates(tmp_path, run_id):
    certs = make_certs(tmp_path / "certs")
    args = ["--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server-key.pem"),
            "--trusted-ca-file", str(certs / "ca.pem"), "--client-cert-auth"]
    server = EtcdServer(data_dir=tmp_path / "data", extra_args=args)
    server.start()
    try:
        tls = {"protocol": "https", "ca_cert": str(certs / "ca.pem"), "cert": str(certs / "client.pem"),
               "key": str(certs / "client-key.pem")}
        handler = handler_creator()(RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, 1,
                                                         local_addr="127.0.0.1", **tls))
        info = handler.next_rendezvous()
        assert info.world_size == 1
        handler.shutdown()
        # Without the client certificate, or without TLS, it fails at once with one sentence.
        for conf in ({"protocol": "https", "ca_cert": str(certs / "ca.pem")}, {}):
            with pytest.raises(RendezvousConnectionError, match="did not answer"):
                handler_creator()(RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, 1,
                                                       connect_timeout="2", **conf))
    finally:
        server.stop()


def test_user_and_password_auth(tmp_path, run_id):
    etcdctl = shutil.which("etcdctl") or "/usr/bin/etcdctl"
    server = EtcdServer(data_dir=tmp_path / "data")
    server.start()
    try:
        env = {"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}
        ctl = [etcdctl, "--endpoints", server.endpoint]
        subprocess.run([*ctl, "user", "add", "root:rootpw"], check=True, env=env, capture_output=True, timeout=20)
        subprocess.run([*ctl, "auth", "enable"], check=True, env=env, capture_output=True, timeout=20)
        handler = handler_creator()(RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, 1,
                                                         local_addr="127.0.0.1", user="root", password="rootpw"))
        assert handler.next_rendezvous().world_size == 1
        handler.shutdown()
        with pytest.raises(RendezvousConnectionError, match="user and password"):
            handler_creator()(RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, 1,
                                                   user="root", password="wrong"))
        with pytest.raises(Exception):  # no credentials: refused by etcd on the first request
            handler_creator()(RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, 1)).next_rendezvous()
    finally:
        server.stop()


def test_scale_benchmark_smallest_size_forms_one_round(etcd):
    from benchmarks.rdzv_scale import run_size

    result = run_size(etcd.endpoint, 8, 4, 60.0, {"lease_ttl": "10", "keep_alive_interval": "2"})
    assert result["ranks_ok"] and result["all_ranked_s"] is not None, result
    assert result["requests_per_agent"] < 50


def test_a_finished_run_can_be_started_again_with_the_same_run_id(etcd, run_id):
    create = handler_creator()
    first = create(_params(etcd, run_id, 1, 1))
    assert first.next_rendezvous().world_size == 1
    first.shutdown()  # the job ended: torch closes the rendezvous
    again = create(_params(etcd, run_id, 1, 1))
    try:
        assert again.next_rendezvous().world_size == 1
        import os
        assert int(os.environ["ELASTIC_TRAINER_RDZV_ROUND"]) >= 1  # rounds continue: fences stay unique
    finally:
        again.shutdown()


@pytest.mark.timeout(90)
def test_a_finished_run_id_reused_by_several_nodes_at_once_starts_the_run(etcd, run_id):
    """What a re-created Kubernetes Job does: every pod starts at the same moment with the finished
    run's id. Each saw the others alive and left the closed state alone, so every node failed."""
    create = handler_creator()
    first = create(_params(etcd, run_id, 1, 1))
    assert first.next_rendezvous().world_size == 1
    first.shutdown()  # the job ended: the rendezvous is closed
    nodes = [create(_params(etcd, run_id, 3, 3)) for _ in range(3)]
    for node in nodes:
        node._lease.ensure()  # every pod is alive before any reads the state: the worst case
    results: list = []

    def join(node):
        try:
            results.append(node.next_rendezvous().world_size)
        except BaseException as exc:  # noqa: BLE001 - the test reports which
            results.append(exc)

    threads = [threading.Thread(target=join, args=(n,), daemon=True) for n in nodes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [3, 3, 3], results
    finally:
        for node in nodes:
            node.shutdown()


def test_a_closed_run_with_a_live_node_stays_closed(etcd, run_id):
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    create = handler_creator()
    a, b = create(_params(etcd, run_id, 1, 2)), create(_params(etcd, run_id, 1, 2))
    try:
        a.next_rendezvous()
        a.set_closed()  # closed while a is still alive: a late joiner is refused, as in torch
        with pytest.raises(RendezvousClosedError):
            b.next_rendezvous()
    finally:
        a.shutdown()
        b.shutdown()


def test_a_spare_node_beyond_max_nodes_is_told_the_run_is_closed_when_it_finishes(etcd, run_id, backend):
    """A pod beyond --max-nodes waits as a spare (torch's redundancy list). When the run finishes, torch's
    join raises RendezvousGracefulExitError, which its agent turns into a run() that returns None and its
    launcher into an AttributeError (exit 1; a Job recreates the pod). Ours says RendezvousClosedError,
    which elastic-train ends with status 0."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    create = handler_creator()
    a, spare = create(_params(etcd, run_id, 1, 1)), create(_params(etcd, run_id, 1, 1, last_call_timeout="0.5"))
    outcome: list[BaseException | None] = []

    def join_as_spare():
        try:
            spare.next_rendezvous()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test checks which one
            outcome.append(exc)

    try:
        assert a.next_rendezvous().world_size == 1
        thread = threading.Thread(target=join_as_spare, daemon=True)
        thread.start()

        def spares() -> int:
            found = backend.read_state()
            return len(decode_state(found[0]).redundancy_list) if found else 0
        wait_until(spares, 30, "the spare in the full round's redundancy list", until=lambda n: n == 1, interval=0.05)
        assert thread.is_alive() and not outcome, outcome  # and it waits there
        a.set_closed()  # the run finished: torch's launcher closes the rendezvous
        thread.join(30)
        assert outcome and isinstance(outcome[0], RendezvousClosedError), outcome
    finally:
        a.shutdown()
        spare.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_behind_a_slow_etcd_keeps_its_round(etcd, run_id, caplog):
    """Every etcd request 0.5 s late (etcd healthy): the lease stays renewed in time and the node
    never fences itself; the watchdog's reads no longer delay the renewals."""
    from tests.helpers.slow_proxy import SlowProxy

    with SlowProxy("127.0.0.1", etcd.port, delay=0.5) as proxy:
        node = handler_creator()(RendezvousParameters("etcd-v3", proxy.endpoint, run_id, 1, 1,
                                                      local_addr="127.0.0.1", connect_timeout="10"))
        try:
            with caplog.at_level(logging.WARNING, logger="elastic_trainer.rendezvous"):
                assert node.next_rendezvous().world_size == 1
                deadline = time.monotonic() + 7  # over two lease periods (lease_ttl 3)
                while time.monotonic() < deadline:  # torch's agent asks every monitor interval
                    assert node.num_nodes_waiting() == 0, caplog.text
                    time.sleep(0.1)
            assert "stopping its workers" not in caplog.text
        finally:
            node.shutdown()
