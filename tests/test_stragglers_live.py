"""Stragglers under ``elastic-train``, end to end: three live nodes of the built-in trainer, one five
times slower than the others (its own ``--sleep-per-step``, a node-local flag: 0.15 s a step against
0.03 s). The ranks name it from their own step times, the others re-form without it live, its
launcher holds it out (listed as refused in the status meanwhile), checks it (storage, etcd, the
device) and lets it rejoin (still slow, it
would be evicted again after the cool-down, held out twice as long: ``BackOff``, tested on its own).

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_stragglers_live.py -q
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions, parse_endpoints
from elastic_trainer.etcd.server import free_port
from elastic_trainer.observability.check_board import read_refused
from tests.helpers.common import wait_until
from tests.helpers.scrape import figure, live_node, node_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLOW = 2


def test_a_node_at_a_fifth_of_the_speed_is_evicted_live_held_out_checked_and_rejoins(etcd, run_id, procs, tmp_path):
    ports = [free_port() for _ in range(3)]
    outs = [tmp_path / f"node{i}.log" for i in range(3)]

    def node(i: int) -> subprocess.Popen:
        return live_node(procs, outs[i], endpoint=etcd.endpoint, run_id=run_id, nnodes="2:3", port=ports[i],
                         run_dir=tmp_path, launcher=("--straggler-sustain", "2", "--straggler-cooldown", "4",
                                                     "--straggler-hold-out", "3"),
                         trainer=("--sleep-per-step", "0.15" if i == SLOW else "0.03"))

    def tails() -> str:
        return "\n".join(f"--- {o.name}\n{o.read_text()[-3000:]}" for o in outs if o.exists())

    def figures() -> list[dict]:
        return [node_metrics(p) for p in ports]

    def refused() -> list:
        return conn.call(lambda c: read_refused(c, f"/elastic-trainer/{run_id}/"))

    conn = EtcdConnection(EtcdOptions(endpoints=parse_endpoints(etcd.endpoint)))
    nodes = [node(i) for i in range(3)]
    slow = SLOW
    # held out for 3 s: the status lists it meanwhile, with its line
    [held] = wait_until(refused, 120, "the slow node left out, in the status", interval=0.05, details=tails)
    assert "was left out (" in held.line and "rejoins in 3 s" in held.line, held
    conn.close()
    wait_until(lambda: outs[slow].read_text(), 120, "the slow node left out",
               until=lambda text: "was left out" in text, details=tails)
    wait_until(figures, 60, "the others re-formed without it, a straggler's eviction",
               until=lambda ms: any(figure(m, "elastic_trainer_recoveries_total", kind="straggler") >= 1
                                    for i, m in enumerate(ms) if i != slow), details=tails)  # rank 0's node
    assert "rejoins in 3 s" in outs[slow].read_text(), tails()
    # held out, checked, then admitted again as a newcomer
    text = wait_until(lambda: outs[slow].read_text(), 120, "the evicted node checked and admitted again",
                      until=lambda text: "(newcomer)" in text.partition("rejoining")[2], details=tails)
    assert "node check passed: storage" in text and "etcd" in text and "device" in text, tails()
    ms = figures()
    assert all(figure(m, "elastic_trainer_recoveries_total", kind="kill") == 0
               and figure(m, "elastic_trainer_recoveries_total", kind="freeze") == 0 for m in ms), tails()
    assert all("was left out" not in outs[i].read_text() for i in range(3) if i != slow), "a fast node evicted"
    for n in nodes:
        n.send_signal(signal.SIGTERM)
    for n in nodes:
        n.wait(timeout=120)
