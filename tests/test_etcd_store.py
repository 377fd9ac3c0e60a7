"""The etcd-backed torch Store: c10d semantics against a real etcd, alone and in a PrefixStore."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions
from elastic_trainer.etcd.store import EtcdStore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(etcd, run_id):
    conn = EtcdConnection(EtcdOptions(endpoints=(("127.0.0.1", etcd.port),)))
    yield EtcdStore(conn, f"/elastic-trainer/{run_id}/store/", timeout=timedelta(seconds=10))
    conn.close()


def test_set_get_check_delete_and_num_keys(store):
    assert store.num_keys() == 0
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"1" and store.get("b") == b"\x00\xff"
    assert store.check(["a", "b"]) and not store.check(["a", "missing"])
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == 1


def test_blocking_get_times_out_with_lookup_error(store):
    store.set_timeout(timedelta(seconds=0.5))
    start = time.monotonic()
    with pytest.raises(LookupError, match="was not set"):
        store.get("never")
    assert 0.4 < time.monotonic() - start < 30
    with pytest.raises(LookupError):
        store.wait(["never"], timedelta(seconds=0.2))


def test_blocking_get_wakes_when_another_client_sets_the_key(store):
    threading.Timer(0.5, lambda: store.set("later", "v")).start()
    start = time.monotonic()
    assert store.get("later") == b"v"
    assert time.monotonic() - start < 9  # woke before the 10 s store timeout
    threading.Timer(0.3, lambda: store.set("w2", "v")).start()
    store.set("w1", "v")
    store.wait(["w1", "w2"])


def test_add_is_atomic_among_racing_threads(store):
    threads = [threading.Thread(target=lambda: [store.add("counter", 1) for _ in range(10)]) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("counter", 0) == 60
    assert store.get("counter") == b"60"


def test_compare_set_follows_c10d(store):
    assert store.compare_set("k", "", "first") == b"first"     # absent + empty expected: set
    assert store.compare_set("k", "wrong", "x") == b"first"    # mismatch: the current value
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.compare_set("absent", "nope", "x") == b"nope"  # absent + expected: the expected value
    assert not store.check(["absent"])


def test_works_wrapped_in_a_prefix_store(store):
    prefixed = dist.PrefixStore("torch.rendezvous.run.3", store)
    prefixed.set("MASTER_ADDR", "127.0.0.1")
    assert prefixed.get("MASTER_ADDR") == b"127.0.0.1"
    assert store.get("torch.rendezvous.run.3/MASTER_ADDR") == b"127.0.0.1"
    assert prefixed.add("n", 2) == 2 and prefixed.add("n", 3) == 5
    assert prefixed.compare_set("c", "", "v") == b"v"
    assert prefixed.check(["MASTER_ADDR"]) and not prefixed.check(["nope"])
    prefixed.wait(["MASTER_ADDR"], timedelta(seconds=1))
    prefixed.multi_set(["x", "y"], ["1", "2"])
    assert prefixed.multi_get(["x", "y"]) == [b"1", b"2"]
    store.delete_prefix("torch.rendezvous.run.3/")
    assert store.num_keys() == 0


def test_a_rounds_bootstrap_keys_go_out_and_come_back_in_one_request_each_under_torchs_prefix(store):
    """The handler writes and reads a round's MASTER_ADDR and MASTER_PORT with ``multi_set`` and
    ``multi_get`` (one request each, not torch's one per key: 2,000 requests at 1,000 agents), under
    the keys torch's PrefixStore of the round uses; ``multi_get`` waits until both are set."""
    keys = ["torch.rendezvous.run.3/MASTER_ADDR", "torch.rendezvous.run.3/MASTER_PORT"]
    threading.Timer(0.3, lambda: store.multi_set(keys, [b"10.0.0.1", b"29500"])).start()
    assert store.multi_get(keys) == [b"10.0.0.1", b"29500"]
    before = store.requests
    store.multi_set(keys, [b"10.0.0.2", b"29501"])
    assert store.multi_get(keys) == [b"10.0.0.2", b"29501"] and store.requests == before + 2
    prefixed = dist.PrefixStore("torch.rendezvous.run.3", store)
    assert (prefixed.get("MASTER_ADDR"), prefixed.get("MASTER_PORT")) == (b"10.0.0.2", b"29501")


def test_torch_barrier_over_the_store_releases_all_agents(store):
    from torch.distributed.elastic.utils import store as store_util

    errors = []

    def agent(rank):
        try:
            store_util.barrier(dist.PrefixStore("exit", store), world_size=3, key_prefix="b", barrier_timeout=20)
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
