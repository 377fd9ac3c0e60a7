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
"""

from __future__ import annotations

import argparse
import enum
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from elastic_trainer.drill.nodes import killpg

if TYPE_CHECKING:
    from elastic_trainer.drill.faults import FaultDriver
    from elastic_trainer.drill.nodes import Node


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
    fire: Callable[["FaultDriver", dict, "Node | None", int, float], None]
    heal: Callable[["FaultDriver", dict, "Node | None"], None] | None = None
    duration: float | None = None  # the default for:SECONDS; None: takes no for:
    default_target: str | None = None  # Target.OPTIONAL: the target when none is given
    victim: str | None = None  # the node it strikes: "target" (the fault's), "rank0", or None
    changes_world: bool = False  # the run goes on at another world size, in a new round
    arms: bool = False  # fire only arms it; FaultDriver.progress strikes later
    prepare: Callable[["FaultDriver", dict], str | None] | None = None  # before firing; a reason to skip
    refuse: Callable[[argparse.Namespace], str | None] | None = None  # why the drill cannot run it


# ------------------------------------------------------------------------------ fire and heal

def _expect(rec: dict, world: int, driver: FaultDriver, *, final: bool = True) -> None:
    rec["expected_world"] = min(world, driver.cluster.max_nodes) if final else world
    if final:
        rec["final_world"] = rec["expected_world"]


def _kill(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    driver.cluster.kill(node)
    _expect(rec, size - 1, driver)


def _arm_kill_during_checkpoint(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    rec["armed_at"] = time.time()
    rec["status"] = "armed"
    driver.watch_checkpoints()


def _corrupt(driver: FaultDriver, rec: dict) -> str | None:
    corrupted = driver.corrupt_newest_checkpoint()
    if corrupted is None:
        return "skipped: no checkpoint to corrupt (local checkpoint dir only)"
    rec["corrupted_steps"] = [corrupted[0]]
    rec["corrupted_file"] = corrupted[1]
    driver.cluster.note(None, "checkpoint_corrupted", step=corrupted[0], file=corrupted[1])
    return None


def _term(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    node.signal(signal.SIGTERM)
    node.state = "terminated"
    node.term_deadline = now + driver.args.term_grace
    driver.cluster.note(node.name, "node_terminated")
    _expect(rec, size - 1, driver)


def _stop(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    node.paused_pgids = node.signal(signal.SIGSTOP)
    node.state = "stopped"
    driver.cluster.note(node.name, "node_stopped", pgids=sorted(node.paused_pgids))
    _expect(rec, size - 1, driver, final=False)


def _cont(driver: FaultDriver, rec: dict, node: Node | None) -> None:
    if node is None:
        return
    for pgid in node.paused_pgids:
        killpg(pgid, signal.SIGCONT)
    if node.state == "stopped":
        node.state = "running"
    driver.cluster.note(node.name, "node_continued")


def _cut(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    driver.cluster.network.cut(node.net)
    node.state = "cut"
    driver.cluster.note(node.name, "node_cut")
    _expect(rec, size - 1, driver, final=False)


def _reconnect(driver: FaultDriver, rec: dict, node: Node | None) -> None:
    if node is None:
        return
    driver.cluster.network.restore(node.net)
    if node.state == "cut":
        node.state = "running"
    driver.cluster.note(node.name, "node_restored")


def _add_node(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    new = driver.cluster.start_node()
    rec["node"] = new.name
    _expect(rec, size + 1, driver)


def _kill_etcd(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    driver.cluster.etcd.kill()
    driver.cluster.note(None, "etcd_killed")


def _start_etcd(driver: FaultDriver, rec: dict, node: Node | None) -> None:
    driver.cluster.etcd.start()
    driver.cluster.note(None, "etcd_started")


def _fill_disk(driver: FaultDriver, rec: dict, node: Node | None, size: int, now: float) -> None:
    rec["filled_bytes"] = driver.fill_disk()
    driver.cluster.note(None, "disk_filled", bytes=rec["filled_bytes"])


def _free_disk(driver: FaultDriver, rec: dict, node: Node | None) -> None:
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
    FaultKind("stop", "SIGSTOP a node for:SECONDS (past the lease TTL), then SIGCONT it: a zombie",
              Target.REQUIRED, _stop, _cont, duration=8.0, victim="target"),
    FaultKind("term", "SIGTERM a node (preemption); SIGKILL what is left after --term-grace",
              Target.REQUIRED, _term, victim="target", changes_world=True),
    FaultKind("add-node", "start one more node (no TARGET)", Target.NONE, _add_node, changes_world=True),
    FaultKind("restart-etcd",
              "SIGKILL the drill's etcd, start it again for:SECONDS later (default 1) on the same port and data",
              Target.NONE, _kill_etcd, _start_etcd, duration=1.0, refuse=_needs_own_etcd),
    FaultKind("cut", "cut a node off the network for:SECONDS (needs --netns)",
              Target.REQUIRED, _cut, _reconnect, duration=6.0, victim="target", refuse=_needs_netns),
    FaultKind("corrupt-checkpoint",
              "flip bytes in the newest checkpoint, then SIGKILL TARGET (default random) "
              "so the run must resume past it",
              Target.OPTIONAL, _kill, default_target="random", victim="target", changes_world=True,
              prepare=_corrupt),
    FaultKind("fill-disk", "fill the checkpoint tmpfs for:SECONDS, then free it",
              Target.NONE, _fill_disk, _free_disk, duration=8.0, refuse=_needs_own_disk),
]}
