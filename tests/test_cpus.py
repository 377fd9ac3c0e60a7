"""Workers get threads for the CPUs the pod may use: the cgroup's CPU quota caps the affinity mask.

Fake cgroup trees in a temporary folder stand for a Kubernetes pod (cgroup v2, v1 and the hybrid
layout), so the tests need no container: ``limits.cpu: 4`` on a 64-core node must give 4 threads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from elastic_trainer import cli, cpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def cgroup_v2(tmp_path: Path, cpu_max: str, own: str = "/", parent_cpu_max: str | None = None) -> tuple[Path, Path]:
    """A unified hierarchy whose process lives in ``own`` with ``cpu.max``; (root, /proc/self/cgroup)."""
    root = tmp_path / "cgroup"
    _write(root / "cgroup.controllers", "cpuset cpu io memory pids")
    _write(root / own.lstrip("/") / "cpu.max", cpu_max)
    if parent_cpu_max is not None:
        _write((root / own.lstrip("/")).parent / "cpu.max", parent_cpu_max)
    proc = tmp_path / "proc-self-cgroup"
    _write(proc, f"0::{own}")
    return root, proc


def cgroup_v1(tmp_path: Path, quota_us: int, period_us: int = 100000, own: str = "/",
              unified: bool = False) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    cpu = root / "cpu,cpuacct" / own.lstrip("/")
    _write(cpu / "cpu.cfs_quota_us", str(quota_us))
    _write(cpu / "cpu.cfs_period_us", str(period_us))
    lines = ["12:memory:" + own, "4:cpu,cpuacct:" + own, "3:cpuset:" + own]
    if unified:  # the hybrid layout: an unified hierarchy without the cpu controller beside v1
        _write(root / "unified" / "cgroup.procs", "1")
        lines.append("0::" + own)
    proc = tmp_path / "proc-self-cgroup"
    _write(proc, "\n".join(lines))
    return root, proc


def test_a_pod_limited_to_4_cpus_on_a_64_core_node_gets_4_threads_cgroup_v2(tmp_path):
    root, proc = cgroup_v2(tmp_path, "400000 100000")
    assert cpus.cgroup_cpu_quota(root, proc) == 4.0
    assert cpus.available_cpus(root, proc, affinity=64) == 4
    assert cpus.threads_per_worker(2, cgroup_root=root, proc_self_cgroup=proc, affinity=64) == 2


def test_cgroup_v1_quota_and_the_hybrid_layout(tmp_path):
    root, proc = cgroup_v1(tmp_path / "v1", 400000)
    assert cpus.available_cpus(root, proc, affinity=64) == 4
    root, proc = cgroup_v1(tmp_path / "hybrid", 150000, unified=True)
    assert cpus.cgroup_cpu_quota(root, proc) == 1.5
    assert cpus.available_cpus(root, proc, affinity=64) == 1


def test_no_quota_leaves_the_affinity_mask(tmp_path):
    root, proc = cgroup_v2(tmp_path / "v2", "max 100000")
    assert cpus.cgroup_cpu_quota(root, proc) is None and cpus.available_cpus(root, proc, affinity=8) == 8
    root, proc = cgroup_v1(tmp_path / "v1", -1)
    assert cpus.cgroup_cpu_quota(root, proc) is None and cpus.available_cpus(root, proc, affinity=8) == 8
    assert cpus.cgroup_cpu_quota(tmp_path / "none", tmp_path / "no-proc-file") is None


def test_a_parent_cgroups_limit_holds_for_its_children(tmp_path):
    # Without a cgroup namespace the process's path is the host's: the pod's limit is on a parent.
    root, proc = cgroup_v2(tmp_path, "max 100000", own="/kubepods/pod1/ctr", parent_cpu_max="300000 100000")
    assert cpus.cgroup_cpu_quota(root, proc) == 3.0


def test_a_host_path_that_is_not_mounted_reads_the_containers_own_cgroup_at_the_root(tmp_path):
    root, proc = cgroup_v2(tmp_path, "200000 100000")
    _write(proc, "0::/kubepods.slice/pod-abc.slice/cri-containerd-123.scope")
    assert cpus.cgroup_cpu_quota(root, proc) == 2.0


def test_a_fraction_of_a_cpu_still_gets_one_thread(tmp_path):
    root, proc = cgroup_v2(tmp_path, "50000 100000")
    assert cpus.available_cpus(root, proc, affinity=64) == 1
    assert cpus.threads_per_worker(4, cgroup_root=root, proc_self_cgroup=proc, affinity=64) == 1


def test_the_launcher_sizes_omp_num_threads_from_the_pods_cpu_limit(tmp_path, monkeypatch):
    """elastic-train in a pod with limits.cpu 4 on a 64-core node: each of 2 workers gets 2 threads."""
    import torch.distributed.launcher.api as launcher_api

    root, proc = cgroup_v2(tmp_path, "400000 100000")
    monkeypatch.setattr(cpus, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpus, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    # elastic-train exports OMP_NUM_THREADS and the run's variables for its workers: into a copy here.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    seen = {}

    def fake_launch(config, entrypoint):
        return lambda *args: seen.update(threads=os.environ["OMP_NUM_THREADS"])

    monkeypatch.setattr(launcher_api, "elastic_launch", fake_launch)
    assert cli.main(["--rdzv-backend", "c10d", "--nproc-per-node", "2", "--checkpoint-dir", str(tmp_path / "c"),
                     "--log-dir", str(tmp_path / "logs"), "--recovery", "restart"]) == 0, sys.stderr
    assert seen == {"threads": "2"}
