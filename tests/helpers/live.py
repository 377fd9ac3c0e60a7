"""Shared code of the live-recovery end-to-end tests: agents, step logs, whole-node faults."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from elastic_trainer import records
from tests.helpers.common import REPO, cli_cmd, wait_until
from tests.helpers.runs import CONF, SEEDS_MSE


def live_agent(procs, etcd, run_id: str, ck: Path, logs: Path, out: Path, *trainer_args: str, nnodes: str = "2:3"):
    with open(out, "a") as log:
        return procs.start(cli_cmd("--nnodes", nnodes, "--rdzv-endpoint", etcd.endpoint, "--run-id", run_id,
                                   "--rdzv-conf", CONF, "--recovery", "live", "--checkpoint-dir", str(ck),
                                   "--log-dir", str(logs), "--", *SEEDS_MSE, *trainer_args),
                           cwd=REPO, stdout=log, stderr=log)


def steps_of(logs: Path) -> list[dict]:
    """Every step line as its JSON object, with the ``pid`` of the worker process that wrote it."""
    return [{**rec.to_json(), "pid": f.pid} for f in records.step_files(logs)
            for rec in records.read_file(f.path, records.StepRecord)]


def wait_steps(what: str, pred, logs: Path, timeout: float, outs: list[Path]) -> list[dict]:
    def seen() -> str:
        tails = "\n".join(f"--- {o.name}\n" + o.read_text()[-2500:] for o in outs if o.exists())
        return f"steps so far: {sorted({(s['round'], s['world_size'], s['pid']) for s in steps_of(logs)})}\n{tails}"

    return wait_until(lambda: steps_of(logs), timeout, what, until=pred, details=seen)


def agent_of(worker_pid: int, agents) -> object:
    """The agent (torchrun) process above this worker (its parent, or its fork server's: preload.py)."""
    pid = worker_pid
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        found = next((a for a in agents if a.pid == pid), None)
        if found is not None:
            return found
    raise LookupError(f"no agent above worker {worker_pid}")


def kill_node(worker_pid: int, agents, logs: Path, outs: list[Path], world: int, steps: int):
    """SIGKILL the whole node (its agent's process group) of ``worker_pid``, then wait for ``steps``
    steps at world size ``world`` after it. Returns (the killed agent, the kill's time, the steps)."""
    victim = agent_of(worker_pid, agents)
    os.killpg(victim.pid, signal.SIGKILL)
    t_kill = time.time()
    st = wait_steps(f"survivors training at {world}", lambda st: sum(
        s["world_size"] == world and s["time"] > t_kill for s in st) >= steps, logs, 60, outs)
    return victim, t_kill, st


def current_ranks(st: list[dict]) -> dict[int, int]:
    """rank -> pid in the newest round."""
    newest = max(s["round"] for s in st)
    return {s["rank"]: s["pid"] for s in st if s["round"] == newest}


@contextlib.contextmanager
def two_members(etcd, run_id: str, **settings) -> Iterator[list]:
    """Two ``LiveGroup``s of two nodes ("node-a", "node-b") in this process, each on its node's
    lease (an agent's, as ``elastic-train`` runs them), joined into one quorum on the real ``etcd``
    and watching; closed after. ``settings`` override ``LiveSettings``' (2 nodes)."""
    from tests.helpers.live_nodes import NodeAgent, group, join_and_watch
    from tests.helpers.live_nodes import settings as live_settings

    live = live_settings(**{"min_nodes": 2, "max_nodes": 2, "last_call": 0.1, "lease_ttl": 3, **settings})
    agents = [NodeAgent(etcd, f"t/{run_id}", node, ttl=int(live.lease_ttl)) for node in ("node-a", "node-b")]
    groups = []
    try:
        groups = [group(etcd, f"t/{run_id}", agent, node, live=live) for agent, node in zip(agents, ("node-a", "node-b"))]
        join_and_watch(groups)
        yield groups
    finally:
        for g in groups:
            g.close()
            g.conn.close()
        for agent in agents:
            agent.close()
