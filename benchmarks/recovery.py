"""Recovery time of elastic training: our etcd-v3 rendezvous against torchrun's c10d.

Run (from the repository root; takes ~1 min per etcd-v3 trial, several per c10d trial):

    .venv/bin/python benchmarks/recovery.py --trials 10
    .venv/bin/python benchmarks/recovery.py --trials 3 --backends etcd-v3,c10d,c10d-tuned --json out.json

Each trial starts ``--nodes`` torchrun agents on loopback (one ``benchmarks/rdzv_worker.py``
worker each, gloo allreduce "steps") and measures, from the workers' step logs:

  (a) kill-other: SIGKILL a node whose worker is not rank 0 (agent and worker) ->
      the first completed step at world size N-1;
  (c) join: then start a new node -> its first step in the grown world (size N);
  (b) kill-rank0: in a fresh job of N nodes, SIGKILL the node of rank 0 -> the first
      completed step at N-1.

A measurement that does not happen within ``--timeout`` seconds is a failure ("died"
when every agent exited). Backends: ``etcd-v3`` (ours, defaults), ``c10d`` (torchrun's
defaults: heartbeats 5 s x 3, last call 30 s, shared TCP store), ``c10d-tuned``
(keep_alive_interval=1, keep_alive_max_attempt=3, last_call_timeout=1, and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; with 2 attempts, as before 2026-11-25, a joining node
judged the running nodes' heartbeats stale and formed a world of its own beside theirs, so no
join ever reached the grown world: see docs/rendezvous.md). It prints median and worst per backend and
scenario, the number of successful trials, and the command that produced them; "rdzv"
columns give the part until an agent logged "Rendezvous complete" (the rest is torchrun
starting the workers: a new Python, ``import torch``, gloo init).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402  (the results' header: date, commit, machine, command)
from benchmarks.rdzv_worker import agent_cmd, read_steps, signal_tree  # noqa: E402
from elastic_trainer.drill.nodes import descendants  # noqa: E402
from elastic_trainer.etcd.server import EtcdServer, free_port  # noqa: E402

SCENARIOS = ("kill-other", "kill-rank0", "join")
BACKENDS = {
    "etcd-v3": ("etcd-v3", "", {}),
    "c10d": ("c10d", "", {}),
    "c10d-tuned": ("c10d", "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1",
                   {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}


_RDZV_DONE = re.compile(r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*Rendezvous complete for workers")


class Failed(Exception):
    """A measurement did not happen in time."""


class Job:
    """One elastic job of single-worker nodes on loopback, or each in a network namespace of its own
    (``net``: ``benchmarks/silent.py``'s ``Netns``, which places each node and its etcd or store)."""

    def __init__(self, backend: str, nodes: int, workdir: Path, extra_conf: str = "", net=None) -> None:
        self.name = backend
        self.rdzv_backend, conf, self.env = BACKENDS[backend]
        self.conf = ",".join(c for c in (conf, extra_conf) if c)
        self.max_nodes = nodes
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.out = str(workdir / "steps")
        self.agents: list[subprocess.Popen] = []
        self.server = None
        self.net = net
        if self.rdzv_backend == "etcd-v3":
            host = net.host_address if net is not None else "127.0.0.1"
            self.server = EtcdServer(data_dir=workdir / "etcd", host=host, log_path=workdir / "etcd.log").start()
            self.endpoint = self.server.endpoint
        elif net is not None:  # the first node hosts c10d's store, inside its namespace (all ports free there)
            self.endpoint = f"{net.address_of(0)}:29400"
        else:
            self.endpoint = f"127.0.0.1:{free_port()}"

    def node_cmd(self) -> list[str]:
        """The command line of one node (a torchrun agent and its worker); subclasses run other workers."""
        return agent_cmd(self.endpoint, "bench", self.out, nnodes=f"1:{self.max_nodes}",
                         backend=self.rdzv_backend, conf=self.conf, worker_args=("--sleep", "0.05"))

    def steps(self) -> list[dict]:
        """Every step line the workers logged so far, sorted by time."""
        return read_steps(self.out)

    def start_node(self) -> subprocess.Popen:
        i = len(self.agents)
        cmd = self.node_cmd()
        env = dict(os.environ, ELASTIC_TRAINER_RDZV_LOG="INFO", LOGLEVEL="INFO", **self.env)
        if self.net is not None:
            cmd, env = self.net.place(i, cmd, env)
        with open(self.dir / f"agent-{i}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.agents.append(proc)
        if i == 0 and self.rdzv_backend == "c10d":
            time.sleep(1.0)  # let the first agent host the c10d store, as an operator would
        return proc

    def wait(self, what: str, pred, timeout: float) -> list[dict]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            steps = self.steps()
            found = pred(steps)
            if found:
                return found
            if all(a.poll() is not None for a in self.agents):
                raise Failed(f"died ({what})")
            time.sleep(0.05)
        raise Failed(f"timeout ({what})")

    def world_formed(self, size: int, timeout: float, since: float | None = None) -> dict[int, int]:
        """Wait until ``size`` workers step at world size ``size``; return {rank: worker pid}.

        With ``since`` (a ``time.time()``) only steps after it count: a world that stepped at
        ``size`` once and has shrunk since is not a world of ``size`` now."""
        def pred(steps):
            last = {}
            for s in steps:
                if s["world_size"] == size and (since is None or s["time"] > since):
                    last[s["rank"]] = s["pid"]
            return last if len(last) == size else None
        return self.wait(f"a world of {size}", pred, timeout)

    def first_step_after(self, t0: float, size: int, timeout: float) -> float:
        def pred(steps):
            hits = [s["time"] for s in steps if s["time"] > t0 and s["world_size"] == size]
            return hits[0] if hits else None
        return self.wait(f"a step at world size {size}", pred, timeout) - t0

    def rendezvous_done_after(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the first "Rendezvous complete" an agent logged after it."""
        times = []
        for log in self.dir.glob("agent-*.log"):
            for line in log.read_text(errors="replace").splitlines():
                m = _RDZV_DONE.match(line)
                if m:
                    mmdd, hms = m.groups()
                    now = datetime.datetime.now()
                    t = datetime.datetime.strptime(f"{now.year}{mmdd} {hms}", "%Y%m%d %H:%M:%S.%f").timestamp()
                    if t > t0:
                        times.append(t - t0)
        return min(times) if times else None

    def agent_of(self, worker_pid: int) -> subprocess.Popen:
        for agent in self.agents:
            if agent.poll() is None and worker_pid in descendants(agent.pid):
                return agent
        raise Failed(f"no live agent runs worker {worker_pid}")

    def close(self) -> None:
        try:
            for agent in self.agents:
                signal_tree(agent.pid, signal.SIGKILL)
                agent.wait()
            if self.server is not None:
                self.server.stop()
        finally:
            if self.net is not None:
                self.net.close()


def _steady(job: Job, size: int, timeout: float) -> dict[int, int]:
    job.world_formed(size, timeout)
    time.sleep(1.0)  # a few steps in the steady state before the fault
    return job.world_formed(size, timeout)


def trial(backend: str, nodes: int, timeout: float, root: Path, extra_conf: str) -> dict[str, float | str]:
    """One trial of every scenario; values are seconds, or a failure string."""
    results: dict[str, float | str] = {}
    job = Job(backend, nodes, root / f"{backend}-a", extra_conf)
    try:
        for _ in range(nodes):
            job.start_node()
        ranks = _steady(job, nodes, timeout)
        victim = job.agent_of(ranks[max(ranks)])
        t0 = time.time()
        signal_tree(victim.pid, signal.SIGKILL)
        try:
            results["kill-other"] = job.first_step_after(t0, nodes - 1, timeout)
            results["kill-other rdzv"] = job.rendezvous_done_after(t0)
            time.sleep(1.0)
            t0 = time.time()
            job.start_node()
            results["join"] = job.first_step_after(t0, nodes, timeout)
            results["join rdzv"] = job.rendezvous_done_after(t0)
        except Failed as exc:
            results.setdefault("kill-other", str(exc))
            results.setdefault("join", "not run (kill-other failed)" if "kill-other" not in results
                               or isinstance(results["kill-other"], str) else str(exc))
    except Failed as exc:
        results["kill-other"] = results["join"] = f"setup {exc}"
    finally:
        job.close()
    job = Job(backend, nodes, root / f"{backend}-b", extra_conf)
    try:
        for _ in range(nodes):
            job.start_node()
        ranks = _steady(job, nodes, timeout)
        victim = job.agent_of(ranks[0])
        t0 = time.time()
        signal_tree(victim.pid, signal.SIGKILL)
        results["kill-rank0"] = job.first_step_after(t0, nodes - 1, timeout)
        results["kill-rank0 rdzv"] = job.rendezvous_done_after(t0)
    except Failed as exc:
        results["kill-rank0"] = str(exc)
    finally:
        job.close()
    return results


def summarize(all_results: dict[str, list[dict]], trials: dict[str, int]) -> str:
    lines = [f"{'backend':<11} {'scenario':<11} {'median s':>9} {'worst s':>9} {'ok':>7} "
             f"{'rdzv med':>9} {'rdzv worst':>10}  failures"]
    for backend, results in all_results.items():
        for scenario in SCENARIOS:
            values = [r.get(scenario, "not run") for r in results]
            ok = [v for v in values if isinstance(v, float)]
            bad = sorted({v for v in values if isinstance(v, str)})
            rdzv = [r[f"{scenario} rdzv"] for r in results if isinstance(r.get(scenario), float)
                    and isinstance(r.get(f"{scenario} rdzv"), float)]
            med = f"{statistics.median(ok):9.2f}" if ok else f"{'-':>9}"
            worst = f"{max(ok):9.2f}" if ok and len(ok) == len(values) else f"{'fail' if bad else '-':>9}"
            rmed = f"{statistics.median(rdzv):9.2f}" if rdzv else f"{'-':>9}"
            rworst = f"{max(rdzv):10.2f}" if rdzv else f"{'-':>10}"
            lines.append(f"{backend:<11} {scenario:<11} {med} {worst} {len(ok):>3}/{len(values):<3} {rmed} {rworst}  "
                         f"{'; '.join(bad)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Recovery time: etcd-v3 vs torchrun's c10d (see the module docstring).")
    p.add_argument("--trials", type=int, default=10, help="trials per backend (default 10)")
    p.add_argument("--baseline-trials", type=int, default=None,
                   help="trials for the c10d backends (default: --trials; they are slow)")
    p.add_argument("--nodes", type=int, default=3, help="nodes per job, one worker each (default 3)")
    p.add_argument("--backends", default="etcd-v3,c10d", help="comma list of etcd-v3, c10d, c10d-tuned")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds before a measurement fails (default 90)")
    p.add_argument("--rdzv-conf", default="", help="extra --rdzv-conf for etcd-v3 (e.g. lease_ttl=2)")
    p.add_argument("--json", default=None, help="also write every measurement to this JSON file")
    p.add_argument("--keep", action="store_true", help="keep the logs of every trial")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as run:
        return _main(p, args, run)


def _main(p: argparse.ArgumentParser, args: argparse.Namespace, run: provenance.Run) -> int:

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    root = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    all_results: dict[str, list[dict]] = {b: [] for b in backends}
    counts = {b: (args.trials if b == "etcd-v3" else (args.baseline_trials or args.trials)) for b in backends}
    started = time.time()
    try:
        for i in range(max(counts.values())):
            for b in backends:  # alternate backends trial by trial, so load hits both alike
                if i >= counts[b]:
                    continue
                r = trial(b, args.nodes, args.timeout, root / f"trial-{i}",
                          args.rdzv_conf if b == "etcd-v3" else "")
                all_results[b].append(r)
                print(f"trial {i + 1} {b}: " + ", ".join(
                    f"{k}={v:.2f}s" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                    if not k.endswith("rdzv")), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"logs kept in {root}")
    print()
    print(summarize(all_results, counts))
    print(f"\n{args.nodes} nodes x 1 worker on loopback, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, {time.time() - started:.0f} s in all")
    print("command: " + run.command)
    provenance.write_json(args.json, {"args": vars(args), "results": all_results}, run, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
