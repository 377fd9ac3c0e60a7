"""Rendezvous scale: how long N agents take to form one round on one etcd.

Run (from the repository root):

    .venv/bin/python benchmarks/rdzv_scale.py                    # sizes 8, 64, 256, 1000
    .venv/bin/python benchmarks/rdzv_scale.py --sizes 8          # the smoke test's size
    .venv/bin/python benchmarks/rdzv_scale.py --processes 1      # every agent a thread of one process

Each simulated agent is a thread running the real etcd-v3 handler (backend, JSON state
holder, lease keeper, etcd store) exactly as torchrun's agent calls it:
``next_rendezvous()`` with min_nodes = max_nodes = N, so the round completes when the
last agent joined and every agent then has its rank and MASTER_ADDR/PORT. The agents are
spread over ``--processes`` worker processes (default 16; real agents are separate
processes, and a thousand threads under one GIL measure Python's thread scheduler: a
thread waits seconds for its turn, and lease renewals starve). Agents of one process
share ``--connections`` gRPC channels. All processes start their agents at the same
instant (``time.monotonic`` is one clock for every process on Linux). It prints, per size:
seconds until every agent had its rank, the first agent, etcd requests per agent (state
reads/writes, store, lease), lost compare-and-swap races per agent, and the agents whose etcd
lease was lost (etcd expired it: a renewal came too late) before the round formed or while the
others still waited. The handler runs with its own defaults (``lease_ttl`` 3 s, renewed every
second) unless ``--rdzv-conf`` says otherwise. ``--trace`` also prints where the time goes: every
etcd request by kind (how many, their wall time, the CPU of the thread that sent them, when they
started) and the agents' CPU in state syncs and state decoding, then a timeline per half second: the
agents' and etcd's CPU, the renewals sent and their slowest answer, leases lost, agents ranked, and
the requests started by kind.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
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

from benchmarks import provenance  # noqa: E402  (the results' header: date, commit, machine, command)
from elastic_trainer.torch_private import (  # noqa: E402
    RendezvousSettings,
    RendezvousTimeout,
    generate_node_desc,
)

from elastic_trainer.etcd.server import EtcdServer  # noqa: E402
from elastic_trainer.etcd.client import EtcdConnection  # noqa: E402
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend  # noqa: E402
from elastic_trainer.etcd.store import EtcdStore  # noqa: E402
from elastic_trainer.rendezvous.handler import (  # noqa: E402
    NO_STATE_HEARTBEATS,
    EtcdRendezvousHandler,
    RendezvousOptions,
)


_TRACE: list[tuple[str, float, float, float]] = []  # (what, started, wall s, thread CPU s), with --trace
_RENEWALS: list[tuple[float, float, bool]] = []  # (sent, answered after s, lost), with --trace
_TICK = 0.5  # seconds per row of the --trace timeline


def _install_trace() -> None:
    """Time every etcd request by kind, and the handler's syncs and state decoding (this process)."""
    from elastic_trainer.rendezvous import handler, state, watchdog

    def timed(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                _TRACE.append((label if label else (args[2] if len(args) > 2 else kwargs.get("what", "request")),
                               t0, time.monotonic() - t0, time.thread_time() - c0))
        setattr(owner, name, wrapper)
    if getattr(EtcdConnection.call, "_traced", False):
        return
    timed(EtcdConnection, "call", "")
    EtcdConnection.call._traced = True  # type: ignore[attr-defined]
    from elastic_trainer.rendezvous.lease import LeaseKeeper
    LeaseKeeper.on_answer = staticmethod(lambda sent, took, lost: _RENEWALS.append((sent, took, lost)))
    timed(state.EtcdRendezvousStateHolder, "sync", "=state sync")
    timed(state, "decode_state", "=state decode")
    handler.decode_state = watchdog.decode_state = state.decode_state


def _timeline(start: float, samples: list, trace: list, renewals: list, ranked: list) -> dict:
    """Per ``_TICK`` seconds from the start: this process's CPU, its requests started by kind, its
    renewals (sent, worst answer time), leases lost, agents ranked (--trace)."""
    rows: dict[int, dict] = {}

    def row(t: float) -> dict:
        return rows.setdefault(max(0, int((t - start) / _TICK)), {})
    last = None
    for t, cpu in samples:
        if last is not None:
            r = row(t)
            r["cpu"] = r.get("cpu", 0.0) + cpu - last
        last = cpu
    for what, t0, wall, cpu in trace:
        r = row(t0)
        r[what] = r.get(what, 0) + 1
        r["cpu " + what] = r.get("cpu " + what, 0.0) + cpu
    for sent, took, gone in renewals:
        r = row(sent)
        r["renewals"] = r.get("renewals", 0) + 1
        r["renewal worst s"] = max(r.get("renewal worst s", 0.0), took)
        if gone:
            r["lost"] = r.get("lost", 0) + 1
    for t in ranked:
        r = row(t)
        r["ranked"] = r.get("ranked", 0) + 1
    return rows


def _timeline_table(parts: list[dict], etcd: list) -> list[str]:
    rows: dict[int, dict] = {}
    for p in parts:
        for i, r in p.get("timeline", {}).items():
            into = rows.setdefault(int(i), {})
            for k, v in r.items():
                into[k] = max(into.get(k, 0), v) if k == "renewal worst s" else into.get(k, 0) + v
    for i, cpu in etcd:
        rows.setdefault(i, {})["etcd cpu"] = cpu
    lines = [f"{'t s':>5} {'agents CPU':>10} {'etcd CPU':>8} {'renewals':>8} {'worst s':>7} {'lost':>5} "
             f"{'ranked':>6}  requests started (CPU s of the busiest kinds)"]
    for i in sorted(rows):
        if i * _TICK > 60:
            break
        r = rows[i]
        kinds = sorted(((k, v) for k, v in r.items() if k.startswith("cpu ")), key=lambda kv: -kv[1])[:4]
        what = ", ".join(f"{k[4:]} {r.get(k[4:], 0)} ({v:.2f})" for k, v in kinds)
        lines.append(f"{i * _TICK:>5.1f} {r.get('cpu', 0):>10.2f} {r.get('etcd cpu', 0):>8.2f} "
                     f"{r.get('renewals', 0):>8} {r.get('renewal worst s', 0):>7.2f} {r.get('lost', 0):>5} "
                     f"{r.get('ranked', 0):>6}  {what}")
    return lines


def _trace_table(parts: list[dict]) -> list[str]:
    rows: dict[str, list] = {}
    for p in parts:
        for what, (count, wall, cpu, starts) in p.get("trace", {}).items():
            row = rows.setdefault(what, [0, 0.0, 0.0, []])
            row[0] += count
            row[1] += wall
            row[2] += cpu
            row[3] += starts
    lines = [f"{'what':<18}{'count':>7}{'mean wall s':>12}{'thread CPU s':>13}  started at (s) p10/p50/p90"]
    for what, (count, wall, cpu, starts) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        starts.sort()
        q = [starts[min(len(starts) - 1, int(f * len(starts)))] for f in (0.1, 0.5, 0.9)]
        lines.append(f"{what:<18}{count:>7}{wall / count:>12.2f}{cpu:>13.2f}  {q[0]:.1f}/{q[1]:.1f}/{q[2]:.1f}")
    return lines


def run_agents(endpoint: str, run_id: str, n: int, count: int, connections: int, timeout: float, conf: dict,
               ready=None, trace: bool = False) -> dict:
    """Run ``count`` of the ``n`` agents of one round as threads of this process.

    ``ready(go_event)`` is called once every handler is built: it must set ``go_event`` at the
    start instant and return that instant (``time.monotonic()``); without it they start at once.
    """
    params = RendezvousParameters("etcd-v3", endpoint, run_id, n, n, local_addr="127.0.0.1",
                                  join_timeout=str(timeout), **conf)
    options = RendezvousOptions(params)
    conns = [EtcdConnection(options.etcd) for _ in range(max(1, min(connections, count)))]
    settings = RendezvousSettings(run_id, n, n, RendezvousTimeout(
        join=timedelta(seconds=timeout), last_call=timedelta(seconds=options.last_call_timeout),
        close=timedelta(seconds=options.close_timeout), heartbeat=timedelta(seconds=options.heartbeat_timeout)),
        keep_alive_interval=NO_STATE_HEARTBEATS, keep_alive_max_attempt=3)
    handlers = []
    for i in range(count):
        conn = conns[i % len(conns)]
        backend = EtcdRendezvousBackend(conn, run_id, options.key_prefix)
        store = EtcdStore(conn, backend.prefix + "store/")
        node = generate_node_desc("127.0.0.1")
        handlers.append(EtcdRendezvousHandler(node, settings, store, backend, conn, options))
    done: list = [None] * count
    errors: list[str] = []
    go = threading.Event()

    def agent(i: int) -> None:
        go.wait()
        try:
            info = handlers[i].next_rendezvous()
            done[i] = (time.monotonic(), info.rank)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    samples: list[tuple[float, float]] = []  # (time, this process's CPU s), every _TICK with --trace
    if trace:
        _install_trace()
        _TRACE.clear()
        _RENEWALS.clear()

        def sample() -> None:
            go.wait()
            while not stop_sampling.wait(_TICK / 5):
                samples.append((time.monotonic(), time.process_time()))
        stop_sampling = threading.Event()
        threading.Thread(target=sample, daemon=True).start()
    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    if ready is None:
        start = time.monotonic()
        go.set()
    else:
        start = ready(go)
    for t in threads:
        t.join(max(0.1, start + timeout + 5 - time.monotonic()))
    result = {
        "cpu_s": time.process_time() - cpu0,
        "start": start, "done": [d for d in done if d is not None],
        "requests": [h._etcd_backend.requests + h._store.requests + h._lease.requests for h in handlers],
        "lost": [h._op_executor.lost_races for h in handlers], "errors": sorted(set(errors))[:3],
        "lost_leases": sum(1 for h in handlers if h._lease.lost),
    }
    if trace:
        table: dict[str, list] = {}
        for what, t0, wall, cpu in list(_TRACE):
            row = table.setdefault(what, [0, 0.0, 0.0, []])
            row[0] += 1
            row[1] += wall
            row[2] += cpu
            row[3].append(round(t0 - start, 2))
        result["trace"] = table
        stop_sampling.set()
        result["timeline"] = _timeline(start, samples, list(_TRACE), list(_RENEWALS),
                                       [d[0] for d in done if d is not None])
    for h in handlers:
        h._joined = None
        h._lease.close(revoke=False)
    for c in conns:
        c.close()
    return result


def _summary(n: int, parts: list[dict], start: float) -> dict:
    finished = [d for p in parts for d in p["done"]]
    ranks = sorted(d[1] for d in finished)
    done = sorted(d[0] - start for d in finished)
    return {
        "ranked_at_s": {f"p{q}": round(done[min(len(done) - 1, q * len(done) // 100)], 2)
                        for q in (10, 50, 90)} if done else None,
        "trace": _trace_table(parts) if any("trace" in p for p in parts) else None,
        "timeline": [], "start": start, "parts": parts if any("timeline" in p for p in parts) else [],
        "agents": n, "joined": len(finished), "ranks_ok": ranks == list(range(n)),
        "all_ranked_s": max(d[0] for d in finished) - start if len(finished) == n else None,
        "first_ranked_s": min(d[0] for d in finished) - start if finished else None,
        "requests_per_agent": statistics.mean(r for p in parts for r in p["requests"]),
        "lost_races_per_agent": statistics.mean(x for p in parts for x in p["lost"]),
        "errors": sorted({e for p in parts for e in p["errors"]})[:3],
        "agents_cpu_s": sum(p["cpu_s"] for p in parts),
        "lost_leases": sum(p.get("lost_leases", 0) for p in parts),
    }


def _worker(pipe) -> None:
    """A worker process: runs its share of each size's agents when the main process asks."""
    while (job := pipe.recv()) is not None:
        def ready(go: threading.Event) -> float:
            pipe.send("ready")
            go_at = pipe.recv()
            time.sleep(max(0.0, go_at - time.monotonic()))
            go.set()
            return go_at
        try:
            pipe.send(run_agents(**job, ready=ready))
        except Exception as exc:  # noqa: BLE001 - sent back to the main process, which reports it
            pipe.send({"error": f"{type(exc).__name__}: {exc}"})


class AgentPool:
    """``processes`` spawned worker processes that run the simulated agents of each size."""

    def __init__(self, processes: int) -> None:
        ctx = mp.get_context("spawn")  # gRPC does not survive fork
        self.pipes, self.procs = [], []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child,), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def run(self, endpoint: str, run_id: str, n: int, connections: int, timeout: float, conf: dict,
            trace: bool = False) -> dict:
        shares = [n // len(self.pipes) + (i < n % len(self.pipes)) for i in range(len(self.pipes))]
        pipes = [(p, c) for p, c in zip(self.pipes, shares) if c]
        for pipe, count in pipes:
            pipe.send({"endpoint": endpoint, "run_id": run_id, "n": n, "count": count,
                       "connections": connections, "timeout": timeout, "conf": conf, "trace": trace})
        for pipe, _ in pipes:
            answer = pipe.recv()
            if answer != "ready":
                raise RuntimeError(f"an agent process failed to start: {answer}")
        go_at = time.monotonic() + 0.5
        for pipe, _ in pipes:
            pipe.send(go_at)
        parts = [pipe.recv() for pipe, _ in pipes]
        failed = [p["error"] for p in parts if "error" in p]
        if failed:
            raise RuntimeError(f"an agent process failed: {failed[0]}")
        return _summary(n, parts, go_at)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) a process has used so far, from /proc (None when unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def run_size(endpoint: str, n: int, connections: int, timeout: float, conf: dict,
             pool: AgentPool | None = None, etcd_pid: int | None = None, trace: bool = False) -> dict:
    """N agents join one round; every agent a thread of this process, or spread over ``pool``."""
    run_id = f"scale-{n}-{int(time.time())}"
    etcd0 = _cpu_s(etcd_pid)
    etcd_samples: list[tuple[float, float | None]] = []
    sampling = threading.Event()

    def sample_etcd() -> None:
        while not sampling.wait(_TICK / 5):
            etcd_samples.append((time.monotonic(), _cpu_s(etcd_pid)))
    if trace:
        threading.Thread(target=sample_etcd, daemon=True).start()
    if pool is None:
        part = run_agents(endpoint, run_id, n, n, connections, timeout, conf, trace=trace)
        result = _summary(n, [part], part["start"])
    else:
        result = pool.run(endpoint, run_id, n, connections, timeout, conf, trace)
    sampling.set()
    etcd_rows: dict[int, float] = {}
    for (t0, c0), (t1, c1) in zip(etcd_samples, etcd_samples[1:]):
        if c0 is not None and c1 is not None and t1 >= result["start"]:
            i = int((t1 - result["start"]) / _TICK)
            etcd_rows[i] = etcd_rows.get(i, 0.0) + c1 - c0
    parts = result.pop("parts")
    result["timeline"] = _timeline_table(parts, sorted(etcd_rows.items())) if parts else []
    etcd1 = _cpu_s(etcd_pid)
    result["etcd_cpu_s"] = etcd1 - etcd0 if etcd0 is not None and etcd1 is not None else None
    conn = EtcdConnection(RendezvousOptions(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1)).etcd)
    try:
        conn.client.delete_prefix(EtcdRendezvousBackend(conn, run_id).prefix)
    except Exception:  # noqa: BLE001 - cleanup of a benchmark run; the etcd is thrown away anyway
        pass
    finally:
        conn.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="N simulated agents join one etcd-v3 rendezvous round.")
    p.add_argument("--sizes", default="8,64,256,1000", help="comma list of agent counts (default 8,64,256,1000)")
    p.add_argument("--processes", type=int, default=16,
                   help="worker processes the agents are spread over (default 16; 1: threads of this process)")
    p.add_argument("--connections", type=int, default=4,
                   help="gRPC channels the agents of one process share (default 4)")
    p.add_argument("--timeout", type=float, default=120.0, help="join timeout per size in seconds (default 120)")
    p.add_argument("--endpoint", default=None, help="an etcd to use (default: start a private one)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--rdzv-conf", default="",
                   help="handler options k=v,... (default: none, the handler's defaults, lease_ttl 3 s renewed "
                        "every second; the runs before 2026-11-27 used lease_ttl=30,keep_alive_interval=5)")
    p.add_argument("--trace", action="store_true",
                   help="also print every etcd request by kind (count, wall and CPU seconds, start times)")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as run:
        return _main(args, run)


def _main(args: argparse.Namespace, run: provenance.Run) -> int:
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if item)

    server, tmp = None, None
    endpoint = args.endpoint
    if endpoint is None:
        tmp = tempfile.mkdtemp(prefix="rdzv-scale-")
        server = EtcdServer(data_dir=Path(tmp) / "etcd").start()
        endpoint = server.endpoint
    pool = AgentPool(min(args.processes, max(sizes))) if args.processes > 1 else None
    results = []
    print(f"{'agents':>7} {'all ranked s':>13} {'first s':>8} {'req/agent':>10} {'lost CAS/agent':>15} "
          f"{'agents CPU s':>13} {'etcd CPU s':>11} {'lost leases':>12}  notes")
    try:
        for n in sizes:
            r = run_size(endpoint, n, args.connections, args.timeout, conf, pool,
                         server.proc.pid if server is not None and server.proc is not None else None, args.trace)
            results.append(r)
            all_s = f"{r['all_ranked_s']:13.2f}" if r["all_ranked_s"] is not None else f"{'>' + str(args.timeout):>13}"
            first = f"{r['first_ranked_s']:8.2f}" if r["first_ranked_s"] is not None else f"{'-':>8}"
            notes = "" if r["ranks_ok"] else f"only {r['joined']}/{n} ranked; {r['errors']}"
            etcd_cpu = f"{r['etcd_cpu_s']:11.1f}" if r["etcd_cpu_s"] is not None else f"{'-':>11}"
            print(f"{n:>7} {all_s} {first} {r['requests_per_agent']:10.1f} {r['lost_races_per_agent']:15.1f} "
                  f"{r['agents_cpu_s']:13.1f} {etcd_cpu} {r['lost_leases']:12d}  {notes}", flush=True)
            if r["ranked_at_s"]:
                print(f"{'':>7} ranked by (s): p10 {r['ranked_at_s']['p10']}, p50 {r['ranked_at_s']['p50']}, "
                      f"p90 {r['ranked_at_s']['p90']}", flush=True)
            for line in (r["trace"] or []) + r["timeline"]:
                print(f"{'':>7} {line}", flush=True)
    finally:
        if pool is not None:
            pool.close()
        if server is not None:
            server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    where = (f"spread over {args.processes} processes, " if pool is not None else "threads of one process, ") + \
        f"the agents of a process sharing {args.connections} gRPC channels"
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; agents are {where}; "
          f"handler options {args.rdzv_conf or 'the defaults (lease_ttl=3,keep_alive_interval=1)'}")
    print("command: " + run.command)
    provenance.write_json(args.json, {"processes": args.processes, "connections": args.connections,
                                      "rdzv_conf": conf, "cpus": os.cpu_count(), "timeout_s": args.timeout,
                                      "results": results}, run, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
