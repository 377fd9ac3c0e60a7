"""What nodes say of their checks before a join, in the run's etcd: the device speeds their peers
compare with, and the nodes that are refused for now.

A node's launcher runs the checks before it first joins and before it rejoins
(``observability/health.py``; ``cli/launch.py``'s ``checked``). Two things about them must reach
other machines, and the run's etcd is where every node and ``elastic-train status`` already look:

- ``<run>/checks/speed/<host>``: the matmul speed (GFLOP/s) this host's device reached when it last
  passed, and what the device is (``device_label``: the GPU's name, or the CPU's model). A node
  checks its speed against the **median of the other hosts' reports for the same device**
  (``reference``): a GPU at half its peers' speed (throttled, a degraded PCIe link, a failing
  fan) is refused before it slows every step, as DLRover's pre-flight check names a node slower
  than half the median. Hosts, not nodes: nodes that share a host share its device, so one of them
  measured beside the others' training would measure the others' load, not its device; a host
  never compares with itself. A host's report stays after it leaves (it is still a sample of the
  cluster's hardware) and is replaced by its next one.
- ``<run>/checks/refused/<node>``: the one line of a node that failed its checks (or is held out
  after an eviction as a straggler) and when it tries again; ``elastic-train status`` lists it.
  The key lives on its own etcd lease of the retry's length plus a margin, so the line of a node
  whose launcher died goes with it; a node that passes deletes it.

A value that is not such a report (not a JSON object, a speed that is no positive finite number,
a time that is no number) is ignored, never raised: whoever can write the run's keys can refuse
nodes (write access is trust, as for the rest of the run's keys), not crash a launcher or status.

Nothing here is on the training path: one read and one or two writes per check, a node's start
or rejoin at most. A failure to reach etcd is logged and never fails the check (the etcd check
itself says whether etcd answers).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions

logger = logging.getLogger(__name__)

SPEEDS = "checks/speed/"
REFUSED = "checks/refused/"
LEASE_MARGIN_S = 30.0
"""A refused line outlives its retry by this much, so that status shows it until the next check."""


def device_label(device: torch.device) -> str:
    """What the device is, for comparing like with like: the GPU's name (``NVIDIA H100 80GB HBM3``),
    or ``cpu: <model name>`` from /proc/cpuinfo (the machine's architecture where there is none)."""
    import platform

    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"cpu: {model or platform.machine()}"


@dataclass(frozen=True)
class Refused:
    """A node refused for now: its ``line``, since when (``time``) and when it tries again (``retry_at``)."""

    node: str
    line: str
    time: float
    retry_at: float


class CheckBoard:
    """One node's view of the run's check reports (see the module docstring), through its own etcd
    connection made at first use (and again after a failure: etcd may be what the node waits
    for). ``host`` and ``node`` default to this machine's name and ``<host>-<launcher pid>``."""

    def __init__(self, options: EtcdOptions, prefix: str, *, host: str | None = None, node: str | None = None
                 ) -> None:
        self._options = options
        self._conn: EtcdConnection | None = None
        self._prefix = prefix
        self.host = host or socket.gethostname()
        self.node = node or f"{self.host}-{os.getpid()}"
        self._lease = None

    def _call(self, fn, what: str) -> Any:
        from elastic_trainer.etcd.client import EtcdConnection

        if self._conn is None:
            self._conn = EtcdConnection(self._options)
        return self._conn.call(fn, what, retry_timeout=3)

    def reference(self, label: str) -> float | None:
        """The median speed other hosts reported for a device like ``label``; None when none did
        (or etcd did not answer: the check then passes on correctness alone)."""
        try:
            reports = self._call(lambda c: list(c.get_prefix(self._prefix + SPEEDS)), "check board read")
        except Exception as exc:  # noqa: BLE001 - a missing reference never fails the check
            logger.warning("could not read the peers' device speeds from etcd (%s); checking without them", exc)
            return None
        speeds = []
        for value, meta in reports:
            host = meta.key.decode()[len(self._prefix + SPEEDS):]
            report = _decoded(value)
            speed = _number(report.get("gflops"))
            if host != self.host and report.get("device") == label and speed > 0:
                speeds.append(speed)
        return statistics.median(speeds) if speeds else None

    def passed(self, gflops: float | None, label: str | None) -> None:
        """This node passed: report its device's speed (when measured) and take its refused line back."""
        def write(c):
            if gflops is not None and label is not None:
                c.put(self._prefix + SPEEDS + self.host,
                      json.dumps({"gflops": round(gflops, 2), "device": label, "node": self.node, "time": time.time()}))
            c.delete(self._prefix + REFUSED + self.node)
            if self._lease is not None:
                c.revoke_lease(self._lease)
        self._write(write)
        self._lease = None

    def refused(self, line: str, retry_s: float) -> None:
        """This node is refused for ``retry_s`` seconds, for the reason in ``line`` (one line)."""
        now = time.time()
        body = json.dumps({"line": line, "time": now, "retry_at": now + retry_s})

        def write(c):
            old, lease = self._lease, c.lease(int(retry_s + LEASE_MARGIN_S))
            c.put(self._prefix + REFUSED + self.node, body, lease=lease)
            if old is not None:
                c.revoke_lease(old)
            return lease.id
        self._lease = self._write(write) or self._lease

    def close(self) -> None:
        """Take this node's refused line back (it is stopping) and close the connection."""
        if self._lease is not None:
            self._write(lambda c: c.revoke_lease(self._lease))
        if self._conn is not None:
            self._conn.close()

    def _write(self, fn) -> Any:
        try:
            return self._call(fn, "check board write")
        except Exception as exc:  # noqa: BLE001 - the node's own line is printed anyway
            logger.warning("could not write this node's check report to etcd (%s)", exc)
            return None


def read_refused(client, prefix: str) -> list[Refused]:
    """The nodes refused for now, from one etcd ``client`` (``elastic-train status``)."""
    out = []
    for value, meta in client.get_prefix(prefix + REFUSED):
        report = _decoded(value)
        out.append(Refused(node=meta.key.decode(errors="replace")[len(prefix + REFUSED):],
                           line=str(report.get("line", "?"))[:2000], time=_number(report.get("time")),
                           retry_at=_number(report.get("retry_at"))))
    return sorted(out, key=lambda r: r.node)


def _number(value: Any) -> float:
    """A time from a report; 0 for anything that is not a finite number (a stray or hostile value)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _decoded(value: bytes) -> dict:
    try:
        report = json.loads(value)
    except (TypeError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


__all__ = ["CheckBoard", "REFUSED", "Refused", "SPEEDS", "device_label", "read_refused"]
