"""How many CPUs this process may really use, and so how many threads each worker gets.

The CPU affinity mask says which cores the process may run on; in a container it is usually every
core of the machine. The cgroup's CPU quota says how much CPU time it gets: a Kubernetes pod with
``limits.cpu: 4`` on a 64-core node has 64 cores in its mask and 4 CPUs of quota. Sized from the
mask, each worker's OpenMP pool would start 64 threads that share 4 CPUs of time and are throttled
at every period (the same oversubscription, 1 thread per core on 2 cores for each of several
workers, once made training 30x slower here). So the threads come from the smaller of the two.

    from elastic_trainer import cpus
    cpus.available_cpus()                    # min(affinity, floor(cgroup quota)), at least 1
    cpus.threads_per_worker(nproc_per_node=4)

The quota is read from cgroup v2 (``cpu.max``: ``"400000 100000"`` or ``"max 100000"``) and v1
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 for none), for this process's cgroup and each
of its parents (a parent's limit holds for its children), under ``cgroup_root``. In a container
``/proc/self/cgroup`` may name a path of the host's hierarchy that is not mounted; the mount's
own root is then the container's cgroup, and it is read instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# Mount folder names of the v1 "cpu" controller (co-mounted with cpuacct on most distributions).
_V1_CPU_MOUNTS = ("cpu,cpuacct", "cpuacct,cpu", "cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under ``mount`` and each parent up to ``mount``; just ``mount`` when the
    named path is not there (a container sees its own cgroup at the mount's root)."""
    leaf = mount / path.lstrip("/")
    if not leaf.is_dir():
        return [mount] if mount.is_dir() else []
    folders = [leaf]
    while folders[-1] != mount and mount in folders[-1].parents:
        folders.append(folders[-1].parent)
    return folders


def _v2_quota(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_quota(cgroup_root: Path | str | None = None,
                     proc_self_cgroup: Path | str | None = None) -> float | None:
    """This process's CPU quota in CPUs (4.0 for ``limits.cpu: 4``), or None when it has none.
    ``cgroup_root`` and ``proc_self_cgroup`` default to ``CGROUP_ROOT`` and ``PROC_SELF_CGROUP``."""
    root = Path(cgroup_root or CGROUP_ROOT)
    lines = _read(Path(proc_self_cgroup or PROC_SELF_CGROUP))
    if lines is None:
        return None
    quotas: list[float] = []
    for line in lines.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2 (unified), alone or beside v1
            mount = root if (root / "cgroup.controllers").exists() else root / "unified"
            quotas += [q for f in _folders(mount, path) if (q := _v2_quota(f)) is not None]
        elif "cpu" in controllers.split(","):  # cgroup v1
            for name in (controllers, *_V1_CPU_MOUNTS):
                if (root / name).is_dir():
                    quotas += [q for f in _folders(root / name, path) if (q := _v1_quota(f)) is not None]
                    break
    return min(quotas) if quotas else None


def available_cpus(cgroup_root: Path | str | None = None, proc_self_cgroup: Path | str | None = None,
                   affinity: int | None = None) -> int:
    """CPUs this process can keep busy: its affinity mask, capped by the cgroup quota (rounded
    down: 2.5 CPUs of quota run 2 threads without throttling), at least 1."""
    cores = len(os.sched_getaffinity(0)) if affinity is None else affinity
    quota = cgroup_cpu_quota(cgroup_root, proc_self_cgroup)
    if quota is not None:
        cores = min(cores, int(quota))
    return max(1, cores)


def threads_per_worker(nproc_per_node: int, **where) -> int:
    """``OMP_NUM_THREADS`` for each of ``nproc_per_node`` workers: their share of ``available_cpus``."""
    return max(1, available_cpus(**where) // nproc_per_node)
