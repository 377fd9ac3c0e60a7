"""``benchmarks/live_sim.py`` at its smallest (5 nodes of 2 workers, one lost node): the simulation
of the live path at scale runs the product's etcd code end to end, and every survivor learns the
next quorum from its watcher. The numbers at scale are the benchmark's (benchmarks/results/live_sim.txt)."""

from __future__ import annotations

import argparse
import shutil
import tempfile

import pytest

from benchmarks import live_sim

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def workdir():
    """The simulation's files (its nodes' lease records and shared directories, with their
    sockets): under the system's temp dir, whose short path a socket's name fits in (pytest's
    ``tmp_path`` is too long for AF_UNIX's 108 bytes)."""
    path = tempfile.mkdtemp(prefix="live-sim-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("shared", [False, True], ids=["sibling-threads", "shared-siblings"])
def test_a_lost_node_reaches_every_survivor_of_a_small_simulation(etcd, workdir, shared):
    args = argparse.Namespace(nodes=5, workers=2, processes=2, channels=1, poll=1.0, lease_ttl=3, losses=1,
                              reread=False, no_reports=False, settle=0.2, window=1.0, between=0.0, timeout=30.0,
                              shared_siblings=shared, workdir=workdir)
    result = live_sim.run(args, etcd.endpoint)
    assert result["steady"]["requests_per_s"] < 20, "5 nodes at rest: their 5 lease renewals a second"
    loss = result["losses"][0]
    assert loss["knew"] == loss["survivors"] == 8, "every survivor must see the next quorum"
    # One whole read per node's stream, when it was established (its sibling loads the view the
    # watching worker published), and one report per node (live/node_report.py)
    assert loss["whole_reads"] == 5
    assert loss["report_puts"] == 4
    assert result["lost_leases"] == 0 and result["look_errors"] == 0


@pytest.mark.parametrize("thin_aio", [False, True], ids=["thin-threads", "thin-aio-proposer-apart"])
def test_thin_nodes_carry_the_etcd_load_and_the_full_ones_run_the_product(etcd, workdir, thin_aio):
    """``--full-nodes``: the proposers' and the lost nodes run the product's code whole, the others
    only their etcd side (one watch stream, one report put per loss; ``--thin-aio``: all of a
    process's on one asyncio loop, and with it ``--proposer-apart``: the first node in a process of
    its own): every survivor, thin or full, is counted, and only the full nodes read the live keys
    whole. The losses are expiries."""
    args = argparse.Namespace(nodes=7, workers=2, processes=2, channels=1, poll=1.0, lease_ttl=3, losses=2,
                              reread=False, no_reports=False, settle=0.2, window=1.0, between=0.0, timeout=30.0,
                              shared_siblings=True, full_nodes=2, expire=True,
                              thin_aio=thin_aio, proposer_apart=thin_aio, workdir=workdir)
    result = live_sim.run(args, etcd.endpoint)
    first, second = result["losses"]
    assert result["loss"] == "expiry"  # the lost node's lease expires (3 s after its last renewal)
    assert result["processes"] == (3 if thin_aio else 2)
    assert first["knew"] == first["survivors"] == 12 and second["knew"] == second["survivors"] == 10
    assert first["report_puts"] == 6 and second["report_puts"] == 5, "one report per surviving node"
    assert 3 <= result["full_nodes"] <= 5, "the first 3 nodes in the quorum's order and the 2 lost ones"
    assert first["whole_reads"] == result["full_nodes"], "only the full nodes read the live keys whole"
    assert first["breakdown"]["thin"]["event_worst_s"] > 0 and first["breakdown"]["siblings"]["knew_worst_s"] > 0
    assert result["lost_leases"] == 0 and result["look_errors"] == 0
