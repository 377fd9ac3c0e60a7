"""Silent faults for ``benchmarks/live_recovery.py`` (issue 27): a node that freezes, a node cut off
the network, a worker that hangs. Nothing closes a socket, so only a system that watches leases
or progress notices; the others wait for their collective timeout.

    .venv/bin/python benchmarks/live_recovery.py --scenarios stop-node,stop-rank0,cut-node,hang --goodput-seconds 0

Scenarios, each in a job of N nodes stepping at N:

  stop-node   SIGSTOP the node of the highest rank: its agent's and workers' process groups (as the
              drill's ``stop``); SIGCONT once it has been away ``--away`` s and the others stepped
              without it, or at ``--cap``;
  stop-rank0  the same for the node of rank 0;
  cut-node    the job's nodes each in a network namespace on one bridge (as the drill's ``--netns``;
              root): the veth of the node of the highest rank down, up again as for stop-node;
  hang        one worker (of the highest rank) stops making progress while its process lives. Live
              path: SIGUSR2 with ``ELASTIC_TRAINER_DEBUG_HANG=1`` (the training thread sleeps for good,
              its lease and watcher threads go on). ``--recovery restart`` and plain_ddp.py have no
              such hook and nothing in their workers watches progress (their agents watch only the
              process): SIGSTOP of the worker process is the same fault seen from outside.

On c10d the node of the highest rank that does not host the store is chosen (the first node hosts
it; a job whose store host freezes cannot recover at all); stop-rank0 takes rank 0's node, whichever.

Measured, in seconds from the fault: **to N-1**, the first step of a world without the node or
worker (at N-1; after a hang also a step at N by processes started after the fault, since a
restarted job may form at N again at once), or "> cap" when none came within ``--cap``; **to N**,
the first step at N after the node came back or the worker was replaced; the steps redone. The
restart path and c10d would wait for their collective timeout (300 s and 30 min by default):
they run with ``--baseline-collective-timeout`` (30 s), as a user who knows about hangs sets it;
the live path runs at its defaults.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

# benchmarks/recovery.py, on the path that live_recovery.py sets
from recovery import Failed

from benchmarks.rdzv_worker import signal_tree
from elastic_trainer.drill import netns
from elastic_trainer.env import ENV_DEBUG_HANG, LiveSettings

SCENARIOS = ("stop-node", "stop-rank0", "cut-node", "hang")
NEEDS_NETNS = ("cut-node",)
LEASE_TTL = LiveSettings().lease_ttl
HANG_MIN, HANG_FACTOR = LiveSettings().hang_min, LiveSettings().hang_factor
DEBUG_ENV = {ENV_DEBUG_HANG: "1"}
"""Set on every node of every job: a live worker then hangs on SIGUSR2 (the others ignore it)."""


class Netns:
    """One network namespace per node of a job, on one bridge (``elastic_trainer.drill.netns``);
    the job's etcd listens on the bridge, c10d's store in the first node's namespace."""

    def __init__(self) -> None:
        netns.sweep_stale()
        self.network = netns.Network()
        self.nodes: dict[int, netns.NetNode] = {}
        try:
            self.network.up()
        except Exception:
            self.network.teardown()
            raise

    @property
    def host_address(self) -> str:
        return self.network.host_address

    def address_of(self, index: int) -> str:
        return f"10.231.{self.network.subnet}.{10 + index}"

    def place(self, index: int, cmd: list[str], env: dict) -> tuple[list[str], dict]:
        """Node ``index``'s command inside its namespace, with its address as ``--local-addr``."""
        node = self.nodes[index] = self.network.add_node(index)
        cmd = [node.address if prev == "--local-addr" else arg for prev, arg in zip([None, *cmd], cmd)]
        backend = cmd[cmd.index("--rdzv-backend") + 1] if "--rdzv-backend" in cmd else None
        if index == 0 and backend == "c10d":  # c10d finds its store host by host name, which a namespace keeps
            if "--rdzv-conf" in cmd:
                at = cmd.index("--rdzv-conf") + 1
                cmd[at] = ",".join(c for c in (cmd[at], "is_host=true") if c)
            else:
                at = cmd.index("--rdzv-backend") + 2
                cmd[at:at] = ["--rdzv-conf", "is_host=true"]
        env = {**env, "GLOO_SOCKET_IFNAME": netns.INSIDE_IFNAME, "TP_SOCKET_IFNAME": netns.INSIDE_IFNAME}
        return self.network.wrap(node, cmd), env

    def cut(self, index: int) -> None:
        self.network.cut(self.nodes[index])

    def restore(self, index: int) -> None:
        self.network.restore(self.nodes[index])

    def close(self) -> None:
        self.network.teardown()


