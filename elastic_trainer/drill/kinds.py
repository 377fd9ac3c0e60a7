"""The drill's fault kinds, one registry entry each: :data:`FAULTS`.

A :class:`FaultKind` says everything the drill knows about one kind of fault: its ``--help``
line, its target rule (needs a target, takes none, or defaults to one), its default and only
``for:SECONDS`` duration, which node it strikes, whether the world changes size after it, what
it refuses to run with, and the code that fires it and (for a fault with a duration) heals it.
The scenario grammar and ``--help`` (``scenario``), the driver (``faults.FaultDriver``) and the
report (``report.WORLD_CHANGING``) all read this table; adding a fault is adding an entry.

``fire(driver, rec, node, size, now)`` applies the fault now: ``driver`` is the
``FaultDriver`` (its ``cluster`` and ``args``), ``rec`` the fault's record (it sets the world
expected after the fault), ``node`` the node struck (None for a kind without a ``victim``),
``size`` the number of member nodes before the fault. ``heal(driver, rec, node)`` ends it.

Silent faults (``stop``, ``cut``, ``hang``) set ``rec["away_world"]`` (the world without the
node, N-1) and ``rec["expect_dip"]``: whether the run must train at N-1 while the fault lasts and
at N again after it, in a new round. A node frozen or cut off for longer than its lease (plus
:data:`EVICT_MARGIN`) is out when the lease expires; a shorter absence must end at N (a dip is
reported, not judged: the lease may have been renewed up to a keep-alive interval before the
fault). A hung worker is always left out, once its peers see no progress.
"""

from __future__ import annotations

import argparse
import enum
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from elastic_trainer.drill.nodes import Node, killpg, workers
from elastic_trainer.env import ENV_DEBUG_HANG, ENV_DEBUG_SLOW


class Driver(Protocol):
    """What a kind's ``fire``, ``heal`` and ``prepare`` use of the driver (``faults.FaultDriver``).

    This registry sits below the driver, the cluster and the scenario, which all read it; it names
    what it needs here instead of importing them (that closed an import cycle)."""

    cluster: Any
    """The drill's ``cluster.Cluster``: its nodes, etcd, network and notes."""
    args: argparse.Namespace
    """The drill's parsed flags."""

    def watch_checkpoints(self) -> None: ...

    def corrupt_newest_checkpoint(self) -> tuple[int, str] | None: ...

    def fill_disk(self) -> int: ...

    def free_disk(self) -> None: ...


class Target(enum.Enum):
    """What a fault's ``TARGET`` (before the ``@``) may be."""

    REQUIRED = "needs a target"
    NONE = "takes no target"
    OPTIONAL = "takes a target, or its default"


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault (see the module docstring)."""

    name: str
    help: str
    target: Target
    fire: Callable[[Driver, dict, Node | None, int, float], None]
    heal: Callable[[Driver, dict, Node | None], None] | None = None
    duration: float | None = None  # the default for:SECONDS; None: takes no for:
    default_target: str | None = None  # Target.OPTIONAL: the target when none is given
    victim: str | None = None  # the node it strikes: "target" (the fault's), "rank0", or None
    changes_world: bool = False  # the run goes on at another world size, in a new round
    arms: bool = False  # fire only arms it; FaultDriver.progress strikes later
    prepare: Callable[[Driver, dict], str | None] | None = None  # before firing; a reason to skip
    refuse: Callable[[argparse.Namespace], str | None] | None = None  # why the drill cannot run it
    node_env: tuple[tuple[str, str], ...] = ()  # set on every node when the scenario holds this kind
    node_args: tuple[str, ...] = ()  # launcher flags of every node when the scenario holds this kind


SLOW_FACTOR = 5
"""How much slower the ``slow`` fault makes a node (its workers pause 4 own steps a step)."""
SLOW_NODE_ARGS = ("--straggler-sustain", "2", "--straggler-cooldown", "5", "--straggler-hold-out", "5")
"""The launcher flags of every node of a drill with a ``slow`` fault: evicted within seconds and
back after a 5 s hold-out, instead of the defaults' 10 s sustain and 5 min hold-out."""

EVICT_MARGIN = 1.0
"""Seconds past the lease TTL that a node must stay away to be out of the world for sure: etcd
revokes an expired lease up to about half a second late (its expiry check runs twice a second)."""


# ------------------------------------------------------------------------------ fire and heal

def ranks(args, nodes: int) -> int:
    """The world size (in ranks, as the step lines count it) of ``nodes`` whole nodes: every world
    size a fault record expects is in ranks (``args.nproc_per_node`` workers a node), as its
    ``world_before`` is."""
    return nodes * args.nproc_per_node


def _expect(rec: dict, world: int, driver: Driver, *, final: bool = True) -> None:
    rec["expected_world"] = ranks(driver.args, min(world, driver.cluster.max_nodes) if final else world)
    if final:
        rec["final_world"] = rec["expected_world"]


