"""etcd's load from the live path in steady state (issue 32): requests per second per node, by method.

Run (from the repository root; about a minute per configuration and code tree):

    .venv/bin/python benchmarks/etcd_load.py --txt benchmarks/results/etcd_load.txt
    .venv/bin/python benchmarks/etcd_load.py --workers 1 --window 10          # a quick look
    .venv/bin/python benchmarks/etcd_load.py --tree before=/tmp/watch-before --tree after=.   # side by side

For each code tree (``--tree NAME=PATH``: the nodes run that tree's ``elastic_trainer`` and
``examples/own_loop.py``, a plain DDP loop through the Manager, live) and each ``--workers`` count,
it starts a private etcd and ``--nodes`` nodes of that many workers on loopback, waits until the
world trains at its full size, lets it settle for ``--settle`` seconds, then reads etcd's own
``/metrics`` twice, ``--window`` seconds apart, and prints the difference as requests per second:

  requests  ``grpc_server_msg_received_total``: every message a client sent (a unary call is one;
            a stream counts each message on it: a lease renewal on the keep-alive stream is one);
  handled   ``grpc_server_handled_total``: RPCs that ended (unary calls, and streams that closed).

Per node is the total divided by ``--nodes``; the target (issue 32) is at most 1 request/s per
node, independent of the step rate and of the workers per node. Steps are padded with
``--sleep-per-step`` so that the step rate is set by the sleep, not by 2 shared cores.

Every agent is started in its own session and killed with its workers through its recorded PID
(``signal_tree``); every etcd is stopped, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import recovery

from benchmarks import provenance

RDZV_CONF = "lease_ttl=3,keep_alive_interval=1,last_call_timeout=1"
TARGET = 1.0
"""Requests per second per node in steady state (issue 32)."""

_METRIC = re.compile(r'^(grpc_server_msg_received_total|grpc_server_handled_total)\{(.*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class OwnLoopJob(recovery.Job):
    """``--nodes`` nodes of ``workers`` workers each, running ``tree``'s ``examples/own_loop.py`` live."""

    def __init__(self, tree: Path, nodes: int, workers: int, workdir: Path, sleep_per_step: float) -> None:
        super().__init__("etcd-v3", nodes, workdir)
        self.tree, self.workers, self.sleep_per_step = tree, workers, sleep_per_step
        self.env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}

    def node_cmd(self) -> list[str]:
        # env -C: the agent imports `elastic_trainer` from the tree too (`python -m` puts its working
        # directory ahead of PYTHONPATH), not from wherever this script runs
        return ["env", "-C", str(self.tree), sys.executable, "-m", "elastic_trainer.cli", "--nnodes", f"{self.max_nodes}:{self.max_nodes}",
                "--nproc-per-node", str(self.workers), "--rdzv-endpoint", self.endpoint, "--run-id", "bench",
                "--rdzv-conf", RDZV_CONF, "--local-addr", "127.0.0.1", "--log-dir", str(self.dir),
                str(self.tree / "examples" / "own_loop.py"), *self.run_flags(),
                "--sleep-per-step", str(self.sleep_per_step)]

    def run_flags(self) -> list[str]:
        """Run until stopped: own_loop.py's flags for that in this tree (epochs since issue 42, steps before)."""
        if "--epochs" in (self.tree / "examples" / "own_loop.py").read_text():
            return ["--epochs", "1000000", "--checkpoint", str(self.dir / "own_loop.pt")]
        return ["--max-steps", "1000000"]

    def steps(self) -> list[dict]:
        from live_recovery import read_steps

        return read_steps(self.dir)


def scrape(endpoint: str) -> dict[tuple[str, str], float]:
    """(metric, grpc method) -> count, summed over codes and types, from etcd's ``/metrics``."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group(2)))
            key = (m.group(1), labels.get("grpc_method", "?"))
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def measure(tree: Path, nodes: int, workers: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One configuration: requests/s in total, per node and by method over the steady window."""
    job = OwnLoopJob(tree, nodes, workers, workdir, args.sleep_per_step)
    try:
        for _ in range(nodes):
            job.start_node()
        job.world_formed(nodes * workers, args.timeout)
        time.sleep(args.settle)
        steps_before = len(job.steps())
        before, t0 = scrape(job.endpoint), time.monotonic()
        time.sleep(args.window)
        after, t1 = scrape(job.endpoint), time.monotonic()
        steps_rate = (len(job.steps()) - steps_before) / (t1 - t0) / (nodes * workers)
        sizes = {s["world_size"] for s in job.steps() if s["time"] > time.time() - (t1 - t0)}
        if sizes != {nodes * workers}:
            raise recovery.Failed(f"the world changed during the window (sizes {sorted(sizes)}): not steady")
    finally:
        job.close()
    dt = t1 - t0
    rate = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / dt for k in after}
    by_method = {m: r for (metric, m), r in rate.items() if metric == "grpc_server_msg_received_total" and r > 0}
    requests = sum(by_method.values())
    handled = sum(r for (metric, _), r in rate.items() if metric == "grpc_server_handled_total")
    return {"nodes": nodes, "workers": workers, "window_s": round(dt, 1), "steps_per_s_per_rank": round(steps_rate, 2),
            "requests_per_s": round(requests, 2), "requests_per_s_per_node": round(requests / nodes, 2),
            "handled_per_s_per_node": round(handled / nodes, 2),
            "by_method_per_node": {m: round(r / nodes, 2) for m, r in sorted(by_method.items())}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=None, metavar="NAME=PATH",
                   help="a code tree to measure (repeat for side by side); default: this one, as 'this'")
    p.add_argument("--nodes", type=int, default=3, help="nodes per job")
    p.add_argument("--workers", default="1,4", help="comma list of workers per node")
    p.add_argument("--window", type=float, default=20.0, help="seconds between the two reads of /metrics")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after the world formed before the window")
    p.add_argument("--sleep-per-step", type=float, default=0.05, help="seconds every step sleeps")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds for the world to form")
    p.add_argument("--workdir", default=None, help="where the jobs' logs go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results as JSON")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) if "=" in t else (t, Path(t).resolve())
             for t in (args.tree or [f"this={REPO}"])]
    import tempfile

    root = Path(args.workdir or tempfile.mkdtemp(prefix="etcd-load-"))
    with provenance.record(args.txt) as run:
        print(f"etcd requests/s per node in steady state, {args.nodes} nodes, live path (examples/own_loop.py), "
              f"sleep-per-step {args.sleep_per_step}s, window {args.window:g}s; target <= {TARGET:g}/s per node")
        results = []
        for workers in [int(w) for w in args.workers.split(",")]:
            for name, tree in trees:
                r = measure(tree, args.nodes, workers, args, root / f"{name}-w{workers}")
                r["tree"] = name
                results.append(r)
                methods = ", ".join(f"{m} {v:g}" for m, v in r["by_method_per_node"].items())
                print(f"{name:>8} {workers} worker(s)/node: {r['requests_per_s_per_node']:6.2f} requests/s per node "
                      f"({r['handled_per_s_per_node']:.2f} handled), {r['steps_per_s_per_rank']:.1f} steps/s per rank; "
                      f"by method: {methods}", flush=True)
        provenance.write_json(args.json, {"results": results}, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
