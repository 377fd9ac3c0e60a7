"""The Manager's public API outside a live run, the typed worker environment, and the examples and
docs of a user's loop (the live path itself, with real agents, etcd and SIGKILLs, is
tests/test_live_recovery.py; how the launcher chooses live recovery for a user's own script is
tests/test_recovery_mode.py)."""

from __future__ import annotations

import ast
import difflib
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from elastic_trainer import ElasticSampler, records
from elastic_trainer.env import ENV_LIVE, EXIT_EXCLUDED, LiveSettings, WorkerEnv
from elastic_trainer.rendezvous.options import RendezvousOptions
from elastic_trainer.live.quorum import LiveExcluded
from elastic_trainer.training.manager import Manager
from tests.helpers.common import REPO

EXAMPLES = REPO / "examples"


def test_worker_env_round_trips_through_the_environment_and_ignores_what_is_not_a_number():
    env = WorkerEnv(rank=1, world_size=4, local_rank=1, local_world_size=2, restart_count=3, rdzv_round=0,
                    rdzv_prefix="/p/run/", rdzv_node="host_1_2", rdzv_conn='{"endpoints": "e:1"}',
                    rdzv_endpoint="e:1", live=LiveSettings(min_nodes=2, max_nodes=3, report_timeout=2.0))
    environ = env.to_environ()
    assert environ["RANK"] == "1" and environ["ELASTIC_TRAINER_RDZV_ROUND"] == "0"
    assert WorkerEnv.from_environ(environ) == env
    assert WorkerEnv.from_environ({"RANK": "x", "WORLD_SIZE": ""}) == WorkerEnv()
    assert not WorkerEnv.from_environ({"RANK": "0"}).launched
    assert WorkerEnv.from_environ({ENV_LIVE: '{"min_nodes": 2, "from_a_newer_version": 1}'}).live == \
        LiveSettings(min_nodes=2)
    with pytest.raises(ValueError, match=ENV_LIVE):
        WorkerEnv.from_environ({ENV_LIVE: "{not json"})


def test_the_live_settings_defaults_are_the_rendezvous_options_defaults():
    d, live = RendezvousOptions.DEFAULTS, LiveSettings()
    assert (d["join_timeout"], d["last_call_timeout"], d["report_timeout"], d["lease_ttl"],
            d["keep_alive_interval"]) == (live.join_timeout, live.last_call, live.report_timeout, live.lease_ttl,
                                          live.keep_alive_interval)


def test_a_manager_outside_a_live_run_is_plain_agrees_alone_and_never_reforms():
    """Not launched (no torchrun environment): no group, no quorum; the agreement is the loop's own
    values; a failure is not recovered (``run`` re-raises) and ``reform`` says why it cannot."""
    manager = Manager(env=WorkerEnv())
    manager.start()
    assert not manager.live and not manager.distributed and not manager.newcomer
    assert manager.receive_state() is None and manager.fence is None
    manager.before_step()
    assert manager.run(lambda: 7) == (7, None)  # run counts the step
    assert manager.agree_due() and manager.agree_due()  # the first step agrees; asking twice changes nothing
    agreed = manager.agree([1.5, 2.0], interval=3)
    assert agreed.values == [1.5, 2.0] and not agreed.reform and agreed.next_in == 3
    due = []
    for _ in range(3):
        manager.run(lambda: None)
        due.append(manager.agree_due())
    assert due == [False, False, True]
    with pytest.raises(RuntimeError, match="gloo"):
        manager.run(lambda: (_ for _ in ()).throw(RuntimeError("gloo: connection closed by peer")))
    with pytest.raises(RuntimeError, match="needs live recovery"):
        manager.reform(0, "test")
    manager.close()


# ---- a user's loop, in one process (plain mode: not launched, no process group) ----------------------
def _loop_parts(samples: int = 96, batch: int = 12):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 4), torch.randn(samples, 1))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return data, model, opt, ElasticSampler(len(data), batch, 0, 1, seed=0)


