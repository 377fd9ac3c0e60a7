"""``benchmarks/live_sim.py`` at its smallest (5 nodes of 2 workers, one lost node): the simulation
of the live path at scale runs the product's etcd code end to end, and every survivor learns the
next quorum from its watcher. The numbers at scale are the benchmark's (benchmarks/results/live_sim.txt)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import live_sim

pytestmark = pytest.mark.timeout(120)


def test_a_lost_node_reaches_every_survivor_of_a_small_simulation(etcd):
    args = argparse.Namespace(nodes=5, workers=2, processes=2, channels=1, poll=1.0, lease_ttl=3, losses=1,
                              reread=False, no_reports=False, settle=0.2, window=1.0, between=0.0, timeout=30.0)
    result = live_sim.run(args, etcd.endpoint)
    assert result["steady"]["requests_per_s"] < 20, "5 nodes at rest: their 5 lease renewals a second"
    loss = result["losses"][0]
    assert loss["knew"] == loss["survivors"] == 8, "every survivor must see the next quorum"
    assert loss["whole_reads"] == 10, "one whole read per watcher, when its watch was established"
    assert result["lost_leases"] == 0