def can_cut() -> str | None:
    """Why cut-node cannot run here, or None."""
    if os.geteuid() != 0:
        return "skipped: cut-node needs root (network namespaces)"
    return None


def _wait(job, pred, limit: float):
    """Poll the job's step logs until ``pred(steps)`` returns something; None after ``limit`` s."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        found = pred(job.steps())
        if found:
            return found
        if all(a.poll() is not None for a in job.agents):
            raise Failed("died (every agent exited)")
        time.sleep(0.05)
    return None


def measure(job, scenario: str, n: int, args, live: bool, steady, redone_steps) -> dict:
    """One silent fault on a job stepping at ``n``; see the module docstring. ``steady(job, n)``
    waits for a steady world of ``n`` and returns ``{rank: worker pid}``; ``redone_steps(steps,
    t0, size)`` counts the steps done again (``live_recovery.redone_steps``)."""
    ranks = steady(job, n)
    store_host = job.agents[0] if job.rdzv_backend == "c10d" else None
    if scenario == "stop-rank0":
        rank = 0
    else:
        choices = [r for r, pid in ranks.items() if r != 0 and job.agent_of(pid) is not store_host]
        if not choices:
            raise Failed(f"no rank but 0 on a node without the c10d store in a world of {n}")
        rank = max(choices)
    worker = ranks[rank]
    agent = job.agent_of(worker)
    index = job.agents.index(agent)
    before = set(ranks.values())
    old_round = max((s for s in job.steps() if s["pid"] in before), key=lambda s: s["time"]).get("round")
    out: dict = {"rank": rank, "cap": args.cap}
    t0 = time.time()
    if scenario in ("stop-node", "stop-rank0"):
        signal_tree(agent.pid, signal.SIGSTOP)
    elif scenario == "cut-node":
        job.net.cut(index)
    else:
        out["signal"] = "SIGUSR2" if live else "SIGSTOP"
        os.kill(worker, signal.SIGUSR2 if live else signal.SIGSTOP)

    def without(steps):  # a world that trains without the node or worker
        return next((s for s in steps if s["time"] > t0 and (
            s["world_size"] == n - 1 or (scenario == "hang" and s["world_size"] == n and s["pid"] not in before))),
            None)

    try:
        first = _wait(job, without, args.cap)
        if scenario != "hang":  # away at least --away s, then back
            time.sleep(max(0.0, t0 + args.away - time.time()))
    finally:
        if scenario in ("stop-node", "stop-rank0"):
            signal_tree(agent.pid, signal.SIGCONT)
        elif scenario == "cut-node":
            job.net.restore(index)
    t_back = time.time()
    out["s"] = first["time"] - t0 if first else None
    out["away_s"] = t_back - t0 if scenario != "hang" else None
    if first is None and scenario == "hang":
        raise Failed(f"> cap: no step without the hung worker within {args.cap:g}s")
    def again(steps):  # at n in a new world; or the old one going on, where none formed without the node
        return next((s for s in steps if s["time"] > max(t_back, first["time"] if first else 0)
                     and s["world_size"] == n
                     and (first is None or s["pid"] not in before or s.get("round") != old_round)), None)

    full = _wait(job, again, args.timeout)
    out["back"] = full["time"] - t0 if full else None
    if full is None:
        raise Failed(f"no step at world size {n} within {args.timeout:g}s after the node came back"
                     + ("" if first else f" (nor without it within the cap of {args.cap:g}s)"))
    time.sleep(0.5)
    out["redone"] = redone_steps(job.steps(), t0, first["world_size"]) if first else None
    return out


def capped(value) -> bool:
    """A trial in which no world formed without the node within the cap."""
    return isinstance(value, dict) and value.get("s") is None or isinstance(value, str) and value.startswith("> cap")


def _seconds(values: list[float], caps: int, cap: float) -> tuple[str, str]:
    """Median and worst, the capped trials counted as longer than every other."""
    if not values and not caps:
        return "-", "-"
    ordered = sorted(values) + [float("inf")] * caps
    med, worst = statistics.median(ordered), ordered[-1]
    return tuple(f"> {cap:g}" if v == float("inf") else f"{v:.3f}" for v in (med, worst))


def summarize(results: dict[str, list[dict]], scenarios: list[str], cap: float) -> str:
    head = (f"{'system':<11} {'scenario':<11} {'N-1 ok':>7} {'to N-1 med':>10} {'worst':>8} {'to N med':>9} "
            f"{'worst':>8} {'redone':>7}  failures")
    lines = [head]
    for system, trials in results.items():
        for sc in scenarios:
            vals = [t.get(sc, "not run") for t in trials]
            done = [v for v in vals if isinstance(v, dict) and v.get("s") is not None]
            caps = sum(capped(v) for v in vals)
            med, worst = _seconds([v["s"] for v in done], caps, cap)
            back = [v["back"] for v in vals if isinstance(v, dict) and v.get("back") is not None]
            bmed, bworst = (f"{statistics.median(back):.3f}", f"{max(back):.3f}") if back else ("-", "-")
            redone = sorted({v["redone"] for v in done if v.get("redone") is not None})
            red = "-" if not redone else str(redone[0]) if len(redone) == 1 else f"{redone[0]}-{redone[-1]}"
            bad = "; ".join(sorted({v for v in vals if isinstance(v, str) and not v.startswith("> cap")}))
            lines.append(f"{system:<11} {sc:<11} {len(done):>3}/{len(vals):<3} {med:>10} {worst:>8} {bmed:>9} "
                         f"{bworst:>8} {red:>7}  {bad}")
    return "\n".join(lines)


def verdicts(results: dict[str, list[dict]], live_systems: tuple[str, ...], step_s: float | None,
             cap: float) -> list[str]:
    """Issue 27's targets for the live path: a frozen or cut-off node, median < lease + 1 s and worst
    < lease + 2 s; a hang, every trial < the hang bound + 1 s (the bound from the measured step)."""
    bound = max(HANG_MIN, HANG_FACTOR * (step_s or 0.0))
    out = []
    for system in live_systems:
        for sc in SCENARIOS:
            vals = [t.get(sc) for t in results.get(system, []) if sc in t]
            if not vals or all(isinstance(v, str) and v.startswith("skipped") for v in vals):
                continue
            ok = [v["s"] for v in vals if isinstance(v, dict) and v.get("s") is not None]
            med, worst = _seconds(ok, len(vals) - len(ok), cap)
            if sc == "hang":
                met = len(ok) == len(vals) and max(ok) < bound + 1
                target = f"every trial < bound + 1 s = {bound + 1:.1f} s (bound max({HANG_MIN:g}, {HANG_FACTOR:g} x step))"
            else:
                met = len(ok) == len(vals) and statistics.median(ok) < LEASE_TTL + 1 and max(ok) < LEASE_TTL + 2
                target = f"median < {LEASE_TTL + 1} s, worst < {LEASE_TTL + 2} s"
            out.append(f"{system} {sc}: to N-1 median {med} s, worst {worst} s, {len(ok)}/{len(vals)} "
                       f"(target {target}): {'met' if met else 'NOT met'}")
    return out