def test_a_plain_loop_steps_commits_its_sampler_logs_its_steps_and_stops_by_agreement(tmp_path):
    """The one way to write the loop, outside a live run: ``start`` hands back the model (no
    wrapper without a group), ``step`` runs the step and commits the sampler's step (its position
    goes on where the loop is), the Manager writes the step log and events, ``stop`` ends every
    loader at the next agreement, ``finish`` writes the last event."""
    data, model, opt, sampler = _loop_parts()
    manager = Manager(env=WorkerEnv(), log_dir=str(tmp_path))
    loader = manager.loader(torch.utils.data.DataLoader(data, batch_sampler=sampler))
    ddp = manager.start(model, lambda m: pytest.fail("no wrapper without a process group"), optimizer=opt)
    assert ddp is not None and ddp.module is model and list(ddp.parameters()) == list(model.parameters())

    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    seen = []
    for epoch in range(sampler.epoch, 2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            seen.append(x)
            assert isinstance(manager.step(train_step, x, y), float)
    assert manager.steps == 16 and (sampler.epoch, sampler.offset) == (2, 0)
    assert torch.equal(torch.cat(seen[:8]).sort(0).values, data.tensors[0].sort(0).values), "each sample once an epoch"
    manager.stop()
    for epoch in range(sampler.epoch, 100):  # agreed at the next agreement (at most 32 steps on)
        sampler.set_epoch(epoch)
        for x, y in loader:
            manager.step(train_step, x, y)
    assert manager.stopped and 16 < manager.steps <= 16 + 32 and list(loader) == []
    manager.finish()
    steps = records.read_steps(tmp_path)
    assert [s.step for s in steps] == list(range(1, manager.steps + 1))
    assert all(s.loss_scope == "rank" and s.loss is not None for s in steps)
    assert [(s.epoch, s.offset) for s in steps[:9]] == [(0, 12 * k) for k in range(1, 8)] + [(1, 0), (1, 12)]
    assert [e.event for e in records.read_events(tmp_path)] == ["start", "stopped"]


def test_after_a_reform_the_loader_gives_the_lost_step_again_cut_for_the_new_world():
    """What a re-form does to a loop's data (``ElasticLoader``): the step that did not complete
    comes again from the committed position, as the new world splits it; a received position in
    the next epoch ends the epoch's iteration (nothing is repeated or skipped)."""
    data, _, _, sampler = _loop_parts(samples=48, batch=12)
    manager = Manager(env=WorkerEnv())
    loader = manager.loader(torch.utils.data.DataLoader(data, batch_sampler=sampler))
    it = iter(loader)
    first = next(it)
    sampler.commit_step()  # step 1 done; step 2's batch is drawn, then lost to a re-form
    next(it)
    sampler.reshard(1, 3)  # rank 1 of 3 now
    loader.regrouped()
    redo = loader.redo()
    expected = sampler.micro_batches_at(12)[0]  # step 2 as rank 1 of 3 cuts it
    assert torch.equal(redo[0], data.tensors[0][expected]) and len(expected) == 4
    assert not torch.equal(redo[0], first[0])
    sampler.commit_step()
    assert torch.equal(next(it)[0], data.tensors[0][sampler.micro_batches_at(24)[0]])  # step 3 goes on
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 1, "offset": 0})  # a peer is in the next epoch
    loader.regrouped()
    assert list(it) == [] and loader.redo() is None


def test_the_loader_refuses_what_would_not_be_one_batch_per_step():
    data, _, _, sampler = _loop_parts()
    manager = Manager(env=WorkerEnv())
    with pytest.raises(ValueError, match="batch_sampler=sampler"):
        manager.loader(torch.utils.data.DataLoader(data, sampler=sampler))
    split = ElasticSampler(len(data), 12, 0, 1, micro_batch_size=4)
    with pytest.raises(ValueError, match="micro_batch_size=None"):
        manager.loader(torch.utils.data.DataLoader(data, batch_sampler=split))


