"""A join's group formed ahead (``training/group_ahead.py``): beside the group in use, then swapped in.

The members of a quorum train on their group while a thread of each forms the next quorum's with a
newcomer (``torch_private.new_default_group`` under the quorum's name, the newcomer making the same
group as its first); at the switch it becomes the default (``install_default_group``) and the old
one is destroyed on a thread. Three real processes on gloo and a real ``TCPStore`` check that the
old group trains while the next one forms, and that after the switch the default group is the new
world's, with a group beside it (``torch_private.new_subgroup``, as a loop's planned groups are
made) formed ahead by one member and at once by the newcomer; the rest is ``GroupAhead``'s
bookkeeping (its thread, a discard while it forms, a failure).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from elastic_trainer.etcd.server import free_port
from elastic_trainer.live.quorum import Member, Quorum
from elastic_trainer.training.group_ahead import GroupAhead, group_name, only_adds

WORKER = textwrap.dedent('''
    import datetime, json, sys, threading, time, weakref
    import torch, torch.distributed as dist
    from elastic_trainer.runtime import exit_without_teardown
    from elastic_trainer.torch_private import install_default_group, new_default_group, new_subgroup
    from elastic_trainer.training.group_ahead import GroupAhead, group_name
    from elastic_trainer.training.process_group import drop_group

    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timeout)
    q1, q2 = dist.PrefixStore("q1/", store), dist.PrefixStore("q2/", store)
    ctl = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timeout)  # the test's own keys: a client is one thread's
    result = {}
    def start(name, target, *args, stop=None):
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        return t
    pairs = [[0, 2], [1]]  # a loop's groups beside the default one (Manager.plan_groups): rank 0 with the newcomer
    mine = next(i for i, g in enumerate(pairs) if rank in g)
    def subgroup():  # made by its own ranks only, under the quorum's name, as the Manager makes a plan's
        return new_subgroup("gloo", q2, pairs[mine], rank, timeout, f"{group_name(2)}/pair/{mine}")
    if rank < 2:  # a member: trains on quorum 1's group while quorum 2's forms ahead
        install_default_group(new_default_group("gloo", q1, rank, 2, timeout, group_name(1)))
        old = weakref.ref(dist.group.WORLD)
        ahead = GroupAhead(None, "test", lambda: (new_default_group("gloo", q2, rank, 3, timeout, group_name(2)),
                                                  subgroup()),  # its group ahead too, while the old default trains
                           lambda box: drop_group(box, start), start)
        ctl.set(f"ahead-started-{rank}", "1")
        steps = 0
        while True:  # steps on the group in use meanwhile, each ending in an agreement (the Manager's):
            t = torch.tensor([1.0, float(ahead.ready and steps >= 2)])  # switch once both have it ready
            dist.all_reduce(t)
            assert t[0].item() == 2, t
            steps += 1
            if t[1].item() == 2:
                break
            time.sleep(0.005)
        made, pair = ahead.take()
        drop_group([install_default_group(made)], start)
        del made
        result["old_steps"] = steps
        deadline = time.monotonic() + 30
        while old() is not None and time.monotonic() < deadline:  # destroyed and dropped on its thread
            time.sleep(0.01)
        result["old_gone"] = old() is None
    else:  # the newcomer: admitted once the members started forming (it forms the same group, its first)
        ctl.wait(["ahead-started-0", "ahead-started-1"])
        install_default_group(new_default_group("gloo", q2, rank, 3, timeout, group_name(2)))
        pair = subgroup()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    p = torch.tensor([float(rank + 1)])
    dist.all_reduce(p, group=pair)
    result.update(pair_sum=p.item(), pair_ranks=dist.get_process_group_ranks(pair), pair_rank=dist.get_rank(pair))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))  # on the default group: the new one
    model(torch.ones(1, 4)).sum().backward()
    result.update(rank=dist.get_rank(), world=dist.get_world_size(), sum=t.item(),
                  grad=model.module.weight.grad.sum().item())
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
    exit_without_teardown(0)  # gloo may abort in the interpreter's teardown after a clean run (runtime.py)
''')


@pytest.mark.timeout(150)
def test_a_group_formed_ahead_beside_the_group_in_use_takes_over_from_it(tmp_path, procs):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    started = [procs.start([sys.executable, str(script), str(r), str(port), str(tmp_path / f"out-{r}.json")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]
    for p in started:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("a worker did not finish within 120 s")
        assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    results = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(3)]
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 6.0 for r in results), results
    assert len({r["grad"] for r in results}) == 1, "DDP on the new group did not average over all three"
    # the group beside the default one, made ahead by member 0 and at once by the newcomer, pairs them
    assert [(r["pair_ranks"], r["pair_rank"], r["pair_sum"]) for r in results] == [
        ([0, 2], 0, 4.0), ([1], 0, 2.0), ([0, 2], 1, 4.0)], results
    for r in results[:2]:
        assert r["old_steps"] >= 3, "the group in use did not train while the next one formed"
        assert r["old_gone"], "the replaced group was not destroyed and dropped"


def _members(*nodes: str) -> tuple[Member, ...]:
    return tuple(Member(f"{n}-0-1", n, 0, "127.0.0.1:1") for n in nodes)


def test_only_a_quorum_that_keeps_every_member_in_its_place_and_adds_ranks_forms_ahead():
    old = Quorum(q=4, members=_members("a", "b"), step=10)
    joined = Quorum(q=5, members=_members("a", "b", "c"), step=10, source=0, receivers=(2,))
    assert only_adds(old, joined)
    assert not only_adds(old, Quorum(q=5, members=_members("a", "c"), step=10, source=0, receivers=(1,)))  # b lost
    assert not only_adds(old, Quorum(q=5, members=_members("b", "a", "c"), step=10, source=0, receivers=(2,)))
    assert not only_adds(old, Quorum(q=5, members=_members("a", "b", "c"), step=10, source=1,
                                     receivers=(0, 2)))  # a member behind: it needs the state too
    assert not only_adds(old, Quorum(q=5, members=_members("a", "b"), step=10))  # nothing added
    assert group_name(5) != group_name(4)


def _start(name, target, *args, stop=None):
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    t.start()
    return t


def test_a_group_discarded_while_it_forms_is_dropped_once_its_making_returns():
    release, dropped, made = threading.Event(), [], object()

    def make():
        release.wait(10)
        return made

    ahead = GroupAhead(Quorum(q=2, members=_members("a")), "test", make, lambda box: dropped.append(list(box)),
                       _start)
    assert not ahead.ready and not ahead.failed
    ahead.discard()
    assert dropped == []  # still forming: nothing to drop yet
    release.set()
    deadline = time.monotonic() + 10
    while not dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped == [[made]] and not ahead.ready


def test_a_group_that_could_not_form_ahead_is_failed_and_take_says_why():
    def make():
        raise RuntimeError("a member was lost")

    ahead = GroupAhead(Quorum(q=2, members=_members("a")), "test", make, lambda box: None, _start)
    with pytest.raises(RuntimeError, match="not formed ahead") as info:
        ahead.take()
    assert ahead.failed and not ahead.ready
    assert "a member was lost" in str(info.value.__cause__)


def test_the_group_made_ahead_is_handed_over_once():
    made = object()
    ahead = GroupAhead(Quorum(q=2, members=_members("a")), "test", lambda: made, lambda box: None, _start)
    assert ahead.take() is made
    with pytest.raises(RuntimeError):
        ahead.take()
