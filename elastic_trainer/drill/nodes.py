"""A drill's simulated nodes: one ``elastic-train`` process each, and the processes under it.

A node is an agent (``python -m elastic_trainer.cli``, a torchrun agent) started in a session of
its own; the agent starts the workers, each in a session of its own (:func:`workers`: the built-in
trainer's are forked from the agent's fork server, ``preload.py``). The drill finds every process below an agent through
``/proc`` (children of children), signals a node by process group (the agent's and each
descendant's), and remembers each worker it saw by pid and start time, so that it can SIGKILL
what is left at the end without hitting a recycled pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads'), from /proc."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            out.extend(int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except OSError:
            continue
    return out


def workers(agent_pid: int) -> list[int]:
    """The worker processes of a node's agent now: the children of its fork server when it has one
    (the built-in trainer's workers are forked from it, ``preload.py``), else its children but
    multiprocessing's helpers and the embedded etcd's keeper."""
    kids = children(agent_pid)
    server = [pid for pid in kids if _multiprocessing_helper(pid) == "forkserver"]
    if server:
        return [pid for s in server for pid in children(s)]
    return [pid for pid in kids if _multiprocessing_helper(pid) is None and not _etcd_keeper(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _etcd_keeper(pid: int) -> bool:
    return b"elastic_trainer.etcd.keeper" in _cmdline(pid)


def _multiprocessing_helper(pid: int) -> str | None:
    """``forkserver`` or ``resource_tracker`` when ``pid`` is that multiprocessing helper, else None."""
    cmdline = _cmdline(pid)
    return next((name for name in ("forkserver", "resource_tracker")
                 if f"from multiprocessing.{name} import main".encode() in cmdline), None)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children of children too."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a live pid from a recycled one)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def killpg(pgid: int, sig: int) -> None:
    """``os.killpg``; a group that is gone already is not an error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Node:
    """One simulated node: an ``elastic-train`` process (agent) and the workers it started."""

    index: int
    log_dir: Path
    proc: subprocess.Popen
    net: object | None = None
    state: str = "running"  # running | stopped | cut | killed | terminated | exited
    workers: set[int] = field(default_factory=set)
    seen: dict[int, int | None] = field(default_factory=dict)  # pid -> start ticks
    term_deadline: float | None = None
    paused_pgids: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"node-{self.index}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def pgids(self) -> set[int]:
        """The agent's process group and every descendant's, looked up now."""
        groups = {self.proc.pid}
        for pid in descendants(self.proc.pid):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
        return groups

    def signal(self, sig: int) -> set[int]:
        groups = self.pgids() if self.alive else set()
        for pgid in groups:
            killpg(pgid, sig)
        return groups

    def kill_leftovers(self) -> None:
        """SIGKILL every worker ever seen that still runs (same pid and start time)."""
        for pid, ticks in self.seen.items():
            if ticks is not None and start_ticks(pid) == ticks:
                try:  # its group now: a forked worker makes its own a moment after it starts
                    killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    continue
