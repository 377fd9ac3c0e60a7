"""A task that reports what a worker of the built-in trainer really sees, for tests/test_preload.py
(``elastic-train ... -- --task tests.helpers.preload_probe:build``, ``PROBE_OUT=<folder>`` set).

Each worker writes ``<PROBE_OUT>/rank<RANK>.json`` when its task is built: its process (pid, parent,
session, the parent's command line), its environment as Python sees it and as ``/proc`` shows it,
torch's thread count, and whether a matrix product with those threads finished (it would hang in
a process forked after an OpenMP parallel region). Then it is the tiny task of task_fixture.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch

from tests.helpers import task_fixture


def build(args: argparse.Namespace):
    a = torch.randn(512, 512)
    product = float((a @ a).sum())  # torch's intra-op threads, the worker's count
    parent = os.getppid()
    grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
    report = {
        "pid": os.getpid(), "ppid": parent, "grandparent": grandparent, "sid": os.getsid(0), "pgid": os.getpgid(0),
        "parent_cmdline": Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"),
        "environ": dict(os.environ),
        "proc_environ": Path("/proc/self/environ").read_bytes().decode(errors="replace"),
        "threads": torch.get_num_threads(), "product_finite": product == product,
        "argv": sys.argv, "start_method": multiprocessing.get_start_method(),
    }
    out = Path(os.environ["PROBE_OUT"])
    part = out / f"rank{os.environ['RANK']}.part"
    part.write_text(json.dumps(report))
    part.rename(out / f"rank{os.environ['RANK']}.json")  # whole, for a reader polling for it
    return task_fixture.build(args)
