"""Leaving a process group: its backend's destructor runs on the thread it is handed to, not on the re-form's.

gloo's destructor takes 20 ms every time (its event loops wake every 10 ms to see that they must
end), and whoever drops the group's last reference pays it: it was the whole of a re-form's
teardown. ``leave_process_group(start_thread)`` destroys the group and hands that reference to a
thread (``drop-old-group``, the runtime's in a worker)."""

from __future__ import annotations

import weakref

import pytest
import torch.distributed as dist

from elastic_trainer.training.process_group import leave_process_group


def test_the_old_groups_destructor_runs_on_the_thread_it_is_handed_to():
    if dist.is_initialized():
        pytest.skip("a process group is up in this process already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    old = weakref.ref(dist.group.WORLD)
    handed: list = []
    leave_process_group(lambda name, target, *args: handed.append((name, target, args)))
    assert not dist.is_initialized()
    assert [name for name, _, _ in handed] == ["drop-old-group"]
    assert old() is not None, "the group went on the caller's thread"
    _, target, args = handed.pop()
    target(*args)  # the thread's body: drops the last reference
    assert old() is None, "the handed-over reference was not the group's last"


def test_without_a_thread_the_group_goes_at_once():
    if dist.is_initialized():
        pytest.skip("a process group is up in this process already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    old = weakref.ref(dist.group.WORLD)
    leave_process_group()
    assert not dist.is_initialized() and old() is None



WARMED = """
import sys
import torch, torch.distributed as dist
from elastic_trainer.training.process_group import warm_up_ddp
warm_up_ddp()
assert not dist.is_initialized(), "the warm-up made a process group"
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = set(sys.modules)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
print(len(set(sys.modules) - before))
"""


def test_the_warm_up_imports_what_ddps_first_construction_would_and_makes_no_group():
    """``warm_up_ddp`` (a live worker's, before it asks to be admitted): afterwards DDP's first
    construction imports nothing more (without it, ~800 modules), and it made no group on the way."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", WARMED], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == 0, "DDP's first construction still imported modules"
