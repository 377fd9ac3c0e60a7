"""How long a live re-form takes at a few nodes: the product's round, from all members entering it to the last knowing the quorum.

Run (from the repository root):

    .venv/bin/python benchmarks/reform_latency.py --nodes 3 --reforms 25

Each node is an agent's lease (a ``LeaseKeeper`` with its renewal record, as ``elastic-train``
runs it) and one worker's ``LiveGroup`` on it (``elastic_trainer/live/group.py``), all in this
process against a private etcd. The groups join one quorum, then re-form ``--reforms`` times
(after ``--warm-up`` rounds not counted): the members enter ``LiveGroup.reform`` together (a
barrier) and each times its own call. Printed per re-form: the proposer's time (its report, its
looks at the reports, the compare-and-swap) and the last member's (its report, then the new
quorum through its watcher), median and worst. No process group is made: this is the
membership's part of a re-form (``benchmarks/live_recovery.py`` times the whole recovery).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from elastic_trainer.env import LiveSettings  # noqa: E402
from elastic_trainer.etcd.server import EtcdServer  # noqa: E402
from elastic_trainer.live.group import LiveGroup  # noqa: E402
from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions, parse_endpoints  # noqa: E402
from elastic_trainer.rendezvous.lease import LeaseKeeper  # noqa: E402
from elastic_trainer.rendezvous.node_lease import AgentRecord  # noqa: E402


def connection(endpoint: str) -> EtcdConnection:
    return EtcdConnection(EtcdOptions(endpoints=parse_endpoints(endpoint), retry_timeout=10))


def measure(endpoint: str, nodes: int, reforms: int, warm_up: int) -> tuple[list[float], list[float]]:
    """(the proposer's seconds, the last member's seconds) for each counted re-form."""
    settings = LiveSettings(min_nodes=1, max_nodes=nodes, last_call=10.0, join_timeout=30)
    agents, groups = [], []
    try:
        for i in range(nodes):
            record = AgentRecord()
            keeper = LeaseKeeper(connection(endpoint), f"/bench/alive/node{i}", ttl=int(settings.lease_ttl),
                                 interval=settings.keep_alive_interval, on_renewed=record)
            keeper.ensure()
            agents.append((keeper, record))
            groups.append(LiveGroup.make(connection(endpoint), "/bench/", f"node{i}", 0, 1, "127.0.0.1", settings,
                                         keeper.lease_id))
        joining = [threading.Thread(target=g.join) for g in groups]
        for t in joining:
            t.start()
        for t in joining:
            t.join(60)
        time.sleep(1.0)  # every watcher has read, every first candidate's report feed is open
        proposer_s, last_s = [], []
        for r in range(warm_up + reforms):
            barrier = threading.Barrier(len(groups))
            took: dict[str, float] = {}

            def one(g: LiveGroup, step: int = r) -> None:
                barrier.wait()
                t0 = time.perf_counter()
                g.reform(step, "benchmark")
                took[g.id] = time.perf_counter() - t0

            threads = [threading.Thread(target=one, args=(g,)) for g in groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            if r >= warm_up:
                first = groups[0].quorum.members[0].id
                proposer_s.append(took[first])
                last_s.append(max(took.values()))
            time.sleep(0.2)
        return proposer_s, last_s
    finally:
        for g in groups:
            g.close()
        for keeper, record in agents:
            keeper.close(revoke=True)
            record.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="single-worker nodes")
    p.add_argument("--reforms", type=int, default=25, help="re-forms counted")
    p.add_argument("--warm-up", type=int, default=3, help="re-forms first, not counted")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as record, tempfile.TemporaryDirectory(prefix="reform-latency-") as tmp:
        server = EtcdServer(data_dir=Path(tmp) / "etcd").start()
        try:
            proposer_s, last_s = measure(server.endpoint, args.nodes, args.reforms, args.warm_up)
        finally:
            server.stop()
        for name, ts in (("proposer", proposer_s), ("last member", last_s)):
            print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms, worst {max(ts) * 1e3:.1f} ms "
                  f"over {len(ts)} re-forms at {args.nodes} single-worker nodes")
        print("command: " + record.command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
