"""The checks a node passes before it joins a run, and before it rejoins one: a node whose storage
mount is gone, whose etcd is out of reach or whose GPU is broken would otherwise join, fail, be
restarted and join again, costing every other node a re-form each time.

Each check is bounded in time and gives one ``CheckResult`` whose ``line`` says, in one line, what
was checked, what failed and what to do about it:

- ``check_storage(url)``: write, read back and delete a small object at the checkpoint URL
  (``storage.check_writable``: the same probe the launcher makes at start, on every
  store fsspec reaches);
- ``check_etcd(endpoints, options)``: one etcd of the run answers a status request within the
  bound, as the rendezvous connects (``etcd/server.probe_endpoint``: TLS and user included);
- ``check_device(device, reference)``: a matmul on the device gives the right numbers (a column
  checked in float64 on the CPU) at a speed not far below ``reference``, the median speed the
  run's other nodes reported (``min_speed_ratio`` of it); the measured speed is in ``value``, for
  this node to report in turn;
- ``check_nvml(pci_bus_ids)``: on NVIDIA GPUs, what the driver says each GPU needs
  (NVML's GPU recovery action, driver r570+: none, a reset, a reboot, a drain); skipped, with the
  reason, where ``pynvml`` (``pip install nvidia-ml-py``) or the driver is missing.

``check_node(...)`` runs those that apply and returns a ``HealthReport``: ``ok``, and ``summary()``,
the one line a failing node prints (and shows in ``elastic-train status``) before it retries after
a back-off (``backoff.BackOff``); each failure is counted in the metrics
(``elastic_trainer_health_check_failures_total{check}``).

Bounds. A probe runs on a thread of the worker runtime and is waited for at most its bound: a
storage mount that hangs (an NFS server gone: the call blocks in the kernel) fails the check
after ``storage_timeout_s`` instead of holding the node. Such a thread cannot be stopped; while
one is still stuck, the next check of that kind fails at once with the same cause instead of
starting another (NVIDIA's resiliency extension runs its storage probe in a short-lived
process for the same reason).

What NVIDIA's resiliency extension and DLRover do, and what is taken: NVRx checks GPU health
through NVML's recovery action before each rendezvous, NIC link counters and storage paths
(exists, readable); here the storage probe also writes and deletes (a read-only mount passes
NVRx's check and fails a checkpoint). DLRover runs a matmul and an all-gather on pairs of nodes
before training and names a node slower than twice the median: the matmul speed against the
peers' median is that idea, per node, without pairing; the collective with a peer belongs to the
join itself (its first all-reduce), where a broken link fails the join.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_trainer.observability import metrics

if TYPE_CHECKING:
    import torch

    from elastic_trainer.etcd.client import EtcdOptions

logger = logging.getLogger(__name__)


@dataclass
class HealthConfig:
    """Bounds of the checks before a node joins."""

    storage_timeout_s: float = 30.0
    """Seconds the checkpoint storage has to take a small write, read and delete."""
    etcd_timeout_s: float = 3.0
    """Seconds etcd has to answer (the node lease lives 3 s: slower, the node would lose it)."""
    device_timeout_s: float = 60.0
    """Seconds the device check may take (a first CUDA call makes the context: seconds)."""
    matmul_size: int = 1024
    """Side of the square matmul the device check runs (float32)."""
    measure_s: float = 0.1
    """Seconds of matmuls the device's speed is measured over (after one to warm up): a node's
    start pays it before its first join."""
    min_speed_ratio: float = 0.5
    """A device slower than this share of its peers' median speed fails (DLRover: half)."""

    def __post_init__(self) -> None:
        for name in ("storage_timeout_s", "etcd_timeout_s", "device_timeout_s", "measure_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"health check {name} must be above 0 seconds, got {getattr(self, name)}")
        if self.matmul_size < 16:
            raise ValueError(f"health check matmul_size must be at least 16, got {self.matmul_size}")
        if not 0 < self.min_speed_ratio <= 1:
            raise ValueError(f"health check min_speed_ratio must be in (0, 1], got {self.min_speed_ratio}")


@dataclass(frozen=True)
class CheckResult:
    """One check: ``check`` (``metrics.HEALTH_CHECKS``), whether it passed, its one ``line``, its
    ``seconds``; ``skipped`` when it could not apply here (it passes then); ``value``: the device
    check's speed in GFLOP/s."""

    check: str
    ok: bool
    line: str
    seconds: float = 0.0
    skipped: bool = False
    value: float | None = None
    label: str | None = None
    """The device check's device, as ``check_board.device_label`` names it (for its report)."""


@dataclass(frozen=True)
class HealthReport:
    """Every check of one node, in order."""

    results: tuple[CheckResult, ...] = ()

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        """One line: the failures' lines, or what passed."""
        failed = self.failures()
        if failed:
            return "node check failed: " + "; ".join(r.line for r in failed)
        return "node check passed: " + "; ".join(r.line for r in self.results)


# ---- bounded probes ----------------------------------------------------------------------------------
_stuck_lock = threading.Lock()
_stuck: dict[str, threading.Thread] = {}
"""The probe thread of each kind that outlived its bound (still blocked, perhaps for good)."""


def bounded(name: str, probe: Callable[[], Any], timeout: float) -> tuple[str, Any]:
    """Run ``probe()`` on a runtime thread for at most ``timeout`` seconds: ``("done", value)``,
    ``("raised", exception)``, ``("timeout", None)``, or ``("stuck", None)`` when the previous probe
    of this ``name`` (a check and its subject: ``storage:<url>``) is still blocked (none is started then)."""
    from elastic_trainer.runtime import runtime

    with _stuck_lock:
        previous = _stuck.get(name)
        if previous is not None and previous.is_alive():
            return "stuck", None
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["done"] = probe()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which reports it
            out["raised"] = exc

    thread = runtime().start_thread(f"health-{name.split(':', 1)[0]}", run)
    thread.join(timeout)
    if thread.is_alive():
        with _stuck_lock:
            _stuck[name] = thread
        return "timeout", None
    kind = "done" if "done" in out else "raised"
    return kind, out[kind]


def _late(check: str, what: str, timeout: float, outcome: str, fix: str, took: float) -> CheckResult:
    still = " (the previous probe is still blocked)" if outcome == "stuck" else ""
    return CheckResult(check, False, f"{check}: {what} did not answer within {timeout:g} s{still}; {fix}", took)


# ---- the checks ---------------------------------------------------------------------------------------
def check_storage(url: str, timeout: float = HealthConfig.storage_timeout_s) -> CheckResult:
    """Write, read back and delete a small object under the checkpoint URL ``url``."""
    from elastic_trainer import storage

    where = storage.redact(url)
    fix = f"check that {where} is mounted or reachable, writable by this user, and its credentials"
    t0 = time.perf_counter()
    outcome, value = bounded(f"storage:{where}", lambda: storage.check_writable(url), timeout)
    took = time.perf_counter() - t0
    if outcome in ("timeout", "stuck"):
        return _late("storage", f"the checkpoint storage {where}", timeout, outcome, fix, took)
    if outcome == "raised":
        reason = str(value) if isinstance(value, storage.StorageError) else f"{type(value).__name__}: {value}"
        return CheckResult("storage", False, f"storage: {storage.redact(reason)}; {fix}", took)
    return CheckResult("storage", True, f"storage: {where} written, read and deleted in {took * 1000:.0f} ms", took)


def check_etcd(endpoints: str, options: EtcdOptions | None = None,
               timeout: float = HealthConfig.etcd_timeout_s) -> CheckResult:
    """One of ``endpoints`` answers an etcd status request within ``timeout``, connected as the
    rendezvous connects (``options``: TLS, user)."""
    from elastic_trainer.etcd import server

    fix = "check that etcd runs there and that this node reaches it (network policy, TLS files, --rdzv-conf)"
    t0 = time.perf_counter()
    outcome, value = bounded(f"etcd:{endpoints}", lambda: server.probe_endpoint(endpoints, timeout, options),
                             timeout + 1.0)
    took = time.perf_counter() - t0
    if outcome in ("timeout", "stuck"):
        return _late("etcd", f"etcd at {endpoints}", timeout, outcome, fix, took)
    if outcome == "raised":
        return CheckResult("etcd", False, f"etcd: {value}", took)
    if took > timeout:
        return CheckResult("etcd", False, f"etcd: {endpoints} answered after {took:.2f} s, over the {timeout:g} s "
                                          f"bound; {fix}", took)
    return CheckResult("etcd", True, f"etcd: {endpoints} (etcd {value}) answered in {took * 1000:.0f} ms", took)


def _matmul_speed(device: torch.device, size: int, measure_s: float = HealthConfig.measure_s) -> float:
    """GFLOP/s of float32 ``size`` x ``size`` matmuls on ``device`` (at least ``measure_s`` of them), after
    checking one column of the product in float64 on the CPU; ``ArithmeticError`` when it is wrong."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a_cpu = torch.randn(size, size, generator=generator)
    b_cpu = torch.randn(size, size, generator=generator)
    a, b = a_cpu.to(device), b_cpu.to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.no_grad():
        c = a @ b  # also the warm-up (CUDA context, kernels chosen)
        sync()
        column = c[:, 0].double().cpu()
        expected = a_cpu.double() @ b_cpu[:, 0].double()
        if not torch.allclose(column, expected, rtol=1e-3, atol=1e-3 * size ** 0.5):
            worst = (column - expected).abs().max().item()
            raise ArithmeticError(f"a {size}x{size} matmul on {device} gave wrong numbers (off by up to {worst:.3g})")
        runs, t0 = 0, time.perf_counter()
        while True:
            for _ in range(4):
                a @ b
            sync()
            runs += 4
            elapsed = time.perf_counter() - t0
            if elapsed >= measure_s:
                return 2.0 * size ** 3 * runs / elapsed / 1e9


def check_device(device: torch.device, reference: float | None = None, *, config: HealthConfig | None = None
                 ) -> CheckResult:
    """A matmul on ``device`` is right, and at least ``min_speed_ratio`` of ``reference`` (GFLOP/s,
    the peers' median; None: no peer reported yet, any speed passes and is reported in ``value``)."""
    config = config or HealthConfig()
    size = config.matmul_size
    t0 = time.perf_counter()
    outcome, value = bounded(f"device:{device}", lambda: _matmul_speed(device, size, config.measure_s),
                             config.device_timeout_s)
    took = time.perf_counter() - t0
    if outcome in ("timeout", "stuck"):
        return _late("device", f"a {size}x{size} matmul on {device}", config.device_timeout_s, outcome, _DEVICE_FIX,
                     took)
    if outcome == "raised":
        return CheckResult("device", False, f"device: {type(value).__name__}: {value}; {_DEVICE_FIX}", took)
    return _judged(str(device), float(value), reference, config, took)


_DEVICE_FIX = "check the device (nvidia-smi -q -d PERFORMANCE,ECC shows clocks, throttling, errors), or drain this node"


def _judged(device: str, speed: float, reference: float | None, config: HealthConfig, took: float) -> CheckResult:
    size = config.matmul_size
    if reference is not None and speed < config.min_speed_ratio * reference:
        return CheckResult("device", False, f"device: {device} ran a {size}x{size} matmul at {speed:.1f} GFLOP/s, "
                                            f"below {config.min_speed_ratio:g} of its peers' median {reference:.1f}; "
                                            f"{_DEVICE_FIX}", took, value=speed)
    against = f" (peers' median {reference:.1f})" if reference is not None else ""
    return CheckResult("device", True, f"device: {device} {speed:.1f} GFLOP/s{against}", took, value=speed)


def check_devices_apart(devices: Sequence[str], reference_of: Callable[[str], float | None] = lambda label: None,
                        *, config: HealthConfig | None = None) -> CheckResult:
    """The device check of each of ``devices`` (``cuda:0``, ...) in a short-lived process of its own
    (this module's ``main``), judged by the slowest: the launcher of a GPU node checks its GPUs so,
    since a matmul in the launcher would hold a CUDA context on each GPU for the whole run. Costs
    that process's start (a torch import, the CUDA context): seconds, before a join only.
    ``reference_of(label)``: the peers' median speed for a device such as the slowest one."""
    import subprocess
    import sys

    config = config or HealthConfig()
    command = [sys.executable, "-m", "elastic_trainer.observability.health", "--size", str(config.matmul_size),
               "--measure", str(config.measure_s), *devices]
    t0 = time.perf_counter()
    limit = config.device_timeout_s + 60.0  # the process's torch import and CUDA start come first
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        return _late("device", f"the device check of {', '.join(devices)}", limit, "timeout", _DEVICE_FIX,
                     time.perf_counter() - t0)
    took = time.perf_counter() - t0
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(answers) != len(devices):
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return CheckResult("device", False, f"device: the check of {', '.join(devices)} failed: {last}; "
                                            f"{_DEVICE_FIX}", took)
    failed = next((a for a in answers if "error" in a), None)
    if failed is not None:
        return CheckResult("device", False, f"device: {failed['error']}; {_DEVICE_FIX}", took)
    slowest = min(answers, key=lambda a: a["gflops"])
    result = _judged(slowest["device"], float(slowest["gflops"]), reference_of(slowest["label"]), config, took)
    return dataclasses.replace(result, label=slowest["label"])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic_trainer.observability.health [--size N] DEVICE...``: one JSON line per
    device, ``{"device", "label", "gflops"}`` or ``{"device", "error"}`` (``check_devices_apart``)."""
    import argparse

    import torch

    from elastic_trainer.observability.check_board import device_label

    p = argparse.ArgumentParser(prog="python -m elastic_trainer.observability.health")
    p.add_argument("--size", type=int, default=HealthConfig.matmul_size)
    p.add_argument("--measure", type=float, default=HealthConfig.measure_s)
    p.add_argument("devices", nargs="+")
    args = p.parse_args(argv)
    for name in args.devices:
        device = torch.device(name)
        try:
            answer = {"device": name, "label": device_label(device),
                      "gflops": _matmul_speed(device, args.size, args.measure)}
        except Exception as exc:  # noqa: BLE001 - reported to the launcher, which says it in one line
            answer = {"device": name, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    return 0


_RECOVERY_ACTIONS = {
    "NVML_GPU_RECOVERY_ACTION_GPU_RESET": "needs a GPU reset: stop its processes and reset it (nvidia-smi -r)",
    "NVML_GPU_RECOVERY_ACTION_NODE_REBOOT": "needs the node rebooted",
    "NVML_GPU_RECOVERY_ACTION_DRAIN_P2P": "needs its peer-to-peer traffic drained: stop the processes using it",
    "NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET": "runs at reduced capacity: drain the node and reset the GPU",
}


def check_nvml(pci_bus_ids: Sequence[str] | None = None) -> CheckResult:
    """What NVML says the GPUs (``pci_bus_ids``, None: every GPU) need; skipped without pynvml or a
    driver, or where the driver does not report recovery actions (before r570)."""
    t0 = time.perf_counter()
    try:
        import pynvml
    except ImportError:
        return CheckResult("nvml", True, "nvml: skipped: pynvml is not installed (pip install nvidia-ml-py)",
                           skipped=True)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return CheckResult("nvml", True, f"nvml: skipped: no NVIDIA driver here ({exc})", skipped=True)
    try:
        field_id = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return CheckResult("nvml", True, "nvml: skipped: this pynvml has no GPU recovery action (upgrade "
                                             "nvidia-ml-py)", skipped=True)
        handles = ([pynvml.nvmlDeviceGetHandleByPciBusId(bus) for bus in pci_bus_ids] if pci_bus_ids is not None
                   else [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())])
        names = {getattr(pynvml, name, None): text for name, text in _RECOVERY_ACTIONS.items()}
        problems = []
        for handle in handles:
            [answer] = pynvml.nvmlDeviceGetFieldValues(handle, [field_id])
            if answer.nvmlReturn != pynvml.NVML_SUCCESS:
                return CheckResult("nvml", True, "nvml: skipped: the driver does not report GPU recovery actions "
                                                 "(r570 or newer does)", time.perf_counter() - t0, skipped=True)
            action = answer.value.uiVal
            if action != getattr(pynvml, "NVML_GPU_RECOVERY_ACTION_NONE", 0):
                bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
                bus = bus.decode() if isinstance(bus, bytes) else bus
                problems.append(f"GPU {bus} {names.get(action, f'reports recovery action {action}')}")
        took = time.perf_counter() - t0
        if problems:
            return CheckResult("nvml", False, "nvml: " + "; ".join(problems), took)
        return CheckResult("nvml", True, f"nvml: {len(handles)} GPU(s) need no recovery action", took)
    except pynvml.NVMLError as exc:
        return CheckResult("nvml", False, f"nvml: the driver failed to answer ({exc}); check nvidia-smi, or drain "
                                          "this node", time.perf_counter() - t0)
    finally:
        pynvml.nvmlShutdown()


def check_node(config: HealthConfig | None = None, *, checkpoint_url: str | None = None,
               etcd_endpoints: str | None = None, etcd_options: EtcdOptions | None = None,
               device: torch.device | None = None, reference_gflops: float | None = None,
               pci_bus_ids: Sequence[str] | None = None) -> HealthReport:
    """The checks that apply (a check whose subject is None is left out; NVML only on a CUDA
    device), each failure counted in the metrics; the caller says the report's line (once).
    See the module docstring."""
    config = config or HealthConfig()
    results = []
    if checkpoint_url:
        results.append(check_storage(checkpoint_url, config.storage_timeout_s))
    if etcd_endpoints:
        results.append(check_etcd(etcd_endpoints, etcd_options, config.etcd_timeout_s))
    if device is not None:
        results.append(check_device(device, reference_gflops, config=config))
        if device.type == "cuda":
            results.append(check_nvml(pci_bus_ids))
    report = HealthReport(tuple(results))
    for failed in report.failures():
        metrics.health_check_failed(failed.check)
    return report


__all__ = ["CheckResult", "HealthConfig", "HealthReport", "bounded", "check_device", "check_devices_apart",
           "check_etcd", "check_node", "check_nvml", "check_storage"]


if __name__ == "__main__":
    raise SystemExit(main())