def test_leaving_the_with_block_raises_and_the_runtime_turns_it_into_the_exit_code(tmp_path):
    """``Manager.__exit__`` never ends the process: the exception goes on up (the loop's ``finally``
    runs); once it leaves the program uncaught the worker runtime ends it with the code it maps
    (``exit_on_uncaught``: the Manager maps ``LiveExcluded`` to ``EXIT_EXCLUDED`` in a live run)."""
    with pytest.raises(LiveExcluded):
        with Manager(env=WorkerEnv()):
            raise LiveExcluded("left out of quorum 7")
    marker = tmp_path / "finally-ran"
    script = (f"from elastic_trainer.env import EXIT_EXCLUDED\n"
              f"from elastic_trainer.live.quorum import LiveExcluded\n"
              f"from elastic_trainer.runtime import runtime\n"
              f"runtime().exit_on_uncaught(LiveExcluded, EXIT_EXCLUDED)\n"
              f"try:\n    raise LiveExcluded('left out')\n"
              f"finally:\n    open({str(marker)!r}, 'w').write('yes')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_EXCLUDED and marker.read_text() == "yes", proc.stderr
    assert "Traceback" not in proc.stderr and "LiveExcluded: left out" in proc.stderr
    other = subprocess.run([sys.executable, "-c", script.replace("raise LiveExcluded('left out')", "1 / 0")],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and "ZeroDivisionError" in other.stderr  # the previous hook's traceback


# ---- the examples and the docs ----------------------------------------------------------------------
def code_lines(path: Path) -> list[str]:
    """A script's lines without its module docstring, comments and blank lines."""
    text = path.read_text()
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    body = ast.parse(text).body
    doc = range(body[0].lineno, body[0].end_lineno + 1) if body and isinstance(body[0], ast.Expr) else range(0)
    return [line.rstrip() for i, line in enumerate(lines, 1) if i not in doc and line.strip()]


def changed_lines(a: list[str], b: list[str]) -> int:
    """Lines that differ between ``a`` and ``b``: a line replaced by another counts once."""
    ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def test_the_live_example_is_the_plain_ddp_script_with_at_most_eight_lines_changed():
    plain, live = code_lines(EXAMPLES / "plain_ddp.py"), code_lines(EXAMPLES / "own_loop.py")
    diff = "\n".join(difflib.unified_diff(plain, live, "plain_ddp.py", "own_loop.py", lineterm="", n=0))
    assert changed_lines(plain, live) <= 8, diff
    assert "for x, y in loader:" in [line.strip() for line in live], "the loop keeps its shape"


def test_the_usage_doc_shows_the_examples_diff_as_it_is():
    """docs/usage.md's ``diff`` block is the examples' diff: its - and + lines are the code lines
    plain_ddp.py has and own_loop.py has not, and the reverse (comments aside)."""
    plain, live = code_lines(EXAMPLES / "plain_ddp.py"), code_lines(EXAMPLES / "own_loop.py")
    ops = difflib.SequenceMatcher(a=plain, b=live, autojunk=False).get_opcodes()
    removed = [line.strip() for tag, i1, i2, _, _ in ops if tag != "equal" for line in plain[i1:i2]]
    added = [line.strip() for tag, _, _, j1, j2 in ops if tag != "equal" for line in live[j1:j2]]
    block = re.search(r"```diff\n(.*?)```", (REPO / "docs" / "usage.md").read_text(), re.S)
    assert block, "docs/usage.md shows the examples' diff in a ```diff block"
    shown = [line for line in block[1].splitlines() if line[:1] in "+-"]
    strip = lambda line: line[1:].split("  #")[0].strip()  # noqa: E731 - the doc's comments aside
    assert [strip(x) for x in shown if x[0] == "-"] == removed
    assert [strip(x) for x in shown if x[0] == "+"] == added


def test_the_manager_reference_names_every_public_name():
    text = (REPO / "docs" / "manager.md").read_text()
    names = {n for n in dir(Manager) if not n.startswith("_")} | {"device", "env", "max_seconds"}
    missing = sorted(n for n in names if f"`{n}" not in text and f"{n}`" not in text and f"`{n}(" not in text)
    assert missing == [], f"docs/manager.md does not name {missing}"
