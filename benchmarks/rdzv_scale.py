"""Rendezvous scale: how long N agents take to form one round on one etcd.

Run (from the repository root):

    .venv/bin/python benchmarks/rdzv_scale.py                    # sizes 8, 64, 256, 1000
    .venv/bin/python benchmarks/rdzv_scale.py --sizes 8          # the smoke test's size

Each simulated agent is a thread running the real etcd-v3 handler (backend, JSON state
holder, lease keeper, etcd store) exactly as torchrun's agent calls it:
``next_rendezvous()`` with min_nodes = max_nodes = N, so the round completes when the
last agent joined and every agent then has its rank and MASTER_ADDR/PORT. Agents share
``--connections`` gRPC channels (1,000 channels in one process would measure Python,
not etcd). It prints, per size: seconds until every agent had its rank, the slowest
agent, etcd requests per agent (state reads/writes, store, lease), and lost
compare-and-swap races per agent.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torch.distributed.elastic.rendezvous.api import RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
)

from elastic_trainer.etcd_server import EtcdServer  # noqa: E402
from elastic_trainer.rendezvous._etcd import EtcdConnection  # noqa: E402
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend  # noqa: E402
from elastic_trainer.rendezvous.etcd_store import EtcdStore  # noqa: E402
from elastic_trainer.rendezvous.handler import (  # noqa: E402
    _NO_STATE_HEARTBEATS,
    EtcdRendezvousHandler,
    RendezvousOptions,
)


def run_size(endpoint: str, n: int, connections: int, timeout: float, conf: dict) -> dict:
    run_id = f"scale-{n}-{int(time.time())}"
    params = RendezvousParameters("etcd-v3", endpoint, run_id, n, n, local_addr="127.0.0.1",
                                  join_timeout=str(timeout), **conf)
    options = RendezvousOptions(params)
    conns = [EtcdConnection(options.etcd) for _ in range(min(connections, n))]
    settings = RendezvousSettings(run_id, n, n, RendezvousTimeout(
        join=timedelta(seconds=timeout), last_call=timedelta(seconds=options.last_call_timeout),
        close=timedelta(seconds=options.close_timeout), heartbeat=timedelta(seconds=options.heartbeat_timeout)),
        keep_alive_interval=_NO_STATE_HEARTBEATS, keep_alive_max_attempt=3)
    handlers = []
    for i in range(n):
        conn = conns[i % len(conns)]
        backend = EtcdRendezvousBackend(conn, run_id, options.key_prefix)
        store = EtcdStore(conn, backend.prefix + "store/")
        node = DynamicRendezvousHandler._node_desc_generator.generate("127.0.0.1")
        handlers.append(EtcdRendezvousHandler(node, settings, store, backend, conn, options))
    done = [None] * n
    errors: list[str] = []
    go = threading.Event()

    def agent(i: int) -> None:
        go.wait()
        try:
            info = handlers[i].next_rendezvous()
            done[i] = (time.monotonic(), info.rank)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start = time.monotonic()
    go.set()
    for t in threads:
        t.join(max(0.1, start + timeout + 5 - time.monotonic()))
    finished = [d for d in done if d is not None]
    ranks = sorted(d[1] for d in finished)
    requests = [h._etcd_backend.requests + h._store.requests + h._lease.requests for h in handlers]
    lost = [h._op_executor.lost_races for h in handlers]
    result = {
        "agents": n, "joined": len(finished), "ranks_ok": ranks == list(range(n)),
        "all_ranked_s": max(d[0] for d in finished) - start if len(finished) == n else None,
        "first_ranked_s": min(d[0] for d in finished) - start if finished else None,
        "requests_per_agent": statistics.mean(requests), "lost_races_per_agent": statistics.mean(lost),
        "errors": sorted(set(errors))[:3],
    }
    for h in handlers:
        h._joined = None
        h._lease.close(revoke=False)
    try:
        conns[0].client.delete_prefix(handlers[0]._etcd_backend.prefix)
    except Exception:  # noqa: BLE001 - cleanup of a benchmark run; the etcd is thrown away anyway
        pass
    for c in conns:
        c.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="N simulated agents join one etcd-v3 rendezvous round.")
    p.add_argument("--sizes", default="8,64,256,1000", help="comma list of agent counts (default 8,64,256,1000)")
    p.add_argument("--connections", type=int, default=16, help="gRPC channels the agents share (default 16)")
    p.add_argument("--timeout", type=float, default=120.0, help="join timeout per size in seconds (default 120)")
    p.add_argument("--endpoint", default=None, help="an etcd to use (default: start a private one)")
    p.add_argument("--rdzv-conf", default="lease_ttl=30,keep_alive_interval=5",
                   help="handler options k=v,... (default lease_ttl=30,keep_alive_interval=5: a thousand lease "
                        "threads in one Python process on 2 cores cannot renew 3 s leases in time)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if item)

    server, tmp = None, None
    endpoint = args.endpoint
    if endpoint is None:
        tmp = tempfile.mkdtemp(prefix="rdzv-scale-")
        server = EtcdServer(data_dir=Path(tmp) / "etcd").start()
        endpoint = server.endpoint
    print(f"{'agents':>7} {'all ranked s':>13} {'first s':>8} {'req/agent':>10} {'lost CAS/agent':>15}  notes")
    try:
        for n in sizes:
            r = run_size(endpoint, n, args.connections, args.timeout, conf)
            all_s = f"{r['all_ranked_s']:13.2f}" if r["all_ranked_s"] is not None else f"{'>' + str(args.timeout):>13}"
            first = f"{r['first_ranked_s']:8.2f}" if r["first_ranked_s"] is not None else f"{'-':>8}"
            notes = "" if r["ranks_ok"] else f"only {r['joined']}/{n} ranked; {r['errors']}"
            print(f"{n:>7} {all_s} {first} {r['requests_per_agent']:10.1f} {r['lost_races_per_agent']:15.1f}  {notes}",
                  flush=True)
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; agents are threads of one process "
          f"sharing {args.connections} gRPC channels")
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
