"""Private network namespaces for drills: one namespace per simulated node, joined by a bridge.

A drill with ``--netns`` puts every node (its agent and its workers) in a network namespace
of its own. Each namespace gets one veth pair: the end inside is called ``etd0`` and has the
address ``10.231.X.(10+i)``; the end outside is enslaved to a bridge that this module also
creates, with the address ``10.231.X.1`` where the drill's etcd listens. Nodes reach each
other and etcd over that bridge and nothing else: no route leaves it, nothing is forwarded.
"Cutting a node off the network" is setting its outside veth end down; restoring is setting
it up again.

Every name carries the drill's process id (``etd-<pid>-<i>``, ``etb<pid>``, ``etv<pid>.<i>``),
so that :func:`sweep_stale` can remove what a drill that was killed with SIGKILL left behind,
and nothing else. Needs root (``ip netns``).

    net = Network()
    try:
        net.up()
        node = net.add_node(0)
        subprocess.run(net.wrap(node, ["python", "-c", "print('inside')"]))
        net.cut(node); net.restore(node)
    finally:
        net.teardown()
"""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INSIDE_IFNAME = "etd0"
"""Name of each node's interface inside its namespace (use it as GLOO_SOCKET_IFNAME)."""
_NS_RE = re.compile(r"^etd-(\d+)-\d+$")
_LINK_RE = re.compile(r"^(?:etb(\d+)|etv(\d+)\.\d+)$")


class NetnsError(RuntimeError):
    """A namespace, bridge or veth could not be created or changed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    except FileNotFoundError as exc:
        raise NetnsError("the `ip` command (iproute2) is missing: apt-get install -y iproute2") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()} "
                         "(network namespaces need root and iproute2)")
    return done


@dataclass
class NetNode:
    """One node's namespace: its name, the outside veth end, and the address inside."""

    index: int
    namespace: str
    veth: str
    address: str
    cut: bool = False


class Network:
    """A bridge with address ``10.231.X.1`` and one namespace per node attached to it."""

    def __init__(self, owner_pid: int | None = None, subnet: int | None = None) -> None:
        self.owner = owner_pid or os.getpid()
        self.subnet = subnet if subnet is not None else _free_subnet()
        self.bridge = f"etb{self.owner}"
        self.host_address = f"10.231.{self.subnet}.1"
        self.nodes: list[NetNode] = []
        self._bridge_made = False

    def up(self) -> None:
        """Create the bridge and give it ``10.231.X.1/24``."""
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        # A bridge without an address of its own takes its ports' lowest MAC and changes it when
        # a port joins, leaves or goes down: every node's ARP entry for etcd goes stale, and a
        # cut or an added node becomes a seconds-long outage of etcd for all. Pin it.
        pid = self.owner & 0xFFFFFF
        _ip("link", "set", self.bridge, "address", f"02:e7:00:{pid >> 16:02x}:{(pid >> 8) & 0xFF:02x}:{pid & 0xFF:02x}")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        logger.info("netns: bridge %s at %s/24", self.bridge, self.host_address)

    def add_node(self, index: int) -> NetNode:
        """Create namespace ``etd-<pid>-<index>`` with ``etd0`` at ``10.231.X.(10+index)``."""
        if not 0 <= index < 240:
            raise NetnsError(f"node index {index} does not fit the /24 (0 to 239)")
        node = NetNode(index, f"etd-{self.owner}-{index}", f"etv{self.owner}.{index}",
                       f"10.231.{self.subnet}.{10 + index}")
        if len(node.veth) > 15:
            raise NetnsError(f"interface name {node.veth!r} is longer than 15 characters")
        _ip("netns", "add", node.namespace)
        self.nodes.append(node)
        peer = f"etp{self.owner}.{index}"
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", node.namespace)
        _ip("-n", node.namespace, "link", "set", peer, "name", INSIDE_IFNAME)
        _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", INSIDE_IFNAME)
        _ip("-n", node.namespace, "link", "set", INSIDE_IFNAME, "up")
        _ip("-n", node.namespace, "link", "set", "lo", "up")
        _ip("link", "set", node.veth, "master", self.bridge)
        _ip("link", "set", node.veth, "up")
        return node

    @staticmethod
    def wrap(node: NetNode, cmd: list[str]) -> list[str]:
        """The command line that runs ``cmd`` inside the node's namespace (same pid: ip execs it)."""
        return ["ip", "netns", "exec", node.namespace, *cmd]

    def cut(self, node: NetNode) -> None:
        """Take the node off the network: its outside veth end goes down (both directions)."""
        _ip("link", "set", node.veth, "down")
        node.cut = True

    def restore(self, node: NetNode) -> None:
        """Put a cut node back on the network."""
        _ip("link", "set", node.veth, "up")
        node.cut = False

    def teardown(self) -> None:
        """Remove every veth, namespace and the bridge this object made; safe to call twice."""
        for node in self.nodes:
            _ip("link", "del", node.veth, check=False)  # deletes the inside end too
            _ip("netns", "del", node.namespace, check=False)
        self.nodes = []
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False


def _free_subnet() -> int:
    """A third octet X for 10.231.X.0/24 that no route on this machine uses yet."""
    used = _ip("-4", "route", "show", check=False).stdout
    taken = {int(m) for m in re.findall(r"10\.231\.(\d+)\.", used)}
    choices = [x for x in range(1, 255) if x not in taken]
    if not choices:
        raise NetnsError("every 10.231.X.0/24 subnet is in use; remove stale drill bridges (ip link)")
    return random.choice(choices)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove drill namespaces and links whose owning drill process is gone; return their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NS_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        match = _LINK_RE.match(name)
        if match and not _alive(int(match.group(1) or match.group(2))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    if removed:
        logger.info("netns: removed what earlier drills left behind: %s", ", ".join(removed))
    return removed