def _kill(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    driver.cluster.kill(node)
    _expect(rec, size - 1, driver)


def _arm_kill_during_checkpoint(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    rec["armed_at"] = time.time()
    rec["status"] = "armed"
    driver.watch_checkpoints()


def _corrupt(driver: Driver, rec: dict) -> str | None:
    corrupted = driver.corrupt_newest_checkpoint()
    if corrupted is None:
        return "skipped: no checkpoint to corrupt (local checkpoint dir only)"
    rec["corrupted_steps"] = [corrupted[0]]
    rec["corrupted_file"] = corrupted[1]
    driver.cluster.note(None, "checkpoint_corrupted", step=corrupted[0], file=corrupted[1])
    return None


def _term(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    node.signal(signal.SIGTERM)
    node.state = "terminated"
    node.term_deadline = now + driver.args.term_grace
    driver.cluster.note(node.name, "node_terminated")
    _expect(rec, size - 1, driver)


def _away(driver: Driver, rec: dict, size: int) -> None:
    """stop/cut: N-1 while the node is away when that outlasts its lease, N after (module docstring)."""
    longer = rec.get("duration") is not None and rec["duration"] >= driver.args.lease_ttl + EVICT_MARGIN
    rec["away_world"] = ranks(driver.args, size - 1)
    rec["expect_dip"] = bool(longer) and driver.args.rdzv_backend == "etcd-v3"
    rec["expected_world"] = ranks(driver.args, size - 1 if rec["expect_dip"] else size)


def _stop(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    node.paused_pgids = node.signal(signal.SIGSTOP)
    node.state = "stopped"
    driver.cluster.note(node.name, "node_stopped", pgids=sorted(node.paused_pgids))
    _away(driver, rec, size)


def _cont(driver: Driver, rec: dict, node: Node | None) -> None:
    if node is None:
        return
    for pgid in node.paused_pgids:
        killpg(pgid, signal.SIGCONT)
    if node.state == "stopped":
        node.state = "running"
    driver.cluster.note(node.name, "node_continued")


def _cut(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    driver.cluster.network.cut(node.net)
    node.state = "cut"
    driver.cluster.note(node.name, "node_cut")
    _away(driver, rec, size)


def _reconnect(driver: Driver, rec: dict, node: Node | None) -> None:
    if node is None:
        return
    driver.cluster.network.restore(node.net)
    if node.state == "cut":
        node.state = "running"
    driver.cluster.note(node.name, "node_restored")


def _pick_worker(driver: Driver, rec: dict) -> str | None:
    """hang: choose the worker process to hang (a child of the node's agent), or say why not."""
    node = driver.cluster.node(rec["node"])
    pids = sorted(workers(node.proc.pid)) if node is not None else []
    if not pids:
        return f"skipped: {rec['node']} runs no worker process now"
    rec["worker_pid"] = driver.cluster.rng.choice(pids)
    return None


def _hang(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    """One worker stops making progress while its process lives. Live path: SIGUSR2, which the
    trainer's debug hook (``ENV_DEBUG_HANG``) turns into an endless sleep of the training thread,
    its lease and watcher threads still running; the others must leave it out (N-1), its agent
    starts a newcomer (N). Restart path (no such hook): SIGSTOP of that worker process alone; its
    agent sees a live worker, and only the collective timeout ends the wait."""
    live = driver.args.recovery != "restart"
    sig = signal.SIGUSR2 if live else signal.SIGSTOP
    rec["signal"] = sig.name
    try:
        os.kill(rec["worker_pid"], sig)
    except ProcessLookupError:
        rec["notes"].append(f"worker {rec['worker_pid']} exited before the {sig.name}")
    driver.cluster.note(node.name, "worker_hung", pid=rec["worker_pid"], signal=sig.name)
    rec["away_world"] = ranks(driver.args, size - 1)
    rec["expect_dip"] = live
    rec["expected_world"] = ranks(driver.args, size - 1 if live else size)


def _slow(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    """A straggler: SIGUSR1 to each worker of the node, which the Manager's debug hook
    (``ENV_DEBUG_SLOW``) turns into a pause of (factor - 1) own steps a step. Live: the others leave
    it out (N-1), its launcher holds it out, checks it and lets it rejoin (N) with new workers,
    which are fast. Restart path: it is never left out (N throughout)."""
    live = driver.args.recovery != "restart"
    rec["worker_pids"] = sorted(workers(node.proc.pid))
    for pid in rec["worker_pids"]:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            rec["notes"].append(f"worker {pid} exited before the SIGUSR1")
    driver.cluster.note(node.name, "node_slowed", pids=rec["worker_pids"], factor=SLOW_FACTOR)
    rec["away_world"] = ranks(driver.args, size - 1)
    rec["expect_dip"] = live
    rec["expected_world"] = ranks(driver.args, size)


def _fast(driver: Driver, rec: dict, node: Node | None) -> None:
    """The slowed workers still alive (not evicted: the restart path, or a fault shorter than the
    detection) run at their own speed again."""
    for pid in rec.get("worker_pids", []):
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass  # evicted and gone: its node rejoined with new workers
    if node is not None:
        driver.cluster.note(node.name, "node_fast_again")


def _add_node(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    new = driver.cluster.start_node()
    rec["node"] = new.name
    _expect(rec, size + 1, driver)


def _kill_etcd(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    driver.cluster.etcd.kill()
    driver.cluster.note(None, "etcd_killed")


def _start_etcd(driver: Driver, rec: dict, node: Node | None) -> None:
    driver.cluster.etcd.start()
    driver.cluster.note(None, "etcd_started")


def _fill_disk(driver: Driver, rec: dict, node: Node | None, size: int, now: float) -> None:
    rec["filled_bytes"] = driver.fill_disk()
    driver.cluster.note(None, "disk_filled", bytes=rec["filled_bytes"])


def _free_disk(driver: Driver, rec: dict, node: Node | None) -> None:
    driver.free_disk()
    driver.cluster.note(None, "disk_freed")


# ------------------------------------------------------------------------------ the registry

def _needs_netns(args: argparse.Namespace) -> str | None:
    return None if args.netns else "the cut fault needs --netns (each node in its own network namespace)"


def _needs_own_etcd(args: argparse.Namespace) -> str | None:
    return "restart-etcd needs the drill's own etcd: leave out --rdzv-endpoint" if args.rdzv_endpoint else None


def _needs_own_disk(args: argparse.Namespace) -> str | None:
    return ("fill-disk needs the drill's own tmpfs checkpoint dir: leave --checkpoint-dir out of --trainer-args"
            if args.checkpoint_dir else None)


FAULTS: dict[str, FaultKind] = {k.name: k for k in [  # in --help order
    FaultKind("kill", "SIGKILL a node: its agent's and every worker's process group",
              Target.REQUIRED, _kill, victim="target", changes_world=True),
    FaultKind("kill-rank0", "SIGKILL the node that hosts global rank 0 (no TARGET)",
              Target.NONE, _kill, victim="rank0", changes_world=True),
    FaultKind("kill-during-checkpoint",
              "SIGKILL rank 0's node as soon as a checkpoint save starts at or after WHEN",
              Target.NONE, _arm_kill_during_checkpoint, changes_world=True, arms=True),
    FaultKind("stop", "SIGSTOP a node for:SECONDS, then SIGCONT it: past the lease the others go on at N-1, it rejoins",
              Target.REQUIRED, _stop, _cont, duration=8.0, victim="target"),
    FaultKind("term", "SIGTERM a node (preemption); SIGKILL what is left after --term-grace",
              Target.REQUIRED, _term, victim="target", changes_world=True),
    FaultKind("slow", f"make a node {SLOW_FACTOR}x slower for:SECONDS (SIGUSR1 to its workers with "
              f"ELASTIC_TRAINER_DEBUG_SLOW={SLOW_FACTOR} on every node): live, it is left out, held out, checked "
              "and rejoins", Target.REQUIRED, _slow, _fast, duration=30.0, victim="target",
              node_env=((ENV_DEBUG_SLOW, str(SLOW_FACTOR)),), node_args=SLOW_NODE_ARGS),
    FaultKind("add-node", "start one more node (no TARGET)", Target.NONE, _add_node, changes_world=True),
    FaultKind("restart-etcd",
              "SIGKILL the drill's etcd, start it again for:SECONDS later (default 1) on the same port and data",
              Target.NONE, _kill_etcd, _start_etcd, duration=1.0, refuse=_needs_own_etcd),
    FaultKind("cut", "cut a node off the network for:SECONDS (needs --netns): past the lease N-1, then N",
              Target.REQUIRED, _cut, _reconnect, duration=6.0, victim="target", refuse=_needs_netns),
    FaultKind("corrupt-checkpoint",
              "flip bytes in the newest checkpoint, then SIGKILL TARGET (default random) "
              "so the run must resume past it",
              Target.OPTIONAL, _kill, default_target="random", victim="target", changes_world=True,
              prepare=_corrupt),
    FaultKind("fill-disk", "fill the checkpoint tmpfs for:SECONDS, then free it",
              Target.NONE, _fill_disk, _free_disk, duration=8.0, refuse=_needs_own_disk),
    FaultKind("hang", "hang one worker of a node: its training thread stops, its process and lease live on "
              "(SIGUSR2 with ELASTIC_TRAINER_DEBUG_HANG=1 on every node; restart path: SIGSTOP of the worker)",
              Target.REQUIRED, _hang, victim="target", prepare=_pick_worker, node_env=((ENV_DEBUG_HANG, "1"),)),
]}
