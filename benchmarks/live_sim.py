"""The live path at scale (issue 32, point 2): N simulated nodes of W workers against one real etcd.

Run (from the repository root):

    .venv/bin/python benchmarks/live_sim.py --nodes 100 --workers 8 --shared-siblings   # 800 watchers
    .venv/bin/python benchmarks/live_sim.py --nodes 1000 --workers 8 --processes 8 --timeout 180 \
        --shared-siblings --full-nodes 16 --losses 3 --settle 3 --window 5 --between 2 --start-wave 8 \
        --thin-aio --expire --lease-ttl 3 --proposer-apart --txt benchmarks/results/live_sim.txt
    .venv/bin/python benchmarks/live_sim.py --nodes 5 --workers 2 --processes 2 --losses 1 --window 2  # smoke

What runs is the product's etcd code with the process groups and torch left out, driven through
its public parts (``live_sim_nodes.SimWorker``): each simulated worker is a ``LiveGroup``
(``elastic_trainer/live/group.py``) composed as ``LiveGroup.make`` composes it (its key layout,
its membership, its watcher thread with its real ``WatchStream``, a whole read when the stream is
established, then its events; its re-form with its report feed), except that the workers of a
process share one probe listener and each node's ``LeaseKeeper`` renews the node's lease for its
workers (no stand-in renewal thread per worker). Each node has ONE etcd lease (renewed every
``keep_alive_interval``, 1 s) with its workers' ``live/alive/<id>`` keys on it, as the product has
it: a lost node deletes its W alive keys at once. Each node also keeps ONE etcd watch, as the
product does on a node's lease (``live/node_share.py``: the node's first worker keeps the stream
and publishes, its siblings load what it published). The nodes are spread over ``--processes``
processes (real workers are separate processes; a thousand threads under one GIL measure Python's
scheduler), the workers of a process sharing ``--channels`` gRPC channels (many streams per channel).

It measures, in order:

1. **Start**: the workers register (``join/<id>`` and ``alive/<id>`` on their node's lease), the
   main process forms quorum 1 from what it reads (the complete nodes, a cold quorum,
   compare-and-swap), every worker adopts it and deletes its join key, then starts its watcher;
   seconds until every watcher has read.
2. **Steady state**: after ``--settle`` seconds, etcd's own ``/metrics`` read twice ``--window``
   seconds apart (``benchmarks/etcd_load.py``'s ``scrape``): requests/s by gRPC method, and bytes
   etcd sent (``etcd_network_client_grpc_sent_bytes_total``). Target (issue 32): < 2,000
   requests/s at 1,000 x 8.
3. **A lost node** (``--losses`` times, a different node each): its process revokes the node's
   lease (t0, the lease gone at etcd). Every survivor's watcher sees its node's alive keys go
   (the ``on_member_lost`` its group was made with) and reports, as ``LiveGroup.reform`` does
   first: each worker to its node's directory, and its node's reporter puts the node's one report
   (``live/node_report.py``; ``live_sim_nodes.Gatherer`` gathers for the nodes of a process, its
   reporters waiting up to ``SIM_GRACE`` for their siblings, served one after the other here,
   where the product's wait 0.5 s; the puts from a pool of 16 threads per process, as each node's
   training thread puts it). The first member of the first node not lost is the re-form's
   proposer (``live/reform.py``): it runs the product's ``LiveGroup.reform`` (its report, the
   reports its standing report feed follows, the compare-and-swap); every other survivor is a
   follower, which learns the new quorum from its watcher's views (``Watcher.subscribe``; the
   product's follower returns from ``reform`` then, reading nothing), and adopts it. The main
   process watches the reports only to time them. Printed: from t0, when the first and the last
   survivor saw the loss, when the reports were all in, when the quorum was written, and when the
   last survivor knew it (median and worst over the survivors), then the same by role (the workers
   that keep a stream, with when the new quorum's event reached it, and the siblings that learn
   from them); etcd's requests and bytes for the loss; whole reads the watchers made. Target: the
   new quorum known everywhere < 1 s after the lease expires. What is not the product's: the
   followers do not block in ``reform`` (8,000 waiting threads; their take-over is
   ``tests/test_live_reform.py``'s), and the proposer's probes of the silent members reach one
   listener per simulation process.

``--shared-siblings`` serves every sibling of a process from one thread instead of two threads
each (``Part._serve_siblings``): each sibling still has its own socket, datagrams, ``NodeShare.load``
and ``Watcher.look`` (the product's code), but the looks of a process run one after the other,
where the product's run in parallel on their nodes' CPUs; a sibling's promotion (its node's
watching worker gone) is not simulated. It is what makes 1,000 x 8 fit on a small machine.
``--start-wave K`` starts the nodes of each process K at a time, each wave once the one before has
made its first read (a real job's nodes start over a minute).

``--full-nodes K`` runs the product's code whole on K nodes only (the proposers' nodes, the lost
ones, and others spread over the rest); every other node is a ``ThinNode``: its lease, its workers'
alive and join keys, ONE watch stream, and its one report put when the stream shows the loss, but
not the in-node work a real node does on its own CPUs (the watcher's looks, the publish, the
siblings' loads). The etcd load is the whole job's; a thin node knows the next quorum when its
stream delivers it, and the full nodes say what the in-node work adds. ``--thin-aio`` runs a
process's thin nodes on one asyncio loop (``live_sim_nodes.AioThin``, grpc.aio) instead of a
thread each (the same streams and puts to etcd): 125 stream threads and a put pool per process,
woken per event and fighting for the GIL, made the load 10-18 on 2 cores and the loss-to-last-report
time vary 0.5-1.6 s between losses; a real node has its own CPUs. ``--expire`` lets the lost
node's lease expire (its renewals stop) instead of revoking it, and times from the expiry (its last
accepted renewal's sending plus the TTL: etcd acts on it at its next 500 ms check).

``--reread`` runs the watcher as it was before it applied the stream's events: every event makes
it read all the live keys again (the "before" of docs/rendezvous.md's numbers; through the
``stream_factory`` the groups are made with: a stream that only says "changed").

``--proposer-apart`` runs the quorum's first node (every loss's proposer: the losses never take it)
alone in one more process. Without it the proposer's node shares a process, and its GIL, with ~125
other nodes' streams and the full nodes' decodes of each new quorum (8,000 members): at 1,000 x 8
its report feed held the last report 0.23-0.40 s after the main process's quiet watch did
(2026-12-03, instrumented), a wait a real node, on its own CPUs, does not have. The machine's 2
cores are still shared by every process.

The watchers check what needs no etcd every ``--poll`` seconds (default 1; the product's 0.1 s
only costs CPU here, 80,000 wake-ups a second at 1,000 x 8, and a watcher is woken at once by an
event either way). Every process, channel, lease, file and the private etcd end with the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from elastic_trainer.env import LiveSettings  # noqa: E402
from elastic_trainer.etcd.server import EtcdServer  # noqa: E402
from elastic_trainer.live import node_report  # noqa: E402
from elastic_trainer.live.keys import LiveKeys  # noqa: E402
from elastic_trainer.live.quorum import Quorum, encode  # noqa: E402
from elastic_trainer.live.reform import propose  # noqa: E402
from elastic_trainer.live.stream import WatchStream  # noqa: E402
from benchmarks.live_sim_nodes import PREFIX, Pool, connection, daemon_thread  # noqa: E402

TARGET_RPS, TARGET_S = 2000.0, 1.0


def sent_bytes(endpoint: str) -> float:
    """Bytes etcd has sent to its gRPC clients so far (its ``/metrics``)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("etcd_network_client_grpc_sent_bytes_total"))


def requests(before: dict, after: dict) -> dict[str, float]:
    """Messages etcd received per gRPC method between two ``scrape``s."""
    return {m: after.get((k, m), 0.0) - before.get((k, m), 0.0)
            for (k, m) in after if k == "grpc_server_msg_received_total"
            if after.get((k, m), 0.0) - before.get((k, m), 0.0) > 0}


def etcd_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) etcd has used so far, from /proc (0 when unknown: an outside etcd)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return 0.0


def full_names(nodes: list[str], lost: list[str], count: int) -> list[str]:
    """The ``--full-nodes``: every node a loss's proposer may come from (the first ones in the
    quorum's order, one more than the losses), the lost ones, then nodes spread evenly over the
    rest, ``count`` in all (or more, where the first two need it)."""
    chosen = dict.fromkeys(nodes[:len(lost) + 1] + lost)
    rest = [x for x in nodes if x not in chosen]
    extra = max(0, count - len(chosen))
    if extra and rest:
        chosen.update(dict.fromkeys(rest[int(i * len(rest) / extra)] for i in range(min(extra, len(rest)))))
    return list(chosen)


def _stats(ts: list[float]) -> tuple[float, float]:
    return statistics.median(ts), max(ts)


def run(args: argparse.Namespace, endpoint: str, etcd_pid: int | None = None) -> dict:
    from benchmarks.etcd_load import scrape  # here: the simulation processes need none of its imports

    n, w = args.nodes, args.workers
    # report_timeout: the simulation's 8,000 workers share 2 cores, so that a member may report
    # later than the product's 5 s, and the proposer would drop its node: not the product's loss
    settings = LiveSettings(min_nodes=1, max_nodes=n, last_call=0.0, lease_ttl=args.lease_ttl,
                            keep_alive_interval=1.0, poll=args.poll, hang_factor=0.0,
                            report_timeout=args.timeout / 2)
    nodes = [f"node{i:05d}" for i in range(n)]
    procs = min(args.processes, n)
    owner = {node: i % procs for i, node in enumerate(nodes)}
    apart = getattr(args, "proposer_apart", False)
    if apart:  # the first node (every loss's proposer) alone in a process (see --proposer-apart)
        owner = {**{node: i % procs for i, node in enumerate(nodes[1:])}, nodes[0]: procs}
        procs += 1
    full_nodes = getattr(args, "full_nodes", None)
    if full_nodes is not None and not 1 <= full_nodes <= n:
        raise ValueError(f"--full-nodes must be between 1 and --nodes ({n})")
    lost_nodes = [nodes[(k * 7919 + 1) % n] for k in range(args.losses)]
    if apart and nodes[0] in lost_nodes:
        raise ValueError("--proposer-apart: a loss would take the first node, the proposer set apart; "
                         "change --nodes or --losses")
    pool = Pool(procs)
    main_conn = connection(endpoint)
    observer = LiveKeys(main_conn, PREFIX)  # the main process's reads and writes of the live keys
    result: dict = {"nodes": n, "workers": w, "processes": procs, "channels": args.channels, "poll_s": args.poll,
                    "watcher": "reread" if args.reread else "events",
                    "shared_siblings": getattr(args, "shared_siblings", False),
                    "start_wave": getattr(args, "start_wave", 0), "full_nodes": full_nodes,
                    "loss": "expiry" if getattr(args, "expire", False) else "revoke",
                    "thin_aio": getattr(args, "thin_aio", False), "proposer_apart": apart}
    try:
        t = time.monotonic()
        registered = sum(pool.ask("setup", [{"endpoint": endpoint, "nodes": [x for x in nodes if owner[x] == i],
                                             "workers": w, "channels": args.channels, "settings": settings,
                                             "reread": args.reread, "tmpdir": args.workdir,
                                             "shared_siblings": getattr(args, "shared_siblings", False),
                                             "thin_aio": getattr(args, "thin_aio", False)}
                                            for i in range(procs)]))
        view = observer.read()
        chosen = view.complete_nodes()
        members = tuple(m for _, ms in chosen for m in ms)
        q1 = Quorum(q=1, members=members, cold=True, cause="cold start", formed_at=time.time())
        if registered != n * w or len(members) != n * w or not observer.cas_quorum(q1, view.quorum_rev):
            raise RuntimeError(f"{registered} workers registered, {len(members)} in whole nodes: not {n * w}")
        result["registered_s"] = round(time.monotonic() - t, 2)
        result["quorum_bytes"] = len(q1.to_json())
        if full_nodes is not None:  # the proposers (the first nodes in the quorum's order) and the lost ones are full
            result["full_nodes"] = sum(pool.ask("thin_out", {"full": full_names(q1.nodes, lost_nodes, full_nodes)}))
        pool.ask("adopt", {"data": q1.to_json()})
        read = sum(a["read"] for a in pool.ask("watch", {"reports": not args.no_reports, "timeout": args.timeout,
                                                          "wave": getattr(args, "start_wave", 0)}))
        result["watching_s"] = round(time.monotonic() - t, 2)
        if read != n * w:
            raise RuntimeError(f"only {read} of {n * w} watchers read the live keys within {args.timeout:g}s")
        print(f"{n} nodes x {w} workers over {procs} processes, watcher "
              f"{'re-reading on every event (--reread)' if args.reread else 'applying events'}: registered in {result['registered_s']:.1f}s, "
              f"every watcher reading at {result['watching_s']:.1f}s; quorum record {result['quorum_bytes']:,} bytes",
              flush=True)

        time.sleep(args.settle)
        lost = sum(part["stats"]["lost_leases"] for part in pool.ask("collect", {"timeout": 0}))
        if lost:
            raise RuntimeError(f"{lost} node leases were lost (renewed too late: the machine is too loaded for "
                               f"--lease-ttl {args.lease_ttl}); the losses would not be the simulation's own")
        m0, b0, t0, c0 = scrape(endpoint), sent_bytes(endpoint), time.monotonic(), etcd_cpu_s(etcd_pid)
        time.sleep(args.window)
        m1, b1, t1, c1 = scrape(endpoint), sent_bytes(endpoint), time.monotonic(), etcd_cpu_s(etcd_pid)
        by_method = {m: round(v / (t1 - t0), 1) for m, v in sorted(requests(m0, m1).items())}
        rps = sum(by_method.values())
        result["steady"] = {"window_s": round(t1 - t0, 1), "requests_per_s": round(rps, 1), "by_method": by_method,
                            "sent_bytes_per_s": round((b1 - b0) / (t1 - t0)),
                            "etcd_cpu_share": round((c1 - c0) / (t1 - t0), 3)}
        print(f"steady state: {rps:,.1f} requests/s ({'met' if rps < TARGET_RPS else 'NOT met'}: "
              f"< {TARGET_RPS:,.0f}), {(b1 - b0) / (t1 - t0) / 1e3:,.1f} kB/s sent, etcd CPU {(c1 - c0) / (t1 - t0):.1%} of a core; "
              f"by method: "
              + ", ".join(f"{m} {v:g}" for m, v in by_method.items()), flush=True)

        losses, q = [], q1
        for k in range(args.losses):
            lost_node = lost_nodes[k]
            target = q.q + 1
            # the first member of the first node not lost: its reform proposes (live_reform.py)
            proposer = next(m.id for m in q.members if m.node != lost_node)
            pool.ask("expect", {"target": target, "proposer": None if args.no_reports else proposer})
            reports: list[int] = []
            all_reported = threading.Event()
            survivors = (n - 1 - k) * w

            def on_reports(changes, reports=reports, all_reported=all_reported, survivors=survivors) -> None:
                # a node's report (report/<q>/@<node>) counts its members
                reports.extend(len(node_report.expand({c.key.rsplit("/", 1)[1]: json.loads(c.value)}))
                               for c in changes if c.value is not None)
                if sum(reports) >= survivors:
                    all_reported.set()

            watch = WatchStream(main_conn, [f"{observer.prefix}report/{target}/"], lambda: None, on_events=on_reports)
            daemon_thread("reports", watch.run)
            watch.established.wait(10)
            m0, b0, c0 = scrape(endpoint), sent_bytes(endpoint), etcd_cpu_s(etcd_pid)
            lost_at = pool.ask("lose", {"node": lost_node, "expire": getattr(args, "expire", False)},
                               only=owner[lost_node])[0]
            if args.no_reports:
                written_from = lost_at
            else:
                all_reported.wait(args.timeout)
                written_from = time.monotonic()
            watch.close()
            if args.no_reports:  # written by the main process, at once
                view = observer.read(report_q=target, held=q)
                view.reports = {m.id: {"step": 0} for m in q.members if m.node != lost_node}
                new = propose(q, view, target, "sim: a node's lease revoked", settings)
                if new is None or not observer.cas_quorum(new, view.quorum_rev, base=q):
                    raise RuntimeError(f"quorum {target} could not be written")
                written = time.monotonic()
            parts = pool.ask("collect", {"timeout": args.timeout})
            if not args.no_reports:  # written by the proposer's LiveGroup.reform
                stamps = [x for p in parts for x in p["written_at"]]
                if not stamps:
                    raise RuntimeError(f"the proposer {proposer} did not write quorum {target} within {args.timeout:g}s")
                written = stamps[0]
                new = observer.read(held=q).quorum
                if new is None or new.q != target:
                    raise RuntimeError(f"etcd holds quorum {new.q if new else None}, not {target}")
            m1, b1, c1 = scrape(endpoint), sent_bytes(endpoint), etcd_cpu_s(etcd_pid)
            lost_ts = [x - lost_at for p in parts for x in p["lost_at"] + p["thin_lost_at"] if x is not None]
            # a thin node knows the quorum when its stream delivered it (its in-node work is the full nodes')
            knew_ts = [x - lost_at for p in parts for x in p["knew_at"] if x is not None]
            knew_ts += [x - lost_at for p in parts for x in p["thin_event_at"] if x is not None for _ in range(w)]
            thin_survivors = sum(p["thin_workers"] for p in parts)
            # the breakdown: the workers that keep an etcd watch (all, or one per node) and the
            # siblings that learn from them
            by_role: dict[str, dict[str, list[float]]] = {"watching": {"lost": [], "knew": []},
                                                          "siblings": {"lost": [], "knew": []}}
            by_role["watching"]["event"] = [x - lost_at for p in parts for x in p["event_at"]]
            if thin_survivors:
                by_role["thin"] = {"lost": [x - lost_at for p in parts for x in p["thin_lost_at"] if x is not None],
                                   "event": [x - lost_at for p in parts for x in p["thin_event_at"] if x is not None]}
            for p in parts:
                for lost_x, knew_x, keeps in zip(p["lost_at"], p["knew_at"], p["keeps_watch"]):
                    role = by_role["watching" if keeps else "siblings"]
                    if lost_x is not None:
                        role["lost"].append(lost_x - lost_at)
                    if knew_x is not None:
                        role["knew"].append(knew_x - lost_at)
            knew = len(knew_ts)  # a thin node's workers count when its stream delivered the quorum
            missing = survivors - knew
            loss = {"node": lost_node, "survivors": survivors, "knew": knew,
                    "loss_seen_median_s": round(_stats(lost_ts)[0], 3) if lost_ts else None,
                    "loss_seen_worst_s": round(_stats(lost_ts)[1], 3) if lost_ts else None,
                    "reports_in_s": None if args.no_reports else round(written_from - lost_at, 3),
                    "report_puts": len(reports),
                    "quorum_written_s": round(written - lost_at, 3),
                    "known_median_s": round(_stats(knew_ts)[0], 3) if knew_ts else None,
                    "known_worst_s": round(_stats(knew_ts)[1], 3) if knew_ts else None,
                    "requests": round(sum(requests(m0, m1).values())), "sent_bytes": round(b1 - b0),
                    "record_bytes": len(encode(new, q)[0]),
                    "etcd_cpu_s": round(c1 - c0, 2),
                    "whole_reads": sum(p["stats"]["reads"] for p in parts),
                    "sibling_loads": sum(p["stats"]["loads"] for p in parts),
                    "loss_seen_first_s": round(min(lost_ts), 3) if lost_ts else None,
                    "breakdown": {role: {f"{what}_{k}_s": round(f(ts), 3) for what, ts in d.items() if ts
                                         for k, f in (("median", statistics.median), ("worst", max))}
                                  for role, d in by_role.items()}}
            losses.append(loss)
            q = new
            print(f"loss {k + 1} ({lost_node}): first saw it at {loss['loss_seen_first_s']}s, every survivor at {loss['loss_seen_worst_s']}s "
                  f"(median {loss['loss_seen_median_s']}s), reports in at {loss['reports_in_s']}s "
                  f"({loss['report_puts']:,} puts), quorum {target} "
                  f"written at {loss['quorum_written_s']}s, known by {knew}/{survivors} survivors: "
                  f"median {loss['known_median_s']}s, worst {loss['known_worst_s']}s "
                  f"({'met' if not missing and loss['known_worst_s'] < TARGET_S else 'NOT met'}: < {TARGET_S:g}s); "
                  f"etcd {loss['requests']:,} requests, {loss['sent_bytes'] / 1e6:,.1f} MB sent "
                  f"(the quorum key's record {loss['record_bytes']:,} bytes), "
                  f"{loss['etcd_cpu_s']:.2f} CPU s; "
                  f"whole reads so far {loss['whole_reads']:,}; by role: "
                  + "; ".join(f"{role} " + ", ".join(f"{k} {v}" for k, v in d.items())
                              for role, d in loss["breakdown"].items() if d), flush=True)
            time.sleep(args.between)
        result["losses"] = losses
        stats = [p["stats"] for p in pool.ask("collect", {"timeout": 0})]
        result["lost_leases"] = sum(s["lost_leases"] for s in stats)
        result["look_errors"] = sum(s["look_errors"] for s in stats)
        result["sim_cpu_s"] = round(sum(s["cpu_s"] for s in stats), 1)
    finally:
        pool.close()
        main_conn.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--workers", type=int, default=8, help="workers per node")
    p.add_argument("--processes", type=int, default=8, help="processes the nodes are spread over")
    p.add_argument("--channels", type=int, default=2, help="gRPC channels the workers of one process share")
    p.add_argument("--poll", type=float, default=1.0, help="the watchers' poll (seconds; the product's is 0.1)")
    p.add_argument("--lease-ttl", type=int, default=3,
                   help="the node leases' TTL (renewed every second whatever it is; a loss is a revoke)")
    p.add_argument("--losses", type=int, default=3, help="nodes lost one after the other")
    p.add_argument("--reread", action="store_true", help="the watcher as before: a whole read on every event")
    p.add_argument("--shared-siblings", action="store_true",
                   help="one thread per process serves every sibling (each look the product's Watcher.look) "
                        "instead of two threads per sibling; what makes 1,000 x 8 fit this machine")
    p.add_argument("--start-wave", type=int, default=0,
                   help="nodes per process that start watching at a time, each wave once the one before has read "
                        "(default 0: all at once)")
    p.add_argument("--full-nodes", type=int, default=None,
                   help="only this many nodes (spread over the processes; the proposer's and the lost node among "
                        "them) run the product's code whole; the others are thin: their etcd side only (lease, keys, "
                        "one watch stream, one report put per loss), their in-node work left out (default: all full)")
    p.add_argument("--thin-aio", action="store_true",
                   help="with --full-nodes: a process's thin nodes on one asyncio loop (grpc.aio), not a thread each "
                        "(the same etcd requests and streams, less of the simulation's own CPU)")
    p.add_argument("--proposer-apart", action="store_true",
                   help="the quorum's first node (every loss's proposer) alone in one more process: a real "
                        "proposer's node has its own CPUs, where in a process of 1/--processes of the job its "
                        "report feed waits for the GIL (measured: 0.23-0.40 s behind a quiet watch of the reports)")
    p.add_argument("--expire", action="store_true",
                   help="a lost node's lease expires (its renewals stop; times from the expiry, its last accepted "
                        "renewal + --lease-ttl) instead of being revoked (times from the revoke)")
    p.add_argument("--no-reports", action="store_true",
                   help="write the next quorum as soon as the lease is revoked (no report round)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds before the steady window")
    p.add_argument("--window", type=float, default=10.0, help="seconds of the steady window")
    p.add_argument("--between", type=float, default=3.0, help="seconds between two losses")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any phase may take")
    p.add_argument("--endpoint", default=None, help="an etcd to use (default: start a private one)")
    p.add_argument("--json", default=None, help="also write the results as JSON")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as record:
        tmp = server = None
        endpoint = args.endpoint
        tmp = tempfile.mkdtemp(prefix="live-sim-")
        args.workdir = tmp
        if endpoint is None:
            server = EtcdServer(data_dir=Path(tmp) / "etcd").start()
            endpoint = server.endpoint
        try:
            result = run(args, endpoint, server.proc.pid if server is not None and server.proc is not None else None)
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; simulation CPU "
              f"{result['sim_cpu_s']}s; node leases lost by a late renewal: {result['lost_leases']}; "
              f"sibling looks that raised: {result['look_errors']}")
        print("command: " + record.command)
        provenance.write_json(args.json, result, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
